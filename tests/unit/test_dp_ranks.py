"""Routing to (worker, data-parallel rank), as NVIDIA Dynamo does.

Specification: a vLLM worker with `--data-parallel-size N` runs N engines behind one API server, each with
its own KV cache; rank r publishes its KV events on the configured port + r, labelled `data_parallel_rank` r,
and a request with the header `X-data-parallel-rank: r` runs on rank r. So the router keeps one index and
load entry per rank, subscribes to every rank's port, and a route to a DP worker names the rank, which the
request to the worker carries as that header. Health, drains and the planner's loads stay per worker; a
worker without DP is one entry under its own id, with one port and no header, exactly as before. The
deployment objects (container and Service ports, NetworkPolicy) open every rank's port, and discovery reads
a worker's DP size from them. A worker spanning nodes runs its ranks on several pods (vLLM: node n runs ranks
n * dp/nodes onwards, each publishing at the port + its global rank on that node, while the leader's API server
takes any rank): a Service over all its pods lists every rank's port, and discovery subscribes to rank r on the
pod of node r // (dp/nodes) of the worker's group.
"""

from __future__ import annotations

import json

import httpx
import pytest

from runtime.config import DeploymentSpec, ModelRef, PoolSpec, RouterSpec
from runtime.deploy import workers
from runtime.deploy.discovery import (
    RANKS_PER_POD_LABEL, PoolMembership, kv_events_port_name, membership_from_slices,
)
from runtime.deploy.errors import ManifestError
from runtime.deploy.render import find, render_all
from runtime.deploy.target import ClusterTarget
from runtime.engines.client import DP_RANK_HEADER, VllmClient
from runtime.engines.kv_events import KvEventSubscriber, rank_endpoint
from runtime.kv.events import BlockStored, KvEventBatch
from runtime.server.discovery_sync import apply_membership, discovered_id
from runtime.server.pairing import RouteRequest
from runtime.server.routing import RouterPairing, WorkerEndpoint, rank_worker_id
from tests.infra_cluster import V
from tests.unit.test_deploy_discovery import eps

BS = 16
PROMPT = list(range(1000, 1000 + 40 * BS + 5))
P5 = ClusterTarget(instance_type="p5.48xlarge")


def _stored(tokens: list[int], rank: int | None = None) -> KvEventBatch:
    n = len(tokens) // BS
    return KvEventBatch(ts_s=0.0, events=(BlockStored(tuple(range(100, 100 + n)), None, tuple(tokens[: n * BS]), BS),),
                        data_parallel_rank=rank)


def _req(rid: str, tokens: list[int] = PROMPT) -> RouteRequest:
    return RouteRequest(rid, "/v1/completions", {"prompt": "ignored"}, tokens, 0.0)


def _pairing(decode_dp: int = 4, prefill_dp: int = 1, **spec_kw) -> RouterPairing:
    return RouterPairing(RouterSpec(**spec_kw), BS, [
        WorkerEndpoint("p0", "prefill", "http://10.0.0.1:8000", "tcp://10.0.0.1:5557", dp_size=prefill_dp),
        WorkerEndpoint("d0", "decode", "http://10.0.1.1:8000", "tcp://10.0.1.1:5557", dp_size=decode_dp),
    ], clock=lambda: 0.0)


# -- the router adapter -------------------------------------------------------------------------------------------
def test_every_rank_is_an_entry_of_its_own_subscribed_on_the_port_plus_its_rank():
    pairing = _pairing(decode_dp=4)
    assert set(pairing.router.workers) == {"p0", *(rank_worker_id("d0", r) for r in range(4))}
    assert pairing.kv_event_endpoints() == {
        "p0": "tcp://10.0.0.1:5557", **{rank_worker_id("d0", r): f"tcp://10.0.1.1:{5557 + r}" for r in range(4)}}
    assert set(pairing.workers) == {"p0", "d0"}  # the planner and actuators count workers, not ranks
    assert set(pairing.last_event_s) == set(pairing.kv_event_endpoints())  # each rank ages on its own


