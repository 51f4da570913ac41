"""One champion rule for every face: `pdserve tune --register` and the pipeline's tune step, given the same
inputs in the same order, pick the same winner, write the same spec and move (or keep) the `champion` alias the
same way (runtime/usecases/champion.py). Real MLflow on sqlite, one registry per face."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec
from runtime.modelfiles.catalog import catalog_path
from runtime.steps import tune_step
from runtime.tracking.mlflow_runs import champion_version, load_champion

# (request rate, requests/s) of successive tunings of one model. 40 -> 41: the same deployment, so the first
# champion stays (not 5 % cheaper); 41 -> 5: a third of the GPUs, so the new winner takes the alias.
ROUNDS = [40.0, 41.0, 5.0]


@pytest.fixture
def staged(tmp_path):
    from runtime.staging.stage import stage_model

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(catalog_path("llama-3.1-8b").read_text())
    (src / "model.safetensors").write_bytes(b"\0" * 16)
    dest = tmp_path / "fsx" / "models" / "m"
    stage_model(str(src), dest, progress=False)
    return dest


def _cli(staged, uri: str, rate: float, out_dir) -> tuple[dict, DeploymentSpec]:
    spec, decision = out_dir / f"spec-{rate}.json", out_dir / f"decision-{rate}.json"
    res = CliRunner().invoke(app, ["tune", str(staged), "--fsx-root", str(staged.parent.parent), "--precision",
                                   "bf16", "--isl", "3000", "--osl", "150", "--rate", str(rate), "--mlflow-uri",
                                   uri, "--register", "m-pd", "--out", str(spec), "--decision-out", str(decision)])
    assert res.exit_code == 0, res.output
    return json.loads(decision.read_text()), DeploymentSpec.model_validate_json(spec.read_text())


def test_the_cli_and_the_pipeline_step_apply_the_same_champion_rule(staged, tmp_path):
    cli_uri, step_uri = f"sqlite:///{tmp_path / 'cli.db'}", f"sqlite:///{tmp_path / 'step.db'}"
    cli_champions, step_champions = [], []
    for rate in ROUNDS:
        decision, cli_spec = _cli(staged, cli_uri, rate, tmp_path)
        out = tune_step(str(staged), "m", "H100-SXM", "bf16", 2000.0, 50.0, 3000, 150, rate, step_uri, "m-pd")
        cli_champions.append(decision["champion_version"])
        step_champions.append(out.champion_version)
        assert out.champion_version == champion_version(step_uri, "m-pd")  # the output names the live alias
        assert (out.prefill_tp, out.decode_tp) == (cli_spec.prefill.tp, cli_spec.decode.tp)
    assert cli_champions == step_champions == ["1", "1", "3"]  # kept at 41/s, replaced at 5/s
    (cv, cli_champ), (sv, step_champ) = load_champion(cli_uri, "m-pd"), load_champion(step_uri, "m-pd")
    assert cv == sv == "3"
    assert (cli_champ.prefill, cli_champ.decode, cli_champ.workload) == (
        step_champ.prefill, step_champ.decode, step_champ.workload)


def test_the_pipeline_step_refuses_a_bad_min_improvement_pct_before_anything(staged, tmp_path):
    uri = f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(ValueError, match="min_improvement_pct"):
        tune_step(str(staged), "m", "H100-SXM", "bf16", 2000.0, 50.0, 3000, 150, 10.0, uri, "m-pd",
                  min_improvement_pct=-1.0)
    assert not (tmp_path / "x.db").exists()
