"""Roofline PerfModel and GPU catalog: hand-checked arithmetic and monotonicity properties."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.modelfiles.load import load_model_spec
from runtime.perf.calibration import Efficiency
from runtime.perf.gpus import get_gpu, gpu_names
from runtime.perf.instances import INSTANCES, get_instance, instance_for, usd_per_gpu_hour
from runtime.perf.collectives import nccl_allreduce_s, nccl_latencies
from runtime.perf.model import PerfModel
from runtime.modelfiles.catalog import CATALOG_DIR

MODELS = CATALOG_DIR
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
        assert (i.usd_per_hour is None or i.usd_per_hour >= 0) and i.source
    assert get_instance("g6e.2xlarge").usd_per_gpu_hour is None  # not priced: the tuner prices L40S by g6e.xlarge
    assert usd_per_gpu_hour("L40S", 1) == get_instance("g6e.xlarge").usd_per_hour
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
    act = 32 * (10 * 4096 + 3 * 14336) * 2  # norms + residual adds, gated activation: one token
    assert t == pytest.approx((bytes_read + act) / 3350e9, rel=1e-6)


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
    # 16.384 MB per all-reduce; ring factor 2*7/8; H100 NVSwitch bus bandwidth 470 GB/s (nccl-tests busbw)
    bus_s = 2 * 7 / 8 * tokens * 8192 * 2 / 470e9  # 61.0 us
    ll, simple = 3.6e-6 + 14 * 0.47e-6, 8.4e-6 + 14 * 3.4e-6  # NCCL tuning.cc, 8 GPUs: 10.18 us, 56.0 us
    per = min(ll + 4 * bus_s, simple + bus_s) + 10e-6  # Simple wins at 16 MB: 117 us + engine latency
    assert per == pytest.approx(127.0e-6, rel=1e-3)
    br = pm.prefill_breakdown(tokens, tp=8)
    assert br.comm_s == pytest.approx(2 * 80 * per)
    assert br.comm_peak_s == pytest.approx(2 * 80 * bus_s) and br.num_allreduces == 160
    assert pm.prefill_breakdown(tokens, tp=1).comm_s == 0


def test_nccl_protocol_choice_by_hand():
    """LL (low latency, 1/4 of the bus bandwidth) for small messages, Simple for large ones (NCCL tuning.cc)."""
    ll, simple = nccl_latencies(8, nvlink=True)
    assert (ll, simple) == pytest.approx((10.18e-6, 56.0e-6))
    assert nccl_latencies(2, nvlink=False) == pytest.approx((3.6e-6 + 2 * 1.0e-6, 8.4e-6 + 2 * 5.7e-6))
    # 1 us of bytes at bus bandwidth: LL 10.18 + 4 = 14.18 us beats Simple 57 us
    assert nccl_allreduce_s(1e-6, ll, simple) == pytest.approx(14.18e-6)
    # 100 us: Simple 156 us beats LL 410.18 us; the crossover is at (56 - 10.18) / 3 = 15.27 us
    assert nccl_allreduce_s(100e-6, ll, simple) == pytest.approx(156e-6)
    x = (simple - ll) / 3
    assert nccl_allreduce_s(x, ll, simple) == pytest.approx(ll + 4 * x) == pytest.approx(simple + x)


def test_allreduce_bus_bandwidth_per_fabric():
    """nccl-tests large-message busbw: 8x H100 NVSwitch ~470 GB/s, 8x A100 NVLink-3 ~240, PCIe ~40/64 of link."""
    assert get_gpu("H100-SXM").allreduce_bus_bw_bytes_per_s == pytest.approx(470e9)
    assert get_gpu("H200-SXM").allreduce_bus_bw_bytes_per_s == pytest.approx(470e9)
    assert get_gpu("B200-SXM").allreduce_bus_bw_bytes_per_s == pytest.approx(900e9 * 470 / 450)
    assert get_gpu("A100-SXM-80GB").allreduce_bus_bw_bytes_per_s == pytest.approx(240e9)
    assert get_gpu("H100-PCIe").allreduce_bus_bw_bytes_per_s == pytest.approx(40e9)
    assert get_gpu("L40S").allreduce_bus_bw_bytes_per_s == pytest.approx(20e9)  # PCIe Gen4: 32 * 40/64
    # a slower fabric never makes the same all-reduce faster
    times = [PerfModel(L70, get_gpu(g), "bf16", efficiency=IDEAL).prefill_breakdown(4096, tp=4).comm_s
             for g in ("H100-SXM", "A100-SXM-80GB", "L40S")]
    assert times == sorted(times)


def test_fused_moe_efficiency_slows_only_the_expert_gemms():
    """Expert GEMM time / moe (grouped GEMM with routing and permutation); dense GEMMs and attention unchanged."""
    base = PerfModel(MIXTRAL, get_gpu("H100-SXM"), "bf16", efficiency=IDEAL).prefill_breakdown(4096, tp=1)
    half = PerfModel(MIXTRAL, get_gpu("H100-SXM"), "bf16",
                     efficiency=replace(IDEAL, moe=0.5)).prefill_breakdown(4096, tp=1)
    assert base.expert_peak_s > 0
    # 8 experts, top-2, 4096 rows: every expert touched, so IDEAL (no GEMM-size loss) gives peak times
    assert half.compute_s - base.compute_s == pytest.approx(base.expert_peak_s)
    assert half.attn_compute_s == base.attn_compute_s and half.memory_s == base.memory_s
    dense = PerfModel(L8, get_gpu("H100-SXM"), "bf16", efficiency=replace(IDEAL, moe=0.5))
    assert dense.prefill_breakdown(4096, tp=1).compute_s == pytest.approx(
        PerfModel(L8, get_gpu("H100-SXM"), "bf16", efficiency=IDEAL).prefill_breakdown(4096, tp=1).compute_s)


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
    act_s = batch * 32 * (10 * 4096 + 3 * 14336) * 2 / 3350e9  # element-wise traffic, its own kernels
    assert br.act_memory_s == pytest.approx(act_s, rel=1e-9)
    assert br.total_s == pytest.approx(max(linear_s, weights_s) + max(br.attn_compute_s, kv_s) + act_s, rel=1e-9)
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


def test_nvfp4_mla_checkpoints_keep_attention_projections_in_fp8_by_hand():
    """nvidia/DeepSeek-R1-FP4 quantises the MoE/MLP linears to NVFP4 but not the MLA projections."""
    fp4 = PerfModel(DSV3, get_gpu("B200-SXM"), "fp4", efficiency=IDEAL)
    # per layer: q_a 7168x1536 + norm 1536 + q_b 1536x(128*192) + kv_a 7168x576 + norm 512
    #            + kv_b 512x(128*(128+128)) + o (128*128)x7168
    per_layer = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256
                 + 128 * 128 * 7168)
    assert DSV3.attention_params_per_layer == per_layer == 187_107_328
    attn = 61 * per_layer
    embed = 129280 * 7168
    quantised = DSV3.num_params - 2 * embed  # untied embedding + LM head stay 16-bit
    expected = (quantised - attn) * 0.5625 + attn * 1.0 + 2 * embed * 2
    assert fp4.weight_bytes_per_rank(1) == pytest.approx(expected)
    # their GEMM FLOPs run at the fp8 rate: prefill dense time = other / fp4 peak + attention / fp8 peak
    br = fp4.prefill_breakdown(1000, tp=1)
    experts_active = 58 * 8 * 3 * 7168 * 2048  # 58 MoE layers, top-8 routed experts of 2048 intermediate
    dense = DSV3.num_active_matmul_params - 129280 * 7168 - experts_active  # minus the LM head
    assert br.dense_peak_s == pytest.approx(2 * (dense - attn) * 1000 / 9000e12 + 2 * attn * 1000 / 4500e12)
    llama = PerfModel(L70, get_gpu("B200-SXM"), "fp4", efficiency=IDEAL)  # not MLA: everything NVFP4
    assert llama._fp8_attention_params == 0


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


def test_device_memory_is_what_the_driver_reports():
    """nvidia-smi memory.total / cudaMemGetInfo totals are below the marketing GiB; KV sizing starts there."""
    h100, h200, a100 = get_gpu("H100-SXM"), get_gpu("H200-SXM"), get_gpu("A100-SXM-80GB")
    assert h100.cuda_memory_bytes == 81559 * 2**20 < h100.memory_bytes == 80 * 2**30
    assert h200.cuda_memory_bytes == 143771 * 2**20
    assert get_gpu("B200-SXM").cuda_memory_bytes == int(178.35 * 2**30)
    assert a100.cuda_memory_bytes == a100.memory_bytes == 81920 * 2**20
    pm = PerfModel(L8, h100, "bf16")
    assert pm.memory_breakdown(1).budget_bytes == pytest.approx(0.9 * 81559 * 2**20)


def test_trtllm_kv_cache_takes_a_fraction_of_the_free_memory_by_hand():
    """vLLM: 0.9 x total - weights - activations - reserve; TensorRT-LLM: 0.9 x (total - weights - activations
    - reserve) (KvCacheConfig.free_gpu_memory_fraction)."""
    total = 81559 * 2**20
    weights = L70.num_params + 2 * 128256 * 8192  # fp8 body, 16-bit embedding and LM head
    acts = 8192 * (4 * 8192 + 2 * 28672) * 2
    reserve = 3_758_096_384
    vllm = PerfModel(L70, get_gpu("H100-SXM"), "fp8").memory_breakdown(1)
    trt = PerfModel(L70, get_gpu("H100-SXM"), "fp8", backend="trtllm").memory_breakdown(1)
    assert vllm.kv_bytes == pytest.approx(0.9 * total - weights - acts - reserve)
    assert trt.kv_bytes == pytest.approx(0.9 * (total - weights - acts - reserve))
    assert trt.kv_free_fraction == 0.9 and vllm.kv_free_fraction == 1.0
    assert trt.explain().startswith("0.9 x (")
    cap = PerfModel(L70, get_gpu("H100-SXM"), "fp8", backend="trtllm").kv_capacity_tokens(1)
    assert cap == int(trt.kv_bytes // (2 * 80 * 8 * 128))  # fp8 KV, 8 KV heads
    assert PerfModel(L70, get_gpu("H100-SXM"), "fp8", backend="sglang").memory_breakdown(1) == vllm


def test_moe_activation_traffic_counts_the_expert_copies_by_hand():
    """Mixtral 8x7B (32 MoE layers, top-2 of 8, hidden 4096, expert FFN 14336) at TP2: per token and layer 10
    hidden values of norms / residual adds, 3 x 2 x 14336 / 2 of gated activation and 3 x 2 hidden of expand /
    finalize copies, 2 bytes each; the time is that traffic at the ``memory`` efficiency, added to the step."""
    eff = replace(IDEAL, memory=0.5)
    pm = PerfModel(MIXTRAL, get_gpu("H100-SXM"), "bf16", efficiency=eff)
    per_token = 32 * (10 * 4096 + 3 * 2 * 14336 / 2 + 3 * 2 * 4096) * 2
    assert pm.activation_bytes_per_token(2) == pytest.approx(per_token, rel=1e-12)
    br = pm.decode_breakdown(64, 1024, tp=2)
    assert br.act_peak_s == pytest.approx(64 * per_token / 3350e9, rel=1e-9)
    assert br.act_memory_s == pytest.approx(br.act_peak_s / 0.5, rel=1e-9)
    without = replace(br, act_memory_s=0.0)
    assert br.total_s == pytest.approx(without.total_s + br.act_memory_s, rel=1e-12)
    pre = pm.prefill_breakdown(1000, tp=2, batch=3)
    assert pre.act_peak_s == pytest.approx(3000 * per_token / 3350e9, rel=1e-9)


# ---------------------------------------------------------------- expert parallelism / attention DP
# Mixtral 8x7B: 32 layers, all MoE, top-2 of 8 experts, hidden 4096, expert FFN 14336, 8 KV heads of 128,
# vocabulary 32000, untied embeddings.
MIX_EXPERT_PARAMS = 32 * 8 * 3 * 4096 * 14336  # gate, up, down of every expert of every layer
QWEN235 = load_model_spec(MODELS / "Qwen--Qwen3-235B-A22B_config.json")


def test_default_mapping_is_plain_tp_and_ep_is_ignored_on_dense_models():
    h100 = get_gpu("H100-SXM")
    plain = PerfModel(MIXTRAL, h100, "bf16", efficiency=IDEAL)
    explicit = PerfModel(MIXTRAL, h100, "bf16", efficiency=IDEAL, expert_parallel=False, attention_dp=False)
    assert plain.decode_breakdown(64, 1024, 2) == explicit.decode_breakdown(64, 1024, 2)
    assert plain.weight_bytes_per_rank(2) == explicit.weight_bytes_per_rank(2) == MIXTRAL.num_params * 2 / 2
    assert PerfModel(L8, h100, "bf16", expert_parallel=True).expert_parallel is False  # no experts to split


def test_expert_parallel_keeps_weights_and_comm_but_splits_the_token_copies_by_hand():
    """EP = TP2: each rank holds 4 whole experts instead of half of all 8 (same bytes), the all-reduces are
    those of TP, and a rank expands / finalizes only the copies routed to its own experts: per token and layer
    10 hidden (norms, residuals) + 3 x 2 x 14336 / 2 (gated activation) + 3 x 2 x 4096 / 2 (copies), 2 B each."""
    h100 = get_gpu("H100-SXM")
    tp_pm = PerfModel(MIXTRAL, h100, "bf16", efficiency=IDEAL)
    ep_pm = PerfModel(MIXTRAL, h100, "bf16", efficiency=IDEAL, expert_parallel=True)
    assert ep_pm.weight_bytes_per_rank(2) == tp_pm.weight_bytes_per_rank(2)
    assert ep_pm.activation_bytes_per_token(2) == pytest.approx(
        32 * (10 * 4096 + 3 * 2 * 14336 / 2 + 3 * 2 * 4096 / 2) * 2, rel=1e-12)
    a, b = tp_pm.decode_breakdown(64, 1024, 2), ep_pm.decode_breakdown(64, 1024, 2)
    assert (a.comm_s, a.weights_peak_s, a.kv_peak_s, a.compute_s) == (b.comm_s, b.weights_peak_s, b.kv_peak_s,
                                                                       b.compute_s)
    assert b.act_peak_s == pytest.approx(64 * ep_pm.activation_bytes_per_token(2) / 3350e9, rel=1e-9)


def test_attention_dp_replicates_non_expert_weights_and_drops_replicated_kv_heads_by_hand():
    """Attention DP: every rank holds all non-expert weights + 1/tp of the experts; KV per token and rank is the
    whole model's KV / tp. Qwen3-235B has 4 KV heads: plain TP8 puts 1 head of every token on each rank
    (2 x 94 x 1 x 128 B at fp8), attention DP 2 x 94 x 4 x 128 / 8 B: half."""
    h100 = get_gpu("H100-SXM")
    adp = PerfModel(MIXTRAL, h100, "bf16", efficiency=IDEAL, expert_parallel=True, attention_dp=True)
    non_expert = (MIXTRAL.num_params - MIX_EXPERT_PARAMS) * 2
    assert adp.weight_bytes_per_rank(2) == pytest.approx(non_expert + MIX_EXPERT_PARAMS * 2 / 2, rel=1e-12)
    assert adp.kv_bytes_per_token_rank(2) == 2 * 32 * 8 * 128 * 2 / 2  # 8 heads >= tp: same as plain TP
    q_tp = PerfModel(QWEN235, h100, "fp8")
    q_adp = PerfModel(QWEN235, h100, "fp8", expert_parallel=True, attention_dp=True)
    assert q_tp.kv_bytes_per_token_rank(8) == 2 * 94 * 1 * 128 * 1
    assert q_adp.kv_bytes_per_token_rank(8) == 2 * 94 * 4 * 128 * 1 / 8
    kv = q_adp.memory_breakdown(8).kv_bytes
    assert q_adp.kv_capacity_tokens(8) == int(kv // (2 * 94 * 4 * 128 / 8))


def test_attention_dp_step_by_hand():
    """Mixtral, TP2 with attention DP + EP, decode batch 64 at context 1024 (ideal efficiencies):

    * weights read per rank: all non-expert weights but the input embedding (a lookup) + half of the 8 touched
      experts (64 tokens x top-2 touch all 8);
    * non-expert GEMMs run over 64 / 2 = 32 rows per rank (logits rows too); experts see the same rows as TP;
    * comm: no all-reduce after attention; each of the 32 MoE layers all-gathers and reduce-scatters
      ``(tp-1)/tp x 64 x 4096 x 2`` bytes: 64 collectives, half the ring bytes of TP's 64 all-reduces;
    * element-wise traffic per token: (10 x 4096 / 2 + 3 x 2 x 14336 / 2 + 3 x 2 x 4096 / 2) x 32 x 2 B.
    """
    h100 = get_gpu("H100-SXM")
    tp_pm = PerfModel(MIXTRAL, h100, "bf16", efficiency=IDEAL)
    adp = PerfModel(MIXTRAL, h100, "bf16", efficiency=IDEAL, expert_parallel=True, attention_dp=True)
    br, tp_br = adp.decode_breakdown(64, 1024, 2), tp_pm.decode_breakdown(64, 1024, 2)
    non_expert_read = (MIXTRAL.num_params - MIX_EXPERT_PARAMS - 32000 * 4096) * 2
    # expected distinct experts 8 (1 - (6/8)^64) = 8 - 8e-8: all 8 to 1e-8
    assert br.weights_peak_s == pytest.approx((non_expert_read + MIX_EXPERT_PARAMS * 2 / 2) / 3350e9, rel=1e-7)
    assert (br.gemm_tokens, br.logits_rows) == (32.0, 32.0)
    assert br.expert_tokens == tp_br.expert_tokens
    ring = (2 - 1) / 2 * 64 * 4096 * 2 / h100.allreduce_bus_bw_bytes_per_s
    assert br.num_allreduces == 64 and br.comm_peak_s == pytest.approx(64 * ring, rel=1e-12)
    assert tp_br.comm_peak_s == pytest.approx(2 * br.comm_peak_s, rel=1e-12)
    assert adp.activation_bytes_per_token(2) == pytest.approx(
        32 * (10 * 4096 / 2 + 3 * 2 * 14336 / 2 + 3 * 2 * 4096 / 2) * 2, rel=1e-12)
    # FLOPs per rank do not change: the same work, split by rows instead of columns
    assert br.dense_peak_s == pytest.approx(tp_br.dense_peak_s, rel=1e-12)
    assert br.attn_peak_s == pytest.approx(tp_br.attn_peak_s, rel=1e-12)
    # a dense model under attention DP has no collective at all
    assert PerfModel(L8, h100, "bf16", efficiency=IDEAL, attention_dp=True).decode_breakdown(64, 1024, 2).comm_s == 0


def test_overlap_scheduler_host_work_bounds_the_step_instead_of_adding_by_hand():
    # TensorRT-LLM (overlap scheduler): step = max(GPU work + fixed overhead, seqs x per-seq host s x host factor);
    # vLLM: the per-sequence work adds to the step. Grace hosts run it GRACE_HOST_SLOWDOWN times slower.
    from runtime.perf.gpus import GRACE_HOST_SLOWDOWN

    eff = replace(IDEAL, decode_step_overhead_s=0.001, decode_seq_overhead_s=1e-5)
    h100 = get_gpu("H100-SXM")
    gpu_only = PerfModel(L8, h100, "fp8", efficiency=replace(eff, decode_seq_overhead_s=0.0), backend="trtllm")
    trt = PerfModel(L8, h100, "fp8", efficiency=eff, backend="trtllm")
    vllm = PerfModel(L8, h100, "fp8", efficiency=eff, backend="vllm")
    for batch in (8, 4096):
        g = gpu_only.decode_step_time_s(batch, 1024, 1)
        assert trt.decode_step_time_s(batch, 1024, 1) == pytest.approx(max(g, batch * 1e-5))
        assert vllm.decode_step_time_s(batch, 1024, 1) == pytest.approx(g + batch * 1e-5)
    assert trt.decode_step_time_s(8, 1024, 1) == pytest.approx(gpu_only.decode_step_time_s(8, 1024, 1))
    gb = PerfModel(L8, get_gpu("GB200"), "fp8", efficiency=eff, backend="trtllm")
    assert gb.decode_breakdown(4096, 1024, 1).host_s == pytest.approx(4096 * 1e-5 * GRACE_HOST_SLOWDOWN)
    assert get_gpu("B200-SXM").host_cpu_slowdown == 1.0