def test_a_request_goes_to_the_rank_whose_events_hold_its_prefix_and_names_that_rank():
    pairing = _pairing(decode_dp=4, disagg_min_uncached_tokens=10_000)  # decode pool prefills locally
    pairing.apply_batch(rank_worker_id("d0", 2), _stored(PROMPT, rank=2))
    route = pairing.choose(_req("r1"))
    assert route.decode_worker == rank_worker_id("d0", 2) and route.decode_dp_rank == 2
    assert route.decode_url == "http://10.0.1.1:8000" and route.overlap_blocks == 40
    # the other ranks hold nothing: another prompt goes to an idle rank, not to the busy one
    other = pairing.choose(_req("r2", list(range(50_000, 50_000 + 40 * BS))))
    assert other.decode_dp_rank in (0, 1, 3)


def test_a_worker_without_data_parallelism_is_one_entry_and_its_routes_name_no_rank():
    pairing = _pairing(decode_dp=1, prefill_dp=1, disagg_min_uncached_tokens=0)
    assert set(pairing.router.workers) == {"p0", "d0"}
    assert pairing.kv_event_endpoints() == {"p0": "tcp://10.0.0.1:5557", "d0": "tcp://10.0.1.1:5557"}
    pairing.apply_batch("p0", _stored(PROMPT, rank=0))  # vLLM labels rank 0's batches 0
    route = pairing.choose(_req("r1"))
    assert (route.prefill_worker, route.decode_worker) == ("p0", "d0")
    assert route.prefill_dp_rank is None and route.decode_dp_rank is None and route.overlap_blocks == 40


def test_a_remote_prefill_on_a_dp_prefill_worker_names_its_rank_and_the_fallback_keeps_the_decode_rank():
    pairing = _pairing(decode_dp=2, prefill_dp=2, disagg_min_uncached_tokens=0)
    pairing.apply_batch(rank_worker_id("p0", 1), _stored(PROMPT, rank=1))
    route = pairing.choose(_req("r1"))
    assert route.prefill_worker == rank_worker_id("p0", 1) and route.prefill_dp_rank == 1
    assert route.prefill_url == "http://10.0.0.1:8000" and route.decode_dp_rank in (0, 1)
    local = pairing.on_prefill_failed("r1", 0.0)
    assert local.prefill_url is None and local.prefill_dp_rank is None
    assert local.decode_dp_rank == route.decode_dp_rank


def test_a_batch_labelled_with_another_rank_is_not_indexed_under_the_subscription():
    pairing = _pairing(decode_dp=2, disagg_min_uncached_tokens=10_000)
    pairing.apply_batch(rank_worker_id("d0", 0), _stored(PROMPT, rank=1))  # rank 1's events on rank 0's port
    assert pairing.router.overlaps(pairing.router.hashes_for(PROMPT)) == {}
    pairing.apply_batch(rank_worker_id("d0", 1), _stored(PROMPT, rank=1))
    assert pairing.router.overlaps(pairing.router.hashes_for(PROMPT)) == {rank_worker_id("d0", 1): 40}


def test_health_removal_and_loads_are_per_worker_over_all_its_ranks():
    pairing = _pairing(decode_dp=2, disagg_min_uncached_tokens=10_000)
    routes = [pairing.choose(_req(f"r{i}", list(range(i * 10_000, i * 10_000 + 40 * BS)))) for i in range(2)]
    assert {r.decode_dp_rank for r in routes} == {0, 1}  # spread over the ranks by load
    load = pairing.load_of("http://10.0.1.1:8000")
    assert load.num_requests == 2 and load.worker_id == "d0"
    assert pairing.load_of_ip("10.0.1.1").num_requests == 2
    assert sorted(pairing.mark_down("http://10.0.1.1:8000")) == ["r0", "r1"]
    assert not any(w.available for rid, w in pairing.router.workers.items() if rid.startswith("d0/"))
    pairing.mark_up("http://10.0.1.1:8000")
    assert all(w.available for w in pairing.router.workers.values())
    assert sorted(pairing.remove_worker("d0")) == ["r0", "r1"]
    assert set(pairing.router.workers) == {"p0"} and set(pairing.last_event_s) == {"p0"}


