"""Worker discovery feeding the runtime's router pool, at the HTTP transport.

Specification: the EndpointSlices the API lists, then the watch's ADDED/MODIFIED/DELETED events, make the
router's pool exactly the ready addresses of the prefill and decode Services — a pod added becomes a
routing target, a pod not ready or deleted stops being one — and nothing but a discovered address is ever
routed to. The runtime's `--discovery` flags are checked naming the flag.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from runtime.config import RouterSpec
from runtime.deploy.discovery import EndpointSliceDiscovery, PoolMembership
from runtime.server.__main__ import discovery_settings, parse_args
from runtime.server.app import build_router_pairing
from runtime.engines.kv_events import KvEventSubscriber
from runtime.server.discovery_sync import apply_membership, discovered_id, follow_discovery
from runtime.server.pairing import RouteRequest

NS = "pdserve"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"


def eps(name: str, service: str, ips: dict[str, bool], rv: str = "1") -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": NS, "resourceVersion": rv,
                         "labels": {"kubernetes.io/service-name": service}},
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ok}} for ip, ok in ips.items()],
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]}


def empty_pairing():
    return build_router_pairing(RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0),
                                block_size_tokens=16, prefill_urls=[], decode_urls=[])


def pool(pairing) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for w in pairing.workers.values():
        out[w.role].append(w.url)
    return {k: sorted(v) for k, v in out.items()}


async def test_endpointslice_adds_and_removes_change_the_router_pool():
    watch = [
        {"type": "ADDED", "object": eps("p-1", "m-prefill", {"10.0.0.1": True}, rv="11")},
        {"type": "MODIFIED", "object": eps("d-1", "m-decode", {"10.0.1.1": True, "10.0.1.2": True}, rv="12")},
        {"type": "MODIFIED", "object": eps("d-1", "m-decode", {"10.0.1.1": False, "10.0.1.2": True}, rv="13")},
        {"type": "DELETED", "object": eps("p-1", "m-prefill", {}, rv="14")},
    ]
    requests: list[httpx.Request] = []

    def api(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        assert request.url.path == PATH
        if request.url.params.get("watch") != "1":
            return httpx.Response(200, json={"kind": "EndpointSliceList", "metadata": {"resourceVersion": "10"},
                                             "items": [eps("d-1", "m-decode", {"10.0.1.1": True})]})
        script = watch if sum(r.url.params.get("watch") == "1" for r in requests) == 1 else []
        return httpx.Response(200, content="".join(json.dumps(e) + "\n" for e in script).encode())

    client = httpx.AsyncClient(base_url="https://k8s.test", transport=httpx.MockTransport(api))
    discovery = EndpointSliceDiscovery(namespace=NS, prefill_service="m-prefill", decode_service="m-decode",
                                       client=client)
    pairing = empty_pairing()
    snapshots: list[dict] = []
    done = asyncio.Event()
    routed_prefill: list[str | None] = []

    def on_change(m: PoolMembership) -> None:
        snapshots.append(pool(pairing))
        assert set(pairing.router.workers) == set(pairing.workers)  # the router's pool follows
        route = pairing.choose(RouteRequest(f"r{len(snapshots)}", "/v1/chat/completions", {}, None, 0.0))
        routed_prefill.append(route.prefill_url)
        assert route.decode_url in snapshots[-1]["decode"]  # only a discovered address is a target
        pairing.on_complete(f"r{len(snapshots)}", 0.0, True)
        if len(snapshots) == 5:
            done.set()

    task = asyncio.create_task(follow_discovery(discovery, pairing, on_change))
    try:
        await asyncio.wait_for(done.wait(), timeout=5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
    u = "http://10.0.{}:8000".format
    assert snapshots == [
        {"prefill": [], "decode": [u("1.1")]},                       # listed
        {"prefill": [u("0.1")], "decode": [u("1.1")]},               # prefill pod added
        {"prefill": [u("0.1")], "decode": [u("1.1"), u("1.2")]},     # decode pod added
        {"prefill": [u("0.1")], "decode": [u("1.2")]},               # decode pod not ready
        {"prefill": [], "decode": [u("1.2")]},                       # prefill slice deleted
    ]
    assert routed_prefill == [None, u("0.1"), u("0.1"), u("0.1"), None]  # no prefill pool -> local prefill


def test_apply_membership_reports_changes_and_keeps_unchanged_workers():
    pairing = empty_pairing()
    added, removed = apply_membership(pairing, PoolMembership(("http://a:1",), ("http://b:1", "http://c:1")))
    assert added == sorted([discovered_id("decode", "http://b:1"), discovered_id("decode", "http://c:1"),
                           discovered_id("prefill", "http://a:1")]) and removed == []
    assert apply_membership(pairing, PoolMembership(("http://a:1",), ("http://b:1", "http://c:1"))) == ([], [])
    # a pod whose address moves from the decode to the prefill pool changes role; one in both stays prefill
    added, removed = apply_membership(pairing, PoolMembership(("http://a:1", "http://b:1"), ("http://b:1",)))
    assert added == [discovered_id("prefill", "http://b:1")]
    assert removed == sorted([discovered_id("decode", "http://b:1"), discovered_id("decode", "http://c:1")])
    assert pool(pairing) == {"prefill": ["http://a:1", "http://b:1"], "decode": []}
    apply_membership(pairing, PoolMembership((), ()))
    assert pairing.workers == {} and pairing.router.workers == {}


def _args(*extra: str):
    return parse_args(["--model-name", "m", *extra])


def test_discovery_settings_configure_the_in_cluster_endpointslice_watch(tmp_path):
    (tmp_path / "token").write_text("tok")
    s = discovery_settings(_args("--discovery", "kubernetes", "--prefill-service", "p", "--decode-service", "d",
                                 "--router", "kv", "--worker-kv-events-port-name", "zmq"))
    d = EndpointSliceDiscovery.in_cluster(**s, sa_dir=tmp_path, host="https://127.0.0.1:6443")  # as serve() does
    assert (d.port_name, d.kv_events_port_name) == ("http", "zmq")
    assert d.roles == {"p": "prefill", "d": "decode"}


def test_discovery_flags_are_checked_naming_the_flag():
    assert discovery_settings(_args("--decode-url", "http://d:1")) is None
    with pytest.raises(SystemExit, match="--decode-url"):
        discovery_settings(_args())
    with pytest.raises(SystemExit, match="--decode-service"):
        discovery_settings(_args("--discovery", "kubernetes", "--prefill-service", "p"))
    with pytest.raises(SystemExit, match="--decode-url"):
        discovery_settings(_args("--discovery", "kubernetes", "--prefill-service", "p", "--decode-service", "d",
                                 "--decode-url", "http://d:1"))
    s = discovery_settings(_args("--discovery", "kubernetes", "--prefill-service", "p", "--decode-service", "d",
                                 "--namespace", "llm"))
    assert s == {"namespace": "llm", "prefill_service": "p", "decode_service": "d", "port_name": "http",
                 "kv_events_port_name": "kv-events"}
    with pytest.raises(SystemExit, match="--prefill-kv-events"):  # discovered endpoints are the only source
        discovery_settings(_args("--discovery", "kubernetes", "--prefill-service", "p", "--decode-service", "d",
                                 "--router", "kv", "--prefill-kv-events", "tcp://p:5557"))
    s = discovery_settings(_args("--discovery", "kubernetes", "--prefill-service", "p", "--decode-service", "d",
                                 "--router", "kv", "--worker-kv-events-port-name", "zmq"))
    assert s["kv_events_port_name"] == "zmq"


def test_rendered_runtime_args_start_discovery_and_the_kubernetes_planner(monkeypatch):
    from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, PoolSpec
    from runtime.deploy.render import SPEC_ENV, find, render_all

    spec = DeploymentSpec(model=ModelRef(name="m"), gpu="H100-SXM", prefill=PoolSpec(tp=1), decode=PoolSpec(tp=1),
                          planner=PlannerSpec(mode="sla"))
    objs = render_all(spec, name="m", namespace="llm", image="img:1", pvc_name="fsx-claim", revision="v3")
    csr = find(objs, "ClusterServingRuntime", "pdserve")["spec"]["containers"][0]["args"]
    model = find(objs, "InferenceService", "m")["spec"]["predictor"]["model"]
    env = {e["name"]: e.get("value") for e in model["env"]}
    monkeypatch.setenv(SPEC_ENV, env[SPEC_ENV])
    args = parse_args(csr + model["args"])  # KServe appends the ISVC args to the runtime's
    assert discovery_settings(args) == {"namespace": "llm", "prefill_service": "m-v3-prefill",
                                        "decode_service": "m-v3-decode", "port_name": "http",
                                        "kv_events_port_name": "kv-events"}
    assert args.planner == "kubernetes" and str(args.model_dir) == "/mnt/models"
    assert (args.prefill_deployment, args.decode_deployment) == ("m-v3-prefill", "m-v3-decode")
    assert DeploymentSpec.model_validate_json(args.deployment_spec) == spec  # from the env the ISVC sets
    role = find(objs, "Role", "m-v3-planner")  # the RBAC the planner's scale patches need
    assert role["rules"][0]["resourceNames"] == ["m-v3-prefill", "m-v3-decode"]


def kv_pairing():
    return build_router_pairing(RouterSpec(policy="kv_aware"), block_size_tokens=16, prefill_urls=[],
                                decode_urls=[])


async def test_discovered_event_endpoints_are_subscribed_and_unsubscribed_with_their_workers():
    pairing = kv_pairing()
    sub = KvEventSubscriber({}, pairing.apply_batch)
    sub.start()  # real SUB sockets; ZMQ connects lazily, so no publisher is needed here
    try:
        m1 = PoolMembership(("http://10.0.0.1:8000",), ("http://10.0.1.1:8000",),
                            kv_events=(("http://10.0.0.1:8000", "tcp://10.0.0.1:5557"),))
        added, removed = apply_membership(pairing, m1, subscriber=sub)
        assert added == sorted([discovered_id("decode", "http://10.0.1.1:8000"),
                               discovered_id("prefill", "http://10.0.0.1:8000")]) and removed == []
        assert sub.endpoints == {discovered_id("prefill", "http://10.0.0.1:8000"): "tcp://10.0.0.1:5557"}
        assert sub.active_workers == (discovered_id("prefill", "http://10.0.0.1:8000"),)
        loads = pairing.router.workers
        assert loads[discovered_id("prefill", "http://10.0.0.1:8000")].kv_events is True  # precise: events
        assert loads[discovered_id("decode", "http://10.0.1.1:8000")].kv_events is False  # no endpoint: approx
        assert apply_membership(pairing, m1, subscriber=sub) == ([], [])  # unchanged: nothing reopened
        assert sub.stats.num_opened == 1

        # the decode pod's slice gains its kv-events port: it is re-added as an event-fed worker
        m2 = PoolMembership(m1.prefill, m1.decode, kv_events=m1.kv_events + (
            ("http://10.0.1.1:8000", "tcp://10.0.1.1:5557"),))
        assert apply_membership(pairing, m2, subscriber=sub) == ([discovered_id("decode", "http://10.0.1.1:8000")],
                                                                 [discovered_id("decode", "http://10.0.1.1:8000")])
        assert pairing.router.workers[discovered_id("decode", "http://10.0.1.1:8000")].kv_events is True
        assert sub.active_workers == tuple(sorted((discovered_id("decode", "http://10.0.1.1:8000"),
                                                   discovered_id("prefill", "http://10.0.0.1:8000"))))

        # the prefill pod leaves: its subscription closes with it
        m3 = PoolMembership((), m2.decode, kv_events=m2.kv_events[1:])
        assert apply_membership(pairing, m3, subscriber=sub) == ([], [discovered_id("prefill", "http://10.0.0.1:8000")])
        assert sub.active_workers == (discovered_id("decode", "http://10.0.1.1:8000"),)
        assert set(sub.endpoints) == set(sub.active_workers) == set(pairing.kv_event_endpoints())
        assert sub.stats.num_closed == 1
    finally:
        await sub.stop()
    assert sub.active_workers == ()


async def test_without_a_subscriber_discovered_endpoints_are_ignored_and_workers_are_approximate():
    pairing = kv_pairing()
    m = PoolMembership((), ("http://10.0.1.1:8000",), kv_events=(("http://10.0.1.1:8000", "tcp://10.0.1.1:5557"),))
    apply_membership(pairing, m)
    assert pairing.kv_event_endpoints() == {}
    assert pairing.router.workers[discovered_id("decode", "http://10.0.1.1:8000")].kv_events is False


async def test_an_endpoint_zmq_refuses_leaves_its_worker_routable_but_approximate():
    pairing = kv_pairing()
    sub = KvEventSubscriber({}, pairing.apply_batch)
    sub.start()
    try:
        m = PoolMembership((), ("http://10.0.1.1:8000",), kv_events=(("http://10.0.1.1:8000", "tcp://10.0.1.1"),))
        assert apply_membership(pairing, m, subscriber=sub) == ([discovered_id("decode", "http://10.0.1.1:8000")], [])
        assert sub.active_workers == () and sub.endpoints == {}
        assert pairing.router.workers[discovered_id("decode", "http://10.0.1.1:8000")].kv_events is False
    finally:
        await sub.stop()


def test_discovered_ids_are_stable_per_address_and_name_no_address():
    a = discovered_id("decode", "http://user:secret@10.0.1.1:8000/")
    assert a == discovered_id("decode", "http://user:secret@10.0.1.1:8000")  # same pod address, same id
    assert a != discovered_id("prefill", "http://user:secret@10.0.1.1:8000")
    assert a != discovered_id("decode", "http://10.0.1.2:8000")
    assert a.startswith("decode@") and "10.0.1.1" not in a and "secret" not in a and ":" not in a


def test_a_discovered_worker_id_is_keyed_in_response_headers():
    import hashlib

    from runtime.server.model import public_worker_id

    url = "http://10.244.37.201:8000"
    wid = discovered_id("decode", url)
    assert "10.244" not in wid
    shown = public_worker_id(wid, b"k" * 16)
    unkeyed = hashlib.sha256(url.encode()).hexdigest()[:12]
    assert shown.startswith("decode-") and unkeyed not in shown  # not reversible by hashing the pod network
    assert shown == public_worker_id(wid, b"k" * 16) != public_worker_id(wid, b"j" * 16)
