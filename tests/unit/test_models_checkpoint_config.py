"""What the tuner accepts from a checkpoint's config.json and quantization config, as vLLM 0.28 / transformers
read them: ``model_type`` is required, RoPE scaling vLLM cannot build is refused, ModelOpt ``FP8_PB_WO`` keeps
whole 128 x 128 blocks on each rank, and a multimodal wrapper's (Llama 4) ignore list names its text model's
modules under ``language_model.``. Configs mirror the published checkpoints' config.json files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.modelfiles.load import load_model_spec
from runtime.models.spec import ModelConfigError, ModelSpec


def catalog(stem: str) -> dict:
    return json.loads((CATALOG_DIR / f"{stem}_config.json").read_text())


# Qwen/Qwen2.5-72B-Instruct config.json as published
QWEN25_72B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 8192, "initializer_range": 0.02, "intermediate_size": 29568,
    "max_position_embeddings": 32768, "max_window_layers": 70, "model_type": "qwen2", "num_attention_heads": 64,
    "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}


def pb_wo_quant(exclude: list[str]) -> dict:
    """A TensorRT Model Optimizer hf_quant_config.json of a per-block weight-only FP8 export."""
    return {"producer": {"name": "modelopt", "version": "0.31.0"},
            "quantization": {"quant_algo": "FP8_PB_WO", "kv_cache_quant_algo": None, "exclude_modules": exclude}}


def folder(tmp_path: Path, name: str, cfg: dict, hf_quant: dict | None = None) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    if hf_quant is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return d


# ------------------------------------------------------------------ model_type
def test_a_config_without_model_type_is_refused_naming_the_key_and_file(tmp_path: Path) -> None:
    cfg = dict(QWEN25_72B)
    del cfg["model_type"]  # architectures alone: AutoConfig refuses it ("Should have a `model_type` key")
    with pytest.raises(ModelConfigError, match="missing required field model_type"):
        ModelSpec.from_hf_config(cfg, "q")
    d = folder(tmp_path, "Qwen2.5-72B-Instruct", cfg)
    with pytest.raises(ModelConfigError, match="model_type") as e:
        load_model_spec(d)
    assert str(d / "config.json") in str(e.value)


def test_model_type_must_be_a_string_and_a_wrapper_needs_its_own() -> None:
    with pytest.raises(ModelConfigError, match="model_type must be a string"):
        ModelSpec.from_hf_config(dict(QWEN25_72B, model_type=["qwen2"]), "q")
    maverick = catalog("meta-llama--Llama-4-Maverick-17B-128E-Instruct")
    assert ModelSpec.from_hf_config(maverick, "m").model_type == "llama4_text"
    del maverick["model_type"]  # the text_config's llama4_text does not stand in for the file's own
    with pytest.raises(ModelConfigError, match="model_type"):
        ModelSpec.from_hf_config(maverick, "m")


# ------------------------------------------------------------------ rope_scaling
def qwen3_8b(rope) -> dict:
    return catalog("Qwen--Qwen3-8B") | {"rope_scaling": rope}  # max_position_embeddings 40960


@pytest.mark.parametrize("rope, what", [
    ({"rope_type": "yarn_v2", "factor": 4.0}, "RoPE type 'yarn_v2', which vLLM cannot build"),
    ({"type": 4.0}, "RoPE type 4.0"),
    ({"rope_type": "linear"}, "type 'linear' has no factor"),
    ({"type": "dynamic"}, "type 'dynamic' has no factor"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 32768}, "type 'yarn' has no factor"),
    ({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, "type 'llama3' has no factor"),
    ({"rope_type": "yarn", "type": "linear", "factor": 4.0}, "rope_type 'yarn' and type 'linear'"),
    ({"full_attention": {"rope_type": "yarn", "factor": 4.0}, "sliding_attention": "linear"},
     "rope_scaling.sliding_attention must be a JSON object"),
])
def test_rope_scaling_vllm_cannot_build_is_refused(rope, what: str) -> None:
    with pytest.raises(ModelConfigError, match="rope_scaling") as e:
        ModelSpec.from_hf_config(qwen3_8b(rope), "q")
    assert what in str(e.value)


def test_rope_scaling_vllm_builds_is_accepted_and_sizes_the_context() -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cases = [
        (yarn, 131072),
        ({"type": "dynamic", "alpha": 1000.0}, 40960),  # Hunyuan's NTK alpha: no factor, no longer context
        ({"type": "mrope", "mrope_section": [16, 24, 24]}, 40960),  # Qwen2-VL's legacy spelling of default
        ({"type": "su", "rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
          "original_max_position_embeddings": 4096}, 40960),
        ({"full_attention": yarn, "sliding_attention": None}, 131072),  # per layer type, a NoPE type null
    ]
    for rope, tokens in cases:
        assert ModelSpec.from_hf_config(qwen3_8b(rope), "q").max_context_tokens == tokens, rope


# ------------------------------------------------------------------ ModelOpt FP8_PB_WO
def test_modelopt_fp8_pb_wo_refuses_tp_that_splits_a_128_block(tmp_path: Path) -> None:
    m = load_model_spec(folder(tmp_path, "Qwen2.5-72B-Instruct-FP8-PB-WO", QWEN25_72B, pb_wo_quant(["lm_head"])))
    assert (m.quant_algo, m.weight_format, m.weight_block_size) == ("FP8_PB_WO", "fp8-block", (128, 128))
    assert m.block_quant_problem(1) == ""
    # intermediate 29568 = 231 x 128: each TP-2 rank's down_proj input, 14784, splits a block
    problem = m.block_quant_problem(2)
    assert "down_proj input per rank 14784 (TP 2)" in problem and "FP8_PB_WO" in problem
    assert "vLLM refuses" in problem


def test_modelopt_fp8_pb_wo_checks_merged_layers_at_every_tp(tmp_path: Path) -> None:
    # DeepSeek-V3: fused_qkv_a_proj outputs q_lora_rank 1536 + kv_lora_rank 512 + rope 64 = 2112 = 16.5 x 128,
    # which ModelOptFp8PbWoLinearMethod refuses on one GPU too; kept in 16 bits, nothing else splits a block
    ds = catalog("deepseek-ai--DeepSeek-V3")
    ds.pop("quantization_config", None)
    m = load_model_spec(folder(tmp_path, "a", ds, pb_wo_quant(["lm_head"])))
    assert "fused_qkv_a_proj) output per rank 2112 (TP 1)" in m.block_quant_problem(1)
    kept = load_model_spec(folder(tmp_path, "b", ds, pb_wo_quant(["lm_head", "model.layers.*.self_attn*"])))
    assert [kept.block_quant_problem(tp) for tp in (1, 8)] == ["", ""]
    # the per-tensor FP8 ModelOpt algorithm has no blocks
    assert load_model_spec(folder(tmp_path, "c", ds, pb_wo_quant([]) | {
        "quantization": {"quant_algo": "FP8"}})).block_quant_problem(1) == ""


# ------------------------------------------------------------------ multimodal wrappers: language_model.
def maverick_fp8() -> dict:
    """meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8: fbgemm FP8 with the text model's attention and dense
    FFNs (every other layer) kept in bf16, named as the wrapper's weights are, under language_model."""
    cfg = catalog("meta-llama--Llama-4-Maverick-17B-128E-Instruct")
    skip = [f"language_model.model.layers.{i}.self_attn" for i in range(48)]
    skip += [f"language_model.model.layers.{i}.feed_forward.mlp" for i in range(0, 48, 2)]
    skip += [f"language_model.model.layers.{i}.feed_forward" for i in range(0, 48, 2)]
    skip += ["vision_model", "multi_modal_projector", "language_model.lm_head"]
    cfg["quantization_config"] = {"activation_scale_ub": 1200.0, "quant_method": "fbgemm_fp8",
                                  "modules_to_not_convert": skip}
    return cfg


