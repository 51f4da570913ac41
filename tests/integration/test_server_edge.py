"""Malformed requests at the real runtime app's edge (KServe RESTServer built by runtime.server.app, in process
on 127.0.0.1) in front of a real loopback stand-in worker (http.server) that answers /health and records
every other request.

Specification: each malformed request (including those vLLM's request models reject with VLLMValidationError,
not a pydantic error: empty or null prompt, stream_options without stream, top_logprobs without logprobs) gets
a 4xx with an OpenAI error body naming no internal address (`{"error": {"message", "type",
"param", "code"}}`), never a 500; none reaches the worker; the server stays ready and healthy afterwards.
Wrong routes and methods under /openai/ answer OpenAI-shaped 404/405; GET /openai/v1/models/{id} answers the
model object or a 404; KServe's tensor inference routes answer 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

M = "m"
MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP = "/openai/v1/chat/completions", "/openai/v1/completions"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RecordingWorker:
    """A loopback worker: GET /health answers 200; every other request is recorded and answered 500."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    self.send_response(200)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                self._record()

            def do_POST(self) -> None:  # noqa: N802
                self._record()

            def _record(self) -> None:
                worker.requests.append(f"{self.command} {self.path}")
                self.send_response(500)
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "RecordingWorker":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@contextlib.asynccontextmanager
async def _runtime(worker: RecordingWorker, **rest_kw):
    """The real runtime app on 127.0.0.1 in front of `worker`, ready; yields a client of it. `rest_kw` goes to
    build_rest_server."""
    from prometheus_client import CollectorRegistry

    from runtime.server.app import build_model, build_rest_server, run_server

    model = build_model(M, prefill_urls=[], decode_urls=[worker.url], registry=CollectorRegistry())
    port = _free_port()
    rest = build_rest_server(model, host="127.0.0.1", http_port=port, **rest_kw)
    task = asyncio.create_task(run_server(rest, model, health_interval_s=0.2))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            for _ in range(400):
                try:
                    if (await c.get("/v2/health/ready")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
            else:
                pytest.fail("runtime never ready in front of a healthy worker")
            yield c
    finally:
        rest._server.should_exit = True  # uvicorn's own shutdown
        try:
            await asyncio.wait_for(task, 10)
        except BaseException:
            task.cancel()


def _raw(text: str) -> bytes:
    return text.encode()


# (method, path, JSON body or raw bytes, expected status, expected param or None)
CASES = [
    ("POST", CHAT, _raw('{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":NaN}'), 400,
     "temperature"),
    ("POST", CHAT, _raw('{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":Infinity}'),
     400, "temperature"),
    ("POST", CHAT, _raw('{"model":"m","messages":[{"role":"user","content":"hi"}],"top_p":NaN}'), 400, "top_p"),
    ("POST", COMP, _raw('{"model":"m","prompt":"x","temperature":-Infinity}'), 400, "temperature"),
    ("POST", COMP, _raw('{"model":"m","prompt":"x","frequency_penalty":NaN}'), 400, "frequency_penalty"),
    # a literal beyond a double's range reads as infinity, which the workers' JSON would carry as null (the
    # field's default): refused like Infinity itself
    ("POST", COMP, _raw('{"model":"m","prompt":"x","temperature":1e400}'), 400, "temperature"),
    ("POST", CHAT, _raw('{"model":"m","messages":[{"role":"user","content":"hi"}],"logit_bias":{"5":-1e400}}'),
     400, "logit_bias.5"),
    # a client's key of any length is named cut to 100 characters
    ("POST", COMP, _raw('{"model":"m","prompt":"x","extra":{"' + "k" * 5000 + '":NaN}}'), 400,
     "extra." + "k" * 91 + "..."),
    ("POST", COMP, _raw('{"model":"m","prompt":"x","extra":{"' + "k" * 5000 + '":"\\ud800"}}'), 400,
     "extra." + "k" * 91 + "..."),
    ("POST", CHAT, _raw('{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}'), 400,
     "messages[0].content"),
    ("POST", COMP, _raw('{"model":"m","prompt":"a\\udfffb"}'), 400, "prompt"),
    ("POST", COMP, _raw('{"model":"m","prompt":["ok","\\ud83d"]}'), 400, "prompt[1]"),
    ("POST", CHAT, _raw('{"model":"m","messages":[{"role":"user","content":"hi"}],"stop":["\\udc00"]}'), 400,
     "stop[0]"),
    ("POST", CHAT, {"model": M, "messages": MSG, "stream": "yes"}, 400, "stream"),
    ("POST", CHAT, {"model": M, "messages": MSG, "stream": "false"}, 400, "stream"),
    ("POST", COMP, {"model": M, "prompt": "x", "stream": 1}, 400, "stream"),
    ("POST", COMP, {"model": M, "prompt": "x", "stream": []}, 400, "stream"),
    ("POST", CHAT, {"model": M, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("POST", CHAT, {"model": M, "messages": [{"role": 3, "content": "x"}]}, 400, "messages[0].role"),
    ("POST", CHAT, {"model": M, "messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("POST", CHAT, {"model": M, "messages": [{"role": "USER", "content": "x"}]}, 400, "messages[0].role"),
    ("POST", CHAT, {"model": M, "messages": ["hi"]}, 400, "messages[0]"),
    ("POST", CHAT, {"model": M, "messages": [*MSG, {"role": None, "content": "x"}]}, 400, "messages[1].role"),
    ("POST", CHAT, {"model": M}, 400, "messages"),
    ("POST", CHAT, {"model": M, "messages": "hello"}, 400, "messages"),
    ("POST", CHAT, {"model": M, "messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("POST", CHAT, {"model": M, "messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    ("POST", CHAT, {"model": M, "messages": MSG, "stream_options": {"include_usage": True}}, 400, None),
    ("POST", CHAT, {"model": M, "messages": MSG, "top_logprobs": 5}, 400, None),
    ("POST", COMP, {"model": M, "prompt": ""}, 400, None),
    ("POST", COMP, {"model": M, "prompt": None}, 400, None),
    ("POST", COMP, {"model": M}, 400, None),
    ("POST", COMP, {"model": M, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("POST", COMP, {"model": M, "prompt": "x", "suffix": "tail"}, 400, "suffix"),
    ("POST", COMP, {"model": M, "prompt": "x", "n": 2, "temperature": 0}, 400, "n"),
    ("POST", CHAT, {"model": M, "messages": MSG, "n": 3, "temperature": 0.0}, 400, "n"),
    ("POST", CHAT, _raw('{"model": '), 400, None),
    ("POST", CHAT, _raw("[1, 2]"), 400, None),
    ("POST", CHAT, {"model": 7, "messages": MSG}, 400, "model"),
    ("POST", CHAT, {"model": "nope", "messages": MSG}, 404, "model"),
    ("POST", COMP, {"model": "nope", "prompt": "x"}, 404, "model"),
    ("POST", "/openai/v1/nothing", {"model": M}, 404, None),
    ("POST", "/openai/v2/chat/completions", {"model": M, "messages": MSG}, 404, None),
    ("GET", CHAT, None, 405, None),
    ("PUT", COMP, {"model": M, "prompt": "x"}, 405, None),
    ("DELETE", "/openai/v1/models", None, 405, None),
    ("GET", "/openai/v1/models/nope", None, 404, "model"),
    ("POST", "/openai/v1/embeddings", {"model": M, "input": "x"}, 400, None),
    ("POST", "/openai/v1/rerank", {"model": M, "query": "x", "documents": ["y"]}, 400, None),
    ("POST", f"/v1/models/{M}:predict", {"instances": [1]}, 404, None),
    ("POST", f"/v2/models/{M}/infer", {"inputs": []}, 404, None),
    # nested beyond MAX_BODY_DEPTH (128): below orjson's own limit (1,024), at it, and beyond Python's recursion
    # limit, in a field the request model keeps as it is (an extra field) and in one it checks
    *[("POST", COMP, _raw('{"model":"m","prompt":"x","extra":' + "[" * d + "]" * d + "}"), 400, None)
      for d in (129, 1000, 1024, 5000)],
    ("POST", CHAT, _raw('{"model":"m","messages":[{"role":"user","content":"hi"}],"metadata":'
                        + '{"a":' * 200 + "1" + "}" * 200 + "}"), 400, None),
]


async def test_malformed_requests_are_4xx_openai_errors_that_never_reach_a_worker():
    assert len(CASES) >= 40
    with RecordingWorker() as worker:
        async with _runtime(worker) as c:
            for method, path, body, status, param in CASES:
                kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(
                    body, bytes) else {} if body is None else {"json": body}
                r = await c.request(method, path, **kw)
                case = (method, path, body)
                assert r.status_code == status, (case, r.text)
                assert worker.url.split("//")[1] not in r.text, case
                err = r.json()["error"]
                if path.startswith("/openai/"):
                    assert set(err) == {"message", "type", "param", "code"}, (case, r.text)
                    assert err["code"] == status and err["message"], case
                    if param is not None:
                        assert err["param"] == param, (case, r.text)
                else:
                    assert "OpenAI API only" in err, case
            one = await c.get(f"/openai/v1/models/{M}")
            assert one.status_code == 200 and one.json()["id"] == M and one.json()["object"] == "model"
            listed = await c.get("/openai/v1/models")  # the same object, no null or empty field
            assert listed.status_code == 200 and listed.json() == {"object": "list", "data": [one.json()]}
            assert one.json()["owned_by"] == "pdserve" and all(v not in (None, "") for v in one.json().values())
            assert (await c.get("/v2/health/ready")).status_code == 200
            assert (await c.get(f"/v1/models/{M}")).status_code == 200
        assert worker.requests == []


async def test_a_body_sent_as_another_media_type_is_refused_as_vllm_refuses_it():
    # what curl -d sends without -H: FastAPI reads it as no object and its error names no cause; a body sent
    # without the header at all vLLM refuses too
    with RecordingWorker() as worker:
        async with _runtime(worker) as c:
            for path, ctype in ((CHAT, "application/x-www-form-urlencoded"), (COMP, "text/plain; charset=utf-8"),
                                (COMP, None)):
                body = b'{"model":"m","prompt":"x"}' if path == COMP else b'{"model":"m","messages":[]}'
                r = await c.post(path, content=body, headers={"content-type": ctype} if ctype else {})
                assert r.status_code == 400, r.text
                assert r.json() == {"error": {
                    "message": "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                    "type": "Bad Request", "param": None, "code": 400}}, r.text
        assert worker.requests == []


async def test_bodies_over_the_limit_are_413_unread_and_the_server_serves_on():
    """A body over `max_body_bytes` is refused 413 (OpenAI body, `connection: close`) whether it declares its
    length or is sent chunked; a body of exactly the limit passes the edge (here to its own 400); a declared
    length over it is refused on a non-OpenAI route too; nothing reaches the worker; the server stays ready."""
    limit = 4096

    def body(size: int) -> bytes:  # a request the edge passes and the request model refuses (n)
        head = b'{"model":"m","prompt":"x","n":2,"temperature":0,"pad":"'
        return head + b"a" * (size - len(head) - 2) + b'"}'

    async def chunked(data: bytes):
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    with RecordingWorker() as worker:
        async with _runtime(worker, max_body_bytes=limit) as c:
            at, over = body(limit), body(limit + 1)
            assert len(at) == limit and len(over) == limit + 1
            ok = await c.post(COMP, content=at, headers={"content-type": "application/json"})
            assert ok.status_code == 400 and ok.json()["error"]["param"] == "n", ok.text
            for content in (over, chunked(over), chunked(b"x" * (10 * limit))):
                r = await c.post(COMP, content=content, headers={"content-type": "application/json"})
                assert r.status_code == 413, r.text
                assert r.headers["connection"] == "close"
                err = r.json()["error"]
                assert err["code"] == 413 and str(limit) in err["message"] and err["type"], r.text
            r = await c.post(f"/v2/repository/models/{M}/load", content=b"x" * (limit + 1))
            assert r.status_code == 413 and str(limit) in r.json()["error"], r.text
            # the server serves on, on new connections
            assert (await c.get("/v2/health/ready")).status_code == 200
            again = await c.post(COMP, content=at, headers={"content-type": "application/json"})
            assert again.status_code == 400
        assert worker.requests == []
