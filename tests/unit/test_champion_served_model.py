"""Registering a winner that serves another model than the registered model's champion is refused unless asked
for (`pdserve tune --replace-model`, the pipeline's replace_model): the next promote would change the model served
behind the same InferenceService. One rule (runtime.usecases.champion.check_served_model) for every face."""

from __future__ import annotations

import inspect

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec, ModelRef
from runtime.usecases.champion import ChampionPolicy, ServedModelChangeError, check_served_model

runner = CliRunner()
WIDE = {"COLUMNS": "400"}


def test_the_rule_refuses_another_served_model_unless_replacing_it_is_asked_for():
    champion = ("3", DeploymentSpec(model=ModelRef(name="Qwen/Qwen3-0.6B")))
    assert check_served_model("m", None, "x", ChampionPolicy()) is None  # no champion yet
    assert check_served_model("m", champion, "Qwen/Qwen3-0.6B", ChampionPolicy()) is None
    with pytest.raises(ServedModelChangeError) as e:
        check_served_model("m", champion, "meta-llama/Meta-Llama-3.1-8B", ChampionPolicy())
    assert "(version 3) serves 'Qwen/Qwen3-0.6B'" in str(e.value) and "pass replace_model" in str(e.value)
    assert "pass --replace-model" in e.value.message("--replace-model")
    note = check_served_model("m", champion, "meta-llama/Meta-Llama-3.1-8B", ChampionPolicy(replace_model=True))
    assert note and "serves 'Qwen/Qwen3-0.6B'" in note


def test_the_pipeline_tune_step_carries_replace_model_to_the_same_rule():
    from components.tune import tune_tp
    from pipelines.stage_tune_promote import stage_tune_promote
    from runtime.usecases.tune import TuneSettings, check_tune_settings

    base = dict(gpu="H100-SXM", ttft_p90_ms=2000, itl_p90_ms=50, isl_tokens=3000, osl_tokens=150,
                registered_model="m")
    assert check_tune_settings(TuneSettings(**base)).champion_policy.replace_model is False
    assert check_tune_settings(TuneSettings(**base, replace_model=True)).champion_policy.replace_model is True
    for func in (tune_tp.python_func, stage_tune_promote.pipeline_func):
        assert inspect.signature(func).parameters["replace_model"].default is False


def test_tune_register_refuses_another_model_under_a_champions_name_unless_replace_model(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = runner.invoke(app, ["tune", "qwen3-0.6b", "--mlflow-uri", uri, "--register", "m"], env=WIDE)
    assert first.exit_code == 0, first.output
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--mlflow-uri", uri, "--register", "m", "--out", str(out)],
                        env=WIDE)
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "its champion (version 1) serves 'Qwen/Qwen3-0.6B'" in text and "pass --replace-model" in text
    assert not out.exists() and "candidate" not in text.lower()  # refused before the search and --out
    from runtime.tracking.mlflow_runs import champion_version

    assert champion_version(uri, "m") == "1"
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--mlflow-uri", uri, "--register", "m", "--replace-model"],
                        env=WIDE)
    assert res.exit_code == 0, res.output
    assert "registered" in res.output and "version 2" in res.output
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--replace-model"], env=WIDE)
    assert res.exit_code == 2 and "--replace-model: only applies with --register" in res.output


def test_the_registration_itself_refuses_as_the_pipelines_tune_step_does(tmp_path, monkeypatch):
    """Without the CLI's early check, register_tuning (what the pipeline's tune step calls) refuses: nothing is
    registered and the champion stays."""
    import runtime.usecases.tune_model as tune_model
    from runtime.tracking.mlflow_runs import champion_version

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert runner.invoke(app, ["tune", "qwen3-0.6b", "--mlflow-uri", uri, "--register", "m"]).exit_code == 0
    monkeypatch.setattr(tune_model, "_check_served_model", lambda *a, **k: None)
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--mlflow-uri", uri, "--register", "m"], env=WIDE)
    assert res.exit_code == 2 and "pass --replace-model" in res.output, res.output
    assert champion_version(uri, "m") == "1"
    import mlflow

    assert [str(v.version) for v in mlflow.MlflowClient(uri).search_model_versions("name='m'")] == ["1"]
