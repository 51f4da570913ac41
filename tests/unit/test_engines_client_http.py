"""runtime.engines.client's own HTTP path (runtime.engines.h1, no injected transport) against real HTTP servers
on 127.0.0.1 (aiohttp.web, and raw sockets for what a well-behaved server never does): the P/D legs parse as on
the httpx path, what the client sends the worker, connection reuse, and how each wire failure is reported.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
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

    released = asyncio.Event()  # set as the fixture ends: the stand-ins below that hold an answer let it go

    async def hold(delay_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(released.wait(), delay_s)

    async def stall_head(request: web.Request) -> web.Response:  # answers after far longer than the timeout
        await hold(60)
        return web.json_response({})

    async def stall_body(request: web.Request) -> web.StreamResponse:  # one event, then nothing
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id": "d", "choices": []}\n\n')
        await hold(60)
        return resp

    async def slow(request: web.Request) -> web.StreamResponse:  # an event every 0.1 s, 3 in all
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(3):
            await asyncio.sleep(0.1)
            await resp.write(b'data: {"id": "d", "choices": []}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def big(request: web.Request) -> web.Response:  # far more than the client buffers before pausing
        return web.json_response({"id": "b", "text": "x" * (3 << 20)})

    async def prefixed(request: web.Request) -> web.Response:
        seen.append({"path": request.path})
        return web.json_response({"id": "p", "choices": []})

    async def end_after(request: web.Request, delay_s: float) -> web.StreamResponse:
        # as vLLM's server ends a stream: the end of the body in a write of its own after [DONE] (here late)
        seen.append({"peer": request.transport.get_extra_info("peername")})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id": "d", "choices": [{"index": 0, "delta": {"content": "t"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await hold(delay_s)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post(CHAT_PATH, chat)
    app.router.add_post("/end-soon", functools.partial(end_after, delay_s=0.02))
    app.router.add_post("/end-late", functools.partial(end_after, delay_s=60.0))
    app.router.add_post("/bad", bad)
    app.router.add_post("/stall-head", stall_head)
    app.router.add_post("/stall-body", stall_body)
    app.router.add_post("/slow", slow)
    app.router.add_post("/big", big)
    app.router.add_post("/prefix/v1/completions", prefixed)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        released.set()
        await runner.cleanup()


async def test_prefill_and_stream_over_the_runtimes_http(worker):
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


async def test_credentials_in_a_worker_url_are_sent_as_basic_auth_and_never_shown(worker):
    url, seen = worker
    host = url.removeprefix("http://")
    async with VllmClient(f"http://ad%40min:s3%3Acret@{host}") as c:  # percent-encoded '@' and ':'
        await c.prefill(CHAT_PATH, BODY, "rid-1")
        with pytest.raises(BackendError) as ei:
            await c.post_json("/bad", BODY, "rid-2")
    headers = {k.lower(): v for k, v in seen[0]["headers"].items()}
    assert headers["authorization"] == "Basic " + base64.b64encode(b"ad@min:s3:cret").decode()
    assert headers["host"] == host  # the host alone
    assert "s3" not in str(ei.value) and "s3" not in ei.value.url and ei.value.url.startswith("http://***@")


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
            # timed out, not ended by the stand-in (60 s), with room for pauses of this process
            assert len(got) == events and 0.3 <= time.monotonic() - t0 < 10.0


async def test_the_read_timeout_counts_waits_for_the_worker_only(worker):
    url, _ = worker
    # the worker sends every 0.1 s (within the timeout, with room for a pause of this process); the reader
    # spends 1.2 s on each event (over it)
    async with VllmClient(url, timeout_s=1.0) as c:
        n = 0
        async for _ in c.stream_events("/slow", BODY, "rid"):
            n += 1
            await asyncio.sleep(1.2)
        assert n == 3


async def test_a_cancelled_stream_is_cancelled_not_timed_out(worker):
    url, _ = worker
    # a timeout a pause of this process cannot reach before the cancel: the cancel must not read as one
    async with VllmClient(url, timeout_s=30) as c:
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
    async with VllmClient(url, timeout_s=30.0) as c:
        t0 = time.monotonic()
        chunks = [ch async for ch in c.stream("/end-late", BODY, "r0")]
        took = time.monotonic() - t0
        # far below the body's end (60 s) and the read timeout (30 s), with room for pauses of this process
        assert len(chunks) == 1 and took < 5.0, took
        assert [ch async for ch in c.stream("/end-soon", BODY, "r1")]
    peers = [s["peer"] for s in seen]
    assert len(peers) == 2 and peers[0] != peers[1], peers


async def test_a_large_answer_is_read_whole_and_a_base_path_prefixes_every_call(worker):
    url, seen = worker
    async with VllmClient(url) as c:
        answer = await c.post_json("/big", {}, "rid")
        assert len(answer["text"]) == 3 << 20 and set(answer["text"]) == {"x"}
    async with VllmClient(url + "/prefix/") as c:
        assert (await c.post_json("/v1/completions", {}, "rid"))["id"] == "p"
    assert seen[-1] == {"path": "/prefix/v1/completions"}


async def _raw_server(handle) -> tuple[asyncio.AbstractServer, str]:
    """A TCP server on 127.0.0.1 whose connections `handle(reader, writer, n)` serves (n: the connection's
    number, from 0)."""
    count = 0

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        n, count = count, count + 1
        try:
            await handle(reader, writer, n)
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{\"ok\": true}"


async def test_an_idle_connection_the_worker_closes_as_it_is_reused_is_retried_once_on_a_new_one():
    """The worker's keep-alive timeout races with a call: it closes the idle connection on which the request
    was just written, before any byte of an answer. The call goes out again on a new connection; a new
    connection closed the same way is a worker gone (no second retry)."""
    requests: list[int] = []

    async def handle(reader, writer, n):
        await _read_request(reader)
        requests.append(n)
        writer.write(OK)
        await writer.drain()
        if n == 0:  # keep-alive for one more request, which it drops unanswered
            await _read_request(reader)
            requests.append(n)

    server, url = await _raw_server(handle)
    async with server, VllmClient(url) as c:
        assert await c.post_json("/x", {}, "r1") == {"ok": True}
        assert await c.post_json("/x", {}, "r2") == {"ok": True}  # conn 0 drops it; conn 1 answers
    assert requests == [0, 0, 1]

    async def drop(reader, writer, n):
        await _read_request(reader)

    server, url = await _raw_server(drop)
    async with server, VllmClient(url) as c:
        with pytest.raises(BackendError) as ei:
            await c.post_json("/x", {}, "r")
    assert ei.value.status_code == 502 and ei.value.unreachable


async def test_idle_connections_the_worker_closes_leave_the_pool_at_once():
    """A worker's keep-alive timeout closes idle connections: they must not wait in the pool for a call to pop
    and discard them (a burst of concurrent calls leaves as many behind), and a call after it connects anew."""
    closing = asyncio.Event()

    async def handle(reader, writer, n):
        await _read_request(reader)
        writer.write(OK)
        await writer.drain()
        await closing.wait()  # then close, as uvicorn does an idle connection at its keep-alive timeout

    server, url = await _raw_server(handle)
    async with server, VllmClient(url) as c:
        assert await asyncio.gather(*(c.post_json("/x", {}, f"r{i}") for i in range(5))) == [{"ok": True}] * 5
        assert len(c._pool._idle) == 5
        closing.set()
        for _ in range(100):
            if not c._pool._idle:
                break
            await asyncio.sleep(0.01)
        assert not c._pool._idle
        closing.clear()
        assert await c.post_json("/x", {}, "after") == {"ok": True}
        assert len(c._pool._idle) == 1


@pytest.mark.parametrize("answer, gone", [
    (b"SPDY/9 garbage\r\n\r\n", False),  # answered, but not HTTP: the worker is there
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"cut\":", True),  # closed mid-body
])
async def test_a_broken_answer_is_a_502_and_only_a_cut_one_is_a_worker_gone(answer, gone):
    async def handle(reader, writer, n):
        await _read_request(reader)
        writer.write(answer)
        await writer.drain()

    server, url = await _raw_server(handle)
    async with server, VllmClient(url) as c:
        for call in (c.post_json("/x", {}, "r"), _drain(c.stream_events("/x", BODY, "r"))):
            with pytest.raises(BackendError) as ei:
                await call
            assert ei.value.status_code == 502 and ei.value.unreachable is gone, ei.value


async def _drain(events) -> None:
    async for _ in events:
        pass


async def test_a_refused_connection_is_a_worker_gone_and_health_is_false():
    from runtime.ports import free_port

    async with VllmClient(f"http://127.0.0.1:{free_port()}") as c:
        with pytest.raises(BackendError) as ei:
            await c.prefill(CHAT_PATH, BODY, "r")
        assert ei.value.status_code == 502 and ei.value.unreachable
        assert await c.healthy() is False


async def test_a_call_cancelled_mid_answer_closes_its_connection_and_the_next_call_is_answered():
    closed = asyncio.Event()

    async def handle(reader, writer, n):
        await _read_request(reader)
        if n == 0:  # a stream that never ends; the client's cancel must close the connection
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
            if await reader.read(1) == b"":
                closed.set()
            return
        writer.write(OK)
        await writer.drain()

    server, url = await _raw_server(handle)
    async with server, VllmClient(url) as c:
        task = asyncio.create_task(_drain(c.stream_events("/x", BODY, "r")))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 2)
        assert await c.post_json("/x", {}, "r2") == {"ok": True}


def _sse(*datas: bytes) -> bytes:
    return b"".join(b"data: " + d + b"\n\n" for d in datas)


async def test_interim_answers_are_skipped_and_never_shift_a_later_calls_answer():
    """103 Early Hints (any 1xx) in a write of its own before the answer: the call reads its own answer, and
    the next call on the connection reads the next one (a 1xx taken as the answer shifts every later call)."""
    async def handle(reader, writer, n):
        while True:
            rid = [line for line in (await _read_request(reader)).split(b"\r\n")
                   if line.lower().startswith(b"x-request-id")][0].split(b":")[1].strip()
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
            body = b'{"rid": "%s"}' % rid
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    server, url = await _raw_server(handle)
    async with server, VllmClient(url) as c:
        assert [(await c.post_json("/x", {}, r))["rid"] for r in ("A", "B", "C")] == ["A", "B", "C"]


async def test_a_second_answer_to_one_request_is_not_read_into_the_first_and_drops_the_connection():
    async def handle(reader, writer, n):
        await _read_request(reader)
        writer.write(OK + b"HTTP/1.1 500 Oops\r\nContent-Length: 7\r\n\r\n{\"b\":2}")
        await writer.drain()
        if n == 0:
            await asyncio.sleep(0.2)

    server, url = await _raw_server(handle)
    async with server, VllmClient(url) as c:
        assert await c._post("/x", b"{}", {}) == (200, b'{"ok": true}')
        assert await c.post_json("/x", {}, "r2") == {"ok": True}  # on a new connection: no stray answer read


async def test_an_answer_without_length_ends_where_the_connection_does():
    async def handle(reader, writer, n):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{\"ok\": true}")
        await writer.drain()

    server, url = await _raw_server(handle)
    async with server, VllmClient(url) as c:
        assert await c.post_json("/x", {}, "r") == {"ok": True}  # not a worker gone


async def test_a_connection_left_with_reading_paused_is_not_reused():
    """A stream's last bytes arrive while more than the high-water mark is buffered (reading paused, answer
    complete) and the reader stops early: the connection must not serve the next call with reading paused."""
    big = _sse(b'{"id": "d", "choices": [], "pad": "%s"}' % (b"x" * 400_000), b"[DONE]")

    async def handle(reader, writer, n):
        while True:
            request = await _read_request(reader)
            if b"/big" in request.split(b"\r\n")[0]:
                answer = _sse(b'{"id": "d", "choices": []}') + big
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
            else:
                writer.write(OK)
            await writer.drain()

    server, url = await _raw_server(handle)
    async with server, VllmClient(url, timeout_s=20) as c:
        async with contextlib.aclosing(c.stream_events("/big", BODY, "r1")) as events:
            async for _ in events:
                await asyncio.sleep(0.3)  # everything arrives meanwhile; then the reader leaves
                break
        t0 = time.monotonic()
        assert await c.post_json("/small", {}, "r2") == {"ok": True}
        assert time.monotonic() - t0 < 10.0  # answered, not left to the read timeout


async def test_the_read_timeout_holds_when_another_task_reads_the_rest_of_a_stream():
    """The first event read in one task, the rest in another (as a response streamed by a task of its own):
    a worker that stalls is still timed out."""
    async def handle(reader, writer, n):
        await _read_request(reader)
        event = _sse(b'{"id": "d", "choices": []}')
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(30)

    server, url = await _raw_server(handle)
    async with server, VllmClient(url, timeout_s=0.3) as c:
        events = c.stream_events("/x", BODY, "r")
        await asyncio.create_task(events.__anext__())
        t0 = time.monotonic()
        with pytest.raises(BackendError) as ei:
            await asyncio.wait_for(asyncio.create_task(_drain(events)), 20)
        # timed out, not ended by the stand-in (30 s), with room for pauses of this process
        assert ei.value.status_code == 504 and time.monotonic() - t0 < 10.0
        await events.aclose()


async def test_https_to_a_plain_worker_and_a_header_with_a_line_break_are_errors_not_a_worker_gone(worker):
    url, seen = worker
    async with VllmClient(url.replace("http://", "https://")) as c:
        with pytest.raises(BackendError) as ei:
            await c.post_json(CHAT_PATH, BODY, "r")
        assert ei.value.status_code == 502 and not ei.value.unreachable and "https" in str(ei.value.body)
    async with VllmClient(url) as c:
        with pytest.raises(BackendError) as ei:
            await c.post_json(CHAT_PATH, BODY, "r\r\nX-Injected: 1")
        assert not ei.value.unreachable and "CR or LF" in str(ei.value.body)
    assert seen == []  # nothing reached the worker


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


# The silence the stall tests judge by: longer than any pause a loaded machine gives this process, so a
# stream producing every 0.05 s never reads as silent for it (the producer is in this process too).
SILENCE_S = 2.5


async def _until(cond, timeout_s: float = 10.0) -> None:
    """Wait (polling every 10 ms) until `cond()` is true; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _stall_or_produce(writer, path: bytes) -> None:
    """A stream stand-in's answer to `path`: "/stall" sends the head and one event, then nothing for 30 s;
    any other path an event every 0.05 s for 2 * SILENCE_S, then `[DONE]`."""
    if b"/stall" in path:
        writer.write(SSE_HEAD + _chunk(_sse(b'{"id": "d", "choices": []}')))
        await writer.drain()
        await asyncio.sleep(30)
        return
    writer.write(SSE_HEAD)
    for _ in range(int(2 * SILENCE_S / 0.05)):
        await asyncio.sleep(0.05)
        writer.write(_chunk(_sse(b'{"id": "d", "choices": []}')))
    writer.write(_chunk(_sse(b"[DONE]")) + b"0\r\n\r\n")
    await writer.drain()


