"""Specification of apply + canary rollout + rollback, tested at the HTTP transport.

No kube-apiserver can run on this machine (not in Debian or PyPI), so the real `kubernetes` client talks
to a small Kubernetes-API stand-in on 127.0.0.1 that stores objects by REST path, answers GET/PATCH
(server-side apply)/DELETE like the API server (404 Status for missing objects, 422 for rejected ones)
and sets `status` the way the controllers would (ready at once unless told otherwise).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import pytest

from runtime.config import DeploymentSpec, ModelRef, PoolSpec, SloSpec
from runtime.deploy.apply import apply_objects, readiness
from runtime.deploy.errors import ApplyError, ManifestError
from runtime.deploy.kube import Kube, resource_path
from runtime.deploy.render import SPEC_ENV, render_all
from runtime.deploy.rollout import ListRecorder, ProbeResult, rollout

TOKEN = "test-token"
NAME, NS, PVC, IMAGE = "smollm2", "pdserve", "fsx-claim", "img:1"


class FakeApiServer:
    """Kubernetes REST stand-in: objects by path, SSA as replace, controller-like status."""

    def __init__(self) -> None:
        self.store: dict[str, dict] = {}
        self.log: list[tuple[str, str, dict, dict | None]] = []  # method, path, query, body
        self.never_ready: set[str] = set()  # object names whose status never turns ready
        self.reject: dict[str, str] = {}  # "Kind/name" -> 422 message
        self.revision_urls: dict[str, str] = {}  # pdserve.io/revision -> URL reported for that revision
        self.lock = threading.Lock()
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                url = urlsplit(self.path)
                query = dict(parse_qsl(url.query))
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                with srv.lock:
                    srv.log.append((method, url.path, query, body))
                    if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                        return self._send(401, {"kind": "Status", "code": 401, "message": "Unauthorized"})
                    code, out = srv.handle(method, url.path, self.headers.get("Content-Type"), body)
                self._send(code, out)

            def do_GET(self):
                self._handle("GET")

            def do_PATCH(self):
                self._handle("PATCH")

            def do_DELETE(self):
                self._handle("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def handle(self, method: str, path: str, ctype: str | None, body: dict | None) -> tuple[int, dict]:
        not_found = {"kind": "Status", "code": 404, "reason": "NotFound", "message": f"{path} not found"}
        if method == "GET":
            return (200, self.store[path]) if path in self.store else (404, not_found)
        if method == "DELETE":
            return (200, {"kind": "Status", "status": "Success"}) if self.store.pop(path, None) else (404, not_found)
        assert ctype == "application/apply-patch+yaml", ctype
        key = f"{body['kind']}/{body['metadata']['name']}"
        if key in self.reject:
            return 422, {"kind": "Status", "code": 422, "message": self.reject[key]}
        old = self.store.get(path)
        obj = json.loads(json.dumps(body))
        gen = (old or {}).get("metadata", {}).get("generation", 0)
        changed = old is None or old.get("spec") != obj.get("spec")
        obj["metadata"]["generation"] = gen + 1 if changed else gen
        obj["status"] = self.status_for(obj)
        self.store[path] = obj
        return 200, obj

    def status_for(self, obj: dict) -> dict:
        name = obj["metadata"]["name"]
        ready = name not in self.never_ready
        if obj["kind"] == "Deployment":
            n = obj["spec"]["replicas"] if ready else 0
            return {"observedGeneration": obj["metadata"]["generation"], "updatedReplicas": n,
                    "availableReplicas": n, "readyReplicas": n}
        if obj["kind"] == "InferenceService":
            pct = obj["spec"]["predictor"].get("canaryTrafficPercent", 100)
            host = f"{name}.{obj['metadata']['namespace']}.example.com"
            rev = obj["metadata"].get("labels", {}).get("pdserve.io/revision", "")
            latest = self.revision_urls.get(rev, f"http://latest-{host}")
            return {"url": f"http://{host}",
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                    "reason": "RevisionFailed" if not ready else "Ready"}],
                    "components": {"predictor": {"traffic": [
                        {"tag": "latest", "latestRevision": True, "percent": pct, "url": latest}]}}}
        return {}

    def add(self, obj: dict) -> None:
        m = obj["metadata"]
        self.store[resource_path(obj["apiVersion"], obj["kind"], m["name"], m.get("namespace"))] = obj

    def live(self, api_version: str, kind: str, name: str, ns: str | None = NS) -> dict | None:
        return self.store.get(resource_path(api_version, kind, name, ns))

    def patches(self) -> list[dict]:
        return [b for m, _, _, b in self.log if m == "PATCH"]


@pytest.fixture
def api():
    srv = FakeApiServer()
    srv.thread.start()
    srv.add({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": PVC, "namespace": NS}})
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()
    srv.thread.join(timeout=5)


@pytest.fixture
def kube(api):
    return Kube.for_host(api.url, token=TOKEN)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def spec(decode_tp: int = 2, **kw) -> DeploymentSpec:
    return DeploymentSpec(model=ModelRef(name="smollm2-135m-instruct"), prefill=PoolSpec(tp=1),
                          decode=PoolSpec(tp=decode_tp), slo=SloSpec(ttft_p90_ms=500, itl_p90_ms=50), **kw)


def objs(**kw):
    return render_all(spec(), name=NAME, namespace=NS, image=IMAGE, pvc_name=PVC, **kw)


# ---------------------------------------------------------------- apply_objects


def test_apply_server_side_applies_every_object_in_order_and_waits(api, kube):
    rendered = objs()
    messages: list[str] = []
    live = apply_objects(rendered, kube=kube, progress=messages.append, sleep=lambda s: None)
    assert [b["metadata"]["name"] for b in api.patches()] == [o["metadata"]["name"] for o in rendered]
    patch_queries = [q for m, _, q, _ in api.log if m == "PATCH"]
    assert all(q == {"fieldManager": "pdserve", "force": "true"} for q in patch_queries)
    assert [o["kind"] for o in live] == [o["kind"] for o in rendered]
    assert api.live("apps/v1", "Deployment", f"{NAME}-decode")["spec"]["replicas"] == 1
    assert api.live("serving.kserve.io/v1beta1", "InferenceService", NAME)["spec"]["predictor"]["model"][
        "storageUri"] == f"pvc://{PVC}/models/smollm2-135m-instruct"
    assert f"ready: InferenceService/{NAME} (Ready)" in messages
    patch_paths = [p for m, p, _, _ in api.log if m == "PATCH"]
    assert "/apis/serving.kserve.io/v1alpha1/clusterservingruntimes/pdserve" in patch_paths
    assert f"/apis/serving.kserve.io/v1beta1/namespaces/{NS}/inferenceservices/{NAME}" == patch_paths[-1]


def test_missing_pvc_is_reported_before_anything_is_applied(api, kube):
    api.store.clear()
    with pytest.raises(ApplyError, match=r"pvc_name: PersistentVolumeClaim 'fsx-claim' does not exist in "
                                         r"namespace 'pdserve'"):
        apply_objects(objs(), kube=kube)
    assert api.patches() == []


def test_invalid_object_is_rejected_before_any_request(api, kube):
    bad = objs()
    bad[-1]["spec"]["predictor"]["model"]["storageURI"] = "x"
    with pytest.raises(ManifestError, match=r"InferenceService/smollm2: spec\.predictor\.model\.storageURI"):
        apply_objects(bad, kube=kube)
    assert api.log == []


def test_api_rejection_names_the_object_path_and_message(api, kube):
    api.reject[f"Deployment/{NAME}-prefill"] = "admission webhook denied: gpu quota exceeded"
    with pytest.raises(ApplyError, match=r"^Deployment/smollm2-prefill: PATCH /apis/apps/v1/namespaces/pdserve/"
                                         r"deployments/smollm2-prefill: HTTP 422: admission webhook denied"):
        apply_objects(objs(), kube=kube, sleep=lambda s: None)


def test_readiness_timeout_names_what_is_not_ready(api, kube):
    api.never_ready.add(f"{NAME}-decode")
    clock, messages = FakeClock(), []
    with pytest.raises(ApplyError, match=r"not ready after 60 s: Deployment/smollm2-decode: 0/1 replicas"):
        apply_objects(objs(), kube=kube, timeout_s=60, poll_s=5, clock=clock, sleep=clock.sleep,
                      progress=messages.append)
    assert clock.t >= 60
    assert any(m.startswith("waiting for 1 object(s): Deployment/smollm2-decode") for m in messages)


def test_readiness_rules():
    dep = {"kind": "Deployment", "metadata": {"generation": 2}, "spec": {"replicas": 2},
           "status": {"observedGeneration": 1, "updatedReplicas": 2, "availableReplicas": 2}}
    assert readiness(dep)[0] is False  # stale generation
    dep["status"]["observedGeneration"] = 2
    assert readiness(dep) == (True, "2/2 replicas available")
    dep["status"]["availableReplicas"] = 1
    assert readiness(dep)[0] is False
    isvc = {"kind": "InferenceService", "status": {"conditions": [{"type": "Ready", "status": "False",
                                                                    "reason": "RevisionMissing"}]}}
    assert readiness(isvc) == (False, "RevisionMissing:")
    assert readiness({"kind": "Service"}) == (True, "applied")


# ---------------------------------------------------------------- canary rollout + rollback


def run(kube, clock, recorder, *, revision, probe, s=None, **kw):
    return rollout(s or spec(), name=NAME, namespace=NS, image=IMAGE, pvc_name=PVC, revision=revision,
                   kube=kube, probe=probe, recorder=recorder, clock=clock, sleep=clock.sleep, timeout_s=120, **kw)


FAST = ProbeResult(ttft_p90_ms=120.0, itl_p90_ms=20.0, num_requests=8)
SLOW = ProbeResult(ttft_p90_ms=900.0, itl_p90_ms=20.0, num_requests=8)


def isvc_labels(api):
    return api.live("serving.kserve.io/v1beta1", "InferenceService", NAME)["metadata"]["labels"]


def test_first_rollout_gets_full_traffic_and_is_promoted(api, kube):
    rec, urls = ListRecorder(), []
    res = run(kube, FakeClock(), rec, revision="v1", probe=lambda u: urls.append(u) or FAST)
    assert res.outcome == "promoted" and res.previous_revision is None
    assert [s for s, _, _ in rec.steps] == ["preflight", "apply_workers", "canary", "slo_probe", "promote",
                                           "outcome"]
    assert rec.steps[2][2] == {"canary_traffic_percent": 100}
    assert urls == [f"http://latest-{NAME}.{NS}.example.com"]
    assert isvc_labels(api)["pdserve.io/revision"] == "v1"
    assert api.live("apps/v1", "Deployment", f"{NAME}-v1-decode") is not None


def test_canary_that_meets_the_slo_is_promoted_and_the_old_workers_removed(api, kube):
    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)
    rec = ListRecorder()
    res = run(kube, clock, rec, revision="v2", probe=lambda u: FAST, s=spec(decode_tp=4), canary_percent=20)
    assert res.outcome == "promoted" and res.previous_revision == "v1"
    isvc_patches = [b for b in api.patches() if b["kind"] == "InferenceService"]
    assert [p["spec"]["predictor"].get("canaryTrafficPercent") for p in isvc_patches[-2:]] == [20, None]
    assert isvc_labels(api)["pdserve.io/revision"] == "v2"
    assert api.live("apps/v1", "Deployment", f"{NAME}-v1-decode") is None
    assert api.live("v1", "Service", f"{NAME}-v1-prefill") is None
    dec = api.live("apps/v1", "Deployment", f"{NAME}-v2-decode")
    assert dec["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "4"
    cleanup = dict((s, d) for s, _, d in rec.steps)["cleanup"]
    assert "Deployment/smollm2-v1-decode" in cleanup["deleted"]


def test_canary_that_misses_the_slo_rolls_back_to_the_previous_champion(api, kube):
    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)
    rec = ListRecorder()
    res = run(kube, clock, rec, revision="v2", probe=lambda u: SLOW, s=spec(decode_tp=4))
    assert res.outcome == "rolled_back" and res.previous_revision == "v1"
    assert "TTFT p90 900.0 ms > SLO 500.0 ms" in res.reason
    steps = {s: (st, d) for s, st, d in rec.steps}
    assert steps["slo_probe"][0] == "failed" and steps["rollback"][0] == "ok"
    assert steps["rollback"][1]["restored_revision"] == "v1"
    assert rec.restored == ["v1"]
    live = api.live("serving.kserve.io/v1beta1", "InferenceService", NAME)
    assert live["metadata"]["labels"]["pdserve.io/revision"] == "v1"
    assert "canaryTrafficPercent" not in live["spec"]["predictor"]
    env = {e["name"]: e["value"] for e in live["spec"]["predictor"]["model"]["env"]}
    assert DeploymentSpec.model_validate_json(env[SPEC_ENV]).decode.tp == 2
    assert api.live("apps/v1", "Deployment", f"{NAME}-v2-decode") is None
    assert api.live("apps/v1", "Deployment", f"{NAME}-v1-decode") is not None


def test_workers_that_never_get_ready_roll_back(api, kube):
    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)
    api.never_ready.add(f"{NAME}-v2-prefill")
    rec = ListRecorder()
    res = run(kube, clock, rec, revision="v2", probe=lambda u: pytest.fail("probe must not run"))
    assert res.outcome == "rolled_back"
    assert "Deployment/smollm2-v2-prefill" in res.reason
    assert isvc_labels(api)["pdserve.io/revision"] == "v1"
    assert api.live("apps/v1", "Deployment", f"{NAME}-v2-prefill") is None


def test_failed_first_rollout_cleans_up_and_raises(api, kube):
    rec = ListRecorder()
    with pytest.raises(ApplyError, match="no previous champion"):
        run(kube, FakeClock(), rec, revision="v1", probe=lambda u: SLOW)
    assert rec.steps[-1][1] == "no_previous_champion"
    assert api.live("serving.kserve.io/v1beta1", "InferenceService", NAME) is None
    assert api.live("apps/v1", "Deployment", f"{NAME}-v1-decode") is None


def test_rollout_with_missing_pvc_applies_nothing(api, kube):
    api.store.clear()
    rec = ListRecorder()
    with pytest.raises(ApplyError, match="fsx-claim"):
        run(kube, FakeClock(), rec, revision="v1", probe=lambda u: FAST)
    assert api.patches() == [] and rec.steps[0][:2] == ("preflight", "failed")


def test_probe_verdict_requires_every_request_to_succeed():
    slo = SloSpec(ttft_p90_ms=500, itl_p90_ms=50)
    assert FAST.verdict(slo)[0] is True
    ok, why = ProbeResult(100, 60, 8, num_errors=1).verdict(slo)
    assert not ok and "1/8 probe requests failed" in why and "ITL p90 60.0 ms > SLO 50.0 ms" in why
    assert ProbeResult(0, 0, 0).verdict(slo)[0] is False


def test_unsupported_kind_is_reported_before_anything_is_applied(api, kube):
    extra = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": NS}, "type": "Opaque"}
    with pytest.raises(ApplyError, match="kind 'Secret' is not supported"):
        apply_objects(objs() + [extra], kube=kube)
    assert api.patches() == []


def test_kubeconfig_context_reaches_the_api_server(api, tmp_path):
    import yaml

    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "other",
           "clusters": [{"name": "loop", "cluster": {"server": api.url}}],
           "users": [{"name": "u", "user": {"token": TOKEN}}],
           "contexts": [{"name": "pdserve-test", "context": {"cluster": "loop", "user": "u"}},
                        {"name": "other", "context": {"cluster": "loop", "user": "nobody"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    kube = Kube.from_context("pdserve-test", kubeconfig=str(path))
    assert kube.get("v1", "PersistentVolumeClaim", PVC, NS)["metadata"]["name"] == PVC
    assert api.log[-1][1] == f"/api/v1/namespaces/{NS}/persistentvolumeclaims/{PVC}"
