"""A loopback proxy in front of one real worker that breaks a streamed answer at a chosen chunk (tests).

Real vLLM workers die wherever a kill finds them; a test of what happens after a cut at a given place in the
text (right after a newline, say) needs the cut placed. `CuttingProxy` forwards every request to its upstream
worker (HTTP/1.1 on 127.0.0.1, its own port) and passes answers through; a streamed `POST` whose path ends
with `cut_path` is cut once: after the first `data:` chunk (of at least `min_chunks` with text) that makes choice
0's text so far end with `cut_after`, the proxy closes the connection without ending the chunked body, as a
worker that died there would. The upstream request is closed with it (vLLM aborts the request).
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade"}


class CuttingProxy:
    """Forward to `upstream` ("http://host:port"); cut the first qualifying stream (see the module docstring).

    Attributes:
        url: the proxy's base URL.
        cuts: choice 0's text before each cut (one entry per cut stream).
        forwarded: paths of the requests forwarded, in order.
    """

    def __init__(self, upstream: str, *, cut_path: str = "/v1/chat/completions", cut_after: str = "\n",
                 min_chunks: int = 2) -> None:
        self.upstream, self.cut_path, self.cut_after, self.min_chunks = upstream.rstrip("/"), cut_path, cut_after, \
            min_chunks
        self.cuts: list[str] = []
        self.forwarded: list[str] = []
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # noqa: ANN002
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP and k.lower() != "host"}
                proxy.forwarded.append(self.path)
                with proxy._client.stream(self.command, proxy.upstream + self.path, content=body,
                                          headers=headers) as r:
                    streamed = r.headers.get("content-type", "").startswith("text/event-stream")
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in _HOP:
                            self.send_header(k, v)
                    if not streamed:
                        data = r.read()
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data)
                        return
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    with proxy._lock:
                        armed = self.command == "POST" and self.path.endswith(proxy.cut_path) and not proxy.cuts
                    texts, so_far = 0, ""
                    for line in r.iter_lines():
                        piece = (line + "\n").encode()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        self.wfile.flush()
                        text = _choice_text(line)
                        texts, so_far = texts + bool(text), so_far + text
                        if armed and text and texts >= proxy.min_chunks and so_far.endswith(proxy.cut_after):
                            with proxy._lock:
                                proxy.cuts.append(so_far)
                            self.close_connection = True
                            self.connection.shutdown(socket.SHUT_RDWR)  # no last chunk: the stream broke
                            return
                    self.wfile.write(b"0\r\n\r\n")

            do_GET = do_POST = _forward  # noqa: N815

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "CuttingProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(10)
        self._client.close()


def _choice_text(line: str) -> str:
    """Choice 0's text (chat `delta.content` or completion `text`) of one SSE line; "" for any other line."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ""
    try:
        choices = json.loads(line[len("data: "):]).get("choices") or ()
    except (ValueError, AttributeError):
        return ""
    c = choices[0] if choices and isinstance(choices[0], dict) else {}
    return ((c.get("delta") or {}).get("content") or c.get("text") or "") if isinstance(c, dict) else ""
