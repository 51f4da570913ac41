"""The MLflow server of infra/k8s/mlflow answers the pipeline's in-cluster tracking URI.

MLflow 3.x refuses requests whose Host header is not in `--allowed-hosts` (403 "Invalid Host header";
default: localhost and private IPs). The pipeline talks to `http://mlflow.mlflow.svc:5000`
(pipelines/stage_tune_promote.py), so the Deployment must list the Service's DNS names. This test starts a real
`mlflow server` on 127.0.0.1 with a sqlite store and exactly the `--allowed-hosts` value of the manifest.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from runtime.ports import free_port
from runtime.procs import stop_process

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MLFLOW_DIR = REPO / "infra" / "k8s" / "mlflow"
START_TIMEOUT_S = 120.0
SEARCH_PATH = "/api/2.0/mlflow/experiments/search?max_results=1"


def manifest_allowed_hosts() -> str:
    dep = yaml.safe_load((MLFLOW_DIR / "deployment.yaml").read_text())
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    values = [a.split("=", 1)[1] for a in args if a.startswith("--allowed-hosts=")]
    assert len(values) == 1, f"expected one --allowed-hosts=... in the MLflow args, got {args}"
    return values[0]


def service_hosts() -> list[str]:
    """Every name a pod resolves Service mlflow/mlflow by, with and without its port."""
    svc = yaml.safe_load((MLFLOW_DIR / "service.yaml").read_text())
    name, ns = svc["metadata"]["name"], svc["metadata"]["namespace"]
    port = svc["spec"]["ports"][0]["port"]
    names = [f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"]
    return names + [f"{n}:{port}" for n in names]


def get(port: int, path: str, host: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers={"Host": host})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def mlflow_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    tmp = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--default-artifact-root", str(tmp / "artifacts"),
         "--allowed-hosts", manifest_allowed_hosts()],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited {proc.returncode}: {(tmp / 'server.log').read_text()[-2000:]}")
            try:
                if get(port, "/health", "localhost")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not healthy after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        yield port
    finally:
        stop_process(proc, timeout_s=15)
        log.close()


def test_pipeline_tracking_host_is_allowed(mlflow_port: int):
    status, body = get(mlflow_port, SEARCH_PATH, "mlflow.mlflow.svc:5000")
    assert status == 200, body[:300]
    assert b"experiments" in body


def test_every_service_dns_name_and_localhost_is_allowed(mlflow_port: int):
    hosts = service_hosts() + ["localhost", f"localhost:{mlflow_port}", f"127.0.0.1:{mlflow_port}"]
    assert {h: get(mlflow_port, SEARCH_PATH, h)[0] for h in hosts} == {h: 200 for h in hosts}


def test_other_hosts_are_still_refused(mlflow_port: int):
    status, body = get(mlflow_port, SEARCH_PATH, "attacker.example:5000")
    assert status == 403 and b"Invalid Host header" in body
