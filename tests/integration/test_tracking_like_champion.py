"""`pdserve tune --like NAME` and challenger-vs-champion registration against a real sqlite-backed MLflow.

A first tune registers a champion; later tunes inherit its GPU, precision, SLO, GPU budget and planner mode
(explicit options win), and take the `champion` alias only when they beat the champion's deployment on the same
workload by --min-improvement-pct. Llama-3.1-70B on H100 at 10 requests/s is p4d4 3:1 (16 GPUs), at 2 requests/s
p4d4 1:1 (8 GPUs); on H200 its $/Mtok is slightly higher than on H100 (runtime/perf instance prices).
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from tests.integration.test_tracking_cli_mlflow import ENV, LLAMA_70B, _flat  # noqa: F401 - shared

pytestmark = pytest.mark.integration

runner = CliRunner()


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    """One real sqlite-backed tracking store for the module (its schema migration takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _tune(*args: str) -> str:
    res = runner.invoke(app, ["tune", str(LLAMA_70B), *args], env=ENV)
    assert res.exit_code == 0, res.output
    return _flat(res.output)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _last_parent(uri: str):
    client = _client(uri)
    exp = client.get_experiment_by_name("pdserve-tune-meta-llama/Meta-Llama-3.1-70B")
    runs = client.search_runs([exp.experiment_id], "tags.`pdserve.kind` = 'tuning'", max_results=1000)
    return max(runs, key=lambda r: r.info.start_time)


def _champion(uri: str, name: str) -> str:
    return str(_client(uri).get_model_version_by_alias(name, "champion").version)


def test_like_inherits_the_champions_constraints_and_logs_them(uri):
    _tune("--gpu", "H200-SXM", "--precision", "fp8", "--ttft-ms", "1500", "--itl-ms", "40", "--gpu-budget", "32",
          "--planner", "sla", "--rate", "4", "--mlflow-uri", uri, "--register", "inherit70")
    out = _tune("--like", "inherit70", "--rate", "3", "--mlflow-uri", uri)
    assert ("--like inherit70: champion version 1 (meta-llama/Meta-Llama-3.1-70B); inherited --gpu H200-SXM, "
            "--precision fp8, --ttft-ms 1500, --itl-ms 40, --gpu-budget 32, --planner sla") in out
    assert "given here" not in out
    p = _last_parent(uri).data.params
    assert (p["gpu"], p["precision"], p["slo_ttft_p90_ms"], p["slo_itl_p90_ms"]) == ("H200-SXM", "fp8", "1500", "40")
    assert (p["gpu_budget"], p["planner_mode"], p["inherited_from"]) == ("32", "sla", "inherit70 v1")
    assert p["request_rate_per_s"] == "3"


def test_an_explicit_option_overrides_what_like_inherits(uri):
    _tune("--gpu", "H200-SXM", "--ttft-ms", "1500", "--gpu-budget", "32", "--planner", "sla", "--rate", "4",
          "--mlflow-uri", uri, "--register", "override70")
    out = _tune("--like", "override70", "--ttft-ms", "3000", "--planner", "off", "--gpu", "H100-SXM",
                "--precision", "auto", "--rate", "4", "--mlflow-uri", uri)
    assert "inherited --itl-ms 50, --gpu-budget 32; given here: --gpu, --precision, --ttft-ms, --planner" in out
    p = _last_parent(uri).data.params
    assert (p["gpu"], p["slo_ttft_p90_ms"], p["planner_mode"]) == ("H100-SXM", "3000", "off")
    assert (p["slo_itl_p90_ms"], p["gpu_budget"], p["precision"]) == ("50", "32", "bf16")


def test_a_worse_challenger_is_registered_without_the_alias(uri):
    _tune("--rate", "10", "--mlflow-uri", uri, "--register", "worse70")  # H100 p4d4 3:1, 16 GPUs
    out = _tune("--like", "worse70", "--gpu", "H200-SXM", "--rate", "10", "--mlflow-uri", uri, "--register",
                "worse70")
    assert "registered worse70 version 2 WITHOUT alias champion, the champion stays version 1" in out
    assert "more than the champion" in out and "less than the 5% required" in out
    assert _champion(uri, "worse70") == "1"  # the old champion is not lost
    mv = _client(uri).get_model_version("worse70", "2")
    assert mv.tags["pdserve.champion_decision"] == "kept" and "not the champion" in mv.description
    run = _last_parent(uri)
    m = run.data.metrics
    assert m["champion_replaced"] == 0.0 and m["champion_improvement_pct"] < 0
    assert m["challenger_usd_per_mtok"] > m["champion_usd_per_mtok"] > 0
    assert m["champion_num_gpus"] == 16 and m["champion_min_improvement_pct"] == 5.0
    assert run.data.params["champion_version"] == "1" and run.data.params["champion_metric"] == "usd_per_mtok"
    assert run.data.tags["pdserve.champion_decision"] == "kept"


def test_a_better_challenger_takes_the_alias_and_an_equal_one_does_not(uri):
    _tune("--rate", "10", "--mlflow-uri", uri, "--register", "better70")  # 3:1 fixed replicas, 16 GPUs
    out = _tune("--like", "better70", "--rate", "2", "--mlflow-uri", uri, "--register", "better70")
    assert "registered better70 version 2 (alias champion), replacing version 1" in out and "50.0% less" in out
    assert _champion(uri, "better70") == "2"
    m = _last_parent(uri).data.metrics
    assert (m["champion_num_gpus"], m["challenger_num_gpus"], m["champion_replaced"]) == (16, 8, 1.0)
    assert m["champion_improvement_pct"] == pytest.approx(50.0)
    assert _client(uri).get_model_version("better70", "2").tags["pdserve.champion_decision"] == "replaced"
    # the same traffic again: as good as the champion, not better by 5%; without --like too (--register compares)
    out = _tune("--rate", "2", "--mlflow-uri", uri, "--register", "better70")
    assert "version 3 WITHOUT alias champion, the champion stays version 2" in out and _champion(uri, "better70") == "2"
    # --min-improvement-pct 0: any winner at least as cheap takes it
    out = _tune("--rate", "2", "--mlflow-uri", uri, "--register", "better70", "--min-improvement-pct", "0")
    assert "version 4 (alias champion), replacing version 2" in out and _champion(uri, "better70") == "4"


def test_a_champion_that_cannot_serve_the_new_traffic_is_replaced_whatever_the_threshold(uri):
    _tune("--rate", "10", "--mlflow-uri", uri, "--register", "grow70")  # 3:1 fixed
    out = _tune("--like", "grow70", "--rate", "40", "--mlflow-uri", uri, "--register", "grow70",
                "--min-improvement-pct", "90")
    assert "replacing version 1: the champion (p4d4) cannot serve this workload: needs" in out
    assert _champion(uri, "grow70") == "2"
    assert _last_parent(uri).data.metrics["champion_feasible"] == 0.0


def test_the_alias_is_not_moved_when_another_tuning_moved_it_meanwhile(uri):
    from dataclasses import replace

    from runtime.config import SloSpec, WorkloadSpec
    from runtime.modelfiles.load import load_model_spec
    from runtime.tracking.mlflow_runs import log_tuning
    from runtime.tuner.champion import compare_with_champion
    from runtime.tuner.search import tune

    result = tune(load_model_spec(LLAMA_70B), "H100-SXM", SloSpec(), WorkloadSpec(request_rate_per_s=2))
    assert log_tuning(result, tracking_uri=uri, experiment="race", registered_model="race70") == "1"
    assert log_tuning(result, tracking_uri=uri, experiment="race", registered_model="race70") == "2"
    old = replace(result.best, num_gpus=result.best.num_gpus * 2)
    cmp = compare_with_champion(result.best, old, same_gpu=True)
    assert cmp.replace  # compared with version 1, but version 2 holds the alias now
    v = log_tuning(result, tracking_uri=uri, experiment="race", registered_model="race70", comparison=cmp,
                   compared_version="1")
    assert v == "3" and _champion(uri, "race70") == "2"
    mv = _client(uri).get_model_version("race70", "3")
    assert mv.tags["pdserve.champion_decision"] == "kept" and "moved from version 1 to 2" in mv.tags[
        "pdserve.champion_reason"]


# ------------------------------------------------------------------------------------------------ refusals


def test_like_a_registered_model_that_does_not_exist(uri):
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--like", "nosuch70", "--mlflow-uri", uri], env=ENV)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    out = _flat(res.output)
    assert "error: --like nosuch70: registered model 'nosuch70' has no 'champion' version" in out
    assert "no such registered model" in out and "Traceback" not in out


def test_like_a_registered_model_without_a_champion_lists_its_versions(uri):
    _tune("--rate", "2", "--mlflow-uri", uri, "--register", "noalias70")
    _client(uri).delete_registered_model_alias("noalias70", "champion")
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--like", "noalias70", "--mlflow-uri", uri], env=ENV)
    assert res.exit_code == 1, res.output
    assert "its 'champion' alias is not set (versions: 1)" in _flat(res.output)


def test_like_names_what_the_champions_spec_does_not_state(uri):
    from runtime.tracking.mlflow_runs import SPEC_ARTIFACT

    _tune("--rate", "2", "--planner", "load", "--gpu-budget", "24", "--mlflow-uri", uri, "--register", "old70")
    client = _client(uri)
    run_id = client.get_model_version_by_alias("old70", "champion").run_id
    artifact = Path(unquote(urlparse(client.get_run(run_id).info.artifact_uri).path)) / SPEC_ARTIFACT
    doc = json.loads(artifact.read_text())
    del doc["planner"]  # a spec written before the planner existed
    del doc["slo"]["itl_p90_ms"]
    artifact.write_text(json.dumps(doc))
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--like", "old70", "--mlflow-uri", uri], env=ENV)
    assert res.exit_code == 1, res.output
    out = _flat(res.output)
    assert "does not state slo.itl_p90_ms, planner.gpu_budget, planner.mode" in out
    assert "(--itl-ms, --gpu-budget, --planner)" in out
    # given explicitly, nothing is missing: the rest is inherited
    out = _tune("--like", "old70", "--itl-ms", "50", "--gpu-budget", "24", "--planner", "load", "--rate", "2",
                "--mlflow-uri", uri)
    assert "inherited --gpu H100-SXM, --precision bf16, --ttft-ms 2000" in out


@pytest.mark.parametrize("args, why", [
    (["--like", "x"], "--like needs --mlflow-uri"),
    (["--like", "a/b", "--mlflow-uri", "sqlite:///unused.db"], "--like: registered model name 'a/b'"),
])
def test_like_refuses_bad_use_before_reading_anything(tmp_path, monkeypatch, args, why):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["tune", str(LLAMA_70B), *args], env=ENV)
    assert res.exit_code == 2 and why in _flat(res.output), res.output
    assert not (tmp_path / "unused.db").exists()


