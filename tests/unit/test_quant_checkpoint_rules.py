"""What a quantised checkpoint's config says beyond its format, and how the tuner uses it: block-FP8 shards
vLLM refuses to load, modules kept in 16 bits, dense compressed-tensors MXFP4, and AWQ / GPTQ deployed with an
FP8 KV cache. The configs are those of the published checkpoints (Qwen3-235B-A22B-FP8, Qwen3-30B-A3B-FP8,
Llama-3.1-405B-Instruct-FP8, a Llama-3.1-70B AWQ), trimmed to the fields pdserve reads."""

from __future__ import annotations

import pytest

from runtime.config import SloSpec, WorkloadSpec
from runtime.models.quant import detect_precision, module_unquantized
from runtime.models.spec import ModelSpec
from runtime.perf.gpus import get_gpu
from runtime.perf.model import MXFP4_BYTES, PerfModel
from runtime.perf.worker import Layout
from runtime.tuner.layouts import layout_problem
from runtime.tuner.search import deployment_perf, evaluate, perf_precisions, tune

BLOCK_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def qwen3_moe(hidden: int, inter: int, moe_inter: int, layers: int, heads: int, quant: dict | None) -> dict:
    c = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
         "intermediate_size": inter, "moe_intermediate_size": moe_inter, "num_hidden_layers": layers,
         "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
         "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
         "max_position_embeddings": 40960, "tie_word_embeddings": False}
    if quant is not None:
        c["quantization_config"] = quant
    return c


QWEN3_235B_FP8 = qwen3_moe(4096, 12288, 1536, 94, 64, BLOCK_FP8)
QWEN3_30B_FP8 = qwen3_moe(2048, 6144, 768, 48, 32, BLOCK_FP8)


def llama(hidden: int, inter: int, layers: int, heads: int, quant: dict | None = None) -> dict:
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
         "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
         "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"},
         "tie_word_embeddings": False}
    if quant is not None:
        c["quantization_config"] = quant
    return c


