"""Fleet simulator: a prefill pool and a decode pool of perf-model engines serving a request trace,
resized by a controller (the planner) every interval. Pure: no clock, no I/O; arrays in, result out.

Model (like Dynamo's mocker, at interval/step granularity so an hour of 200k requests replays in
seconds):

* Prefill: one central queue in front of the prefill workers (the router sends each request
  to the worker that frees first), first come first served (``prefill_order="fcfs"``) or by
  ``arrival + prompt-length bucket x 1 s`` (``"length"``: :func:`runtime.router.priority.prefill_order_key_s`,
  what the runtime's prefill workers do with ``--scheduling-policy priority``; decode workers prefilling
  in aggregated mode keep FCFS, as they do in the runtime). A request occupies its worker for ``prefill.busy_time_s(ISL)``
  and has its KV ready ``prefill.prefill_time_s(ISL)`` after it started (the fixed API-side latency
  overlaps the worker's next prefill);
  a worker launched at ``t`` serves from ``t + worker_start_s``. When no prefill worker is ready
  (aggregated serving, or before the first one starts) the ready decode workers prefill
  (``agg_prefill`` profile) and their decode steps stretch by ``1 / (1 - busy share)``.
* Decode: the ready decode workers form one pool with perfect balancing. Every ``decode_dt_s``
  admitted sequences advance ``dt / step`` tokens, ``step = decode.step_s(running / workers,
  mean context)``; admission is FIFO while KV (ISL + generated tokens) stays under
  ``kv_watermark`` of capacity and running sequences under ``max_num_seqs`` per worker; a prompt
  larger than one worker's ``kv_watermark`` of capacity is refused (never served, a miss: one
  sequence cannot span workers) instead of blocking the queue.
* TTFT = first decode token time - arrival (queueing + prefill + decode admission + one step);
  ITL = (finish - first token) / (OSL - 1). NIXL KV transfer time is not modelled.
* Scale-down: a starting worker is cancelled first; a ready prefill worker leaves after its
  assigned prefills; a decode worker drains until the rest hold its sequences.
* GPU time: every worker from launch to leave, times its TP, counted over [0, last arrival].
* Metrics per tick as the engines export them: besides queue/KV/latency, the mean prefill time of
  the requests whose prefill finished in the tick (vLLM ``vllm:request_prefill_time_seconds``).

The controller sees a :class:`runtime.planner.types.TickInput` per interval and returns a
:class:`runtime.planner.types.ScalingDecision` (or None to keep the fleet).
"""

from __future__ import annotations

import copy
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from runtime.planner.profiles import ServiceProfile
from runtime.planner.sla import arrival_dispersion
from runtime.planner.types import PoolObservation, ScalingDecision, TickInput
from runtime.router.priority import PRIORITY_AGING_S, prompt_length_bucket

