"""Hindsight oracles for the fleet simulator (runtime.sim.fleet): the smallest fleets that, knowing a
trace's arrivals exactly, would have served it within the SLOs. They are the reference the planner
benchmark (bench/planner.py) measures controllers' GPU time against. Pure: no clock, no I/O.

* :func:`oracle_gpu_seconds`: each window sized on its own, from empty (a relaxation: it ignores what
  windows leave each other).
* :func:`sequential_oracle`: windows sized greedily in order on one running simulation (a feasible
  reference; its attainment is measured by the replay).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable

import numpy as np

from runtime.planner.profiles import ServiceProfile
from runtime.planner.types import ScalingDecision, TickInput
from runtime.sim.fleet import FleetConfig, FleetSim, SimResult, Trace, simulate, static_controller


def _min_count(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """Smallest n in [lo, hi] with ok(n) (ok monotone); hi if none."""
    if ok(lo):
        return lo
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _fewest_gpus(
    run: Callable[[int, int], float], attainment: float, prefill_tp: int, decode_tp: int, max_replicas: int,
) -> tuple[int, int]:
    """The oracles' search over (prefill, decode) workers, ``run`` giving the attainment of each: the
    fewest prefill workers with ample decode, then the fewest decode workers for them, then
    :func:`_trade_prefill_for_decode`. When even ``max_replicas`` of each cannot reach ``attainment``
    the goal becomes what they reach (the fewest GPUs that do as well), not the largest fleet."""
    attainment = min(attainment, run(max_replicas, max_replicas))
    p = _min_count(lambda k: run(k, max_replicas) >= attainment, 1, max_replicas)
    d = _min_count(lambda k: run(p, k) >= attainment, 1, max_replicas)
    if run(p, d) < attainment:
        p = _min_count(lambda k: run(k, d) >= attainment, p, max_replicas)
    return _trade_prefill_for_decode(run, p, d, attainment, prefill_tp, decode_tp, max_replicas)


ORACLE_MAX_EXTRA_PREFILL = 8  # prefill workers above the minimum the oracle tries trading for decode


def _trade_prefill_for_decode(
    run: Callable[[int, int], float], p: int, d: int, attainment: float, prefill_tp: int, decode_tp: int,
    max_replicas: int,
) -> tuple[int, int]:
    """From a feasible (p, d), try ``p + 1 ...`` prefill workers (at most ``ORACLE_MAX_EXTRA_PREFILL``
    more, while they could still save GPUs) each with its fewest decode workers; keep the fewest GPUs."""
    best, best_gpus = (p, d), p * prefill_tp + d * decode_tp
    for p2 in range(p + 1, min(p + ORACLE_MAX_EXTRA_PREFILL, max_replicas) + 1):
        if p2 * prefill_tp + decode_tp >= best_gpus:
            break
        d2 = _min_count(lambda k: run(p2, k) >= attainment, 1, best[1])
        gpus = p2 * prefill_tp + d2 * decode_tp
        if gpus < best_gpus and run(p2, d2) >= attainment:
            best, best_gpus = (p2, d2), gpus
    return best


def oracle_gpu_seconds(
    trace: Trace,
    profile: ServiceProfile,
    cfg: FleetConfig,
    *,
    ttft_target_s: float,
    itl_target_s: float,
    interval_s: float = 60.0,
    attainment: float = 0.99,
    max_replicas: int = 64,
) -> tuple[float, list[tuple[int, int]]]:
    """Hindsight relaxation: for each ``interval_s`` window sized from empty, the (prefill, decode)
    workers with the fewest GPUs that, started warm and ready, serve that window's requests with
    ``attainment`` of them within both SLOs; GPU-seconds summed over the windows. It ignores what
    windows leave each other (queued prefills, sequences still decoding), so its plan, replayed, can
    miss the SLO (see :func:`sequential_oracle`). Returns (gpu_seconds, [(prefill, decode)]).

    Search: the fewest prefill workers with ample decode, then the fewest decode workers for them,
    then :func:`_trade_prefill_for_decode` (a window whose TTFT sits at the attainment boundary can
    need many decode workers with the fewest prefill workers and few with one prefill worker more)."""
    iso = replace(cfg, worker_start_s=0.0, interval_s=interval_s)
    total, plan = 0.0, []
    t = 0.0
    span = float(trace.arrival_s[-1]) if len(trace) else 0.0
    while t < span or (not plan and len(trace)):  # all arrivals at one instant: one window
        sub = trace.window(t, t + interval_s)
        length = min(interval_s, span - t)
        if len(sub) == 0:
            p, d = 0, 1
        else:
            @functools.lru_cache(maxsize=None)
            def run(p: int, d: int) -> float:
                c = replace(iso, initial_prefill=p, initial_decode=d)
                return simulate(sub, profile, c, static_controller(p, d)).slo_attainment(ttft_target_s, itl_target_s)

            p, d = _fewest_gpus(run, attainment, cfg.prefill_tp, cfg.decode_tp, max_replicas)
        plan.append((p, d))
        total += (p * cfg.prefill_tp + d * cfg.decode_tp) * length
        t += interval_s
    return total, plan


def sequential_oracle(
    trace: Trace,
    profile: ServiceProfile,
    cfg: FleetConfig,
    *,
    ttft_target_s: float,
    itl_target_s: float,
    interval_s: float = 60.0,
    attainment: float = 0.99,
    max_replicas: int = 64,
) -> tuple[SimResult, list[tuple[int, int]]]:
    """Hindsight plan sized window by window, greedily and in order, on one running simulation: each
    window from the state the previous ones left (queued prefills, sequences still decoding, workers
    draining), knowing its arrivals exactly, with workers ready the moment they are asked for (no
    start lag). A feasible reference rather than a proven minimum: its replay's attainment is
    measured (the returned result), not guaranteed, and a plan trading windows against each other
    could cost less.

    For window ``[t, t + interval_s)`` the judged requests are those that arrived before its end, have
    not finished at ``t`` and have not already missed the TTFT target (no first token and older than
    the target, or a first token later than it: no fleet can save them, and they must not count
    against every window they still run in). Each candidate (prefill, decode) is tried on a copy of
    the simulation with no later arrivals, held until the judged requests finish, and the fewest
    GPUs with ``attainment`` of them within both SLOs are kept (:func:`_fewest_gpus`, as in
    :func:`oracle_gpu_seconds`). Returns (the replay's :class:`SimResult`, GPU time accounted as for
    any controller, its timeline entry at ``t`` holding the plan of the window from ``t``; the plan
    ``[(prefill, decode)]`` per window)."""
    iso = replace(cfg, worker_start_s=0.0, interval_s=interval_s, initial_prefill=1, initial_decode=1)
    sim = FleetSim(trace, profile, iso)
    arr, osl = trace.arrival_s, trace.osl_tokens
    plan: list[tuple[int, int]] = []

    def keep(_tick: TickInput) -> None:
        return None

    def decide(t: float, p: int, d: int) -> ScalingDecision:
        return ScalingDecision(now_s=t, prefill_replicas=p, decode_replicas=d)

    while not sim.done and (sim.t_s < sim.span_s or (not plan and len(trace))):
        t0 = sim.t_s
        hi = int(np.searchsorted(arr, t0 + interval_s, side="left"))
        first_now, arr_now = sim.first_s[:hi], arr[:hi]
        missed = np.where(np.isnan(first_now), t0 - arr_now > ttft_target_s, first_now - arr_now > ttft_target_s)
        judged = np.flatnonzero(np.isnan(sim.finish_s[:hi]) & ~missed)
        if len(judged) == 0:
            p, d = 0, 1
        else:
            @functools.lru_cache(maxsize=None)
            def run(p: int, d: int) -> float:
                s = sim.clone()
                s.arrival_limit = hi
                s._apply(t0, decide(t0, p, d))
                while not np.all(np.isfinite(s.finish_s[judged])) and s.step(keep):
                    pass
                first, fin = s.first_s[judged], s.finish_s[judged]
                o = osl[judged]
                itl = np.where(o > 1, (fin - first) / np.maximum(o - 1, 1), 0.0)
                ok = (first - arr[judged] <= ttft_target_s) & (itl <= itl_target_s) & np.isfinite(fin)
                return float(np.mean(ok))

            p, d = _fewest_gpus(run, attainment, cfg.prefill_tp, cfg.decode_tp, max_replicas)
        plan.append((p, d))
        sim._apply(t0, decide(t0, p, d))
        if sim.timeline:  # the entry at t0 holds from t0: this window's fleet
            sim.timeline[-1].update(prefill=len(sim.prefill), decode=sum(1 for w in sim.decode if not w.draining))
        sim.step(keep)
    while sim.step(keep):
        pass
    return sim.result(), plan