def llama_405b_fp8() -> dict:
    """meta-llama/Llama-3.1-405B-Instruct-FP8: fbgemm FP8, every attention projection, the first and last
    layers' MLPs and the LM head kept in bf16 (511 entries, as published)."""
    skip = [f"model.layers.{i}.self_attn.{p}" for i in range(126) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    skip += [f"model.layers.{i}.mlp.{p}" for i in (0, 125) for p in ("down_proj", "gate_proj", "up_proj")]
    skip.append("lm_head")
    return llama(16384, 53248, 126, 128, {"activation_scale_ub": 1200.0, "quant_method": "fbgemm_fp8",
                                          "modules_to_not_convert": skip})


# ------------------------------------------------------------------ block-FP8 tensor-parallel shards
def test_block_fp8_moe_refuses_tp_that_splits_an_expert_block() -> None:
    """vLLM's Fp8MoEMethod refuses moe_intermediate_size / TP not a multiple of block_n (Qwen3-235B-A22B-FP8 at
    TP 8: 192; Qwen3-30B-A3B-FP8 at TP 4: 192); with expert parallelism each rank holds whole experts."""
    big = ModelSpec.from_hf_config(QWEN3_235B_FP8, "Qwen3-235B-A22B-FP8")
    small = ModelSpec.from_hf_config(QWEN3_30B_FP8, "Qwen3-30B-A3B-FP8")
    assert big.weight_block_size == (128, 128)
    why = layout_problem(big, Layout(tp=8), 8)
    assert "192" in why and "block_n 128" in why and "moe_intermediate_size 1536 / TP 8" in why
    assert layout_problem(big, Layout(tp=4), 8) == ""
    assert layout_problem(big, Layout(tp=8, ep=True), 8) == ""
    assert layout_problem(big, Layout(tp=1, dp=8, ep=True), 8) == ""
    assert "192" in layout_problem(small, Layout(tp=4), 8)
    assert "96" in layout_problem(small, Layout(tp=8), 8)
    assert layout_problem(small, Layout(tp=2), 8) == ""
    # the 16-bit checkpoint of the same model has no blocks
    assert layout_problem(ModelSpec.from_hf_config(qwen3_moe(4096, 12288, 1536, 94, 64, None), "q"),
                          Layout(tp=8), 8) == ""


def test_tuner_lists_block_fp8_shards_as_infeasible_with_the_reason() -> None:
    m = ModelSpec.from_hf_config(QWEN3_235B_FP8, "Qwen3-235B-A22B-FP8")
    r = tune(m, "H100-SXM", SloSpec(), WorkloadSpec(), precision="fp8")
    assert r.best.feasible and 8 not in (r.best.prefill_tp, r.best.decode_tp)
    tp8 = [c for c in r.candidates if 8 in (c.prefill_tp, c.decode_tp)]
    assert tp8 and all(not c.feasible and "block_n 128" in c.reason for c in tp8)
    # the plain evaluate() of a prebuilt model applies the rule too
    c = evaluate(deployment_perf(m, get_gpu("H100-SXM"), "fp8"), 4, 8, SloSpec(), WorkloadSpec())
    assert not c.feasible and "block_n 128" in c.reason


def test_block_fp8_dense_row_parallel_input_share_must_hold_whole_blocks() -> None:
    """validate_fp8_block_shape: a row-parallel layer's input share (down_proj: intermediate_size / TP) is a
    multiple of block_k when TP > 1; fp8 checkpoints' merged column layers (gate/up, QKV) are not checked."""
    m = ModelSpec.from_hf_config(llama(8192, 29568, 80, 64, BLOCK_FP8), "dense-block-fp8")
    assert layout_problem(m, Layout(tp=1), 8) == ""
    why = layout_problem(m, Layout(tp=2), 8)
    assert "down_proj input per rank 14784" in why and "block_k 128" in why
    ok = ModelSpec.from_hf_config(llama(8192, 28672, 80, 64, BLOCK_FP8), "dense-block-fp8-ok")
    assert all(layout_problem(ok, Layout(tp=t), 8) == "" for t in (1, 2, 4, 8))
    # a down_proj the config keeps in bf16 is not checked by vLLM
    skip = dict(BLOCK_FP8, ignored_layers=[f"model.layers.{i}.mlp.down_proj" for i in range(80)])
    assert layout_problem(ModelSpec.from_hf_config(llama(8192, 29568, 80, 64, skip), "d"), Layout(tp=2), 8) == ""


def test_compressed_tensors_block_structure_is_read() -> None:
    q = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}},
        "ignore": ["lm_head", "re:.*mlp.gate$"]}
    p = detect_precision(q)
    assert (p.weights, p.block_size, p.unquantized) == ("fp8-block", (128, 128), ("lm_head", "re:.*mlp.gate$"))
    m = ModelSpec.from_hf_config(qwen3_moe(2048, 6144, 768, 48, 32, q), "ct-block")
    assert "192" in layout_problem(m, Layout(tp=4), 8)


# ------------------------------------------------------------------ modules kept in 16 bits
def test_modules_to_not_convert_are_sized_at_16_bits() -> None:
    """Llama-3.1-405B-FP8 keeps 126 layers of attention and two MLPs in bf16: ~486 GB, not ~410 GB."""
    m = ModelSpec.from_hf_config(llama_405b_fp8(), "Llama-3.1-405B-FP8")
    h, inter, vocab = 16384, 53248, 128256
    attn = 2 * h * h + 2 * h * 8 * 128
    wide = 126 * attn + 2 * 3 * h * inter + 2 * vocab * h
    assert m.unquantized_linear_params == 126 * attn + 2 * 3 * h * inter
    pm = PerfModel(m, get_gpu("H100-SXM"), "fp8")
    assert pm.weight_bytes_per_rank(1) == pytest.approx((m.num_params - wide) * 1.0 + wide * 2.0, rel=1e-12)
    # the same config without the list: everything but embedding / LM head at 1 byte, more KV
    plain = llama(16384, 53248, 126, 128, {"quant_method": "fbgemm_fp8"})
    pp = PerfModel(ModelSpec.from_hf_config(plain, "p"), get_gpu("H100-SXM"), "fp8")
    assert pm.weight_bytes_per_rank(8) > pp.weight_bytes_per_rank(8) + 8e9
    assert pm.kv_capacity_tokens(8) < pp.kv_capacity_tokens(8) / 1.5


