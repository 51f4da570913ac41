"""Specification of run_server's background tasks (discovery, planner, health checks).

* A task that dies is logged at ERROR, with its traceback, while the server still serves.
* Discovery that dies is started again after a back-off (`supervise_discovery`): `retry_s` doubling per
  failure in a row up to `max_retry_s`, reset by a run that lasted `max_retry_s`; its pool follows the new
  run's membership. Updates that simply end (static discovery) are not restarted.
* Cancellation at shutdown is not reported; every task is awaited before the planner's actuator is closed.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from runtime.config import RouterSpec
from runtime.deploy.discovery import PoolMembership, StaticDiscovery
from runtime.server.app import build_model, build_router_pairing, run_server
from runtime.server.discovery_sync import supervise_discovery


def empty_pairing():
    return build_router_pairing(RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0),
                                block_size_tokens=16, prefill_urls=[], decode_urls=[])


def decode_urls(pairing) -> list[str]:
    return sorted(w.url for w in pairing.workers.values() if w.role == "decode")


class ServeUntil:
    """The REST-server side of run_server: serves until `until()` holds (checked every 10 ms, at most 5 s)."""

    def __init__(self, until) -> None:
        self.until, self.serving = until, False

    async def start(self) -> None:
        self.serving = True
        try:
            for _ in range(500):
                if self.until():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("the condition to stop serving never held")
        finally:
            self.serving = False


class DyingDiscovery:
    """Each run of `updates()` yields a membership with one decode worker (a new URL per run), then fails like a
    watch whose line is not JSON; the last run's updates stay open."""

    def __init__(self, num_failures: int) -> None:
        self.num_failures, self.calls = num_failures, 0

    async def updates(self):
        self.calls += 1
        yield PoolMembership((), (f"http://10.0.1.{self.calls}:8000",))
        if self.calls <= self.num_failures:
            raise ValueError("watch line is not JSON")
        await asyncio.Event().wait()


class ErrorsWhileServing(logging.Handler):
    def __init__(self, rest: ServeUntil) -> None:
        super().__init__(level=logging.ERROR)
        self.rest, self.records = rest, []

    def emit(self, record: logging.LogRecord) -> None:
        if self.rest.serving:
            self.records.append(record)


async def serve(rest: ServeUntil, model, **kw) -> list[logging.LogRecord]:
    handler = ErrorsWhileServing(rest)
    logging.getLogger().addHandler(handler)
    try:
        await asyncio.wait_for(run_server(rest, model, health_interval_s=3600, **kw), timeout=10)
    finally:
        logging.getLogger().removeHandler(handler)
    return handler.records


async def test_discovery_that_dies_is_logged_with_its_traceback_and_restarted_while_serving():
    pairing = empty_pairing()
    model = build_model("m", prefill_urls=[], decode_urls=[], pairing=pairing, registry=CollectorRegistry())
    disc = DyingDiscovery(num_failures=2)
    rest = ServeUntil(lambda: disc.calls == 3 and decode_urls(pairing) == ["http://10.0.1.3:8000"])
    records = await serve(rest, model, discovery=disc, discovery_retry_s=0.01, discovery_max_retry_s=0.02)
    died = [r for r in records if r.name == "runtime.server.discovery_sync"]
    assert len(died) == 2
    assert all(r.exc_info and isinstance(r.exc_info[1], ValueError) for r in died)
    assert "discovery died" in died[0].getMessage()


async def test_supervise_discovery_backs_off_doubling_and_returns_when_the_updates_end():
    pairing, sleeps = empty_pairing(), []

    class DiesThenEnds(DyingDiscovery):
        async def updates(self):
            self.calls += 1
            yield PoolMembership((), (f"http://10.0.1.{self.calls}:8000",))
            if self.calls <= self.num_failures:
                raise ValueError("watch line is not JSON")

    async def record(s: float) -> None:
        sleeps.append(s)

    disc = DiesThenEnds(num_failures=4)
    await asyncio.wait_for(supervise_discovery(disc, pairing, retry_s=1.0, max_retry_s=4.0, sleep=record,
                                               clock=lambda: 0.0), timeout=5)
    assert sleeps == [1.0, 2.0, 4.0, 4.0]
    assert disc.calls == 5
    assert decode_urls(pairing) == ["http://10.0.1.5:8000"]  # the pool follows the latest run


async def test_supervise_discovery_resets_the_wait_after_a_run_that_lasted_max_retry_s():
    pairing, sleeps = empty_pairing(), []
    now = [0.0]

    class LongThenShortRuns(DyingDiscovery):
        async def updates(self):
            self.calls += 1
            yield PoolMembership((), ())
            now[0] += 10.0 if self.calls == 3 else 0.0  # the third run lasts 10 s, the others 0 s
            if self.calls <= self.num_failures:
                raise ValueError("watch line is not JSON")

    async def record(s: float) -> None:
        sleeps.append(s)

    await asyncio.wait_for(supervise_discovery(LongThenShortRuns(num_failures=4), pairing, retry_s=1.0,
                                               max_retry_s=8.0, sleep=record, clock=lambda: now[0]), timeout=5)
    assert sleeps == [1.0, 2.0, 1.0, 2.0]


