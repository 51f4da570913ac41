"""A rollout's steps land on the MLflow model version; a rollback moves the champion alias back
(real MLflow, sqlite backend in a temporary folder)."""

from __future__ import annotations

import json

import pytest

from runtime.deploy.mlflow_recorder import MlflowRecorder, revision_for, version_of

pytestmark = pytest.mark.integration


def test_steps_become_version_tags_and_rollback_restores_the_alias(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    client.create_registered_model("smollm2")
    v1 = client.create_model_version("smollm2", source=str(tmp_path / "m1")).version
    v2 = client.create_model_version("smollm2", source=str(tmp_path / "m2")).version
    client.set_registered_model_alias("smollm2", "champion", v2)

    rec = MlflowRecorder(tracking_uri=uri, registered_model="smollm2", version=v2)
    rec.record("canary", "ok", {"canary_traffic_percent": 10})
    rec.record("slo_probe", "failed", {"reason": "TTFT p90 900.0 ms > SLO 500.0 ms"})
    rec.champion_restored(revision_for(v1))

    tags = client.get_model_version("smollm2", v2).tags
    assert json.loads(tags["pdserve.deploy.canary"]) == {"status": "ok", "canary_traffic_percent": 10}
    assert json.loads(tags["pdserve.deploy.slo_probe"])["status"] == "failed"
    assert tags["pdserve.deploy.status"] == "slo_probe:failed"
    assert tags["pdserve.deploy.rolled_back_to"] == f"v{v1}"
    assert client.get_model_version_by_alias("smollm2", "champion").version == v1
    assert mlflow.__version__.startswith("3.")


def test_revision_names_round_trip():
    assert revision_for("12") == "v12" and version_of("v12") == "12"
    assert version_of(None) is None and version_of("canary") is None
