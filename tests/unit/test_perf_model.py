"""Roofline PerfModel and GPU catalog: hand-checked arithmetic and monotonicity properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.models.load import load_model_spec
from runtime.perf.calibration import Efficiency
from runtime.perf.gpus import get_gpu, gpu_names
from runtime.perf.instances import INSTANCES, get_instance, instance_for, usd_per_gpu_hour
from runtime.perf.model import PerfModel
from runtime.paths import data_dir

MODELS = data_dir() / "models"
L8 = load_model_spec(MODELS / "meta-llama--Meta-Llama-3.1-8B_config.json")
L70 = load_model_spec(MODELS / "meta-llama--Meta-Llama-3.1-70B_config.json")
MIXTRAL = load_model_spec(MODELS / "mistralai--Mixtral-8x7B-v0.1_config.json")
DSV3 = load_model_spec(MODELS / "deepseek-ai--DeepSeek-V3_config.json")
GPT_OSS = load_model_spec(MODELS / "openai--gpt-oss-120b_config.json")
# Pure roofline (no efficiency loss, no overhead) so times can be checked by hand.
IDEAL = Efficiency(compute=1.0, memory=1.0, comm=1.0, decode_step_overhead_s=0.0, prefill_overhead_s=0.0,
                   attention=1.0)


def test_catalog_has_contract_names_and_aliases():
    for name in ("H100-SXM", "H200-SXM", "A100-SXM-80GB", "L40S", "CPU"):
        assert get_gpu(name).name == name
    assert get_gpu("H100-SXM5-80GB").name == "H100-SXM"  # gpu_specs.csv spelling
    assert get_gpu("b200_sxm").name == "B200-SXM"  # aiconfigurator spelling
    h100 = get_gpu("H100-SXM")
    assert h100.mem_bw_bytes_per_s == 3350e9 and h100.bf16_flops == 989e12 and h100.fp8_flops == 1978e12
    assert get_gpu("A100-SXM-80GB").peak_flops("fp8") == 312e12  # no FP8 cores: bf16 rate
    with pytest.raises(KeyError, match="H100-SXM"):
        get_gpu("TPU-v9")
    assert len(set(gpu_names())) == len(gpu_names())


def test_aws_instances_map_to_catalog_gpus_with_dated_prices():
    for i in INSTANCES:
        get_gpu(i.gpu)
        assert i.usd_per_hour >= 0 and i.source
    p5 = get_instance("p5.48xlarge")
    assert (p5.gpu, p5.num_gpus) == ("H100-SXM", 8) and p5.price_date
    assert get_instance("p4d.24xlarge").gpu == "A100-SXM-40GB"
    assert get_instance("p4de.24xlarge").gpu == "A100-SXM-80GB"
    assert instance_for("L40S", 2).name == "g6e.12xlarge"  # fewest GPUs >= 2
    assert usd_per_gpu_hour("H100-SXM", 4) == pytest.approx(p5.usd_per_hour / 8)
    assert usd_per_gpu_hour("GH200") is None


def test_weights_per_rank_by_hand():
    pm = PerfModel(L70, get_gpu("H100-SXM"), "bf16")
    assert pm.weight_bytes_per_rank(1) == L70.num_params * 2
    assert pm.weight_bytes_per_rank(4) == L70.num_params * 2 / 4
    embed = 128256 * 8192  # untied: embedding + LM head stay 16-bit in an FP8 checkpoint
    assert PerfModel(L70, get_gpu("H100-SXM"), "fp8").weight_bytes_per_rank(1) == L70.num_params + 2 * embed
    oss = PerfModel(GPT_OSS, get_gpu("B200-SXM"), "fp4")  # MXFP4: only the experts are 4.25-bit
    experts = 36 * 128 * (3 * 2880 * 2880 + 2 * 2880 + 2880)
    assert oss.weight_bytes_per_rank(1) == pytest.approx(experts * 0.53125 + (GPT_OSS.num_params - experts) * 2)


def test_70b_bf16_needs_two_h100s_and_kv_capacity_by_hand():
    pm = PerfModel(L70, get_gpu("H100-SXM"), "bf16")
    assert not pm.fits(1)  # 141 GB of weights > 80 GB
    assert pm.kv_capacity_tokens(1) == 0
    assert pm.fits(2) and pm.fits(8)
    mb = pm.memory_breakdown(4)
    expected = int(mb.kv_bytes // (327680 / 4))
    assert pm.kv_capacity_tokens(4) == expected
    assert "weights" in mb.explain()


def test_decode_step_of_8b_at_batch_1_is_weight_bandwidth_bound_by_hand():
    pm = PerfModel(L8, get_gpu("H100-SXM"), "bf16", efficiency=IDEAL)
    t = pm.decode_step_time_s(batch=1, context_tokens=1, tp=1)
    bytes_read = (L8.num_params - 128256 * 4096) * 2 + 131072  # all weights but the embedding lookup + 1 KV
    assert t == pytest.approx(bytes_read / 3350e9, rel=1e-6)


def test_prefill_flops_by_hand_when_compute_bound():
    pm = PerfModel(L8, get_gpu("H100-SXM"), "bf16", efficiency=IDEAL)
    isl = 4096
    embed = 128256 * 4096
    linear = 2 * (L8.num_params - 2 * embed - 4096 - 32 * 2 * 4096) * isl  # norms are no matmul
    br = pm.prefill_breakdown(isl, tp=1)
    attn = 32 * isl**2 / 2 * 32 * 2 * (128 + 128)
    lm_head = 2 * embed
    assert br.compute_s == pytest.approx((linear + attn + lm_head) / 989e12, rel=2e-3)
    assert br.compute_s > br.memory_s and br.comm_s == 0


def test_tp_allreduce_by_hand():
    pm = PerfModel(L70, get_gpu("H100-SXM"), "bf16", efficiency=IDEAL)
    tokens = 1000
    per = 2 * 7 / 8 * tokens * 8192 * 2 / 450e9 + 10e-6
    assert pm.prefill_breakdown(tokens, tp=8).comm_s == pytest.approx(2 * 80 * per)
    assert pm.prefill_breakdown(tokens, tp=1).comm_s == 0


def test_moe_decode_reads_fewer_expert_weights_at_small_batch():
    pm = PerfModel(MIXTRAL, get_gpu("H100-SXM"), "bf16", efficiency=IDEAL)
    small = pm.decode_breakdown(1, 1, 2).memory_s
    large = pm.decode_breakdown(256, 1, 2).memory_s
    assert small < large
    assert small == pytest.approx(
        ((MIXTRAL.num_active_params - 32000 * 4096) * 2 / 2 + MIXTRAL.kv_bytes_per_token(2, 2)) / 3350e9,
        rel=0.01,  # active weights but the embedding lookup (one row), plus one token of KV
    )


def test_cpu_entry_models_smollm2_sensibly():
    from runtime.models.spec import ModelSpec

    m = ModelSpec.from_hf_config(
        {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
         "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
         "tie_word_embeddings": True}, "smollm2")
    pm = PerfModel(m, get_gpu("CPU"))
    assert pm.fits(1) and not pm.fits(2)  # one CPU "device"
    assert 0.001 < pm.decode_step_time_s(1, 512, 1) < 1.0


def test_unknown_precision_rejected():
    with pytest.raises(ValueError, match="precision"):
        PerfModel(L8, get_gpu("H100-SXM"), "int3")


@settings(max_examples=40, deadline=None)
@given(tp_small=st.sampled_from([1, 2, 4]), isl=st.integers(1, 32768), batch=st.integers(1, 512),
       ctx=st.integers(1, 32768))
def test_monotonicity(tp_small, isl, batch, ctx):
    """Invariants: more TP never increases per-rank weight bytes; longer ISL never lowers TTFT;
    larger batch or context never lowers the decode step time; more TP never lowers KV capacity."""
    pm = PerfModel(L70, get_gpu("H100-SXM"), "bf16")
    tp_big = tp_small * 2
    assert pm.weight_bytes_per_rank(tp_big) <= pm.weight_bytes_per_rank(tp_small)
    assert pm.prefill_time_s(isl + 1, tp_small) >= pm.prefill_time_s(isl, tp_small)
    assert pm.decode_step_time_s(batch + 1, ctx, tp_small) >= pm.decode_step_time_s(batch, ctx, tp_small)
    assert pm.decode_step_time_s(batch, ctx + 1, tp_small) >= pm.decode_step_time_s(batch, ctx, tp_small)
    assert pm.kv_capacity_tokens(tp_big) >= pm.kv_capacity_tokens(tp_small)



def test_linear_and_attention_rooflines_add_by_hand():
    """A large decode batch at long context: the GEMMs are compute-bound and the attention reads the KV
    cache; both kernels run one after the other, so their times add (not max of the sums)."""
    pm = PerfModel(L8, get_gpu("H100-SXM"), "bf16", efficiency=IDEAL)
    batch, ctx = 512, 8192
    br = pm.decode_breakdown(batch, ctx, tp=1)
    kv_s = batch * ctx * 131072 / 3350e9
    weights_s = L8.num_params * 2 / 3350e9
    linear_s = br.compute_s - br.attn_compute_s
    assert br.kv_memory_s == pytest.approx(kv_s, rel=1e-9)
    assert br.total_s == pytest.approx(max(linear_s, weights_s) + max(br.attn_compute_s, kv_s), rel=1e-9)
    assert br.total_s > max(br.compute_s, br.memory_s)


def test_mla_decode_attention_uses_the_absorbed_latent_by_hand():
    """DeepSeek-V3 decode attends over the 512 + 64 latent per head (q.k) and 512 (values); prefill uses the
    expanded 128 + 64 / 128 head dims."""
    pm = PerfModel(DSV3, get_gpu("H200-SXM"), "fp8", efficiency=IDEAL)
    ctx = 4096
    dec = pm.decode_breakdown(1, ctx, tp=8)
    flops = 61 * 2 * ctx * 128 * ((512 + 64) + 512)
    assert dec.attn_peak_s == pytest.approx(flops / (8 * 989e12), rel=1e-9)
    pre = pm.prefill_breakdown(ctx, tp=8)
    assert pre.attn_peak_s == pytest.approx(61 * ctx**2 / 2 * 128 * 2 * (192 + 128) / (8 * 989e12), rel=1e-9)


def test_backend_selects_its_fitted_overheads():
    from runtime.perf.calibration import efficiency_for

    g = get_gpu("H100-SXM")
    assert PerfModel(L8, g, "fp8").eff == efficiency_for(g, "fp8", "vllm")
    assert PerfModel(L8, g, "fp8", backend="trtllm").eff == efficiency_for(g, "fp8", "trtllm")


def test_mxfp4_experts_compute_at_the_fp8_rate():
    pm = PerfModel(GPT_OSS, get_gpu("B200-SXM"), "fp4", efficiency=IDEAL)
    assert pm.compute_precision == "fp8" and pm.weight_dtype_bytes == 0.53125
    br = pm.prefill_breakdown(1024, tp=1)
    assert br.expert_peak_s > 0
    dense = PerfModel(L8, get_gpu("B200-SXM"), "fp4", efficiency=IDEAL)
    assert dense.compute_precision == "fp4"


def test_runtime_reserve_and_nccl_buffers_follow_aiconfigurator():
    pm = PerfModel(L8, get_gpu("H100-SXM"), "bf16")
    assert pm.memory_breakdown(1).reserve_bytes == 3_758_096_384
    assert pm.memory_breakdown(2).reserve_bytes == 3_758_096_384 + 358_612_992
    assert pm.memory_breakdown(8).reserve_bytes == 3_758_096_384 + 411_041_792
    small = pm.memory_breakdown(1, max_num_tokens=2048).activations_bytes
    assert pm.memory_breakdown(1, max_num_tokens=8192).activations_bytes == pytest.approx(4 * small)


def test_sliding_window_layers_attend_to_the_window_only_by_hand():
    pm = PerfModel(GPT_OSS, get_gpu("H100-SXM"), "bf16", efficiency=IDEAL)
    ctx = 4096
    br = pm.decode_breakdown(1, ctx, tp=1)
    attended = 18 * ctx + 18 * 128
    assert br.attn_peak_s == pytest.approx(2 * attended * 64 * (64 + 64) / 989e12, rel=1e-9)
    per_layer_kv = GPT_OSS.kv_bytes_per_token(2, 1) / 36
    assert br.kv_peak_s == pytest.approx(attended * per_layer_kv / 3.35e12, rel=1e-9)
    pre = pm.prefill_breakdown(ctx, tp=1)
    pairs = 18 * ctx**2 / 2 + 18 * (ctx * 128 - 128**2 / 2)
    assert pre.attn_peak_s == pytest.approx(pairs * 64 * 2 * (64 + 64) / 989e12, rel=1e-9)
    short = pm.decode_breakdown(1, 100, tp=1)  # shorter than the window: every layer sees all 100 tokens
    assert short.attn_peak_s == pytest.approx(2 * 36 * 100 * 64 * 128 / 989e12, rel=1e-9)
