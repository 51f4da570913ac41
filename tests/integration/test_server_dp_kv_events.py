"""KV events of a data-parallel worker over real ZMQ sockets on 127.0.0.1.

Specification: a worker with `--data-parallel-size N` publishes rank r's KV events on its configured port + r
(vLLM's `ZmqEventPublisher.offset_endpoint_port`), each batch labelled `data_parallel_rank` r. The runtime
subscribes to every rank's port; the blocks rank r stores are indexed under rank r only, so a prompt they
hold is routed to that rank of the worker, and the route names it (the request's `X-data-parallel-rank`).
"""

from __future__ import annotations

import msgspec
import pytest

from runtime.config import RouterSpec
from runtime.engines.kv_events import KvEventSubscriber
from runtime.engines.vllm_worker import free_port
from runtime.server.pairing import RouteRequest
from runtime.server.routing import RouterPairing, WorkerEndpoint, rank_worker_id
from tests.integration.zmq_publisher import bound_publisher, wait_for

pytestmark = pytest.mark.integration
zmq = pytest.importorskip("zmq")

BLOCK = 16
PROMPT = list(range(500, 500 + 20 * BLOCK))


def _rank_frame(seq: int, rank: int, token_ids: list[int]) -> list[bytes]:
    """One message as vLLM 0.28's ZmqEventPublisher of DP rank `rank` sends it: `[ts, events, rank]`."""
    n = len(token_ids) // BLOCK
    payload = msgspec.msgpack.encode([float(seq), [
        {"type": "BlockStored", "block_hashes": [7_000 + rank * 100 + i for i in range(n)], "parent_block_hash": None,
         "token_ids": token_ids[: n * BLOCK], "block_size": BLOCK, "lora_id": None, "medium": "GPU",
         "lora_name": None}], rank])
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


def _two_consecutive_publishers():
    for _ in range(20):
        base = free_port()
        try:
            first = bound_publisher(base)
        except zmq.ZMQError:
            continue
        try:
            return base, first, bound_publisher(base + 1)
        except zmq.ZMQError:
            first[2]()
    pytest.skip("no two consecutive free ports on 127.0.0.1")


async def test_each_ranks_events_reach_its_own_entry_and_route_requests_to_that_rank():
    base, (pub0, _, close0), (pub1, _, close1) = _two_consecutive_publishers()
    pairing = RouterPairing(RouterSpec(policy="kv_aware", disagg_min_uncached_tokens=10_000), BLOCK, [
        WorkerEndpoint("d0", "decode", "http://127.0.0.1:1", f"tcp://127.0.0.1:{base}", dp_size=2)])
    sub = KvEventSubscriber(pairing.kv_event_endpoints(), pairing.apply_batch)
    sub.start()
    hashes = pairing.router.hashes_for(PROMPT)
    try:
        seq = 0
        while not pairing.router.overlaps(hashes):  # SUB sockets join late: publish until one batch lands
            await pub1.send_multipart(_rank_frame(seq, 1, PROMPT))
            seq += 1
            try:
                await wait_for(lambda: bool(pairing.router.overlaps(hashes)), "rank 1's batch", timeout_s=0.2)
            except AssertionError:
                assert seq < 100, "rank 1's events never reached the router"
        assert pairing.router.overlaps(hashes) == {rank_worker_id("d0", 1): 20}
        route = pairing.choose(RouteRequest("r1", "/v1/completions", {}, PROMPT, 0.0))
        assert route.decode_dp_rank == 1 and route.decode_url == "http://127.0.0.1:1"
        assert sub.stats.num_batches.get(rank_worker_id("d0", 0)) is None  # rank 0 sent nothing
        await pub0.send_multipart(_rank_frame(0, 0, PROMPT))
        await wait_for(lambda: len(pairing.router.overlaps(hashes)) == 2, "rank 0's batch")
    finally:
        await sub.stop()
        close0()
        close1()
