"""KV events of workers found through discovery (issues #3/#7 follow-up), with a real ZMQ publisher on 127.0.0.1.

Specification: a worker pod that appears in its Service's EndpointSlice with a `kv-events` port is
subscribed to at `tcp://<pod IP>:<port>`; the KV events it publishes (vLLM's framing: multipart
`[topic, 8-byte big-endian sequence number, msgpack EventBatch]`) fill the router's index, so a prompt
whose blocks it stored is routed to it with that overlap. When the pod leaves the slice its subscription
is closed, its blocks leave the index, and what it still publishes never reaches the router again.

The Kubernetes API is the EndpointSlice stand-in of tests/unit/test_deploy_discovery.py (httpx transport
answering list and watch like the API server), here with a watch stream the test feeds step by step.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest

from runtime.config import RouterSpec
from runtime.deploy.discovery import EndpointSliceDiscovery, PoolMembership
from runtime.engines.kv_events import KvEventSubscriber
from runtime.engines.vllm_worker import free_port
from runtime.server.app import build_router_pairing
from runtime.server.discovery_sync import discovered_id, follow_discovery
from runtime.server.pairing import RouteRequest
from tests.unit.test_deploy_discovery import NS, PATH, eps
from tests.integration.zmq_publisher import bound_publisher, wait_for

pytestmark = pytest.mark.integration
zmq = pytest.importorskip("zmq")

BLOCK = 16
PREFILL, DECODE = "smollm2-prefill", "smollm2-decode"


class QueuedWatchApi:
    """EndpointSlice list from `slices`; every watch streams the events put on `watch_events` (a queue)."""

    def __init__(self, slices: list[dict]) -> None:
        self.slices = slices
        self.watch_events: asyncio.Queue[dict] = asyncio.Queue()
        self.num_watches = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == PATH
        assert request.url.params["labelSelector"] == (f"kubernetes.io/service-name in ({DECODE},{DECODE}-kv-events,"
                                                       f"{PREFILL},{PREFILL}-kv-events)")
        if request.url.params.get("watch") != "1":
            return httpx.Response(200, json={"kind": "EndpointSliceList", "metadata": {"resourceVersion": "10"},
                                             "items": self.slices})
        self.num_watches += 1

        async def lines():
            while True:
                yield (json.dumps(await self.watch_events.get()) + "\n").encode()

        return httpx.Response(200, content=lines())


def slice_with_events(name: str, service: str, ips: dict[str, bool], kv_port: int, rv: str) -> dict:
    s = eps(name, service, ips, rv=rv)
    s["ports"].append({"name": "kv-events", "port": kv_port, "protocol": "TCP"})
    return s


def vllm_frame(seq: int, token_ids: list[int]) -> list[bytes]:
    """One message as vLLM 0.28's ZmqEventPublisher sends it: a BlockStored of every full block of
    `token_ids` (engine hashes of its own, chained by parent_block_hash), then a no-op BlockRemoved of an
    unknown hash."""
    n = len(token_ids) // BLOCK
    engine_hashes = [10_000 + seq * 100 + i for i in range(n)]
    payload = msgspec.msgpack.encode([float(seq), [
        {"type": "BlockStored", "block_hashes": engine_hashes, "parent_block_hash": None,
         "token_ids": token_ids[: n * BLOCK], "block_size": BLOCK, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [999_999], "medium": "GPU"},
    ], None])
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


async def test_a_discovered_workers_kv_events_reach_the_router_until_it_leaves():

    kv_port = free_port()
    pub, _, close_pub = bound_publisher(kv_port)

    # at first: one decode pod and one prefill pod that publishes nothing (no kv-events port)
    api = QueuedWatchApi([eps("d-1", DECODE, {"127.0.0.9": True}), eps("p-0", PREFILL, {"127.0.0.8": True})])
    client = httpx.AsyncClient(base_url="https://k8s.test", transport=httpx.MockTransport(api))
    discovery = EndpointSliceDiscovery(namespace=NS, prefill_service=PREFILL, decode_service=DECODE, client=client)
    pairing = build_router_pairing(RouterSpec(policy="kv_aware", disagg_min_uncached_tokens=0),
                                   block_size_tokens=BLOCK, prefill_urls=[], decode_urls=[])
    sub = KvEventSubscriber({}, pairing.apply_batch)
    sub.start()
    memberships: list[PoolMembership] = []
    follow = asyncio.create_task(follow_discovery(discovery, pairing, memberships.append, subscriber=sub))
    wid = discovered_id("prefill", "http://127.0.0.1:8000")
    prompt = list(range(1000, 1000 + 5 * BLOCK + 3))  # 5 full blocks + a partial one
    hashes = pairing.router.hashes_for(prompt)
    try:
        await wait_for(lambda: len(memberships) == 1 and api.num_watches == 1, "the initial list")
        assert sub.active_workers == ()  # nobody publishes yet

        # a prefill pod with a kv-events port becomes ready
        api.watch_events.put_nowait({"type": "ADDED", "object": slice_with_events(
            "p-1", PREFILL, {"127.0.0.1": True}, kv_port, rv="11")})
        await wait_for(lambda: wid in pairing.workers, "the new worker")
        assert sub.endpoints[wid] == f"tcp://127.0.0.1:{kv_port}" and sub.active_workers == (wid,)
        assert pairing.router.workers[wid].kv_events is True

        # it publishes the prompt's blocks (resent until the SUB socket has joined: ZMQ's slow joiner)
        seq = 0
        while pairing.router.overlaps(hashes).get(wid, 0) < 5:
            await pub.send_multipart(vllm_frame(seq, prompt))
            seq += 1
            await asyncio.sleep(0.05)
            assert seq < 200, "the router never received the worker's KV events"
        assert pairing.router.overlaps(hashes) == {wid: 5}  # the other prefill pod holds nothing
        route = pairing.choose(RouteRequest("r1", "/v1/completions", {}, prompt, 0.0))
        assert (route.prefill_worker, route.overlap_blocks) == (wid, 5)
        assert route.prefill_url == "http://127.0.0.1:8000"
        pairing.on_complete("r1", 0.0, True)
        assert sub.stats.num_batches[wid] >= 1

        # the pod is deleted: subscription closed, blocks gone, later events ignored
        sock = sub._socks[wid]
        api.watch_events.put_nowait({"type": "DELETED", "object": slice_with_events(
            "p-1", PREFILL, {}, kv_port, rv="12")})
        await wait_for(lambda: wid not in pairing.workers, "the worker to leave")
        assert sub.active_workers == () and wid not in sub.endpoints and sock.closed
        assert wid not in sub.stats.num_batches
        assert pairing.router.overlaps(hashes) == {}
        for i in range(5):
            await pub.send_multipart(vllm_frame(seq + i, prompt))
        await asyncio.sleep(0.3)
        assert pairing.router.overlaps(hashes) == {} and wid not in sub.stats.num_batches
        route = pairing.choose(RouteRequest("r2", "/v1/completions", {}, prompt, 0.0))
        assert route.prefill_url == "http://127.0.0.8:8000" and route.overlap_blocks == 0
        assert [m.kv_events for m in memberships] == [
            (), (("http://127.0.0.1:8000", f"tcp://127.0.0.1:{kv_port}"),), ()]
    finally:
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)
        await sub.stop()
        await client.aclose()
        close_pub()
    assert sub.active_workers == ()


class ServingUntilStopped:
    """The REST-server side of run_server: `start` serves until `stop`. (KServe's FastAPI app is one global
    per process and can start only once, so the real one runs in a subprocess in test_server_openai.py.)"""

    def __init__(self) -> None:
        self.stopped = asyncio.Event()

    async def start(self) -> None:
        await self.stopped.wait()


@pytest.mark.parametrize("kv_router", [True, False])
async def test_the_runtime_subscribes_discovered_workers_only_with_the_kv_router(kv_router):
    """run_server's wiring: with the KV-aware router the discovered worker's events fill the index; without
    it the worker stays approximate and its events are not subscribed to."""
    from prometheus_client import CollectorRegistry

    from runtime.server.app import build_model, run_server

    kv_port = free_port()
    pub, _, close_pub = bound_publisher(kv_port)
    api = QueuedWatchApi([slice_with_events("d-1", DECODE, {"127.0.0.1": True}, kv_port, rv="9")])
    client = httpx.AsyncClient(base_url="https://k8s.test", transport=httpx.MockTransport(api))
    discovery = EndpointSliceDiscovery(namespace=NS, prefill_service=PREFILL, decode_service=DECODE, client=client)
    pairing = build_router_pairing(RouterSpec(policy="kv_aware"), block_size_tokens=BLOCK, prefill_urls=[],
                                   decode_urls=[])
    model = build_model("m", prefill_urls=[], decode_urls=[], pairing=pairing, registry=CollectorRegistry())
    rest = ServingUntilStopped()
    server = asyncio.create_task(run_server(rest, model, health_interval_s=60, discovery=discovery,
                                            discovered_kv_events=kv_router))
    wid = discovered_id("decode", "http://127.0.0.1:8000")
    prompt = list(range(3 * BLOCK))
    hashes = pairing.router.hashes_for(prompt)
    try:
        await wait_for(lambda: wid in pairing.workers, "the discovered worker")
        assert pairing.kv_event_endpoints() == ({wid: f"tcp://127.0.0.1:{kv_port}"} if kv_router else {})
        assert pairing.router.workers[wid].kv_events is kv_router
        for seq in range(200 if kv_router else 10):
            await pub.send_multipart(vllm_frame(seq, prompt))
            await asyncio.sleep(0.05)
            if pairing.router.overlaps(hashes):
                break
        assert pairing.router.overlaps(hashes) == ({wid: 3} if kv_router else {})
    finally:
        rest.stopped.set()
        await asyncio.wait_for(server, timeout=10)  # stops the discovery task and the subscriber
        await client.aclose()
        close_pub()
