"""The generation routes served from the edge (runtime.server.direct) answer as KServe's routes do.

Specification: the same PDModel behind KServe's OpenAI routes, once with the edge's direct server and once
without, gives the same status, headers and body for every kind of answer (a non-streaming answer with its
route headers, a stream, a worker's error passed through, a 502, a 429 with Retry-After from admission
control, an answer named after the client's X-Request-Id); requests the direct server must not take
(another model's name, a body that fails validation, a body not sent as JSON) go on to KServe and get
KServe's answer; a client that goes away stops the stream.
"""

from __future__ import annotations

import asyncio
import functools
import json

import httpx
import pytest

pytest.importorskip("kserve")

from fastapi import FastAPI  # noqa: E402
from fastapi.responses import ORJSONResponse  # noqa: E402
from kserve.model_repository import ModelRepository  # noqa: E402
from kserve.protocol.rest.openai.dataplane import OpenAIDataPlane  # noqa: E402
from kserve.protocol.rest.openai.endpoints import register_openai_endpoints  # noqa: E402

from runtime.server.direct import serve_direct  # noqa: E402
from runtime.server.edge import install_edge  # noqa: E402
from runtime.server.errors import Overloaded, install_openai_error_handlers  # noqa: E402
from tests.unit.test_server_model import FakeWorkers, _model  # noqa: E402

CHAT = "/openai/v1/chat/completions"
COMPLETIONS = "/openai/v1/completions"


def _app(model, direct: bool, taken: list[bool]) -> FastAPI:
    repo = ModelRepository()
    repo.update(model)
    app = FastAPI(default_response_class=ORJSONResponse)
    register_openai_endpoints(app, OpenAIDataPlane(model_registry=repo))
    install_openai_error_handlers(app)
    serve = functools.partial(serve_direct, model, app)

    async def recorded(*args) -> bool:
        taken.append(await serve(*args))
        return taken[-1]

    install_edge(app, model.name, lambda: model.ready, model.count_unready, direct=recorded if direct else None)
    return app


class Workers(FakeWorkers):
    """FakeWorkers that also answer health checks (so that the model is ready)."""

    def handler(self, req: httpx.Request) -> httpx.Response:
        return httpx.Response(200) if req.url.path == "/health" else super().handler(req)


async def _ask(direct: bool, taken: list[bool], path: str, *, workers: Workers | None = None, patch=None, **kw):
    """(status, headers but date/server, body) of one request to a fresh model's app."""
    model, _ = _model(workers or Workers())
    await model.breakers.check_round(model.worker_healthy)
    if patch is not None:
        patch(model)
    app = _app(model, direct, taken)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rt") as c:
        r = await c.post(path, **kw)
    return r.status_code, [(k, v) for k, v in r.headers.items() if k not in ("date", "server")], r.content


async def _same(path: str, **kw) -> tuple[tuple, list[bool]]:
    """The answer with the direct server and without (asserted equal), and what the direct server took."""
    taken: list[bool] = []
    direct = await _ask(True, taken, path, **kw)
    kserve = await _ask(False, taken, path, **kw)
    assert direct == kserve
    return direct, taken


CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "capital?"}], "max_tokens": 7}


async def test_answers_served_from_the_edge_equal_kserve_ones():
    answer, taken = await _same(CHAT, json=CHAT_BODY)
    assert taken == [True] and answer[0] == 200 and json.loads(answer[2])["choices"][0]["message"]["content"] == "Paris"
    assert any(k.startswith("x-pdserve") for k, _ in answer[1])  # the route headers
    answer, taken = await _same(CHAT, json={**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}})
    assert taken == [True] and answer[0] == 200 and answer[2].endswith(b"data: [DONE]\n\n")
    assert answer[2].count(b"data: ") == 4
    answer, taken = await _same(CHAT, json=CHAT_BODY, workers=Workers(decode_status=400))  # the worker's 400
    assert taken == [True] and answer[0] == 400 and b"decode says no" in answer[2]
    answer, taken = await _same(COMPLETIONS, json={"model": "m", "prompt": "x", "max_tokens": 3})
    assert taken == [True] and answer[0] == 502  # a chat answer to a completion: not an OpenAI response

    def overloaded(model) -> None:
        def admit(path: str, body: dict) -> None:
            raise Overloaded("predicted time to first token is 9 s", 3)
        model._admit = admit

    answer, taken = await _same(CHAT, json=CHAT_BODY, patch=overloaded)
    assert taken == [True] and answer[0] == 429 and ("retry-after", "3") in answer[1]
    assert json.loads(answer[2])["error"]["type"] == "OverloadedError"


