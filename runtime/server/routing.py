"""`Pairing` backed by the KV-aware router (runtime.router.core.Router).

The pure `Router` decides among worker *ids*; this adapter owns the id → URL map (configuration only), the
clock, the KV-event subscription and the worker health loop:
* `choose` routes on the prompt's token ids (runtime.server.tokenize, same tokens as vLLM), hashed with the
  request's `cache_salt` when it has one (vLLM salts that request's cached blocks with it, so it can only
  reuse blocks cached under the same salt); a prompt the runtime could not tokenize (batches, nested token-id lists, chats the template rejects) is routed and
  charged by an estimate of its length (`estimate_prompt_tokens`), without prefix matching;
* KV events of every worker (runtime.engines.kv_events) are applied to the router's index as they arrive;
* a worker whose circuit breaker opens (runtime.server.breakers calls `mark_down`) is no longer chosen, but
  keeps its index entry (its cache survives a short outage, and vLLM never re-reports blocks it holds); it
  is chosen again when its breaker closes (`mark_up`). A real restart clears the entry through the KV-event
  path (sequence reset); `remove_worker` drops it for good;
* workers without KV events are tracked approximately, each bounded to `approx_capacity_tokens`;
* with several runtime replicas in front of the same workers, each decode-capable worker's load includes
  the other replicas' requests, estimated from the engine's own gauges (`set_engine_load`, fed by
  runtime.server.engine_load), so every replica balances on the whole pool's load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from runtime.config import DeploymentSpec, RouterSpec
from runtime.engines.kv_events import rank_endpoint
from runtime.engines.metrics import readable_gauge
from runtime.kv.events import KvEventBatch
from runtime.redact import redact_userinfo
from runtime.router.core import MigrationLimitError, NoWorkersError, Router, UnknownRequestError
from runtime.router.load import WorkerLoad, set_external_load
from runtime.server.pairing import Route, RouteRequest

log = logging.getLogger(__name__)

#: Default bound of the router's learned index entry per worker without KV events, tokens: the order of a
#: large worker's KV cache (Llama-3.1-70B on 8×H100 at 0.9 memory: ~1.3M tokens; 8B on one H100: ~0.45M),
#: so learned entries cannot grow without limit (the engine's LRU would have evicted older blocks anyway).
DEFAULT_APPROX_CAPACITY_TOKENS = 1 << 20

#: Weight of the newest request in the running mean of prompt blocks per request (an exponential moving
#: average over about the last 1 / weight = 20 requests): the size other replicas' requests are taken to have.
BLOCKS_MEAN_WEIGHT = 0.05

#: Characters per token of the prompt-length estimate for prompts the runtime could not tokenize (the
#: usual ~4 characters per token of English BPE vocabularies, OpenAI's tokenizer guide).
CHARS_PER_TOKEN = 4


def _text_chars(value: object) -> int:
    """Characters of the text in a message `content` (a string or a list of `{"type": "text", ...}` parts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(p["text"]) for p in value
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def estimate_prompt_tokens(body: Mapping[str, object]) -> int:
    """Prompt length estimate, tokens, of an OpenAI request body the runtime could not tokenize.

    Completions `prompt`: a string or list of strings → characters / `CHARS_PER_TOKEN` (rounded up) over all
    of them; a token-id list → its length; a list of token-id lists → the sum of their lengths. Chat
    `messages`: characters of every message's text content / `CHARS_PER_TOKEN`. Anything else counts 0.
    Never raises (the body is client input).
    """
    chars = tokens = 0
    prompt = body.get("prompt")
    items: Sequence[object] = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else ()
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        tokens += len(prompt)
    else:
        for item in items:
            if isinstance(item, str):
                chars += len(item)
            elif isinstance(item, list):
                tokens += len(item)
    messages = body.get("messages")
    if isinstance(messages, list):
        chars += sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
    return tokens + -(-chars // CHARS_PER_TOKEN)


def rank_worker_id(worker_id: str, rank: int) -> str:
    """The router's id of data-parallel rank `rank` of worker `worker_id` (a worker with ``dp_size`` > 1)."""
    return f"{worker_id}/dp{rank}"


@dataclass(frozen=True)
class WorkerEndpoint:
    """One configured worker: id, role ("prefill"/"decode"/"both"), base URL, KV-event endpoint or None (of
    DP rank 0: vLLM publishes rank r on its port + r), and its data-parallel size (vLLM
    ``--data-parallel-size``: engines behind the one API server, each with its own KV cache).

    ``rank_endpoints``: a worker whose ranks run on several pods (a multi-node worker: rank r publishes on
    the pod that runs it) gives each rank's endpoint here, ``dp_size`` long, None for a rank without one (its
    cache is tracked approximately); () means every rank publishes at ``kv_events_endpoint``'s port + rank.

    Raises:
        ValueError: ``dp_size`` < 1, or ``rank_endpoints`` neither empty nor ``dp_size`` long.
    """

    worker_id: str
    role: str
    url: str
    kv_events_endpoint: str | None = None
    dp_size: int = 1
    rank_endpoints: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"worker {self.worker_id!r}: dp_size {self.dp_size} < 1")
        if self.rank_endpoints and len(self.rank_endpoints) != self.dp_size:
            raise ValueError(f"worker {self.worker_id!r}: {len(self.rank_endpoints)} rank endpoints for "
                             f"dp_size {self.dp_size}")

    def publishes_kv_events(self) -> bool:
        """Whether any rank of the worker has a KV-event endpoint."""
        return self.kv_events_endpoint is not None or any(ep is not None for ep in self.rank_endpoints)

    def rank_ids(self) -> dict[str, int | None]:
        """``{router id: DP rank}`` of the worker's engines: ``{worker_id: None}`` without data parallelism
        (the request carries no rank), else one ``rank_worker_id`` per rank."""
        if self.dp_size == 1:
            return {self.worker_id: None}
        return {rank_worker_id(self.worker_id, r): r for r in range(self.dp_size)}

    def kv_event_subscriptions(self) -> dict[str, str]:
        """``{subscription id: endpoint}``: one per DP rank (the router id of the rank, its publisher's
        endpoint: its ``rank_endpoints`` entry, else runtime.engines.kv_events.rank_endpoint); {} without a
        KV-event endpoint; a rank whose ``rank_endpoints`` entry is None is left out.

        Raises:
            ValueError: data parallelism with an endpoint vLLM does not offset per rank (not TCP).
        """
        if self.rank_endpoints:
            return {rid: ep for rid, ep in zip(self.rank_ids(), self.rank_endpoints) if ep is not None}
        if self.kv_events_endpoint is None:
            return {}
        return {rid: rank_endpoint(self.kv_events_endpoint, r or 0) for rid, r in self.rank_ids().items()}


def tier_credit_costs(spec: DeploymentSpec, model_config: Mapping | None) -> dict:
    """The router's prefill and KV-tier load costs for a deployment with a KV offload tier, as keyword arguments
    of `RouterPairing` (``prefill_cost``, ``tier_load_cost``); {} when it has none (``engine.kv_offload.cpu_gib``
    0) or the model's HF ``config.json`` dict `model_config` is unknown (the router then counts uncached
    tokens and does not credit tier hits).

    Both are in seconds, from the performance model the planner uses (runtime.server.planner_loop
    `spec_perf`) at the prefill pool's TP: ``prefill_cost`` is ``runtime.sim.timing.PerfTiming.prefill_s``
    (seconds a prefill with a cached prefix occupies its worker), ``tier_load_cost`` is
    ``runtime.kv.tiers.load_s_per_token`` of ``PerfModel.kv_bytes_per_token_rank(tp)`` for the CPU tier, and
    for the disk tier when ``engine.kv_offload.disk_path`` is set (same as bench/router.py's tier replay).

    Raises:
        runtime.models.spec.ModelConfigError: `model_config` lacks a field the perf model needs.
        KeyError: ``spec.gpu`` is not in the GPU catalog.
    """
    offload = spec.engine.kv_offload
    if offload.cpu_gib <= 0 or model_config is None:
        return {}
    from runtime.kv.tiers import load_s_per_token
    from runtime.server.planner_loop import spec_perf
    from runtime.sim.timing import PerfTiming

    perf, tp = spec_perf(spec, model_config), spec.prefill.tp
    per_token = load_s_per_token(perf.kv_bytes_per_token_rank(tp))
    media = ("CPU", "STORAGE") if offload.disk_path is not None else ("CPU",)
    return {"prefill_cost": PerfTiming(perf, tp).prefill_s, "tier_load_cost": {m: per_token[m] for m in media}}


#: The least share of the traffic a runtime replica is taken to see (the render runs at most 8 replicas; an
#: uneven balancer may give one less than 1/8 for a while): bounds how far the planner scales up its requests.
MIN_TRAFFIC_SHARE = 1 / 16


class RouterPairing:
    """`runtime.server.pairing.Pairing` over a `Router`.

    A worker with data parallelism (``WorkerEndpoint.dp_size`` > 1) is one router entry per DP rank
    (``rank_worker_id``: its own prefix index, load and KV-event subscription, as NVIDIA Dynamo routes to a
    worker and DP rank); a route to it names the rank (``Route.prefill_dp_rank`` / ``decode_dp_rank``), which
    the request carries to vLLM as its ``X-data-parallel-rank`` header. Everything keyed by URL (health,
    drains, the planner's loads) stays per worker: ``mark_down``/``mark_up``/``remove_worker`` act on all its
    ranks and ``load_of`` sums them. A worker without data parallelism is one entry under its own id.

    Args:
        spec: router settings (policy, thresholds).
        block_size_tokens: the workers' `--block-size`.
        workers: the configured pool.
        clock: monotonic seconds (injected for tests).
        approx_capacity_tokens: bound of the learned index entry of each worker without KV events, tokens.

    Raises:
        ValueError: duplicate worker ids or an unknown role (from Router.add_worker).
    """

    def __init__(self, spec: RouterSpec, block_size_tokens: int, workers: list[WorkerEndpoint], *,
                 clock: Callable[[], float] = time.monotonic,
                 approx_capacity_tokens: int = DEFAULT_APPROX_CAPACITY_TOKENS,
                 prefill_cost: Callable[[int, int], float] | None = None,
                 tier_load_cost: Mapping[str, float] | None = None) -> None:
        self.router = Router(spec, block_size_tokens, prefill_cost=prefill_cost, tier_load_cost=tier_load_cost)
        self.block_size_tokens = block_size_tokens
        # subscription (router) id -> clock() of its last applied KV-event batch, or of when it joined the pool
        # (a worker that publishes KV events): a worker whose publisher never sends one must still age (the
        # stale-index alert); one entry per DP rank
        self.last_event_s: dict[str, float] = {}
        self._approx_capacity_blocks = max(1, approx_capacity_tokens // block_size_tokens)
        self.workers = {w.worker_id: w for w in workers}
        self._url_to_id = {w.url.rstrip("/"): w.worker_id for w in workers}
        #: router id -> (worker id, DP rank or None): the router's entries, one per DP rank of a worker
        self._ranks: dict[str, tuple[str, int | None]] = {}
        self.clock = clock
        self.down: set[str] = set()
        #: moves whenever a worker joins or leaves (add_worker, remove_worker): followers of the pool
        #: (runtime.server.breakers) look it up again only then
        self.pool_version = 0
        # running mean of prompt blocks per routed request (BLOCKS_MEAN_WEIGHT); None until the first request
        self.blocks_per_request: float | None = None
        # this router's and the engines' decode requests summed over the engine-load reads since the last
        # drain_traffic_share() (its share of the traffic when several runtime replicas share the workers)
        self._share_own = self._share_engine = 0.0
        self._share_lock = threading.Lock()  # the planner drains it from its own thread
        for w in workers:
            self._add_to_router(w)

    def _add_to_router(self, w: WorkerEndpoint) -> None:
        ranks = w.rank_ids()
        if any(rid in self._ranks for rid in ranks):
            raise ValueError(f"worker {w.worker_id!r}: an id of its DP ranks is already in the pool")
        for i, (rid, rank) in enumerate(ranks.items()):
            # a rank of a multi-node worker without an endpoint (its pod not listed) is tracked approximately
            events = (w.rank_endpoints[i] is not None) if w.rank_endpoints else w.kv_events_endpoint is not None
            self.router.add_worker(rid, w.role, kv_events=events, kv_capacity_blocks=self._approx_capacity_blocks)
            self._ranks[rid] = (w.worker_id, rank)
            if events:
                self.last_event_s[rid] = self.clock()

    def _route(self, prefill: str | None, decode: str, reason: str, overlap_blocks: int) -> Route:
        """The Route of router ids `prefill` (None: local) and `decode`: their workers' URLs and DP ranks."""
        dw, d_rank = self._ranks[decode]
        pw, p_rank = self._ranks[prefill] if prefill is not None else (None, None)
        return Route(None if pw is None else self.workers[pw].url, self.workers[dw].url, reason, prefill, decode,
                     overlap_blocks, prefill_dp_rank=p_rank, decode_dp_rank=d_rank)

    def _router_ids(self, worker_id: str | None) -> list[str]:
        """Router ids of a worker's DP ranks ([] for None or an unknown worker)."""
        w = self.workers.get(worker_id) if worker_id is not None else None
        return [] if w is None else list(w.rank_ids())

    # -- Pairing -----------------------------------------------------------------------------------
    def choose(self, req: RouteRequest) -> Route:
        if req.token_ids is None:  # not tokenizable here: route and charge by an estimate, no prefix match
            d = self.router.route(req.request_id, now_s=req.now_s, block_hashes=[],
                                  num_prompt_tokens=estimate_prompt_tokens(req.body))
        else:
            salt = req.body.get("cache_salt")  # vLLM salts the prompt's cached blocks with it
            d = self.router.route(req.request_id, now_s=req.now_s, token_ids=req.token_ids,
                                  cache_salt=salt if isinstance(salt, str) and salt else None)
        mean = self.blocks_per_request
        self.blocks_per_request = float(d.num_prompt_blocks) if mean is None else (
            mean + BLOCKS_MEAN_WEIGHT * (d.num_prompt_blocks - mean))
        return self._route(d.prefill_worker, d.decode_worker, d.reason, d.overlap_blocks)

    def on_first_token(self, request_id: str, now_s: float) -> None:
        self.router.on_first_token(request_id)

    def on_prefill_failed(self, request_id: str, now_s: float) -> Route:
        d = self.router.fallback_local_prefill(request_id, now_s=now_s)
        return self._route(None, d.decode_worker, d.reason, d.overlap_blocks)

    def on_complete(self, request_id: str, now_s: float, ok: bool) -> None:
        self.router.on_complete(request_id, ok=ok)

    def on_decode_failed(self, request_id: str, now_s: float) -> Route | None:
        # the decode worker's server is unreachable: none of its DP ranks can continue the request
        try:
            failed = self._ranks.get(self.router.in_flight(request_id).decode_worker)
        except UnknownRequestError:
            return None
        try:
            d = self.router.migrate(request_id, now_s=now_s, exclude=self._router_ids(failed and failed[0]))
        except (MigrationLimitError, NoWorkersError, UnknownRequestError):
            return None
        return self._route(None, d.decode_worker, d.reason, d.overlap_blocks)

    # -- events and health ---------------------------------------------------------------------------
    def apply_batch(self, subscription_id: str, batch: KvEventBatch) -> None:
        """Apply one KV-event batch to the router index (callback of KvEventSubscriber): `subscription_id` is a
        key of `kv_event_endpoints` (a worker's id, or its DP rank's id). A batch of a DP rank labelled with
        another ``data_parallel_rank`` (a publisher on the wrong port) is dropped with a warning: its blocks
        are never indexed under the wrong rank."""
        owner = self._ranks.get(subscription_id)
        rank = None if owner is None else owner[1]
        if rank is not None and batch.data_parallel_rank is not None and batch.data_parallel_rank != rank:
            log.warning("KV events of %s carry data_parallel_rank %d: dropped (a publisher on the wrong port?)",
                        subscription_id, batch.data_parallel_rank)
            return
        now = self.clock()
        self.last_event_s[subscription_id] = now
        self.router.apply_kv_events(subscription_id, batch.events, now)

    def kv_event_endpoints(self) -> Mapping[str, str]:
        """`{subscription id: endpoint}` of the workers that publish KV events, one per DP rank
        (`WorkerEndpoint.kv_event_subscriptions`)."""
        return {sid: ep for w in self.workers.values() for sid, ep in w.kv_event_subscriptions().items()}

    def mark_down(self, url: str) -> list[str]:
        """Stop routing to the worker at `url` (its index entry is kept); returns its in-flight request ids."""
        wid = self._url_to_id.get(url.rstrip("/"))
        if wid is None or wid in self.down:
            return []
        self.down.add(wid)
        log.warning("worker %s (%s) is down: no longer routed to", wid, redact_userinfo(url))
        return list(dict.fromkeys(r for rid in self._router_ids(wid) for r in self.router.suspend_worker(rid)))

    def add_worker(self, endpoint: WorkerEndpoint) -> None:
        """Add a worker started at run time (e.g. by the planner's local actuator).

        Raises:
            ValueError: its id or URL is already in the pool.
        """
        if endpoint.worker_id in self.workers or endpoint.url.rstrip("/") in self._url_to_id:
            raise ValueError(f"worker {endpoint.worker_id!r} / {endpoint.url} is already in the pool")
        self._add_to_router(endpoint)
        self.workers[endpoint.worker_id] = endpoint
        self._url_to_id[endpoint.url.rstrip("/")] = endpoint.worker_id
        self.pool_version += 1

    def remove_worker(self, worker_id: str) -> list[str]:
        """Remove a worker for good (scaled down); returns its in-flight request ids. Unknown ids: []."""
        w = self.workers.get(worker_id)
        if w is None:
            return []
        out: dict[str, None] = {}
        for rid in self._router_ids(worker_id):
            self._ranks.pop(rid, None)
            self.last_event_s.pop(rid, None)
            out.update(dict.fromkeys(self.router.remove_worker(rid)))
        del self.workers[worker_id]
        self._url_to_id.pop(w.url.rstrip("/"), None)
        self.down.discard(worker_id)
        self.pool_version += 1
        return list(out)

    def load_of(self, url: str) -> WorkerLoad | None:
        """The router's in-flight load of the worker at `url` (`num_requests`: requests that decode on it, or
        were prefilled on it and have not completed, so a handoff of its KV may still be unread); None for a
        worker not in the pool. A worker with DP ranks: a new WorkerLoad, the sum of its ranks' counters
        (read it; changing it changes nothing)."""
        loads = self._rank_loads(url)
        if len(loads) <= 1:
            return loads[0] if loads else None
        total = WorkerLoad(self._url_to_id[url.rstrip("/")], loads[0].role, kv_events=loads[0].kv_events,
                           available=any(w.available for w in loads))
        for name in ("prefill_tokens", "decode_blocks", "num_requests", "engine_requests", "prefill_work",
                     "total_prefill_work", "external_requests", "external_decode_blocks"):
            setattr(total, name, sum(getattr(w, name) for w in loads))
        return total

    def _rank_loads(self, url: str) -> list[WorkerLoad]:
        """The router's WorkerLoad of each DP rank of the worker at `url` (in rank order; [] when unknown)."""
        loads = self.router.workers
        return [loads[rid] for rid in self._router_ids(self._url_to_id.get(url.rstrip("/"))) if rid in loads]

    def load_of_ip(self, host: str) -> WorkerLoad | None:
        """`load_of` the worker whose URL's host is `host` (a pod IP); None when no worker has it."""
        for url in list(self._url_to_id):
            if urlsplit(url).hostname == host:
                return self.load_of(url)
        return None

    def dp_size_of(self, url: str) -> int:
        """Data-parallel ranks of the worker at `url` (1 for a worker without data parallelism or not in the
        pool)."""
        wid = self._url_to_id.get(url.rstrip("/"))
        return 1 if wid is None else self.workers[wid].dp_size

    def decode_worker_urls(self) -> list[str]:
        """Base URLs of the pool's decode-capable workers (roles "decode" and "both")."""
        return [w.url for w in self.workers.values() if w.role != "prefill"]

    def set_engine_load(self, url: str, engine_requests: float | Mapping[int, float] | None) -> None:
        """The engine at `url` reports `engine_requests` running or waiting (None: its page was unreadable):
        the requests beyond this router's own on it (`WorkerLoad.engine_requests`) count as other replicas'
        load on it, each of the running mean prompt size (runtime.router.load.set_external_load; one block
        each before this router has routed a request). Unknown URLs and prefill-only workers: no-op. A NaN,
        infinite or negative count is taken as unreadable (None): it would corrupt the traffic share.

        `engine_requests` of a worker with DP ranks: `{rank: requests}` (vLLM's gauges per ``engine`` label),
        or the worker's total, whose excess over this router's requests is then spread evenly over its ranks
        (a rank missing from the mapping counts as unreadable)."""
        loads = self._rank_loads(url)
        if not loads:
            return
        if isinstance(engine_requests, Mapping):
            per_rank = [engine_requests.get(r) for r in range(len(loads))]
            total = None if any(v is None for v in per_rank) else sum(float(v) for v in per_rank)
        else:
            total = per_rank = engine_requests
        if total is not None:
            total = readable_gauge(float(total))
        own = sum(w.engine_requests for w in loads)
        if total is not None and loads[0].can_decode:
            # the requests this router has on the engine as the engine counts them (a request still
            # prefilling elsewhere is on neither count); never more than all of it, as the reads race
            with self._share_lock:
                self._share_own += own
                self._share_engine += max(float(total), float(own))
        blocks = 1.0 if self.blocks_per_request is None else self.blocks_per_request
        for i, w in enumerate(loads):
            if isinstance(per_rank, list):
                n = None if per_rank[i] is None else readable_gauge(float(per_rank[i]))
            elif total is None or len(loads) == 1:
                n = total
            else:  # the worker's excess spread evenly over its ranks
                n = w.engine_requests + max(0.0, total - own) / len(loads)
            set_external_load(w, n, blocks)

    def drain_traffic_share(self) -> float | None:
        """This router's share of the requests the decode workers ran or queued, over the engine-load reads
        since the last call (`set_engine_load`): with N runtime replicas behind an even balancer about 1/N.
        At least `MIN_TRAFFIC_SHARE`; None when no read counted a request (nothing to judge by)."""
        with self._share_lock:
            own, engine = self._share_own, self._share_engine
            self._share_own = self._share_engine = 0.0
        if engine <= 0:
            return None
        return min(1.0, max(own / engine, MIN_TRAFFIC_SHARE))

    def mark_up(self, url: str) -> None:
        """Route to a recovered worker again (its index entry as kept while it was down)."""
        wid = self._url_to_id.get(url.rstrip("/"))
        if wid is None or wid not in self.down:
            return
        for rid in self._router_ids(wid):
            self.router.resume_worker(rid)
        self.down.discard(wid)
        log.info("worker %s (%s) is back in the pool", wid, redact_userinfo(url))