def test_a_request_whose_dp_decode_worker_died_migrates_to_another_worker_not_a_sibling_rank():
    pairing = RouterPairing(RouterSpec(disagg_min_uncached_tokens=10_000), BS, [
        WorkerEndpoint("d0", "decode", "http://10.0.1.1:8000", "tcp://10.0.1.1:5557", dp_size=4),
        WorkerEndpoint("d1", "decode", "http://10.0.1.2:8000", "tcp://10.0.1.2:5557", dp_size=2),
    ], clock=lambda: 0.0)
    pairing.apply_batch(rank_worker_id("d0", 1), _stored(PROMPT, rank=1))
    pairing.apply_batch(rank_worker_id("d0", 2), _stored(PROMPT, rank=2))  # a sibling rank holds it too
    assert pairing.choose(_req("r1")).decode_worker in (rank_worker_id("d0", 1), rank_worker_id("d0", 2))
    new = pairing.on_decode_failed("r1", 0.0)  # d0's server is unreachable
    assert new.decode_url == "http://10.0.1.2:8000" and new.decode_dp_rank in (0, 1)
    assert pairing.on_decode_failed("unknown", 0.0) is None


def test_engine_load_per_rank_or_spread_over_the_ranks():
    pairing = _pairing(decode_dp=2, disagg_min_uncached_tokens=10_000)
    d0, d1 = (pairing.router.workers[rank_worker_id("d0", r)] for r in range(2))
    pairing.set_engine_load("http://10.0.1.1:8000", {0: 3.0, 1: 1.0})  # vLLM's gauges per `engine` label
    assert (d0.external_requests, d1.external_requests) == (3.0, 1.0)
    pairing.set_engine_load("http://10.0.1.1:8000", 4.0)  # the worker's total: spread evenly
    assert (d0.external_requests, d1.external_requests) == (2.0, 2.0)
    pairing.set_engine_load("http://10.0.1.1:8000", {0: 3.0})  # rank 1 unreadable
    assert (d0.external_requests, d1.external_requests) == (3.0, 0.0)


async def test_the_engine_load_loop_reads_a_dp_workers_gauges_per_engine():
    import asyncio

    from runtime.server.engine_load import engine_load_loop, read_engine_load

    pairing = _pairing(decode_dp=2)
    page_text = ('vllm:num_requests_running{model_name="m",engine="0"} 2\n'
                 'vllm:num_requests_running{model_name="m",engine="1"} 0\n'
                 'vllm:num_requests_waiting{model_name="m",engine="0"} 1\n'
                 'vllm:num_requests_waiting{model_name="m",engine="1"} 1\n')

    async def page(url: str) -> str:
        return page_text

    assert pairing.dp_size_of("http://10.0.1.1:8000") == 2 and pairing.dp_size_of("http://10.0.0.1:8000") == 1
    assert await read_engine_load(page, "http://10.0.1.1:8000", 1.0, dp_size=2) == {0: 3.0, 1: 1.0}
    assert await read_engine_load(page, "http://10.0.1.1:8000", 1.0) == 4.0  # one engine's worth: the sum
    from tests.unit.test_server_engine_load import _spy_engine_load

    applied = _spy_engine_load(pairing, {"http://10.0.1.1:8000"})
    task = asyncio.create_task(engine_load_loop(pairing, page, interval_s=0.01))
    await asyncio.wait_for(applied.wait(), 10)  # a round has passed the DP worker's loads on
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    loads = pairing.router.workers
    assert [loads[rank_worker_id("d0", r)].external_requests for r in range(2)] == [3.0, 1.0]


