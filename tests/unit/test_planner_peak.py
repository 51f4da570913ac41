"""Burst-aware sizing: the sub-tick peak term, the residual-quantile predictor,
asymmetric scale-down delays, the simulator's peak measurement and Dynamo's load-based layer.

Profile (hand-checkable): prefill 0.1 ms/token, decode step 10 ms + 0.1 ms per sequence, KV 100k
tokens per worker. TTFT target 2 s, ITL 50 ms -> TTFT budget 2 - 2 x 0.05 = 1.9 s."""

import numpy as np
import pytest

from runtime.planner.dynamo_baseline import DynamoSlaBaseline
from runtime.planner.predictors import ResidualQuantilePredictor, make_predictor
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig, PoolObservation, TickInput
from runtime.sim.fleet import FleetConfig, Trace, simulate
from tests.planner_builders import PROF, planner_cfg
from tests.planner_builders import tick as planner_tick


def cfg(**kw) -> PlannerConfig:  # noqa: ANN003
    # the peak term on its own (square-root staffing, now the default, is off: test_planner_staffing.py)
    return planner_cfg(**(dict(size_on_peak=True, prefill_staffing_beta=None) | kw))


def tick(now_s: float, rate: float, peak: float | None = None, **kw) -> TickInput:  # noqa: ANN003
    return planner_tick(now_s, rate, peak_prefill_tokens_per_s=peak, **kw)


def test_residual_quantile_predicts_level_plus_the_quantile_of_past_changes():
    p = ResidualQuantilePredictor(window=40, quantile=1.0)
    for v in (10, 20, 10, 20, 10, 20, 10, 20):
        p.observe(v)
    # level = mean(10, 20) = 15 everywhere; one step later the value is 10 or 20 -> errors -5 / +5
    assert p.predict(1) == pytest.approx(20.0)  # 15 + max error 5
    q = make_predictor("residual_quantile", window=40, quantile=0.5)
    for v in (10, 20, 10, 20, 10, 20, 10, 20):
        q.observe(v)
    assert q.predict(1) == pytest.approx(15.0)  # median error 0
    assert ResidualQuantilePredictor().predict() == 0.0
    with pytest.raises(ValueError, match="quantile"):
        ResidualQuantilePredictor(quantile=0.0)


def test_peak_second_of_prompt_tokens_sizes_prefill_by_hand():
    sm = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    d = sm.on_tick(tick(30, 30.0, peak=100_000.0))
    # mean: 30 req/s x 0.1 s = 3 Erlangs -> ceil(3 / 0.9) = 4. Peak: 100k tokens in the peak second
    # + 0.9 s at 30 req/s x 1000 tokens = 127k tokens x 0.1 ms = 12.7 worker-s over 1.9 s -> 6.68 -> 7
    assert d.prefill_replicas == 7
    assert sm.peak_prefill_replicas(30.0, 1000) == 7
    without = PlannerStateMachine(cfg(size_on_peak=False), PROF, initial_prefill=4, initial_decode=2)
    assert without.on_tick(tick(30, 30.0, peak=100_000.0)).prefill_replicas == 4
    no_data = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    assert no_data.on_tick(tick(30, 30.0)).prefill_replicas == 4  # no peak reported: mean sizing only


def test_peak_sizing_is_monotone_in_the_peak():
    sizes = []
    for peak in (0.0, 30_000.0, 60_000.0, 120_000.0, 240_000.0):
        sm = PlannerStateMachine(cfg(), PROF, initial_prefill=1, initial_decode=1)
        sizes.append(sm.on_tick(tick(30, 30.0, peak=peak)).prefill_replicas)
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]


def test_ttft_correction_is_capped_only_while_peak_sizing_is_active():
    slow = dict(observed_ttft_p90_s=1.5)  # far above the ~0.2 s the model expects
    capped = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    free = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    for t in range(30, 330, 30):
        capped.on_tick(tick(t, 30.0, peak=30_000.0, **slow))
        free.on_tick(tick(t, 30.0, **slow))
    assert capped.ttft_correction == pytest.approx(1.0)  # ttft_correction_max = 1.0
    assert free.ttft_correction == pytest.approx(2.0, rel=0.05)  # no peak data: clamped at 2 as before


def test_prefill_scales_down_after_its_delay_decode_after_its_own():
    sm = PlannerStateMachine(cfg(scale_down_delay_s=60.0, cooldown_s=60.0, decode_scale_down_delay_s=180.0),
                             PROF, initial_prefill=1, initial_decode=1)
    hi = sm.on_tick(tick(30, 60.0))
    assert (hi.prefill_replicas, hi.decode_replicas) == (7, 3)  # 6 Erlangs / 0.9 -> 7; 12k tok/s / 4475 -> 3
    seen = [(d.prefill_replicas, d.decode_replicas) for d in (sm.on_tick(tick(t, 5.0)) for t in range(60, 300, 30))]
    first_p = 60 + 30 * next(i for i, (p, _) in enumerate(seen) if p < 7)
    first_d = 60 + 30 * next(i for i, (_, d) in enumerate(seen) if d < 3)
    assert first_p - 30 >= 60 and first_d - 30 >= 180 and first_p < first_d


def test_simulator_reports_the_90th_percentile_second_of_prompt_tokens():
    # one request per second, second k carries (k + 1) x 100 prompt tokens: bins 100 ... 3000
    arrivals = np.arange(30, dtype=float) + 0.5
    tr = Trace(arrivals, (np.arange(30) + 1) * 100, np.full(30, 2))
    seen: list[TickInput] = []

    def controller(t: TickInput):
        seen.append(t)
        return None

    simulate(tr, PROF, FleetConfig(prefill_tp=1, decode_tp=1, interval_s=30.0), controller)
    # numpy's linear quantile at 0.9 x 29 = 26.1 between 2700 and 2800
    assert seen[0].peak_prefill_tokens_per_s == pytest.approx(2710.0)


def test_dynamo_load_layer_steps_one_above_the_throughput_floor():
    dyn = DynamoSlaBaseline(PROF, prefill_tp=1, decode_tp=1, ttft_target_s=2.0, itl_target_s=0.05, gpu_budget=64,
                            predictor="constant", load_scaling=True)

    def t(now: float, queue: float, ready: int) -> TickInput:
        return TickInput(now_s=now, interval_s=30.0, num_requests=300, mean_isl_tokens=1000, mean_osl_tokens=200,
                         prefill=PoolObservation(num_ready=ready, queue_per_worker=queue),
                         decode=PoolObservation(num_ready=1))

    # TTFT 2 s at 0.1 ms/token -> 20k tokens; minus the ISL -> 19k queued tokens per worker allowed
    up = dyn.on_tick(t(30, 25.0, 2))  # 25 x 1000 = 25k > 19k -> +1
    assert (up.prefill_replicas, up.decode_replicas) == (3, 1)
    down = dyn.on_tick(t(60, 0.0, 3))  # 0 < 19k x 2/3 x 0.8 -> -1
    assert down.prefill_replicas == 2
    plain = DynamoSlaBaseline(PROF, prefill_tp=1, decode_tp=1, ttft_target_s=2.0, itl_target_s=0.05, gpu_budget=64,
                              predictor="constant")
    assert plain.on_tick(t(30, 25.0, 2)) is None  # throughput mode acts every 180 s only
