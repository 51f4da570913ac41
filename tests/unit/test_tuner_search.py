"""Prefill-TP x decode-TP tuner: rules, SLO checks, M/D/1 queueing, errors, outputs."""

from __future__ import annotations

import math

import pytest

from runtime.config import DeploymentSpec, ModelRef, SloSpec, WorkloadSpec
from runtime.modelfiles.load import load_model_spec
from runtime.models.spec import ModelSpec
from runtime.modelfiles.catalog import CATALOG_DIR, load_catalog_spec
from runtime.perf.gpus import get_gpu
from runtime.perf.model import PerfModel
from runtime.tuner.profiles import PlannerProfiles, build_profiles
from runtime.tuner.queueing import max_rate_under_ttft, md1_mean_wait_s, md1_wait_quantile_s
from runtime.tuner.search import (
    InfeasibleSLOError,
    ModelDoesNotFitError,
    tune,
)

MODELS = CATALOG_DIR
L70 = load_model_spec(MODELS / "meta-llama--Meta-Llama-3.1-70B_config.json")
L8 = load_model_spec(MODELS / "meta-llama--Meta-Llama-3.1-8B_config.json")
DSV3 = load_model_spec(MODELS / "deepseek-ai--DeepSeek-V3_config.json")
SMOLLM2 = ModelSpec.from_hf_config(
    {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30,
     "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
     "vocab_size": 49152, "tie_word_embeddings": True}, "SmolLM2-135M-Instruct")


def test_md1_mean_wait_matches_pollaczek_khinchine():
    d, lam = 0.1, 5.0  # rho = 0.5
    assert md1_mean_wait_s(lam, d) == pytest.approx(0.5 * 0.1 / (2 * 0.5))
    assert md1_mean_wait_s(10.0, d) == math.inf
    assert md1_wait_quantile_s(0.5, d) == 0.0  # rho 0.05 < 0.1: p90 of the wait is 0
    assert md1_wait_quantile_s(8.0, d) > md1_wait_quantile_s(5.0, d) > 0


def test_max_rate_under_ttft_is_the_boundary():
    d = 0.2
    lam = max_rate_under_ttft(d, ttft_slo_s=0.5)
    assert 0 < lam < 1 / d
    assert md1_wait_quantile_s(lam, d) + d == pytest.approx(0.5, rel=1e-3)
    assert max_rate_under_ttft(d, ttft_slo_s=0.1) == 0.0


def test_smollm2_on_h100_default_slo_picks_tp1_tp1():
    r = tune(SMOLLM2, "H100-SXM", SloSpec(), WorkloadSpec())
    assert (r.best.prefill_tp, r.best.decode_tp) == (1, 1)
    assert r.best.feasible and r.best.ttft_ms <= 2000 and r.best.itl_ms <= 50
    assert len(r.candidates) == 16
    others = [c for c in r.candidates if (c.prefill_tp, c.decode_tp) != (1, 1)]
    assert all(not c.feasible and "does not divide" in c.reason for c in others)


def test_rules_for_70b_bf16_on_h100():
    r = tune(L70, "H100-SXM", SloSpec(), WorkloadSpec())
    by = {(c.prefill_tp, c.decode_tp): c for c in r.candidates}
    assert not by[(1, 1)].feasible and "fit" in by[(1, 1)].reason  # 141 GB of weights
    assert not by[(4, 2)].feasible and "prefill TP > decode TP" in by[(4, 2)].reason
    assert r.best.prefill_tp <= r.best.decode_tp
    for c in r.candidates:
        if c.feasible:
            assert c.ttft_ms <= 2000 and c.itl_ms <= 50
            assert c.prefill_replicas * c.prefill_goodput_rps >= 10 - 1e-6
            assert c.decode_replicas * c.decode_goodput_rps >= 10 - 1e-6
            assert c.num_gpus == c.prefill_replicas * c.prefill_tp + c.decode_replicas * c.decode_tp
            assert c.usd_per_mtok > 0
    assert r.best.num_gpus == min(c.num_gpus for c in r.candidates if c.feasible)


def test_mla_allows_prefill_tp_above_decode_tp():
    r = tune(DSV3, "H200-SXM", SloSpec(ttft_p90_ms=5000, itl_p90_ms=200), WorkloadSpec(), precision="fp8",
             tps=(8,))
    assert r.best.feasible
    pm = PerfModel(DSV3, get_gpu("H200-SXM"), "fp8")
    from runtime.tuner.search import evaluate

    c = evaluate(pm, 8, 4, SloSpec(), WorkloadSpec())
    assert "prefill TP > decode TP" not in c.reason


