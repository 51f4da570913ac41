"""Square-root staffing of the prefill pool (rule 7 of runtime/planner/state_machine.py).

Profile (hand-checkable): prefill 0.1 ms/token, so a 1000-token prompt takes 0.1 s; decode step
10 ms + 0.1 ms per sequence, KV 100k tokens per worker. Offered prefill load R = rate x 0.1 s
Erlangs; staffing = ceil(R + beta * sqrt(R)), R the maximum of the last ``prefill_level_window_ticks``.
"""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import PlannerSpec
from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig
from runtime.sim.fleet import FleetConfig, Trace, simulate
from tests.planner_builders import PROF, planner_cfg, tick


def cfg(**kw) -> PlannerConfig:  # noqa: ANN003
    # staffing settings the hand arithmetic below uses (defaults: test_planner_correction.py)
    return planner_cfg(**(dict(prefill_staffing_beta=1.5, prefill_level_window_ticks=2, target_utilization=0.9) | kw))


def test_staffing_adds_beta_times_the_square_root_of_the_load_by_hand():
    sm = PlannerStateMachine(cfg(), PROF)
    d = sm.on_tick(tick(30, 30.0))
    # R = 30 req/s x 0.1 s = 3 Erlangs -> 3 + 1.5 x sqrt(3) = 5.60 -> 6 (M/M/c alone: ceil(3 / 0.9) = 4)
    assert sm.staffing_prefill_replicas() == 6 and d.prefill_replicas == 6
    zero = PlannerStateMachine(cfg(prefill_staffing_beta=0.0), PROF)
    zero.on_tick(tick(30, 30.0))
    assert zero.staffing_prefill_replicas() == 3  # beta 0: the bare load
    off = PlannerStateMachine(cfg(prefill_staffing_beta=None), PROF)
    assert off.on_tick(tick(30, 30.0)).prefill_replicas == 4 and off.staffing_prefill_replicas() == 0


def test_headroom_share_shrinks_as_the_pool_grows():
    # square-root staffing: headroom beta * sqrt(R) is a falling share of R
    shares = []
    for rate in (10.0, 100.0, 400.0):
        sm = PlannerStateMachine(cfg(max_prefill=200, gpu_budget=400), PROF)
        sm.on_tick(tick(30, rate))
        r = rate * 0.1
        assert sm.staffing_prefill_replicas() == math.ceil(r + 1.5 * math.sqrt(r) - 1e-9)
        shares.append(sm.staffing_prefill_replicas() / r)
    assert shares == sorted(shares, reverse=True)


def test_level_is_the_maximum_of_the_last_ticks_then_follows_the_load_down():
    sm = PlannerStateMachine(cfg(scale_down_delay_s=30.0, cooldown_s=30.0), PROF, initial_prefill=1, initial_decode=1)
    seen = [sm.on_tick(tick(t, r)).prefill_replicas for t, r in ((30, 60.0), (60, 10.0), (90, 10.0), (120, 10.0))]
    # 60 req/s: R = 6 -> 6 + 1.5 x 2.449 = 9.67 -> 10; 10 req/s: R = 1 -> 2.5 -> 3 (M/M/c: 2).
    # t=60: the 2-tick level still holds R = 6; t=90: the 30-s scale-down window still holds t=60's 10;
    # t=120: down to 3
    assert seen == [10, 10, 10, 3]
    longer = PlannerStateMachine(cfg(scale_down_delay_s=30.0, cooldown_s=30.0, prefill_level_window_ticks=3), PROF,
                                 initial_prefill=1, initial_decode=1)
    seen3 = [longer.on_tick(tick(t, r)).prefill_replicas for t, r in ((30, 60.0), (60, 10.0), (90, 10.0), (120, 10.0))]
    assert seen3[-1] == 10 and seen3[:3] == [10, 10, 10]  # three ticks of memory: the 60 req/s tick is still in


