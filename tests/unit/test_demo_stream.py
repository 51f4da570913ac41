"""The demo's streaming client: joins the content deltas and measures TTFT at the first non-empty one
(a role-only first chunk must not count), against a real HTTP server on 127.0.0.1 sending SSE."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runtime.demo import stream_chat

CHUNKS = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
          {"choices": [{"delta": {"content": "The capital"}}]},
          {"choices": [{"delta": {"content": " is Paris."}}]},
          {"choices": [{"delta": {}, "finish_reason": "stop"}]}]
EMPTY_CHUNKS = [CHUNKS[0], CHUNKS[-1]]


class _SSE(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert body["stream"] is True
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        question = body["messages"][0]["content"]
        chunks = EMPTY_CHUNKS if question == "empty" else CHUNKS[:2] if question == "truncated" else CHUNKS
        for c in chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
        if question != "truncated":  # "truncated": the connection closes without the [DONE] sentinel
            self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def sse_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    t.join(timeout=5)


def test_stream_chat_joins_deltas_and_times_the_first_token(sse_server):
    res = stream_chat(sse_server, "m", "What is the capital of France?", max_tokens=8)
    assert res.answer == "The capital is Paris."
    assert 0 <= res.ttft_s <= res.total_s


def test_a_stream_that_closes_before_done_is_an_error_not_a_short_answer(sse_server):
    with pytest.raises(RuntimeError, match=r"closed before 'data: \[DONE\]' after 1 content chunk"):
        stream_chat(sse_server, "m", "truncated", max_tokens=8)


def test_an_empty_answer_has_no_ttft_and_serialises_as_strict_json(sse_server):
    res = stream_chat(sse_server, "m", "empty", max_tokens=8)
    assert res.answer == "" and res.ttft_s is None and res.total_s >= 0
    assert json.dumps({"ttft_s": [res.ttft_s]}, allow_nan=False) == '{"ttft_s": [null]}'
