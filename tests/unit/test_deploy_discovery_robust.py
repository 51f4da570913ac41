"""Specification: EndpointSliceDiscovery.updates() outlives whatever the API server answers, and never polls
it in a tight loop.

* A malformed list body or watch line (not JSON, not an object, a slice without `metadata.name`) is logged
  as a warning, then discovery waits `retry_s` and lists again; the updates go on.
* The first `410 Gone` in a row lists again at once; the following ones wait, doubling up to `max_retry_s`.
* A watch the server ends without any event is reopened (from the same resourceVersion) after a wait that
  doubles the same way; a watch that delivers an event resets the wait to `retry_s`.

Tested at the HTTP transport (httpx.MockTransport); the waits go through the injected `sleep`, recorded.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from runtime.deploy.discovery import EndpointSliceDiscovery, PoolMembership

NS = "pdserve"
D1, D2, D3 = "http://10.0.1.1:8000", "http://10.0.1.2:8000", "http://10.0.1.3:8000"


def eps(name: str, ip: str, rv: str = "1") -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": NS, "resourceVersion": rv,
                         "labels": {"kubernetes.io/service-name": "d"}},
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]}


def added(name: str, ip: str, rv: str = "11") -> bytes:
    return (json.dumps({"type": "ADDED", "object": eps(name, ip, rv)}) + "\n").encode()


class ScriptedApi:
    """Lists answer from `lists` (bytes: raw body; exhausted: the `d-1` slice at resourceVersion 10);
    watches from `watches` (int: that HTTP status; bytes: a 200 body the server then closes; exhausted: 410)."""

    def __init__(self, watches: list[int | bytes], lists: list[bytes] | None = None) -> None:
        self.watches, self.lists = list(watches), list(lists or [])
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.params.get("watch") != "1":
            if self.lists:
                return httpx.Response(200, content=self.lists.pop(0))
            return httpx.Response(200, json={"kind": "EndpointSliceList", "metadata": {"resourceVersion": "10"},
                                             "items": [eps("d-1", "10.0.1.1")]})
        script = self.watches.pop(0) if self.watches else 410
        if isinstance(script, int):
            return httpx.Response(script, json={"kind": "Status", "code": script})
        return httpx.Response(200, content=script)

    def num_lists(self) -> int:
        return sum(r.url.params.get("watch") != "1" for r in self.requests)

    def watch_versions(self) -> list[str]:
        return [r.url.params["resourceVersion"] for r in self.requests if r.url.params.get("watch") == "1"]


def discovery(api: ScriptedApi, sleeps: list[float], **kw) -> EndpointSliceDiscovery:
    async def record(s: float) -> None:
        sleeps.append(s)

    client = httpx.AsyncClient(base_url="https://k8s.test", transport=httpx.MockTransport(api))
    return EndpointSliceDiscovery(namespace=NS, prefill_service="p", decode_service="d", client=client,
                                  sleep=record, **kw)


async def take(d: EndpointSliceDiscovery, n: int) -> list[PoolMembership]:
    out: list[PoolMembership] = []
    gen = d.updates()

    async def run() -> None:
        async for m in gen:
            out.append(m)
            if len(out) == n:
                break

    try:
        await asyncio.wait_for(run(), timeout=5)
    finally:
        await gen.aclose()
    return out


BAD_WATCH_LINES = {
    "truncated JSON": b'{"type": "ADDED", "object": {"metadata"\n',
    "not an object": b"[1, 2, 3]\n",
    "object not an object": b'{"type": "ADDED", "object": "d-9"}\n',
    "ADDED without metadata.name": b'{"type": "ADDED", "object": {"metadata": {"resourceVersion": "3"}}}\n',
    "DELETED without metadata": b'{"type": "DELETED", "object": {"kind": "EndpointSlice"}}\n',
}


@pytest.mark.parametrize("line", BAD_WATCH_LINES.values(), ids=BAD_WATCH_LINES.keys())
async def test_a_malformed_watch_line_is_logged_and_discovery_lists_again_after_a_wait(line, caplog):
    api = ScriptedApi([line, added("d-2", "10.0.1.2")])
    sleeps: list[float] = []
    with caplog.at_level(logging.WARNING, logger="runtime.deploy.discovery"):
        got = await take(discovery(api, sleeps), 2)
    assert [m.decode for m in got] == [(D1,), (D1, D2)]
    assert sleeps == [1.0]
    assert api.num_lists() == 2  # the slices are listed again: the watch's view may have missed a change
    assert any("MalformedWatchError" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("body", [b"<html>proxy error</html>", b'{"items": []}', b'{"metadata": {"resourceVersion": "9"}, "items": [{}]}'],
                         ids=["not JSON", "no resourceVersion", "item without name"])
async def test_a_malformed_list_body_is_retried_after_a_wait(body):
    api = ScriptedApi([added("d-2", "10.0.1.2")], lists=[body])
    sleeps: list[float] = []
    got = await take(discovery(api, sleeps), 2)
    assert [m.decode for m in got] == [(D1,), (D1, D2)]
    assert sleeps == [1.0]
    assert api.num_lists() == 2


async def test_the_first_410_relists_at_once_later_ones_in_a_row_back_off_doubling():
    gone_event = b'{"type": "ERROR", "object": {"kind": "Status", "code": 410}}\n'
    api = ScriptedApi([410, gone_event, 410, 410, added("d-2", "10.0.1.2")])
    sleeps: list[float] = []
    got = await take(discovery(api, sleeps), 2)
    assert got[-1].decode == (D1, D2)
    assert sleeps == [1.0, 2.0, 4.0]  # after the 2nd, 3rd and 4th Gone; none after the 1st
    assert api.num_lists() == 5


async def test_a_single_410_still_relists_without_waiting():
    api = ScriptedApi([410, added("d-2", "10.0.1.2")])
    sleeps: list[float] = []
    got = await take(discovery(api, sleeps), 2)
    assert got[-1].decode == (D1, D2)
    assert sleeps == []
    assert api.num_lists() == 2


async def test_a_watch_that_ends_without_events_is_reopened_after_a_doubling_wait_capped_at_max_retry_s():
    api = ScriptedApi([b""] * 5 + [added("d-2", "10.0.1.2")])
    sleeps: list[float] = []
    got = await take(discovery(api, sleeps, max_retry_s=4.0), 2)
    assert got[-1].decode == (D1, D2)
    assert sleeps == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert api.num_lists() == 1  # resumed from the same resourceVersion: nothing to list again
    assert api.watch_versions() == ["10"] * 6


async def test_a_watch_that_delivered_events_resets_the_wait_and_is_resumed_at_once():
    api = ScriptedApi([b"", b"", added("d-2", "10.0.1.2", rv="11"), b"", added("d-3", "10.0.1.3", rv="12")])
    sleeps: list[float] = []
    got = await take(discovery(api, sleeps), 3)
    assert [m.decode for m in got] == [(D1,), (D1, D2), (D1, D2, D3)]
    assert sleeps == [1.0, 2.0, 1.0]  # two empty watches, then an event resets; one empty watch after it
    assert api.watch_versions() == ["10", "10", "10", "11", "11"]


async def test_410s_separated_by_successful_lists_still_count_as_in_a_row():
    """A list that succeeds does not reset the count: only a watch event shows the watch works again."""
    api = ScriptedApi([410, 410, added("d-2", "10.0.1.2", rv="11"), 410, added("d-3", "10.0.1.3", rv="12")])
    sleeps: list[float] = []
    got = await take(discovery(api, sleeps), 4)
    assert [m.decode for m in got] == [(D1,), (D1, D2), (D1,), (D1, D3)]  # each relist sees only d-1
    assert sleeps == [1.0]  # the 2nd Gone in a row waits; the Gone after an event is a first one again
