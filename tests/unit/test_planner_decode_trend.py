"""Rule 11 of runtime.planner.state_machine: the decode pool's forecasts count the least-squares trend less
``PlannerConfig.decode_trend_se_discount`` standard errors of it, prefill's the whole trend; and the predictor
knob behind it (``BurstQuantilePredictor(trend_se_discount=...)``).

Profile (hand-checkable): prefill 0.1 ms/token; decode step 10 ms + 0.1 ms per sequence; KV 1M tokens.
"""

import math

import pytest

from runtime.planner.predictors import BurstQuantilePredictor, make_predictor
from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig, PoolObservation, TickInput

PROF = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4,
                        kv_capacity_tokens=1_000_000)


def fed(values, **kw) -> BurstQuantilePredictor:
    p = BurstQuantilePredictor(window=10, quantile=0.5, **kw)
    for v in values:
        p.observe(v)
    return p


def test_discounted_trend_by_hand():
    # 20, 44, 47 at x = 0, 1, 2: slope (47 - 20) / 2 = 13.5, intercept 37 - 13.5 = 23.5; fitted 23.5, 37, 50.5;
    # residuals -3.5, 7, -3.5: SSE 73.5 over k - 2 = 1 degree of freedom, sum (x - 1)^2 = 2: SE sqrt(36.75) = 6.062
    level = (44.0 + 47.0) / 2
    assert fed([20.0, 44.0, 47.0]).trend_forecast(2) == pytest.approx(level + 2 * 13.5)
    assert fed([20.0, 44.0, 47.0], trend_se_discount=0.5).trend_forecast(2) == pytest.approx(
        level + 2 * (13.5 - 0.5 * math.sqrt(36.75)))
    # a clean ramp has no residual: nothing is discounted
    assert fed([10.0, 20.0, 30.0], trend_se_discount=0.5).trend_forecast(2) == pytest.approx(25.0 + 2 * 10.0)
    # a discount larger than the slope leaves the level (only upward trends count)
    assert fed([20.0, 44.0, 47.0], trend_se_discount=3.0).trend_forecast(2) == pytest.approx(level)


@pytest.mark.parametrize("bad", [-0.5, math.inf, math.nan, True, "0.5"])
def test_bad_trend_se_discount_is_refused(bad):
    with pytest.raises(ValueError, match="trend_se_discount"):
        BurstQuantilePredictor(trend_se_discount=bad)


def test_make_predictor_passes_the_discount_to_burst_quantile_only():
    p = make_predictor("burst_quantile", window=10, quantile=0.5, trend_se_discount=3.0)
    for v in (20.0, 44.0, 47.0):
        p.observe(v)
    assert p.predict(2) == pytest.approx(45.5)
    make_predictor("moving_average", window=4, trend_se_discount=3.0)  # no trend term: ignored, no error


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_bad_decode_trend_se_discount_is_a_config_error(bad):
    with pytest.raises(ValueError, match="decode_trend_se_discount"):
        PlannerConfig(decode_trend_se_discount=bad)


def cfg(**kw) -> PlannerConfig:
    base = dict(mode="sla", prefill_tp=1, decode_tp=4, min_prefill=1, max_prefill=40, min_decode=1, max_decode=20,
                gpu_budget=256, interval_s=30.0, worker_start_s=60.0, predictor="burst_quantile",
                allow_aggregated=False, prefill_staffing_beta=None)
    return PlannerConfig(**(base | kw))


def run(rates: list[float], **kw) -> list[tuple[int, int]]:
    sm = PlannerStateMachine(cfg(**kw), PROF, initial_prefill=2, initial_decode=1)
    out = []
    for i, rate in enumerate(rates):
        d = sm.on_tick(TickInput(now_s=30.0 * (i + 1), interval_s=30.0, num_requests=round(rate * 30),
                                 mean_isl_tokens=1000, mean_osl_tokens=4000,
                                 prefill=PoolObservation(num_ready=sm.prefill),
                                 decode=PoolObservation(num_ready=sm.decode, running_per_worker=50)))
        out.append((d.prefill_replicas, d.decode_replicas))
    return out


def test_a_step_read_as_a_ramp_launches_one_decode_worker_fewer():
    # the Azure trace's first minute: one low tick, then a level rate; three points read as a steep ramp
    rates = [1.72, 4.0, 4.24, 4.16, 4.08]
    discounted, whole = run(rates), run(rates, decode_trend_se_discount=0.0)
    assert max(d for _, d in discounted) < max(d for _, d in whole)
    assert [p for p, _ in discounted] == [p for p, _ in whole]  # prefill still counts the whole trend


def test_a_clean_ramp_keeps_its_whole_trend():
    rates = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert run(rates) == run(rates, decode_trend_se_discount=0.0)
    # and the trend is counted at all: ahead of a fleet sized for the tick's own rate
    level = run(rates, predictor="moving_average", predictor_window_ticks=1)
    assert run(rates)[-1][1] > level[-1][1]
