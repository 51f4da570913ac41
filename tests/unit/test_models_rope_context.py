"""The context vLLM serves from a config: max_position_embeddings with RoPE scaling (vLLM 0.28
vllm/config/model.py _get_and_verify_max_len), and the tuner's context-length check on it."""

import json
from pathlib import Path

import pytest

from runtime.config import SloSpec, WorkloadSpec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.models.spec import ModelConfigError, ModelSpec
from runtime.perf.gpus import get_gpu
from runtime.tuner.search import ContextTooLongError, tune

MODELS = CATALOG_DIR


def _qwen3_8b(**extra) -> dict:
    return json.loads((MODELS / "Qwen--Qwen3-8B_config.json").read_text()) | extra


def test_yarn_multiplies_the_original_length_by_its_factor():
    # Qwen's documented YaRN setting for Qwen3: 32768 x 4 = 131072 tokens (max_position_embeddings 40960)
    cfg = _qwen3_8b(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    m = ModelSpec.from_hf_config(cfg, "q")
    assert (m.max_position_embeddings, m.max_context_tokens) == (40960, 131072)


def test_linear_and_dynamic_scaling_multiply_max_position_embeddings():
    for kind in ("linear", "dynamic"):
        m = ModelSpec.from_hf_config(_qwen3_8b(rope_scaling={"type": kind, "factor": 2.0}), "q")
        assert m.max_context_tokens == 81920


def test_llama3_scaling_and_no_scaling_keep_max_position_embeddings():
    llama = json.loads((MODELS / "meta-llama--Meta-Llama-3.1-8B_config.json").read_text())
    assert llama["rope_scaling"]["rope_type"] == "llama3"
    assert ModelSpec.from_hf_config(llama, "l").max_context_tokens == 131072
    assert ModelSpec.from_hf_config(_qwen3_8b(), "q").max_context_tokens == 40960
    ds = json.loads((MODELS / "deepseek-ai--DeepSeek-V3_config.json").read_text())  # yarn 4096 x 40
    assert ModelSpec.from_hf_config(ds, "d").max_context_tokens == 163840


@pytest.mark.parametrize("rope", ["yarn", {"type": "linear", "factor": "2"}, {"type": "linear", "factor": -1}])
def test_malformed_rope_scaling_is_named(rope):
    with pytest.raises(ModelConfigError, match="rope_scaling"):
        ModelSpec.from_hf_config(_qwen3_8b(rope_scaling=rope), "q")


def test_the_tuner_accepts_a_workload_that_only_the_scaled_context_holds():
    cfg = _qwen3_8b(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    m = ModelSpec.from_hf_config(cfg, "q")
    slo, wl = SloSpec(ttft_p90_ms=60000, itl_p90_ms=200), WorkloadSpec(isl_tokens=60000, osl_tokens=2000,
                                                                        request_rate_per_s=0.2)
    res = tune(m, get_gpu("H100-SXM"), slo, wl)
    assert 62000 <= res.max_model_len_tokens() <= 131072
    plain = ModelSpec.from_hf_config(_qwen3_8b(), "q")
    with pytest.raises(ContextTooLongError, match="max_position_embeddings 40960"):
        tune(plain, get_gpu("H100-SXM"), slo, wl)
    with pytest.raises(ContextTooLongError, match=r"context 131072 \(max_position_embeddings 40960 with RoPE"):
        tune(m, get_gpu("H100-SXM"), slo, WorkloadSpec(isl_tokens=130000, osl_tokens=2000, request_rate_per_s=0.2))


def test_a_default_rope_with_a_factor_scales_the_context_as_vllm_does():
    # vLLM 0.28 applies `factor` of every type but su/longrope/llama3, "default" included (and Qwen2-VL's
    # legacy "mrope", which it renames to default)
    for rope in ({"rope_type": "default", "factor": 2.0}, {"type": "mrope", "mrope_section": [16, 24, 24],
                                                           "factor": 2.0}):
        assert ModelSpec.from_hf_config(_qwen3_8b(rope_scaling=rope), "q").max_context_tokens == 81920, rope


LONGROPE = {"type": "su", "rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64}


def test_longrope_keeps_its_short_factors_when_the_workload_fits_the_original_context():
    """vLLM applies LongRoPE's long factors to every sequence once --max-model-len exceeds the original context
    (Phi3LongRoPEScaledRotaryEmbedding), and serves that context by default: the tuner asks for it when the
    workload fits, and for the whole context when it does not."""
    cfg = _qwen3_8b(rope_scaling=LONGROPE, original_max_position_embeddings=4096)
    m = ModelSpec.from_hf_config(cfg, "phi-like")
    assert (m.max_context_tokens, m.longrope_original_tokens) == (40960, 4096)
    inner = _qwen3_8b(rope_scaling=LONGROPE | {"original_max_position_embeddings": 8192})
    assert ModelSpec.from_hf_config(inner, "p").longrope_original_tokens == 8192  # the RoPE object's own
    assert ModelSpec.from_hf_config(_qwen3_8b(), "q").longrope_original_tokens == 0
    slo = SloSpec(ttft_p90_ms=2000, itl_p90_ms=100)
    short = tune(m, get_gpu("H100-SXM"), slo, WorkloadSpec(isl_tokens=3000, osl_tokens=500, request_rate_per_s=1))
    assert short.max_model_len_tokens() == 4096
    assert short.max_model_len_tokens(override=20000) == 20000  # the operator may still ask for more
    long = tune(m, get_gpu("H100-SXM"), slo, WorkloadSpec(isl_tokens=6000, osl_tokens=500, request_rate_per_s=1))
    assert long.max_model_len_tokens() > 4096
    with pytest.raises(ModelConfigError, match="original_max_position_embeddings"):
        ModelSpec.from_hf_config(_qwen3_8b(rope_scaling=LONGROPE, original_max_position_embeddings="4k"), "p")