def test_like_with_measure_is_refused(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(LLAMA_70B.read_text())
    (folder / "model.safetensors").write_bytes(b"")
    res = runner.invoke(app, ["tune", str(folder), "--measure", "--like", "x", "--mlflow-uri", "sqlite:///x.db"],
                        env=ENV)
    assert res.exit_code == 2 and "--like re-tunes a registered GPU deployment" in _flat(res.output)


def test_the_cli_inherits_exactly_the_fields_tracking_documents():
    from runtime.usecases.tune_model import LIKE_OPTIONS
    from runtime.tracking.mlflow_runs import INHERITED_FIELDS

    assert tuple(LIKE_OPTIONS) == INHERITED_FIELDS


def test_an_infinite_improvement_threshold_is_refused_before_anything_is_tuned_or_written(tmp_path):
    """typer's min=0 lets `inf` through (and `nan` only by accident of the comparison); compare_with_champion then
    raised ValueError as a traceback after --out was written, and only when a champion existed."""
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--rate", "2", "--min-improvement-pct", "inf",
                              "--out", str(out)], env=ENV)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert "--min-improvement-pct: must be a finite percentage >= 0, got inf" in _flat(res.output)
    assert not out.exists()


def test_an_improvement_threshold_without_register_is_refused_not_ignored(tmp_path):
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--rate", "2", "--min-improvement-pct", "10",
                              "--out", str(out)], env=ENV)
    assert res.exit_code == 2, res.output
    assert "--min-improvement-pct: only applies with --register" in _flat(res.output)
    assert not out.exists()