def test_goodput_per_gpu_formula():
    r = tune(L8, "H100-SXM", SloSpec(), WorkloadSpec())
    for c in r.candidates:
        if c.feasible:
            expected = 1 / (c.prefill_tp / c.prefill_goodput_rps + c.decode_tp / c.decode_goodput_rps)
            assert c.goodput_per_gpu == pytest.approx(expected)


def test_impossible_slo_names_best_prediction():
    with pytest.raises(InfeasibleSLOError, match=r"best candidate prefill TP \d / decode TP \d predicts TTFT "
                                                 r"[\d.]+ ms and ITL [\d.]+ ms"):
        tune(L70, "H100-SXM", SloSpec(ttft_p90_ms=1, itl_p90_ms=1), WorkloadSpec(), parallelism="tp")
    # auto also searches multi-node layouts when plain TP has no feasible candidate, and names them
    with pytest.raises(InfeasibleSLOError, match=r"best candidate prefill TP\d( PP\d)? / decode TP\d predicts"):
        tune(L70, "H100-SXM", SloSpec(ttft_p90_ms=1, itl_p90_ms=1), WorkloadSpec(), parallelism="auto")


def test_model_that_fits_nowhere_shows_memory_arithmetic():
    with pytest.raises(ModelDoesNotFitError, match=r"weights .* GB"):
        tune(load_model_spec(MODELS / "meta-llama--Meta-Llama-3.1-405B_config.json"), "L4", SloSpec(),
             WorkloadSpec())


def test_deployment_spec_and_markdown():
    r = tune(L70, "H100-SXM", SloSpec(), WorkloadSpec())
    spec = r.to_deployment_spec(ModelRef(name="llama-70b"))
    assert isinstance(spec, DeploymentSpec)
    assert (spec.prefill.tp, spec.decode.tp) == (r.best.prefill_tp, r.best.decode_tp)
    assert spec.prefill.replicas == r.best.prefill_replicas and spec.gpu == "H100-SXM"
    DeploymentSpec.model_validate_json(spec.model_dump_json())
    md = r.markdown_table()
    assert md.count("\n|") == 2 + 16 and "★" in md and "prefill TP > decode TP" in md


def test_tune_accepts_a_spec_loaded_from_a_config_file():
    r = tune(load_model_spec(MODELS / "meta-llama--Meta-Llama-3.1-8B_config.json"), "H100-SXM", SloSpec(),
             WorkloadSpec())
    assert r.model.num_layers == 32 and r.best.feasible


def test_profiles_are_monotone_and_roundtrip():
    pm = PerfModel(L70, get_gpu("H100-SXM"))
    prof = build_profiles(pm, (1, 2, 4, 8), (2, 4, 8))
    assert 1 not in prof.prefill  # does not fit
    for pts in prof.prefill.values():
        ttfts = [p.ttft_ms for p in pts]
        assert ttfts == sorted(ttfts)
    for pts in prof.decode.values():
        assert all(0 < p.kv_usage <= 1 for p in pts)
    again = PlannerProfiles.from_dict(prof.to_dict())
    assert again == prof
    assert prof.ttft_ms(8, 3000) == pytest.approx(pm.prefill_time_s(3000, 8) * 1e3, rel=0.1)



def test_profile_perf_uses_measured_curves_and_tunes_on_them():
    from runtime.tuner.profiles import DecodePoint, PrefillPoint, ProfilePerf

    base = PerfModel(SMOLLM2, get_gpu("CPU"), "fp32")
    measured = PlannerProfiles("smollm2", "CPU", "fp32", source="measured (hand-written here)")
    measured.prefill[1] = [PrefillPoint(128, 100.0, 1280.0), PrefillPoint(1024, 900.0, 1137.0)]
    measured.decode[1] = [DecodePoint(1, 256, 40.0, 25.0, 0.0), DecodePoint(16, 256, 120.0, 133.0, 0.0)]
    pp = ProfilePerf(measured, base)
    assert pp.prefill_time_s(576, 1) == pytest.approx(0.5)  # halfway between 128 and 1024 tokens
    assert pp.decode_step_time_s(1, 256, 1) == pytest.approx(0.040)
    assert pp.decode_step_time_s(8, 9999, 1) == pytest.approx(0.040 + (0.120 - 0.040) * 7 / 15)
    assert pp.kv_capacity_tokens(1) == base.kv_capacity_tokens(1)
    r = tune(SMOLLM2, "CPU", SloSpec(ttft_p90_ms=2000, itl_p90_ms=100),
             WorkloadSpec(isl_tokens=512, osl_tokens=64, request_rate_per_s=0.5), precision="fp32", perf=pp)
    assert (r.best.prefill_tp, r.best.decode_tp) == (1, 1)
    assert r.best.itl_ms <= 100 and r.best.ttft_unloaded_ms == pytest.approx(
        pp.prefill_time_s(512, 1) * 1e3 + 512 * SMOLLM2.kv_bytes_per_token(4) / 1e9 * 1e3)