def test_ttft_correction_rises_only_on_a_missed_slo_while_staffing_sizes_for_bursts():
    met = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    missed = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    for t in range(30, 330, 30):  # the model expects ~0.2 s
        met.on_tick(tick(t, 30.0, observed_ttft_p90_s=1.5))  # slow, but within the 2 s target
        missed.on_tick(tick(t, 30.0, observed_ttft_p90_s=3.0))  # target missed
    assert met.ttft_correction == pytest.approx(1.0)
    assert missed.ttft_correction == pytest.approx(2.0, rel=0.05)  # clamped at CORRECTION_MAX
    # the correction stretches the service time, so the staffing level rises with it: R = 3 x 2 = 6 -> 10
    assert missed.staffing_prefill_replicas() > met.staffing_prefill_replicas()


@pytest.mark.parametrize("field,value", [("prefill_staffing_beta", -0.5), ("prefill_level_window_ticks", 0)])
def test_bad_staffing_settings_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        cfg(**{field: value})
    with pytest.raises(ValueError, match=field):
        PlannerSpec(**{field: value})


def test_staffing_settings_flow_from_the_deployment_spec():
    spec = PlannerSpec(prefill_staffing_beta=2.0, prefill_level_window_ticks=4)
    assert (spec.prefill_staffing_beta, spec.prefill_level_window_ticks) == (2.0, 4)
    assert PlannerSpec(prefill_staffing_beta=None).prefill_staffing_beta is None
    defaults = PlannerSpec()
    ref = PlannerConfig()
    assert (defaults.prefill_staffing_beta, defaults.prefill_level_window_ticks) == (
        ref.prefill_staffing_beta, ref.prefill_level_window_ticks)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.0, 300.0), st.floats(0.0, 300.0), st.sampled_from([0.0, 0.5, 1.5, 3.0]), st.integers(1, 4))
def test_staffing_is_monotone_in_the_observed_load(r1, r2, beta, window):
    lo, hi = sorted((r1, r2))
    sizes = []
    for rate in (lo, hi):
        sm = PlannerStateMachine(cfg(prefill_staffing_beta=beta, prefill_level_window_ticks=window, max_prefill=200,
                                     gpu_budget=400), PROF)
        sm.on_tick(tick(30, rate))
        sizes.append(sm.staffing_prefill_replicas())
    assert sizes[0] <= sizes[1]


def test_staffing_planner_serves_a_clumped_trace_within_slo_on_the_simulator():
    # clumps: every second 8 requests arrive within 50 ms (like the bench's --rate-scale copies)
    rng = np.random.default_rng(3)
    seconds = np.arange(0, 600, 1.0)
    arr = np.sort(np.repeat(seconds, 8) + rng.uniform(0, 0.05, len(seconds) * 8))
    n = len(arr)
    tr = Trace(arr, np.full(n, 1000), np.full(n, 20))
    prof = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4,
                            kv_capacity_tokens=100_000, prefill_tp=2, decode_tp=4)
    c = PlannerConfig(prefill_tp=2, decode_tp=4, interval_s=10.0, worker_start_s=20.0, predictor="burst_quantile",
                      allow_aggregated=False, max_prefill=16, max_decode=8)
    sm = PlannerStateMachine(c, prof, initial_prefill=2, initial_decode=1)
    res = simulate(tr, prof, FleetConfig(prefill_tp=2, decode_tp=4, interval_s=10.0, worker_start_s=20.0,
                                         initial_prefill=2, initial_decode=1), sm.on_tick)
    assert res.slo_attainment(2.0, 0.05) >= 0.99
    # 8 req/s x 0.1 s = 0.8 Erlangs. Rule 11 replays each tick: a clump of 8 x 0.1 s on one worker clears
    # in 0.8 s, within the 1.8 s wait budget, so the measured beta is 0 and the configured one (below)
    # stays: 2 prefill workers at steady state
    assert sm.measured_beta() == 0.0
    assert sm.staffing_prefill_replicas() == 2 and sm.prefill == 2
    # configured beta scaled by dispersion: every 1-s bin holds exactly 8 arrivals, dispersion 0, beta scaled
    # by sqrt(floor 5 / ref 8): 0.8 + 1.65 x 0.791 x 0.894 = 1.97 -> 2
    scaled = PlannerStateMachine(replace(c, measure_burst=False), prof, initial_prefill=2, initial_decode=1)
    simulate(tr, prof, FleetConfig(prefill_tp=2, decode_tp=4, interval_s=10.0, worker_start_s=20.0,
                                   initial_prefill=2, initial_decode=1), scaled.on_tick)
    assert scaled.arrival_dispersion == pytest.approx(0.0, abs=1e-6)
    assert scaled.staffing_prefill_replicas() == 2
    # beta as given: 0.8 + 1.65 x 0.894 = 2.28 -> 3
    plain = PlannerStateMachine(replace(c, staffing_dispersion_ref=None, measure_burst=False), prof,
                                initial_prefill=2, initial_decode=1)
    simulate(tr, prof, FleetConfig(prefill_tp=2, decode_tp=4, interval_s=10.0, worker_start_s=20.0,
                                   initial_prefill=2, initial_decode=1), plain.on_tick)
    assert plain.prefill == 3


