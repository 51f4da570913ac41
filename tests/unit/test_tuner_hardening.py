"""Specification of the tuner's edge cases found by adversarial testing: invalid config
values are errors naming the field, unknown architectures are refused, KV heads are replicated as
vLLM does, MLA winners with prefill TP > decode TP are deployable, non-finite or tiny loads, the spec
carries a max model length and the precision the tuner sized for, $/Mtok is the price of the
replicas written, and the CLI never moves the champion for a failed command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec, ModelRef, PoolSpec, SloSpec, WorkloadSpec
from runtime.deploy.workers import precision_args
from runtime.modelfiles.load import load_model_spec
from runtime.models.spec import ModelConfigError, ModelSpec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.perf.gpus import get_gpu
from runtime.perf.instances import usd_per_gpu_hour
from runtime.tuner.search import ModelDoesNotFitError, tune

MODELS = CATALOG_DIR
L8_PATH = MODELS / "meta-llama--Meta-Llama-3.1-8B_config.json"
L8_CFG = json.loads(L8_PATH.read_text())
runner = CliRunner()


@pytest.mark.parametrize(("field", "value", "says"), [
    ("intermediate_size", -14336, "intermediate_size=-14336 (must be >= 1)"),
    ("intermediate_size", "big", "intermediate_size='big' (must be a whole number)"),
    ("num_key_value_heads", 0, "num_key_value_heads=0 (must be >= 1)"),
    ("head_dim", -128, "head_dim=-128 (must be >= 1)"),
    ("hidden_size", 4096.7, "hidden_size=4096.7 (must be a whole number)"),
    ("hidden_size", True, "hidden_size=True (must be a whole number)"),
    ("sliding_window", -128, "sliding_window=-128 (must be >= 0)"),
    # a layer count the parser would walk for minutes (1e308 layers: forever) is refused at once
    ("num_hidden_layers", 1e308, "num_hidden_layers=1e+308 (must be <= 10000)"),
    ("vocab_size", 2**40, f"vocab_size={2**40} (must be <= {2**31 - 1})"),
])
def test_invalid_numbers_are_named(field: str, value: object, says: str) -> None:
    with pytest.raises(ModelConfigError, match=None) as e:
        ModelSpec.from_hf_config({**L8_CFG, field: value}, "m")
    assert says in str(e.value)


def test_moe_and_mla_numbers_are_checked_too() -> None:
    q3 = json.loads((MODELS / "Qwen--Qwen3-30B-A3B_config.json").read_text())
    with pytest.raises(ModelConfigError, match=r"moe_intermediate_size=-768"):
        ModelSpec.from_hf_config({**q3, "moe_intermediate_size": -768}, "q")
    with pytest.raises(ModelConfigError, match=r"num_experts_per_tok=2.7"):
        ModelSpec.from_hf_config({**q3, "num_experts_per_tok": 2.7}, "q")
    ds = json.loads((MODELS / "deepseek-ai--DeepSeek-V3_config.json").read_text())
    with pytest.raises(ModelConfigError, match=r"kv_lora_rank=-512"):
        ModelSpec.from_hf_config({**ds, "kv_lora_rank": -512}, "d")


def test_unknown_architectures_are_refused_by_name() -> None:
    with pytest.raises(ModelConfigError, match=r"model_type 'gemma3'.*supported: .*llama"):
        ModelSpec.from_hf_config({**L8_CFG, "model_type": "gemma3"}, "g")
    with pytest.raises(ModelConfigError, match="attn_type_list"):
        ModelSpec.from_hf_config({**L8_CFG, "attn_type_list": [0, 1]}, "minimax")
    with pytest.raises(ModelConfigError, match="head width would be 0"):
        ModelSpec.from_hf_config({**L8_CFG, "hidden_size": 16, "num_attention_heads": 32,
                                  "num_key_value_heads": 8}, "tiny")


def test_kv_heads_are_replicated_when_tp_is_a_multiple_of_them() -> None:
    q235 = load_model_spec(MODELS / "Qwen--Qwen3-235B-A22B_config.json")
    assert q235.num_kv_heads == 4
    assert q235.tp_divides_heads(8) and q235.kv_heads_per_rank(8) == 1
    odd = ModelSpec.from_hf_config({**L8_CFG, "num_attention_heads": 24, "num_key_value_heads": 6,
                                    "head_dim": 128}, "odd")
    assert not odd.tp_divides_heads(4)  # 4 neither divides nor is a multiple of 6 KV heads


def test_mla_winner_with_prefill_tp_above_decode_tp_is_deployable() -> None:
    ds = load_model_spec(MODELS / "deepseek-ai--DeepSeek-V3_config.json")
    res = tune(ds, "GB200", SloSpec(ttft_p90_ms=2000, itl_p90_ms=10), WorkloadSpec(isl_tokens=30000, osl_tokens=150),
               precision="fp8")
    spec = res.to_deployment_spec(ModelRef(name="ds"))
    assert spec.model.mla and spec.model.quantization == "fp8"
    assert res.best.prefill_tp > res.best.decode_tp  # the case that used to crash
    with pytest.raises(ValidationError, match="unless the model uses MLA"):
        DeploymentSpec(model=ModelRef(name="dense"), prefill=PoolSpec(tp=4), decode=PoolSpec(tp=2))


def test_non_finite_loads_are_rejected_and_tiny_ones_still_get_a_worker_per_pool() -> None:
    with pytest.raises(ValidationError, match="finite"):
        WorkloadSpec(request_rate_per_s=math.inf)
    with pytest.raises(ValidationError, match="finite"):
        SloSpec(ttft_p90_ms=math.inf)
    l8 = load_model_spec(L8_PATH)
    res = tune(l8, "H100-SXM", SloSpec(), WorkloadSpec(isl_tokens=1, osl_tokens=1, request_rate_per_s=1e-6))
    assert res.best.prefill_replicas == 1 and res.best.decode_replicas == 1


def test_spec_max_model_len_covers_the_workload_within_the_model_and_kv() -> None:
    l8 = load_model_spec(L8_PATH)
    res = tune(l8, "H100-SXM", SloSpec(), WorkloadSpec(isl_tokens=8000, osl_tokens=150))
    n = res.to_deployment_spec(ModelRef(name="l8")).engine.max_model_len_tokens
    assert 8150 <= n <= l8.max_position_embeddings and n <= res.best.kv_capacity_tokens
    assert n == l8.max_context_tokens == 131072  # the model's context: an H100 holds one such sequence
    short = tune(l8, "H100-SXM", SloSpec(), WorkloadSpec(isl_tokens=100, osl_tokens=50))
    assert short.to_deployment_spec(ModelRef(name="l8")).engine.max_model_len_tokens == n  # not the mean's 2x
    l70 = load_model_spec(L8_PATH.with_name("meta-llama--Meta-Llama-3.1-70B_config.json"))
    small = tune(l70, "L40S", SloSpec(), WorkloadSpec(isl_tokens=1000, osl_tokens=100, request_rate_per_s=1))
    m = small.max_model_len_tokens()  # 48 GB GPUs: the KV memory, not the 131k context, bounds it
    assert 1100 <= m < 131072 and m <= small.best.kv_capacity_tokens


def test_usd_per_mtok_is_the_price_of_the_replicas_written() -> None:
    l8 = load_model_spec(L8_PATH)
    w = WorkloadSpec(isl_tokens=3000, osl_tokens=150, request_rate_per_s=0.5)
    b = tune(l8, "H100-SXM", SloSpec(), w).best
    per_hour = (b.prefill_replicas * b.prefill_tp * usd_per_gpu_hour("H100-SXM", b.prefill_tp)
                + b.decode_replicas * b.decode_tp * usd_per_gpu_hour("H100-SXM", b.decode_tp))
    assert b.usd_per_mtok == pytest.approx(per_hour / (0.5 * 150 * 3600) * 1e6)


def test_no_fit_arithmetic_is_shown_at_a_tp_the_node_has() -> None:
    ds = load_model_spec(MODELS / "deepseek-ai--DeepSeek-V3_config.json")
    gpu = get_gpu("GH200")
    with pytest.raises(ModelDoesNotFitError) as e:
        tune(ds, gpu, SloSpec(), WorkloadSpec(), precision="fp8")
    assert f"at TP {gpu.num_gpus_per_node} per GPU" in str(e.value)


def test_fp8_reaches_gpu_workers_and_a_quantized_checkpoint_is_loaded_as_it_is() -> None:
    fp8 = DeploymentSpec(model=ModelRef(name="m"), precision="fp8")
    assert precision_args(fp8, gpu=True) == ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    assert precision_args(fp8, gpu=False) == []
    assert precision_args(DeploymentSpec(model=ModelRef(name="m")), gpu=True) == []
    quantized = DeploymentSpec(model=ModelRef(name="m", quantization="modelopt"), precision="fp8")
    assert precision_args(quantized, gpu=True) == ["--kv-cache-dtype", "fp8"]
    own = DeploymentSpec(model=ModelRef(name="m"), precision="fp8")
    own.engine.extra_args = ["--kv-cache-dtype=fp8_e5m2"]
    assert precision_args(own, gpu=True) == ["--quantization", "fp8"]


def test_cli_precision_defaults_to_the_checkpoints_and_bad_ones_fail_first(tmp_path: Path) -> None:
    res = runner.invoke(app, ["tune", str(L8_PATH), "--precision", "fp4", "--out", str(tmp_path / "s.json")],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "--precision: must be bf16, fp8" in res.output
    assert "prefill TP" not in res.output and not (tmp_path / "s.json").exists()  # failed before tuning
    fp8 = MODELS / "deepseek-ai--DeepSeek-V3_config.json"  # quantization_config.quant_method: fp8
    res = runner.invoke(app, ["tune", str(fp8), "--gpu", "p5en.48xlarge", "--out", str(tmp_path / "q.json")],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "quantized as 'fp8'" in res.output
    auto = runner.invoke(app, ["tune", str(fp8), "--gpu", "p5en.48xlarge", "--precision", "AUTO", "--out",
                               str(tmp_path / "a.json")], env={"COLUMNS": "300"})  # the pipeline's spelling
    assert auto.exit_code == 0, auto.output
    assert DeploymentSpec.model_validate_json((tmp_path / "a.json").read_text()).precision == "fp8"
    spec = DeploymentSpec.model_validate_json((tmp_path / "q.json").read_text())
    assert spec.precision == "fp8" and spec.gpu == "H200-SXM" and spec.model.quantization == "fp8"


def test_cli_register_needs_mlflow_and_a_failed_out_moves_no_champion(tmp_path: Path) -> None:
    res = runner.invoke(app, ["tune", str(L8_PATH), "--register", "x"], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "--register needs --mlflow-uri" in res.output
    db = tmp_path / "mlflow.db"
    unwritable = Path("/proc/pdserve-test-spec.json")  # the folder exists, creating a file there fails (even as root)
    res = runner.invoke(app, ["tune", str(L8_PATH), "--mlflow-uri", f"sqlite:///{db}", "--register", "x",
                              "--out", str(unwritable)], env={"COLUMNS": "300"})
    assert res.exit_code == 1 and "--out /proc/pdserve-test-spec.json" in res.output
    assert not db.exists()  # MLflow untouched: no runs, no champion for a command that failed


def test_cli_says_an_mxfp4_checkpoint_is_costed_in_its_own_format(tmp_path: Path) -> None:
    """gpt-oss ships MXFP4 experts; a DeploymentSpec deploys bf16/fp8 only, so the note must not suggest
    --precision can pick the checkpoint's own format, and must say what the search does: the weights costed
    as stored (fp4), the precision setting the KV cache."""
    res = runner.invoke(app, ["tune", str(MODELS / "openai--gpt-oss-20b_config.json"), "--gpu", "H100-SXM",
                              "--out", str(tmp_path / "g.json")], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "quantized as 'mxfp4'" in out and "sets the KV cache (bf16)" in out
    assert "the search costs them in their format (fp4)" in out
    assert "wider than they are" not in out and "does not tune for" not in out
    spec = DeploymentSpec.model_validate_json((tmp_path / "g.json").read_text())
    assert spec.precision == "bf16" and spec.model.quantization == "mxfp4"  # vLLM loads the checkpoint as is


def test_an_instance_type_bounds_tp_by_its_gpu_count(tmp_path: Path) -> None:
    from runtime.tuner.search import TP_CHOICES, tp_choices

    assert tp_choices("L40S") == TP_CHOICES and tp_choices("p5.48xlarge") == TP_CHOICES
    assert tp_choices("g6e.xlarge") == (1,) and tp_choices("g6e.12xlarge") == (1, 2, 4)
    with pytest.raises(KeyError):
        tp_choices("p9.nonexistent")
    res = runner.invoke(app, ["tune", str(L8_PATH), "--gpu", "g6e.xlarge", "--out", str(tmp_path / "s.json")],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    spec = DeploymentSpec.model_validate_json((tmp_path / "s.json").read_text())
    assert spec.prefill.tp == 1 and spec.decode.tp == 1
    import re

    rows = [line for line in res.output.splitlines() if re.match(r"│ [★ ] │\s+\d+ / \d+ │", line)]
    assert len(rows) == 1  # the only candidate one g6e.xlarge (one L40S) holds: TP 1 / TP 1
