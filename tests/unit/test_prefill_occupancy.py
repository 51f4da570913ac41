"""Prefill occupancy vs latency: a worker is held for the engine's prefill time only; the fixed TTFT
latency (API-side tokenisation, streaming) overlaps the next prefill (PerfModel.prefill_busy_s)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from runtime.config import SloSpec, WorkloadSpec
from runtime.modelfiles.load import load_model_spec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.perf.gpus import get_gpu
from runtime.perf.model import PerfModel
from runtime.planner import sla
from runtime.planner.profiles import ISL_GRID_TOKENS, PrefillProfile, analytic_profile, build_profile
from runtime.sim.fleet import FleetConfig, FleetSim, Trace, static_controller
from runtime.tuner.profiles import PlannerProfiles, PrefillPoint, ProfilePerf, build_profiles
from runtime.tuner.search import evaluate

L8 = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json")


def test_busy_time_is_the_roofline_plus_one_engine_step():
    perf = PerfModel(L8, get_gpu("H100-SXM"))
    for isl in (128, 1024, 8192):
        b = perf.prefill_breakdown(isl, 1)
        busy = perf.prefill_busy_s(isl, 1)
        assert busy == pytest.approx(b.total_s - perf.eff.prefill_overhead_s + perf.eff.decode_step_overhead_s)
        assert busy < perf.prefill_time_s(isl, 1)  # vLLM: 70 ms TTFT constant vs ~1 ms per engine step
    # a 128-token 8B prefill on H100 is a few ms of engine time, not the ~76 ms of its TTFT
    assert perf.prefill_busy_s(128, 1) < 0.2 * perf.prefill_time_s(128, 1)
    assert perf.prefill_busy_s(4096, 1) > perf.prefill_busy_s(1024, 1) > perf.prefill_busy_s(128, 1)


def test_tuner_queues_prefill_on_occupancy_but_reports_the_whole_latency():
    perf = PerfModel(L8, get_gpu("H100-SXM"))
    slo = SloSpec(ttft_p90_ms=2000, itl_p90_ms=50)
    c = evaluate(perf, 1, 1, slo, WorkloadSpec(isl_tokens=128, osl_tokens=512, request_rate_per_s=50))
    assert c.feasible
    # one worker clears more prompts per second than 1 / latency (the old model's ceiling, ~13/s) ...
    assert c.prefill_goodput_rps > 5.0 / perf.prefill_time_s(128, 1)
    assert c.prefill_goodput_rps < 1.0 / perf.prefill_busy_s(128, 1)  # ... but never more than 1 / occupancy
    assert c.prefill_replicas == 1
    # ... and the TTFT it reports still carries the fixed latency
    assert c.ttft_ms >= perf.prefill_time_s(128, 1) * 1e3


def test_planner_profiles_carry_busy_and_measured_ones_stay_conservative():
    perf = PerfModel(L8, get_gpu("H100-SXM"))
    prof = build_profiles(perf, (1,), (1,))
    again = PlannerProfiles.from_dict(prof.to_dict())
    assert again.prefill[1][0].busy_ms == pytest.approx(perf.prefill_busy_s(128, 1) * 1e3)
    assert ProfilePerf(again, perf).prefill_busy_s(128, 1) == pytest.approx(perf.prefill_busy_s(128, 1))
    # a measured curve (no busy_ms, e.g. from an older file) queues on the whole measured TTFT
    old = prof.to_dict()
    for p in old["prefill"]["1"]:
        del p["busy_ms"]
    measured = PlannerProfiles.from_dict(old)
    pp = ProfilePerf(measured, perf)
    assert pp.prefill_busy_s(1024, 1) == pytest.approx(pp.prefill_time_s(1024, 1))


def _split_profile(busy_s: float, latency_s: float, decode_tp: int = 1):
    """analytic profile whose prefill takes ``latency_s`` but holds the worker ``busy_s`` at every ISL."""
    base = analytic_profile(prefill_s_per_token=1e-9, decode_base_s=0.01, decode_s_per_seq=1e-4,
                            kv_capacity_tokens=1_000_000, prefill_tp=1, decode_tp=decode_tp)
    n = len(ISL_GRID_TOKENS)
    pre = PrefillProfile(tp=1, isl_grid_tokens=ISL_GRID_TOKENS, time_s=(latency_s,) * n, busy_s=(busy_s,) * n)
    return replace(base, prefill=pre)


def test_simulated_worker_is_free_after_the_busy_time_and_ttft_keeps_the_latency():
    prof = _split_profile(busy_s=0.01, latency_s=0.1)
    arrivals = np.arange(200) * 0.02  # 50 req/s: 5x what 0.1 s of occupancy could serve, 0.5 of 0.01 s
    tr = Trace(arrivals, np.full(200, 100), np.full(200, 2))
    cfg = FleetConfig(prefill_tp=1, decode_tp=1, interval_s=1.0, worker_start_s=0.0)
    sim = FleetSim(tr, prof, cfg)
    res = sim.run(static_controller(1, 2))
    prefill_part = sim.prefill_done_s - arrivals
    assert np.all(prefill_part >= 0.1 - 1e-9)  # every request still waits its whole latency
    assert np.max(prefill_part) < 0.1 + 0.02  # and no queue builds up behind one worker
    assert np.allclose(sim.prefill_used_s, 0.01)  # what vLLM's engine-side prefill histogram would show
    assert res.slo_attainment(0.2, 0.05) == 1.0


def test_sla_prefill_replicas_queue_on_busy_and_budget_the_latency():
    split = _split_profile(busy_s=0.01, latency_s=0.1).prefill
    whole = PrefillProfile(tp=1, isl_grid_tokens=ISL_GRID_TOKENS, time_s=split.time_s)  # busy = latency
    assert sla.prefill_replicas(50.0, 100, split, ttft_budget_s=1.0, quantile=0.99) == 1
    assert sla.prefill_replicas(50.0, 100, whole, ttft_budget_s=1.0, quantile=0.99) >= 6
    # the latency, not the occupancy, is what the budget must hold: 0.1 s of latency leaves no slack in 0.1 s
    s, lat = sla.prefill_service_s(split, 100, ttft_correction=2.0)
    assert (s, lat) == pytest.approx((0.02, 0.09 + 0.02))
    assert sla.expected_ttft_s(0.0, 100, 1, split) == pytest.approx(0.1)


def test_build_profile_fills_busy_from_the_perf_model():
    perf = PerfModel(L8, get_gpu("H100-SXM"))
    prof = build_profile(perf, 1, 1)
    assert prof.prefill.busy_time_s(128.0) == pytest.approx(perf.prefill_busy_s(128, 1))
    assert prof.prefill.prefill_time_s(128.0) == pytest.approx(perf.prefill_time_s(128, 1))
    assert prof.prefill.tokens_per_s(1024.0) == pytest.approx(1024 / perf.prefill_busy_s(1024, 1))
    with pytest.raises(ValueError, match="busy_s"):
        PrefillProfile(tp=1, isl_grid_tokens=(1, 2), time_s=(1.0, 2.0), busy_s=(1.0,))


def test_ttft_based_correction_scales_the_engine_part_only():
    from runtime.planner.state_machine import CORRECTION_EWMA, PlannerStateMachine
    from runtime.planner.types import PlannerConfig, PoolObservation, TickInput

    prof = _split_profile(busy_s=0.01, latency_s=0.1)  # 0.09 s of fixed latency, 0.01 s of engine time
    cfg = PlannerConfig(mode="sla", ttft_target_s=0.2, itl_target_s=0.05, correct_by_prefill_time=False,
                        prefill_staffing_beta=None, max_prefill=40, max_decode=20, allow_aggregated=False)
    sm = PlannerStateMachine(cfg, prof, initial_prefill=40, initial_decode=4)
    # an engine twice as slow: TTFT p90 = fixed + 2 x busy + the first decode step (no queueing at 40 workers)
    observed = 0.09 + 2 * 0.01 + 0.05
    sm.on_tick(TickInput(now_s=30, interval_s=30, num_requests=30, mean_isl_tokens=100, mean_osl_tokens=10,
                         prefill=PoolObservation(num_ready=40), decode=PoolObservation(num_ready=4),
                         observed_ttft_p90_s=observed))
    sample = (2 * 0.01 + 0.05) / (0.01 + 0.05)  # the whole-TTFT ratio would be 0.16 / 0.15 = 1.07
    assert sm.ttft_correction == pytest.approx((1 - CORRECTION_EWMA) + CORRECTION_EWMA * sample, rel=1e-3)


def test_a_profile_whose_occupancy_exceeds_its_latency_is_refused():
    with pytest.raises(ValueError, match="busy_s must be > 0 and <= time_s"):
        PrefillProfile(tp=1, isl_grid_tokens=(1, 2), time_s=(1.0, 2.0), busy_s=(1.5, 1.0))
