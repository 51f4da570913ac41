"""The KV-cache-aware disaggregated router: pure decisions over a worker pool (no I/O, no clock).

Usage (the server adapter owns sockets, tokenizer and clock)::

    router = Router(spec.router, block_size_tokens=spec.engine.block_size_tokens)
    router.add_worker("prefill-0", "prefill"); router.add_worker("decode-0", "decode")
    router.apply_kv_events("prefill-0", decode_payload(frame).events, now_s)   # from each worker's ZMQ
    d = router.route("req-1", token_ids=ids, now_s=now)      # -> RouteDecision
    ... send to d.prefill_worker (or prefill locally on d.decode_worker when it is None) ...
    router.on_first_token("req-1"); router.on_complete("req-1")

Conditional disaggregation (``route``): the decode worker is chosen among decode-capable workers — with
the configured policy when there is no prefill pool (aggregated workers; ``kv_aware`` then counts their
decode load beyond the pool mean plus the mean of the other workers with at least :data:`AGGREGATED_DECODE_WEIGHT`), else with the same policy
re-weighted for decode (``decode_weight >= 1``: active KV blocks plus its own cache and local prefill
queue, the "load and own cache" choice). The prompt is prefilled *locally* on it when

1. there is no prefill pool (``reason="local_no_prefill_pool"``: aggregated workers), or
2. the uncached part on the decode worker is shorter than ``disagg_min_uncached_tokens`` (default 512,
   ``local_short``): below ~512 tokens a 70B-class prefill on H100 is weight-read bound (a 512-token
   prefill costs about as long as one decode step reading all weights, runtime/perf roofline), so a
   remote prefill saves the decode worker almost nothing while adding a NIXL transfer and a second
   queue; vLLM's chunked prefill (default ``max_num_batched_tokens`` 512-2048) also folds such chunks
   into decode steps, and Dynamo's disaggregated router uses the same kind of threshold
   (``max_local_prefill_length``), or
3. the prefill pool is saturated: the chosen prefill worker already queues more than
   ``disagg_max_prefill_queue_tokens`` (default 32,768 ≈ 1-2 s of 70B TP8 prefill on H100 at the
   roofline's ~20-30k tokens/s, i.e. the order of a TTFT SLO; ``local_prefill_saturated``),

otherwise the prefill worker is picked by the policy among ``prefill`` workers (``remote``).

Routing only ever returns ids added with :meth:`Router.add_worker`; nothing in a request can name a
backend.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from runtime.config import RouterSpec
from runtime.kv.apply import ApplyStats, KvEventApplier
from runtime.kv.events import OFFLOAD_MEDIA, KvEvent
from runtime.kv.hashing import block_hashes as _block_hashes
from runtime.kv.hashing import request_extra_keys
from runtime.kv.index import PrefixIndex
from runtime.kv.tiers import offload_hits
from runtime.router.load import ROLES, WorkerLoad
from runtime.router.policies import uncached_tokens, make_policy


#: Most prompt tokens hashed per request for prefix matching (Llama-3.1's 128k context). Hashing is
#: ~175 ns/token on the event loop (8M tokens blocked it 1.4 s); a longer prompt is still charged its full
#: length, only its prefix beyond this is never matched or learned.
MAX_HASHED_PROMPT_TOKENS = 131_072

#: Least kv_aware ``decode_weight`` on an *aggregated* pool (role ``both``, no prefill workers), applied to
#: each worker's active decode tokens beyond the pool mean plus the mean of the other workers (weight relative to one uncached prefill
#: token of the prompt). There a worker prefills *and* decodes; with weight 0 a shared 2,048-token prefix
#: kept 3,841 of 4,000 requests on one of four workers while the others idled. The right weight is the
#: decode interference of a context token over a request's life against one prefill token: ~0.01-0.2 for a
#: 70B model on 8×H100 (KV reads of ~12 ns per token per step), more for small models, whose decode is
#: KV-bound; raise ``RouterSpec.decode_weight`` to spread more. Chosen on bench/router.py (Mooncake, 16×70B
#: TP8, whose TTFT has no decode interference, so it only shows the price of spreading): pricing all decode
#: load at 0.05 cost 1.9 % hit rate, the excess over the mean 0.2 %; beyond twice the mean it costs nothing
#: (kv_aware hit 0.5755 → 0.5789, mean TTFT 0.615 → 0.609 s), the figures moving by ~±1 % with any change.
AGGREGATED_DECODE_WEIGHT = 0.05


class NoWorkersError(RuntimeError):
    """No worker of the needed role is in the pool (or all are excluded)."""


class MigrationLimitError(RuntimeError):
    """A request's decode worker failed more often than ``RouterSpec.migration_limit`` allows."""


