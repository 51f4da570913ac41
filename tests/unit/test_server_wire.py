"""The runtime's HTTP/1.1 server protocol (runtime.server.wire): a response head goes out in one write with the
first piece of its body, or at the end of the loop's iteration when no body piece follows at once.

Specification: a head and a body piece sent back to back are one write on the socket; a head with no body
piece behind it is written before the loop waits again; bytes keep their order; closing writes a held head
first; aborting drops it. Against a real uvicorn server on 127.0.0.1: answers are intact (keep-alive, HEAD,
Content-Length and chunked bodies, `Expect: 100-continue`), and a head the app sends before a long wait
reaches the client before the body.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from runtime.server.wire import HeadCoalescingProtocol, _HeadHoldingTransport

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n"


class _Recorder:
    """A transport that records each write (the socket's writes)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


async def test_a_head_and_its_first_body_piece_are_one_write():
    rec = _Recorder()
    t = _HeadHoldingTransport(rec, asyncio.get_running_loop())
    t.write(HEAD)
    assert rec.writes == []
    t.write(b"5\r\nhello\r\n")
    t.write(b"0\r\n\r\n")
    assert rec.writes == [HEAD + b"5\r\nhello\r\n", b"0\r\n\r\n"]
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # everything else is the transport's


async def test_a_head_alone_is_written_before_the_loop_waits_again():
    rec = _Recorder()
    t = _HeadHoldingTransport(rec, asyncio.get_running_loop())
    t.write(HEAD)
    await asyncio.sleep(0)
    assert rec.writes == [HEAD]
    t.write(b"body")
    assert rec.writes == [HEAD, b"body"]


async def test_close_writes_a_held_head_first_and_abort_drops_it():
    rec = _Recorder()
    t = _HeadHoldingTransport(rec, asyncio.get_running_loop())
    t.write(HEAD)
    t.close()
    assert rec.writes == [HEAD] and rec.closed
    rec2 = _Recorder()
    t2 = _HeadHoldingTransport(rec2, asyncio.get_running_loop())
    t2.write(HEAD)
    t2.abort()
    await asyncio.sleep(0)
    assert rec2.writes == [] and rec2.aborted


async def test_uvicorns_own_protocol_writes_the_head_alone():
    """The case the protocol exists for: uvicorn's httptools protocol writes a head and its body apart."""
    writes = await _writes_of_one_answer(HttpToolsProtocol)
    assert writes[0].startswith(b"HTTP/1.1 200") and writes[0].endswith(b"\r\n\r\n") and len(writes) >= 2
    writes = await _writes_of_one_answer(HeadCoalescingProtocol)
    assert writes[0].startswith(b"HTTP/1.1 200") and writes[0].endswith(b"hello")


async def _writes_of_one_answer(protocol_cls) -> list[bytes]:
    """The socket writes of one GET answered with a head and one body piece by `protocol_cls`."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"hello"})

    config = uvicorn.Config(app, log_config=None, lifespan="off")
    config.load()
    server_state = uvicorn.server.ServerState()
    proto = protocol_cls(config=config, server_state=server_state, app_state={})
    rec = _Recorder()
    proto.connection_made(rec)
    proto.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    for _ in range(10):
        await asyncio.sleep(0)
    return rec.writes


class _Server:
    """uvicorn with HeadCoalescingProtocol serving `app` on 127.0.0.1 in a thread."""

    def __init__(self, app) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                                    lifespan="off", http=HeadCoalescingProtocol))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "_Server":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _recv_until(sock: socket.socket, end: bytes, timeout_s: float = 5.0) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while not data.endswith(end):
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return data


# Holds the body of "/slow" until set: its head must reach the client while the body waits, however long the
# machine takes to carry it.
SLOW_BODY = threading.Event()


async def _app(scope, receive, send):
    path = scope["path"]
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if path == "/slow":  # the head, then a wait (until the test lets it go), then the body
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await asyncio.get_running_loop().run_in_executor(None, SLOW_BODY.wait, 30.0)
        await send({"type": "http.response.body", "body": b"late", "more_body": False})
        return
    if path == "/chunked":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in (b"a", b"b", b"c"):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    answer = b"echo:" + body
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def server():
    with _Server(_app) as s:
        yield s


def test_answers_are_intact_on_one_keep_alive_connection(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n\r\nabc")
        first = _recv_until(sock, b"echo:abc")
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 8\r\n" in first
        sock.sendall(b"GET /chunked HTTP/1.1\r\nhost: t\r\n\r\n")
        second = _recv_until(sock, b"0\r\n\r\n")
        assert second.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in second
        assert second.endswith(b"1\r\na\r\n1\r\nb\r\n1\r\nc\r\n0\r\n\r\n")
        sock.sendall(b"HEAD /x HTTP/1.1\r\nhost: t\r\n\r\n")
        third = _recv_until(sock, b"\r\n\r\n")
        assert third.startswith(b"HTTP/1.1 200 OK\r\n") and third.endswith(b"\r\n\r\n")


def test_a_head_sent_before_a_wait_reaches_the_client_before_the_body(server):
    SLOW_BODY.clear()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
            head = _recv_until(sock, b"\r\n\r\n", timeout_s=20.0)  # the body is held until the head came
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
            SLOW_BODY.set()
            rest = _recv_until(sock, b"0\r\n\r\n")
            assert rest == b"4\r\nlate\r\n0\r\n\r\n"
    finally:
        SLOW_BODY.set()


def test_expect_100_continue_is_answered_before_the_body_is_sent(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n")
        assert _recv_until(sock, b"\r\n\r\n", timeout_s=3.0) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"ok")
        assert _recv_until(sock, b"echo:ok").startswith(b"HTTP/1.1 200 OK\r\n")
