"""Runtime side of the KV-aware router (runtime.server.routing.RouterPairing) over the real pure Router.

Specification: routes name only configured workers (ids and URLs from configuration); a worker whose KV
events say it holds the prompt's prefix gets the request, with the predicted overlap; short uncached prompts
are prefilled locally; a failed prefill turns into a local prefill on the same decode worker; a worker marked
down leaves the pool and the index, and comes back empty when marked up.
"""

from __future__ import annotations

import pytest

from runtime.config import RouterSpec
from runtime.kv.events import BlockStored, KvEventBatch
from runtime.server.pairing import RouteRequest
from runtime.server.routing import RouterPairing, WorkerEndpoint

BS = 16


def _pairing(roles=("both", "both"), **spec_kw) -> RouterPairing:
    workers = [WorkerEndpoint(f"w{i}", role, f"http://127.0.0.1:{9000 + i}", f"tcp://127.0.0.1:{5000 + i}")
               for i, role in enumerate(roles)]
    return RouterPairing(RouterSpec(**spec_kw), BS, workers, clock=lambda: 0.0)


def _stored(tokens: list[int]) -> KvEventBatch:
    n = len(tokens) // BS
    return KvEventBatch(ts_s=0.0, events=(BlockStored(tuple(range(100, 100 + n)), None, tuple(tokens[: n * BS]), BS),))


def _req(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(rid, "/v1/completions", {"prompt": "ignored"}, tokens, 0.0)


PROMPT = list(range(1000, 1000 + 10 * BS + 5))


def test_request_goes_to_the_worker_whose_events_hold_its_prefix():
    p = _pairing()
    p.apply_batch("w1", _stored(PROMPT))
    r = p.choose(_req("a", PROMPT))
    assert r.decode_worker == "w1"
    assert r.decode_url == "http://127.0.0.1:9001"
    assert r.prefill_url is None  # aggregated pool: local prefill
    assert r.overlap_blocks == 10


def test_routes_only_name_configured_workers():
    p = _pairing()
    urls = {w.url for w in p.workers.values()}
    for i in range(20):
        r = p.choose(_req(f"r{i}", [i] * 40))
        assert r.decode_url in urls and r.decode_worker in p.workers
        p.on_complete(f"r{i}", 0.0, True)


def test_long_uncached_prompt_is_prefilled_remotely_short_one_locally():
    p = _pairing(roles=("prefill", "decode"), disagg_min_uncached_tokens=64)
    long_r = p.choose(_req("long", PROMPT))
    assert long_r.prefill_worker == "w0" and long_r.prefill_url == "http://127.0.0.1:9000"
    assert long_r.reason == "remote"
    short_r = p.choose(_req("short", PROMPT[:20]))
    assert short_r.prefill_url is None and short_r.reason == "local_short"


def test_failed_prefill_becomes_local_prefill_on_the_same_decode_worker():
    p = _pairing(roles=("prefill", "decode"), disagg_min_uncached_tokens=0)
    first = p.choose(_req("a", PROMPT))
    fb = p.on_prefill_failed("a", 0.0)
    assert fb.prefill_url is None and fb.decode_worker == first.decode_worker
    assert fb.reason == "local_prefill_failed"


def test_down_worker_leaves_pool_and_index_and_returns_empty():
    p = _pairing()
    p.apply_batch("w1", _stored(PROMPT))
    p.mark_down("http://127.0.0.1:9001/")
    for i in range(5):
        assert p.choose(_req(f"d{i}", PROMPT)).decode_worker == "w0"
    p.mark_up("http://127.0.0.1:9001")
    assert "w1" in p.router.workers
    assert p.router.overlaps(p.router.hashes_for(PROMPT)).get("w1", 0) == 0


def test_unknown_url_is_ignored_by_health_marks():
    p = _pairing()
    assert p.mark_down("http://203.0.113.1:1") == []
    assert set(p.router.workers) == {"w0", "w1"}


def test_kv_event_endpoints_come_from_configuration():
    assert _pairing().kv_event_endpoints() == {"w0": "tcp://127.0.0.1:5000", "w1": "tcp://127.0.0.1:5001"}


def test_duplicate_worker_ids_are_rejected():
    with pytest.raises(ValueError):
        RouterPairing(RouterSpec(), BS, [WorkerEndpoint("w", "both", "http://a"), WorkerEndpoint("w", "both", "http://b")])


async def test_health_loop_spares_starting_workers_and_removes_ones_that_die():
    import asyncio

    from runtime.server.routing import health_loop

    p = _pairing()
    health = {"http://127.0.0.1:9000": False, "http://127.0.0.1:9001": True}

    async def is_healthy(url: str) -> bool:
        return health[url]

    task = asyncio.create_task(health_loop(p, is_healthy, interval_s=0.01))
    try:
        await asyncio.sleep(0.05)
        assert set(p.router.workers) == {"w0", "w1"}  # w0 never healthy yet: still starting, kept
        health["http://127.0.0.1:9000"] = True
        await asyncio.sleep(0.05)
        health["http://127.0.0.1:9001"] = False  # w1 was healthy and died
        await asyncio.sleep(0.05)
        assert set(p.router.workers) == {"w0"}
        health["http://127.0.0.1:9001"] = True
        await asyncio.sleep(0.05)
        assert set(p.router.workers) == {"w0", "w1"}
    finally:
        task.cancel()


def test_workers_added_and_removed_at_run_time_join_and_leave_the_pool():
    p = _pairing(roles=("both",))
    p.add_worker(WorkerEndpoint("w9", "both", "http://127.0.0.1:9009"))
    assert set(p.router.workers) == {"w0", "w9"}
    with pytest.raises(ValueError):
        p.add_worker(WorkerEndpoint("w10", "both", "http://127.0.0.1:9009/"))
    p.remove_worker("w0")
    for i in range(3):
        assert p.choose(_req(f"r{i}", PROMPT)).decode_url == "http://127.0.0.1:9009"
    assert p.remove_worker("nope") == []


def test_prefill_worker_found_dead_mid_request_falls_back_locally():
    p = _pairing(roles=("prefill", "decode"), disagg_min_uncached_tokens=0)
    r = p.choose(_req("a", PROMPT))
    assert r.prefill_worker == "w0"
    p.on_worker_unreachable(r.prefill_url)
    fb = p.on_prefill_failed("a", 0.0)
    assert fb.prefill_url is None and fb.decode_worker == "w1"
    p.on_complete("a", 0.0, True)
    nxt = p.choose(_req("b", PROMPT))
    assert nxt.prefill_url is None  # no prefill pool left: local
    assert p.on_decode_failed("b", 0.0) is None  # no other decode worker to migrate to
