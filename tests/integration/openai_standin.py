"""A real HTTP server on 127.0.0.1 that answers OpenAI completions the way a loaded endpoint can: with
throttling (429/503), client errors (400) and slow answers — on demand, which no real vLLM does
deterministically. For the batch runner's retry / resume / concurrency tests.

A prompt (``prompt`` or the last message's ``content``) chooses the behaviour:
``"fail-N ..."`` answers 503 to its first N tries, ``"always-503"`` always 503, ``"bad"`` 400 with an OpenAI
error body, ``"html"`` 200 with an HTML page, ``"nan"`` 200 with a NaN in its JSON, ``"bad-gzip"`` 200 claiming
gzip over bytes that are not; ``"slow ..."`` waits 1 s; anything else 200 with ``usage`` (prompt_tokens = words of the prompt, completion_tokens =
``max_tokens`` or 4). Every request is recorded (path, body, Authorization header); ``max_in_flight`` is the
most requests the server held at once (each answer waits ``delay_s``).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class OpenAIStandin:
    def __init__(self, delay_s: float = 0.05, prefix: str = "/openai") -> None:
        self.delay_s, self.prefix = delay_s, prefix
        self.requests: list[dict] = []
        self.tries: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                standin._answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{self.prefix}"

    def start(self) -> "OpenAIStandin":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def _answer(self, h: BaseHTTPRequestHandler) -> None:
        body = json.loads(h.rfile.read(int(h.headers.get("Content-Length", 0))) or b"{}")
        prompt = body.get("prompt") or (body.get("messages") or [{}])[-1].get("content", "")
        with self._lock:
            self.requests.append({"path": h.path, "body": body, "auth": h.headers.get("Authorization")})
            self.tries[prompt] = self.tries.get(prompt, 0) + 1
            tries = self.tries[prompt]
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(1.0 if prompt.startswith("slow") else self.delay_s)
            if not h.path.startswith(self.prefix + "/v1/"):
                status, out = 404, {"detail": "Not Found"}  # the web framework's page for an unknown path
            elif body.get("model") == "unknown":  # KServe's answer for a model it does not serve
                status, out = 404, {"error": f"Model with name {body['model']} does not exist."}
            elif prompt == "always-503" or (prompt.startswith("fail-") and tries <= int(prompt.split()[0][5:])):
                status, out = 503, {"error": {"message": "overloaded"}}
            elif prompt == "bad":
                status, out = 400, {"error": {"message": "max_tokens must be positive", "type": "BadRequestError"}}
            elif prompt in ("html", "nan", "bad-gzip"):
                status, out = 200, prompt
            else:
                n = int(body.get("max_tokens") or 4)
                status, out = 200, {"id": "cmpl-1", "object": "text_completion", "model": body.get("model"),
                                    "choices": [{"index": 0, "text": " ok" * n}],
                                    "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": n}}
        finally:
            with self._lock:
                self.in_flight -= 1
        headers = {"Content-Type": "application/json"}
        if out == "html":
            data, headers = b"<html><body>Service Unavailable</body></html>", {"Content-Type": "text/html"}
        elif out == "nan":
            data = b'{"id": "c", "choices": [], "usage": {"prompt_tokens": NaN, "completion_tokens": 1}}'
        elif out == "bad-gzip":
            data, headers = b"this is not gzip", {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        else:
            data = json.dumps(out).encode()
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.send_header("x-request-id", f"req-{len(self.requests)}")
        h.end_headers()
        h.wfile.write(data)