async def test_static_discovery_that_ends_is_neither_restarted_nor_reported():
    pairing = empty_pairing()
    model = build_model("m", prefill_urls=[], decode_urls=[], pairing=pairing, registry=CollectorRegistry())
    rest = ServeUntil(lambda: decode_urls(pairing) == ["http://d:1"])
    records = await serve(rest, model, discovery=StaticDiscovery([], ["http://d:1"]))
    assert records == []


class FakePlanner:
    local = None

    def __init__(self, fail: bool = False, cleanup_s: float = 0.0) -> None:
        self.fail, self.cleanup_s = fail, cleanup_s
        self.started = self.stopped = False
        self.stopped_before_close: bool | None = None

    async def run(self) -> None:
        self.started = True
        if self.fail:
            raise RuntimeError("planner tick loop broke")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(self.cleanup_s)  # e.g. a tick finishing its scale-up
            self.stopped = True
            raise

    def close(self) -> None:
        self.stopped_before_close = self.stopped


async def test_a_planner_task_that_dies_is_logged_with_its_traceback_while_serving():
    model = build_model("m", prefill_urls=[], decode_urls=[], pairing=empty_pairing(), registry=CollectorRegistry())
    planner = FakePlanner(fail=True)
    done = []
    rest = ServeUntil(lambda: done)
    handler_task = asyncio.create_task(serve(rest, model, planner=planner))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if planner.started:
            break
    await asyncio.sleep(0.05)  # the done-callback runs on the next loop iterations
    done.append(True)
    records = await handler_task
    assert [r.getMessage().split(":")[0] for r in records] == ["background task pdserve-planner died"]
    assert isinstance(records[0].exc_info[1], RuntimeError)


async def test_a_health_loop_that_dies_is_logged_with_its_traceback_while_serving():
    pairing = build_router_pairing(RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0),
                                   block_size_tokens=16, prefill_urls=[], decode_urls=["http://d:1"])
    model = build_model("m", prefill_urls=[], decode_urls=[], pairing=pairing, registry=CollectorRegistry())
    checks = []

    async def broken_check(url: str) -> bool:
        checks.append(url)
        raise KeyError(url)

    model.worker_healthy = broken_check
    rest = ServeUntil(lambda: handler.records)  # serve until the death is reported (at most 5 s)
    handler = ErrorsWhileServing(rest)
    logging.getLogger().addHandler(handler)
    try:
        await asyncio.wait_for(run_server(rest, model, health_interval_s=3600), timeout=10)
    finally:
        logging.getLogger().removeHandler(handler)
    assert checks == ["http://d:1"]
    assert "pdserve-health died" in handler.records[0].getMessage()
    assert isinstance(handler.records[0].exc_info[1], KeyError)


async def test_shutdown_awaits_the_cancelled_tasks_before_closing_the_planner_and_reports_nothing():
    model = build_model("m", prefill_urls=[], decode_urls=[], pairing=empty_pairing(), registry=CollectorRegistry())
    planner = FakePlanner(cleanup_s=0.2)
    rest = ServeUntil(lambda: planner.started)
    records = await serve(rest, model, planner=planner)
    assert planner.stopped, "run_server returned while its planner task was still stopping"
    assert planner.stopped_before_close is True
    assert records == []


async def test_a_worker_back_at_the_same_url_starts_again_and_joins_the_rotation_at_its_first_answer():
    """The breakers' contract: a worker that has not answered a health check since it joined is starting: its
    failed checks do not open its breaker, it is out of the rotation, and its first answer puts it in. A pod
    that leaves and comes back at the same address gets the same discovered id; it is a new worker."""
    from runtime.router.breaker import BreakerState
    from runtime.config import OverloadSpec
    from runtime.server.breakers import WorkerBreakers
    from runtime.server.discovery_sync import apply_membership, discovered_id

    pairing, url = empty_pairing(), "http://10.0.1.1:8000"
    breakers = WorkerBreakers(pairing, OverloadSpec(breaker_failures=1))
    healthy = {url: True}

    async def is_healthy(u: str) -> bool:
        return healthy[u]

    apply_membership(pairing, PoolMembership((), (url,)))
    await breakers.check_round(is_healthy)
    assert breakers.serving(url)  # seen healthy
    apply_membership(pairing, PoolMembership((), ()))  # the pod is deleted
    healthy[url] = False  # its replacement, same IP, is still starting
    apply_membership(pairing, PoolMembership((), (url,)))
    for _ in range(3):
        await breakers.check_round(is_healthy)
    assert breakers.state(url) is BreakerState.CLOSED  # its failed checks did not count
    assert discovered_id("decode", url) in pairing.down  # but the router does not choose it
    assert not breakers.serving(url) and not breakers.usable(url)  # starting: not a request's decode worker
    healthy[url] = True
    await breakers.check_round(is_healthy)
    assert discovered_id("decode", url) not in pairing.down and breakers.usable(url)