def test_a_wrappers_ignore_list_matches_its_text_model_modules() -> None:
    m = ModelSpec.from_hf_config(maverick_fp8(), "maverick-fp8")
    assert m.module_prefix == "language_model."
    h = 5120
    attn = h * 40 * 128 + 2 * h * 8 * 128 + 40 * 128 * h
    assert m.num_moe_layers == 24
    assert m.unquantized_linear_params == 48 * attn + 24 * 3 * h * 16384
    names = [n for n, _ in m.linear_modules()]
    assert names[0] == "language_model.model.layers.0.self_attn.q_proj"
    # a text-only checkpoint's names carry no prefix
    assert ModelSpec.from_hf_config(catalog("meta-llama--Meta-Llama-3.1-8B"), "l").linear_modules()[0][0] == (
        "model.layers.0.self_attn.q_proj")


def test_modelopt_names_match_without_the_language_model_prefix(tmp_path: Path) -> None:
    # vLLM's ModelOpt exclusion also tries the module name with language_model. removed
    cfg = catalog("meta-llama--Llama-4-Scout-17B-16E-Instruct")
    quant = {"producer": {"name": "modelopt", "version": "0.29.0"},
             "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                              "exclude_modules": ["lm_head", "model.layers.0.self_attn"]}}
    m = load_model_spec(folder(tmp_path, "Llama-4-Scout-17B-16E-Instruct-FP8", cfg, quant))
    h = m.hidden_size
    assert m.unquantized_linear_params == h * 40 * 128 + 2 * h * 8 * 128 + 40 * 128 * h


# ------------------------------------------------------------------ routed experts in an ignore list
# vLLM 0.28 builds a MoE layer's routed experts as ONE fused-MoE module with one quantization method (fp8 / ModelOpt
# ``is_layer_skipped``: an ignore entry naming any expert of layer i excludes all of layer i's experts;
# compressed-tensors decides on expert 0's projections; mxfp4 always quantises them)
def qwen3_30b(quant: dict) -> dict:
    return catalog("Qwen--Qwen3-30B-A3B") | {"quantization_config": quant}  # 48 MoE layers, 128 experts, k 8


def fp8(ignored: list[str]) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ignored}