async def test_the_clients_x_request_id_names_the_answer_on_both_routes():
    """vLLM names an answer after the client's X-Request-Id header (else its `request_id` field)."""
    answer, taken = await _same(CHAT, json=CHAT_BODY, headers={"x-request-id": "client-7"})
    assert taken == [True] and answer[0] == 200 and json.loads(answer[2])["id"] == "chatcmpl-client-7"
    # a repeated header: its first value on both routes (Starlette's Headers.get)
    answer, taken = await _same(CHAT, json=CHAT_BODY, headers=[("x-request-id", "one"), ("x-request-id", "two")])
    assert taken == [True] and json.loads(answer[2])["id"] == "chatcmpl-one"


async def test_a_body_without_a_model_is_served_by_the_served_model_as_vllm_serves_it():
    """vLLM serves a request whose `model` is absent, null or "" with its served model; so does the edge, on
    both routes (KServe alone would answer 404 naming a model "None")."""
    for body in ({k: v for k, v in CHAT_BODY.items() if k != "model"}, {**CHAT_BODY, "model": None},
                 {**CHAT_BODY, "model": ""}):
        for direct in (True, False):
            workers, taken = Workers(), []
            status, _, content = await _ask(direct, taken, CHAT, workers=workers, json=body)
            assert status == 200 and json.loads(content)["choices"][0]["message"]["content"] == "Paris", content
            assert taken == ([True] if direct else []) and workers.calls
            assert all(sent["model"] == "m" for _, sent, _ in workers.calls)
    status, _, content = await _ask(True, [], CHAT, json={**CHAT_BODY, "model": 7})
    assert status == 400 and json.loads(content)["error"]["param"] == "model"


async def test_what_the_edge_must_not_serve_goes_on_to_kserve():
    for kw in ({"json": {**CHAT_BODY, "model": "other"}},  # KServe's 404
               {"json": {**CHAT_BODY, "max_tokens": "many"}},  # its validation 400
               {"json": {**CHAT_BODY, "stream_options": {"include_usage": True}}}):  # vLLM's validator's 400
        answer, taken = await _same(CHAT, **kw)
        assert taken == [False] and 400 <= answer[0] < 500, (kw, answer)


async def test_a_client_that_leaves_stops_the_stream():
    model, _ = _model(Workers())
    await model.breakers.check_round(model.worker_healthy)
    closed = asyncio.Event()

    async def endless():
        try:
            while True:
                yield "data: {}\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    async def create(request, raw_request=None, context=None):
        return endless()

    model.create_chat_completion = create
    left, sent = asyncio.Event(), []

    async def receive() -> dict:
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) == 3:
            left.set()

    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": []}
    assert await asyncio.wait_for(serve_direct(model, FastAPI(), scope, json.dumps(CHAT_BODY).encode(),
                                               receive, send), 5)
    assert closed.is_set() and sent[0]["status"] == 200 and all(m.get("more_body") for m in sent[1:])


def test_no_access_log_detaches_uvicorn_access_logger():
    """`--no-access-log`: uvicorn logs a request whenever "uvicorn.access" has a handler (its own or an
    ancestor's), so build_rest_server detaches it."""
    import logging

    from runtime.server.app import build_rest_server

    access = logging.getLogger("uvicorn.access")
    kept, root_handler = (access.handlers[:], access.propagate), logging.NullHandler()
    try:
        logging.getLogger().addHandler(root_handler)  # a root handler, as KServe installs one
        model, _ = _model(Workers())
        build_rest_server(model, http_port=1, access_log=True)
        assert access.hasHandlers()
        build_rest_server(model, http_port=1, access_log=False)
        assert not access.hasHandlers()
    finally:
        access.handlers, access.propagate = kept
        logging.getLogger().removeHandler(root_handler)


