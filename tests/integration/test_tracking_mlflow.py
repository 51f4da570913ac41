"""Tuning logged to a real sqlite-backed MLflow: nested runs, artifacts, registry alias `champion`."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import ModelRef, SloSpec, WorkloadSpec
from runtime.modelfiles.load import load_model_spec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.tracking.mlflow_runs import TrackingError, load_champion, log_tuning
from runtime.tuner.search import tune

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    """One real sqlite-backed tracking store for the module (its schema migration takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def result():
    m = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json")
    return tune(m, "H100-SXM", SloSpec(), WorkloadSpec())


def test_log_register_and_load_champion(uri: str, result):
    from mlflow.tracking import MlflowClient

    db_dir = Path(uri[len("sqlite:///"):]).parent
    version = log_tuning(result, tracking_uri=uri, experiment="pdserve-tune", registered_model="llama70b",
                         model_ref=ModelRef(name="llama70b", path="/fsx/models/llama70b"))
    assert version == "1"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.get_experiment_by_name("pdserve-tune")
    assert exp.artifact_location.startswith((db_dir / "mlartifacts").as_uri())
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("pdserve.kind") == "tuning"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(parents) == 1 and len(children) == len(result.candidates) == 16
    winner = [r for r in children if r.data.tags["champion"] == "true"]
    assert len(winner) == 1
    w = winner[0].data
    assert w.params["prefill_tp"] == str(result.best.prefill_tp)
    assert w.params["model"] == result.model.name and w.params["gpu"] == "H100-SXM"
    assert w.metrics["predicted_ttft_ms"] == pytest.approx(result.best.ttft_ms)
    assert w.metrics["predicted_itl_ms"] == pytest.approx(result.best.itl_ms)
    assert w.metrics["goodput_per_gpu"] == pytest.approx(result.best.goodput_per_gpu)
    assert w.metrics["usd_per_mtok"] == pytest.approx(result.best.usd_per_mtok)
    arts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert {"pareto.png", "pareto.html", "candidates.md", "profiles", "deployment"} <= arts
    prof = {a.path for a in client.list_artifacts(parents[0].info.run_id, "profiles")}
    assert "profiles/profiles.json" in prof

    v, spec = load_champion(uri, "llama70b")
    assert v == "1"
    assert (spec.prefill.tp, spec.decode.tp) == (result.best.prefill_tp, result.best.decode_tp)
    assert spec.model.path == "/fsx/models/llama70b"

    # a second tuning moves the alias to version 2
    v2 = log_tuning(result, tracking_uri=uri, experiment="pdserve-tune", registered_model="llama70b")
    assert v2 == "2" and load_champion(uri, "llama70b")[0] == "2"


def test_load_champion_of_unknown_model_names_it(uri: str):
    with pytest.raises(TrackingError, match="registered model 'nosuchmodel' has no 'champion' version"):
        load_champion(uri, "nosuchmodel")


def test_log_without_registering_moves_no_alias(tmp_path, result) -> None:  # noqa: ANN001
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    assert log_tuning(result, tracking_uri=uri, experiment="pdserve-tune", registered_model=None) is None
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("pdserve-tune")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 + len(result.candidates)  # parent + one child per candidate
    with pytest.raises(MlflowException):
        client.get_registered_model("llama70b")
