"""`pdserve` command line: help explains every command; `tune` prints candidates, writes a valid spec, and
fails clearly (exit 1, message) on an impossible SLO or a broken config.json."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec
from runtime.paths import data_dir

runner = CliRunner()
LLAMA_70B = data_dir() / "models" / "meta-llama--Meta-Llama-3.1-70B_config.json"


def test_help_lists_every_command():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("demo", "stage", "tune", "promote", "serve", "compile", "prepare-model"):
        assert cmd in res.output


def test_tune_writes_a_valid_deployment_spec(tmp_path):
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--gpu", "H100-SXM", "--out", str(out)],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    spec = DeploymentSpec.model_validate_json(out.read_text())
    assert spec.prefill.tp <= spec.decode.tp
    assert spec.decode.tp >= 2  # 70B bf16 (141 GB of weights) cannot fit one 80 GB H100
    assert "★" in res.output


def test_tune_impossible_slo_exits_with_the_best_achievable(tmp_path):
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--ttft-ms", "0.01", "--itl-ms", "0.01"])
    assert res.exit_code == 1
    assert "TTFT" in res.output and "ITL" in res.output


def test_tune_config_missing_field_is_named(tmp_path):
    cfg = json.loads(LLAMA_70B.read_text())
    del cfg["num_hidden_layers"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    res = runner.invoke(app, ["tune", str(p)])
    assert res.exit_code == 1
    assert "num_hidden_layers" in res.output


def test_tune_measure_needs_a_model_folder_with_weights(tmp_path):
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--measure"])
    assert res.exit_code == 1
    assert "--measure needs a model folder" in " ".join(res.output.split())


def test_tune_measure_refuses_to_write_a_deployable_spec(tmp_path):
    res = runner.invoke(app, ["tune", str(tmp_path), "--measure", "--out", str(tmp_path / "s.json")])
    assert res.exit_code == 1
    assert "not a deployable GPU spec" in " ".join(res.output.split())  # rich wraps long lines
    assert not (tmp_path / "s.json").exists()