PREFILL_ORDERS = ("fcfs", "length")
MAX_DECODE_STEPS_PER_TICK = 1_000_000
PEAK_BIN_QUANTILE = 0.9  # quantile of per-second prompt-token arrivals reported as the tick's peak
Controller = Callable[[TickInput], "ScalingDecision | None"]


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival. ``arrival_s`` seconds from 0; token counts >= 1."""

    arrival_s: np.ndarray
    isl_tokens: np.ndarray
    osl_tokens: np.ndarray
    priority: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.isl_tokens) != n or len(self.osl_tokens) != n:
            raise ValueError("Trace: arrival_s, isl_tokens and osl_tokens must have the same length")
        if self.priority is not None and len(self.priority) != n:
            raise ValueError(f"Trace.priority has {len(self.priority)} entries for {n} requests")
        if not n:
            return
        for name in ("arrival_s", "isl_tokens", "osl_tokens"):
            bad = np.flatnonzero(~np.isfinite(np.asarray(getattr(self, name), float)))
            if len(bad):
                raise ValueError(f"Trace.{name}[{bad[0]}] is not a finite number ({getattr(self, name)[bad[0]]})")
        if np.min(self.arrival_s) < 0:
            raise ValueError(f"Trace.arrival_s must be >= 0 (seconds from the trace start), got {np.min(self.arrival_s)}")
        if np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("Trace.arrival_s must be sorted")
        if np.min(self.isl_tokens) < 1 or np.min(self.osl_tokens) < 1:
            raise ValueError("Trace: isl_tokens and osl_tokens must be >= 1")

    def __len__(self) -> int:
        return len(self.arrival_s)

    def window(self, start_s: float, end_s: float) -> "Trace":
        """Requests arriving in [start_s, end_s), re-based to start at 0."""
        i, j = np.searchsorted(self.arrival_s, [start_s, end_s])
        pr = None if self.priority is None else self.priority[i:j]
        return Trace(self.arrival_s[i:j] - start_s, self.isl_tokens[i:j], self.osl_tokens[i:j], pr)


@dataclass(frozen=True)
class FleetConfig:
    """Simulator settings. Times in seconds."""

    prefill_tp: int
    decode_tp: int
    interval_s: float = 30.0
    worker_start_s: float = 60.0
    decode_dt_s: float = 0.25
    initial_prefill: int = 1
    initial_decode: int = 1
    slowdown: float = 1.0  # true engine time / profile time (tests the correction factors)
    kv_watermark: float = 0.95
    max_num_seqs: int = 512
    drain_limit_s: float = 1800.0
    prefill_order: str = "fcfs"  # "fcfs" or "length" (see the module doc)

    def __post_init__(self) -> None:
        for name in ("prefill_tp", "decode_tp", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"FleetConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("initial_prefill", "initial_decode"):
            if getattr(self, name) < 0:
                raise ValueError(f"FleetConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("interval_s", "decode_dt_s", "slowdown"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v > 0):
                raise ValueError(f"FleetConfig.{name} must be finite and > 0, got {v}")
        for name in ("worker_start_s", "drain_limit_s"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"FleetConfig.{name} must be finite and >= 0, got {v}")
        if not 0 < self.kv_watermark <= 1:
            raise ValueError(f"FleetConfig.kv_watermark must be in (0, 1], got {self.kv_watermark}")
        if self.interval_s / self.decode_dt_s > MAX_DECODE_STEPS_PER_TICK:
            raise ValueError(f"FleetConfig: interval_s / decode_dt_s = {self.interval_s / self.decode_dt_s:.0f} decode "
                             f"steps per tick; at most {MAX_DECODE_STEPS_PER_TICK} (raise decode_dt_s)")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"FleetConfig.prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")


@dataclass
class SimResult:
    """Per-request outcomes (NaN = never served) and fleet cost. ``gpu_seconds_by_pool`` splits
    ``gpu_seconds`` into ``{"prefill": ..., "decode": ...}`` (aggregated serving counts as decode)."""

    ttft_s: np.ndarray
    itl_s: np.ndarray
    gpu_seconds: float
    span_s: float
    timeline: list[dict] = field(default_factory=list)
    gpu_seconds_by_pool: dict[str, float] = field(default_factory=dict)

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0

    def slo_attainment(self, ttft_target_s: float, itl_target_s: float) -> float:
        """Fraction of requests with TTFT <= target and ITL <= target (unserved count as misses)."""
        if len(self.ttft_s) == 0:
            return 1.0
        ok = (self.ttft_s <= ttft_target_s) & (self.itl_s <= itl_target_s)
        return float(np.mean(ok))

    def p90(self, which: str) -> float:
        a = self.ttft_s if which == "ttft" else self.itl_s
        a = np.where(np.isnan(a), np.inf, a)
        return float(np.quantile(a, 0.9)) if len(a) else 0.0


def _prefill_arrays(profile, isl: np.ndarray, slowdown: float) -> tuple[np.ndarray, np.ndarray]:
    """(occupancy, latency) per request, seconds: the engine part slowed by ``slowdown``, the fixed
    API-side latency (``prefill_time - busy_time``) not."""
    busy = np.asarray(profile.busy_time_s(isl), float)
    fixed = np.maximum(np.asarray(profile.prefill_time_s(isl), float) - busy, 0.0)
    return busy * slowdown, fixed + busy * slowdown


class _Worker:
    __slots__ = ("launch_s", "ready_s", "free_s", "draining")

    def __init__(self, launch_s: float, ready_s: float) -> None:
        self.launch_s, self.ready_s, self.free_s, self.draining = launch_s, ready_s, ready_s, False


CLONED_ARRAYS = ("first_s", "prefill_done_s", "prefill_used_s", "finish_s", "act_idx", "act_admit", "act_done")


class FleetSim:
    """One simulation run; use :func:`simulate`."""

    def __init__(self, trace: Trace, profile: ServiceProfile, cfg: FleetConfig) -> None:
        self.tr, self.prof, self.cfg = trace, profile, cfg
        n = len(trace)
        # per request: how long its prefill occupies a worker (engine time x slowdown) and how long until
        # its first token could be ready (+ the fixed API-side latency, which overlaps the next prefill)
        isl = trace.isl_tokens.astype(float)
        self.busy_p, self.lat_p = _prefill_arrays(profile.prefill, isl, cfg.slowdown)
        self.busy_a, self.lat_a = _prefill_arrays(profile.agg_prefill, isl, cfg.slowdown)
        self.first_s = np.full(n, np.nan)
        self.prefill_done_s = np.full(n, np.nan)  # when each request's prefill finished
        self.prefill_used_s = np.full(n, np.nan)  # its engine-side prefill time (occupancy x slowdown)
        self.finish_s = np.full(n, np.nan)
        self.span_s = float(trace.arrival_s[-1]) if n else 0.0
        self.gpu_s = 0.0
        self.gpu_s_by_pool = {"prefill": 0.0, "decode": 0.0}
        self.prefill = [_Worker(0.0, 0.0) for _ in range(cfg.initial_prefill)]
        self.decode = [_Worker(0.0, 0.0) for _ in range(cfg.initial_decode)]
        self.pending: deque[int] = deque()  # queued, in arrival order (may not have arrived yet)
        # "length" order: arrived, not started, as (order key, arrival, request) heap; the key is
        # runtime.router.priority.prefill_order_key_s, vectorised
        self.prefill_q: list[tuple[float, float, int]] = []
        self.prio_p = (trace.arrival_s + PRIORITY_AGING_S * np.array(
            [prompt_length_bucket(int(x)) for x in trace.isl_tokens], dtype=float)
            if cfg.prefill_order == "length" else None)
        self.ready_heap: list[tuple[float, int]] = []  # (prefill done, request)
        self.waiting: deque[tuple[float, int]] = deque()
        self.act_idx = np.zeros(0, int)
        self.act_admit = np.zeros(0)
        self.act_done = np.zeros(0)
        self.timeline: list[dict] = []
        self.t_s = 0.0  # start of the next tick
        self.next_arrival = 0  # index of the first request not yet queued
        self.arrival_limit = n  # requests from this index on are never queued (what-if runs, see clone)
        self.done = False

    def clone(self) -> "FleetSim":
        """An independent copy of the simulation state for what-if runs from this point on: the
        trace, profile and service-time arrays are shared (never written), everything else is copied;
        the copy's ``timeline`` starts empty."""
        c = copy.copy(self)
        for name in CLONED_ARRAYS:
            setattr(c, name, getattr(self, name).copy())
        c.prefill = [copy.copy(w) for w in self.prefill]
        c.decode = [copy.copy(w) for w in self.decode]
        c.pending, c.waiting, c.ready_heap = deque(self.pending), deque(self.waiting), list(self.ready_heap)
        c.prefill_q = list(self.prefill_q)
        c.timeline = []
        c.gpu_s_by_pool = dict(self.gpu_s_by_pool)
        return c

    # ------------------------------------------------------------------ accounting
    def _leave(self, w: _Worker, at_s: float, tp: int, pool: str) -> None:
        end = min(at_s, self.span_s)
        gpu_s = max(0.0, end - max(w.launch_s, 0.0)) * tp
        self.gpu_s += gpu_s
        self.gpu_s_by_pool[pool] += gpu_s

    def _apply(self, now_s: float, d: ScalingDecision) -> None:
        c = self.cfg
        self._resize(self.prefill, max(d.prefill_replicas, 0), now_s, c.prefill_tp, drain=False)
        self._resize(self.decode, max(d.decode_replicas, 1), now_s, c.decode_tp, drain=True)

    def _resize(self, pool: list[_Worker], target: int, now_s: float, tp: int, drain: bool) -> None:
        name = "decode" if drain else "prefill"
        live = [w for w in pool if not w.draining]
        if target > len(live):
            revive = [w for w in pool if w.draining][: target - len(live)]
            for w in revive:
                w.draining = False
            for _ in range(target - len(live) - len(revive)):
                pool.append(_Worker(now_s, now_s + self.cfg.worker_start_s))
            return
        extra = len(live) - target
        starting = sorted((w for w in live if w.ready_s > now_s), key=lambda w: -w.ready_s)
        for w in starting[:extra]:
            pool.remove(w)
            self._leave(w, now_s, tp, name)
        extra -= min(extra, len(starting))
        ready = sorted((w for w in live if w.ready_s <= now_s), key=lambda w: (-w.launch_s, w.free_s))
        for w in ready[:extra]:
            if drain:
                w.draining = True
            else:
                pool.remove(w)
                self._leave(w, max(now_s, w.free_s), tp, name)

    # ------------------------------------------------------------------ prefill
    def _dispatch(self, t0: float, t1: float) -> float:
        """Start queued prefills that can start before t1; returns busy seconds put on decode workers."""
        ready_p = [w for w in self.prefill if w.ready_s <= t0]
        servers, busy_s, lat_s, agg = (self.prefill, self.busy_p, self.lat_p, False)
        if not ready_p:
            servers, busy_s, lat_s, agg = ([w for w in self.decode if w.ready_s <= t0 and not w.draining],
                                           self.busy_a, self.lat_a, True)
        if not servers:
            return 0.0
        if self.prio_p is not None and not agg:
            self._dispatch_by_priority(servers, t0, t1)
            return 0.0
        if self.prefill_q:  # decode workers prefill in FCFS order (the runtime sets no priority for them)
            queued = sorted(self.prefill_q, key=lambda e: (e[1], e[2]))
            self.pending = deque([i for _, _, i in queued] + list(self.pending))
            self.prefill_q = []
        # never before t0: decode workers taking over a queue (aggregated) may have been idle since long ago
        avail = [max(w.ready_s, w.free_s, t0) for w in servers]
        arr = self.tr.arrival_s
        busy = 0.0
        while self.pending:
            i = self.pending[0]
            k = min(range(len(avail)), key=avail.__getitem__)
            start = max(arr[i], avail[k])
            if start >= t1:
                break
            self.pending.popleft()
            avail[k] = servers[k].free_s = self._start_prefill(i, start, busy_s, lat_s)
            busy += busy_s[i]
        return busy if agg else 0.0

    def _start_prefill(self, i: int, start: float, busy_s: np.ndarray, lat_s: np.ndarray) -> float:
        """Record request `i`'s prefill starting at `start`; returns when its worker is free again."""
        done = start + lat_s[i]
        self.prefill_done_s[i], self.prefill_used_s[i] = done, busy_s[i]
        heapq.heappush(self.ready_heap, (done, i))
        return start + busy_s[i]

    def _dispatch_by_priority(self, servers: list[_Worker], t0: float, t1: float) -> None:
        """`_dispatch` on the prefill pool with the queue ordered by (order key, arrival): whenever a worker
        frees, it takes the most urgent request that has arrived by then."""
        arr, prio, q = self.tr.arrival_s, self.prio_p, self.prefill_q
        free = [(max(w.ready_s, w.free_s, t0), k) for k, w in enumerate(servers)]
        heapq.heapify(free)
        while q or self.pending:
            now = free[0][0]
            if not q:
                now = max(now, float(arr[self.pending[0]]))
            if now >= t1:
                break
            while self.pending and arr[self.pending[0]] <= now:
                i = self.pending.popleft()
                heapq.heappush(q, (float(prio[i]), float(arr[i]), i))
            _, _, i = heapq.heappop(q)
            k = free[0][1]
            servers[k].free_s = self._start_prefill(i, max(now, float(arr[i])), self.busy_p, self.lat_p)
            heapq.heapreplace(free, (servers[k].free_s, k))

    # ------------------------------------------------------------------ decode
    def _decode_steps(self, t0: float, t1: float, agg_busy_s: float) -> dict:
        c, prof, tr = self.cfg, self.prof, self.tr
        kv_cap = prof.decode.kv_capacity_tokens
        isl, osl = tr.isl_tokens, tr.osl_tokens
        n_steps = max(1, int(round((t1 - t0) / c.decode_dt_s)))
        dt = (t1 - t0) / n_steps
        for k in range(n_steps):
            s, se = t0 + k * dt, t0 + (k + 1) * dt
            pool = [w for w in self.decode if w.ready_s <= s]
            n_pool = len(pool)
            n_live = sum(1 for w in pool if not w.draining)
            while self.ready_heap and self.ready_heap[0][0] < se:
                self.waiting.append(heapq.heappop(self.ready_heap))
            kv_used = float(np.sum(isl[self.act_idx] + self.act_done)) if len(self.act_idx) else 0.0
            if self.waiting and n_live:
                cap_seq, cap_kv = n_live * c.max_num_seqs, n_live * kv_cap * c.kv_watermark
                new_i, new_t = [], []
                n_act = len(self.act_idx)
                while self.waiting and isl[self.waiting[0][1]] > kv_cap * c.kv_watermark:
                    self.waiting.popleft()  # one worker cannot hold it: refused (never served), not a queue block
                while self.waiting and n_act + len(new_i) < cap_seq and kv_used + isl[self.waiting[0][1]] <= cap_kv:
                    done, i = self.waiting.popleft()
                    if isl[i] > kv_cap * c.kv_watermark:
                        continue
                    new_i.append(i)
                    new_t.append(max(done, s))
                    kv_used += isl[i]
                if new_i:
                    self.act_idx = np.concatenate([self.act_idx, np.asarray(new_i, int)])
                    self.act_admit = np.concatenate([self.act_admit, np.asarray(new_t)])
                    self.act_done = np.concatenate([self.act_done, np.zeros(len(new_i))])
            if any(w.draining for w in self.decode) and n_live:
                if len(self.act_idx) <= n_live * c.max_num_seqs and kv_used <= n_live * kv_cap * c.kv_watermark:
                    for w in [w for w in self.decode if w.draining]:
                        self.decode.remove(w)
                        self._leave(w, s, c.decode_tp, "decode")
                    n_pool = n_live
            if not len(self.act_idx) or not n_pool:
                continue
            idx = self.act_idx
            ctx = float(np.mean(isl[idx] + self.act_done))
            u = min(agg_busy_s / (n_live * (t1 - t0)), 0.9) if (agg_busy_s and n_live) else 0.0
            step = prof.decode.step_s(len(idx) / n_pool, ctx) * c.slowdown / (1.0 - u)
            start = np.maximum(self.act_admit, s)
            gain = np.maximum(se - start, 0.0) / step
            before = self.act_done
            after = before + gain
            firsts = (before < 1.0) & (after >= 1.0)
            self.first_s[idx[firsts]] = start[firsts] + (1.0 - before[firsts]) * step
            fin = after >= osl[idx]
            self.finish_s[idx[fin]] = start[fin] + (osl[idx[fin]] - before[fin]) * step
            keep = ~fin
            self.act_idx, self.act_admit, self.act_done = idx[keep], self.act_admit[keep], after[keep]
        # the gauges as vLLM's num_requests_waiting, num_requests_running and kv_cache_usage_perc read at the
        # tick's end, per worker ready then: what the runtime's planner loop scrapes once a tick (a mean over
        # the tick divided among the workers ready at its end would also count a queue the pool held before
        # workers joined it many times over); KV usage at most 1, as vLLM's gauge: this model admits on prompts
        # and does not preempt, so contexts can outgrow the pool where vLLM would have preempted
        n_end = sum(1 for w in self.decode if w.ready_s <= t1)
        kv_end = float(np.sum(isl[self.act_idx] + self.act_done)) if len(self.act_idx) else 0.0
        return {
            "running_per_worker": len(self.act_idx) / max(n_end, 1),
            "queue_per_worker": len(self.waiting) / max(n_end, 1),
            "kv_usage": min(kv_end / max(n_end * kv_cap, 1), 1.0),
        }

    def _peak_tokens_per_s(self, new: slice, t0: float) -> float:
        """PEAK_BIN_QUANTILE of the prompt tokens arriving per 1-s bin of this tick, tokens/s."""
        bins = max(int(np.ceil(self.cfg.interval_s)), 1)
        idx = np.clip((self.tr.arrival_s[new] - t0).astype(int), 0, bins - 1)
        per_s = np.bincount(idx, weights=self.tr.isl_tokens[new], minlength=bins)
        return float(np.quantile(per_s, PEAK_BIN_QUANTILE))

    # ------------------------------------------------------------------ loop
    def run(self, controller: Controller) -> SimResult:
        while self.step(controller):
            pass
        return self.result()

    def step(self, controller: Controller) -> bool:
        """Simulate one tick ``[t_s, t_s + interval_s)``, then ask ``controller``; False once the
        trace is served (or ``drain_limit_s`` after the last arrival)."""
        c, tr = self.cfg, self.tr
        arr = tr.arrival_s
        n, ai, t = min(len(tr), self.arrival_limit), self.next_arrival, self.t_s
        if self.done or t >= self.span_s + c.drain_limit_s:
            self.done = True
            return False
        t1 = t + c.interval_s
        bi = max(min(int(np.searchsorted(arr, t1, side="left")), n), ai)
        self.pending.extend(range(ai, bi))
        new = slice(ai, bi)
        ai = bi
        agg_busy = self._dispatch(t, t1)
        stats = self._decode_steps(t, t1, agg_busy)
        ready_p = sum(1 for w in self.prefill if w.ready_s <= t1)
        first_in = (self.first_s >= t) & (self.first_s < t1)
        ended = (self.finish_s >= t) & (self.finish_s < t1)
        fin_in = ended & (tr.osl_tokens > 1)
        ttft = self.first_s[first_in] - arr[first_in]
        itl = (self.finish_s[fin_in] - self.first_s[fin_in]) / (tr.osl_tokens[fin_in] - 1)
        num = bi - new.start
        pre_in = (self.prefill_done_s >= t) & (self.prefill_done_s < t1)
        tick = TickInput(
            now_s=t1,
            interval_s=c.interval_s,
            num_requests=num,
            mean_isl_tokens=float(np.mean(tr.isl_tokens[new])) if num else 0.0,
            # the output lengths of the requests that ended in the tick: a runtime learns a request's only then
            mean_osl_tokens=float(np.mean(tr.osl_tokens[ended])) if np.any(ended) else 0.0,
            num_priority_requests=int(np.sum(tr.priority[new])) if tr.priority is not None else 0,
            p90_isl_tokens=float(np.quantile(tr.isl_tokens[new], 0.9)) if num else None,
            peak_prefill_tokens_per_s=self._peak_tokens_per_s(new, t) if num else None,
            arrival_dispersion=arrival_dispersion(tr.arrival_s[new], t, t1) if num else None,
            prompt_arrivals=tuple(zip(tr.arrival_s[new].tolist(), tr.isl_tokens[new].tolist())) if num else None,
            prefill=PoolObservation(
                num_ready=ready_p,
                num_starting=len(self.prefill) - ready_p,
                queue_per_worker=(len(self.pending) + len(self.prefill_q)) / max(ready_p, 1),
            ),
            decode=PoolObservation(
                num_ready=sum(1 for w in self.decode if w.ready_s <= t1),
                num_starting=sum(1 for w in self.decode if w.ready_s > t1),
                queue_per_worker=stats["queue_per_worker"],
                running_per_worker=stats["running_per_worker"],
                kv_usage=stats["kv_usage"],
            ),
            observed_ttft_p90_s=float(np.quantile(ttft, 0.9)) if len(ttft) else None,
            observed_itl_p90_s=float(np.quantile(itl, 0.9)) if len(itl) else None,
            observed_ttft_mean_s=float(np.mean(ttft)) if len(ttft) else None,
            observed_itl_mean_s=float(np.mean(itl)) if len(itl) else None,
            mean_request_duration_s=float(np.mean(self.finish_s[fin_in] - arr[fin_in])) if len(itl) else None,
            observed_prefill_time_mean_s=float(np.mean(self.prefill_used_s[pre_in])) if np.any(pre_in) else None,
        )
        decision = controller(tick)
        if decision is not None:
            self._apply(t1, decision)
        self.timeline.append(
            {"t_s": t1, "rate_per_s": tick.rate_per_s, "prefill": len(self.prefill),
             "decode": sum(1 for w in self.decode if not w.draining),
             "mode": decision.serving_mode if decision is not None else None}
        )
        self.t_s, self.next_arrival = t1, ai
        idle = not (self.pending or self.prefill_q or self.ready_heap or self.waiting or len(self.act_idx))
        if (ai >= n and idle) or t1 >= self.span_s + c.drain_limit_s:
            self.done = True
        return not self.done

    def result(self) -> SimResult:
        """Close the books (every worker leaves now) and return the per-request outcomes."""
        c, tr, t = self.cfg, self.tr, self.t_s
        arr = tr.arrival_s
        for w in self.prefill:
            self._leave(w, t, c.prefill_tp, "prefill")
        for w in self.decode:
            self._leave(w, t, c.decode_tp, "decode")
        self.prefill, self.decode = [], []
        ttft = self.first_s - arr
        osl = tr.osl_tokens
        itl = np.where(osl > 1, (self.finish_s - self.first_s) / np.maximum(osl - 1, 1), 0.0)
        itl = np.where(np.isnan(self.finish_s), np.nan, itl)
        return SimResult(ttft_s=ttft, itl_s=itl, gpu_seconds=self.gpu_s, span_s=self.span_s, timeline=self.timeline,
                         gpu_seconds_by_pool=dict(self.gpu_s_by_pool))


def simulate(trace: Trace, profile: ServiceProfile, cfg: FleetConfig, controller: Controller) -> SimResult:
    """Replay ``trace`` on a fleet resized by ``controller`` every ``cfg.interval_s``."""
    return FleetSim(trace, profile, cfg).run(controller)


def static_controller(prefill: int, decode: int) -> Controller:
    """A controller that always asks for the same fleet."""
    return lambda tick: ScalingDecision(now_s=tick.now_s, prefill_replicas=prefill, decode_replicas=decode)
