"""Drain-safe scale-down, pure parts and the local actuator (times passed in, stand-in workers).

Specification:
* a draining worker is out of the rotation whatever its breaker says; it is drained (may be stopped) when it
  holds no request, or once its drain cap has passed; a scale-up that keeps it ends the drain;
* the worker a scale-down removes is the least loaded one (fewest requests, then decode blocks, then queued
  prefill tokens; ties: the newest; a worker the router does not track holds nothing);
* the local actuator keeps a removed ready worker alive (draining, still holding its slot) until the runtime
  releases it or the cap passes; no new worker takes the slot meanwhile.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import OverloadSpec, RouterSpec
from runtime.planner.types import ScalingDecision
from runtime.router.breaker import BreakerBoard, BreakerState
from runtime.router.load import WorkerLoad, removal_choice
from runtime.server.actuators import LocalActuator
from runtime.server.breakers import WorkerBreakers
from runtime.server.routing import RouterPairing, WorkerEndpoint
from tests.unit.test_server_local_actuator import Clock, FakeWorker


def _decision(p: int, d: int) -> ScalingDecision:
    return ScalingDecision(now_s=0.0, prefill_replicas=p, decode_replicas=d)


# ------------------------------------------------------------------------------------------ pure drain state
def test_a_draining_worker_takes_no_traffic_and_is_drained_when_idle_or_at_its_cap():
    board = BreakerBoard(OverloadSpec())
    board.add("w")
    assert board.allows_traffic("w", 0.0) and not board.drained("w", 0.0, 0)  # not draining: never "drained"
    board.start_drain("w", now_s=10.0, cap_s=30.0)
    assert board.state("w", 10.0) is BreakerState.CLOSED and not board.allows_traffic("w", 10.0)
    assert not board.drained("w", 20.0, in_flight=2)  # still serving, cap not reached
    assert board.drained("w", 20.0, in_flight=0)  # idle: may stop now
    assert not board.drained("w", 39.9, in_flight=1) and board.drained("w", 40.0, in_flight=1)  # the cap
    board.start_drain("w", now_s=35.0, cap_s=30.0)  # a second call keeps the first deadline
    assert board.drained("w", 40.0, in_flight=1)
    board.end_drain("w")
    assert board.allows_traffic("w", 41.0) and not board.draining("w")
    with pytest.raises(ValueError):
        board.start_drain("w", 0.0, float("inf"))


def test_the_least_loaded_worker_is_removed_newest_on_ties():
    def load(wid: str, requests: int, blocks: int = 0, tokens: int = 0) -> WorkerLoad:
        return WorkerLoad(wid, "decode", num_requests=requests, decode_blocks=blocks, prefill_tokens=tokens)

    assert removal_choice([load("a", 3), load("b", 1), load("c", 2)]) == 1
    assert removal_choice([load("a", 1, blocks=5), load("b", 1, blocks=9)]) == 0
    assert removal_choice([load("a", 1, 5, tokens=100), load("b", 1, 5, tokens=10)]) == 1
    assert removal_choice([load("a", 0), load("b", 0)]) == 1  # tie: the newest
    assert removal_choice([load("a", 0), None, load("c", 0)]) == 2  # untracked counts idle; newest wins the tie
    assert removal_choice([None, load("b", 1)]) == 0
    with pytest.raises(ValueError):
        removal_choice([])


# ------------------------------------------------------------------------------------------ the rotation
def _pairing() -> RouterPairing:
    return RouterPairing(RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0), 16,
                         [WorkerEndpoint("d0", "decode", "http://d0"), WorkerEndpoint("d1", "decode", "http://d1")])


def test_the_rotation_drains_a_worker_while_its_requests_finish():
    clock = Clock()
    pairing = _pairing()
    breakers = WorkerBreakers(pairing, OverloadSpec(), clock=clock)
    breakers.sync()
    first = pairing.choose(_req("r1"))
    drained_url = first.decode_url
    breakers.drain(drained_url, cap_s=60.0)
    assert not breakers.usable(drained_url) and breakers.in_rotation("decode") == 1
    for i in range(4):  # every new request goes to the other worker
        assert pairing.choose(_req(f"n{i}")).decode_url != drained_url
        pairing.on_complete(f"n{i}", 0.0, True)
    load = pairing.load_of(drained_url)
    assert load is not None and load.num_requests == 1
    assert not breakers.drained(drained_url, load.num_requests)
    pairing.on_complete("r1", 0.0, True)
    assert breakers.drained(drained_url, pairing.load_of(drained_url).num_requests)
    breakers.undrain(drained_url)  # kept after all: back in rotation
    assert breakers.usable(drained_url) and breakers.in_rotation("decode") == 2
    assert pairing.load_of("http://nowhere") is None


def _req(rid: str):
    from runtime.server.pairing import RouteRequest

    return RouteRequest(rid, "/v1/chat/completions", {}, None, 0.0)


# ------------------------------------------------------------------------------------------ local actuator
def _actuator(loads: dict[str, int] | None = None, max_workers: int = 3):
    clock, made = Clock(), []

    def factory(role, index):
        made.append(FakeWorker(role, index))
        return made[-1]

    load_of = None if loads is None else (lambda url: WorkerLoad(url, "decode", num_requests=loads.get(url, 0)))
    act = LocalActuator(factory, max_workers=max_workers, drain_s=30.0, clock=clock, ready_probe=lambda w: True,
                        load_of=load_of)
    return clock, made, act


def test_scale_down_removes_the_least_loaded_ready_worker():
    loads: dict[str, int] = {}
    clock, made, act = _actuator(loads)
    act.apply(_decision(0, 3))
    act.apply(_decision(0, 3))  # all three seen ready
    loads.update({made[0].base_url: 2, made[1].base_url: 0, made[2].base_url: 5})
    act.apply(_decision(0, 2))
    assert [w for _, w in act.draining()] == [made[1]] and made[1] not in act.workers("decode")
    assert made[1].running  # draining, not stopped


def test_a_drained_worker_is_stopped_on_release_and_holds_its_slot_until_then():
    clock, made, act = _actuator(max_workers=2)
    act.apply(_decision(0, 2))
    act.apply(_decision(0, 2))
    applied = act.apply(_decision(0, 1))
    leaving = made[1]
    assert applied.decode_replicas == 1 and applied.draining == 1
    applied = act.apply(_decision(1, 1))  # the prefill worker waits for the draining worker's slot
    assert applied.prefill_replicas == 0 and len(made) == 2 and leaving.running
    assert act.release(leaving) and leaving.stopped and act.draining() == []
    assert not act.release(leaving)  # released once
    applied = act.apply(_decision(1, 1))
    assert applied.prefill_replicas == 1 and applied.draining == 0 and made[-1].role == "prefill"


def test_a_drain_ends_at_its_cap_whatever_the_worker_holds():
    clock, made, act = _actuator()
    act.apply(_decision(0, 2))
    act.apply(_decision(0, 2))
    clock.now_s = 5.0
    act.apply(_decision(0, 1))
    clock.now_s = 34.9
    act.apply(_decision(0, 1))
    assert made[1].running
    clock.now_s = 35.0
    act.apply(_decision(0, 1))
    assert made[1].stopped and act.draining() == []


def test_the_planner_sees_draining_workers_until_they_are_stopped():
    from prometheus_client import CollectorRegistry

    from runtime.server.planner_loop import PlannerGauges
    from runtime.server.planner_runtime import ExtraWorkersActuator

    clock, made, act = _actuator()
    extra = ExtraWorkersActuator(act, base_prefill=1, base_decode=1)
    extra.apply(_decision(1, 3))
    extra.apply(_decision(1, 3))
    applied = extra.apply(_decision(1, 2))
    assert (applied.prefill_replicas, applied.decode_replicas, applied.draining) == (1, 2, 1)
    reg = CollectorRegistry()
    gauges = PlannerGauges(reg)
    gauges.export_applied(applied)
    assert reg.get_sample_value("pdserve_planner_draining_workers") == 1
    act.release(made[1])
    gauges.export_applied(extra.apply(_decision(1, 2)))
    assert reg.get_sample_value("pdserve_planner_draining_workers") == 0


# ------------------------------------------------------------------------------------------ the planner's budget
class _DrainingActuator:
    """An actuator stand-in reporting `held` = (prefill, decode) workers still draining."""

    def __init__(self, held: tuple[int, int]) -> None:
        self.held = held

    def draining_counts(self) -> tuple[int, int]:
        return self.held

    def current(self) -> tuple[int, int]:
        return 1, 1


def _loop(held: tuple[int, int], *, budget: int, tp: tuple[int, int], fleet: tuple[int, int]):
    import httpx
    from prometheus_client import CollectorRegistry

    from runtime.planner.state_machine import PlannerStateMachine
    from runtime.planner.types import PlannerConfig
    from runtime.server.planner_loop import PlannerLoop, RequestWindow

    cfg = PlannerConfig(mode="load", prefill_tp=tp[0], decode_tp=tp[1], min_prefill=1, max_prefill=64, min_decode=1,
                        max_decode=64, gpu_budget=budget, cooldown_s=0.0, scale_down_delay_s=0.0,
                        decode_scale_down_delay_s=0.0, allow_aggregated=False)
    machine = PlannerStateMachine(cfg, None, initial_prefill=fleet[0], initial_decode=fleet[1])
    return PlannerLoop(machine, _DrainingActuator(held), RequestWindow(), metrics_urls=lambda: {},
                       client=httpx.Client(), registry=CollectorRegistry())


def _overloaded(now_s: float):
    from runtime.planner.types import PoolObservation, TickInput

    busy = PoolObservation(num_ready=1, queue_per_worker=50.0, running_per_worker=8.0, kv_usage=0.99)
    return TickInput(now_s=now_s, interval_s=30.0, num_requests=300, mean_isl_tokens=1000, mean_osl_tokens=100,
                     prefill=busy, decode=busy)


def test_a_scale_up_during_a_drain_leaves_the_draining_workers_gpus_free():
    # without draining workers the overload grows the pools up to the budget ...
    free = _loop((0, 0), budget=8, tp=(1, 2), fleet=(1, 1))
    grown = [free._decide(_overloaded(30.0 * i)) for i in range(1, 6)]
    assert grown[-1].num_gpus(1, 2) == 8
    # ... with one decode worker (2 GPUs) still draining, to the budget less its GPUs, tick after tick
    loop = _loop((0, 1), budget=8, tp=(1, 2), fleet=(1, 1))
    for i in range(1, 6):
        assert loop._decide(_overloaded(30.0 * i)).num_gpus(1, 2) <= 6
    assert loop.machine.cfg.gpu_budget == 8  # the configured budget is back after each tick
    loop.actuator.held = (0, 0)  # the drain ended: its GPUs are free again
    assert loop._decide(_overloaded(200.0)).num_gpus(1, 2) == 8


@settings(max_examples=60, deadline=None)
@given(spare=st.integers(0, 20), tp_p=st.integers(1, 4), tp_d=st.integers(1, 4), held_p=st.integers(0, 4),
       held_d=st.integers(0, 4), fleet_p=st.integers(1, 6), fleet_d=st.integers(1, 6))
def test_decisions_plus_draining_gpus_stay_within_the_budget(spare, tp_p, tp_d, held_p, held_d, fleet_p, fleet_d):
    held = held_p * tp_p + held_d * tp_d
    budget = fleet_p * tp_p + fleet_d * tp_d + held + spare  # the fleet within budget, drains included
    loop = _loop((held_p, held_d), budget=budget, tp=(tp_p, tp_d), fleet=(fleet_p, fleet_d))
    assert loop.draining_gpus() == held
    for i in range(1, 4):
        assert loop._decide(_overloaded(30.0 * i)).num_gpus(tp_p, tp_d) + held <= budget
    loop.client.close()


def _local_planner(healthy=None):
    """A local planner runtime over `_pairing()` with breakers, one extra worker at most, its workers
    `FakeWorker`s (returned as they are made) that pass every health check (or `healthy(url)`'s); its next tick
    an hour away."""
    from prometheus_client import CollectorRegistry

    from runtime.config import DeploymentSpec, ModelRef, PlannerSpec
    from runtime.server import planner_runtime
    from runtime.server.planner_loop import RequestWindow

    made: list[FakeWorker] = []

    def factory(role, index):
        made.append(FakeWorker(role, 10 + index))
        return made[-1]

    async def always(url: str) -> bool:
        return True

    pairing = _pairing()
    breakers = WorkerBreakers(pairing, OverloadSpec())
    spec = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(mode="load", interval_s=3600.0))
    rt = planner_runtime.build_planner("local", spec=spec, model_config=None, pairing=pairing, window=RequestWindow(),
                                       registry=CollectorRegistry(), is_healthy=healthy or always, breakers=breakers,
                                       max_workers=1, worker_factory=factory)
    return rt, pairing, breakers, made


def test_the_runtime_stops_a_drained_worker_between_ticks(monkeypatch):
    import asyncio

    from runtime.server import planner_runtime

    monkeypatch.setattr(planner_runtime, "DRAIN_POLL_S", 0.02)
    rt, pairing, breakers, made = _local_planner()
    act = rt.loop.actuator

    async def scenario() -> None:
        act.apply(_decision(0, 3))
        act.apply(_decision(0, 3))  # seen ready
        await rt.sync_pool()
        url = made[0].base_url
        assert pairing.load_of(url) is not None
        routes = {rid: pairing.choose(_req(rid)).decode_url for rid in ("r1", "r2", "r3")}  # round robin
        busy = [rid for rid, u in routes.items() if u == url]
        assert busy
        act.apply(_decision(0, 2))  # the extra worker drains
        await rt.sync_pool()
        assert breakers.draining(url) and made[0].running
        runner = asyncio.create_task(rt.run())  # its next tick is an hour away
        await asyncio.sleep(0.1)
        assert made[0].running  # still holds a request
        for rid in busy:
            pairing.on_complete(rid, 0.0, True)
        for _ in range(100):
            if made[0].stopped:
                break
            await asyncio.sleep(0.02)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        assert made[0].stopped and act.draining_counts() == (0, 0) and rt.loop.draining_gpus() == 0

    try:
        asyncio.run(scenario())
    finally:
        rt.close()


def test_a_draining_worker_is_no_ready_capacity_for_the_planner():
    """While it finishes its requests a leaving worker stays in the pairing (out of the rotation); the planner
    reads only the workers that stay: two serving decode workers at 8 running / 4 waiting each and one idle
    leaving worker are 2 ready workers at 8 / 4, not 3 at 5.3 / 2.7."""
    import asyncio

    import httpx

    rt, pairing, breakers, made = _local_planner()

    def page(req: httpx.Request) -> httpx.Response:
        idle = bool(made) and str(req.url).startswith(made[0].base_url)
        return httpx.Response(200, text=f"vllm:num_requests_running {0 if idle else 8}\n"
                                        f"vllm:num_requests_waiting {0 if idle else 4}\n"
                                        "vllm:kv_cache_usage_perc 0.5\n")

    rt.loop.client = httpx.Client(transport=httpx.MockTransport(page))
    seen = []
    on_tick = rt.loop.machine.on_tick
    rt.loop.machine.on_tick = lambda t: (seen.append(t), on_tick(t))[1]
    act = rt.loop.actuator

    async def scenario() -> None:
        act.apply(_decision(0, 3))
        act.apply(_decision(0, 3))  # seen ready
        await rt.sync_pool()
        busy = [rid for rid in ("r1", "r2", "r3") if pairing.choose(_req(rid)).decode_url == made[0].base_url]
        assert busy  # it holds a request, so it drains rather than leaves
        act.apply(_decision(0, 2))
        await rt.sync_pool()
        assert breakers.draining(made[0].base_url) and pairing.load_of(made[0].base_url) is not None

    try:
        asyncio.run(scenario())
        rt.loop.tick(100.0)
    finally:
        rt.close()
    dec = seen[-1].decode
    assert (dec.num_ready, dec.num_starting, dec.queue_per_worker, dec.running_per_worker) == (2, 0, 4.0, 8.0)


def test_a_started_worker_serves_once_ready_not_at_the_next_tick(monkeypatch):
    """The planner counts a worker ready from when it is (and the fleet simulator it is measured on does): the
    pool takes it between ticks, within DRAIN_POLL_S of its /health answering."""
    import asyncio

    from runtime.server import planner_runtime

    monkeypatch.setattr(planner_runtime, "DRAIN_POLL_S", 0.02)
    ready = {"yes": False}

    async def healthy(url: str) -> bool:
        return ready["yes"]

    rt, pairing, _, made = _local_planner(healthy)
    act = rt.loop.actuator

    async def scenario() -> None:
        act.apply(_decision(0, 3))  # one more decode worker: started, its /health not answering yet
        await rt.sync_pool()
        url = made[0].base_url
        assert pairing.load_of(url) is None
        runner = asyncio.create_task(rt.run())  # its next tick is an hour away
        await asyncio.sleep(0.1)
        assert pairing.load_of(url) is None  # still starting
        ready["yes"] = True
        for _ in range(100):
            if pairing.load_of(url) is not None:
                break
            await asyncio.sleep(0.02)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        assert pairing.load_of(url) is not None

    try:
        asyncio.run(scenario())
    finally:
        rt.close()


def test_a_worker_whose_kv_event_subscription_fails_joins_once_and_the_planner_keeps_running(monkeypatch):
    import asyncio

    from runtime.server import planner_runtime

    monkeypatch.setattr(planner_runtime, "DRAIN_POLL_S", 0.02)
    rt, pairing, _, made = _local_planner()
    act = rt.loop.actuator

    class Refusing:  # a KV-event subscriber that cannot connect (KvEventSubscriber.add raises ValueError)
        removed: list[str] = []

        def add(self, worker_id: str, endpoint: str) -> bool:
            raise ValueError(f"cannot connect to {endpoint}")

        def remove(self, worker_id: str) -> bool:
            self.removed.append(worker_id)
            return False

    rt.subscriber = Refusing()

    async def scenario() -> None:
        act.apply(_decision(0, 3))
        made[0].kv_events_endpoint = "tcp://127.0.0.1:1"
        runner = asyncio.create_task(rt.run())  # its next tick is an hour away: the joins happen between ticks
        await asyncio.sleep(0.2)
        assert not runner.done()  # the failed subscription did not end the planner's task
        url = made[0].base_url
        assert pairing.load_of(url) is not None  # in the pool once, known to the runtime, so it can leave
        await rt.sync_pool()  # no "already in the pool" on the next sync
        act.apply(_decision(0, 2))
        await rt.sync_pool()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        rt.close()