async def test_calls_silent_past_the_bound_are_abandoned_as_a_worker_gone_and_a_producing_one_is_not():
    """`abandon_silent` (a worker judged down): a call whose answer never began and a stream that stopped
    sending fail as a dropped connection does (502, unreachable), at once, and the hung call is not sent again
    on a new connection (as a reused connection closed before any byte of an answer would be); a stream still
    sending events, and a call on a fresh bound, are left alone and end normally."""
    requests: list[bytes] = []

    async def handle(reader, writer, n):
        while True:
            request = await _read_request(reader)
            requests.append(request.split(b"\r\n")[0])
            if b"/ok" in requests[-1]:
                writer.write(OK)
            elif b"/hang" in requests[-1]:
                await asyncio.sleep(30)
            else:
                await _stall_or_produce(writer, requests[-1])
            await writer.drain()

    server, url = await _raw_server(handle)
    async with server, VllmClient(url) as c:
        assert await c.post_json("/ok", {}, "o") == {"ok": True}  # the hung call reuses its connection
        hung = asyncio.create_task(c.post_json("/hang", {}, "h"))
        stalled_events: list[dict] = []

        async def stalled() -> None:
            async for _, chunk in c.stream_events("/stall", BODY, "s"):
                stalled_events.append(chunk)

        stall = asyncio.create_task(stalled())
        produced: list[dict] = []

        async def producing_stream() -> None:
            async for _, chunk in c.stream_events("/produce", BODY, "p"):
                produced.append(chunk)

        producing = asyncio.create_task(producing_stream())
        await _until(lambda: stalled_events and produced)
        await asyncio.sleep(SILENCE_S + 0.2)
        assert not producing.done()  # still sending an event every 0.05 s
        assert c.abandon_silent(10 * SILENCE_S) == 0  # nothing is silent that long
        assert c.abandon_silent(SILENCE_S) == 2
        for task in (hung, stall):
            with pytest.raises(BackendError) as ei:
                await asyncio.wait_for(task, 10)
            # failed by the abandon itself (not by a read timeout, 600 s here, nor by the stand-in's 30 s end)
            assert ei.value.status_code == 502 and ei.value.unreachable, ei.value
            assert "judged down" in str(ei.value), ei.value
        assert len(stalled_events) == 1
        await asyncio.wait_for(producing, 30)  # untouched: read to its [DONE]
    assert requests.count(b"POST /hang HTTP/1.1") == 1


