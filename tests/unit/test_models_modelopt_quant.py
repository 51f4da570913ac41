"""ModelOpt checkpoints that keep their quantization in hf_quant_config.json beside config.json
(nvidia/Llama-3.1-70B-Instruct-FP8): read as vLLM reads them, and tuned at FP8 by default."""

import json
import shutil
from pathlib import Path

import pytest

from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.modelfiles.load import load_model_spec
from runtime.models.spec import ModelConfigError
from runtime.modelfiles.load import checkpoint_precision

MODELS = CATALOG_DIR
HF_QUANT = {"producer": {"name": "modelopt", "version": "0.15.0"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "Llama-3.1-70B-Instruct-FP8"
    d.mkdir()
    # the checkpoint's config.json as published: no quantization_config (the catalog entry restates it)
    cfg = json.loads((MODELS / "nvidia--Llama-3.1-70B-Instruct-FP8_config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_hf_quant_config_makes_it_an_fp8_checkpoint(folder: Path) -> None:
    assert checkpoint_precision(load_model_spec(folder)) == "bf16"  # config.json alone says nothing
    (folder / "hf_quant_config.json").write_text(json.dumps(HF_QUANT))
    m = load_model_spec(folder)
    assert (m.quant_method, m.quant_algo) == ("modelopt", "FP8")
    assert checkpoint_precision(m) == "fp8"
    assert checkpoint_precision(load_model_spec(folder / "config.json")) == "fp8"  # the file path too


def test_an_nvfp4_modelopt_checkpoint_is_not_tuned_at_fp8(folder: Path) -> None:
    (folder / "hf_quant_config.json").write_text(json.dumps(HF_QUANT | {"quantization": {"quant_algo": "NVFP4"}}))
    m = load_model_spec(folder)
    assert (m.quant_method, m.quant_algo, checkpoint_precision(m)) == ("modelopt", "NVFP4", "bf16")


def test_a_quantization_config_in_config_json_wins(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text()) | {"quantization_config": {"quant_method": "fp8"}}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "hf_quant_config.json").write_text(json.dumps(HF_QUANT | {"quantization": {"quant_algo": "NVFP4"}}))
    assert load_model_spec(folder).quant_method == "fp8"


@pytest.mark.parametrize("text", ["{not json", json.dumps({"producer": {"name": "modelopt"}}), "[]"])
def test_a_broken_hf_quant_config_is_named(folder: Path, text: str) -> None:
    (folder / "hf_quant_config.json").write_text(text)
    with pytest.raises(ModelConfigError, match="hf_quant_config.json"):
        load_model_spec(folder)


def test_pdserve_tune_on_the_folder_tunes_at_fp8(folder: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from runtime.cli import app
    from runtime.config import DeploymentSpec

    (folder / "hf_quant_config.json").write_text(json.dumps(HF_QUANT))
    res = CliRunner().invoke(app, ["tune", str(folder), "--gpu", "H100-SXM", "--out", str(tmp_path / "s.json")],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "quantized as 'modelopt'" in out and "tuning at fp8" in out and "does not tune for" not in out
    spec = DeploymentSpec.model_validate_json((tmp_path / "s.json").read_text())
    assert spec.precision == "fp8" and spec.model.quantization == "modelopt"  # no --quantization flag added