def test_like_keeps_the_instance_type_a_champion_was_tuned_on(uri, tmp_path):
    """`--gpu g6e.12xlarge` bounds TP by the instance's 4 GPUs; the spec records only the GPU (L40S), so a re-tune
    that inherited `--gpu L40S` searched TP 8 too (a g6e.48xlarge the user never chose)."""
    _tune("--gpu", "g6e.12xlarge", "--precision", "fp8", "--rate", "0.5", "--mlflow-uri", uri,
          "--register", "inst70")
    assert _client(uri).get_model_version("inst70", "1").tags["pdserve.gpu_option"] == "g6e.12xlarge"
    out = _tune("--like", "inst70", "--rate", "0.5", "--mlflow-uri", uri, "--register", "inst70",
                "--out", str(tmp_path / "spec.json"))
    assert "inherited --gpu g6e.12xlarge, --precision fp8" in out
    p = _last_parent(uri).data.params
    assert (p["gpu"], p["gpu_option"], p["num_candidates"]) == ("L40S", "g6e.12xlarge", "9")  # TP 1, 2, 4 only
    assert _client(uri).get_model_version("inst70", "2").tags["pdserve.gpu_option"] == "g6e.12xlarge"
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert spec["gpu"] == "L40S" and max(spec["prefill"]["tp"], spec["decode"]["tp"]) <= 4
    # a GPU catalog name records no option: --like inherits the spec's GPU as before
    _tune("--gpu", "L40S", "--precision", "fp8", "--rate", "0.5", "--mlflow-uri", uri, "--register", "name70")
    assert "pdserve.gpu_option" not in _client(uri).get_model_version("name70", "1").tags
    assert "inherited --gpu L40S" in _tune("--like", "name70", "--rate", "0.5", "--mlflow-uri", uri)