def test_rank_endpoints_follow_vllms_port_offset():
    assert rank_endpoint("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert rank_endpoint("tcp://[fd00::1]:5557", 3) == "tcp://[fd00::1]:5560"
    assert rank_endpoint("ipc:///tmp/kv.sock", 0) == "ipc:///tmp/kv.sock"
    with pytest.raises(ValueError, match="tcp://host:port"):
        rank_endpoint("ipc:///tmp/kv.sock", 1)  # vLLM refuses it too
    with pytest.raises(ValueError):
        WorkerEndpoint("w", "decode", "http://h:1", dp_size=0)


# -- the request to the worker ------------------------------------------------------------------------------------
async def test_the_requests_to_a_dp_worker_carry_the_chosen_rank_and_others_carry_none():
    pytest.importorskip("kserve")
    from kserve.protocol.rest.openai.types import CompletionRequest
    from prometheus_client import CollectorRegistry

    from runtime.server.metrics import RuntimeMetrics
    from runtime.server.model import PDModel

    calls: list[tuple[str, str | None, bool]] = []
    kv = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
          "remote_port": 1}

    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        calls.append((req.url.host, req.headers.get(DP_RANK_HEADER), bool(body.get("stream"))))
        answer = {"id": "c1", "object": "text_completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "text": "x", "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
        if body.get("stream"):
            chunk = {**answer, "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
            return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")
        return httpx.Response(200, json={**answer, "kv_transfer_params": kv if req.url.host == "10.0.0.1" else None})

    class Tokens:
        def token_ids(self, path: str, body: dict) -> list[int]:
            return PROMPT

    for prefill_dp, decode_dp in ((2, 4), (1, 1)):
        pairing = _pairing(decode_dp=decode_dp, prefill_dp=prefill_dp, disagg_min_uncached_tokens=0)
        if decode_dp > 1:
            pairing.apply_batch(rank_worker_id("d0", 3), _stored(PROMPT, rank=3))
            pairing.apply_batch(rank_worker_id("p0", 1), _stored(PROMPT, rank=1))
        transport = httpx.MockTransport(handler)
        model = PDModel("m", pairing, metrics=RuntimeMetrics(CollectorRegistry()),
                        client_factory=lambda url: VllmClient(url, transport=transport))
        model.tokenizer = Tokens()
        calls.clear()
        await model.create_completion(CompletionRequest(model="m", prompt="p", max_tokens=1))
        await model.create_completion(CompletionRequest(model="m", prompt="p", max_tokens=1, stream=True))
        got = [(h, r) for h, r, _ in calls]
        if decode_dp > 1:  # prefill on p0's rank 1, decode on d0's rank 3 (their caches hold the prompt)
            assert got == [("10.0.0.1", "1"), ("10.0.1.1", "3")] * 2
        else:
            assert got == [("10.0.0.1", None), ("10.0.1.1", None)] * 2
        assert [s for _, _, s in calls] == [False, False, False, True]


# -- discovery ----------------------------------------------------------------------------------------------------
def _slice_with_ranks(name: str, service: str, ip: str, ranks: int) -> dict:
    s = eps(name, service, {ip: True})
    s["ports"] += [{"name": kv_events_port_name(r), "port": 5557 + r, "protocol": "TCP"} for r in range(ranks)]
    return s


def test_discovery_reads_a_workers_dp_size_from_its_rank_ports():
    m = membership_from_slices([_slice_with_ranks("d", "dec", "10.0.1.1", 16),
                                _slice_with_ranks("p", "pre", "10.0.0.1", 1)],
                               roles={"dec": "decode", "pre": "prefill"})
    assert m.dp_size("http://10.0.1.1:8000") == 16 and m.dp_size("http://10.0.0.1:8000") == 1
    assert m.kv_events_endpoint("http://10.0.1.1:8000") == "tcp://10.0.1.1:5557"
    assert m.dp_sizes == (("http://10.0.1.1:8000", 16),)  # a worker without DP is not listed
    assert kv_events_port_name(0) == "kv-events" and kv_events_port_name(15) == "kv-events-15"


async def test_a_discovered_dp_worker_is_subscribed_on_every_rank_and_unsubscribed_with_them():
    pairing = RouterPairing(RouterSpec(policy="kv_aware"), BS, [], clock=lambda: 0.0)
    sub = KvEventSubscriber({}, pairing.apply_batch)
    sub.start()  # real SUB sockets; ZMQ connects lazily
    url = "http://10.0.1.1:8000"
    wid = discovered_id("decode", url)
    try:
        m = PoolMembership((), (url,), kv_events=((url, "tcp://10.0.1.1:5557"),), dp_sizes=((url, 4),))
        assert apply_membership(pairing, m, subscriber=sub) == ([wid], [])
        assert sub.endpoints == {rank_worker_id(wid, r): f"tcp://10.0.1.1:{5557 + r}" for r in range(4)}
        assert len(sub.active_workers) == 4 and set(pairing.workers) == {wid}
        assert apply_membership(pairing, m, subscriber=sub) == ([], [])  # unchanged: nothing reopened
        # the worker comes back with another DP size: re-added with its new ranks
        m2 = PoolMembership((), (url,), kv_events=m.kv_events, dp_sizes=((url, 2),))
        assert apply_membership(pairing, m2, subscriber=sub) == ([wid], [wid])
        assert set(sub.endpoints) == {rank_worker_id(wid, r) for r in range(2)}
        assert set(pairing.router.workers) == set(sub.endpoints)
        assert apply_membership(pairing, PoolMembership((), ()), subscriber=sub) == ([], [wid])
        assert sub.endpoints == {} and sub.active_workers == () and pairing.router.workers == {}
    finally:
        await sub.stop()


# -- deployment objects -------------------------------------------------------------------------------------------
def _render(decode: PoolSpec, target: ClusterTarget = P5) -> list[dict]:
    spec = DeploymentSpec(model=ModelRef(name="m", mla=True), gpu="H100-SXM", prefill=PoolSpec(tp=8, ep=True),
                          decode=decode)
    return render_all(spec, name="moe", namespace="pdserve", image="repo/pdserve:1", pvc_name="fsx-claim",
                      target=target)


def _kv_ports(ports: list[dict], key: str) -> dict[str, int]:
    return {p["name"]: p[key] for p in ports if p["name"].startswith("kv-events")}


def test_a_single_node_dp_worker_opens_every_ranks_kv_event_port():
    objs = _render(PoolSpec(tp=1, dp=8, ep=True))
    want = {kv_events_port_name(r): 5557 + r for r in range(8)}
    dec = find(objs, "Deployment", "moe-decode")["spec"]["template"]["spec"]["containers"][0]
    assert _kv_ports(dec["ports"], "containerPort") == want
    assert _kv_ports(find(objs, "Service", "moe-decode")["spec"]["ports"], "port") == want
    pre = find(objs, "Deployment", "moe-prefill")["spec"]["template"]["spec"]["containers"][0]
    assert _kv_ports(pre["ports"], "containerPort") == {"kv-events": 5557}  # no DP: one port, as before
    assert _kv_ports(find(objs, "Service", "moe-prefill")["spec"]["ports"], "port") == {"kv-events": 5557}
    policy = find(objs, "NetworkPolicy", "moe-workers")["spec"]["ingress"][1]["ports"]
    assert [p["port"] for p in policy] == ["http", *want]
    # the rendered Service is what discovery reads the DP size from
    svc_ports = find(objs, "Service", "moe-decode")["spec"]["ports"]
    m = membership_from_slices([{"metadata": {"labels": {"kubernetes.io/service-name": "moe-decode"}},
                                 "endpoints": [{"addresses": ["10.0.1.1"]}],
                                 "ports": [{"name": p["name"], "port": p["port"]} for p in svc_ports]}],
                               roles={"moe-decode": "decode"})
    assert m.dp_size("http://10.0.1.1:8000") == 8


def test_a_plain_deployment_keeps_its_single_kv_event_port():
    spec = DeploymentSpec(model=ModelRef(name="m"), gpu="H100-SXM", prefill=PoolSpec(tp=2), decode=PoolSpec(tp=2))
    objs = render_all(spec, name="m", namespace="pdserve", image="repo/pdserve:1", pvc_name="fsx-claim")
    policy = find(objs, "NetworkPolicy", "m-workers")["spec"]["ingress"][1]["ports"]
    assert [p["port"] for p in policy] == ["http", "kv-events"]
    for role in ("prefill", "decode"):
        assert _kv_ports(find(objs, "Service", f"m-{role}")["spec"]["ports"], "port") == {"kv-events": 5557}


def _controller_slices(service: dict, pods: dict[str, tuple[str, bool]]) -> dict:
    """The EndpointSlice the EndpointSlice controller makes of `service` over `pods` (name -> (IP, ready)):
    the Service's labels copied, its ports with their (numeric) target ports, each pod's targetRef."""
    meta = service["metadata"]
    return {"metadata": {"name": f"{meta['name']}-abc", "labels": {**meta.get("labels", {}),
                                                                  "kubernetes.io/service-name": meta["name"]}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}, "targetRef": {"kind": "Pod", "name": n}}
                          for n, (ip, ready) in pods.items()],
            "ports": [{"name": p["name"], "port": p["targetPort"] if isinstance(p["targetPort"], int) else p["port"],
                       "protocol": "TCP"} for p in service["spec"]["ports"]]}