def test_launch_on_the_level_release_on_the_tick_by_hand():
    # rule 8: the staffing term launches only up to the count of the smoothed load (EWMA weight
    # 1 / lead_ticks = 1/3 with a 60 s start and 30 s ticks); a one-tick transient is not launched for
    from runtime.planner import sla

    kw = dict(prefill_staffing_beta=1.5, prefill_level_window_ticks=1, target_utilization=1.0,
              scale_down_delay_s=30.0, cooldown_s=30.0)
    sm = PlannerStateMachine(cfg(**kw), PROF, initial_prefill=3, initial_decode=1)
    assert sm.lead_ticks == 3
    for t in (30, 60, 90, 120):  # 10 req/s: R = 1 -> 1 + 1.5 = 2.5 -> 3
        assert sm.on_tick(tick(t, 10.0)).prefill_replicas == 3
    d = sm.on_tick(tick(150, 60.0))
    # the tick alone asks 6 + 1.5 x sqrt(6) = 9.67 -> 10; the level is 1 + (6 - 1) / 3 = 2.667 ->
    # 2.667 + 1.5 x 1.633 = 5.12 -> 6; the M/M/c term (on the 60 req/s just observed) still applies
    mmc = sla.prefill_replicas(60.0, 1000, PROF.prefill, ttft_budget_s=2.0 - 2 * 0.05, target_utilization=1.0)
    assert sm.staffing_prefill_replicas() == 10
    assert d.prefill_replicas == max(mmc, 6) < 10
    # release on the tick: back to 10 req/s, held one 30-s scale-down window, then down to 3
    assert [sm.on_tick(tick(t, 10.0)).prefill_replicas for t in (180, 210)] == [d.prefill_replicas, 3]
    # a sustained rise is followed: once 60 req/s has lasted lead_ticks = 3 ticks the count is the
    # tick's 10 (the least of the last 3 ticks, R = 6), before the EWMA alone would get there
    seen = [sm.on_tick(tick(t, 60.0)).prefill_replicas for t in range(240, 600, 30)]
    assert seen == sorted(seen) and seen[2] == 10 and seen[1] < 10
    # the old rule launches the transient's 10 at once
    old = PlannerStateMachine(cfg(**kw, scale_up_on_level=False), PROF, initial_prefill=3, initial_decode=1)
    for t in (30, 60, 90, 120):
        old.on_tick(tick(t, 10.0))
    assert old.on_tick(tick(150, 60.0)).prefill_replicas == 10


def test_launch_on_the_level_is_the_old_rule_when_workers_start_at_once():
    # worker_start_s 0: lead_ticks 1, EWMA weight 1, the level is the tick: identical decisions
    rates = [10.0, 10.0, 60.0, 10.0, 35.0, 80.0, 80.0, 5.0, 5.0, 40.0]
    runs = []
    for on_level in (True, False):
        sm = PlannerStateMachine(cfg(worker_start_s=0.0, scale_up_on_level=on_level), PROF, initial_prefill=2,
                                 initial_decode=1)
        runs.append([sm.on_tick(tick(30.0 * (k + 1), r)).prefill_replicas for k, r in enumerate(rates)])
    assert runs[0] == runs[1] and max(runs[0]) > 10
