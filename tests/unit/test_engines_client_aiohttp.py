"""runtime.engines.client's own HTTP path (aiohttp, no injected transport) against a real HTTP server on
127.0.0.1 (aiohttp.web): the P/D legs parse as on the httpx path, and what the client sends the worker.
"""

from __future__ import annotations

import json

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

    app = web.Application()
    app.router.add_post(CHAT_PATH, chat)
    app.router.add_post("/bad", bad)
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
