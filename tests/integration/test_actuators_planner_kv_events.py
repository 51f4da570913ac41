"""`--planner local` with the KV-aware router: workers the planner starts publish KV events, and the
runtime routes on them (real worker processes stand in for vLLM, a real ZMQ publisher on 127.0.0.1 sends
vLLM-framed KV events for the started prefill worker).

Specification: a worker the planner starts joins the router's pool as a KV-event (precise) worker and is
subscribed at its `kv_events_endpoint`; the blocks it publishes fill the router's index, so a prompt with
those blocks is routed to it with that overlap; when the planner stops it, its subscription is closed
before it leaves the pool and its blocks are gone. Without a subscriber (round-robin pairing) the same
worker joins as an approximate one.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, RouterSpec
from runtime.engines.kv_events import KvEventSubscriber
from runtime.engines.vllm_worker import free_port
from runtime.planner.types import ScalingDecision
from runtime.server.app import build_router_pairing
from runtime.server.pairing import RouteRequest
from runtime.server.planner_loop import RequestWindow
from runtime.server.planner_runtime import build_planner
from tests.integration.standin_worker import TinyWorker
from tests.integration.test_actuators_planner_runtime import _answers
from tests.integration.test_server_discovery_kv_events import BLOCK, vllm_frame
from tests.integration.zmq_publisher import bound_publisher

pytestmark = pytest.mark.integration
zmq = pytest.importorskip("zmq")


class PublishingWorker(TinyWorker):
    """A stand-in worker that names a KV-event endpoint, as WorkerProcess(enable_kv_events=True) does."""

    def __init__(self, role: str, index: int, kv_events_endpoint: str) -> None:
        super().__init__(role, index)
        self.kv_events_endpoint = kv_events_endpoint


def _decision(p: int, d: int) -> ScalingDecision:
    return ScalingDecision(now_s=0.0, prefill_replicas=p, decode_replicas=d)


@pytest.mark.parametrize("with_subscriber", [True, False])
def test_planner_started_workers_are_routed_on_their_kv_events(with_subscriber: bool) -> None:
    kv_port = free_port()
    endpoint = f"tcp://127.0.0.1:{kv_port}"
    made: list[PublishingWorker] = []

    def factory(role, index):
        made.append(PublishingWorker(role, index, endpoint))
        return made[-1]

    spec = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(mode="load"))
    pairing = build_router_pairing(RouterSpec(policy="kv_aware", disagg_min_uncached_tokens=0),
                                   block_size_tokens=BLOCK, prefill_urls=[], decode_urls=["http://127.0.0.1:1"])
    rt = build_planner("local", spec=spec, model_config=None, pairing=pairing, window=RequestWindow(),
                       registry=CollectorRegistry(), is_healthy=_answers, max_workers=1, worker_factory=factory)
    prompt = list(range(500, 500 + 4 * BLOCK + 5))  # 4 full blocks + a partial one
    hashes = pairing.router.hashes_for(prompt)

    async def scenario() -> None:
        pub, _, close_pub = bound_publisher(kv_port)
        sub = KvEventSubscriber({}, pairing.apply_batch)
        sub.start()
        if with_subscriber:
            rt.subscriber = sub
        try:
            rt.loop.actuator.apply(_decision(1, 1))  # one extra prefill worker
            deadline = time.monotonic() + 30
            while len(pairing.workers) < 2 and time.monotonic() < deadline:
                await rt.sync_pool()
                await asyncio.sleep(0.1)
            wid = next(w for w, e in pairing.workers.items() if e.role == "prefill")
            assert pairing.router.workers[wid].kv_events is with_subscriber
            if not with_subscriber:
                assert sub.active_workers == () and pairing.workers[wid].kv_events_endpoint is None
                return
            assert sub.active_workers == (wid,) and sub.endpoints[wid] == endpoint
            seq = 0
            while pairing.router.overlaps(hashes).get(wid, 0) < 4:  # resent until the SUB has joined
                await pub.send_multipart(vllm_frame(seq, prompt))
                seq += 1
                await asyncio.sleep(0.05)
                assert seq < 200, "the router never received the started worker's KV events"
            route = pairing.choose(RouteRequest("r1", "/v1/completions", {}, prompt, 0.0))
            assert (route.prefill_worker, route.overlap_blocks) == (wid, 4)
            assert route.prefill_url == made[0].base_url
            pairing.on_complete("r1", 0.0, True)

            rt.loop.actuator.apply(_decision(0, 1))  # back to the base: the worker stops ...
            sock = sub._socks[wid]
            await rt.sync_pool()  # ... is unsubscribed and leaves the pool with its blocks
            assert wid not in pairing.workers and sub.active_workers == () and sock.closed
            assert pairing.router.overlaps(hashes) == {}
            for i in range(3):
                await pub.send_multipart(vllm_frame(seq + i, prompt))
            await asyncio.sleep(0.3)
            assert pairing.router.overlaps(hashes) == {}
        finally:
            await sub.stop()
            close_pub()

    try:
        asyncio.run(scenario())
        assert len(made) == 1
    finally:
        rt.close()
    assert not any(w.alive() for w in made)
