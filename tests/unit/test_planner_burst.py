"""Measured burst headroom (rule 11 of runtime/planner/state_machine.py): each tick's arrivals are
replayed on candidate prefill pools (runtime.planner.sla.burst_misses) and the staffing coefficient is
the least that serves all but ``1 - slo_quantile`` of the requests that can meet the TTFT in time.

Profile (hand-checkable): prefill 0.1 ms/token, so a 5000-token prompt occupies a worker 0.5 s.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.planner.sla import burst_misses
from runtime.planner.state_machine import BURST_BETA_MAX, PlannerStateMachine
from runtime.planner.types import PlannerConfig, PoolObservation, TickInput
from runtime.sim.fleet import FleetConfig, Trace, simulate
from tests.planner_builders import PROF, planner_cfg
from tests.planner_builders import tick as planner_tick


def cfg(**kw) -> PlannerConfig:  # noqa: ANN003
    return planner_cfg(**({"max_prefill": 60, "gpu_budget": 100} | kw))


def tick(now_s: float, arrivals: list[float], isl: int = 5000) -> TickInput:
    return planner_tick(now_s, len(arrivals) / 30.0, isl=isl, osl=50,
                        prompt_arrivals=tuple((t, isl) for t in arrivals))


def test_burst_misses_by_hand():
    # four requests at once, each 1 s of work, 0.5 s of slack: c workers leave 4 - c of them late
    assert burst_misses([0, 0, 0, 0], [1, 1, 1, 1], [0.5] * 4, 1, 10) == [3, 2, 1, 0]
    # spaced a whole service time apart nobody waits
    assert burst_misses([0, 1, 2, 3], [1, 1, 1, 1], [0.5] * 4, 1, 10) == [0]
    # a request with negative slack (its own prefill exceeds the budget) never counts
    assert burst_misses([0, 0], [1, 1], [0.5, -1.0], 1, 10) == [0]
    # stops at max_servers, order of the input does not matter
    assert burst_misses([3, 0, 0, 0], [1, 1, 1, 1], [0.5] * 4, 1, 2) == [2, 1]
    with pytest.raises(ValueError):
        burst_misses([0], [1], [1], 0, 3)
    with pytest.raises(ValueError):
        burst_misses([0, 1], [1], [1], 1, 3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 30), st.floats(0.01, 2.0), st.floats(-0.5, 2.0)), min_size=1, max_size=60))
def test_more_workers_never_leave_more_requests_late(reqs):
    arr, occ, slack = zip(*reqs)
    late = burst_misses(arr, occ, slack, 1, 80)
    assert late == sorted(late, reverse=True)
    assert late[-1] == 0 or len(late) == 80
    assert late[0] <= sum(s >= 0 for s in slack)


def _clumped(rate: float, clump: int, rng) -> list[float]:
    """Poisson clumps of ``clump`` simultaneous requests, ``rate`` requests/s over 30 s."""
    starts = np.sort(rng.uniform(0, 30, int(rate * 30 / clump)))
    return sorted(float(t) for t in np.repeat(starts, clump))


def test_clumped_arrivals_measure_more_headroom_than_poisson_at_the_same_load():
    rng = np.random.default_rng(0)
    betas, pools = {}, {}
    for clump in (1, 4, 16):
        sm = PlannerStateMachine(cfg(), PROF)
        for k in range(1, 11):
            arr = [30.0 * k + t for t in _clumped(8.0, clump, rng)]
            sm.on_tick(tick(30.0 * (k + 1), arr))
        betas[clump], pools[clump] = sm.measured_beta(), sm.staffing_prefill_replicas()
    assert betas[1] < betas[4] < betas[16] <= BURST_BETA_MAX
    # the configured beta (scaled by dispersion) is the floor: Poisson and small clumps stay on it, large
    # clumps measure more and raise the pool above it
    assert pools[1] <= pools[4] < pools[16]
    # R = 8 req/s x 0.5 s = 4 Erlangs; the staffed pool is ceil(R + beta sqrt(R)), beta the larger one
    assert betas[16] > 1.65 * math.sqrt(4 * 8 / 8.0)  # above the floor at dispersion <= 4 x the reference
    assert pools[16] == math.ceil(4.0 + betas[16] * 2.0 - 1e-9)


def test_the_measured_beta_meets_the_slo_quantile_on_the_replayed_ticks():
    rng = np.random.default_rng(1)
    for q in (0.9, 0.99):
        sm = PlannerStateMachine(cfg(slo_quantile=q), PROF)
        ticks = [[30.0 * k + t for t in _clumped(8.0, 4, rng)] for k in range(1, 11)]
        for k, arr in enumerate(ticks, start=1):
            sm.on_tick(tick(30.0 * (k + 1), arr))
        beta = sm.measured_beta()
        budget = 2.0 - 2 * 0.05 - 0.5  # TTFT budget less the prompt's own prefill

        def late(b: float) -> int:
            c = math.ceil(4.0 + b * 2.0 - 1e-9)
            return sum(burst_misses(arr, [0.5] * len(arr), [budget] * len(arr), c, c)[0] for arr in ticks)

        n = sum(len(a) for a in ticks)
        assert late(beta) <= (1 - q) * n
        if beta > 0:  # the least such beta: one step less leaves too many late
            assert late(beta - 0.05) > (1 - q) * n or math.ceil(4 + (beta - 0.05) * 2 - 1e-9) == math.ceil(
                4 + beta * 2 - 1e-9)


def test_without_arrivals_or_switched_off_the_configured_beta_stays():
    sm = PlannerStateMachine(cfg(), PROF)
    sm.on_tick(TickInput(now_s=30, interval_s=30.0, num_requests=240, mean_isl_tokens=5000, mean_osl_tokens=50,
                         prefill=PoolObservation(num_ready=4), decode=PoolObservation(num_ready=2)))
    assert sm.measured_beta() is None
    off = PlannerStateMachine(cfg(measure_burst=False), PROF)
    off.on_tick(tick(60, [30.0 + t for t in _clumped(8.0, 16, np.random.default_rng(2))]))
    assert off.measured_beta() is None
    with pytest.raises(ValueError, match="prompt_arrivals"):
        TickInput(now_s=1, interval_s=30.0, num_requests=1, mean_isl_tokens=1, mean_osl_tokens=1,
                  prompt_arrivals=((float("nan"), 10.0),))


def test_simulator_hands_the_planner_each_ticks_arrivals():
    arr = np.array([1.0, 2.0, 31.0, 40.0, 41.0])
    tr = Trace(arr, np.array([100, 200, 300, 400, 500]), np.array([5, 5, 5, 5, 5]))
    seen = []

    def ctl(t: TickInput):
        seen.append(t.prompt_arrivals)

    simulate(tr, PROF, FleetConfig(prefill_tp=1, decode_tp=1, initial_prefill=1, initial_decode=1), ctl)
    assert seen[0] == ((1.0, 100), (2.0, 200))
    assert seen[1] == ((31.0, 300), (40.0, 400), (41.0, 500))


def test_least_pool_by_hand_and_against_the_late_counts():
    from runtime.planner.sla import least_pool

    # four at once, 1 s each, 0.5 s slack: 4 workers serve all, 3 leave one late (25 %)
    assert least_pool([0, 0, 0, 0], [1, 1, 1, 1], [0.5] * 4, 0.0) == 4
    assert least_pool([0, 0, 0, 0], [1, 1, 1, 1], [0.5] * 4, 0.25) == 3
    assert least_pool([0, 0], [1, 1], [-1.0, -1.0], 0.0) == 0  # nobody can be served in time
    rng = np.random.default_rng(4)
    for _ in range(20):
        n = int(rng.integers(2, 80))
        arr, occ, slack = rng.uniform(0, 30, n), rng.uniform(0.05, 2.0, n), rng.uniform(-0.2, 1.5, n)
        counts = burst_misses(arr, occ, slack, 1, n)
        share = float(rng.uniform(0, 0.2))
        allowed = share * int(np.sum(slack >= 0))
        want = next((c for c, late in enumerate(counts, start=1) if late <= allowed), n)
        assert least_pool(arr, occ, slack, share) == (want if np.any(slack >= 0) else 0)
        # from a lower bound: the larger of it and the least pool (the planner's longer window)
        k = int(rng.integers(1, n + 3))
        assert least_pool(arr, occ, slack, share, at_least=k) == max(k, want if np.any(slack >= 0) else 0)
    with pytest.raises(ValueError, match="at_least"):
        least_pool([0.0], [1.0], [1.0], 0.0, at_least=-1)


def test_bursts_shorter_than_a_worker_start_keep_the_pool_at_what_they_needed():
    # 20 s bursts of 8 req/s every 120 s over a base of 1 req/s: by the low phase the pool still holds
    # what the last window's bursts needed, though the tick's own load asks for 1 worker
    rng = np.random.default_rng(5)
    sm = PlannerStateMachine(cfg(), PROF)
    for k in range(1, 13):
        t0 = 30.0 * k
        base = list(rng.uniform(t0, t0 + 30, 30))
        burst = list(rng.uniform(t0, t0 + 20, 160)) if k % 4 == 0 else []
        d = sm.on_tick(tick(t0 + 30, sorted(base + burst)))
    # last tick (k = 12) was a burst tick: the window (10 ticks) holds 2 bursts; after 2 low ticks...
    for k in (13, 14):
        t0 = 30.0 * k
        d = sm.on_tick(tick(t0 + 30, sorted(rng.uniform(t0, t0 + 30, 30))))
    assert sm.window_pool >= 4  # 8 req/s x 0.5 s = 4 Erlangs in a burst
    assert d.prefill_replicas >= sm.window_pool
    off = PlannerStateMachine(cfg(measure_burst=False), PROF)
    assert off.window_pool == 0


def test_the_runtime_window_hands_each_request_with_its_arrival_time_and_prompt():
    from runtime.server.planner_loop import RequestWindow

    now = [100.0]
    w = RequestWindow(clock=lambda: now[0])
    now[0] = 101.0
    w.record_arrival(500)
    now[0] = 103.0
    w.record_arrival(7000, ago_s=1.5)  # learnt after routing: it arrived at 101.5
    stats = w.drain()
    assert stats.prompt_arrivals == ((101.0, 500.0), (101.5, 7000.0))
    assert w.drain().prompt_arrivals is None  # an empty window reports none