async def test_the_stall_verdict_leaves_out_paused_and_unsteady_streams():
    """A stream its caller does not read (reading paused) says nothing of the engine now, so it cannot hide
    a stalled one; a stream sent with a `stream_interval` above 1, or with `tools`, may pause for many steps of
    a live engine, so its silence is no evidence (runtime.engines.client.steady_stream)."""
    event = _chunk(_sse(b'{"id": "d", "choices": [], "pad": "' + b"x" * 1000 + b'"}'))

    async def handle(reader, writer, n):
        while True:
            path = (await _read_request(reader)).split(b"\r\n")[0]
            writer.write(SSE_HEAD + (event * 600 if b"/flood" in path else event))
            await writer.drain()
            await asyncio.sleep(30)

    server, url = await _raw_server(handle)
    async with server, VllmClient(url) as c:
        unread = c.stream_events("/flood", BODY, "f")
        await unread.__anext__()  # one event read, then nobody reads: 600 KB arrive, reading pauses
        tasks = [asyncio.create_task(_drain(c.stream_events("/interval", {**BODY, "stream_interval": 1000}, "i"))),
                 asyncio.create_task(_drain(c.stream_events("/tools", {**BODY, "tools": [{"type": "function"}]},
                                                            "t")))]
        await _until(lambda: any(conn.paused for conn in c._pool._busy)
                     and sum(bool(conn.body_rx) for conn in c._pool._busy) == 3)
        await asyncio.sleep(0.5)
        assert c.stall_verdict(0.3) is None  # the paused and the unsteady streams judge nothing
        tasks.append(asyncio.create_task(_drain(c.stream_events("/stall", BODY, "s"))))
        await _until(lambda: sum(bool(conn.body_rx) for conn in c._pool._busy) == 4)
        await asyncio.sleep(0.5)
        assert c.stall_verdict(0.3) is True  # the silent steady stream is judged, the paused one hides nothing
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await unread.aclose()


