"""Rule 11 of runtime.planner.state_machine: the decode pool's forecasts extrapolate an upward trend only
from a full trend window (``PlannerConfig.decode_trend_full_window``), prefill's from three ticks, and the
predictor knob behind it (``BurstQuantilePredictor(min_trend_points=...)``).

Profile (hand-checkable): prefill 0.1 ms/token; decode step 10 ms + 0.1 ms per sequence; KV 1M tokens.
"""

import pytest

from runtime.planner.predictors import MIN_TREND_POINTS, TREND_POINTS, BurstQuantilePredictor, make_predictor
from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig, PoolObservation, TickInput

PROF = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4,
                        kv_capacity_tokens=1_000_000)


def test_trend_needs_min_trend_points_by_hand():
    # 20, 44, 47: level mean(44, 47) = 45.5; least-squares slope over three points (47 - 20) / 2 = 13.5
    early = BurstQuantilePredictor(window=10, quantile=0.5)
    late = BurstQuantilePredictor(window=10, quantile=0.5, min_trend_points=TREND_POINTS)
    for v in (20.0, 44.0, 47.0):
        early.observe(v)
        late.observe(v)
    assert early.trend_forecast(2) == pytest.approx(45.5 + 2 * 13.5)
    assert late.trend_forecast(2) == pytest.approx(45.5)  # three points < six: the level alone
    for v in (50.0, 53.0, 56.0):  # a full window of six: the trend counts again
        late.observe(v)
    # x = 0..5, y = 20, 44, 47, 50, 53, 56: slope = sum((x - 2.5)(y - 45)) / 17.5 = 105 / 17.5 = 6.0
    assert late.trend_forecast(2) == pytest.approx(54.5 + 2 * 6.0)


@pytest.mark.parametrize("bad", [MIN_TREND_POINTS - 1, TREND_POINTS + 1, True, 3.0])
def test_bad_min_trend_points_is_refused(bad):
    with pytest.raises(ValueError, match="min_trend_points"):
        BurstQuantilePredictor(min_trend_points=bad)


def test_make_predictor_passes_min_trend_points_to_burst_quantile_only():
    p = make_predictor("burst_quantile", window=10, quantile=0.5, min_trend_points=TREND_POINTS)
    for v in (10.0, 20.0, 30.0):
        p.observe(v)
    assert p.predict(2) == pytest.approx(25.0)  # no trend yet
    make_predictor("moving_average", window=4, min_trend_points=TREND_POINTS)  # ignored, no error


def cfg(**kw) -> PlannerConfig:
    base = dict(mode="sla", prefill_tp=1, decode_tp=4, min_prefill=1, max_prefill=40, min_decode=1, max_decode=20,
                gpu_budget=256, interval_s=30.0, worker_start_s=60.0, predictor="burst_quantile",
                allow_aggregated=False, prefill_staffing_beta=None)
    return PlannerConfig(**(base | kw))


def run(sm: PlannerStateMachine, rates: list[float]) -> list[tuple[int, int]]:
    out = []
    for i, rate in enumerate(rates):
        d = sm.on_tick(TickInput(now_s=30.0 * (i + 1), interval_s=30.0, num_requests=round(rate * 30),
                                 mean_isl_tokens=1000, mean_osl_tokens=2000,
                                 prefill=PoolObservation(num_ready=sm.prefill),
                                 decode=PoolObservation(num_ready=sm.decode, running_per_worker=50)))
        out.append((d.prefill_replicas, d.decode_replicas))
    return out


def test_one_low_first_tick_launches_no_decode_worker():
    # the Azure trace's first minute: one low tick, then a steady rate; three points read as a steep ramp
    rates = [2.0, 4.4, 4.7, 4.6, 4.5]
    full = run(PlannerStateMachine(cfg(), PROF, initial_prefill=2, initial_decode=1), rates)
    three = run(PlannerStateMachine(cfg(decode_trend_full_window=False), PROF, initial_prefill=2, initial_decode=1),
                rates)
    steady = run(PlannerStateMachine(cfg(), PROF, initial_prefill=2, initial_decode=1), [4.6] * 5)
    assert max(d for _, d in three) > max(d for _, d in full)  # the 3-point slope launched decode
    assert max(d for _, d in full) == max(d for _, d in steady)  # the full-window rule sizes for the level
    assert [p for p, _ in full] == [p for p, _ in three]  # prefill still extrapolates from three ticks


def test_a_sustained_ramp_still_grows_decode_ahead_of_the_load():
    # once six ticks exist the decode forecast carries the trend: it plans above the last observed rate
    rates = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    full = run(PlannerStateMachine(cfg(), PROF, initial_prefill=2, initial_decode=1), rates)
    three = run(PlannerStateMachine(cfg(decode_trend_full_window=False), PROF, initial_prefill=2, initial_decode=1),
                rates)
    assert full[-1][1] == three[-1][1]  # a full window: the same forecast as from three ticks
    no_trend = run(PlannerStateMachine(cfg(predictor="moving_average", predictor_window_ticks=1), PROF,
                                       initial_prefill=2, initial_decode=1), rates)
    assert full[-1][1] > no_trend[-1][1]  # and it is ahead of the tick's own rate
