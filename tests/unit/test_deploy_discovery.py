"""Specification of worker discovery from EndpointSlices (list + watch), tested at the HTTP transport
with httpx.MockTransport answering like the Kubernetes API server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from runtime.deploy.discovery import (
    EndpointSliceDiscovery, PoolMembership, StaticDiscovery, membership_from_slices,
)

NS = "pdserve"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
ROLES = {"smollm2-prefill": "prefill", "smollm2-decode": "decode"}


def eps(name: str, service: str, ips: dict[str, bool | None], rv: str = "1", port: int = 8000) -> dict:
    endpoints = []
    for ip, ready in ips.items():
        cond = {} if ready is None else {"ready": ready}
        endpoints.append({"addresses": [ip], "conditions": cond, "targetRef": {"kind": "Pod", "name": ip}})
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": NS, "resourceVersion": rv,
                         "labels": {"kubernetes.io/service-name": service}},
            "endpoints": endpoints,
            "ports": [{"name": "nixl", "port": 5600, "protocol": "TCP"},
                      {"name": "http", "port": port, "protocol": "TCP"}]}


def test_membership_counts_ready_and_unknown_endpoints_and_uses_the_named_port():
    slices = [
        eps("p-1", "smollm2-prefill", {"10.0.0.1": True, "10.0.0.2": False, "10.0.0.3": None}),
        eps("d-1", "smollm2-decode", {"10.0.1.1": True}),
        eps("x-1", "other-service", {"10.9.9.9": True}),
    ]
    m = membership_from_slices(slices, roles=ROLES)
    assert m == PoolMembership(prefill=("http://10.0.0.1:8000", "http://10.0.0.3:8000"),
                               decode=("http://10.0.1.1:8000",))


def test_ipv6_addresses_are_bracketed():
    s = eps("d-1", "smollm2-decode", {"fd00::1": True})
    s["addressType"] = "IPv6"
    assert membership_from_slices([s], roles=ROLES).decode == ("http://[fd00::1]:8000",)


async def test_static_discovery_yields_the_given_urls_once():
    got = [m async for m in StaticDiscovery(["http://p:1"], ["http://d:2", "http://c:3"]).updates()]
    assert got == [PoolMembership(("http://p:1",), ("http://c:3", "http://d:2"))]


class FakeApi:
    """Answers list requests from `self.slices` and watch requests from scripted line batches."""

    def __init__(self, slices: list[dict], watches: list[list[dict] | int]) -> None:
        self.slices, self.watches, self.requests = slices, list(watches), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        assert request.url.path == PATH
        # the pools' Services and their KV-event Services (a multi-node worker's ranks on every pod of its group)
        assert request.url.params["labelSelector"] == ("kubernetes.io/service-name in (smollm2-decode,"
                                                       "smollm2-decode-kv-events,smollm2-prefill,"
                                                       "smollm2-prefill-kv-events)")
        assert request.headers["Authorization"] == "Bearer tok"
        if request.url.params.get("watch") != "1":
            return httpx.Response(200, json={"kind": "EndpointSliceList", "metadata": {"resourceVersion": "10"},
                                             "items": self.slices})
        script = self.watches.pop(0) if self.watches else []
        if isinstance(script, int):
            return httpx.Response(script, json={"kind": "Status", "code": script})
        return httpx.Response(200, content="".join(json.dumps(e) + "\n" for e in script).encode())


def discovery(api: FakeApi, **kw) -> EndpointSliceDiscovery:
    client = httpx.AsyncClient(base_url="https://k8s.test", transport=httpx.MockTransport(api),
                               headers={"Authorization": "Bearer tok"})

    async def no_sleep(_s: float) -> None:
        return None

    return EndpointSliceDiscovery(namespace=NS, prefill_service="smollm2-prefill",
                                  decode_service="smollm2-decode", client=client, sleep=no_sleep, **kw)


async def take(gen, n: int) -> list[PoolMembership]:
    out = []

    async def run():
        async for m in gen:
            out.append(m)
            if len(out) == n:
                break

    await asyncio.wait_for(run(), timeout=5)
    await gen.aclose()
    return out


async def test_list_then_watch_yields_each_membership_change():
    api = FakeApi(
        slices=[eps("p-1", "smollm2-prefill", {"10.0.0.1": True}), eps("d-1", "smollm2-decode", {"10.0.1.1": True})],
        watches=[[
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "11"}}},
            {"type": "ADDED", "object": eps("p-2", "smollm2-prefill", {"10.0.0.2": True}, rv="12")},
            {"type": "MODIFIED", "object": eps("p-1", "smollm2-prefill", {"10.0.0.1": False}, rv="13")},
            {"type": "MODIFIED", "object": eps("d-1", "smollm2-decode", {"10.0.1.1": True}, rv="14")},  # no change
            {"type": "DELETED", "object": eps("d-1", "smollm2-decode", {}, rv="15")},
        ]],
    )
    got = await take(discovery(api).updates(), 4)
    assert [m.prefill for m in got] == [("http://10.0.0.1:8000",),
                                        ("http://10.0.0.1:8000", "http://10.0.0.2:8000"),
                                        ("http://10.0.0.2:8000",), ("http://10.0.0.2:8000",)]
    assert [m.decode for m in got] == [("http://10.0.1.1:8000",)] * 3 + [()]
    watch = [r for r in api.requests if r.url.params.get("watch") == "1"][0]
    assert watch.url.params["resourceVersion"] == "10"


async def test_expired_resource_version_relists():
    api2 = FakeApi(slices=[eps("d-1", "smollm2-decode", {"10.0.1.1": True})],
                   watches=[[{"type": "ERROR", "object": {"kind": "Status", "code": 410}}], []])
    api2.slices_after_relist = [eps("d-2", "smollm2-decode", {"10.0.1.2": True})]
    gen2 = discovery(api2).updates()

    async def consume():
        out = []
        async for m in gen2:
            out.append(m)
            if len(out) == 1:
                api2.slices = api2.slices_after_relist  # the relist after 410 sees the new state
            if len(out) == 2:
                break
        return out

    got = await asyncio.wait_for(consume(), timeout=5)
    await gen2.aclose()
    assert got[1].decode == ("http://10.0.1.2:8000",)
    lists = [r for r in api2.requests if r.url.params.get("watch") != "1"]
    assert len(lists) == 2


async def test_http_errors_back_off_and_retry():
    api = FakeApi(slices=[eps("d-1", "smollm2-decode", {"10.0.1.1": True})],
                  watches=[500, [{"type": "ADDED", "object": eps("d-2", "smollm2-decode", {"10.0.1.2": True})}]])
    sleeps: list[float] = []

    async def record_sleep(s: float) -> None:
        sleeps.append(s)

    d = discovery(api)
    d.sleep = record_sleep
    got = await take(d.updates(), 2)
    assert got[-1].decode == ("http://10.0.1.1:8000", "http://10.0.1.2:8000")
    assert sleeps == [1.0]


def test_in_cluster_reads_the_service_account_token_per_request(tmp_path, monkeypatch):
    (tmp_path / "token").write_text("tok\n")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(RuntimeError, match="KUBERNETES_SERVICE_HOST"):
        EndpointSliceDiscovery.in_cluster(namespace=NS, prefill_service="a", decode_service="b", sa_dir=tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.100.0.1")
    d = EndpointSliceDiscovery.in_cluster(namespace=NS, prefill_service="a", decode_service="b", sa_dir=tmp_path)
    assert d.client.base_url.host == "10.100.0.1" and d.client.base_url.scheme == "https"
    req = httpx.Request("GET", "https://10.100.0.1/x")
    flow = d.client.auth.auth_flow(req)
    assert next(flow).headers["Authorization"] == "Bearer tok"
    (tmp_path / "token").write_text("rotated")
    assert next(d.client.auth.auth_flow(httpx.Request("GET", "https://x/"))).headers["Authorization"] == "Bearer rotated"


def with_kv_events(s: dict, port: int = 5557) -> dict:
    s["ports"] = s["ports"] + [{"name": "kv-events", "port": port, "protocol": "TCP"}]
    return s


def test_kv_event_endpoints_come_from_the_same_slice_named_port_for_ready_workers_only():
    slices = [
        with_kv_events(eps("p-1", "smollm2-prefill", {"10.0.0.1": True, "10.0.0.2": False})),
        with_kv_events(eps("d-1", "smollm2-decode", {"10.0.1.1": None}), port=6000),
        eps("d-2", "smollm2-decode", {"10.0.1.2": True}),  # no kv-events port: no endpoint, still a worker
    ]
    m = membership_from_slices(slices, roles=ROLES)
    assert m.prefill == ("http://10.0.0.1:8000",)
    assert m.decode == ("http://10.0.1.1:8000", "http://10.0.1.2:8000")
    assert m.kv_events == (("http://10.0.0.1:8000", "tcp://10.0.0.1:5557"),
                           ("http://10.0.1.1:8000", "tcp://10.0.1.1:6000"))
    assert m.kv_events_endpoint("http://10.0.1.1:8000/") == "tcp://10.0.1.1:6000"
    assert m.kv_events_endpoint("http://10.0.1.2:8000") is None
    assert m.kv_events_endpoint("http://10.0.0.2:8000") is None  # not ready
    assert membership_from_slices(slices, roles=ROLES, kv_events_port_name=None).kv_events == ()
    assert membership_from_slices(slices, roles=ROLES, kv_events_port_name="zmq").kv_events == ()


def test_ipv6_kv_event_endpoints_are_bracketed_like_the_urls():
    s = with_kv_events(eps("d-1", "smollm2-decode", {"fd00::1": True}))
    s["addressType"] = "IPv6"
    assert membership_from_slices([s], roles=ROLES).kv_events == (("http://[fd00::1]:8000", "tcp://[fd00::1]:5557"),)


def test_membership_without_event_endpoints_is_backward_compatible():
    m = membership_from_slices([eps("d-1", "smollm2-decode", {"10.0.1.1": True})], roles=ROLES)
    assert m == PoolMembership(prefill=(), decode=("http://10.0.1.1:8000",))  # kv_events defaults to ()
    assert hash(m) == hash(PoolMembership((), ("http://10.0.1.1:8000",)))  # still a frozen, hashable value


def test_static_discovery_carries_the_given_event_endpoints_of_pool_workers():
    d = StaticDiscovery(["http://p:1/"], ["http://d:2"], kv_events={"http://p:1": "tcp://p:5557",
                                                                    "http://x:9": "tcp://x:5557"})
    assert d.membership.kv_events == (("http://p:1", "tcp://p:5557"),)
    assert d.membership.kv_events_endpoint("http://p:1") == "tcp://p:5557"


async def test_a_slice_gaining_its_kv_events_port_is_a_membership_change():
    api = FakeApi(slices=[eps("d-1", "smollm2-decode", {"10.0.1.1": True})],
                  watches=[[{"type": "MODIFIED",
                             "object": with_kv_events(eps("d-1", "smollm2-decode", {"10.0.1.1": True}, rv="11"))}]])
    got = await take(discovery(api).updates(), 2)
    assert [m.decode for m in got] == [("http://10.0.1.1:8000",)] * 2
    assert [m.kv_events for m in got] == [(), (("http://10.0.1.1:8000", "tcp://10.0.1.1:5557"),)]
    api = FakeApi(slices=[with_kv_events(eps("d-1", "smollm2-decode", {"10.0.1.1": True}))], watches=[])
    got = await take(discovery(api, kv_events_port_name=None).updates(), 1)
    assert got[0].decode == ("http://10.0.1.1:8000",) and got[0].kv_events == ()
