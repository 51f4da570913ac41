"""The other runtime replicas' load, from the workers' gauges (runtime.router.load.set_external_load,
RouterPairing.set_engine_load, runtime.server.engine_load).

Specification: the requests an engine reports beyond the router's own on it (as the engine counts them: a
request still prefilling on another worker is not on its decode engine yet) count as external load of the running
mean prompt size, folded into `decode_blocks` so that the router's own charge and release stay exact; an
unreadable page drops the external share; prefill-only workers are left alone; a router that sees another
replica's requests on a worker sends its next request to the other worker. A NaN, infinite or negative gauge
is unreadable too: it neither enters the traffic share nor stops the loop, and a round that fails for any
reason is logged once and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import math

import pytest

from runtime.config import RouterSpec
from runtime.router.load import WorkerLoad, set_external_load
from runtime.server.app import build_router_pairing
from runtime.server.engine_load import engine_load_loop, read_engine_load
from runtime.server.pairing import RouteRequest
from runtime.server.routing import MIN_TRAFFIC_SHARE


def test_external_requests_are_those_beyond_the_routers_own_and_replace_the_previous_share():
    w = WorkerLoad("d0", "decode", decode_blocks=10, num_requests=3, engine_requests=2)  # one still prefills
    set_external_load(w, 5, 4.0)
    assert (w.external_requests, w.external_decode_blocks, w.decode_blocks, w.num_requests) == (3, 12, 22, 3)
    set_external_load(w, 3, 4.0)  # one external request ended: the share is replaced, not added
    assert (w.external_decode_blocks, w.decode_blocks) == (4, 14)
    w.decode_blocks -= 5  # the router releases one of its own requests: its exact charge comes off
    w.num_requests -= 1
    w.engine_requests -= 1
    set_external_load(w, None, 4.0)  # unreadable page: no stale external share
    assert (w.external_requests, w.external_decode_blocks, w.decode_blocks) == (0, 0, 5)
    set_external_load(w, 0, 4.0)  # fewer in the engine than the router's own (the gauge lags): none external
    assert w.external_requests == 0 and w.decode_blocks == 5


def test_prefill_workers_are_left_alone_and_a_negative_size_is_refused():
    w = WorkerLoad("p0", "prefill", prefill_tokens=7)
    set_external_load(w, 9, 4.0)
    assert (w.prefill_tokens, w.decode_blocks, w.external_requests) == (7, 0, 0)
    with pytest.raises(ValueError):
        set_external_load(WorkerLoad("d0", "decode"), 1, -1.0)


def _pairing():
    return build_router_pairing(RouterSpec(policy="least_loaded", disagg_min_uncached_tokens=0),
                                block_size_tokens=16, prefill_urls=["http://p0"],
                                decode_urls=["http://d0", "http://d1"])


def _route(pairing, i: int, prompt: str = "x" * 640):
    return pairing.choose(RouteRequest(f"r{i}", "/v1/completions", {"prompt": prompt}, None, float(i)))


def test_a_replica_that_sees_the_others_requests_routes_away_from_them():
    blind, seeing = _pairing(), _pairing()
    for p in (blind, seeing):
        _route(p, 0)  # learns the prompt size (10 blocks of 16 tokens)
        p.on_complete("r0", 1.0, True)
    # other replicas hold 3 requests on d0 and none on d1; only `seeing` reads the engines' gauges
    for url, n in (("http://d0", 3), ("http://d1", 0)):
        seeing.set_engine_load(url, n)
    assert seeing.load_of("http://d0").external_requests == 3 and seeing.load_of("http://d0").decode_blocks > 0
    picks = {p: {_route(p, i).decode_url for i in (1, 2)} for p in (blind, seeing)}
    assert picks[seeing] == {"http://d1"}  # both go where the engines are idle
    assert picks[blind] == {"http://d0", "http://d1"}  # its own view: one each
    assert seeing.decode_worker_urls() == ["http://d0", "http://d1"]


async def test_the_loop_reads_every_decode_worker_and_unreadable_pages_count_as_unknown():
    pairing = _pairing()
    _route(pairing, 0)
    pairing.on_complete("r0", 1.0, True)
    pages = {"http://d0": 'vllm:num_requests_running{model_name="m"} 2\nvllm:num_requests_waiting{model_name="m"} 1\n'}
    read: list[str] = []

    async def page(url: str) -> str:
        read.append(url)
        if url not in pages:
            raise OSError("refused")
        return pages[url]

    assert await read_engine_load(page, "http://d0", 1.0) == 3
    assert await read_engine_load(page, "http://d1", 1.0) is None
    applied = _spy_engine_load(pairing, {"http://d0", "http://d1"})
    task = asyncio.create_task(engine_load_loop(pairing, page, interval_s=0.01))
    await asyncio.wait_for(applied.wait(), 10)  # a round has passed its loads on
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert {"http://d0", "http://d1"} <= set(read) and "http://p0" not in read
    assert pairing.load_of("http://d0").external_requests == 3
    assert pairing.load_of("http://d1").external_requests == 0
    with pytest.raises(ValueError):
        await engine_load_loop(pairing, page, interval_s=0)


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0])
def test_a_gauge_no_engine_can_report_drops_the_external_share_like_an_unreadable_page(bad):
    w = WorkerLoad("d0", "decode", decode_blocks=10, num_requests=2, engine_requests=2)
    set_external_load(w, 5, 4.0)
    assert w.decode_blocks == 22
    set_external_load(w, bad, 4.0)  # +Inf raised OverflowError turning the share into blocks
    assert (w.external_requests, w.external_decode_blocks, w.decode_blocks) == (0, 0, 10)


@pytest.mark.parametrize("bad", [math.inf, math.nan, -3.0])
def test_a_gauge_no_engine_can_report_counts_for_nothing_in_the_traffic_share(bad):
    pairing = _pairing()
    pairing.load_of("http://d0").engine_requests = 2
    pairing.load_of("http://d1").engine_requests = 1
    pairing.set_engine_load("http://d0", bad)  # an inf made the share own/inf = 0, a NaN made it 1.0
    pairing.set_engine_load("http://d1", 3)
    assert pairing.drain_traffic_share() == pytest.approx(1 / 3)
    assert pairing.load_of("http://d0").external_requests == 0


_INF_PAGE = 'vllm:num_requests_running{model_name="m"} +Inf\nvllm:num_requests_waiting{model_name="m"} 0\n'
_NAN_PAGE = 'vllm:num_requests_running{model_name="m"} NaN\nvllm:num_requests_waiting{model_name="m"} 1\n'
_THREE = 'vllm:num_requests_running{model_name="m"} 2\nvllm:num_requests_waiting{model_name="m"} 1\n'


def _spy_engine_load(pairing, urls: set[str]) -> asyncio.Event:
    """An event set once `pairing.set_engine_load` has been called for every one of `urls` (the call made)."""
    applied, seen, set_engine_load = asyncio.Event(), set(), pairing.set_engine_load

    def spy(url, load):
        set_engine_load(url, load)
        seen.add(url)
        if urls <= seen:
            applied.set()

    pairing.set_engine_load = spy
    return applied


async def _run_rounds(pairing, page, rounds_done: asyncio.Event) -> asyncio.Task:
    """Run the loop until `rounds_done` is set or the loop ends on its own; the task, still running or not."""
    task = asyncio.create_task(engine_load_loop(pairing, page, interval_s=0.001))
    waiter = asyncio.create_task(rounds_done.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    return task


async def test_an_infinite_or_nan_gauge_is_unreadable_and_the_loop_carries_on():
    pairing = _pairing()
    rounds, done = [0], asyncio.Event()

    async def page(url: str) -> str:
        if url == "http://d1":
            rounds[0] += 1
            if rounds[0] == 3:
                done.set()
        return {"http://d0": _INF_PAGE if rounds[0] % 2 else _NAN_PAGE, "http://d1": _THREE}[url]

    assert await read_engine_load(page, "http://d0", 1.0) is None
    task = await _run_rounds(pairing, page, done)
    try:
        assert not task.done(), task.exception()  # an OverflowError from the +Inf ended it for good
        assert pairing.load_of("http://d0").external_requests == 0
        assert pairing.load_of("http://d1").external_requests == 3
        assert pairing.drain_traffic_share() == MIN_TRAFFIC_SHARE  # none of ours; a NaN read made it 1.0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_round_that_fails_is_logged_once_and_the_loop_goes_on(caplog):
    pairing = _pairing()
    real_set, calls, done = pairing.set_engine_load, [0], asyncio.Event()

    def flaky_set(url, load):
        calls[0] += 1
        if calls[0] <= 4:  # the first four rounds fail (each at its first worker)
            raise RuntimeError("pairing bug")
        real_set(url, load)
        if calls[0] == 6:
            done.set()

    pairing.set_engine_load = flaky_set

    async def page(url: str) -> str:
        return _THREE

    with caplog.at_level(logging.ERROR, logger="runtime.server.engine_load"):
        task = await _run_rounds(pairing, page, done)
    try:
        assert not task.done(), task.exception()
        assert pairing.load_of("http://d0").external_requests == 3
        assert len([r for r in caplog.records if r.exc_info and "pairing bug" in str(r.exc_info[1])]) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
