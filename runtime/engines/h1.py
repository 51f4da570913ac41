"""HTTP/1.1 to one worker: keep-alive connections on asyncio protocols, responses parsed by httptools.

Why not a general client: every request crosses the runtime twice (the prefill answer, the decode stream), so
the worker calls are most of the runtime's own CPU per request (bench/frontend.py, docs/benchmarks.md "Front
door"). The runtime needs little of HTTP from its workers: POST a JSON body and read the status and the body
as it arrives, GET a small page; to an address from configuration (http, or https with the system's trust
store), no proxies, redirects, cookies or compression. A general client (aiohttp, httpx) builds
request and response objects, header multidicts, a writer task and timers per call for what it must support;
here a call is one `transport.write` of the request and httptools' callbacks (llhttp, the parser uvicorn
uses) appending the body's pieces to a deque.

Semantics the callers rely on (runtime/engines/client.py):
* responses framed by Content-Length, chunked encoding or the end of the connection (RFC 9112 6.3); interim
  1xx answers (100 Continue, 103 Early Hints) skipped; the response headers are not kept (the runtime reads the
  status and the body only); a second answer to one request fails the call and drops the connection;
* a connection is reused when its response ended, both sides keep it alive and its reading is not paused;
  one whose response was not read to its end (a cancelled call, an error) is closed, which also tells the
  worker to stop the request;
* `H1Pool.abandon_silent` fails the calls in flight that have received nothing for a given time (a worker the
  runtime has judged down: runtime.server.breakers) as a dropped connection would (`gone` True) and closes
  their connections; a call whose answer is still arriving, or whose reading is paused, is left alone;
* `H1Pool.stall_verdict` says whether the streams in flight show the worker stalled (every answer that has
  begun silent for a given time: runtime.server.breakers);
* a request written to a reused idle connection that the worker closes before any byte of the answer (the
  worker's keep-alive timeout raced with the call) is sent once more on a new connection: no answer byte
  came, so the worker did not take the request (uvicorn closes only idle connections);
* `H1Error` for a connection refused, reset or closed before the response ended (`gone` True), or an
  answer that is not HTTP, a failed TLS handshake, a request that cannot be written (a path that is not
  ASCII, a header with CR or LF: nothing is sent) (`gone` False); timeouts are the caller's
  (`asyncio.timeout`, `_ReadDeadline`).
"""

from __future__ import annotations

import asyncio
import base64
import ssl as _ssl
import urllib.parse
from collections import deque

import httptools

#: body bytes a connection buffers before it stops reading from its socket until the caller catches up
#: (the worker's writes then wait in the kernel's buffers: back-pressure, as aiohttp's reader applies)
_HIGH_WATER = 1 << 18


