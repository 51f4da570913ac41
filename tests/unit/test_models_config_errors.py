"""config.json fields of the wrong type or shape give a ModelConfigError naming the field (never a raw
TypeError, never a silently different model); unreadable files name the file; Llama 4's weightless qk norm
adds no parameters.

Invariants:
* boolean fields accept only JSON true/false (null/absent = the default);
* mlp_only_layers is a list of integers; layer_types a list of known layer-type strings, one per layer;
* quantization_config.quant_method null means "no quantization" ("");
* any other exception while parsing a malformed config surfaces as ModelConfigError naming the model, with
  the original exception as ``__cause__``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import runtime.models.spec as spec_module
from runtime.cli import app
from runtime.modelfiles.load import load_model_spec
from runtime.models.spec import KNOWN_LAYER_TYPES, ModelConfigError, ModelSpec
from runtime.modelfiles.catalog import CATALOG_DIR

MODELS = CATALOG_DIR


def cfg(stem: str) -> dict:
    return json.loads((MODELS / f"{stem}_config.json").read_text())


LLAMA8 = "meta-llama--Meta-Llama-3.1-8B"
QWEN3_MOE = "Qwen--Qwen3-30B-A3B"
GPT_OSS = "openai--gpt-oss-20b"
SCOUT = "meta-llama--Llama-4-Scout-17B-16E-Instruct"
LLAMA8_PARAMS = 8_030_261_248  # untied: embedding + LM head, 128256 x 4096 each


# ---------------------------------------------------------------- boolean fields
@pytest.mark.parametrize("field", ["tie_word_embeddings", "attention_bias", "use_qk_norm"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, [], {}])
def test_non_boolean_flag_is_named(field, value):
    c = dict(cfg(LLAMA8), **{field: value})
    with pytest.raises(ModelConfigError, match=rf"^x: field {field} must be a JSON boolean"):
        ModelSpec.from_hf_config(c, "x")


def test_string_false_does_not_tie_embeddings():
    # the old reader took bool("false") == True and dropped the 525,336,576-parameter LM head
    with pytest.raises(ModelConfigError, match="tie_word_embeddings"):
        ModelSpec.from_hf_config(dict(cfg(LLAMA8), tie_word_embeddings="false"), "x")


@pytest.mark.parametrize("value, tied", [(None, False), (False, False), (True, True)])
def test_boolean_or_null_tie_word_embeddings_is_accepted(value, tied):
    s = ModelSpec.from_hf_config(dict(cfg(LLAMA8), tie_word_embeddings=value), "x")
    assert s.tie_word_embeddings is tied
    assert s.num_params == LLAMA8_PARAMS - (128256 * 4096 if tied else 0)


# ---------------------------------------------------------------- list fields
@pytest.mark.parametrize("value", [3, "3", {"0": 1}, [0, "1"], [True], [1.5]])
def test_mlp_only_layers_must_be_a_list_of_integers(value):
    with pytest.raises(ModelConfigError, match=r"field mlp_only_layers must be a list of integers"):
        ModelSpec.from_hf_config(dict(cfg(QWEN3_MOE), mlp_only_layers=value), "x")


def test_mlp_only_layers_list_makes_those_layers_dense():
    base = ModelSpec.from_hf_config(cfg(QWEN3_MOE), "x")
    two_dense = ModelSpec.from_hf_config(dict(cfg(QWEN3_MOE), mlp_only_layers=[0, 47]), "x")
    assert two_dense.num_moe_layers == base.num_moe_layers - 2 == 46


@pytest.mark.parametrize("value", [5, "sliding_attention", {"0": "full_attention"}, [1, 2]])
def test_layer_types_must_be_a_list_of_strings(value):
    c = dict(cfg(LLAMA8), sliding_window=128, layer_types=value)
    with pytest.raises(ModelConfigError, match=r"field layer_types must be a list of strings"):
        ModelSpec.from_hf_config(c, "x")


def test_unknown_layer_type_is_named_with_the_known_ones():
    c = cfg(GPT_OSS)
    c["layer_types"] = ["linear_attention"] + c["layer_types"][1:]
    with pytest.raises(ModelConfigError) as e:
        ModelSpec.from_hf_config(c, "x")
    msg = str(e.value)
    assert "linear_attention" in msg
    assert all(t in msg for t in KNOWN_LAYER_TYPES)


def test_layer_types_needs_one_entry_per_layer():
    c = cfg(GPT_OSS)  # 24 layers
    c["layer_types"] = c["layer_types"][:-1]
    with pytest.raises(ModelConfigError, match=r"layer_types has 23 entries but num_hidden_layers=24"):
        ModelSpec.from_hf_config(c, "x")


def test_chunked_attention_outside_llama4_is_refused():
    c = cfg(GPT_OSS)
    c["layer_types"] = ["chunked_attention"] * c["num_hidden_layers"]
    with pytest.raises(ModelConfigError, match="chunked_attention .*Llama 4"):
        ModelSpec.from_hf_config(c, "x")


def test_valid_layer_types_still_count_sliding_layers():
    s = ModelSpec.from_hf_config(cfg(GPT_OSS), "x")
    assert s.num_sliding_layers == 12 and s.sliding_window_tokens == 128


def test_no_rope_layers_must_be_a_list_of_integers():
    c = cfg(SCOUT)
    c["text_config"]["no_rope_layers"] = 4
    with pytest.raises(ModelConfigError, match="field no_rope_layers must be a list of integers"):
        ModelSpec.from_hf_config(c, "scout")


# ---------------------------------------------------------------- quantization_config
@pytest.mark.parametrize("quant", [{"quant_method": None}, {}, None])
def test_null_or_absent_quant_method_is_no_quantization(quant):
    assert ModelSpec.from_hf_config(dict(cfg(LLAMA8), quantization_config=quant), "x").quant_method == ""


def test_quant_method_is_read():
    c = dict(cfg(LLAMA8), quantization_config={"quant_method": "fp8"})
    assert ModelSpec.from_hf_config(c, "x").quant_method == "fp8"


@pytest.mark.parametrize("quant, field", [({"quant_method": 8}, "quantization_config.quant_method"),
                                          ("fp8", "quantization_config")])
def test_wrong_typed_quantization_config_is_named(quant, field):
    with pytest.raises(ModelConfigError, match=rf"field {field} must be"):
        ModelSpec.from_hf_config(dict(cfg(LLAMA8), quantization_config=quant), "x")


# ---------------------------------------------------------------- backstop
def test_any_other_parse_failure_is_a_model_config_error_with_the_cause(monkeypatch):
    boom = TypeError("'int' object is not iterable")

    def broken(*args, **kwargs):
        raise boom

    monkeypatch.setattr(spec_module, "_pos_int", broken)
    with pytest.raises(ModelConfigError, match=r"^my/model: malformed config.json .*TypeError") as e:
        ModelSpec.from_hf_config(cfg(LLAMA8), "my/model")
    assert e.value.__cause__ is boom


def test_model_config_errors_pass_through_the_backstop_unchanged():
    with pytest.raises(ModelConfigError) as e:
        ModelSpec.from_hf_config(dict(cfg(LLAMA8), hidden_size=0), "x")
    assert "malformed" not in str(e.value) and "hidden_size" in str(e.value)


# ---------------------------------------------------------------- file adapter
def test_non_utf8_config_names_the_file(tmp_path: Path):
    p = tmp_path / "config.json"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ModelConfigError, match="not UTF-8") as e:
        load_model_spec(p)
    assert str(p) in str(e.value)
    assert isinstance(e.value.__cause__, UnicodeDecodeError)


def test_unreadable_config_names_the_file(tmp_path: Path, monkeypatch):
    p = tmp_path / "config.json"
    p.write_text("{}")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ModelConfigError, match="cannot read") as e:
        load_model_spec(p)
    assert str(p) in str(e.value) and "Permission denied" in str(e.value)


def test_utf8_bom_config_is_read(tmp_path: Path):
    p = tmp_path / "config.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps(cfg(LLAMA8)).encode())
    assert load_model_spec(p).num_params == LLAMA8_PARAMS


def test_cli_tune_on_wrong_typed_field_exits_2_without_traceback(tmp_path: Path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(cfg(QWEN3_MOE), mlp_only_layers=3)))
    res = CliRunner().invoke(app, ["tune", str(p), "--state-dir", str(tmp_path / "state")],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 2  # a bad value (tests/unit/test_cli_exit_codes.py)
    assert "mlp_only_layers" in res.output and str(p) in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


# ---------------------------------------------------------------- Llama 4 qk norm
def test_llama4_qk_norm_is_weightless():
    # transformers Llama4TextL2Norm has no weight: use_qk_norm must not add 2 * head_dim per layer
    with_norm = cfg(SCOUT)
    assert with_norm["text_config"]["use_qk_norm"] is True
    without = cfg(SCOUT)
    without["text_config"]["use_qk_norm"] = False
    assert ModelSpec.from_hf_config(with_norm, "s").num_params == ModelSpec.from_hf_config(without, "s").num_params


def test_qwen3_qk_norm_weights_are_counted():
    s = ModelSpec.from_hf_config(cfg("Qwen--Qwen3-8B"), "q")
    assert s.qk_norm
    # q_norm + k_norm: one head_dim RMSNorm weight each per layer (transformers Qwen3Attention)
    assert s.num_params - ModelSpec(**{**s.__dict__, "qk_norm": False, "_counts": {}}).num_params \
        == 2 * s.head_dim * s.num_layers


@pytest.mark.parametrize("stem", [QWEN3_MOE, "deepseek-ai--DeepSeek-V3"])
def test_moe_without_expert_width_is_refused_not_sized_as_the_dense_ffn(stem):
    c = cfg(stem)
    del c["moe_intermediate_size"]
    with pytest.raises(ModelConfigError, match=r"needs moe_intermediate_size.*intermediate_size="):
        ModelSpec.from_hf_config(c, "m")


def test_mixtral_experts_keep_the_dense_width():
    c = cfg("mistralai--Mixtral-8x7B-v0.1")
    assert "moe_intermediate_size" not in c
    assert ModelSpec.from_hf_config(c, "m").moe_intermediate_size == c["intermediate_size"] == 14336