async def test_the_stall_verdict_judges_begun_streams_and_counts_queue_waits_only_when_asked():
    """`stall_verdict`: a hung call (no answer yet) and a stream whose head came but no chunk (a queue wait)
    give nothing to judge by (None) unless `waiting`; a stream past its first chunk silent for the window makes
    it True; one more stream still producing makes it False."""

    async def handle(reader, writer, n):
        while True:
            path = (await _read_request(reader)).split(b"\r\n")[0]
            if b"/hang" in path:
                await asyncio.sleep(30)
            elif b"/queued" in path:
                writer.write(SSE_HEAD)
                await writer.drain()
                await asyncio.sleep(30)
            else:
                await _stall_or_produce(writer, path)

    server, url = await _raw_server(handle)
    async with server, VllmClient(url) as c:
        tasks = [asyncio.create_task(c.post_json("/hang", {}, "h")),
                 asyncio.create_task(_drain(c.stream_events("/queued", BODY, "q")))]
        await _until(lambda: len(c._pool._busy) == 2 and any(conn.status is not None for conn in c._pool._busy))
        await asyncio.sleep(SILENCE_S + 0.2)
        assert c.stall_verdict(SILENCE_S) is None and c.stall_verdict(SILENCE_S, waiting=True) is True
        tasks.append(asyncio.create_task(_drain(c.stream_events("/stall", BODY, "s"))))
        await _until(lambda: any(conn.body_rx for conn in c._pool._busy))
        await asyncio.sleep(SILENCE_S + 0.2)
        assert c.stall_verdict(SILENCE_S) is True and c.stall_verdict(10 * SILENCE_S) is False
        tasks.append(asyncio.create_task(_drain(c.stream_events("/produce", BODY, "p"))))
        await _until(lambda: sum(bool(conn.body_rx) for conn in c._pool._busy) == 2)
        assert c.stall_verdict(SILENCE_S) is False and c.stall_verdict(SILENCE_S, waiting=True) is False
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
