"""Prefill service-time correction from the engines' observed prefill time, and the default staffing
settings (one-tick Erlang level, beta 1.65, M/M/c up to 100 % utilisation).

Profile (hand-checkable): prefill 0.1 ms/token, so a 1000-token prompt takes 0.1 s; decode step
10 ms + 0.1 ms per sequence, KV 100k tokens per worker. Offered prefill load R = rate x 0.1 s.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import PlannerSpec
from runtime.planner.state_machine import CORRECTION_MAX, CORRECTION_MIN, PlannerStateMachine
from runtime.planner.types import PlannerConfig, TickInput
from runtime.sim.fleet import FleetConfig, Trace, simulate, static_controller
from tests.planner_builders import PROF, tick
from tests.planner_builders import planner_cfg as cfg


def test_defaults_are_the_documented_staffing_settings():
    c, spec = PlannerConfig(), PlannerSpec()
    assert (c.prefill_staffing_beta, c.prefill_level_window_ticks, c.target_utilization) == (1.65, 1, 1.0)
    assert (spec.prefill_staffing_beta, spec.prefill_level_window_ticks, spec.target_utilization) == (1.65, 1, 1.0)
    assert c.correct_by_prefill_time and c.scale_up_on_level


def test_staffing_by_hand_with_the_default_beta():
    sm = PlannerStateMachine(cfg(), PROF)
    d = sm.on_tick(tick(30, 20.0))
    # 20 req/s x 0.1 s = 2 Erlangs -> 2 + 1.65 x sqrt(2) = 4.33 -> 5 (beta 1.4 would give 3.98 -> 4);
    # the first tick is the smoothed level too, so all five are launched
    assert sm.staffing_prefill_replicas() == 5 and d.prefill_replicas == 5
    old = PlannerStateMachine(cfg(prefill_staffing_beta=1.5), PROF)
    old.on_tick(tick(30, 20.0))
    assert old.staffing_prefill_replicas() == 5


def test_one_tick_level_follows_the_load_down_after_the_scale_down_delay():
    sm = PlannerStateMachine(cfg(scale_down_delay_s=30.0, cooldown_s=30.0), PROF, initial_prefill=1, initial_decode=1)
    seen = [sm.on_tick(tick(t, r)).prefill_replicas for t, r in ((30, 60.0), (60, 10.0), (90, 10.0))]
    # 60 req/s: R = 6 -> 6 + 1.65 x 2.449 = 10.04 -> 11; 10 req/s: R = 1 -> 2.65 -> 3 (M/M/c: 2).
    # t=60: the level already forgot R = 6 but the 30-s scale-down window holds t=30's 11; t=90: 3
    assert seen == [11, 11, 3]


def test_prefill_time_correction_by_hand_and_queueing_does_not_raise_it():
    sm = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    sm.on_tick(tick(30, 30.0, observed_prefill_time_mean_s=0.2, observed_ttft_p90_s=0.3))
    # sample 0.2 s / 0.1 s = 2 -> EWMA 0.7 x 1 + 0.3 x 2 = 1.3
    assert sm.ttft_correction == pytest.approx(1.3)
    for t in range(60, 600, 30):
        sm.on_tick(tick(t, 30.0, observed_prefill_time_mean_s=0.2))
    assert sm.ttft_correction == pytest.approx(2.0, rel=1e-3)  # engines 2x slower than the profile
    burst = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    for t in range(30, 330, 30):  # TTFT 5 s from queueing behind a burst; the engines prefill at profile speed
        burst.on_tick(tick(t, 30.0, observed_prefill_time_mean_s=0.1, observed_ttft_p90_s=5.0))
    assert burst.ttft_correction == pytest.approx(1.0)
    by_ttft = PlannerStateMachine(cfg(correct_by_prefill_time=False), PROF, initial_prefill=4, initial_decode=2)
    for t in range(30, 330, 30):
        by_ttft.on_tick(tick(t, 30.0, observed_prefill_time_mean_s=0.1, observed_ttft_p90_s=5.0))
    assert by_ttft.ttft_correction == pytest.approx(CORRECTION_MAX, rel=0.05)  # the TTFT route reads it as slowness


def test_negative_prefill_time_is_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="observed_prefill_time_mean_s"):
        tick(30, 1.0, observed_prefill_time_mean_s=-0.1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 30.0)), min_size=1, max_size=25))
def test_correction_stays_clamped_and_ignores_ttft_when_prefill_time_is_reported(samples):
    """Invariants: the prefill correction stays in [CORRECTION_MIN, CORRECTION_MAX] for any observed
    prefill times; it depends only on the observed prefill times, never on the observed TTFT."""
    a = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    b = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    for k, (pt, ttft) in enumerate(samples):
        t = 30.0 * (k + 1)
        a.on_tick(tick(t, 30.0, observed_prefill_time_mean_s=pt, observed_ttft_p90_s=ttft))
        b.on_tick(tick(t, 30.0, observed_prefill_time_mean_s=pt, observed_ttft_p90_s=0.1))
        assert CORRECTION_MIN - 1e-9 <= a.ttft_correction <= CORRECTION_MAX + 1e-9
        assert a.ttft_correction == pytest.approx(b.ttft_correction)


def test_simulator_reports_the_engines_prefill_time():
    seen: list[TickInput] = []
    ctl = static_controller(1, 1)

    def record(t: TickInput):
        seen.append(t)
        return ctl(t)

    # two 1000-token prompts at 1 s and 2 s on one prefill worker, engines 2x slower than the profile:
    # each prefill takes 0.2 s and finishes in the first 10-s tick; the second tick has none
    tr = Trace(np.array([1.0, 2.0, 15.0]), np.array([1000, 1000, 1000]), np.array([2, 2, 2]))
    simulate(tr, PROF, FleetConfig(prefill_tp=1, decode_tp=1, interval_s=10.0, slowdown=2.0), record)
    assert seen[0].observed_prefill_time_mean_s == pytest.approx(0.2)
    assert seen[1].observed_prefill_time_mean_s == pytest.approx(0.2)  # the 15 s request
    assert all(t.observed_prefill_time_mean_s is None for t in seen[2:])


def test_a_burst_on_the_simulator_no_longer_inflates_the_prefill_correction():
    rng = np.random.default_rng(3)
    steady = np.sort(rng.uniform(0, 600, 6000))  # 10 req/s x 0.1 s = 1 Erlang
    burst = np.full(400, 300.0) + np.sort(rng.uniform(0, 2, 400))  # 40 s of prefill work within 2 s
    arr = np.sort(np.concatenate([steady, burst]))
    tr = Trace(arr, np.full(len(arr), 1000), np.full(len(arr), 20))
    fleet = FleetConfig(prefill_tp=1, decode_tp=1, interval_s=30.0, worker_start_s=60.0, initial_prefill=3,
                        initial_decode=2)
    by_time = PlannerStateMachine(cfg(), PROF, initial_prefill=3, initial_decode=2)
    by_ttft = PlannerStateMachine(cfg(correct_by_prefill_time=False), PROF, initial_prefill=3, initial_decode=2)
    peak = {"time": 1.0, "ttft": 1.0}
    for name, sm in (("time", by_time), ("ttft", by_ttft)):
        def ctl(t: TickInput, sm=sm, name=name):
            d = sm.on_tick(t)
            peak[name] = max(peak[name], sm.ttft_correction)
            return d
        res = simulate(tr, PROF, fleet, ctl)
        assert np.nanmax(res.ttft_s) > 2.0  # the burst does miss the TTFT target
    assert peak["time"] == pytest.approx(1.0, abs=1e-6)  # profile-speed engines: nothing to correct
    assert peak["ttft"] > 1.1  # the TTFT route mistakes the burst's queueing for slow engines (observed: 1.18)
