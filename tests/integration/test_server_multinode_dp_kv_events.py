"""KV events of a data-parallel worker spanning two nodes, found through discovery, over real ZMQ sockets.

Specification: vLLM runs a multi-node DP worker's ranks on several pods (node n runs ranks n * L … n * L + L - 1,
L = dp / nodes), each rank publishing its KV events on the pod that runs it, at the configured port + its global
rank; only the leader serves HTTP, and its API server takes any rank's `X-data-parallel-rank`. The worker's
pool has a Service over all its pods (runtime/deploy/workers.py `kv_events_service`) listing every rank's port
and L (label `RANKS_PER_POD_LABEL`); the LeaderWorkerSet names a group's pods `<group>` (the leader) and
`<group>-<n>`. So the runtime subscribes to rank r on the pod of node r // L: what a follower's rank stores is
indexed under that rank, and a request for that prefix is routed to the leader's URL naming the rank.

The Kubernetes API is the EndpointSlice stand-in of tests/unit/test_deploy_discovery.py; the two pods are two
loopback addresses, 127.0.0.1 (leader) and 127.0.0.2 (follower).
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from runtime.config import RouterSpec
from runtime.deploy.discovery import RANKS_PER_POD_LABEL, EndpointSliceDiscovery, kv_events_port_name
from runtime.engines.kv_events import KvEventSubscriber
from runtime.engines.vllm_worker import free_port
from runtime.server.app import build_router_pairing
from runtime.server.discovery_sync import discovered_id, follow_discovery
from runtime.server.pairing import RouteRequest
from runtime.server.routing import rank_worker_id
from tests.integration.test_server_discovery_kv_events import QueuedWatchApi
from tests.integration.zmq_publisher import wait_for
from tests.unit.test_deploy_discovery import NS, eps

pytestmark = pytest.mark.integration
zmq = pytest.importorskip("zmq")

BLOCK = 16
# QueuedWatchApi's Services: the decode pool's ("smollm2-decode", its leaders) and its KV-event Service
PREFILL, DECODE = "smollm2-prefill", "smollm2-decode"
DP, PER_POD = 4, 2
LEADER, FOLLOWER = "127.0.0.1", "127.0.0.2"


def _publisher(host: str, port: int):
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError:
        pub.close(0)
        ctx.term()
        raise

    def close() -> None:
        pub.close(0)
        ctx.term()

    return pub, close


def _rank_frame(seq: int, rank: int, token_ids: list[int]) -> list[bytes]:
    """One message of DP rank `rank`'s ZmqEventPublisher (vLLM 0.28): `[ts, events, rank]`."""
    n = len(token_ids) // BLOCK
    payload = msgspec.msgpack.encode([float(seq), [
        {"type": "BlockStored", "block_hashes": [9_000 + rank * 100 + i for i in range(n)], "parent_block_hash": None,
         "token_ids": token_ids[: n * BLOCK], "block_size": BLOCK, "lora_id": None, "medium": "GPU",
         "lora_name": None}], rank])
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


def _kv_events_slice(base: int, pods: dict[str, str], rv: str) -> dict:
    """The KV-event Service's slice as the EndpointSlice controller writes it: every pod (name -> IP), every
    rank's port, the Service's labels."""
    s = eps("dec-kv", f"{DECODE}-kv-events", {}, rv=rv)
    s["metadata"]["labels"][RANKS_PER_POD_LABEL] = str(PER_POD)
    s["endpoints"] = [{"addresses": [ip], "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": n}}
                      for n, ip in pods.items()]
    s["ports"] = [{"name": kv_events_port_name(r), "port": base + r, "protocol": "TCP"} for r in range(DP)]
    return s


async def test_a_followers_rank_is_subscribed_on_its_pod_and_routes_requests_to_that_rank():
    for _ in range(20):  # rank 3 publishes on the follower at the base port + 3
        base = free_port()
        try:
            pub3, close3 = _publisher(FOLLOWER, base + 3)
            break
        except zmq.ZMQError:
            continue
    else:
        pytest.skip("no free port on 127.0.0.2")
    leaders = eps("dec-l", DECODE, {LEADER: True})  # the leaders Service: HTTP only, no KV-event port
    api = QueuedWatchApi([leaders, _kv_events_slice(base, {"w-0": LEADER}, rv="1")])
    client = httpx.AsyncClient(base_url="https://k8s.test", transport=httpx.MockTransport(api))
    discovery = EndpointSliceDiscovery(namespace=NS, prefill_service=PREFILL, decode_service=DECODE, client=client)
    pairing = build_router_pairing(RouterSpec(policy="kv_aware", disagg_min_uncached_tokens=10_000),
                                   block_size_tokens=BLOCK, prefill_urls=[], decode_urls=[])
    sub = KvEventSubscriber({}, pairing.apply_batch)
    sub.start()
    follow = asyncio.create_task(follow_discovery(discovery, pairing, subscriber=sub))
    url = f"http://{LEADER}:8000"
    wid = discovered_id("decode", url)
    rid = [rank_worker_id(wid, r) for r in range(DP)]
    prompt = list(range(3000, 3000 + 6 * BLOCK))
    hashes = pairing.router.hashes_for(prompt)
    try:
        await wait_for(lambda: wid in pairing.workers, "the leader")
        # the follower is not listed yet: the leader's ranks are subscribed, the follower's tracked approximately
        assert sub.endpoints == {rid[0]: f"tcp://{LEADER}:{base}", rid[1]: f"tcp://{LEADER}:{base + 1}"}
        assert [pairing.router.workers[r].kv_events for r in rid] == [True, True, False, False]

        api.watch_events.put_nowait({"type": "MODIFIED", "object": _kv_events_slice(
            base, {"w-0": LEADER, "w-0-1": FOLLOWER}, rv="2")})
        await wait_for(lambda: rid[3] in sub.endpoints, "the follower's ranks")
        assert sub.endpoints[rid[2]] == f"tcp://{FOLLOWER}:{base + 2}"
        assert sub.endpoints[rid[3]] == f"tcp://{FOLLOWER}:{base + 3}"

        seq = 0
        while not pairing.router.overlaps(hashes):  # SUB sockets join late: publish until one batch lands
            await pub3.send_multipart(_rank_frame(seq, 3, prompt))
            seq += 1
            await asyncio.sleep(0.05)
            assert seq < 200, "rank 3's events never reached the router"
        assert pairing.router.overlaps(hashes) == {rid[3]: 6}
        route = pairing.choose(RouteRequest("r1", "/v1/completions", {}, prompt, 0.0))
        # the request goes to the leader's API server, pinned to the follower's rank
        assert (route.decode_url, route.decode_worker, route.decode_dp_rank) == (url, rid[3], 3)
    finally:
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)
        await sub.stop()
        close3()
        await client.aclose()
