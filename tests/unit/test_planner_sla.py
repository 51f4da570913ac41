"""Replica arithmetic of the SLA planner, checked by hand against a linear profile:
prefill 0.1 ms/token (1000 tokens = 0.1 s), decode step 10 ms + 0.1 ms per running sequence,
KV capacity 100,000 tokens per worker."""

import math

import pytest

from runtime.planner import sla
from runtime.planner.dynamo_baseline import DynamoSlaBaseline
from runtime.planner.types import TickInput
from tests.planner_builders import PROF
from tests.planner_builders import tick as planner_tick


def test_erlang_c_matches_textbook_values():
    assert sla.erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = utilisation
    assert sla.erlang_c(2, 1.0) == pytest.approx(1 / 3)  # B(2,1) = 0.2; C = 2*0.2/(2-0.8)
    assert sla.erlang_c(3, 1.0) == pytest.approx(0.1875 / 2.0625)  # B(3,1) = 1/16
    assert sla.erlang_c(2, 2.0) == 1.0  # unstable
    with pytest.raises(ValueError, match="num_servers"):
        sla.erlang_c(0, 1.0)


def test_prefill_replicas_hand_checked():
    # 10 req/s x 0.1 s = 1 Erlang; utilisation bound ceil(1/0.9) = 2 workers;
    # M/M/2 p99 wait = ln((1/3)/0.01) / (20 - 10) = 0.351 s <= 2.0 - 0.1 s slack -> 2
    assert sla.prefill_replicas(10, 1000, PROF.prefill, ttft_budget_s=2.0) == 2
    # a 0.3 s budget leaves 0.2 s slack: 2 workers wait 0.351 s (too long);
    # 3 workers: C = 0.0909, p99 wait = ln(9.09) / (30 - 10) = 0.110 s -> 3
    assert sla.prefill_replicas(10, 1000, PROF.prefill, ttft_budget_s=0.3) == 3
    # a correction factor of 2 doubles the service time: 2 Erlangs / 0.9 -> at least 3
    assert sla.prefill_replicas(10, 1000, PROF.prefill, ttft_budget_s=2.0, ttft_correction=2.0) == 3
    assert sla.prefill_replicas(0, 1000, PROF.prefill, ttft_budget_s=2.0) == 0


def test_wait_quantile_hand_checked():
    assert sla.wait_quantile_s(2, 10, 0.1, 0.99) == pytest.approx(math.log((1 / 3) / 0.01) / 10)
    assert sla.wait_quantile_s(1, 20, 0.1, 0.99) == math.inf
    assert sla.wait_quantile_s(8, 1, 0.1, 0.99) == 0.0  # P(wait) below 1%


def test_decode_replicas_hand_checked():
    # ISL 1000, OSL 200: context 1100, KV per sequence 1100/0.9 = 1222 tokens -> 81 sequences fit;
    # step at batch 81 = 10 + 8.1 ms = 18.1 ms <= 50 ms -> 81 / 0.0181 = 4475 tokens/s per worker
    per_worker = 81 / 0.0181
    assert PROF.decode.max_batch(0.05, 1100, 1100 / 0.9) == 81
    assert PROF.decode.tokens_per_s(0.05, 1100, 1100 / 0.9) == pytest.approx(per_worker)
    assert sla.decode_replicas(10, 1000, 200, PROF.decode, itl_target_s=0.05) == 1  # 2000 tok/s
    assert sla.decode_replicas(50, 1000, 200, PROF.decode, itl_target_s=0.05) == math.ceil(10_000 / per_worker) == 3
    # an ITL target of 15.1 ms caps the batch at (15.1-10)/0.1 = 51 -> 51/0.0151 = 3377 tokens/s
    assert PROF.decode.max_batch(0.0151, 1100, 1100 / 0.9) == 51
    assert sla.decode_replicas(50, 1000, 200, PROF.decode, itl_target_s=0.0151) == math.ceil(10_000 / (51 / 0.0151)) == 3
    assert sla.decode_replicas(20, 1000, 200, PROF.decode, itl_target_s=0.0151) == 2  # 4000 / 3377
    # a target below one empty step is infeasible
    assert sla.decode_replicas(10, 1000, 200, PROF.decode, itl_target_s=0.005) is None