class H1Error(ConnectionError):
    """A call failed on the wire. `gone`: the connection could not be made or dropped before the answer
    ended (the worker looks gone); False when the worker answered something that is not HTTP/1.1."""

    def __init__(self, message: str, *, gone: bool) -> None:
        super().__init__(message)
        self.gone = gone


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one call at a time. The parser's callbacks fill `status` and `pieces`."""

    __slots__ = ("transport", "parser", "status", "pieces", "buffered", "complete", "keep_alive", "closed",
                 "error", "waiter", "received", "paused", "interim", "framed", "idle_in", "last_rx",
                 "abandoned", "body_rx", "steady", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.error: H1Error | None = None
        self.waiter: asyncio.Future | None = None
        self.paused = False
        self.idle_in: dict[_Connection, None] | None = None  # the pool's idle set while it waits there
        # loop time of the last bytes received, or of the request's write when none came since: one clock read
        # per socket read, what `H1Pool.abandon_silent` judges silence by (no timer per call or chunk)
        self.last_rx = loop.time()
        self.abandoned = False  # failed by `H1Pool.abandon_silent`: the call is not sent again
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status: int | None = None
        self.pieces: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of this call's answer
        self.interim = False  # inside a 1xx answer (103 Early Hints, 100 Continue): not the call's answer
        self.framed = False  # the answer names its length (Content-Length or Transfer-Encoding)
        # a piece of this call's answer body came: a stream past its first chunk (vLLM writes a stream's head as
        # it takes the request and its first chunk with the first token), what `H1Pool.stall_verdict` judges by
        self.body_rx = False
        # its answer streams a piece at every engine step (`H1Pool.request`'s `steady`), so its silence is
        # evidence of a stalled engine
        self.steady = True

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # idle between calls: bytes nobody asked for; the connection is not reusable
            self.closed = True
            self.transport.close()
            return
        self.received = True
        self.last_rx = self._loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(H1Error(f"the worker's answer is not HTTP/1.1: {exc}", gone=False))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.idle_in is not None:  # the worker closed it between calls (its keep-alive timeout): drop it now
            self.idle_in.pop(self, None)
            self.idle_in = None
        if exc is None and self.status is not None and not self.framed and not self.complete \
                and self.error is None and self.parser is not None:
            # an answer without Content-Length or chunking ends where the connection does (RFC 9112 6.3)
            self.complete = True
            self._wake()
            return
        if not self.complete:
            detail = f": {exc}" if exc else ""
            self._fail(H1Error(f"connection closed before the answer ended{detail}", gone=True))

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # an interim answer; the call's own follows (RFC 9110 15.2)
            self.interim, self.framed = True, False
            return
        if self.status is not None:  # a second answer to one request: the stream is out of step
            self._fail(H1Error("the worker answered one request twice", gone=False))
            self.transport.close()
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.complete or self.error is not None:
            return
        self.body_rx = True
        self.pieces.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.error is None:
            self.complete = True
        self._wake()

    # --
    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def _fail(self, error: H1Error) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    async def wait(self) -> None:
        """Until the parser or the socket has news (head, a body piece, the end, an error)."""
        if self.error is not None:
            raise self.error
        self.waiter = self._loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None and not self.complete:
            raise self.error

    def take(self) -> bytes | None:
        """The next buffered body piece; None when none is buffered."""
        if not self.pieces:
            return None
        piece = self.pieces.popleft()
        self.buffered -= len(piece)
        if self.paused and self.buffered <= _HIGH_WATER // 4:
            self.paused = False
            self.transport.resume_reading()
        return piece


class Response:
    """A response being read: `status`, then the body's pieces with `read_piece` (None at its end)."""

    __slots__ = ("status", "_conn", "_pool")

    def __init__(self, conn: _Connection, pool: "H1Pool") -> None:
        self._conn, self._pool = conn, pool
        self.status = conn.status

    async def read_piece(self) -> bytes | None:
        """The body's next piece as it arrives, None at the end. Raises H1Error."""
        conn = self._conn
        while True:
            piece = conn.take()
            if piece is not None:
                return piece
            if conn.complete:
                return None
            await conn.wait()

    async def read(self) -> bytes:
        """The rest of the body. Raises H1Error."""
        parts = []
        while (piece := await self.read_piece()) is not None:
            parts.append(piece)
        return b"".join(parts)

    def release(self) -> None:
        """Give the connection back: kept for reuse when the answer ended and both sides keep it alive,
        else closed (an unread answer must not be read by the next call). Idempotent."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._release(conn)


class H1Pool:
    """Keep-alive connections to one `host`:`port`, no cap on their number (the worker's scheduler queues
    what it cannot run; a cap here would only add a second queue). Made and used on one event loop."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"{base_url!r}: a worker URL is http(s)://HOST[:PORT][/PATH]")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.connect_timeout_s = connect_timeout_s
        self._prefix = u.path.rstrip("/")  # a worker behind a path prefix: every call's path goes below it
        self._ssl = _ssl.create_default_context() if u.scheme == "https" else None
        self._host_header = u.netloc.rsplit("@", 1)[-1].encode("idna")
        # credentials in the URL (http://user:password@host) become HTTP Basic auth, as httpx and browsers send
        # them (RFC 7617); the Host header and every message name the host alone
        self._auth = b""
        if u.username is not None:
            pair = f"{urllib.parse.unquote(u.username)}:{urllib.parse.unquote(u.password or '')}"
            self._auth = b"\r\nAuthorization: Basic " + base64.b64encode(pair.encode("utf-8"))
        # idle connections, most recently released last (reused first: the least likely to have timed out);
        # one the worker closes leaves at once (`_Connection.connection_lost`)
        self._idle: dict[_Connection, None] = {}
        self._busy: set[_Connection] = set()  # connections of calls in flight (`abandon_silent`)
        self._closed = False

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop), self.host, self.port,
                                                       ssl=self._ssl)
        except TimeoutError:
            raise H1Error(f"connect to {self.host}:{self.port} timed out", gone=True) from None
        except _ssl.SSLError as exc:  # a worker that is there but speaks no TLS, or not ours: a configuration fault
            raise H1Error(f"TLS with {self.host}:{self.port} failed: {exc} (does the worker serve https?)",
                          gone=False) from None
        except OSError as exc:
            raise H1Error(f"cannot connect to {self.host}:{self.port}: {exc}", gone=True) from None
        return conn

    def _head(self, method: bytes, path: str, headers: dict[str, str], length: int | None) -> bytes:
        target = (self._prefix + path).encode("ascii")
        lines = [method + b" " + target + b" HTTP/1.1\r\nHost: " + self._host_header + self._auth]
        for k, v in headers.items():
            line = f"{k}: {v}"
            if "\r" in line or "\n" in line:  # would end the header and start another, or the body
                raise ValueError(f"header {k!r}: CR or LF in a header")
            lines.append(line.encode("latin-1"))
        if length is not None:
            lines.append(b"Content-Length: %d" % length)
        lines.append(b"\r\n")
        return b"\r\n".join(lines)

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes | None = None, *,
                      steady: bool = True) -> Response:
        """Send one request and wait for the final answer's status line and headers (1xx answers skipped).
        `steady` False: its answer may pause for many engine steps while the engine works (`stall_verdict`
        leaves it out). Raises H1Error (also for a path that is not ASCII or a header that is not Latin-1 or
        holds CR or LF: nothing is sent)."""
        if self._closed:
            raise H1Error("the client is closed", gone=False)
        try:
            data = self._head(method.encode("ascii"), path, headers, None if body is None else len(body))
        except (UnicodeEncodeError, ValueError) as exc:  # the caller's own path or header: nothing is sent
            raise H1Error(f"cannot send the request: {exc}", gone=False) from None
        if body:
            data += body
        while True:
            reused = False
            conn = None
            while self._idle:
                c, _ = self._idle.popitem()
                c.idle_in = None
                if not c.closed:
                    conn, reused = c, True
                    break
            if conn is None:
                conn = await self._connect()  # a new connection starts reset
            else:
                conn._reset()
            conn.steady = steady
            conn.transport.write(data)
            conn.last_rx = conn._loop.time()  # silence counts from the request's write
            self._busy.add(conn)
            try:
                while conn.status is None:
                    await conn.wait()
            except H1Error:
                self._busy.discard(conn)
                conn.transport.close()
                # the worker closed an idle connection as it was reused; not a call abandoned as silent, which
                # would only be sent to the worker judged down once more
                if reused and not conn.received and not conn.abandoned:
                    continue
                raise
            except BaseException:  # cancelled or timed out: the answer is not read, so the connection goes
                self._busy.discard(conn)
                conn.transport.close()
                raise
            return Response(conn, self)

    def _release(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if conn.complete and conn.keep_alive and not conn.closed and not self._closed and conn.error is None \
                and not conn.paused:  # paused: its reading would stay stopped for the next call
            conn.parser = None  # a new one per call (`_reset`); the old one holds a reference to conn
            self._idle[conn] = None
            conn.idle_in = self._idle
        else:
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()

    def abandon_silent(self, silent_s: float) -> int:
        """Fail every call in flight that has received no byte for `silent_s` seconds or more (counted from
        its request's write when nothing came since) with `H1Error` (`gone` True: as a worker that dropped
        the connection) and close its connection, which also tells the worker to stop the request. A call
        whose reading is paused (its caller has not read what came) or whose answer has ended is left alone.
        Returns the number of calls failed."""
        failed = 0
        for conn in list(self._busy):
            if conn.paused or conn.complete or conn.error is not None or conn.closed:
                continue
            silent = conn._loop.time() - conn.last_rx
            if silent < silent_s:
                continue
            conn.abandoned = True
            conn._fail(H1Error(f"nothing received from {self.host}:{self.port} for {silent:.1f} s from a worker "
                               "judged down: the call is abandoned", gone=True))
            conn.closed = True
            conn.transport.close()
            self._busy.discard(conn)
            failed += 1
        return failed

    def stall_verdict(self, window_s: float, *, waiting: bool = False) -> bool | None:
        """Whether the calls in flight show the worker stalled (its engine stopped generating).

        True: some answer in flight has begun (a body piece came: a stream past its first chunk) and every
        such answer has received nothing for `window_s` seconds or more. False: one of them received a byte
        within `window_s` seconds. None: no answer in flight has begun, so there is nothing to judge by: a
        stream waiting in the engine's queue and a non-streamed answer show nothing until they start or end.
        Left out either way: a call whose reading is paused (its caller reads slower than the worker writes:
        what the worker does now is not seen) and one sent as not `steady` (an answer that may pause for many
        steps of a live engine: a client's `stream_interval`, a tool-call parser holding deltas). With `waiting`, a
        stream whose head came but no body piece, silent for `window_s` seconds since its head, counts as a
        silent stream too (never as a producing one): for a worker already judged stalled, whose queue
        waits no longer get the benefit of the doubt."""
        silent = False
        now = None
        for conn in self._busy:
            if conn.complete or conn.error is not None or conn.closed or conn.paused or not conn.steady:
                continue
            if now is None:
                now = conn._loop.time()
            if conn.body_rx:
                if now - conn.last_rx < window_s:
                    return False
                silent = True
            elif waiting and conn.status is not None and now - conn.last_rx >= window_s:
                silent = True
        return True if silent else None

    def close(self) -> None:
        """Close the idle connections; calls in flight close theirs when they release them."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for conn in idle:
            conn.idle_in = None
            conn.transport.close()
