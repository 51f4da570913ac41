"""Actuators against real transports: the Kubernetes actuator talks HTTP to a recording API stand-in
on 127.0.0.1 (no kube-apiserver can run here), the local actuator starts and stops real processes."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from runtime.planner.types import ScalingDecision
from tests.integration.standin_worker import TinyWorker
from runtime.server.actuators import (
    DryRunActuator,
    KubernetesActuator,
    LocalActuator,
    make_actuator,
    scale_rbac_rules,
)

pytestmark = pytest.mark.integration
kubernetes = pytest.importorskip("kubernetes")

SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"


class RecordingApiServer:
    """Answers GET/PATCH on deployments/{name}/scale like the API server (JSON Patch only) and records
    every request as (method, path, content type of a PATCH, parsed body)."""

    def __init__(self, namespace: str, replicas: dict[str, int]) -> None:
        self.namespace, self.replicas, self.requests = namespace, dict(replicas), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _name(self) -> str | None:
                parts = self.path.split("?")[0].split("/")
                # ['', 'apis', 'apps', 'v1', 'namespaces', NS, 'deployments', NAME, 'scale']
                if len(parts) == 9 and parts[1:5] == ["apis", "apps", "v1", "namespaces"] and parts[8] == "scale":
                    return parts[7] if parts[6] == "deployments" and parts[5] == outer.namespace else None
                return None

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _scale(self, name: str) -> dict:
                n = outer.replicas[name]
                return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                        "metadata": {"name": name, "namespace": outer.namespace},
                        "spec": {"replicas": n}, "status": {"replicas": n}}

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                ctype = self.headers.get("Content-Type") if method == "PATCH" else None
                outer.requests.append((method, self.path.split("?")[0], ctype, body))
                name = self._name()
                if name is None or name not in outer.replicas:
                    return self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound",
                                            "message": f"deployments.apps \"{name}\" not found", "code": 404})
                if method == "PATCH":
                    if self.headers.get("Content-Type") != "application/json-patch+json" or not isinstance(body, list):
                        return self._send(415, {"kind": "Status", "code": 415, "message": "bad patch"})
                    for op in body:
                        assert op["op"] == "replace" and op["path"] == "/spec/replicas"
                        outer.replicas[name] = int(op["value"])
                self._send(200, self._scale(name))

            def do_GET(self):
                self._handle("GET")

            def do_PATCH(self):
                self._handle("PATCH")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "RecordingApiServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def apps_api(url: str):
    cfg = kubernetes.client.Configuration()
    cfg.host = url
    return kubernetes.client.AppsV1Api(kubernetes.client.ApiClient(cfg))


def decision(p: int, d: int, mode: str = "disaggregated") -> ScalingDecision:
    return ScalingDecision(now_s=0.0, prefill_replicas=p, decode_replicas=d, serving_mode=mode)  # type: ignore[arg-type]


def test_kubernetes_actuator_patches_only_the_scale_subresource():
    with RecordingApiServer("llm", {"m-prefill": 1, "m-decode": 1}) as srv:
        act = KubernetesActuator(apps_api(srv.url), namespace="llm", prefill_deployment="m-prefill",
                                 decode_deployment="m-decode")
        assert act.current() == (1, 1)
        srv.requests.clear()
        applied = act.apply(decision(3, 1))
        assert applied.changed and srv.replicas == {"m-prefill": 3, "m-decode": 1}
        assert srv.requests == [
            ("GET", SCALE_PATH.format(ns="llm", name="m-prefill"), None, None),
            ("PATCH", SCALE_PATH.format(ns="llm", name="m-prefill"), "application/json-patch+json",
             [{"op": "replace", "path": "/spec/replicas", "value": 3}]),
            ("GET", SCALE_PATH.format(ns="llm", name="m-decode"), None, None),
        ]
        srv.requests.clear()
        assert not act.apply(decision(3, 1)).changed  # nothing to do: reads only
        assert [m for m, *_ in srv.requests] == ["GET", "GET"]
        act.apply(decision(0, 2, "aggregated"))  # aggregated: prefill Deployment to 0
        assert srv.replicas == {"m-prefill": 0, "m-decode": 2}
        assert all("/deployments/" in p and p.endswith("/scale") for _, p, _, _ in srv.requests)


def test_kubernetes_actuator_reports_a_missing_deployment():
    with RecordingApiServer("llm", {"m-decode": 1}) as srv:
        act = KubernetesActuator(apps_api(srv.url), namespace="llm", prefill_deployment="m-prefill",
                                 decode_deployment="m-decode")
        with pytest.raises(kubernetes.client.ApiException) as err:
            act.apply(decision(2, 1))
        assert err.value.status == 404 and "m-prefill" in err.value.body
        assert srv.replicas == {"m-decode": 1}


def test_rbac_rules_cover_only_the_scale_of_two_deployments_and_pod_annotations():
    rules = scale_rbac_rules("m-prefill", "m-decode")
    assert [r["resources"] for r in rules] == [["deployments/scale"], ["pods"]]
    assert rules[0]["resourceNames"] == ["m-prefill", "m-decode"]
    assert set(rules[0]["verbs"]) <= {"get", "patch", "update"}
    assert rules[1]["verbs"] == ["list", "patch"]  # list a pool's pods, annotate the ones it removes


def test_local_actuator_starts_and_stops_real_processes_up_to_the_cap():
    made: list[TinyWorker] = []

    def factory(role, index):
        made.append(TinyWorker(role, index))
        return made[-1]

    act = LocalActuator(factory, max_workers=3, stop_timeout_s=10.0)
    try:
        applied = act.apply(decision(2, 1))
        assert applied.changed and act.current() == (2, 1)
        act.wait_ready(timeout_s=30.0)
        assert all(httpx.get(w.base_url, timeout=2.0).status_code == 200 for w in made)
        applied = act.apply(decision(5, 4))  # over the cap of 3: decode first, prefill gets the rest
        assert (applied.prefill_replicas, applied.decode_replicas) == (0, 3) and act.current() == (0, 3)
        stopped = [w for w in made if w.role == "prefill"]
        assert stopped and all(not w.alive() for w in stopped)
        act.apply(decision(1, 1))
        assert act.current() == (1, 1)
        assert sum(w.alive() for w in made) == 2
    finally:
        act.close()
    assert not any(w.alive() for w in made)


def test_local_actuator_replaces_a_worker_that_died():
    made: list[TinyWorker] = []
    act = LocalActuator(lambda r, i: made.append(TinyWorker(r, i)) or made[-1], max_workers=2)
    try:
        act.apply(decision(1, 1))
        victim = act.workers("prefill")[0]
        victim.proc.kill()  # our own child
        victim.proc.wait(timeout=10)
        act.apply(decision(1, 1))
        assert act.workers("prefill")[0] is not victim and act.workers("prefill")[0].alive()
    finally:
        act.close()


def test_dry_run_and_registry():
    dry = make_actuator("dry_run")
    assert isinstance(dry, DryRunActuator)
    assert dry.apply(decision(2, 3)).changed and dry.current() == (2, 3) and len(dry.decisions) == 1
    with pytest.raises(ValueError, match="unknown planner actuator 'slurm'"):
        make_actuator("slurm")


@pytest.mark.parametrize("p,d,match", [
    (2, -1, "decode_replicas must be >= 1"),
    (2, 0, "someone has to decode"),
    (-1, 2, "prefill_replicas must be >= 0"),
    (2.5, 1, "prefill_replicas must be a whole number"),
])
def test_kubernetes_actuator_refuses_a_bad_decision_before_any_request(p, d, match):
    with RecordingApiServer("llm", {"m-prefill": 1, "m-decode": 1}) as srv:
        act = KubernetesActuator(apps_api(srv.url), namespace="llm", prefill_deployment="m-prefill",
                                 decode_deployment="m-decode")
        with pytest.raises(ValueError, match=match):
            act.apply(decision(p, d))
        assert srv.requests == [] and srv.replicas == {"m-prefill": 1, "m-decode": 1}


def test_local_actuator_logs_a_real_worker_crash_backs_off_and_releases_its_ports(tmp_path, caplog):
    """A real WorkerProcess whose interpreter is a script that fails at once (no vLLM needed)."""
    import logging
    import stat

    from runtime import ports
    from runtime.config import EngineSpec
    from runtime.engines.vllm_worker import WorkerProcess

    crash = tmp_path / "crash.sh"
    crash.write_text("#!/bin/sh\necho 'ValueError: model not found' >&2\nexit 3\n")
    crash.chmod(crash.stat().st_mode | stat.S_IXUSR)
    made: list[WorkerProcess] = []

    def factory(role, index):
        made.append(WorkerProcess(EngineSpec(), tmp_path, served_model_name="m", role=role,
                                  log_path=tmp_path / f"{role}-{index}.log", enable_kv_events=True,
                                  python=str(crash)))
        return made[-1]

    now = [0.0]
    act = LocalActuator(factory, max_workers=2, restart_backoff_s=30.0, clock=lambda: now[0])
    try:
        with caplog.at_level(logging.WARNING, logger="runtime.server.actuators"):
            for t in range(8):
                now[0] = float(t)
                act.apply(decision(0, 1))
                for w in act.workers("decode"):  # our own child: let it exit before the next tick
                    w._proc.wait(timeout=10)
        # t=0 start, t=1 crash + restart at once, t=2 crash + back off 30 s: no start until t=32
        assert len(made) == 2 and act.num_failed["decode"] == 2 and act.current() == (0, 0)
        text = caplog.text
        assert "exited with code 3 before it was ready" in text and "model not found" in text
        assert str(tmp_path / "decode-0.log") in text
        given = {p for _, p in ports._given}
        assert all(p not in given for w in made for p in (w.port, w.side_channel_port, w.kv_events_port))
    finally:
        act.close()
