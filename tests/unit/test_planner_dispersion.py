"""Rule 11 of runtime/planner/state_machine.py: square-root staffing scaled by the arrival dispersion.

The dispersion is the index of dispersion of the requests arriving per ~1-s bin of a tick, around
the tick's linear trend (residual variance / mean; runtime.planner.sla.arrival_dispersion); the
staffing coefficient becomes ``beta * sqrt(max(z, floor) / ref)``, ``z`` an EWMA (weight 0.3)
of the ticks' dispersions, each capped at 4 x ref.
Profile (hand-checkable): prefill 0.1 ms/token, so a 1000-token prompt occupies a worker 0.1 s.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.planner.sla import arrival_dispersion
from runtime.planner.state_machine import DISPERSION_EWMA, DISPERSION_SAMPLE_MAX, PlannerStateMachine
from runtime.planner.types import PlannerConfig, TickInput
from runtime.server.planner_loop import RequestWindow
from runtime.sim.fleet import FleetConfig, Trace, simulate, static_controller
from tests.planner_builders import PROF, planner_cfg
from tests.planner_builders import tick as planner_tick


def cfg(**kw) -> PlannerConfig:  # noqa: ANN003
    return planner_cfg(**(dict(max_prefill=200, gpu_budget=400, worker_start_s=0.0, prefill_staffing_beta=1.65,
                               staffing_dispersion_ref=8.0, staffing_dispersion_floor=5.0) | kw))


def tick(now_s: float, rate: float, dispersion: float | None) -> TickInput:
    return planner_tick(now_s, rate, arrival_dispersion=dispersion)


def test_dispersion_by_hand():
    # bins [0,1) [1,2) [2,3) [3,4): counts 1, 2, 0, 2, mean 1.25. Least-squares line over the bin index
    # (centred -1.5 .. 1.5): slope 0.5 / 5 = 0.1; residuals -0.1, 0.8, -1.3, 0.6 -> 2.7 / (4 - 2) / 1.25 = 1.08
    assert arrival_dispersion([0.5, 1.1, 1.5, 3.0, 3.9], 0.0, 4.0) == pytest.approx(1.08)
    # one arrival per bin: no variance
    assert arrival_dispersion([0.5, 1.5, 2.5, 3.5], 0.0, 4.0) == pytest.approx(0.0)
    # a steady ramp 1, 2, 3, 4 per bin lies on its trend: not burstiness
    assert arrival_dispersion([0.5, 1.2, 1.6, 2.1, 2.4, 2.7, 3.1, 3.3, 3.5, 3.7], 0.0, 4.0) == pytest.approx(0.0)
    # outside the interval: left out; any order; a numpy array as well as a list
    assert arrival_dispersion([-30.0, 3.9, -0.5, 0.5, 1.1, 1.5, 3.0, 4.2], 0.0, 4.0) == pytest.approx(1.08)
    assert arrival_dispersion(np.array([0.5, 1.1, 1.5, 3.0, 3.9]), 0.0, 4.0) == pytest.approx(1.08)
    # counts 0, 2, 0, 2, mean 1: slope 2 / 5 = 0.4; residuals -0.4, 1.2, -1.2, 0.4 -> 3.2 / 2 / 1 = 1.6
    assert arrival_dispersion([1.1, 1.5, 3.0, 3.9], 0.0, 4.0) == pytest.approx(1.6)
    assert arrival_dispersion([-0.5, 4.2], 0.0, 4.0) is None
    # fewer than 3 bins (a window of 2.5 s or less): no residual variance to measure; nothing arrived: None
    assert arrival_dispersion([0.2, 0.3, 1.4], 0.0, 2.0) is None
    assert arrival_dispersion([0.2, 1.3, 2.4], 0.0, 2.5) is None
    assert arrival_dispersion([], 0.0, 30.0) is None


def test_a_window_a_few_ms_long_has_no_near_empty_extra_bin():
    # the runtime drains a little after each interval: 30.02 s are 30 bins of 1.0007 s, not 31 bins
    regular = [i * 0.01 for i in range(3000)]  # 100 req/s, perfectly regular
    assert arrival_dispersion(regular, 0.0, 30.02) == pytest.approx(0.0, abs=0.05)
    rng = np.random.default_rng(2)
    poisson = np.sort(rng.uniform(0.0, 30.0, 6000))  # 200 req/s
    assert arrival_dispersion(poisson, 0.0, 30.02) == pytest.approx(arrival_dispersion(poisson, 0.0, 30.0), rel=0.1)
    assert arrival_dispersion(poisson, 0.0, 30.0) == pytest.approx(1.0, abs=0.4)


def test_dispersion_separates_poisson_from_clumps_but_not_a_ramp_from_poisson():
    rng = np.random.default_rng(0)
    poisson = np.sort(rng.uniform(0.0, 600.0, 6000))  # 10 req/s, Poisson
    clumped = np.sort(np.repeat(rng.uniform(0.0, 600.0, 600), 10) + rng.uniform(0.0, 0.5, 6000))  # 10 at once
    assert arrival_dispersion(poisson, 0.0, 600.0) == pytest.approx(1.0, abs=0.1)
    assert arrival_dispersion(clumped, 0.0, 600.0) > 7.0
    # Poisson ramping 1000 -> 1500 req/s within the window (thinning): ~1, not the ~18 of the raw variance
    t = np.sort(rng.uniform(0.0, 30.0, 60_000))
    ramp = t[rng.uniform(0.0, 1500.0, len(t)) < 1000.0 + 500.0 * t / 30.0]
    raw = np.bincount(ramp.astype(int), minlength=30)
    assert raw.var(ddof=1) / raw.mean() > 10.0  # what the variance around the mean reads
    assert arrival_dispersion(ramp, 0.0, 30.0) < 2.5  # ~1 give or take the sampling error of 30 bins


def test_staffing_beta_scales_with_the_square_root_of_the_dispersion_by_hand():
    sm = PlannerStateMachine(cfg(), PROF)
    assert sm.staffing_beta() == 1.65  # no dispersion reported yet: beta as given
    sm.on_tick(tick(30, 40.0, 32.0))
    # z = 32 (the first report, at the cap 4 x 8): beta 1.65 x sqrt(32 / 8) = 3.3;
    # R = 40 x 0.1 = 4 -> 4 + 3.3 x 2 = 10.6 -> 11
    assert sm.arrival_dispersion == pytest.approx(32.0)
    assert sm.staffing_beta() == pytest.approx(3.3)
    assert sm.staffing_prefill_replicas() == 11
    sm.on_tick(tick(60, 40.0, 2.0))
    # EWMA: 0.7 x 32 + 0.3 x 2 = 23; beta 1.65 x sqrt(23 / 8)
    assert sm.arrival_dispersion == pytest.approx((1 - DISPERSION_EWMA) * 32 + DISPERSION_EWMA * 2)
    assert sm.staffing_beta() == pytest.approx(1.65 * math.sqrt(23 / 8))


def test_smooth_arrivals_keep_the_floor():
    sm = PlannerStateMachine(cfg(), PROF)
    for t in range(30, 600, 30):
        sm.on_tick(tick(t, 40.0, 1.0))
    # z -> 1, below the floor 5: beta 1.65 x sqrt(5 / 8) = 1.304; R = 4 -> 4 + 1.304 x 2 = 6.61 -> 7
    assert sm.arrival_dispersion < 1.1
    assert sm.staffing_beta() == pytest.approx(1.65 * math.sqrt(5 / 8))
    assert sm.staffing_prefill_replicas() == 7
    # rule 11 off: beta 1.65 -> 4 + 3.3 = 7.3 -> 8
    off = PlannerStateMachine(cfg(staffing_dispersion_ref=None), PROF)
    off.on_tick(tick(30, 40.0, 1.0))
    assert off.staffing_beta() == 1.65 and off.staffing_prefill_replicas() == 8


def test_a_flash_crowd_moves_the_dispersion_a_bounded_step():
    sm = PlannerStateMachine(cfg(), PROF)
    sm.on_tick(tick(30, 40.0, 8.0))
    sm.on_tick(tick(60, 40.0, 1e6))  # one tick's clump: capped at 4 x ref = 32 before the EWMA
    assert sm.arrival_dispersion == pytest.approx(0.7 * 8.0 + 0.3 * DISPERSION_SAMPLE_MAX * 8.0)
    assert sm.staffing_beta() == pytest.approx(1.65 * math.sqrt(15.2 / 8))
    for t in range(90, 390, 30):
        sm.on_tick(tick(t, 40.0, 8.0))
    assert sm.staffing_beta() == pytest.approx(1.65, rel=0.02)  # ten ordinary ticks later: back
    # a reference so small that the ratio would overflow: beta scaled by at most sqrt(100)
    tiny = PlannerStateMachine(cfg(staffing_dispersion_ref=1e-300, staffing_dispersion_floor=1e300), PROF)
    tiny.on_tick(tick(30, 40.0, 5.0))
    assert tiny.staffing_beta() == pytest.approx(16.5) and tiny.staffing_prefill_replicas() == math.ceil(4 + 33)


def test_a_tick_with_fewer_than_two_requests_does_not_move_the_dispersion():
    sm = PlannerStateMachine(cfg(), PROF)
    sm.on_tick(tick(30, 40.0, 12.0))
    sm.on_tick(TickInput(now_s=60, interval_s=30.0, num_requests=1, mean_isl_tokens=1000, mean_osl_tokens=200,
                         arrival_dispersion=0.0))
    assert sm.arrival_dispersion == pytest.approx(12.0)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.0, 100.0), st.floats(0.0, 100.0), st.floats(0.5, 200.0))
def test_staffing_is_monotone_in_the_dispersion(z1, z2, rate):
    lo, hi = sorted((z1, z2))
    sizes = []
    for z in (lo, hi):
        sm = PlannerStateMachine(cfg(), PROF)
        sm.on_tick(tick(30, rate, z))
        sizes.append(sm.staffing_prefill_replicas())
    assert sizes[0] <= sizes[1]


def test_config_refuses_a_bad_reference_or_floor():
    for bad in (dict(staffing_dispersion_ref=0.0), dict(staffing_dispersion_ref=float("inf")),
                dict(staffing_dispersion_floor=-1.0), dict(staffing_dispersion_floor=float("nan"))):
        with pytest.raises(ValueError, match="staffing_dispersion"):
            cfg(**bad)
    with pytest.raises(ValueError, match="prefill_staffing_beta"):
        cfg(prefill_staffing_beta=1e308)  # would overflow the worker count
    with pytest.raises(ValueError, match="arrival_dispersion"):
        tick(30, 1.0, -0.5)


def test_the_simulator_reports_each_ticks_dispersion():
    rng = np.random.default_rng(1)
    clumps = np.repeat(rng.uniform(0.0, 120.0, 120), 8) + rng.uniform(0.0, 0.2, 960)  # 8 at once, 8 req/s
    arr = np.sort(clumps)
    n = len(arr)
    seen: list[float | None] = []

    def ctl(t: TickInput):
        seen.append(t.arrival_dispersion)
        return static_controller(4, 1)(t)

    simulate(Trace(arr, np.full(n, 1000), np.full(n, 10)), PROF,
             FleetConfig(prefill_tp=1, decode_tp=1, interval_s=30.0, worker_start_s=0.0, initial_prefill=4,
                         initial_decode=1), ctl)
    in_trace = [z for z in seen[:4] if z is not None]
    assert len(in_trace) == 4
    for k, z in enumerate(in_trace):  # each tick: the same as binning its arrivals by hand
        mine = arr[(arr >= 30 * k) & (arr < 30 * (k + 1))]
        assert z == pytest.approx(arrival_dispersion(mine, 30.0 * k, 30.0 * (k + 1)))
    assert min(in_trace) > 3.0  # clumps of 8: far above Poisson's 1


def test_the_runtime_window_reports_the_dispersion_of_its_arrivals():
    now = [100.0]
    w = RequestWindow(clock=lambda: now[0])
    for t in (100.2, 100.4, 100.6, 103.5):  # bins of [100, 104): 3, 0, 0, 1
        now[0] = t
        w.record_arrival(500)
    now[0] = 104.0
    stats = w.drain()
    assert stats.arrival_dispersion == pytest.approx(arrival_dispersion([0.2, 0.4, 0.6, 3.5], 0.0, 4.0))
    # mean 1, trend -3 / 5 = -0.6 per bin: residuals 1.1, -1.3, -0.7, 0.9 -> 4.2 / (4 - 2) / 1 = 2.1
    assert stats.arrival_dispersion == pytest.approx(2.1)


def test_the_runtime_window_bins_requests_by_when_they_arrived():
    now = [0.0]
    w = RequestWindow(clock=lambda: now[0])
    times = [k * 0.1 + 0.03 for k in range(300)]  # 10 req/s, perfectly regular, over [0, 30)
    for t in times:  # each recorded once tokenized, 50 ms after it came in
        now[0] = t + 0.05
        w.record_arrival(500, ago_s=0.05)
    now[0] = 30.0
    first = w.drain()
    assert first.num_requests == 300
    assert first.arrival_dispersion == pytest.approx(0.0)  # 10 arrivals in every bin
