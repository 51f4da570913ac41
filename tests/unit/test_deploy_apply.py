"""Specification of apply + canary rollout + rollback, tested at the HTTP transport.

No kube-apiserver can run on this machine (not in Debian or PyPI), so the real `kubernetes` client talks
to a small Kubernetes-API stand-in on 127.0.0.1 that stores objects by REST path, answers GET/POST/PUT/PATCH
(server-side apply)/DELETE like the API server (404 Status for missing objects, 422 for rejected ones, 409
for creating an existing object or replacing with a stale resourceVersion) and sets `status` the way the controllers would (ready at once unless told otherwise).
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
        self.rv = 0  # resourceVersion counter (POST/PUT)
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
                    scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
                    if scheme.lower() != "bearer" or token != TOKEN:  # auth schemes are case-insensitive (RFC 9110)
                        return self._send(401, {"kind": "Status", "code": 401, "message": "Unauthorized"})
                    code, out = srv.handle(method, url.path, self.headers.get("Content-Type"), body)
                self._send(code, out)

            def do_GET(self):
                self._handle("GET")

            def do_PATCH(self):
                self._handle("PATCH")

            def do_DELETE(self):
                self._handle("DELETE")

            def do_POST(self):
                self._handle("POST")

            def do_PUT(self):
                self._handle("PUT")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def handle(self, method: str, path: str, ctype: str | None, body: dict | None) -> tuple[int, dict]:
        not_found = {"kind": "Status", "code": 404, "reason": "NotFound", "message": f"{path} not found"}
        if method == "GET":
            return (200, self.store[path]) if path in self.store else (404, not_found)
        if method == "DELETE":
            return (200, {"kind": "Status", "status": "Success"}) if self.store.pop(path, None) else (404, not_found)
        if method in ("POST", "PUT"):  # create (409 AlreadyExists) / replace (409 Conflict on a stale resourceVersion)
            item = f"{path}/{body['metadata']['name']}" if method == "POST" else path
            old = self.store.get(item)
            if method == "POST" and old is not None:
                return 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists", "message": f"{item} exists"}
            if method == "PUT" and old is None:
                return 404, not_found
            if method == "PUT" and body["metadata"].get("resourceVersion") not in (
                    None, old["metadata"].get("resourceVersion")):
                return 409, {"kind": "Status", "code": 409, "reason": "Conflict", "message": "object was modified"}
            obj = json.loads(json.dumps(body))
            self.rv += 1
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.store[item] = obj
            return (201 if method == "POST" else 200), obj
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

    def add_pvc(self) -> "FakeApiServer":
        """The FSx claim every promote checks before it renders (PVC in NS); returns self."""
        self.add({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": PVC, "namespace": NS}})
        return self

    def close(self) -> None:
        """Stop serving, release the port, wait for the serving thread."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def live(self, api_version: str, kind: str, name: str, ns: str | None = NS) -> dict | None:
        return self.store.get(resource_path(api_version, kind, name, ns))

    def patches(self) -> list[dict]:
        return [b for m, _, _, b in self.log if m == "PATCH"]

    def writes(self) -> list[tuple[str, str]]:
        """(method, path) of every request that changed or tried to change something."""
        return [(m, p) for m, p, _, _ in self.log if m != "GET"]

    def serve_tls(self, cert_path: str, key_path: str) -> None:
        """Answer HTTPS (as the real API server does) with this certificate; call before `thread.start()`."""
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert_path, key_path)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.url = self.url.replace("http://", "https://", 1)


