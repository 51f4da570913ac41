"""Shared builders for planner tests: hand-checkable engine profiles, a planner configuration and ticks.

The profiles: prefill 0.1 ms per prompt token, decode step 10 ms + 0.1 ms per running sequence, KV 100k
tokens per worker, so a test's expected replica counts can be worked out by hand in its comments.
"""

from __future__ import annotations

import numpy as np

from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig, PoolObservation, ScalingDecision, TickInput
from runtime.sim.fleet import FleetConfig, Trace, simulate

PROF = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4, kv_capacity_tokens=100_000)
# the same engines measured at prefill TP 2 and decode TP 4
PROF_TP = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4,
                           kv_capacity_tokens=100_000, prefill_tp=2, decode_tp=4)


def planner_cfg(**kw) -> PlannerConfig:  # noqa: ANN003
    """An SLA-mode configuration at TP 1/1, 30 s ticks, 60 s worker start, the constant predictor and no
    aggregated serving, room for 40 prefill / 20 decode workers in 64 GPUs; ``kw`` overrides any field."""
    base = dict(mode="sla", prefill_tp=1, decode_tp=1, min_prefill=1, max_prefill=40, min_decode=1, max_decode=20,
                gpu_budget=64, interval_s=30.0, worker_start_s=60.0, predictor="constant", allow_aggregated=False)
    return PlannerConfig(**(base | kw))


def tick(now_s: float, rate: float, *, isl: float = 1000, osl: float = 200, interval_s: float = 30.0,
         ready_p: int = 4, ready_d: int = 2, running_d: float = 0.0, prio: float = 0.0,
         **kw) -> TickInput:  # noqa: ANN003
    """One tick ending at ``now_s``: ``rate`` requests/s (and ``prio`` priority requests/s) over ``interval_s``
    of ``isl``/``osl`` tokens, ``ready_p`` prefill and ``ready_d`` decode workers ready (``running_d``
    sequences in each decode batch); ``kw`` sets any other TickInput field."""
    return TickInput(now_s=now_s, interval_s=interval_s, num_requests=round(rate * interval_s), mean_isl_tokens=isl,
                     mean_osl_tokens=osl, num_priority_requests=round(prio * interval_s),
                     prefill=PoolObservation(num_ready=ready_p),
                     decode=PoolObservation(num_ready=ready_d, running_per_worker=running_d), **kw)


def fleet_tick(sm: PlannerStateMachine, now_s: float, rate: float, *, isl: float = 1000.0, osl: float = 200.0,
               interval_s: float = 30.0, prefill: dict | None = None, decode: dict | None = None,
               **kw) -> ScalingDecision:  # noqa: ANN003
    """Feed ``sm`` one tick whose fleet is what the planner asked for, all of it ready (the actuator is
    done): ``int(rate * interval_s)`` requests; ``prefill``/``decode`` set the other PoolObservation fields,
    ``kw`` any other TickInput field. Returns the planner's decision."""
    return sm.on_tick(TickInput(
        now_s=now_s, interval_s=interval_s, num_requests=int(rate * interval_s), mean_isl_tokens=isl,
        mean_osl_tokens=osl, prefill=PoolObservation(num_ready=sm.prefill, **(prefill or {})),
        decode=PoolObservation(num_ready=sm.decode, **(decode or {})), **kw))


def bursts(starts: list[float], duration_s: float = 3600.0) -> Trace:
    """2 req/s of 5000-token prompts all along, plus 20 req/s for 60 s from each of ``starts``."""
    rng = np.random.default_rng(0)
    t = list(rng.uniform(0, duration_s, int(2 * duration_s)))
    for s in starts:
        t += list(rng.uniform(s, s + 60.0, 20 * 60))
    arr = np.sort(np.array(t))
    return Trace(arr, np.full(len(arr), 5000), np.full(len(arr), 50))


def late_per_burst(trace: Trace, starts: list[float], **cfg_kw) -> tuple[list[int], float]:  # noqa: ANN003
    """Late requests of each 60-s burst from ``starts`` and the fleet's GPU-seconds, ``pdserve_sla`` on
    PROF from 3 prefill / 1 decode workers; ``cfg_kw`` overrides the configuration."""
    cfg = planner_cfg(predictor="burst_quantile", max_prefill=60, max_decode=20, gpu_budget=100, **cfg_kw)
    sm = PlannerStateMachine(cfg, PROF, initial_prefill=3, initial_decode=1)
    res = simulate(trace, PROF, FleetConfig(prefill_tp=1, decode_tp=1, initial_prefill=3, initial_decode=1), sm.on_tick)
    ok = (res.ttft_s <= cfg.ttft_target_s) & (res.itl_s <= cfg.itl_target_s)
    late = [int((~ok[(trace.arrival_s >= s) & (trace.arrival_s < s + 60.0)]).sum()) for s in starts]
    return late, res.gpu_seconds