# ------------------------------------------------------------------------------------------------ decision file


def test_the_decision_file_says_whether_the_registered_version_took_the_alias(uri, tmp_path):
    doc, values = tmp_path / "decision.json", tmp_path / "decision"
    report = ["--decision-out", str(doc), "--decision-values", str(values)]

    def files() -> tuple[str, str, str]:
        return tuple((values / f).read_text() for f in ("replaced", "registered_version", "champion_version"))

    _tune("--rate", "10", "--mlflow-uri", uri, "--register", "decide70", *report)  # H100 p4d4 3:1, 16 GPUs
    assert json.loads(doc.read_text()) == {
        "registered_model": "decide70", "registered_version": "1", "previous_champion_version": None,
        "champion_version": "1", "replaced": True, "reason": "first version of decide70"}
    assert files() == ("true", "1", "1")
    # a worse challenger (H200 costs more per Mtok): registered, the champion stays
    _tune("--like", "decide70", "--gpu", "H200-SXM", "--rate", "10", "--mlflow-uri", uri, "--register", "decide70",
          *report)
    d = json.loads(doc.read_text())
    assert (d["registered_version"], d["previous_champion_version"], d["champion_version"], d["replaced"]) == (
        "2", "1", "1", False)
    assert "less than the 5% required" in d["reason"]
    assert files() == ("false", "2", "1") and _champion(uri, "decide70") == "1"
    # a better one (half the GPUs at 2 requests/s) takes the alias
    _tune("--like", "decide70", "--rate", "2", "--mlflow-uri", uri, "--register", "decide70", *report)
    d = json.loads(doc.read_text())
    assert (d["registered_version"], d["previous_champion_version"], d["champion_version"], d["replaced"]) == (
        "3", "1", "3", True)
    assert "50.0% less" in d["reason"]
    assert files() == ("true", "3", "3") and _champion(uri, "decide70") == "3"


@pytest.mark.parametrize("args, why", [
    (["--decision-out", "d.json"], "--decision-out reports what --register did to the champion alias"),
    (["--decision-values", "dir"], "--decision-values reports what --register did"),
    (["--decision-values", "afile", "--register", "x"], "--decision-values afile: is not a folder"),
])
def test_a_decision_without_register_or_into_a_file_is_refused_before_anything_runs(tmp_path, monkeypatch, args, why):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--mlflow-uri", "sqlite:///unused.db", *args], env=ENV)
    assert res.exit_code == 2 and why in _flat(res.output), res.output
    assert not (tmp_path / "unused.db").exists() and not (tmp_path / "d.json").exists()


def test_promote_expect_version_refuses_a_champion_other_than_the_one_expected(uri, tmp_path):
    _tune("--rate", "2", "--mlflow-uri", uri, "--register", "expect70")
    out = tmp_path / "m.yaml"
    args = ["promote", "expect70", "--mlflow-uri", uri, "--allow-unstaged", "--out", str(out)]
    res = runner.invoke(app, [*args, "--expect-version", "2"], env=ENV)
    assert res.exit_code == 1 and "alias champion is version 1, but this run tuned version 2" in _flat(res.output)
    assert not out.exists()
    res = runner.invoke(app, [*args, "--expect-version", "1"], env=ENV)
    assert res.exit_code == 0 and "version 1:" in _flat(res.output), res.output
    assert "kind: InferenceService" in out.read_text()