def self_signed_cert(folder) -> tuple[str, str]:
    """A CA-style self-signed certificate for IP 127.0.0.1 (like a cluster CA + API server cert in one);
    returns (cert_path, key_path)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "ca.crt", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def in_cluster_files(api: "FakeApiServer", folder) -> dict:
    """Serve `api` over TLS and write what the kubelet gives a pod: env, service-account token, CA."""
    cert, key = self_signed_cert(folder)
    api.serve_tls(cert, key)
    token = folder / "token"
    token.write_text(TOKEN)
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.httpd.server_address[1])}
    return {"environ": env, "token_path": str(token), "ca_path": cert}


@pytest.fixture
def api():
    srv = FakeApiServer().add_pvc()
    srv.thread.start()
    yield srv
    srv.close()


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


def _scale(api, name: str, replicas: int) -> None:
    """What the planner's actuator does: the live Deployment's replicas changed through its scale subresource."""
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"
    api.store[path]["spec"]["replicas"] = replicas


def test_applying_live_workers_again_keeps_the_replicas_the_planner_set(api, kube):
    apply_objects(objs(), kube=kube, sleep=lambda s: None)
    _scale(api, f"{NAME}-decode", 5)
    apply_objects(objs(), kube=kube, sleep=lambda s: None)
    assert api.live("apps/v1", "Deployment", f"{NAME}-decode")["spec"]["replicas"] == 5
    # the count is sent as it stands (server-side apply removes a field its manager stops sending)
    sent = [b for b in api.patches() if b["kind"] == "Deployment" and b["metadata"]["name"] == f"{NAME}-decode"]
    assert [b["spec"]["replicas"] for b in sent] == [1, 5]
    assert api.live("apps/v1", "Deployment", f"{NAME}-prefill")["spec"]["replicas"] == 1  # not scaled: as rendered


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
    env = {e["name"]: e.get("value") for e in live["spec"]["predictor"]["model"]["env"]}
    assert DeploymentSpec.model_validate_json(env[SPEC_ENV]).decode.tp == 2
    assert api.live("apps/v1", "Deployment", f"{NAME}-v2-decode") is None
    assert api.live("apps/v1", "Deployment", f"{NAME}-v1-decode") is not None


def test_a_rollback_keeps_the_replicas_the_planner_gave_the_champion(api, kube):
    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)
    _scale(api, f"{NAME}-v1-decode", 6)  # the champion's planner scaled its decode pool for the load
    res = run(kube, clock, ListRecorder(), revision="v2", probe=lambda u: SLOW, s=spec(decode_tp=4))
    assert res.outcome == "rolled_back"
    assert api.live("apps/v1", "Deployment", f"{NAME}-v1-decode")["spec"]["replicas"] == 6


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
    ok, why = ProbeResult(100, None, 8).verdict(slo)  # a stream of one chunk each: no inter-token gap measured
    assert not ok and why == ("ITL was not measured: no probe request streamed two or more content chunks, so the "
                              "ITL SLO (50.0 ms) cannot be confirmed")


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


def test_in_cluster_config_reaches_the_api_server_with_the_pod_token_over_tls(tmp_path):
    srv = FakeApiServer()
    files = in_cluster_files(srv, tmp_path)
    srv.add_pvc().thread.start()
    try:
        kube = Kube.in_cluster(**files)
        assert kube.get("v1", "PersistentVolumeClaim", PVC, NS)["metadata"]["name"] == PVC
        assert srv.url.startswith("https://127.0.0.1:")
    finally:
        srv.close()


def test_outside_a_pod_in_cluster_config_fails_naming_both_options(tmp_path):
    with pytest.raises(ApplyError, match=r"Service host/port is not set.*kubeconfig context.*inside a Kubernetes pod"):
        Kube.in_cluster(environ={}, token_path=str(tmp_path / "none"), ca_path=str(tmp_path / "none"))
    missing = tmp_path / "no-kubeconfig"
    with pytest.raises(ApplyError, match=r"kubeconfig context 'prod'"):
        Kube.from_context("prod", kubeconfig=str(missing))


def test_unreachable_api_server_is_an_apply_error_naming_the_request():
    from runtime.ports import free_port

    port = free_port()  # nothing listens there
    kube = Kube.for_host(f"http://127.0.0.1:{port}", token=TOKEN)
    with pytest.raises(ApplyError, match=rf"GET /api/v1/namespaces/pdserve/persistentvolumeclaims/{PVC}: cannot "
                                         rf"reach the Kubernetes API server http://127.0.0.1:{port}: MaxRetryError"):
        kube.get("v1", "PersistentVolumeClaim", PVC, NS)
    with pytest.raises(ApplyError, match=r"Deployment/smollm2-prefill: PATCH .*cannot reach"):
        kube.apply(next(o for o in objs() if o["kind"] == "Deployment"))


def test_api_server_that_drops_the_connection_is_an_apply_error():
    import socket

    sock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def accept_and_close():
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            conn.recv(65536)
            conn.close()  # no HTTP answer at all

    t = threading.Thread(target=accept_and_close, daemon=True)
    t.start()
    try:
        kube = Kube.for_host(f"http://127.0.0.1:{sock.getsockname()[1]}", token=TOKEN)
        with pytest.raises(ApplyError, match=r"cannot reach the Kubernetes API server"):
            kube.delete("apps/v1", "Deployment", "x", NS)
    finally:
        stop.set()
        t.join(timeout=5)
        sock.close()


# ---------------------------------------------------------------- rollback on any failure


def rolled_back_to_v1(api) -> bool:
    live = api.live("serving.kserve.io/v1beta1", "InferenceService", NAME)
    return (live["metadata"]["labels"]["pdserve.io/revision"] == "v1"
            and "canaryTrafficPercent" not in live["spec"]["predictor"]
            and api.live("apps/v1", "Deployment", f"{NAME}-v2-decode") is None)


def test_unexpected_probe_error_rolls_back_then_raises(api, kube):
    from runtime.deploy.errors import RolledBackError

    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)

    def broken_probe(url):
        return {"choices": [None]}["choices"][0].get("delta")  # a parse bug: AttributeError

    rec = ListRecorder()
    with pytest.raises(RolledBackError, match=r"rollout of v2 was rolled back to v1 after an unexpected "
                                              r"AttributeError: 'NoneType' object has no attribute 'get'"):
        run(kube, clock, rec, revision="v2", probe=broken_probe, s=spec(decode_tp=4))
    assert rolled_back_to_v1(api)
    steps = {s: (st, d) for s, st, d in rec.steps}
    assert steps["rollback"][0] == "ok" and "AttributeError" in steps["rollback"][1]["error"]
    assert rec.restored == ["v1"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_during_the_canary_rolls_back_then_propagates(api, kube, interrupt):
    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)

    def interrupted_probe(url):
        raise interrupt()

    rec = ListRecorder()
    with pytest.raises(interrupt):
        run(kube, clock, rec, revision="v2", probe=interrupted_probe, s=spec(decode_tp=4))
    assert rolled_back_to_v1(api)  # not left at a 10 % canary of v2
    steps = {s: (st, d) for s, st, d in rec.steps}
    assert steps["rollback"][0] == "ok" and interrupt.__name__ in steps["rollback"][1]["error"]
    assert rec.restored == ["v1"]
    assert api.live(*LEASE) is None  # the promote lock is released too


def test_an_interrupt_with_a_failed_alias_restore_records_it(api, kube):
    class AliasDown(ListRecorder):
        def champion_restored(self, revision):
            raise ConnectionError("MLflow unreachable")

    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)

    def interrupted_probe(url):
        raise KeyboardInterrupt

    rec = AliasDown()
    with pytest.raises(KeyboardInterrupt):
        run(kube, clock, rec, revision="v2", probe=interrupted_probe, s=spec(decode_tp=4))
    assert rolled_back_to_v1(api)
    (alias,) = [d for s, st, d in rec.steps if st == "alias_not_restored"]
    assert alias["restored_revision"] == "v1" and "MLflow unreachable" in alias["alias_error"]


def test_an_interrupted_first_rollout_removes_what_it_applied(api, kube):
    def interrupted_probe(url):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(kube, FakeClock(), ListRecorder(), revision="v1", probe=interrupted_probe)
    assert api.live("serving.kserve.io/v1beta1", "InferenceService", NAME) is None
    assert api.live("apps/v1", "Deployment", f"{NAME}-v1-decode") is None


def test_recorder_error_during_the_canary_rolls_back(api, kube):
    from runtime.deploy.errors import RolledBackError

    class FlakyRecorder(ListRecorder):
        def record(self, step, status, detail):
            if step == "canary":
                raise ConnectionError("MLflow tracking server unreachable")
            super().record(step, status, detail)

    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)
    rec = FlakyRecorder()
    with pytest.raises(RolledBackError, match=r"unexpected ConnectionError: MLflow tracking server unreachable"):
        run(kube, clock, rec, revision="v2", probe=lambda u: pytest.fail("probe must not run"), s=spec(decode_tp=4))
    assert rolled_back_to_v1(api)
    assert [s for s, _, _ in rec.steps][-1] == "rollback" and rec.restored == ["v1"]


def test_champion_alias_is_restored_even_when_the_rollback_wait_fails(api, kube):
    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)

    def slow_and_v1_breaks(url):
        api.never_ready.add(f"{NAME}-v1-decode")  # the old workers cannot come back either
        return SLOW

    rec = ListRecorder()
    with pytest.raises(ApplyError, match=r"rollout of v2 failed \(SLO probe failed: TTFT p90 900.0 ms > SLO 500.0 ms\) "
                                         r"and the rollback to v1 did not complete: ApplyError: not ready after 120 s: "
                                         r"Deployment/smollm2-v1-decode"):
        run(kube, clock, rec, revision="v2", probe=slow_and_v1_breaks, s=spec(decode_tp=4))
    assert rec.restored == ["v1"]
    steps = {s: (st, d) for s, st, d in rec.steps}
    assert steps["rollback"][0] == "failed" and "not ready" in steps["rollback"][1]["rollback_error"]
    assert rolled_back_to_v1(api)  # the InferenceService was re-applied; the unused v2 workers removed


def test_api_server_lost_during_the_canary_still_restores_the_alias(api, kube):
    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)

    def probe_then_api_down(url):
        api.httpd.shutdown()
        api.httpd.server_close()
        return FAST

    rec = ListRecorder()
    with pytest.raises(ApplyError, match=r"rollout of v2 failed \(InferenceService/smollm2: PATCH .*cannot reach the "
                                         r"Kubernetes API server.*\) and the rollback to v1 did not complete"):
        run(kube, clock, rec, revision="v2", probe=probe_then_api_down, s=spec(decode_tp=4))
    assert rec.restored == ["v1"]
    assert [st for s, st, _ in rec.steps if s == "rollback"] == ["failed"]


# ---------------------------------------------------------------- planner RBAC per revision


def planner_role(api, rev: str) -> dict | None:
    return api.live("rbac.authorization.k8s.io/v1", "Role", f"{NAME}-{rev}-planner")


def planner_binding(api, rev: str) -> dict | None:
    return api.live("rbac.authorization.k8s.io/v1", "RoleBinding", f"{NAME}-{rev}-planner")


def test_during_a_canary_each_revision_may_scale_its_own_workers(api, kube):
    from runtime.config import PlannerSpec

    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST, s=spec(planner=PlannerSpec(mode="sla")))
    seen = {}

    def probe(url):  # the canary is live: the champion (90 % of traffic) still scales v1's pools
        seen.update({rev: planner_role(api, rev) for rev in ("v1", "v2")})
        return FAST

    res = run(kube, clock, ListRecorder(), revision="v2", probe=probe,
              s=spec(decode_tp=4, planner=PlannerSpec(mode="sla")))
    assert res.outcome == "promoted"
    for rev in ("v1", "v2"):
        assert seen[rev]["rules"][0]["resourceNames"] == [f"{NAME}-{rev}-prefill", f"{NAME}-{rev}-decode"]
        assert seen[rev]["metadata"]["labels"]["pdserve.io/revision"] == rev
    assert planner_role(api, "v1") is None and planner_binding(api, "v1") is None  # cleaned up with v1's workers
    assert planner_role(api, "v2") is not None and planner_binding(api, "v2")["roleRef"]["name"] == f"{NAME}-v2-planner"


def test_rollback_deletes_the_new_revisions_planner_role(api, kube):
    from runtime.config import PlannerSpec

    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST, s=spec(planner=PlannerSpec(mode="sla")))
    res = run(kube, clock, ListRecorder(), revision="v2", probe=lambda u: SLOW,
              s=spec(decode_tp=4, planner=PlannerSpec(mode="sla")))
    assert res.outcome == "rolled_back"
    assert planner_role(api, "v2") is None and planner_binding(api, "v2") is None
    assert planner_role(api, "v1")["rules"][0]["resourceNames"] == [f"{NAME}-v1-prefill", f"{NAME}-v1-decode"]


def test_promoting_a_spec_without_planner_removes_the_old_planner_role(api, kube):
    from runtime.config import PlannerSpec

    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST, s=spec(planner=PlannerSpec(mode="sla")))
    # a Role shared by all revisions, as rendered before planner RBAC was per revision
    legacy = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
              "metadata": {"name": f"{NAME}-planner", "namespace": NS}, "rules": []}
    api.add(legacy)
    rec = ListRecorder()
    run(kube, clock, rec, revision="v2", probe=lambda u: FAST, s=spec(planner=PlannerSpec(mode="off")))
    assert planner_role(api, "v1") is None and planner_role(api, "v2") is None
    assert api.live("rbac.authorization.k8s.io/v1", "Role", f"{NAME}-planner") is None
    cleanup = dict((s, d) for s, _, d in rec.steps)["cleanup"]["deleted"]
    assert f"Role/{NAME}-v1-planner" in cleanup and f"RoleBinding/{NAME}-v1-planner" in cleanup


# ---------------------------------------------------------------- promote lock (Lease)


LEASE = ("coordination.k8s.io/v1", "Lease", f"{NAME}-promote")


def lease_of(holder: str, renew_time: str, duration_s: int = 3600) -> dict:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": f"{NAME}-promote", "namespace": NS, "resourceVersion": "7"},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration_s, "renewTime": renew_time}}


def test_a_second_concurrent_promote_fails_without_touching_anything(api, kube):
    from runtime.deploy import lease

    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)
    second: dict = {}

    def probe_while_b_promotes(url):  # promote A is in its SLO probe; promote B of the same service starts
        assert api.live(*LEASE)["spec"]["holderIdentity"] == "promote-a"
        before = len(api.writes())
        rec = ListRecorder()
        with pytest.raises(ApplyError, match=r"InferenceService/smollm2: another promote holds the lock "
                                             r"Lease/smollm2-promote in namespace 'pdserve' \(holder 'promote-a', "
                                             r"expires .*\); nothing was applied.*kubectl delete lease smollm2-promote"):
            run(kube, clock, rec, revision="v3", probe=lambda u: pytest.fail("B must not probe"),
                s=spec(decode_tp=4), lease_holder="promote-b")
        second["writes"] = api.writes()[before:]
        second["steps"] = rec.steps
        return FAST

    res = run(kube, clock, ListRecorder(), revision="v2", probe=probe_while_b_promotes, lease_holder="promote-a")
    assert res.outcome == "promoted"
    assert second["writes"] == [("POST", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases")]  # refused create
    assert [(s, st) for s, st, _ in second["steps"]] == [("preflight", "failed")]
    assert api.live("apps/v1", "Deployment", f"{NAME}-v3-decode") is None
    assert isvc_labels(api)["pdserve.io/revision"] == "v2"
    assert api.live(*LEASE) is None  # A released its lock after success
    assert lease.lease_duration_s(120) > 4 * 120


def test_an_expired_lease_is_taken_over_and_released(api, kube):
    api.add(lease_of("promote-that-died", "2020-01-01T00:00:00.000000Z", duration_s=60))
    held_by = []
    rec = ListRecorder()
    res = run(kube, FakeClock(), rec, revision="v1", lease_holder="promote-c",
              probe=lambda u: held_by.append(api.live(*LEASE)["spec"]) or FAST)
    assert res.outcome == "promoted"
    assert held_by[0]["holderIdentity"] == "promote-c" and held_by[0]["leaseTransitions"] == 1
    assert held_by[0]["leaseDurationSeconds"] > 120
    assert rec.steps[0][2]["lease_taken_over_from"] == "promote-that-died"
    assert ("PUT", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{NAME}-promote") in api.writes()
    assert api.live(*LEASE) is None


def test_a_live_lease_of_another_holder_blocks_even_the_first_promote(api, kube):
    import datetime as dt

    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    api.add(lease_of("promote-x", now))
    with pytest.raises(ApplyError, match=r"holder 'promote-x'"):
        run(kube, FakeClock(), ListRecorder(), revision="v1", probe=lambda u: FAST)
    assert api.patches() == [] and api.live(*LEASE)["spec"]["holderIdentity"] == "promote-x"


def test_the_lease_is_released_after_a_rollback_and_after_an_unexpected_error(api, kube):
    from runtime.deploy.errors import RolledBackError

    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)
    assert api.live(*LEASE) is None
    res = run(kube, clock, ListRecorder(), revision="v2", probe=lambda u: SLOW)
    assert res.outcome == "rolled_back" and api.live(*LEASE) is None
    with pytest.raises(RolledBackError):
        run(kube, clock, ListRecorder(), revision="v3", probe=lambda u: 1 / 0)
    assert api.live(*LEASE) is None
    with pytest.raises(ApplyError, match="no previous champion"):
        api.store.pop(next(p for p in api.store if p.endswith(f"/inferenceservices/{NAME}")))
        run(kube, clock, ListRecorder(), revision="v4", probe=lambda u: SLOW)
    assert api.live(*LEASE) is None


def test_release_leaves_a_lease_that_another_holder_took_over(api, kube):
    from runtime.deploy import lease

    held = lease.acquire(kube, name=NAME, namespace=NS, holder="me", duration_s=60, now=lambda: 0.0)
    api.add(lease_of("someone-else", "2099-01-01T00:00:00.000000Z"))
    assert lease.release(kube, held) is False
    assert api.live(*LEASE)["spec"]["holderIdentity"] == "someone-else"


def test_the_lease_object_is_a_valid_kubernetes_lease(api, kube):
    from runtime.deploy import lease
    from runtime.deploy.validate import validate_object

    lease.acquire(kube, name=NAME, namespace=NS, holder="me", duration_s=60)
    body = next(b for m, _, _, b in api.log if m == "POST")
    assert validate_object(body) == "kubernetes 1.33"


def test_promoter_rbac_may_manage_the_lock_lease():
    from runtime.deploy.rbac import promoter_rbac

    rules = promoter_rbac(NS)[1]["rules"]
    lease_rule = next(r for r in rules if r["apiGroups"] == ["coordination.k8s.io"])
    assert lease_rule["resources"] == ["leases"] and {"get", "create", "update", "delete"} <= set(lease_rule["verbs"])


# ---------------------------------------------------------------- live spec from another pdserve version


def edit_live_spec(api, edit) -> None:
    live = api.live("serving.kserve.io/v1beta1", "InferenceService", NAME)
    env = live["spec"]["predictor"]["model"]["env"]
    data = json.loads(env[0]["value"])
    edit(data)
    env[0]["value"] = json.dumps(data)


def test_unknown_fields_in_the_live_spec_are_ignored_with_a_warning(api, kube):
    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)
    edit_live_spec(api, lambda d: (d.update(future_knob=1), d["router"].update(new_policy_weight=0.5)))
    rec = ListRecorder()
    res = run(kube, clock, rec, revision="v2", probe=lambda u: SLOW, s=spec(decode_tp=4))
    assert res.outcome == "rolled_back"  # the champion was read and restored
    pre = rec.steps[0]
    assert pre[:2] == ("preflight", "ok")
    assert pre[2]["ignored_live_spec_fields"] == ["future_knob", "router.new_policy_weight"]
    assert "does not know" in pre[2]["warning"] and "future_knob" in pre[2]["warning"]
    assert rolled_back_to_v1(api)
    rec = ListRecorder()
    assert run(kube, clock, rec, revision="v3", probe=lambda u: FAST).outcome == "promoted"


def test_an_unreadable_live_spec_is_a_clear_error_and_applies_nothing(api, kube):
    clock = FakeClock()
    run(kube, clock, ListRecorder(), revision="v1", probe=lambda u: FAST)
    edit_live_spec(api, lambda d: d["prefill"].update(tp="lots"))
    before = len(api.patches())
    rec = ListRecorder()
    with pytest.raises(ApplyError) as err:
        run(kube, clock, rec, revision="v2", probe=lambda u: FAST)
    msg = str(err.value)
    assert "not rendered by pdserve" not in msg
    assert "live champion's PDSERVE_DEPLOYMENT_SPEC cannot be read by this pdserve version" in msg
    assert "prefill.tp" in msg and "kubectl delete inferenceservice smollm2 -n pdserve" in msg
    assert "image img:1" in msg
    assert len(api.patches()) == before and rec.steps[-1][:2] == ("preflight", "failed")
    assert api.live(*LEASE) is None


def test_an_inference_service_not_rendered_by_pdserve_is_named_as_such(api, kube):
    api.add({"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
             "metadata": {"name": NAME, "namespace": NS}, "spec": {"predictor": {"model": {"env": []}}}})
    with pytest.raises(ApplyError, match=r"InferenceService/smollm2 in namespace 'pdserve' was not rendered by pdserve "
                                         r"\(no env PDSERVE_DEPLOYMENT_SPEC"):
        run(kube, FakeClock(), ListRecorder(), revision="v1", probe=lambda u: FAST)
    assert api.patches() == []
