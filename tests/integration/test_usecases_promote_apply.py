"""The pipeline's promote step applies from inside a pod and fails when its canary is rolled back.

Real parts: sqlite MLflow registry with two tuned versions, the `kubernetes` client with the in-cluster
config (pod env, service-account token, CA) against the Kubernetes-API stand-in served over TLS, SSE servers
on loopback for the SLO probe. Version 1 is promoted; version 2's revision URL refuses connections, so its
probe fails, it is rolled back, and the step raises (a KFP run goes red, like `pdserve promote --apply`).
"""

from __future__ import annotations

import json

import pytest

from runtime.config import ModelRef, SloSpec, WorkloadSpec
from runtime.deploy import kube as kube_mod
from runtime.deploy.errors import RolledBackError
from runtime.modelfiles.load import load_model_spec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.ports import free_port
from runtime.usecases.promote import PromoteRequest, promote
from tests.unit.test_deploy_apply import NS, PVC, FakeApiServer, in_cluster_files
from tests.unit.test_deploy_slo_probe import sse_server

pytestmark = pytest.mark.integration

REGISTERED = "llama8b-pd"


@pytest.fixture
def pod(tmp_path, monkeypatch):
    """The Kubernetes-API stand-in over TLS, and this process made to look like a pod of that cluster."""
    srv = FakeApiServer()
    files = in_cluster_files(srv, tmp_path)
    srv.add_pvc().thread.start()
    for k, v in files["environ"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(kube_mod, "IN_CLUSTER_TOKEN_PATH", files["token_path"])
    monkeypatch.setattr(kube_mod, "IN_CLUSTER_CA_PATH", files["ca_path"])
    yield srv
    srv.close()


@pytest.fixture
def fast_url():
    srv, t, _ = sse_server(0.0, 0.0, 4)
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    t.join(timeout=5)


def promote_step(champion_version: str, **kw) -> dict:
    """The promote use case as the pipeline's promote component calls it (its artifact metadata)."""
    return promote(PromoteRequest(expect_version=champion_version, **kw)).metadata()


def tune_and_register(uri: str) -> str:
    from runtime.tracking.mlflow_runs import log_tuning
    from runtime.tuner.search import tune

    model = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json")
    result = tune(model, "H100-SXM", SloSpec(), WorkloadSpec())
    return str(log_tuning(result, tracking_uri=uri, experiment="steps-apply", registered_model=REGISTERED,
                          model_ref=ModelRef(name="llama8b", path="/mnt/fsx/models/llama8b")))


def test_promote_applies_in_cluster_and_raises_on_rollback(pod, fast_url, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = dict(registered_model=REGISTERED, mlflow_tracking_uri=uri, namespace=NS, image="img:1", pvc_name=PVC,
                apply=True, kube_context="", require_staged=False)

    v1 = tune_and_register(uri)
    pod.revision_urls[f"v{v1}"] = fast_url
    info = promote_step(champion_version=v1, out_path=str(tmp_path / "v1.yaml"), **args)
    assert info["applied"] is True and info["version"] == v1
    live = pod.live("serving.kserve.io/v1beta1", "InferenceService", REGISTERED)  # named after the registered model
    assert live["metadata"]["labels"]["pdserve.io/revision"] == f"v{v1}"

    v2 = tune_and_register(uri)
    pod.revision_urls[f"v{v2}"] = f"http://127.0.0.1:{free_port()}"  # nothing listens: every probe request fails
    with pytest.raises(RolledBackError, match=rf"version {v2} was not promoted: rolled back to revision v{v1}: "
                                              r"SLO probe failed: 4/4 probe requests failed"):
        promote_step(champion_version=v2, out_path=str(tmp_path / "v2.yaml"), **args)
    live = pod.live("serving.kserve.io/v1beta1", "InferenceService", REGISTERED)
    assert live["metadata"]["labels"]["pdserve.io/revision"] == f"v{v1}"
    client = MlflowClient(tracking_uri=uri)
    assert str(client.get_model_version_by_alias(REGISTERED, "champion").version) == v1
    assert json.loads(client.get_model_version(REGISTERED, v2).tags["pdserve.deploy.rollback"])["status"] == "ok"


def test_skip_if_live_applies_nothing_when_the_revision_already_serves_with_that_image(pod, fast_url, tmp_path):
    """A re-tune's promote step runs whenever its tune succeeded (a retried tune may already have moved the alias):
    with skip_if_live it must not re-run a canary of the revision that already serves, yet must still promote
    when the image changed."""
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = dict(registered_model=REGISTERED, mlflow_tracking_uri=uri, namespace=NS, pvc_name=PVC, apply=True,
                kube_context="", require_staged=False, skip_if_live=True)
    v1 = tune_and_register(uri)
    pod.revision_urls[f"v{v1}"] = fast_url
    first = promote_step(champion_version=v1, image="img:1", out_path=str(tmp_path / "a.yaml"), **args)
    assert first["applied"] is True and first["already_live"] is False  # nothing live yet: a first rollout
    writes = sum(1 for method, *_ in pod.log if method != "GET")
    again = promote_step(champion_version=v1, image="img:1", out_path=str(tmp_path / "b.yaml"), **args)
    assert again["applied"] is False and again["already_live"] is True
    assert sum(1 for method, *_ in pod.log if method != "GET") == writes  # not one object written
    new_image = promote_step(champion_version=v1, image="img:2", out_path=str(tmp_path / "c.yaml"), **args)
    assert new_image["applied"] is True and new_image["already_live"] is False
    live = pod.live("serving.kserve.io/v1beta1", "InferenceService", REGISTERED)
    assert live["metadata"]["annotations"]["pdserve.io/image"] == "img:2"