def ct_fp8(ignore: list[str]) -> dict:
    """An llm-compressor FP8 (per-channel) compressed-tensors config."""
    return {"quant_method": "compressed-tensors", "ignore": ignore, "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}


QWEN3_30B_EXPERT = 3 * 2048 * 768  # one expert's gate, up and down projections, parameters


@pytest.mark.parametrize("cfg, what", [
    # expert 17's down_proj and experts 10-19 of every layer: 30 of layer 0's 384 expert weights
    (qwen3_30b(fp8(["model.layers.3.mlp.experts.17.down_proj", r"re:.*mlp\.experts\.1[0-9]\..*"])),
     "keeps 30 of the 384 routed-expert weights of model.layers.0.mlp.experts in 16 bits"),
    (qwen3_30b(fp8(["model.layers.3.mlp.experts.17"])),
     "keeps 3 of the 384 routed-expert weights of model.layers.3.mlp.experts"),
    (qwen3_30b(ct_fp8([r"re:.*mlp\.experts\.1[0-9]\..*", "lm_head"])), "keeps 30 of the 384"),
    # every expert kept, but vLLM's ModelOpt fnmatch of the fused layer's own name misses the wildcard
    (qwen3_30b({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["model.layers.*.mlp.experts.*"]}),
     "ModelOpt exclude_modules do not match the fused layer model.layers.0.mlp.experts"),
    # Mixtral names its experts' weights w1 / w3 / w2
    (catalog("mistralai--Mixtral-8x7B-v0.1") | {"quantization_config": fp8(
        ["model.layers.5.block_sparse_moe.experts.3.w2"])},
     "keeps 1 of the 24 routed-expert weights of model.layers.5.block_sparse_moe.experts"),
    # compressed-tensors decides on w1-less gate_proj names of expert 0, which a Mixtral checkpoint does not have
    (catalog("mistralai--Mixtral-8x7B-v0.1") | {"quantization_config": ct_fp8(
        [r"re:model\.layers\.5\.block_sparse_moe\.experts\.\d+\.w[123]$"])},
     "compressed-tensors ignore does not match model.layers.5.block_sparse_moe.experts.0.gate_proj"),
    # gpt-oss stores fused tensors: one of them kept, or both while vLLM's mxfp4 quantises every MoE layer
    (catalog("openai--gpt-oss-20b") | {"quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.experts.down_proj"]}},
     "keeps 1 of the 2 routed-expert weights of model.layers.0.mlp.experts"),
    (catalog("openai--gpt-oss-20b") | {"quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.2.mlp.experts"]}},
     "mxfp4 method quantises every fused-MoE layer"),
])
def test_an_ignore_list_vllm_cannot_load_for_the_routed_experts_is_refused(cfg: dict, what: str) -> None:
    with pytest.raises(ModelConfigError, match="vLLM cannot load this checkpoint") as e:
        ModelSpec.from_hf_config(cfg, "m")
    assert what in str(e.value)