def test_aggregated_replicas_hand_checked():
    # 1 req/s x 0.1 s prefill = 10% of one worker; decode must meet 50 ms * 0.9 = 45 ms: easily -> 1
    assert sla.aggregated_replicas(1, 1000, 200, PROF.agg_prefill, PROF.decode, ttft_budget_s=1.9,
                                   itl_target_s=0.05, max_workers=8) == 1
    # 8 req/s: 0.8 Erlangs of prefill; share per worker must be <= 0.5 -> at least 2 workers
    assert sla.aggregated_replicas(8, 1000, 200, PROF.agg_prefill, PROF.decode, ttft_budget_s=1.9,
                                   itl_target_s=0.05, max_workers=8) == 2
    assert sla.aggregated_replicas(80, 1000, 200, PROF.agg_prefill, PROF.decode, ttft_budget_s=1.9,
                                   itl_target_s=0.05, max_workers=8) is None


def _tick(now_s: float, rate: float, interval_s: float = 60.0) -> TickInput:
    return planner_tick(now_s, rate, interval_s=interval_s, ready_p=0, ready_d=1)


def test_dynamo_baseline_formula_hand_checked():
    # Dynamo: num_p = ceil(num_req * isl / interval / (isl / ttft(isl) / tp) / tp)
    #         num_d = ceil(num_req * osl / interval / (decode thpt per GPU) / tp)
    dyn = DynamoSlaBaseline(PROF, prefill_tp=2, decode_tp=1, ttft_target_s=2.0, itl_target_s=0.05, gpu_budget=64,
                            adjustment_interval_s=180.0, predictor="constant")
    assert dyn.on_tick(_tick(60, 30)) is None and dyn.on_tick(_tick(120, 30)) is None
    d = dyn.on_tick(_tick(180, 30))
    # 5400 requests in 180 s = 30 req/s: prefill 30000 tok/s; one worker (2 GPUs) does 1000/0.1 = 10000
    assert d is not None and d.prefill_replicas == 3
    # decode: 6000 tok/s; KV holds 100000 / 1100 = 90 sequences -> 90 / 0.019 = 4737 tok/s -> 2
    assert d.decode_replicas == math.ceil(6000 / (90 / 0.019)) == 2


def test_dynamo_baseline_skips_an_interval_with_no_ended_request_or_no_arrival():
    # Dynamo's plan_adjustment returns None when the interval's metrics hold a NaN (Metrics.is_valid): requests
    # that arrived but none ended (no mean OSL), or no request at all; the fleet stays, never the minimum one
    dyn = DynamoSlaBaseline(PROF, prefill_tp=2, decode_tp=1, ttft_target_s=2.0, itl_target_s=0.05, gpu_budget=64,
                            adjustment_interval_s=180.0, predictor="constant")
    for now in (60, 120, 180):  # a first interval in which requests arrive and none ends
        assert dyn.on_tick(planner_tick(now, 30, osl=0, interval_s=60.0)) is None
    for now in (240, 300):
        assert dyn.on_tick(_tick(now, 30)) is None
    d = dyn.on_tick(_tick(360, 30))  # requests ending: sized as the hand-checked window above
    assert d is not None and (d.prefill_replicas, d.decode_replicas) == (3, 2)
    for now in (420, 480, 540):  # an interval with no arrival and no request ending
        assert dyn.on_tick(planner_tick(now, 0, osl=0, interval_s=60.0)) is None
    # as Dynamo's predictors take them: the missing means as 0 once a value was seen (not before: the first
    # interval's OSL was skipped), so the constant predictor now forecasts 0 requests of 0 tokens
    assert (dyn._num_req.predict(), dyn._isl.predict(), dyn._osl.predict()) == (0.0, 0.0, 0.0)


def test_dynamo_baseline_load_headroom_scales_its_predicted_load():
    # the same 30 req/s window as above with 50 % headroom: prefill 45000 tok/s / 10000 per worker -> 5
    # (Dynamo's own formula: 3); decode 9000 tok/s / 4737 per worker -> 2; the reported prediction is the raw one
    dyn = DynamoSlaBaseline(PROF, prefill_tp=2, decode_tp=1, ttft_target_s=2.0, itl_target_s=0.05, gpu_budget=64,
                            adjustment_interval_s=180.0, predictor="constant", load_headroom=0.5)
    dyn.on_tick(_tick(60, 30))
    dyn.on_tick(_tick(120, 30))
    d = dyn.on_tick(_tick(180, 30))
    assert d is not None and d.prefill_replicas == 5
    assert d.decode_replicas == math.ceil(9000 / (90 / 0.019)) == 2
    assert d.predicted_rate_per_s == pytest.approx(30.0)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="load_headroom"):
            DynamoSlaBaseline(PROF, prefill_tp=2, decode_tp=1, ttft_target_s=2.0, itl_target_s=0.05, gpu_budget=64,
                              load_headroom=bad)
