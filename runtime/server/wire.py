"""The runtime's HTTP/1.1 server protocol: uvicorn's httptools protocol, with a response's head sent in one
write with the start of its body.

Why: uvicorn writes the status line and headers to the socket as soon as the app sends
`http.response.start`, and the body in a second write, though most answers send the two back to back: every
non-streamed answer (a completion, an error, a health check, a metrics page) is a head and one body piece.
Each write to an idle client wakes it, and a client woken by the head reads it between the two writes: two
system calls and two wake-ups where one does. The ASGI specification has the server hold the head until the
first body message ("The protocol server must not start sending the response to the client until it has
received at least one Response Body event", asgi.readthedocs.io/en/latest/specs/www.html, Response Start);
this protocol does so. (A stream's head goes out alone, early, by design: runtime.server.direct.)

Semantics: the head is written together with the next write on the connection (the first body piece), or
at the end of the event loop's current iteration, whichever comes first, so an app that sends its head and
then waits still has it on the wire at once; the connection's bytes keep their order; closing the
connection writes a held head first; aborting drops it, as it drops the transport's own buffer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: how every response head uvicorn writes begins (uvicorn.protocols.utils STATUS_LINE)
_HEAD_PREFIX = b"HTTP/1.1 "


class _HeadHoldingTransport:
    """A transport that holds a response head (a write of a whole head: status line to the blank line) until
    the next write or the end of the loop's iteration; everything else passes to `transport` unchanged."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif data.startswith(_HEAD_PREFIX) and data.endswith(b"\r\n\r\n"):
            self._held = data
            self._loop.call_soon(self._flush)
            return
        self._transport.write(data)

    def _flush(self) -> None:
        if self._held is not None:
            data, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()


class HeadCoalescingProtocol(HttpToolsProtocol):
    """uvicorn's httptools HTTP/1.1 protocol whose response heads go out with the first body write (see the
    module docstring). Select it with `uvicorn.Config(http=HeadCoalescingProtocol)`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadHoldingTransport(transport, self.loop))
