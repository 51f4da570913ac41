"""Load predictors: each forecasts the next tick from its own history."""

import pytest

from runtime.planner.predictors import (
    BurstQuantilePredictor,
    ConstantPredictor,
    MovingAveragePredictor,
    make_predictor,
)


def test_constant_repeats_last_value():
    p = ConstantPredictor()
    assert p.predict() == 0.0
    for v in (3.0, 7.0, 5.0):
        p.observe(v)
    assert p.predict() == 5.0 and p.predict(steps_ahead=4) == 5.0


def test_moving_average_over_window():
    p = MovingAveragePredictor(window=3)
    for v in (100.0, 1.0, 2.0, 6.0):
        p.observe(v)
    assert p.predict() == pytest.approx(3.0)  # (1 + 2 + 6) / 3: 100 left the window


def test_burst_quantile_covers_recent_spikes_and_ramps():
    p = BurstQuantilePredictor(window=10, quantile=0.9)
    for v in (10, 10, 10, 10, 50, 10, 10, 10, 10, 10):
        p.observe(v)
    assert p.predict() == pytest.approx(14.0)  # 0.9 quantile of nine 10s and one 50: 10 + 0.1 * 40
    ramp = BurstQuantilePredictor(window=10, quantile=0.5)
    for v in (10, 20, 30, 40):
        ramp.observe(v)
    assert ramp.predict(steps_ahead=3) == pytest.approx(35 + 3 * 10)  # mean of last two + slope x steps


def test_arima_follows_a_trend():
    pytest.importorskip("statsmodels")
    p = make_predictor("arima", window=30)
    for k in range(30):
        p.observe(100.0 + 5.0 * k + (k % 3))
    assert p.predict() == pytest.approx(100 + 5 * 30, rel=0.05)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown planner.predictor 'prophet'"):
        make_predictor("prophet")
    with pytest.raises(ValueError, match="finite and >= 0"):
        ConstantPredictor().observe(-1.0)
    with pytest.raises(ValueError, match="quantile"):
        BurstQuantilePredictor(quantile=0.0)
