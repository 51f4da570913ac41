"""Every command that writes a file (`compile`, `promote --out`, `tune --out` / `--decision-out`, `batch workflow` /
`retune-schedule --out`) replaces an earlier output of its own but refuses any other existing file unless --force
(runtime.paths.replace_problem, runtime.faces.common.check_output_file)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.paths import replace_problem

runner = CliRunner()
WIDE = {"COLUMNS": "300"}
NOTES = "my notes: do not lose\n"
WORKFLOW = ["batch", "workflow", "--input", "s3://bkt1/in.jsonl", "--output", "s3://bkt1/out.jsonl", "--endpoint",
            "http://x-predictor.pdserve.svc.cluster.local/openai"]
RETUNE = ["batch", "retune-schedule", "--model-name", "org/llama8", "--traffic", "s3://bkt1/logs/",
          "--registered-model", "m"]


def test_the_rule_writes_missing_empty_and_recognised_files_and_refuses_others(tmp_path):
    def ours(text: str) -> bool:
        return text.startswith("ours")

    f = tmp_path / "f"
    assert replace_problem(f, ours, "x") is None  # missing
    f.write_text("")
    assert replace_problem(f, ours, "x") is None  # empty: nothing to lose (mktemp)
    f.write_text("ours, earlier")
    assert replace_problem(f, ours, "x") is None
    f.write_text(NOTES)
    assert replace_problem(f, ours, "an x") == "exists and is not an x; pass --force to replace it"
    assert replace_problem(f, ours, "x", force=True) is None
    f.write_bytes(b"\xff\xfe binary")
    assert replace_problem(f, ours, "x") is not None  # not UTF-8: not ours
    assert replace_problem(tmp_path, ours, "x") is None  # a folder is output_file_problem's to report


@pytest.mark.parametrize("argv", [WORKFLOW, RETUNE], ids=["workflow", "retune-schedule"])
def test_batch_workflows_replace_their_own_yaml_but_not_a_foreign_file(tmp_path, argv):
    notes, own = tmp_path / "notes.txt", tmp_path / "wf.yaml"
    notes.write_text(NOTES)
    res = runner.invoke(app, [*argv, "--out", str(notes)], env=WIDE)
    assert res.exit_code == 2, res.output
    assert f"--out {notes}: exists and is not an Argo workflow written by `pdserve batch`; pass --force" in res.output
    assert notes.read_text() == NOTES
    for _ in range(2):  # written, then replaced as its own
        res = runner.invoke(app, [*argv, "--out", str(own)], env=WIDE)
        assert res.exit_code == 0, res.output
    other = RETUNE if argv is WORKFLOW else WORKFLOW  # another pdserve workflow is an earlier output too
    assert runner.invoke(app, [*other, "--out", str(own)], env=WIDE).exit_code == 0
    res = runner.invoke(app, [*argv, "--out", str(notes), "--force"], env=WIDE)
    assert res.exit_code == 0 and "argoproj.io" in notes.read_text(), res.output


def test_tune_out_and_decision_out_refuse_a_foreign_file_before_any_work(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES)
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--out", str(notes)], env=WIDE)
    assert res.exit_code == 2 and "exists and is not a DeploymentSpec written by `pdserve tune --out`" in res.output
    assert notes.read_text() == NOTES and "candidate" not in res.output.lower()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--mlflow-uri", uri, "--register", "m", "--decision-out",
                              str(notes)], env=WIDE)
    assert res.exit_code == 2 and "--decision-out" in res.output and "pass --force" in res.output, res.output
    assert notes.read_text() == NOTES and not (tmp_path / "mlflow.db").exists()
    spec = tmp_path / "spec.json"
    for _ in range(2):  # written, then replaced as its own
        res = runner.invoke(app, ["tune", "llama-3.1-8b", "--out", str(spec)], env=WIDE)
        assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--out", str(notes), "--force"], env=WIDE)
    assert res.exit_code == 0 and json.loads(notes.read_text())["gpu"], res.output


def test_promote_out_and_decision_out_replace_their_own_files_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    decision = tmp_path / "decision.json"
    for _ in range(2):  # the second run replaces the first's decision file
        res = runner.invoke(app, ["tune", "llama-3.1-8b", "--mlflow-uri", uri, "--register", "m",
                                  "--decision-out", str(decision)], env=WIDE)
        assert res.exit_code == 0, res.output
    assert json.loads(decision.read_text())["registered_version"] == "2"
    default = tmp_path / "manifests.yaml"  # promote's default --out
    default.write_text(NOTES)
    promote = ["promote", "m", "--mlflow-uri", uri, "--allow-unstaged"]
    res = runner.invoke(app, promote, env=WIDE)
    assert res.exit_code == 2, res.output
    assert "--out manifests.yaml: exists and is not manifests written by `pdserve promote`; pass --force" in res.output
    assert default.read_text() == NOTES
    res = runner.invoke(app, [*promote, "--force"], env=WIDE)
    assert res.exit_code == 0 and "InferenceService" in default.read_text(), res.output
    res = runner.invoke(app, promote, env=WIDE)  # its own manifests: replaced without --force
    assert res.exit_code == 0, res.output


def test_compile_keeps_its_force_and_replaces_an_empty_file(tmp_path):
    pytest.importorskip("kfp")
    empty = tmp_path / "p.yaml"
    empty.write_text("")
    assert runner.invoke(app, ["compile", str(empty)]).exit_code == 0
    assert "pipelineInfo" in empty.read_text()