@pytest.mark.parametrize("patterns, name, hit", [
    (("model.layers.0.self_attn.k_proj",), "model.layers.0.self_attn.k_proj", True),
    (("model.layers.0.self_attn.k_proj",), "model.layers.10.self_attn.k_proj", False),
    (("re:.*self_attn.*",), "model.layers.3.self_attn.o_proj", True),
    (("re:.*mlp.gate$",), "model.layers.3.mlp.gate_proj", False),
    (("re:.*mlp.gate$",), "model.layers.3.mlp.gate", True),
    (("model.layers.*.self_attn",), "model.layers.7.self_attn.q_proj", True),
    (("model.layers.0.mlp",), "model.layers.0.mlp.down_proj", True),
    (("model.layers.0.mlp",), "model.layers.0.mlp_norm", False),
])
def test_unquantized_patterns_match_as_vllm_reads_them(patterns, name, hit) -> None:
    assert module_unquantized(name, patterns) is hit


@pytest.mark.parametrize("quant, listed", [
    ({"quant_method": "fp8", "ignored_layers": ["a"], "modules_to_not_convert": ["b"]}, ("a",)),
    ({"quant_method": "fp8", "modules_to_not_convert": ["b"]}, ("b",)),
    ({"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head"]}, ("lm_head",)),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head", "model.layers.0*"]},
     ("lm_head", "model.layers.0*")),
])
def test_each_method_reads_its_own_key(quant, listed) -> None:
    assert detect_precision(quant).unquantized == listed


# ------------------------------------------------------------------ dense compressed-tensors MXFP4
def test_dense_compressed_tensors_mxfp4_quantizes_every_linear_layer_it_does_not_ignore() -> None:
    q = {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}}}
    m = ModelSpec.from_hf_config(llama(8192, 28672, 80, 64, q), "Llama-3.1-70B-MXFP4")
    assert m.weight_format == "mxfp4"
    wide = 2 * 128256 * 8192  # embedding + LM head
    pm = deployment_perf(m, get_gpu("B200"), "bf16")
    assert pm.weight_bytes_per_rank(1) == pytest.approx((m.num_params - wide) * MXFP4_BYTES + wide * 2.0, rel=1e-12)


# ------------------------------------------------------------------ AWQ / GPTQ with an FP8 KV cache
def test_awq_deployed_at_fp8_is_costed_as_bf16_weights_with_an_fp8_kv_cache() -> None:
    awq = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
           "zero_point": True}
    m = ModelSpec.from_hf_config(llama(8192, 28672, 80, 64, awq), "Llama-3.1-70B-AWQ")
    assert m.weight_format == "unknown" and "sized as bf16" in m.precision_note
    assert perf_precisions(m, "fp8") == ("bf16", "fp8")
    g = get_gpu("H100-SXM")
    pm = deployment_perf(m, g, "fp8")
    bf16 = PerfModel(m, g, "bf16")
    assert (pm.precision, pm.compute_precision, pm.kv_dtype_bytes) == ("bf16", "bf16", 1.0)
    assert pm.weight_bytes_per_rank(4) == bf16.weight_bytes_per_rank(4)
    r = tune(m, g, SloSpec(), WorkloadSpec(), precision="fp8")
    assert (r.precision, r.weight_precision) == ("fp8", "bf16")
    assert any("sized as bf16" in n for n in r.notes)


def test_hf_quant_config_exclude_modules_are_kept_in_16_bits(tmp_path) -> None:
    """A ModelOpt checkpoint's hf_quant_config.json lists its bf16 modules with wildcards (vLLM reads them)."""
    import json

    from runtime.modelfiles.load import load_model_spec

    (tmp_path / "config.json").write_text(json.dumps(llama(8192, 28672, 80, 64)))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "exclude_modules": ["lm_head", "model.layers.0.self_attn*"]}}))
    m = load_model_spec(tmp_path, "modelopt-fp8")
    assert m.weight_format == "fp8" and m.unquantized_modules == ("lm_head", "model.layers.0.self_attn*")
    assert m.unquantized_linear_params == 2 * 8192 * 8192 + 2 * 8192 * 8 * 128  # layer 0's attention
