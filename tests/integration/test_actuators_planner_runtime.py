"""`--planner local` inside the runtime: the LocalActuator's workers join and leave the router's pool
(runtime.server.planner_runtime), with real worker processes on 127.0.0.1 (python -m http.server stands in
for vLLM: the pool sync needs only a process and an answering health URL).

Specification: the configured decode worker is the base; a decision for more replicas starts the extra
workers, each joins the router's pool once it answers, the router then routes to them; a decision back to
the base drains them: out of the rotation at once (the runtime's circuit-breaker rotation), still in the
pool and alive while the router holds a request on them (a prefill worker: a request it prefilled that has
not completed, whose KV handoff may be unread), out of the pool and stopped once it holds none; closing the
planner stops every worker it started.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from runtime.config import DeploymentSpec, ModelRef, OverloadSpec, PlannerSpec, RouterSpec
from runtime.planner.types import ScalingDecision
from runtime.server.app import build_router_pairing
from runtime.server.breakers import WorkerBreakers
from runtime.server.pairing import RouteRequest
from runtime.server.planner_loop import RequestWindow
from runtime.server.planner_runtime import build_planner
from tests.integration.standin_worker import TinyWorker

pytestmark = pytest.mark.integration


async def _answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=1.0) as c:
            return (await c.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


def _decision(p: int, d: int) -> ScalingDecision:
    return ScalingDecision(now_s=0.0, prefill_replicas=p, decode_replicas=d)


def test_local_planner_workers_join_and_leave_the_router_pool():
    made: list[TinyWorker] = []

    def factory(role, index):
        made.append(TinyWorker(role, index))
        return made[-1]

    spec = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(mode="load"))
    pairing = build_router_pairing(RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0),
                                   block_size_tokens=16, prefill_urls=[], decode_urls=["http://127.0.0.1:1"])
    breakers = WorkerBreakers(pairing, OverloadSpec())
    rt = build_planner("local", spec=spec, model_config=None, pairing=pairing, window=RequestWindow(),
                       registry=CollectorRegistry(), is_healthy=_answers, max_workers=2, worker_factory=factory,
                       interval_s=0.5, breakers=breakers)

    async def scenario() -> None:
        act = rt.loop.actuator
        assert act.current() == (0, 1)  # the configured decode worker is the base
        act.apply(_decision(1, 2))
        assert act.current() == (1, 2) and len(made) == 2 and all(w.alive() for w in made)
        deadline = time.monotonic() + 30
        while len(pairing.workers) < 3 and time.monotonic() < deadline:
            await rt.sync_pool()
            await asyncio.sleep(0.1)
        roles = sorted(w.role for w in pairing.workers.values())
        assert roles == ["decode", "decode", "prefill"]
        assert set(pairing.router.workers) == set(pairing.workers)
        urls = {w.url for w in pairing.workers.values()}
        assert {w.base_url for w in made} <= urls
        route = pairing.choose(RouteRequest("r1", "/v1/chat/completions", {}, None, 0.0))
        prefill = next(w for w in made if w.role == "prefill")
        assert route.prefill_url == prefill.base_url  # the only prefill worker; r1 stays in flight
        act.apply(_decision(0, 1))  # back to the base: the extra workers drain ...
        await rt.sync_pool()
        assert all(breakers.draining(w.base_url) for w in made)
        assert prefill.base_url in {w.url for w in pairing.workers.values()}  # ... r1 holds the prefill one
        assert prefill.alive()
        r2 = pairing.choose(RouteRequest("r2", "/v1/chat/completions", {}, None, 0.0))
        assert r2.prefill_url is None and r2.decode_url == "http://127.0.0.1:1"  # nothing new reaches them
        pairing.on_complete("r2", 0.0, True)
        assert not breakers.usable(prefill.base_url)
        pairing.on_complete("r1", 0.0, True)  # r1 done: its handoff was read, the prefill worker is drained
        await rt.sync_pool()
        assert [w.url for w in pairing.workers.values()] == ["http://127.0.0.1:1"]
        assert set(pairing.router.workers) == set(pairing.workers)
        assert not any(w.alive() for w in made)
        assert act.current() == (0, 1) and act.inner.draining() == []

    try:
        asyncio.run(scenario())
        rt.loop.actuator.apply(_decision(0, 2))
        assert sum(w.alive() for w in made) == 1
    finally:
        rt.close()
    assert not any(w.alive() for w in made)


def test_local_planner_needs_a_pool_that_can_change():
    from runtime.server.pairing import RoundRobinPairing

    spec = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(mode="load"))
    with pytest.raises(ValueError, match="RouterPairing"):
        build_planner("local", spec=spec, model_config=None, pairing=RoundRobinPairing([], ["http://x"]),
                      window=RequestWindow(), registry=CollectorRegistry(), worker_factory=TinyWorker)
    with pytest.raises(ValueError, match="kind"):
        build_planner("magic", spec=spec, model_config=None, pairing=RoundRobinPairing([], ["http://x"]),
                      window=RequestWindow(), registry=CollectorRegistry())
