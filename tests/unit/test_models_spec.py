"""ModelSpec from real HF config.json files: parameters, active parameters, KV bytes per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.modelfiles.load import load_model_spec
from runtime.models.spec import ModelConfigError, ModelSpec
from runtime.modelfiles.catalog import CATALOG_DIR

MODELS = CATALOG_DIR


def spec(stem: str) -> ModelSpec:
    return load_model_spec(MODELS / f"{stem}_config.json")


def cfg(stem: str) -> dict:
    return json.loads((MODELS / f"{stem}_config.json").read_text())


SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30,
    "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "vocab_size": 49152, "tie_word_embeddings": True,
}


def test_llama31_8b_parameter_count_by_hand():
    m = spec("meta-llama--Meta-Llama-3.1-8B")
    h, kv, inter, v, n = 4096, 8 * 128, 14336, 128256, 32
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h  # q,o + k,v + gate/up/down + 2 norms
    expected = n * per_layer + 2 * v * h + h  # + untied embedding and LM head + final norm
    assert m.num_params == expected
    assert m.num_params == pytest.approx(8.03e9, rel=1e-3)
    assert m.num_active_params == m.num_params  # dense


def test_llama31_70b_parameter_count_by_hand():
    m = spec("meta-llama--Meta-Llama-3.1-70B")
    h, kv, inter, v, n = 8192, 8 * 128, 28672, 128256, 80
    expected = n * (2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h) + 2 * v * h + h
    assert m.num_params == expected
    assert m.num_params == pytest.approx(70.6e9, rel=1e-3)


def test_kv_bytes_per_token_llama_bf16_and_fp8():
    m8, m70 = spec("meta-llama--Meta-Llama-3.1-8B"), spec("meta-llama--Meta-Llama-3.1-70B")
    assert m8.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 131072
    assert m70.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2 == 327680
    assert m70.kv_bytes_per_token(1) == 327680 / 2


def test_kv_bytes_per_rank_split_by_tp_and_replicated_beyond_kv_heads():
    m = spec("meta-llama--Meta-Llama-3.1-70B")  # 8 KV heads
    assert m.kv_bytes_per_token(2, tp=2) == 327680 / 2
    assert m.kv_bytes_per_token(2, tp=8) == 327680 / 8
    q = spec("Qwen--Qwen3-235B-A22B")  # 4 KV heads: TP 8 replicates, one head per rank
    assert q.kv_bytes_per_token(2, tp=8) == q.kv_bytes_per_token(2, tp=4) == 2 * 94 * 1 * 128 * 2


@pytest.mark.parametrize(
    "stem,total,active",
    [
        ("mistralai--Mixtral-8x7B-v0.1", 46.7e9, 12.9e9),  # Mistral AI announcement
        ("mistralai--Mixtral-8x22B-v0.1", 141e9, 39e9),
        ("Qwen--Qwen3-30B-A3B", 30.5e9, 3.3e9),  # Qwen3 model card
        ("Qwen--Qwen3-235B-A22B", 235e9, 22e9),
        ("deepseek-ai--DeepSeek-V3", 671e9, 37e9),  # DeepSeek-V3 report (without the MTP module)
        ("meta-llama--Llama-4-Maverick-17B-128E-Instruct", 400e9, 17e9),  # text part
        ("openai--gpt-oss-120b", 116.8e9, 5.1e9 + 0.58e9),  # card counts active w/o the input embedding
    ],
)
def test_moe_total_vs_active_match_published_sizes(stem, total, active):
    m = spec(stem)
    assert m.num_experts > 0
    assert m.num_params == pytest.approx(total, rel=0.03)
    assert m.num_active_params == pytest.approx(active, rel=0.05)
    assert m.num_active_params < m.num_params


def test_deepseek_mla_kv_is_the_compressed_latent_and_not_split_by_tp():
    m = spec("deepseek-ai--DeepSeek-V3")
    assert m.is_mla
    assert m.kv_bytes_per_token(2) == 61 * (512 + 64) * 2
    assert m.kv_bytes_per_token(1, tp=8) == 61 * (512 + 64)
    assert m.tp_divides_heads(8)  # no KV heads to divide for MLA


def test_smollm2_counts_tied_embeddings_once():
    m = ModelSpec.from_hf_config(SMOLLM2, "smollm2")
    assert m.num_params == pytest.approx(134.5e6, rel=1e-3)
    assert m.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2
    assert [tp for tp in (1, 2, 4, 8) if m.tp_divides_heads(tp)] == [1]


def test_every_shared_config_parses():
    for p in sorted(MODELS.glob("*_config.json")):
        m = load_model_spec(p)
        assert m.num_params > m.num_layers * m.hidden_size
        assert m.kv_bytes_per_token(2) > 0


def test_missing_field_error_names_it():
    c = cfg("meta-llama--Meta-Llama-3.1-8B")
    del c["num_hidden_layers"], c["vocab_size"]
    with pytest.raises(ModelConfigError, match="num_hidden_layers, vocab_size"):
        ModelSpec.from_hf_config(c, "broken")


def test_missing_mla_field_error_names_it():
    c = cfg("deepseek-ai--DeepSeek-V3")
    del c["qk_rope_head_dim"]
    with pytest.raises(ModelConfigError, match="qk_rope_head_dim"):
        ModelSpec.from_hf_config(c, "ds")


def test_unknown_architecture_field_is_named():
    c = dict(SMOLLM2, attn_layer_period=8, mamba_d_state=16)
    with pytest.raises(ModelConfigError) as e:
        ModelSpec.from_hf_config(c, "jamba-like")
    assert "mamba_d_state" in str(e.value) and "attn_layer_period" in str(e.value)


def test_bad_value_is_named():
    with pytest.raises(ModelConfigError, match="hidden_size"):
        ModelSpec.from_hf_config(dict(SMOLLM2, hidden_size=0), "zero")
    with pytest.raises(ModelConfigError, match="num_key_value_heads"):
        ModelSpec.from_hf_config(dict(SMOLLM2, num_key_value_heads=4), "kv")


def test_load_model_spec_reads_a_folder(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    m = load_model_spec(tmp_path)
    assert m.name == tmp_path.name and m.num_layers == 30
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model_spec(tmp_path / "absent")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_model_spec(tmp_path / "bad.json")


def test_windowed_attention_layers_are_counted():
    """gpt-oss alternates 128-token sliding-window and full layers; Llama 4 attends within 8192-token chunks
    on its RoPE layers and globally on every 4th (NoPE) layer."""
    oss = load_model_spec(MODELS / "openai--gpt-oss-120b_config.json")
    assert (oss.sliding_window_tokens, oss.num_sliding_layers, oss.num_layers) == (128, 18, 36)
    scout = load_model_spec(MODELS / "meta-llama--Llama-4-Scout-17B-16E-Instruct_config.json")
    assert (scout.sliding_window_tokens, scout.num_sliding_layers, scout.num_layers) == (8192, 36, 48)
    explicit = ModelSpec.from_hf_config(
        {"model_type": "llama4_text", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "intermediate_size_mlp": 128, "vocab_size": 100,
         "num_local_experts": 4, "num_experts_per_tok": 1, "attention_chunk_size": 16,
         "no_rope_layers": [1, 0, 1, 0]}, "tiny-llama4")
    assert explicit.num_sliding_layers == 2
    dense = load_model_spec(MODELS / "meta-llama--Meta-Llama-3.1-8B_config.json")
    assert dense.sliding_window_tokens == 0 and dense.num_sliding_layers == 0
