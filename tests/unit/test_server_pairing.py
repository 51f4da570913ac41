"""Walking-skeleton pairing (runtime.server.pairing): round robin over configured pools, local fallback."""

from __future__ import annotations

import pytest

from runtime.server.pairing import RoundRobinPairing, RouteRequest


def _req(i: int) -> RouteRequest:
    return RouteRequest(request_id=f"r{i}", path="/v1/chat/completions", body={"messages": []})


def test_round_robin_cycles_each_pool_independently():
    p = RoundRobinPairing(["http://p0", "http://p1"], ["http://d0", "http://d1", "http://d2"])
    routes = [p.choose(_req(i)) for i in range(6)]
    assert [r.prefill_url for r in routes] == ["http://p0", "http://p1"] * 3
    assert [r.decode_url for r in routes] == ["http://d0", "http://d1", "http://d2"] * 2


def test_no_prefill_pool_means_local_prefill():
    r = RoundRobinPairing([], ["http://d0"]).choose(_req(0))
    assert r.prefill_url is None and r.decode_url == "http://d0"


def test_prefill_failure_keeps_decode_worker_and_drops_prefill():
    p = RoundRobinPairing(["http://p0"], ["http://d0", "http://d1"])
    p.choose(_req(0))
    first = p.choose(_req(1))
    fb = p.on_prefill_failed("r1", 0.0)
    assert fb.prefill_url is None
    assert fb.decode_url == first.decode_url
    assert fb.reason == "local_prefill_failed"


def test_routes_only_ever_name_configured_workers():
    p = RoundRobinPairing(["http://p0/"], ["http://d0/"])
    for i in range(5):
        r = p.choose(RouteRequest(f"r{i}", "/v1/completions", {"prompt": "x", "base_url": "http://evil"}))
        assert r.prefill_url in p.prefill_urls and r.decode_url in p.decode_urls
        p.on_complete(f"r{i}", 0.0, True)


def test_empty_decode_pool_is_rejected():
    with pytest.raises(ValueError, match="decode_urls"):
        RoundRobinPairing(["http://p0"], [])


def test_a_prefill_worker_marked_down_is_never_chosen_while_another_is_up():
    p = RoundRobinPairing(["http://p0", "http://p1"], ["http://d0"])
    p.mark_down("http://p0/")
    assert {p.choose(_req(i)).prefill_url for i in range(5)} == {"http://p1"}
    p.mark_up("http://p0")
    assert {p.choose(_req(i)).prefill_url for i in range(5, 9)} == {"http://p0", "http://p1"}


def test_every_prefill_worker_down_means_local_prefill_and_every_decode_down_means_no_route():
    p = RoundRobinPairing(["http://p0"], ["http://d0", "http://d1"])
    p.mark_down("http://p0")
    r = p.choose(_req(0))
    assert r.prefill_url is None and r.reason == "local_prefill_down"
    p.mark_down("http://d0")
    assert {p.choose(_req(i)).decode_url for i in range(1, 5)} == {"http://d1"}
    p.mark_down("http://d1")
    with pytest.raises(RuntimeError, match="decode"):
        p.choose(_req(9))


def test_migration_skips_decode_workers_marked_down():
    p = RoundRobinPairing([], ["http://d0", "http://d1", "http://d2"], migration_limit=2)
    p.choose(_req(0))  # d0
    p.mark_down("http://d1")
    assert p.on_decode_failed("r0", 0.0).decode_url == "http://d2"


def test_marking_an_unknown_url_changes_nothing():
    p = RoundRobinPairing(["http://p0"], ["http://d0"])
    p.mark_down("http://elsewhere")
    assert p.down == set() and p.choose(_req(0)).prefill_url == "http://p0"
