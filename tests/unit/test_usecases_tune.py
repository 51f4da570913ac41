"""The tune use case (the pipeline's tune step) takes its parameters as `pdserve tune` does (MLflow replaced by a recorder of the spec; every
step before logging is the real code):

* `gpu` accepts an AWS instance type (`resolve_gpu`), not only a catalog name;
* `gpu_budget` becomes the spec's planner.gpu_budget before the budget check;
* precision `auto` tunes at the checkpoint's own precision with the CLI's rule (fp8 for an FP8 checkpoint);
* cheap parameters fail first, all named at once, before the model is read (`check_tune_settings`), and
  `validate` (the pipeline's first step) applies the same checks plus the model name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.deploy.budget import GpuBudgetError
from runtime.modelfiles.load import checkpoint_precision
from runtime.usecases.tune import TuneRequest, TuneSettings, check_tune_settings, tune
from runtime.usecases.validate import ValidateRequest, validate

MODELS = CATALOG_DIR
FP8_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",  # Qwen/Qwen3-8B-FP8's
             "weight_block_size": [128, 128]}


@pytest.fixture
def staged(tmp_path):
    """A staged copy (marker + manifest) of a shared config.json, with `extra` merged into it."""
    from tests.usecase_requests import stage_config

    def make(cfg_name: str, extra: dict | None = None) -> Path:
        cfg = json.loads((MODELS / cfg_name).read_text()) | (extra or {})
        return stage_config(cfg, tmp_path / "fsx" / "models" / "m", tmp_path)
    return make


@pytest.fixture
def recorded(monkeypatch):
    """MLflow replaced by a recorder: {"spec": the DeploymentSpec tune would register}; no champion yet."""
    import runtime.tracking.mlflow_runs as mr

    seen: dict = {}

    def fake_log_tuning(result, *, tracking_uri, experiment, registered_model, spec=None, **kw):
        seen["spec"] = spec
        return "1"
    monkeypatch.setattr(mr, "log_tuning", fake_log_tuning)
    monkeypatch.setattr(mr, "find_champion", lambda uri, name: None)  # no registry: a first version
    monkeypatch.setattr(mr, "champion_version", lambda uri, name: "1")
    return seen


def _tune(path, gpu="H100-SXM", precision="bf16", rate=10.0, **kw):
    return tune(TuneRequest(model_path=str(path), model_name="m", gpu=gpu, precision=precision, ttft_p90_ms=2000.0,
                            itl_p90_ms=50.0, isl_tokens=3000, osl_tokens=150, request_rate_per_s=rate,
                            mlflow_tracking_uri="sqlite:///unused.db", registered_model="m-pd", **kw))


def _settings(gpu, precision="auto"):
    return TuneSettings(gpu=gpu, precision=precision, ttft_p90_ms=2000.0, itl_p90_ms=50.0, isl_tokens=3000,
                        osl_tokens=150, request_rate_per_s=10.0, registered_model="m-pd")


def test_gpu_may_be_an_aws_instance_type_like_in_the_cli(staged, recorded):
    _tune(staged("meta-llama--Meta-Llama-3.1-8B_config.json"), gpu="p5.48xlarge")
    assert recorded["spec"].gpu == "H100-SXM"


def test_gpu_budget_is_recorded_and_checked(staged, recorded):
    path = staged("meta-llama--Meta-Llama-3.1-70B_config.json")
    with pytest.raises(GpuBudgetError, match=r"needs 126 GPUs.*gpu_budget is 64 GPUs.*raise the budget \(gpu_budget\)"):
        _tune(path, rate=100.0)  # the default budget (PlannerSpec's, as `pdserve tune`)
    assert "spec" not in recorded  # nothing registered
    _tune(path, rate=100.0, gpu_budget=200)
    assert recorded["spec"].planner.gpu_budget == 200
    with pytest.raises(GpuBudgetError, match="gpu_budget is 4 GPUs"):
        _tune(path, rate=10.0, gpu_budget=4)


def test_precision_auto_follows_the_cli_for_an_fp8_checkpoint(tmp_path, staged, recorded):
    from runtime.cli import app

    path = staged("Qwen--Qwen3-8B_config.json", {"quantization_config": FP8_QUANT})
    out = tmp_path / "spec.json"
    res = CliRunner().invoke(app, ["tune", str(path), "--out", str(out), "--rate", "1"])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["precision"] == "fp8"
    _tune(path, precision="auto", rate=1.0)
    assert recorded["spec"].precision == "fp8"
    _tune(path, precision="BF16", rate=1.0)  # an explicit choice wins, case-insensitively like the CLI
    assert recorded["spec"].precision == "bf16"


def test_precision_auto_is_bf16_for_an_unquantized_checkpoint(staged, recorded):
    _tune(staged("meta-llama--Meta-Llama-3.1-8B_config.json"), precision="auto")
    assert recorded["spec"].precision == "bf16"


def test_checkpoint_precision_rule():
    from runtime.models.spec import ModelSpec

    cfg = json.loads((MODELS / "Qwen--Qwen3-8B_config.json").read_text())
    assert checkpoint_precision(ModelSpec.from_hf_config(cfg, "q")) == "bf16"
    assert checkpoint_precision(ModelSpec.from_hf_config(cfg | {"quantization_config": FP8_QUANT}, "q")) == "fp8"
    mxfp4 = cfg | {"quantization_config": {"quant_method": "mxfp4"}}
    assert checkpoint_precision(ModelSpec.from_hf_config(mxfp4, "q")) == "bf16"


def test_bad_parameters_are_all_named_before_the_model_is_read(tmp_path, recorded):
    with pytest.raises(ValueError) as e:  # tmp_path is no staged folder: the parameters fail first
        tune(TuneRequest(model_path=str(tmp_path), model_name="m", gpu="H100-SMX", precision="fp16",
                         ttft_p90_ms=-1.0, itl_p90_ms=50.0, isl_tokens=0, osl_tokens=150, request_rate_per_s=10.0,
                         mlflow_tracking_uri="sqlite:///unused.db", registered_model="bad/name", gpu_budget=0))
    msg = str(e.value)
    for needle in ("gpu: ", "H100-SMX", "precision 'fp16'", "ttft_p90_ms", "isl_tokens", "gpu_budget",
                   "registered model name 'bad/name'"):
        assert needle in msg, (needle, msg)
    assert "spec" not in recorded


def test_check_tune_settings_returns_them_parsed():
    p = check_tune_settings(_settings("p5.48xlarge", "Auto"))
    assert p.gpu.name == "H100-SXM" and p.precision == "auto"
    assert p.slo.ttft_p90_ms == 2000.0 and p.workload.request_rate_per_s == 10.0
    assert p.gpu_budget == 64  # PlannerSpec's default, the same as `pdserve tune --gpu-budget`


@pytest.mark.parametrize(("override", "needle"), [
    ({"model_name": "../escape"}, "model_name"),
    ({"gpu": "H100-SMX"}, "gpu: "),
    ({"precision": "int4"}, "precision"),
    ({"itl_p90_ms": 0.0}, "itl_p90_ms"),
    ({"request_rate_per_s": -1.0}, "request_rate_per_s"),
    ({"gpu_budget": 0}, "gpu_budget"),
    ({"registered_model": "bad/name?"}, "registered model name"),
])
def test_validate_refuses_each_cheap_parameter(override, needle):
    args = dict(model_name="org/m", gpu="p5.48xlarge", precision="auto", ttft_p90_ms=2000.0, itl_p90_ms=50.0,
                isl_tokens=3000, osl_tokens=150, request_rate_per_s=10.0, gpu_budget=64, registered_model="m-pd")
    validate(ValidateRequest(**args))  # the defaults pass
    with pytest.raises(ValueError, match=needle):
        validate(ValidateRequest(**(args | override)))


@pytest.mark.parametrize("gpu", ["GB200", "H100-PCIe", "RTX-PRO-6000"])  # in the GPU catalog, on no EC2 type
def test_a_gpu_no_nodepool_provisions_fails_the_cheap_checks_saying_how_to_add_it(gpu):
    with pytest.raises(ValueError, match=r"can be tuned but not deployed.*NodePool in infra/k8s/karpenter/"):
        check_tune_settings(_settings(gpu))


@pytest.mark.parametrize("gpu", ["H100-SXM", "p5.48xlarge", "L40S", "g6e.12xlarge", "A100-SXM-80GB", "L4", "g6.xlarge",
                                 "B200-SXM", "p6-b200.48xlarge", "p4d.24xlarge", "A10G", "g5.12xlarge"])
def test_every_deployable_gpu_or_instance_type_passes(gpu):
    assert check_tune_settings(_settings(gpu)).gpu.name