async def test_an_unexpected_error_is_a_500_as_on_kserve_routes():
    def broken(model) -> None:
        def admit(path: str, body: dict) -> None:
            raise RuntimeError("a bug")
        model._admit = admit

    taken: list[bool] = []
    for direct in (True, False):
        model, _ = _model(Workers())
        await model.breakers.check_round(model.worker_healthy)
        broken(model)
        transport = httpx.ASGITransport(app=_app(model, direct, taken), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://rt") as c:
            r = await c.post(CHAT, json=CHAT_BODY)
        assert r.status_code == 500, (direct, r.text)


async def test_a_served_name_with_a_slash_is_found_by_the_model_route():
    """GET /openai/v1/models/{id} for a Hugging Face style name (org/model), as sent and percent-encoded."""
    from runtime.server.edge import EdgeMiddleware, Served

    async def inner(scope, receive, send):  # anything the edge passes on
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    name = "meta-llama/Llama-3.1-8B"
    app = EdgeMiddleware(inner, served=Served(name, lambda: True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rt") as c:
        for path in (f"/openai/v1/models/{name}", "/openai/v1/models/meta-llama%2FLlama-3.1-8B"):
            r = await c.get(path)
            assert r.status_code == 200 and r.json()["id"] == name, (path, r.text)
        other = await c.get("/openai/v1/models/meta-llama/other")
        assert other.status_code == 404 and other.json()["error"]["param"] == "model"


async def test_kserve_v2_model_metadata_is_a_clear_404_not_kserves_500():
    """KServe's v2 metadata describes tensor inputs a generative model has none of; its own answer is a 500
    that drops the client's connection. The model's readiness stays KServe's."""
    from runtime.server.edge import EdgeMiddleware, Served

    async def inner(scope, receive, send):  # anything the edge passes on
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = EdgeMiddleware(inner, served=Served("m", lambda: True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rt") as c:
        for path in ("/v2/models/m", "/v2/models/m/versions/1"):
            r = await c.get(path)
            assert r.status_code == 404 and "serves the OpenAI API only" in r.json()["error"], (path, r.text)
        assert (await c.get("/v2/models/m/ready")).status_code == 418


class _HeadThenWait(Workers):
    """Workers whose decode stream sends its 200 head, then waits for `release` before its first chunk;
    with `die` True, the stream then breaks instead (the worker died before its first token)."""

    def __init__(self, die: bool = False) -> None:
        super().__init__()
        self.release, self.die = asyncio.Event(), die

    async def handler(self, req: httpx.Request) -> httpx.Response:  # type: ignore[override]
        if req.url.host != "decode" or req.url.path == "/health" or not json.loads(req.content).get("stream"):
            return super().handler(req)
        self.calls.append((req.url.host, json.loads(req.content), req.headers.get("x-request-id")))
        release, die = self.release, self.die

        async def body():
            await release.wait()
            if die:
                raise httpx.ReadError("connection reset")
            chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": "Paris"}, "finish_reason": "stop"}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=body())


async def _serve_stream(workers: _HeadThenWait) -> tuple[asyncio.Task, list[dict]]:
    """serve_direct of one streamed chat request, started; the messages it sends land in the list."""
    model, _ = _model(workers)
    await model.breakers.check_round(model.worker_healthy)
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": [(b"content-type", b"application/json")]}
    body = json.dumps({**CHAT_BODY, "stream": True}).encode()
    task = asyncio.create_task(serve_direct(model, FastAPI(), scope, body, receive, send))
    return task, sent


async def _until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


async def test_a_streams_head_goes_out_when_the_decode_workers_head_arrives():
    """The client has the 200 head while the decode worker is still making the first token."""
    workers = _HeadThenWait()
    task, sent = await _serve_stream(workers)
    await _until(lambda: bool(sent))
    assert sent == [{"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8")]}]
    assert not workers.release.is_set()
    workers.release.set()
    assert await asyncio.wait_for(task, 5)
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert [m["type"] for m in sent].count("http.response.start") == 1
    assert b'"Paris"' in body and body.endswith(b"data: [DONE]\n\n") and not sent[-1].get("more_body")


async def test_a_stream_whose_only_decode_worker_dies_after_its_head_ends_with_an_error_event():
    """The head is out: the failure (no other worker to take the request whole) is an event in the stream."""
    workers = _HeadThenWait(die=True)
    task, sent = await _serve_stream(workers)
    await _until(lambda: bool(sent))
    workers.release.set()
    assert await asyncio.wait_for(task, 5)
    assert [m["type"] for m in sent].count("http.response.start") == 1 and sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:])
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) == 2, body
    error = json.loads(events[0][len(b"data: "):])["error"]
    assert int(error["code"]) >= 500 and error["message"], error


async def _raise_after_head(exc: Exception, app: FastAPI, sent: list[dict]) -> bool:
    """serve_direct of a stream whose model sends the head, then raises `exc`; the messages land in `sent`."""
    model, _ = _model(Workers())
    await model.breakers.check_round(model.worker_healthy)

    async def create(request, raw_request=None, context=None):
        await context["send_head"]()
        raise exc

    model.create_chat_completion = create

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": []}
    body = json.dumps({**CHAT_BODY, "stream": True}).encode()
    return await asyncio.wait_for(serve_direct(model, app, scope, body, receive, send), 5)


async def test_an_error_raised_after_the_head_went_out_is_an_event_in_the_stream():
    """What the app's handlers would answer as an HTTP error ends the open stream as an error event."""
    app = FastAPI()
    install_openai_error_handlers(app)
    sent: list[dict] = []
    assert await _raise_after_head(Overloaded("predicted time to first token is 9 s", 3), app, sent)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"] and sent[0]["status"] == 200
    event, done = [e for e in sent[1]["body"].split(b"\n\n") if e]
    assert json.loads(event[len(b"data: "):])["error"]["type"] == "OverloadedError" and done == b"data: [DONE]"