class UnknownRequestError(KeyError):
    """The request id is not in flight."""


class RouteDecision(NamedTuple):
    """Where one request goes (immutable; a NamedTuple because it is built on every request).

    Attributes:
        request_id: the caller's id.
        prefill_worker: worker that prefills remotely, or ``None`` = prefill locally on ``decode_worker``.
        decode_worker: worker that decodes (and prefills when ``prefill_worker`` is None).
        overlap_blocks: cached prefix blocks the router predicts on the worker that prefills.
        num_prompt_blocks: full blocks of the prompt, at least 1: the KV blocks its decode worker is charged
            (`WorkerLoad.decode_blocks`).
        uncached_tokens: prompt tokens the prefilling worker must compute (prediction).
        reason: ``remote``, ``local_no_prefill_pool``, ``local_short``, ``local_prefill_saturated``,
            ``local_prefill_failed`` or ``migrated``.
        offload_blocks: of ``overlap_blocks``, those the worker loads from a KV offload tier (CPU, storage)
            rather than holds on the GPU (0 unless the router credits tiers, ``tier_load_cost``).
    """

    request_id: str
    prefill_worker: str | None
    decode_worker: str
    overlap_blocks: int
    num_prompt_blocks: int
    uncached_tokens: int
    reason: str
    offload_blocks: int = 0


def _held_blocks(prompt_blocks: int) -> int:
    """KV blocks a decoding request is charged on its decode worker: its prompt's full blocks, and at least one
    (its tokens, prompt and output, sit in one block at least). Charged none, requests with prompts under a block
    would tie on every decode worker and go wherever the tie-break sends them, all of them to one worker."""
    return max(1, prompt_blocks)


@dataclass(slots=True)
class _InFlight:
    # WorkerLoad objects, not ids: a worker removed and re-added under the same id is a new object,
    # so releasing an old request never touches the new worker's counters
    prefill: WorkerLoad | None
    decode: WorkerLoad
    prefill_tokens: int
    decode_blocks: int
    prefill_work: float
    hashes: Sequence[Hashable]
    num_tokens: int
    prefill_done: bool = False
    # approximate mode: blocks this request newly taught the index about its prefiller, and their expiry
    learned: list[Hashable] | None = None
    learned_until_s: float = 0.0
    num_migrations: int = 0
    excluded: set[str] = field(default_factory=set)

    @property
    def prefiller(self) -> WorkerLoad:
        return self.prefill or self.decode

    @property
    def prefill_worker(self) -> str | None:
        return None if self.prefill is None else self.prefill.worker_id

    @property
    def decode_worker(self) -> str:
        return self.decode.worker_id