def test_a_multi_node_dp_worker_opens_each_ranks_port_on_the_pod_that_runs_it():
    # vLLM: node n of a DP16 worker over 2 nodes runs ranks 8n … 8n+7, rank r publishing on kv_events_port + r
    # on that node; the leader's API server takes any rank's X-data-parallel-rank
    pool = PoolSpec(tp=1, dp=16, ep=True, nodes=2)
    assert workers.kv_event_ranks(pool) == 16 and workers.ranks_per_pod(pool) == 8
    assert workers.ranks_per_pod(PoolSpec(tp=8, pp=2, nodes=2)) == 1  # pipeline stages: rank 0 on the leader
    objs = _render(pool)
    assert _kv_ports(find(objs, "Service", "moe-decode-leaders")["spec"]["ports"], "port") == {}
    svc = find(objs, "Service", "moe-decode-leaders-kv-events")
    want = {kv_events_port_name(r): 5557 + r for r in range(16)}
    assert _kv_ports(svc["spec"]["ports"], "targetPort") == want
    assert svc["metadata"]["labels"][RANKS_PER_POD_LABEL] == "8"
    assert svc["spec"]["selector"] == workers.labels("moe", "decode", None)  # leaders and followers
    lwt = find(objs, "LeaderWorkerSet", "moe-decode")["spec"]["leaderWorkerTemplate"]
    leader, follower = (lwt[t]["spec"]["containers"][0]["ports"] for t in ("leaderTemplate", "workerTemplate"))
    assert _kv_ports(leader, "containerPort") == {kv_events_port_name(r): 5557 + r for r in range(8)}
    assert _kv_ports(follower, "containerPort") == {kv_events_port_name(r): 5557 + r for r in range(8, 16)}
    # the runtime may open a follower's rank ports (the policy names them; the follower declares them)
    policy = find(objs, "NetworkPolicy", "moe-workers")["spec"]["ingress"][1]["ports"]
    assert [p["port"] for p in policy] == ["http", *want]
    follower_pod = V.NetPod("follower", "pdserve", {**workers.labels("moe", "decode", None),
                                                    workers.WORKER_INDEX_LABEL: "1"},
                            {p["name"]: p["containerPort"] for p in follower})
    runtime = V.NetPod("runtime", "pdserve", {"serving.kserve.io/inferenceservice": "moe"}, {})
    assert V.flow_admitted(objs, V.Flow(runtime, follower_pod, 5557 + 12, True, "rank 12's KV events"))
    # what discovery makes of the slices of both Services: every rank on the pod that runs it
    leaders = _controller_slices(find(objs, "Service", "moe-decode-leaders"), {"moe-decode-0": ("10.0.1.1", True)})
    all_pods = _controller_slices(svc, {"moe-decode-0": ("10.0.1.1", True), "moe-decode-0-1": ("10.0.2.2", True)})
    m = membership_from_slices([leaders, all_pods], roles={"moe-decode-leaders": "decode"})
    url = "http://10.0.1.1:8000"
    assert m.decode == (url,) and m.dp_size(url) == 16 and m.kv_events_endpoint(url) == "tcp://10.0.1.1:5557"
    assert m.rank_endpoints(url) == tuple(f"tcp://10.0.{1 if r < 8 else 2}.{1 if r < 8 else 2}:{5557 + r}"
                                          for r in range(16))


