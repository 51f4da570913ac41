"""runtime.engines.client's own HTTP path (aiohttp, no injected transport) against a real HTTP server on
127.0.0.1 (aiohttp.web): the P/D legs parse as on the httpx path, and what the client sends the worker.
"""

from __future__ import annotations

import asyncio
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

    app = web.Application()
    app.router.add_post(CHAT_PATH, chat)
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