class Router:
    """KV-aware, load-aware, disaggregation-aware request router.

    Args:
        spec: router settings (policy name, weights, thresholds).
        block_size_tokens: the workers' KV block size (vLLM ``--block-size``), tokens.
        seed: seed of the policy's tie-breaking / sampling RNG.
        prefill_cost: ``(num_prompt_tokens, cached_tokens) -> work`` of one prefill on a worker of the
            pool, e.g. ``runtime.sim.timing.PerfTiming(perf_model, tp).prefill_s`` (seconds, includes the
            new tokens' attention over the cached prefix and per-request overhead); default: uncached
            tokens. ``kv_aware`` compares queues and balances long-run busy time in this unit.
        tier_load_cost: ``{medium: work of loading one token}`` from each KV offload tier (``"CPU"``,
            ``"STORAGE"``), in ``prefill_cost``'s unit, e.g. ``runtime.kv.tiers.load_s_per_token`` with a
            seconds ``prefill_cost``. The router always indexes the tiers' KV events (``self.tiers``); only
            media given here are credited by :meth:`route` (``kv_aware``: a tier hit saves its prefill and
            costs its load); other policies, media without a cost, and the re-decisions of
            :meth:`fallback_local_prefill` / :meth:`migrate` count device hits only.

    Raises:
        runtime.router.policies.UnknownPolicyError: when ``spec.policy`` is not registered.
    """

    def __init__(self, spec: RouterSpec, block_size_tokens: int, *, seed: int = 0,
                 prefill_cost: Callable[[int, int], float] | None = None,
                 tier_load_cost: Mapping[str, float] | None = None) -> None:
        if block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be > 0, got {block_size_tokens}")
        self.spec = spec
        self.block_size_tokens = block_size_tokens
        self.prefill_cost = prefill_cost or uncached_tokens
        self.policy = make_policy(spec.policy, temperature=spec.temperature,
                                  overlap_weight=spec.overlap_weight, decode_weight=spec.decode_weight,
                                  balance_weight=spec.balance_weight, prefill_cost=self.prefill_cost,
                                  seed=seed)
        # decode pool of a disaggregated deployment: by load (active KV) and its own cache
        self.decode_policy = make_policy(spec.policy, temperature=spec.temperature,
                                         overlap_weight=spec.overlap_weight,
                                         decode_weight=max(1.0, spec.decode_weight),
                                         balance_weight=spec.balance_weight, prefill_cost=self.prefill_cost,
                                         seed=seed + 1)
        # aggregated pool (no prefill workers): each worker prefills *and* decodes, so its decode load counts
        self.aggregated_policy = make_policy(spec.policy, temperature=spec.temperature,
                                             overlap_weight=spec.overlap_weight,
                                             decode_weight=max(AGGREGATED_DECODE_WEIGHT, spec.decode_weight),
                                             balance_weight=spec.balance_weight,
                                             prefill_cost=self.prefill_cost, seed=seed, decode_excess=True)
        self.index = PrefixIndex()
        self._pending = PrefixIndex()  # blocks of routed requests whose prefill has not finished
        self._track_pending = bool(self.policy.uses_inflight_overlap and spec.inflight_overlap)
        #: ``{medium: index}`` of the workers' KV offload tiers (from KV events' ``medium``)
        self.tiers: dict[str, PrefixIndex] = {m: PrefixIndex() for m in OFFLOAD_MEDIA}
        for m, c in (tier_load_cost or {}).items():
            if m not in self.tiers or not c >= 0:
                raise ValueError(f"tier_load_cost: medium {m!r} must be one of {OFFLOAD_MEDIA} with a cost >= 0, "
                                 f"got {c!r}")
        self._tier_cost = {m: float(c) for m, c in (tier_load_cost or {}).items()}
        self._credited = {m: self.tiers[m] for m in OFFLOAD_MEDIA if m in self._tier_cost}
        self._applier = KvEventApplier(self.index, block_size_tokens, tiers=self.tiers)
        self._loads: dict[str, WorkerLoad] = {}
        self._decoders: list[WorkerLoad] = []
        self._prefillers: list[WorkerLoad] = []
        self._num_approx = 0
        self._requests: dict[str, _InFlight] = {}
        # removed workers whose in-flight requests still hold their load (they run on where they were sent):
        # a worker that comes back under its id (a readiness probe that flapped) takes its load back
        self._departed: dict[str, WorkerLoad] = {}

    # ------------------------------------------------------------------ pool
    def add_worker(self, worker_id: str, role: str, *, kv_events: bool = True,
                   kv_capacity_blocks: int | None = None) -> None:
        """Add a worker to the pool.

        Args:
            worker_id: unique id (the adapter maps it to an address).
            role: ``prefill``, ``decode`` or ``both`` (aggregated).
            kv_events: False for workers that publish no KV events: the router then learns their cache
                from its own decisions, entries expiring after ``spec.approx_ttl_s``.
            kv_capacity_blocks: the worker's KV capacity; bounds its learned entries (approximate mode).

        A worker that comes back under the id of one removed while requests it was serving are still in
        flight (discovery saw its readiness flap: those requests run on) takes their load back, so that it is
        not taken for idle. Its KV index entry starts empty either way.

        Raises:
            ValueError: on an unknown role or an id already in the pool.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if worker_id in self._loads:
            raise ValueError(f"worker {worker_id!r} is already in the pool")
        self._forget_departed()
        load = self._departed.pop(worker_id, None)
        if load is not None and load.role == role:  # back with requests still on it: their load is its load
            load.kv_events, load.available = kv_events, True
        else:
            load = WorkerLoad(worker_id, role, kv_events=kv_events)
            if self._loads:  # a newcomer starts at the pool's mean cumulative work, not at 0 (no flood)
                load.total_prefill_work = sum(w.total_prefill_work for w in self._loads.values()) / len(self._loads)
        self._loads[worker_id] = load
        self.index.add_worker(worker_id, approx_capacity_blocks=None if kv_events else kv_capacity_blocks)
        for t in self.tiers.values():
            t.add_worker(worker_id)
        self._pending.add_worker(worker_id)
        self._num_approx += 0 if kv_events else 1
        self._rebuild_pools()

    def remove_worker(self, worker_id: str) -> list[str]:
        """Remove a dead/drained worker: it leaves the index and can no longer be chosen.

        Returns:
            ids of in-flight requests that used it (the adapter falls back / migrates them with
            :meth:`fallback_local_prefill` or :meth:`migrate`). Unknown ids return ``[]``.
        """
        load = self._loads.pop(worker_id, None)
        if load is None:
            return []
        self.index.remove_worker(worker_id)
        for t in self.tiers.values():
            t.remove_worker(worker_id)
        self._pending.remove_worker(worker_id)
        self._applier.forget_worker(worker_id)
        self._num_approx -= 0 if load.kv_events else 1
        self._rebuild_pools()
        users = [rid for rid, r in self._requests.items() if r.prefill is load or r.decode is load]
        self._forget_departed()
        if users:
            self._departed[worker_id] = load
        return users

    def _forget_departed(self) -> None:
        """Drop the departed workers no in-flight request holds any more."""
        if not self._departed:
            return
        held = {id(w) for r in self._requests.values() for w in (r.prefill, r.decode) if w is not None}
        self._departed = {k: w for k, w in self._departed.items() if id(w) in held}

    def suspend_worker(self, worker_id: str) -> list[str]:
        """Stop choosing a worker that failed a health check, keeping its index entry and load counters.

        Its KV events still apply and its in-flight requests still release their load; a worker that comes
        back after a missed health check still holds its cache (vLLM never re-reports blocks it holds, so a
        dropped entry could not be rebuilt). A real restart clears the entry through the KV-event path
        (sequence reset / ``AllBlocksCleared``); :meth:`remove_worker` drops it for good.

        Returns:
            ids of in-flight requests that use it (as :meth:`remove_worker`); ``[]`` for unknown or
            already suspended workers.
        """
        load = self._loads.get(worker_id)
        if load is None or not load.available:
            return []
        load.available = False
        self._rebuild_pools()
        return [rid for rid, r in self._requests.items() if r.prefill is load or r.decode is load]

    def resume_worker(self, worker_id: str) -> bool:
        """Route to a suspended worker again (index entry as kept). Returns False when it was not suspended."""
        load = self._loads.get(worker_id)
        if load is None or load.available:
            return False
        load.available = True
        self._rebuild_pools()
        return True

    def _rebuild_pools(self) -> None:
        self._decoders = [w for w in self._loads.values() if w.can_decode and w.available]
        self._prefillers = [w for w in self._loads.values() if w.role == "prefill" and w.available]

    @property
    def workers(self) -> dict[str, WorkerLoad]:
        """Current pool: ``{worker_id: WorkerLoad}`` (read-only view by convention)."""
        return self._loads

    # ------------------------------------------------------------------ events
    def apply_kv_events(self, worker_id: str, events: Iterable[KvEvent], now_s: float) -> ApplyStats:
        """Apply decoded vLLM KV events of one worker (see runtime/kv/apply.py).

        Events of a worker not in the pool (it may have just been removed) or added with
        ``kv_events=False`` (its cache is learned from decisions instead) are ignored.

        Raises:
            runtime.kv.apply.KvEventError: on a block-size mismatch.
        """
        w = self._loads.get(worker_id)
        if w is None or not w.kv_events:
            return ApplyStats()
        return self._applier.apply(worker_id, events)

    def hashes_for(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The router's chained block hashes of a prompt (salted like vLLM when ``cache_salt`` is given)."""
        bs = self.block_size_tokens
        return _block_hashes(token_ids, bs, extra_keys=request_extra_keys(len(token_ids) // bs, cache_salt))

    def overlaps(self, hashes: Sequence[Hashable]) -> dict[str, int]:
        """``{worker_id: cached prefix blocks}`` from KV events (and learned entries) only."""
        return self.index.match(hashes)

    # ------------------------------------------------------------------ routing
    def route(self, request_id: str, *, now_s: float, token_ids: Sequence[int] | None = None,
              block_hashes: Sequence[Hashable] | None = None,
              num_prompt_tokens: int | None = None, cache_salt: str | None = None) -> RouteDecision:
        """Decide prefill and decode workers for one request and account its load.

        Args:
            request_id: unique among in-flight requests.
            now_s: current time, seconds (any monotonic origin; used for approximate-entry TTLs).
            token_ids: the prompt's token ids (exactly one of ``token_ids`` / ``block_hashes``); only the
                first :data:`MAX_HASHED_PROMPT_TOKENS` are hashed for prefix matching.
            block_hashes: precomputed chained block hashes (e.g. Mooncake ``hash_ids``); ``[]`` with
                ``num_prompt_tokens`` routes a prompt the caller could not tokenize (load only, no
                prefix matching).
            num_prompt_tokens: prompt length, tokens; default ``len(token_ids)`` or
                ``len(block_hashes) * block_size_tokens``. Decode load is charged for
                ``max(len(hashes), num_prompt_tokens // block_size_tokens)`` blocks.
            cache_salt: the request's vLLM ``cache_salt`` (with ``token_ids``): its blocks are hashed
                salted, as the workers' KV events report them (runtime.kv.hashing.request_extra_keys), so
                it matches only blocks cached under the same salt.

        Raises:
            ValueError: duplicate ``request_id`` or not exactly one of token_ids/block_hashes.
            NoWorkersError: no decode-capable worker in the pool.
        """
        if (token_ids is None) == (block_hashes is None):
            raise ValueError("route() needs exactly one of token_ids or block_hashes")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        bs = self.block_size_tokens
        hashes, num_tokens = self._prompt(token_ids, block_hashes, num_prompt_tokens, cache_salt)
        if not self._decoders:
            raise NoWorkersError("no decode-capable worker (role decode or both) in the pool")
        if self._num_approx:
            self.index.expire(now_s)
        overlaps = self._overlaps(hashes)
        policy = self.policy
        device = overlaps
        tier_hits: dict[str, dict[str, int]] = {}
        load_work: dict[str, float] | None = None
        if self._credited and getattr(policy, "credits_tiers", False):
            tier_hits = offload_hits(self._credited, hashes, device, self._loads)
            if tier_hits:
                overlaps = dict(device)
                load_work = {}
                for w, counts in tier_hits.items():
                    overlaps[w] = device.get(w, 0) + sum(counts.values())
                    load_work[w] = sum(n * bs * self._tier_cost[m] for m, n in counts.items())
        nb = max(len(hashes), num_tokens // bs)
        decode_policy = self.decode_policy if self._prefillers else self.aggregated_policy
        decode = self._choose(decode_policy, self._decoders, overlaps, nb, num_tokens, load_work)
        local_uncached = max(0, num_tokens - overlaps.get(decode, 0) * bs)
        prefill: str | None = None
        if not self._prefillers:
            reason = "local_no_prefill_pool"
        elif local_uncached < self.spec.disagg_min_uncached_tokens:
            reason = "local_short"
        else:
            p = self._choose(policy, self._prefillers, overlaps, nb, num_tokens, load_work)
            if self._loads[p].prefill_tokens > self.spec.disagg_max_prefill_queue_tokens:
                reason = "local_prefill_saturated"
            else:
                prefill, reason = p, "remote"
        prefiller = prefill or decode
        # vLLM always recomputes the last prompt token, so a full-prompt hit is one block short
        overlap = min(overlaps.get(prefiller, 0), max(0, (num_tokens - 1) // bs))
        offload = max(0, overlap - device.get(prefiller, 0))
        uncached = max(0, num_tokens - overlap * bs)
        loads = self._loads
        work = self.prefill_cost(num_tokens, num_tokens - uncached) if num_tokens > 0 else 0.0
        if offload and load_work:  # the loaded part of the overlap (the cap may trim the tier run's tail)
            work += load_work[prefiller] * offload / sum(tier_hits[prefiller].values())
        self._charge(request_id, _InFlight(loads[prefill] if prefill else None, loads[decode], uncached,
                                           _held_blocks(nb), work, hashes, num_tokens), now_s)
        return RouteDecision(request_id, prefill, decode, overlap, _held_blocks(nb), uncached, reason, offload)

    def _choose(self, policy, candidates: Sequence[WorkerLoad], overlaps: Mapping[str, int], nb: int,
                num_tokens: int, load_work: Mapping[str, float] | None):
        if load_work:
            return policy.choose(candidates, overlaps, nb, num_tokens, self.block_size_tokens, load_work=load_work)
        return policy.choose(candidates, overlaps, nb, num_tokens, self.block_size_tokens)

    def _prompt(self, token_ids: Sequence[int] | None, block_hashes: Sequence[Hashable] | None,
                num_prompt_tokens: int | None, cache_salt: str | None = None) -> tuple[Sequence[Hashable], int]:
        bs = self.block_size_tokens
        if token_ids is not None:
            cap = MAX_HASHED_PROMPT_TOKENS - MAX_HASHED_PROMPT_TOKENS % bs
            hashed = token_ids if len(token_ids) <= cap else token_ids[:cap]
            hashes: Sequence[Hashable] = _block_hashes(
                hashed, bs, extra_keys=request_extra_keys(len(hashed) // bs, cache_salt))
            return hashes, len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        assert block_hashes is not None
        return block_hashes, len(block_hashes) * bs if num_prompt_tokens is None else num_prompt_tokens

    def _overlaps(self, hashes: Sequence[Hashable], exclude: Iterable[str] = ()) -> dict[str, int]:
        overlaps = self.index.match(hashes)
        if self._track_pending:
            for w, n in self._pending.match(hashes).items():
                if n > overlaps.get(w, 0):
                    overlaps[w] = n
        for w in exclude:
            overlaps.pop(w, None)
        return overlaps

    def _alive(self, w: WorkerLoad | None) -> bool:
        return w is not None and self._loads.get(w.worker_id) is w

    def _charge(self, request_id: str, r: _InFlight, now_s: float) -> None:
        pw = r.prefiller
        pw.prefill_tokens += r.prefill_tokens
        pw.prefill_work += r.prefill_work
        pw.total_prefill_work += r.prefill_work
        dw = r.decode
        dw.decode_blocks += r.decode_blocks
        pw.num_requests += 1
        pw.engine_requests += 1  # the prefill leg (the whole request when it prefills where it decodes)
        if dw is not pw:
            dw.num_requests += 1
        if self._track_pending:
            self._pending.store(pw.worker_id, r.hashes)
        if not pw.kv_events:
            r.learned_until_s = now_s + self.spec.approx_ttl_s
            r.learned = self.index.learn(pw.worker_id, r.hashes, r.learned_until_s)
        self._requests[request_id] = r

    def _unlearn(self, r: _InFlight) -> None:
        """Its prefill never happened: forget the blocks this request alone taught the index."""
        if r.learned and self._alive(r.prefiller):
            self.index.unlearn(r.prefiller.worker_id, r.learned, r.learned_until_s)
        r.learned = None

    # ------------------------------------------------------------------ lifecycle
    def on_first_token(self, request_id: str) -> bool:
        """Prefill finished: drop the request's prefill load. Returns False for unknown/repeated calls."""
        r = self._requests.get(request_id)
        if r is None or r.prefill_done:
            return False
        self._release_prefill(r)
        return True

    def _release_prefill(self, r: _InFlight) -> None:
        r.prefill_done = True
        pw = r.prefiller
        pw.prefill_tokens -= r.prefill_tokens
        pw.prefill_work -= r.prefill_work
        if pw is not r.decode:  # the prefill leg is over; the decode leg goes to its worker now
            pw.engine_requests -= 1
            r.decode.engine_requests += 1
        if self._track_pending and self._alive(pw):
            self._pending.remove(pw.worker_id, r.hashes)

    def on_complete(self, request_id: str, *, ok: bool = True) -> bool:
        """Request finished (or was abandoned): free all its load. Returns False for unknown ids.

        ``ok=False`` before the first token (e.g. the worker rejected the prompt): the prefill never ran,
        so the blocks this request taught the approximate index are forgotten again.
        """
        r = self._requests.pop(request_id, None)
        if r is None:
            return False
        if not r.prefill_done:
            if not ok:
                self._unlearn(r)
            self._release_prefill(r)
        r.decode.decode_blocks -= r.decode_blocks
        r.decode.num_requests -= 1
        r.decode.engine_requests -= 1  # _release_prefill moved it here
        if r.prefill is not None and r.prefill is not r.decode:
            r.prefill.num_requests -= 1
        return True

    def in_flight(self, request_id: str) -> RouteDecision:
        """The current decision of an in-flight request.

        Raises:
            UnknownRequestError: when it is not in flight.
        """
        r = self._requests.get(request_id)
        if r is None:
            raise UnknownRequestError(f"request {request_id!r} is not in flight")
        return RouteDecision(request_id, r.prefill_worker, r.decode_worker, 0, r.decode_blocks,
                             r.prefill_tokens, "remote" if r.prefill_worker else "local")

    # ------------------------------------------------------------------ failures
    def fallback_local_prefill(self, request_id: str, *, now_s: float | None = None) -> RouteDecision:
        """The remote prefill failed or its worker is down: prefill on the decode worker instead.

        Moves the prefill load to the decode worker and returns the new decision
        (``prefill_worker=None``, ``reason="local_prefill_failed"``). Blocks the failed prefill taught the
        approximate index are forgotten; with ``now_s`` (seconds) an approximate decode worker learns them.
        A decode worker that left the pool meanwhile (``remove_worker``) is replaced by another decode worker,
        chosen as a migration chooses one (not counted as one).

        Raises:
            UnknownRequestError: when the request is not in flight.
            NoWorkersError: its decode worker left and no other is in the pool (the request is freed).
        """
        r = self._requests.get(request_id)
        if r is None:
            raise UnknownRequestError(f"request {request_id!r} is not in flight")
        if not self._alive(r.decode):
            if r.prefill is not None and not r.prefill_done:
                self._unlearn(r)
            return self._reroute(request_id, r, r.excluded, r.hashes, r.num_tokens,
                                 0.0 if now_s is None else now_s, r.num_migrations, "local_prefill_failed")
        if r.prefill is not None:
            if not r.prefill_done:
                self._unlearn(r)
                self._release_prefill(r)
            r.prefill.num_requests -= 1
            r.prefill = None
            overlap = self.index.match(r.hashes).get(r.decode_worker, 0)
            r.prefill_tokens = max(0, r.num_tokens - overlap * self.block_size_tokens)
            r.prefill_work = (self.prefill_cost(r.num_tokens, r.num_tokens - r.prefill_tokens)
                              if r.num_tokens > 0 else 0.0)
            r.prefill_done = False
            r.decode.prefill_tokens += r.prefill_tokens
            r.decode.prefill_work += r.prefill_work
            r.decode.total_prefill_work += r.prefill_work
            if self._track_pending and self._alive(r.decode):
                self._pending.store(r.decode_worker, r.hashes)
            if now_s is not None and not r.decode.kv_events and self._alive(r.decode):
                r.learned_until_s = now_s + self.spec.approx_ttl_s
                r.learned = self.index.learn(r.decode_worker, r.hashes, r.learned_until_s)
        overlap = max(0, (r.num_tokens - r.prefill_tokens) // self.block_size_tokens)
        return RouteDecision(request_id, None, r.decode_worker, overlap, r.decode_blocks,
                             r.prefill_tokens, "local_prefill_failed")

    def migrate(self, request_id: str, *, now_s: float, token_ids: Sequence[int] | None = None,
                block_hashes: Sequence[Hashable] | None = None, cache_salt: str | None = None,
                exclude: Iterable[str] = ()) -> RouteDecision:
        """The decode worker died mid-stream: continue on another decode worker (local prefill).

        Args:
            request_id: the in-flight request.
            now_s: current time, seconds.
            token_ids / block_hashes: the continued prompt (original prompt + tokens generated so far);
                default the original prompt's hashes.
            cache_salt: the request's vLLM ``cache_salt``, with ``token_ids`` (as in :meth:`route`).
            exclude: further worker ids that died with the decode worker (the other data-parallel ranks
                of its server), never chosen for this request again.

        Raises:
            UnknownRequestError: not in flight.
            MigrationLimitError: more than ``spec.migration_limit`` migrations (the request is freed).
            NoWorkersError: no other decode-capable worker (the request is freed).
        """
        r = self._requests.get(request_id)
        if r is None:
            raise UnknownRequestError(f"request {request_id!r} is not in flight")
        failed = r.decode_worker
        if r.num_migrations >= self.spec.migration_limit:
            self.on_complete(request_id)
            raise MigrationLimitError(
                f"request {request_id!r}: decode worker {failed!r} failed and migration_limit="
                f"{self.spec.migration_limit} is used up")
        excluded = r.excluded | {failed} | set(exclude)
        if token_ids is not None or block_hashes is not None:
            hashes, num_tokens = self._prompt(token_ids, block_hashes, None, cache_salt)
        else:
            hashes, num_tokens = r.hashes, r.num_tokens
        return self._reroute(request_id, r, excluded, hashes, num_tokens, now_s, r.num_migrations + 1, "migrated")

    def _reroute(self, request_id: str, r: _InFlight, excluded: set[str], hashes: Sequence[Hashable],
                 num_tokens: int, now_s: float, num_migrations: int, reason: str) -> RouteDecision:
        """Free in-flight request `r` and charge it again on a decode worker outside `excluded` that prefills
        it itself (the decode policy's choice).

        Raises:
            NoWorkersError: no such decode worker (the request is freed).
        """
        candidates = [w for w in self._decoders if w.worker_id not in excluded]
        self.on_complete(request_id)
        if not candidates:
            raise NoWorkersError(f"request {request_id!r}: no decode worker left besides {sorted(excluded)}")
        overlaps = self._overlaps(hashes, exclude=excluded)
        nb = max(len(hashes), num_tokens // self.block_size_tokens)
        decode_policy = self.decode_policy if self._prefillers else self.aggregated_policy
        decode = decode_policy.choose(candidates, overlaps, nb, num_tokens, self.block_size_tokens)
        overlap = overlaps.get(decode, 0)
        uncached = max(0, num_tokens - overlap * self.block_size_tokens)
        work = self.prefill_cost(num_tokens, num_tokens - uncached) if num_tokens > 0 else 0.0
        new = _InFlight(None, self._loads[decode], uncached, _held_blocks(nb), work, hashes, num_tokens,
                        num_migrations=num_migrations, excluded=excluded)
        self._charge(request_id, new, now_s)
        return RouteDecision(request_id, None, decode, overlap, _held_blocks(nb), uncached, reason)
