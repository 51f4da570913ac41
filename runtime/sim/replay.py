"""Discrete-event replay of a request trace through a router and simulated workers (pure).

Model (like Dynamo's mocker engine, simplified to what routing changes):

* each worker prefills one request at a time, first come first served (a compute-bound long-prompt
  prefill of a 70B model saturates the GPU; chunked-prefill batching changes the order little);
  prefill time from :class:`~runtime.sim.timing.PerfTiming` given the blocks actually hit in that
  worker's :class:`~runtime.sim.worker.SimKvCache` *when the prefill starts*;
* the KV events of that start (evictions, newly stored blocks) reach the router immediately;
* TTFT = prefill end − arrival + the fixed API-side latency (``PerfTiming.fixed_latency_s``, which
  does not hold the worker); then the request decodes for ``output_tokens`` steps at the decode
  worker's current batch (decode overlaps prefill on the timeline: its cost shows up as KV blocks
  held, not as prefill delay), its blocks pinned until it completes;
* disaggregated decisions prefill on ``prefill_worker`` and then pin the blocks on ``decode_worker``
  (the NIXL transfer is not timed);
* busy time of a worker = sum of its prefill occupancies; imbalance = max / mean busy time;
* a worker with an offload tier (``SimWorkerSpec.offload_capacity_blocks``, vLLM's CPU tier) loads the
  blocks that continue its GPU prefix from the tier: they count as cached for the prefill time, and their
  load (``offload_load_s_per_token`` per token) holds the worker and adds to TTFT (vLLM loads before it
  computes the rest; charging the load to the worker is the conservative side of its async load).

The router is anything with the :class:`RouterLike` methods, so external routers (Dynamo's
``SelectionService`` via an adapter) replay the same trace against the same simulated workers.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.kv.events import KvEvent
from runtime.sim.timing import PerfTiming
from runtime.sim.trace import TraceRequest
from runtime.sim.worker import SimKvCache


class RouterLike(Protocol):
    """What the replay needs from a router (``runtime.router.core.Router`` has it)."""

    def route(self, request_id: str, *, now_s: float, block_hashes: Sequence[Hashable],
              num_prompt_tokens: int) -> Any: ...  # returns .prefill_worker, .decode_worker

    def on_first_token(self, request_id: str) -> Any: ...

    def on_complete(self, request_id: str) -> Any: ...

    def apply_kv_events(self, worker_id: str, events: Iterable[KvEvent], now_s: float) -> Any: ...


@dataclass(frozen=True, slots=True)
class SimWorkerSpec:
    """A simulated worker: id, role (prefill/decode/both), KV capacity in blocks and offload-tier blocks."""

    worker_id: str
    role: str
    capacity_blocks: int
    offload_capacity_blocks: int = 0


@dataclass
class ReplayResult:
    """Per-request and per-worker outcomes of one replay. Times in seconds."""

    ttft_s: list[float] = field(default_factory=list)
    #: per request with output tokens: its decode time / its output tokens (the mean time per output token)
    tpot_s: list[float] = field(default_factory=list)
    hit_blocks: int = 0
    offload_hit_blocks: int = 0
    total_blocks: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)
    num_remote_prefills: int = 0
    num_overflow_blocks: int = 0
    end_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt blocks found in the prefilling worker's GPU cache / all prompt blocks."""
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def offload_hit_rate(self) -> float:
        """Prompt blocks the prefilling worker loaded from its offload tier / all prompt blocks."""
        return self.offload_hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def ttft_mean_s(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else 0.0

    def ttft_quantile_s(self, q: float) -> float:
        """Nearest-rank quantile of TTFT, ``0 < q <= 1``."""
        if not self.ttft_s:
            return 0.0
        xs = sorted(self.ttft_s)
        k = min(len(xs) - 1, max(0, int(-(-q * len(xs) // 1)) - 1))
        return xs[k]

    @property
    def imbalance(self) -> float:
        """max / mean of per-worker busy (prefill) time; 1.0 = perfectly balanced."""
        vals = list(self.busy_s.values())
        mean = sum(vals) / len(vals) if vals else 0.0
        return max(vals) / mean if mean > 0 else 1.0


_ARRIVE, _PREFILL_DONE, _DECODE_DONE = 0, 1, 2


@dataclass(slots=True)
class _Req:
    tr: TraceRequest
    prefill_worker: str
    decode_worker: str
    hit_blocks: int = 0
    loaded_blocks: int = 0


def replay(requests: Sequence[TraceRequest], router: RouterLike, workers: Sequence[SimWorkerSpec],
           timing: PerfTiming, block_size_tokens: int, *, offload_load_s_per_token: float = 0.0) -> ReplayResult:
    """Replay ``requests`` (sorted by arrival) and return the outcomes.

    ``offload_load_s_per_token``: seconds to load one token's KV from a worker's offload tier (e.g.
    ``runtime.kv.tiers.load_s_per_token``).

    Raises:
        ValueError: when ``workers`` is empty, a request's ``arrival_s`` is not finite, or the router
            names a worker not in ``workers``.
    """
    if not workers:
        raise ValueError("replay needs at least one worker")
    _check_finite_arrivals(requests)
    caches = {w.worker_id: SimKvCache(w.capacity_blocks, block_size_tokens,
                                      offload_capacity_blocks=w.offload_capacity_blocks) for w in workers}
    queues: dict[str, deque[_Req]] = {w.worker_id: deque() for w in workers}
    busy = {w.worker_id: False for w in workers}
    decoding = {w.worker_id: 0 for w in workers}
    res = ReplayResult(busy_s={w.worker_id: 0.0 for w in workers})
    heap: list[tuple[float, int, int, object]] = []
    seq = 0
    for tr in requests:
        heap.append((tr.arrival_s, seq, _ARRIVE, tr))
        seq += 1
    heapq.heapify(heap)

    def push(t: float, kind: int, obj: object) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, obj))
        seq += 1

    def start_next(wid: str, now: float) -> None:
        q = queues[wid]
        if busy[wid] or not q:
            return
        r = q.popleft()
        hit, loaded, events = caches[wid].acquire_tiered(r.tr.hash_ids)
        if events:
            router.apply_kv_events(wid, events, now)
        r.hit_blocks, r.loaded_blocks = hit, loaded
        isl = r.tr.input_tokens
        cached_tokens = min((hit + loaded) * block_size_tokens, isl)
        dt = timing.prefill_s(isl, cached_tokens)
        if loaded:  # the loaded part of the reused prefix (prefill_s recomputes the last prompt token)
            top = max(0, isl - 1)
            dt += (min(cached_tokens, top) - min(hit * block_size_tokens, top)) * offload_load_s_per_token
        res.busy_s[wid] += dt
        busy[wid] = True
        push(now + dt, _PREFILL_DONE, r)

    def check(wid: str | None) -> str | None:
        if wid is not None and wid not in caches:
            raise ValueError(f"router chose worker {wid!r} that is not in the simulated pool")
        return wid

    while heap:
        now, _, kind, obj = heapq.heappop(heap)
        if kind == _ARRIVE:
            tr: TraceRequest = obj  # type: ignore[assignment]
            d = router.route(tr.request_id, now_s=now, block_hashes=tr.hash_ids,
                             num_prompt_tokens=tr.input_tokens)
            dec = check(d.decode_worker)
            pre = check(d.prefill_worker) or dec
            if pre != dec:
                res.num_remote_prefills += 1
            queues[pre].append(_Req(tr, pre, dec))  # type: ignore[arg-type]
            start_next(pre, now)  # type: ignore[arg-type]
        elif kind == _PREFILL_DONE:
            r: _Req = obj  # type: ignore[assignment]
            res.ttft_s.append(now - r.tr.arrival_s + timing.fixed_latency_s)
            res.hit_blocks += r.hit_blocks
            res.offload_hit_blocks += r.loaded_blocks
            res.total_blocks += len(r.tr.hash_ids)
            router.on_first_token(r.tr.request_id)
            busy[r.prefill_worker] = False
            if r.decode_worker != r.prefill_worker:
                caches[r.prefill_worker].release(r.tr.hash_ids)
                _, events = caches[r.decode_worker].acquire(r.tr.hash_ids)
                if events:
                    router.apply_kv_events(r.decode_worker, events, now)
            decoding[r.decode_worker] += 1
            dt = timing.decode_s(r.tr.output_tokens, r.tr.input_tokens, decoding[r.decode_worker])
            if r.tr.output_tokens > 0:
                res.tpot_s.append(dt / r.tr.output_tokens)
            push(now + dt, _DECODE_DONE, r)
            start_next(r.prefill_worker, now)
        else:
            r = obj  # type: ignore[assignment]
            decoding[r.decode_worker] -= 1
            caches[r.decode_worker].release(r.tr.hash_ids)
            router.on_complete(r.tr.request_id)
            res.end_s = now
    res.num_overflow_blocks = sum(c.num_overflow_blocks for c in caches.values())
    return res


def load_scale_factor(requests: Sequence[TraceRequest], timing: PerfTiming, num_prefill_workers: int,
                      load: float) -> float:
    """Arrival-time scale so that the trace's no-cache prefill work is ``load`` × cluster capacity.

    ``work = Σ prefill_s(input_tokens)``; over the scaled span ``factor × span`` the cluster offers
    ``num_prefill_workers × factor × span`` seconds of prefill, so ``factor = work / (load × N × span)``.

    Raises:
        ValueError: when ``load`` is not in (0, 10], no workers, the trace is empty, an arrival is not
            finite, or the trace spans zero time.
    """
    if not 0 < load <= 10:
        raise ValueError(f"load must be in (0, 10], got {load}")
    if num_prefill_workers <= 0:
        raise ValueError("num_prefill_workers must be > 0")
    if not requests:
        raise ValueError("trace has no requests; cannot scale arrivals to a load")
    _check_finite_arrivals(requests)
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    if span <= 0:
        raise ValueError("trace spans zero time; cannot scale arrivals")
    work = sum(timing.prefill_s(r.input_tokens) for r in requests)
    return work / (load * num_prefill_workers * span)


def _check_finite_arrivals(requests: Sequence[TraceRequest]) -> None:
    """Raise ``ValueError`` naming the first request whose ``arrival_s`` is NaN or infinite."""
    for r in requests:
        if not math.isfinite(r.arrival_s):
            raise ValueError(f"request {r.request_id!r}: arrival_s must be finite, got {r.arrival_s!r}")
