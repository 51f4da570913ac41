"""`promote_version` end to end at the transports: real kubernetes client → Kubernetes-API stand-in on
loopback, real SLO probe → streaming SSE servers on loopback, real MLflow registry (sqlite).

Version 1 is promoted (fast server); version 2 answers too slowly for the SLO, so it is rolled back:
the InferenceService serves version 1 again, the `champion` alias points at version 1, and every step
is a tag on version 2.
"""

from __future__ import annotations

import json

import pytest

from runtime.deploy.kube import Kube
from runtime.deploy.promote import promote_version
from tests.unit.test_deploy_apply import NS, PVC, TOKEN, FakeApiServer, spec
from tests.unit.test_deploy_slo_probe import sse_server

pytestmark = pytest.mark.integration


@pytest.fixture
def api():
    srv = FakeApiServer().add_pvc()
    srv.thread.start()
    yield srv
    srv.close()


@pytest.fixture
def sse_servers():
    started = []

    def start(first_delay_s, gap_s):
        srv, t, _ = sse_server(first_delay_s, gap_s, 4)
        started.append((srv, t))
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv, t in started:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)


def test_promote_then_roll_back_a_slow_version(api, sse_servers, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    client.create_registered_model("smollm2")
    v1 = client.create_model_version("smollm2", source=str(tmp_path / "1")).version
    v2 = client.create_model_version("smollm2", source=str(tmp_path / "2")).version
    api.revision_urls = {f"v{v1}": sse_servers(0.0, 0.0), f"v{v2}": sse_servers(0.8, 0.0)}
    kube = Kube.for_host(api.url, token=TOKEN)
    common = dict(name="smollm2", namespace=NS, image="img:1", pvc_name=PVC, kube_context=None,
                  tracking_uri=uri, registered_model="smollm2", kube=kube, progress=lambda s: None, timeout_s=30)

    client.set_registered_model_alias("smollm2", "champion", v1)
    first = promote_version(spec(), v1, **common)
    assert first.outcome == "promoted"

    client.set_registered_model_alias("smollm2", "champion", v2)  # what tuning does for a new winner
    second = promote_version(spec(decode_tp=4), v2, **common)
    assert second.outcome == "rolled_back" and second.previous_revision == f"v{v1}"
    assert client.get_model_version_by_alias("smollm2", "champion").version == v1
    tags = client.get_model_version("smollm2", v2).tags
    probe = json.loads(tags["pdserve.deploy.slo_probe"])
    assert probe["status"] == "failed" and probe["ttft_p90_ms"] >= 800
    assert json.loads(tags["pdserve.deploy.rollback"])["restored_revision"] == f"v{v1}"
    assert json.loads(tags["pdserve.deploy.canary"])["canary_traffic_percent"] == 10
    live = api.live("serving.kserve.io/v1beta1", "InferenceService", "smollm2")
    assert live["metadata"]["labels"]["pdserve.io/revision"] == f"v{v1}"
    assert json.loads(client.get_model_version("smollm2", v1).tags["pdserve.deploy.outcome"])["status"] == "promoted"