def _group_slices(groups: dict[str, tuple[str, str | None]], dp: int, per_pod: str | None = "2") -> list[dict]:
    """Slices of "dec-leaders" (ready leaders) and "dec-leaders-kv-events" (every pod): `groups` maps a leader
    pod's name to (its IP, its follower's IP or None when the follower is not ready)."""
    leaders = eps("l", "dec-leaders", {ip: True for ip, _ in groups.values()})
    pods = eps("k", "dec-leaders-kv-events", {})
    for name, (ip, follower) in groups.items():
        pods["endpoints"].append({"addresses": [ip], "conditions": {"ready": True},
                                  "targetRef": {"kind": "Pod", "name": name}})
        if follower is not None:
            pods["endpoints"].append({"addresses": [follower], "conditions": {"ready": True},
                                      "targetRef": {"kind": "Pod", "name": f"{name}-1"}})
    pods["ports"] = [{"name": kv_events_port_name(r), "port": 5557 + r, "protocol": "TCP"} for r in range(dp)]
    if per_pod is not None:
        pods["metadata"]["labels"][RANKS_PER_POD_LABEL] = per_pod
    return [leaders, pods]


def test_discovery_finds_each_rank_of_a_multi_node_worker_on_the_pod_that_runs_it():
    roles = {"dec-leaders": "decode"}
    m = membership_from_slices(_group_slices({"w-0": ("10.0.1.1", "10.0.2.1"), "w-1": ("10.0.1.2", None)}, 4),
                               roles=roles)
    a, b = "http://10.0.1.1:8000", "http://10.0.1.2:8000"
    assert m.decode == (a, b) and m.dp_size(a) == m.dp_size(b) == 4
    assert m.rank_endpoints(a) == ("tcp://10.0.1.1:5557", "tcp://10.0.1.1:5558",
                                   "tcp://10.0.2.1:5559", "tcp://10.0.2.1:5560")
    # the follower of w-1 is not ready: its ranks have no endpoint (tracked approximately), the leader's have
    assert m.rank_endpoints(b) == ("tcp://10.0.1.2:5557", "tcp://10.0.1.2:5558", None, None)
    assert m.kv_events == ((a, "tcp://10.0.1.1:5557"), (b, "tcp://10.0.1.2:5557"))
    # a slice without the label: the pods of ranks past 0 are unknown, so they get no endpoint (not the leader's,
    # where nothing publishes them)
    m = membership_from_slices(_group_slices({"w-0": ("10.0.1.1", "10.0.2.1")}, 2, per_pod=None), roles=roles)
    assert m.rank_endpoints(a) == ("tcp://10.0.1.1:5557", None)
    # without a KV-event port name nothing is read from the KV-event Service
    m = membership_from_slices(_group_slices({"w-0": ("10.0.1.1", "10.0.2.1")}, 4), roles=roles,
                               kv_events_port_name=None)
    assert (m.decode, m.kv_events, m.dp_sizes, m.rank_kv_events) == ((a,), (), (), ())
    # a single-node worker keeps its endpoint's port + rank
    assert membership_from_slices([_slice_with_ranks("d", "dec", "10.0.1.1", 4)],
                                  roles={"dec": "decode"}).rank_endpoints(a) == ()