async def test_a_head_whose_send_the_lease_deadline_cancelled_is_sent_by_the_next_attempt():
    """The head's send waits for a slow client (uvicorn drains first) past the KV lease deadline: cancelled, it
    wrote nothing, so the local-prefill attempt that follows still sends the head before its chunks."""
    from prometheus_client import CollectorRegistry

    from runtime.engines.client import VllmClient
    from runtime.server.metrics import RuntimeMetrics
    from runtime.server.model import PDModel
    from runtime.server.pairing import RoundRobinPairing
    from tests.unit.test_server_model import KV, _completion

    def chunk(text: str, finish: str | None = None) -> dict:
        return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(req.content)
        if req.url.host == "prefill":
            return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})
        if body.get("kv_transfer_params"):  # the handoff's leg: a head, then nothing
            async def hang():
                await asyncio.sleep(30)
                yield b""
            return httpx.Response(200, content=hang())
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in (chunk("Pa"), chunk("ris", "stop")))
        return httpx.Response(200, text=text + "data: [DONE]\n\n")

    transport = httpx.MockTransport(handler)
    model = PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]),
                    metrics=RuntimeMetrics(CollectorRegistry()),
                    client_factory=lambda url: VllmClient(url, transport=transport), kv_lease_s=0.6,
                    kv_lease_margin_s=0.1)
    await model.breakers.check_round(model.worker_healthy)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            await asyncio.sleep(1.0)  # uvicorn's send waiting for a client that does not read
        sent.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": [(b"content-type", b"application/json")]}
    body = json.dumps({**CHAT_BODY, "stream": True}).encode()
    assert await asyncio.wait_for(serve_direct(model, FastAPI(), scope, body, receive, send), 10)
    assert [m["type"] for m in sent][:2] == ["http.response.start", "http.response.body"], sent
    assert b"ris" in b"".join(m.get("body", b"") for m in sent) and not sent[-1].get("more_body")


async def test_an_unexpected_error_after_the_head_ends_the_stream_with_a_500_event():
    sent: list[dict] = []
    with pytest.raises(RuntimeError, match="a bug"):  # raised on, for the server to log
        await _raise_after_head(RuntimeError("a bug"), FastAPI(), sent)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"] and not sent[1]["more_body"]
    event, done = [e for e in sent[1]["body"].split(b"\n\n") if e]
    assert json.loads(event[len(b"data: "):])["error"]["code"] == 500 and done == b"data: [DONE]"


async def test_the_body_the_edge_read_is_not_read_again(monkeypatch):
    """The edge's checks read the body with orjson; the direct server takes that object, not the bytes again."""
    import orjson

    import runtime.server.direct as direct

    reads: list[bytes] = []

    class _Counting:
        JSONDecodeError = orjson.JSONDecodeError
        OPT_NON_STR_KEYS = orjson.OPT_NON_STR_KEYS
        dumps = staticmethod(orjson.dumps)

        @staticmethod
        def loads(raw):
            reads.append(raw)
            return orjson.loads(raw)

    monkeypatch.setattr(direct, "orjson", _Counting)
    answer, taken = await _same(CHAT, json=CHAT_BODY)
    assert taken == [True] and answer[0] == 200 and reads == []


def test_a_vllm_validation_error_reads_as_vllms_own_server_writes_it():
    # vLLM's server answers str(exc): the message, then "(parameter=..., value=...)"
    pytest.importorskip("vllm")
    from vllm.exceptions import VLLMValidationError

    from runtime.server.errors import vllm_client_error_body

    err = vllm_client_error_body(VLLMValidationError("logprobs must be at most 20.", parameter="logprobs", value=21))
    assert err["error"]["message"] == "logprobs must be at most 20. (parameter=logprobs, value=21)"
    assert err["error"]["param"] == "logprobs" and err["error"]["code"] == 400


async def test_a_runtime_bug_is_an_openai_500_on_both_routes():
    """An exception no handler answers is a JSON 500 in OpenAI's shape under the OpenAI prefix (as vLLM's
    server answers one), its text not shown, on the edge's route and on KServe's alike."""
    for direct in (True, False):
        model, _ = _model(Workers())
        await model.breakers.check_round(model.worker_healthy)

        async def broken(*args, **kwargs):
            raise RuntimeError("worker http://10.0.0.7:8000 exploded")

        model.create_chat_completion = broken
        taken: list[bool] = []
        app = _app(model, direct, taken)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://rt") as c:
            r = await c.post(CHAT, json=CHAT_BODY)
        assert r.status_code == 500 and r.headers["content-type"] == "application/json", (direct, r.text)
        assert r.json() == {"error": {"message": "internal error", "type": "InternalServerError", "param": None,
                                      "code": 500}}
        assert taken == []  # the edge's route raised it on (Starlette's outermost middleware answered)