def test_gpu_may_be_given_as_aws_instance_type():
    r = tune(L8, "p5.48xlarge", SloSpec(), WorkloadSpec())
    assert r.gpu.name == "H100-SXM"
    with pytest.raises(KeyError, match="unknown GPU"):
        tune(L8, "x9.huge", SloSpec(), WorkloadSpec())


# ----------------------------------------------------------- the longest request fits one engine of each pool

def test_a_prefill_worker_whose_kv_cannot_hold_the_request_is_infeasible():
    """vLLM refuses to start an engine whose KV cache cannot hold --max-model-len (>= the workload's ISL + OSL),
    prefill engines included: Qwen3-32B at TP 1 on an H100 holds 24,841 tokens, less than a 30,100-token request,
    so no p1 candidate may win, and max_model_len stays within the winner's prefill capacity."""
    m = load_catalog_spec("qwen3-32b")
    r = tune(m, "H100-SXM", SloSpec(ttft_p90_ms=60000, itl_p90_ms=100),
             WorkloadSpec(isl_tokens=30000, osl_tokens=100, request_rate_per_s=0.05))
    p1d2 = next(c for c in r.candidates if (c.prefill_tp, c.decode_tp) == (1, 2))
    assert not p1d2.feasible and p1d2.reason == "prefill KV capacity 24841 tokens < one request (30100)"
    assert r.best.prefill_tp > 1
    for c in r.candidates:
        if c.feasible:
            assert c.prefill_kv_capacity_tokens_per_rank >= 30100 and c.kv_capacity_tokens_per_rank >= 30100
    assert 30100 <= r.max_model_len_tokens() <= r.best.prefill_kv_capacity_tokens_per_rank


def test_max_model_len_is_capped_by_one_data_parallel_ranks_kv():
    """Each DP rank of a data-parallel worker is its own vLLM engine holding whole sequences: --max-model-len
    must fit one rank's cache (the worker's capacity / dp), not the worker's total."""
    m = load_catalog_spec("llama-4-maverick")
    r = tune(m, "p5.48xlarge", SloSpec(), WorkloadSpec(request_rate_per_s=5), parallelism="auto")
    b = r.best
    assert b.decode.dp > 1 and b.prefill.dp > 1
    assert b.kv_capacity_tokens_per_rank == b.kv_capacity_tokens // b.decode.dp
    cap = min(b.kv_capacity_tokens_per_rank, b.prefill_kv_capacity_tokens_per_rank)
    assert r.max_model_len_tokens() == cap < (m.max_context_tokens or m.max_position_embeddings)
    assert r.to_deployment_spec(ModelRef(name="m")).engine.max_model_len_tokens == cap
    with pytest.raises(ValueError, match="per DP rank"):
        r.max_model_len_tokens(cap + 1)


def test_a_request_longer_than_one_data_parallel_ranks_kv_is_not_served_by_that_worker():
    """A 120,100-token request exceeds one Llama-4-Maverick DP rank's cache on p5 (about 101k tokens) though the
    32 ranks together hold about 3.2M: no layout serves it."""
    m = load_catalog_spec("llama-4-maverick")
    with pytest.raises(ModelDoesNotFitError, match=r"KV capacity \d+ tokens per DP rank < one request \(120100\)"):
        tune(m, "p5.48xlarge", SloSpec(ttft_p90_ms=60000, itl_p90_ms=100),
             WorkloadSpec(isl_tokens=120000, osl_tokens=100, request_rate_per_s=0.1), parallelism="all")
