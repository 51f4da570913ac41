"""A loopback stand-in for a vLLM worker's /metrics page in tests (127.0.0.1, a port of its own)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class MetricsWorker:
    """Answers GET /metrics with ``body`` (Prometheus text; other paths 404). ``mode``: "ok" answers ``body``,
    "error" answers 503, "slow" holds the answer while ``mode`` stays "slow" (past any read deadline); set
    ``body`` and ``mode`` at any time. ``url`` is the page's URL; ``close()`` stops the server."""

    def __init__(self, body: bytes) -> None:
        self.body, self.mode, self.closing = body, "ok", threading.Event()
        worker = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # noqa: ANN002
                pass

            def do_GET(self):  # noqa: N802
                while worker.mode == "slow" and not worker.closing.wait(0.05):  # until the test moves on
                    pass
                ok = worker.mode == "ok"
                body = worker.body if ok else b"overloaded\n"
                self.send_response(404 if self.path != "/metrics" else 200 if ok else 503)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.closing.is_set():
            return
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
