"""Specification of the planner's edge cases found by adversarial testing: non-finite or
negative observations are refused where a tick is built, never stick in a correction factor; the
initial fleet is brought within the pool bounds and the budget; ticks at one instant do not grow
memory; invalid settings are errors naming them; ARIMA fits once per observation; a profile is
never built for a prefill TP the model does not fit at."""

from __future__ import annotations

import math

import pytest

from runtime.planner.predictors import ArimaPredictor
from runtime.planner.profiles import build_profile
from runtime.planner.state_machine import CORRECTION_MAX, PlannerStateMachine, _ewma
from runtime.planner.types import PlannerConfig, PoolObservation, TickInput
from tests.planner_builders import PROF
from tests.planner_builders import tick as planner_tick

nan, inf = math.nan, math.inf


def _tick(now: float, n: int = 300, **kw) -> TickInput:  # noqa: ANN003
    return planner_tick(now, n / 30.0, ready_p=0, ready_d=0, **kw)


@pytest.mark.parametrize(("field", "value"), [
    ("observed_ttft_p90_s", nan), ("observed_itl_p90_s", inf), ("observed_prefill_time_mean_s", nan),
    ("observed_ttft_p90_s", -5.0), ("peak_prefill_tokens_per_s", nan),
])
def test_tick_refuses_non_finite_or_negative_observations_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"TickInput.{field} must be finite"):
        _tick(30, **{field: value})


def test_tick_and_pool_refuse_non_finite_time_and_gauges() -> None:
    with pytest.raises(ValueError, match="now_s must be finite"):
        _tick(nan)
    with pytest.raises(ValueError, match="interval_s must be finite"):
        TickInput(now_s=0, interval_s=nan, num_requests=0, mean_isl_tokens=0, mean_osl_tokens=0)
    for name in ("queue_per_worker", "kv_usage", "running_per_worker"):
        with pytest.raises(ValueError, match=f"PoolObservation.{name}"):
            PoolObservation(num_ready=1, **{name: nan})
    with pytest.raises(ValueError, match="queue_per_worker"):
        PoolObservation(num_ready=1, queue_per_worker=-7)


def test_a_nan_sample_never_sticks_in_a_correction_factor() -> None:
    assert _ewma(1.2, nan) == 1.2
    assert _ewma(1.0, inf) == pytest.approx(0.7 + 0.3 * CORRECTION_MAX)


def test_initial_fleet_is_brought_within_bounds_and_budget() -> None:
    cfg = PlannerConfig(max_prefill=4, max_decode=4, gpu_budget=8, scale_down_delay_s=300)
    sm = PlannerStateMachine(cfg, PROF, initial_prefill=20, initial_decode=3)
    assert sm.prefill <= 4 and sm.prefill + sm.decode <= 8
    for k in range(6):
        d = sm.on_tick(_tick(30 + 30 * k, n=30))
        assert d.prefill_replicas <= 4 and d.decode_replicas <= 4
        assert d.num_gpus(1, 1) <= 8
    tight = PlannerConfig(prefill_tp=2, decode_tp=2, max_prefill=8, max_decode=8, gpu_budget=8)
    sm = PlannerStateMachine(tight, PROF, initial_prefill=6, initial_decode=6)
    assert sm.prefill * 2 + sm.decode * 2 <= 8


def test_ticks_at_one_instant_do_not_grow_memory() -> None:
    sm = PlannerStateMachine(PlannerConfig(), PROF)
    for _ in range(2000):
        sm.on_tick(_tick(30.0))
    assert len(sm._p_stab._window) == 1 and len(sm._d_stab._window) == 1 and len(sm._mode_votes) == 1


@pytest.mark.parametrize(("kw", "named"), [
    ({"prefill_tp": 0}, "prefill_tp"), ({"decode_tp": -1}, "decode_tp"), ({"min_prefill": -3}, "min_prefill"),
    ({"max_decode": 2.5}, "max_decode"), ({"interval_s": 0.0}, "interval_s"), ({"interval_s": -30.0}, "interval_s"),
    ({"target_utilization": 0.0}, "target_utilization"), ({"slo_quantile": 1.0}, "slo_quantile"),
    ({"mode": "bogus"}, "mode"), ({"worker_start_s": nan}, "worker_start_s"),
    ({"prefill_staffing_beta": inf}, "prefill_staffing_beta"), ({"reserved_priority_share": 1.0}, "reserved_priority_share"),
    ({"ttft_target_s": -1.0}, "ttft_target_s"), ({"burst_max_s": -1.0}, "burst_max_s"),
    ({"load_kv_down": 0.9, "load_kv_up": 0.5}, "load_kv_down"),
    ({"min_prefill": 0, "allow_aggregated": False}, "allow_aggregated"),
])
def test_invalid_settings_are_errors_naming_them(kw: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        PlannerConfig(**kw)


def test_arima_fits_once_per_observation(monkeypatch: pytest.MonkeyPatch) -> None:
    from statsmodels.tsa.arima.model import ARIMA

    fits = []
    real_fit = ARIMA.fit

    def counting_fit(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        fits.append(1)
        return real_fit(self, *a, **k)

    monkeypatch.setattr(ARIMA, "fit", counting_fit)
    p = ArimaPredictor(window=20)
    for v in (10, 12, 11, 15, 14, 16, 18):
        p.observe(v)
    one, three = p.predict(1), p.predict(3)
    assert len(fits) == 1 and one >= 0 and three >= 0
    p.observe(20)
    p.predict(1)
    assert len(fits) == 2


def test_profile_refuses_a_prefill_tp_the_model_does_not_fit_at() -> None:
    from runtime.modelfiles.load import load_model_spec
    from runtime.modelfiles.catalog import CATALOG_DIR
    from runtime.perf.gpus import get_gpu
    from runtime.perf.model import PerfModel

    l70 = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json")
    perf = PerfModel(l70, get_gpu("H100-SXM"), "bf16")
    with pytest.raises(ValueError, match="prefill_tp=1"):
        build_profile(perf, prefill_tp=1, decode_tp=4)