def test_routed_experts_kept_whole_are_charged_at_16_bits() -> None:
    from runtime.perf.gpus import get_gpu
    from runtime.perf.model import PerfModel

    h100 = get_gpu("H100-SXM")
    base = ModelSpec.from_hf_config(qwen3_30b(fp8(["lm_head"])), "q")
    assert base.unquantized_expert_layers == () and base.unquantized_expert_params == 0
    # fp8: the entry names layer 3's fused experts (vLLM excludes them); compressed-tensors: a regex over
    # layers 3 and 7 that matches expert 0's projections (vLLM's test) and every other expert's
    for quant, layers in [(fp8(["lm_head", "model.layers.3.mlp.experts"]), (3,)),
                          (ct_fp8(["lm_head", r"re:model\.layers\.(3|7)\.mlp\.experts\..*"]), (3, 7))]:
        m = ModelSpec.from_hf_config(qwen3_30b(quant), "q")
        assert m.unquantized_expert_layers == layers
        assert m.unquantized_expert_params == len(layers) * 128 * QWEN3_30B_EXPERT
        wide, narrow = PerfModel(m, h100, "fp8"), PerfModel(base, h100, "fp8")
        # 1 byte more per kept expert weight, resident and (decode of one sequence: its 8 experts) streamed
        assert wide.weight_bytes_per_rank(1) - narrow.weight_bytes_per_rank(1) == len(layers) * 128 * QWEN3_30B_EXPERT
        read = [p.decode_breakdown(1, 1024, 1).weights_peak_s * h100.mem_bw_bytes_per_s for p in (wide, narrow)]
        assert read[0] - read[1] == pytest.approx(len(layers) * 8 * QWEN3_30B_EXPERT)
        bf16 = [PerfModel(s, h100, "bf16").weight_bytes_per_rank(1) for s in (m, base)]
        assert bf16[0] == bf16[1]  # a bf16 deployment charges every expert at 16 bits anyway


def test_fused_experts_of_llama4_match_with_and_without_the_wrapper_prefix(tmp_path: Path) -> None:
    # Scout: 48 MoE layers of 16 experts stored as experts.gate_up_proj / experts.down_proj; vLLM's ModelOpt
    # exclusion also matches an entry against the layer name without language_model.
    cfg = catalog("meta-llama--Llama-4-Scout-17B-16E-Instruct")
    expert = 3 * 5120 * 8192
    for entry in ("language_model.model.layers.3.feed_forward.experts", "model.layers.3.feed_forward.experts"):
        quant = {"producer": {"name": "modelopt", "version": "0.29.0"},
                 "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head", entry]}}
        m = load_model_spec(folder(tmp_path, entry, cfg, quant))
        assert (m.unquantized_expert_layers, m.unquantized_expert_params) == ((3,), 16 * expert), entry
    assert ModelSpec.from_hf_config(catalog("meta-llama--Llama-4-Scout-17B-16E-Instruct"), "s").routed_expert_modules(
        3) == ["language_model.model.layers.3.feed_forward.experts.gate_up_proj",
               "language_model.model.layers.3.feed_forward.experts.down_proj"]


def test_expert_names_are_walked_once_per_spec_and_not_at_all_when_no_entry_can_match(monkeypatch) -> None:
    from runtime.perf.gpus import get_gpu
    from runtime.perf.model import PerfModel

    walks = []
    real = ModelSpec.routed_expert_modules
    monkeypatch.setattr(ModelSpec, "routed_expert_modules", lambda self, i: walks.append(i) or real(self, i))
    ds = catalog("deepseek-ai--DeepSeek-V3")  # 58 MoE layers x 256 experts x 3 projections
    # names, wildcards and regexes that can name no routed expert's weight: nothing is walked
    quiet = ModelSpec.from_hf_config(ds | {"quantization_config": fp8(
        ["lm_head", "model.layers.0.mlp.gate", "model.layers.*.self_attn*", "model.layers.1?.mlp.shared_experts"])},
        "d")
    assert quiet.unquantized_expert_layers == () and walks == []
    m = ModelSpec.from_hf_config(ds | {"quantization_config": ct_fp8([r"re:.*mlp\.gate$", "lm_head"])}, "d")
    assert len(walks) == 58 and m.unquantized_expert_layers == ()
    for tp in (1, 2, 4, 8):  # every tuner candidate builds its own PerfModel from the one spec
        PerfModel(m, get_gpu("H100-SXM"), "fp8").weight_bytes_per_rank(tp)
    assert len(walks) == 58