async def test_a_multi_node_dp_workers_ranks_are_subscribed_on_their_pods_and_follow_them():
    pairing = RouterPairing(RouterSpec(policy="kv_aware"), BS, [], clock=lambda: 0.0)
    sub = KvEventSubscriber({}, pairing.apply_batch)
    sub.start()  # real SUB sockets; ZMQ connects lazily
    url = "http://10.0.1.1:8000"
    wid = discovered_id("decode", url)
    rid = [rank_worker_id(wid, r) for r in range(4)]
    try:
        half = membership_from_slices(_group_slices({"w-0": ("10.0.1.1", None)}, 4), roles={"dec-leaders": "decode"})
        assert apply_membership(pairing, half, subscriber=sub) == ([wid], [])
        assert sub.endpoints == {rid[0]: "tcp://10.0.1.1:5557", rid[1]: "tcp://10.0.1.1:5558"}
        assert [pairing.router.workers[r].kv_events for r in rid] == [True, True, False, False]
        assert apply_membership(pairing, half, subscriber=sub) == ([], [])  # unchanged: nothing reopened
        # the follower is listed: the worker is added again with every rank on its pod
        whole = membership_from_slices(_group_slices({"w-0": ("10.0.1.1", "10.0.2.1")}, 4),
                                       roles={"dec-leaders": "decode"})
        assert apply_membership(pairing, whole, subscriber=sub) == ([wid], [wid])
        assert sub.endpoints == {r: ep for r, ep in zip(rid, whole.rank_endpoints(url))}
        assert sub.endpoints[rid[3]] == "tcp://10.0.2.1:5560"
        assert all(pairing.router.workers[r].kv_events for r in rid)
        assert pairing.kv_event_endpoints() == sub.endpoints
        assert apply_membership(pairing, PoolMembership((), ()), subscriber=sub) == ([], [wid])
        assert sub.endpoints == {} and pairing.router.workers == {}
    finally:
        await sub.stop()


