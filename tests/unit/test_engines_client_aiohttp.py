"""runtime.engines.client's own HTTP path (aiohttp, no injected transport) against a real HTTP server on
127.0.0.1 (aiohttp.web): the P/D legs parse as on the httpx path, and what the client sends the worker.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time

import pytest
from aiohttp import web

from runtime.engines.client import CHAT_PATH, BackendError, VllmClient

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
KV = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1]}


@pytest.fixture
async def worker():
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"headers": dict(request.headers), "body": body})
        if not body.get("stream"):
            return web.json_response({"id": "p", "choices": [], "kv_transfer_params": KV})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            chunk = {"id": "d", "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def bad(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no"}}, status=400)

    async def stall_head(request: web.Request) -> web.Response:  # answers after far longer than the timeout
        await asyncio.sleep(2)
        return web.json_response({})

    async def stall_body(request: web.Request) -> web.StreamResponse:  # one event, then nothing
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id": "d", "choices": []}\n\n')
        await asyncio.sleep(2)
        return resp

    async def slow(request: web.Request) -> web.StreamResponse:  # an event every 0.1 s, 6 in all
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(6):
            await asyncio.sleep(0.1)
            await resp.write(b'data: {"id": "d", "choices": []}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def end_after(request: web.Request, delay_s: float) -> web.StreamResponse:
        # as vLLM's server ends a stream: the end of the body in a write of its own after [DONE] (here late)
        seen.append({"peer": request.transport.get_extra_info("peername")})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id": "d", "choices": [{"index": 0, "delta": {"content": "t"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(delay_s)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post(CHAT_PATH, chat)
    app.router.add_post("/end-soon", functools.partial(end_after, delay_s=0.02))
    app.router.add_post("/end-late", functools.partial(end_after, delay_s=2.0))
    app.router.add_post("/bad", bad)
    app.router.add_post("/stall-head", stall_head)
    app.router.add_post("/stall-body", stall_body)
    app.router.add_post("/slow", slow)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_prefill_and_stream_over_aiohttp(worker):
    url, seen = worker
    async with VllmClient(url) as c:
        kv = await c.prefill(CHAT_PATH, BODY, "rid-1")
        events = [e async for e in c.stream_events(CHAT_PATH, BODY, "rid-1", kv)]
        with pytest.raises(BackendError) as ei:
            await c.post_json("/bad", BODY, "rid-2")
    assert kv == KV
    assert [d for d, _ in events] == [json.dumps({"id": "d", "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
                                       .encode() for i in range(3)]
    assert [c["choices"][0]["delta"]["content"] for _, c in events] == ["t0 ", "t1 ", "t2 "]
    assert ei.value.status_code == 400 and ei.value.body == {"error": {"message": "no"}}
    assert [s["body"]["stream"] for s in seen] == [False, True]
    assert seen[1]["body"]["kv_transfer_params"] == KV
    for s in seen:
        headers = {k.lower(): v for k, v in s["headers"].items()}
        assert headers["x-request-id"] == "rid-1" and headers["content-type"] == "application/json"
        # the client reads answers as they come (no decompression): it must not invite a compressed one
        assert "accept-encoding" not in headers and "user-agent" not in headers


async def test_a_stream_that_stops_sending_is_a_504_after_the_read_timeout(worker):
    url, _ = worker
    async with VllmClient(url, timeout_s=0.3) as c:
        for path, events in (("/stall-head", 0), ("/stall-body", 1)):
            got = []
            t0 = time.monotonic()
            with pytest.raises(BackendError) as ei:
                async for e in c.stream_events(path, BODY, "rid"):
                    got.append(e)
            assert ei.value.status_code == 504 and not ei.value.unreachable
            assert len(got) == events and 0.3 <= time.monotonic() - t0 < 2.0


async def test_the_read_timeout_counts_waits_for_the_worker_only(worker):
    url, _ = worker
    async with VllmClient(url, timeout_s=0.25) as c:
        # the worker sends every 0.1 s (within the timeout); the reader spends 0.3 s on each event (over it)
        n = 0
        async for _ in c.stream_events("/slow", BODY, "rid"):
            n += 1
            await asyncio.sleep(0.3)
        assert n == 6


async def test_a_cancelled_stream_is_cancelled_not_timed_out(worker):
    url, _ = worker
    async with VllmClient(url, timeout_s=0.3) as c:
        async def read() -> None:
            async for _ in c.stream_events("/stall-body", BODY, "rid"):
                pass

        task = asyncio.create_task(read())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_stream_whose_body_ends_after_done_keeps_its_connection(worker):
    """The end of the body comes in a write after [DONE] (as vLLM's server sends it): the client reads it, so
    the next leg reuses the connection (a stream released before its body ended closes it: a new TCP
    connection per decode leg)."""
    url, seen = worker
    async with VllmClient(url, timeout_s=5.0) as c:
        for i in range(3):
            chunks = [ch async for ch in c.stream("/end-soon", BODY, f"r{i}")]
            assert [ch["choices"][0]["delta"]["content"] for ch in chunks] == ["t"]
    peers = [s["peer"] for s in seen]
    assert len(peers) == 3 and len(set(peers)) == 1, peers


async def test_a_body_that_does_not_end_after_done_is_dropped_not_waited_for(worker):
    """A server that holds the body open after [DONE] costs the stream at most DONE_BODY_END_S; its connection
    is dropped (the next call opens a new one and is answered)."""
    url, seen = worker
    async with VllmClient(url, timeout_s=5.0) as c:
        t0 = time.monotonic()
        chunks = [ch async for ch in c.stream("/end-late", BODY, "r0")]
        took = time.monotonic() - t0
        assert len(chunks) == 1 and took < 1.0, took
        assert [ch async for ch in c.stream("/end-soon", BODY, "r1")]
    peers = [s["peer"] for s in seen]
    assert len(peers) == 2 and peers[0] != peers[1], peers