def test_rank_endpoints_must_match_the_dp_size():
    with pytest.raises(ValueError, match="3 rank endpoints for dp_size 4"):
        WorkerEndpoint("d0", "decode", "http://10.0.1.1:8000", dp_size=4, rank_endpoints=("tcp://a:1",) * 3)
    w = WorkerEndpoint("d0", "decode", "http://10.0.1.1:8000", dp_size=2, rank_endpoints=(None, "tcp://b:5558"))
    assert w.publishes_kv_events() and w.kv_event_subscriptions() == {rank_worker_id("d0", 1): "tcp://b:5558"}


@pytest.mark.parametrize("field,port", [("worker_port", 5560), ("nixl_side_channel_port", 5564)])
def test_a_rank_port_that_is_another_worker_port_is_refused(field, port):
    with pytest.raises(ManifestError, match=f"target.{field}: {port} is the KV-event port of data-parallel rank"):
        _render(PoolSpec(tp=1, dp=8, ep=True), ClusterTarget(instance_type="p5.48xlarge", **{field: port}))
    with pytest.raises(ManifestError, match="last data-parallel rank"):
        _render(PoolSpec(tp=1, dp=8, ep=True), ClusterTarget(instance_type="p5.48xlarge", kv_events_port=65530))


# -- static workers (--prefill-url / --decode-url): the DP size on the command line ------------------------------

def test_a_static_workers_dp_size_makes_one_subscribed_entry_per_rank():
    from runtime.server.app import build_router_pairing

    pairing = build_router_pairing(RouterSpec(), block_size_tokens=BS,
                                   prefill_urls=["http://10.0.0.1:8000"], decode_urls=["http://10.0.1.1:8000",
                                                                                       "http://10.0.1.2:8000"],
                                   prefill_kv_events=["tcp://10.0.0.1:5557"],
                                   decode_kv_events=["tcp://10.0.1.1:5557", "tcp://10.0.1.2:5557"],
                                   decode_dp_sizes=[2])
    assert pairing.kv_event_endpoints() == {
        "prefill-0": "tcp://10.0.0.1:5557",
        rank_worker_id("decode-0", 0): "tcp://10.0.1.1:5557", rank_worker_id("decode-0", 1): "tcp://10.0.1.1:5558",
        "decode-1": "tcp://10.0.1.2:5557"}
    # rank 1's events reach rank 1's index entry, and a request with its prefix is pinned to that rank
    pairing.apply_batch(rank_worker_id("decode-0", 1), _stored(PROMPT, rank=1))
    route = pairing.choose(_req("r1"))
    assert (route.decode_url, route.decode_dp_rank) == ("http://10.0.1.1:8000", 1)
    with pytest.raises(ValueError, match="decode_dp_sizes: 3 sizes for 2 decode workers"):
        build_router_pairing(RouterSpec(), block_size_tokens=BS, prefill_urls=[], decode_urls=["http://a:1", "http://b:1"],
                             decode_dp_sizes=[1, 2, 2])


@pytest.mark.parametrize("extra,message", [
    (["--decode-dp-size", "2"], "--decode-dp-size routes to each data-parallel rank by its KV cache: it needs "
                                "--router kv"),
    (["--router", "kv", "--tokenizer-dir", "/m", "--prefill-dp-size", "2", "--prefill-dp-size", "2"],
     "--prefill-dp-size is given 2 times for 1 --prefill-url"),
    (["--router", "kv", "--decode-dp-size", "0"], "--decode-dp-size"),
])
def test_static_dp_sizes_are_checked_at_parse_time(extra, message, capsys):
    from runtime.server.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model-name", "m", "--prefill-url", "http://p:1", "--decode-url", "http://d:1", *extra])
    assert message in capsys.readouterr().err


def test_kubernetes_discovery_refuses_static_dp_sizes():
    from runtime.server.__main__ import discovery_settings, parse_args

    args = parse_args(["--model-name", "m", "--discovery", "kubernetes", "--prefill-service", "p",
                       "--decode-service", "d", "--router", "kv", "--tokenizer-dir", "/m", "--decode-dp-size", "2"])
    with pytest.raises(SystemExit, match="take.*data-parallel size from its Service"):
        discovery_settings(args)
