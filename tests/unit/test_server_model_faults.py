"""Worker faults and client disconnects in the runtime's request flow (runtime.server.model.PDModel), workers
faked at the HTTP transport.

Specification: every request's route is released exactly once, whether it ends in an answer, a worker error
or a client that went away; a worker that answers something that is not the protocol (non-JSON 200, an SSE
event that is not a JSON object, a stream without [DONE]) is an OpenAI error, never a 500 or a truncated
answer passed off as complete; only a worker that looks gone (connection refused / reset, a stream that ends
before its [DONE]) is reported unreachable, a slow one or one that sent a broken event is not; a streaming
request whose decode worker refuses it gets an HTTP error, not a 200 stream; fields that could steer KV
transfers are dropped even inside vllm_xargs.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("kserve")

from kserve.protocol.rest.openai.types import ChatCompletion, ChatCompletionRequest, ErrorResponse  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from runtime.engines.client import VllmClient, prefill_body  # noqa: E402
from runtime.server.metrics import RuntimeMetrics  # noqa: E402
from runtime.server.model import PDModel  # noqa: E402
from runtime.server.pairing import RoundRobinPairing  # noqa: E402
from tests.unit.test_server_model import KV, _completion  # noqa: E402  (the same fake worker answers)


def _chunk(text: str) -> str:
    c = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"content": text}}]}
    return f"data: {json.dumps(c)}\n\n"


class CountingPairing(RoundRobinPairing):
    """Round robin that counts releases per request and the URLs its breakers take out of rotation."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.completed: dict[str, int] = {}
        self.unreachable: list[str] = []

    def on_complete(self, request_id: str, now_s: float, ok: bool) -> None:
        self.completed[request_id] = self.completed.get(request_id, 0) + 1
        super().on_complete(request_id, now_s, ok)

    def mark_down(self, url: str) -> list[str]:
        self.unreachable.append(url)
        return super().mark_down(url)


def _model(handler, prefill: bool = True, **kw) -> tuple[PDModel, CountingPairing]:
    pairing = CountingPairing(["http://prefill"] if prefill else [], ["http://decode"])
    transport = httpx.MockTransport(handler)
    model = PDModel("m", pairing, metrics=RuntimeMetrics(CollectorRegistry()),
                    client_factory=lambda url: VllmClient(url, transport=transport), **kw)
    return model, pairing


def _request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "capital?"}], max_tokens=7,
                                 temperature=0, **extra)


def _released_once(p: CountingPairing) -> None:
    assert list(p.completed.values()) == [1]
    assert not p._routes


async def test_client_gone_during_the_prefill_releases_the_route():
    started, never = asyncio.Event(), asyncio.Event()

    async def handler(req: httpx.Request) -> httpx.Response:
        started.set()
        await never.wait()  # a long prefill
        return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})

    model, p = _model(handler)
    task = asyncio.create_task(model.create_chat_completion(_request()))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()  # KServe cancels the handler when the client disconnects
    with pytest.raises(asyncio.CancelledError):
        await task
    _released_once(p)


async def test_client_gone_while_waiting_for_the_first_streamed_token_releases_the_route():
    started, never = asyncio.Event(), asyncio.Event()

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "prefill":
            return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})
        started.set()
        await never.wait()
        return httpx.Response(200, text="data: [DONE]\n\n")

    model, p = _model(handler)
    task = asyncio.create_task(model.create_chat_completion(_request(stream=True)))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    _released_once(p)


@pytest.mark.parametrize("body", ["<html>oops</html>", "[1, 2, 3]"], ids=["not-json", "not-an-object"])
async def test_a_decode_worker_answering_200_garbage_is_a_502_and_not_a_dead_worker(body):
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "prefill":
            return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})
        return httpx.Response(200, text=body)

    model, p = _model(handler)
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ErrorResponse) and out.error.code == 502
    assert "decode" not in out.error.message  # no worker address or internals in the message
    assert p.unreachable == []
    _released_once(p)


async def test_a_prefill_worker_answering_200_garbage_falls_back_to_local_prefill():
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((req.url.host, json.loads(req.content)))
        if req.url.host == "prefill":
            return httpx.Response(200, text="not json")
        return httpx.Response(200, json=_completion("Paris"))

    model, p = _model(handler)
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ChatCompletion)
    assert [h for h, _ in seen] == ["prefill", "decode"] and "kv_transfer_params" not in seen[1][1]
    _released_once(p)


async def test_a_streaming_request_refused_before_its_first_chunk_is_an_http_error():
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "max_tokens too large", "code": 400}})

    model, p = _model(handler, prefill=False)
    out = await model.create_chat_completion(_request(stream=True))
    assert isinstance(out, ErrorResponse), "a 200 stream carrying the error hides the status from the client"
    assert out.error.code == 400 and out.error.message == "max_tokens too large"
    _released_once(p)


@pytest.mark.parametrize("tail", ["data: {not json\n\n", "data: 42\n\n", ""],
                         ids=["not-json", "not-an-object", "no-done"])
async def test_a_broken_stream_after_the_first_chunk_ends_in_an_error_event(tail):
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=_chunk("Pa") + _chunk("ris") + tail)

    model, p = _model(handler, prefill=False)
    gen = await model.create_chat_completion(_request(stream=True))
    events = [e async for e in gen]
    assert events[-1] == "data: [DONE]\n\n"
    err = json.loads(events[-2][6:])
    assert "error" in err and err["error"]["code"] == 502, "a truncated answer must not look complete"
    # vLLM ends every stream it ends itself with [DONE]: a body ended without it was cut where its server
    # stopped (a proxy can turn the reset into a clean end), so its worker's breaker opens as for a reset
    assert p.unreachable == (["http://decode"] if tail == "" else [])
    _released_once(p)


@pytest.mark.parametrize("fault, gone, code", [
    (httpx.ReadTimeout, False, 504), (httpx.ConnectError, True, 502), (httpx.RemoteProtocolError, True, 502)])
async def test_only_a_worker_that_looks_gone_is_reported_unreachable(fault, gone, code):
    def handler(req: httpx.Request) -> httpx.Response:
        raise fault("boom", request=req)

    model, p = _model(handler, prefill=False)
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ErrorResponse) and out.error.code == code
    assert p.unreachable == (["http://decode"] if gone else [])
    _released_once(p)


async def test_a_decode_worker_answering_502_itself_is_not_taken_for_dead():
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="upstream proxy error")

    model, p = _model(handler, prefill=False)
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ErrorResponse) and out.error.code == 502
    assert p.unreachable == []
    _released_once(p)


def test_the_prefill_request_drops_min_tokens():
    b = prefill_body({"model": "m", "messages": [], "max_tokens": 100, "min_tokens": 10})
    assert b["max_tokens"] == 1 and "min_tokens" not in b  # vLLM refuses min_tokens > max_tokens


class _Raw:
    def __init__(self, body: dict) -> None:
        self._body = body

    async def json(self) -> dict:
        return self._body


async def test_steering_fields_are_dropped_and_the_validated_stream_flag_decides():
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(json.loads(req.content))
        return httpx.Response(200, json=_completion("Paris"))

    model, p = _model(handler, prefill=False)
    raw = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "stream": "false",
           "ec_transfer_params": {"remote_host": "203.0.113.7"},
           "vllm_xargs": {"kv_transfer_params": "x", "keep": 1}}
    out = await model.create_chat_completion(_request(stream=False), raw_request=_Raw(raw))
    assert isinstance(out, ChatCompletion)  # "false" did not turn the answer into a stream
    (sent,) = seen
    assert "ec_transfer_params" not in sent and sent["vllm_xargs"] == {"keep": 1}
    assert sent["stream"] is False
    _released_once(p)


@pytest.mark.parametrize("event", ['{"choices":[null]}', '{"choices":"abc"}', '{"choices":[{"delta":"x"}]}',
                                   '{"choices":[],"usage":"x"}'])
async def test_a_chunk_of_the_wrong_shape_is_a_502_before_the_first_chunk_and_an_error_event_after(event):
    def first(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=f"data: {event}\n\ndata: [DONE]\n\n")

    model, p = _model(first, prefill=False)
    out = await model.create_chat_completion(_request(stream=True))
    assert isinstance(out, ErrorResponse) and out.error.code == 502
    _released_once(p)

    def later(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=_chunk("Pa") + f"data: {event}\n\ndata: [DONE]\n\n")

    model, p = _model(later, prefill=False)
    events = [e async for e in await model.create_chat_completion(_request(stream=True))]
    assert events[-1] == "data: [DONE]\n\n" and json.loads(events[-2][6:])["error"]["code"] == 502
    _released_once(p)


class _DiesAfter(httpx.AsyncByteStream):
    """A response body that sends `head` and then loses the connection (a worker process that exited)."""

    def __init__(self, head: bytes) -> None:
        self.head = head

    async def __aiter__(self):
        yield self.head
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


async def test_after_a_migration_the_new_decode_worker_prefill_load_ends_at_its_first_token():
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "d1":
            return httpx.Response(200, stream=_DiesAfter((_chunk("The") + _chunk(" capital")).encode()))
        return httpx.Response(200, text=_chunk(" is") + _chunk(" Paris") + "data: [DONE]\n\n")

    class Recording(CountingPairing):
        firsts: list[str] = []

        def on_first_token(self, request_id: str, now_s: float) -> None:
            self.firsts.append(self._routes[request_id].decode_url)
            super().on_first_token(request_id, now_s)

    pairing = Recording([], ["http://d1", "http://d2"], migration_limit=1)
    transport = httpx.MockTransport(handler)
    model = PDModel("m", pairing, metrics=RuntimeMetrics(CollectorRegistry()),
                    client_factory=lambda url: VllmClient(url, transport=transport))
    events = [e async for e in await model.create_chat_completion(_request(stream=True))]
    assert events[-1] == "data: [DONE]\n\n"
    text = "".join(json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1])
    assert text == "The capital is Paris"
    assert pairing.firsts == ["http://d1", "http://d2"]  # each decode worker's local prefill load ends
    _released_once(pairing)


async def test_the_route_is_released_even_when_the_metrics_fail():
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_completion("Paris"))

    model, p = _model(handler, prefill=False)

    class Broken:
        def labels(self, *a):
            raise ValueError("metrics backend down")

    model.metrics.e2e = Broken()
    with pytest.raises(ValueError):
        await model.create_chat_completion(_request())
    assert sum(p.completed.values()) == 1 and not p._routes


async def test_a_run_of_5xx_opens_a_prefill_workers_breaker_until_its_probes_answer():
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.url.host)
        if req.url.path == "/health":
            return httpx.Response(200)
        if req.url.host == "prefill":
            return httpx.Response(500, json={"error": {"message": "engine dead", "code": 500}})
        return httpx.Response(200, json=_completion("Paris"))

    now = [0.0]
    model, p = _model(handler, clock=lambda: now[0])
    k, spec = model.overload.breaker_failures, model.overload
    for _ in range(k):
        assert isinstance(await model.create_chat_completion(_request()), ChatCompletion)  # local fallback
    assert seen.count("prefill") == k and p.down == {"http://prefill"}
    seen.clear()
    assert isinstance(await model.create_chat_completion(_request()), ChatCompletion)
    assert seen == ["decode"]  # no prefill spent on a worker known to fail
    await model.breakers.check_round(model.worker_healthy)
    assert "prefill" not in seen  # open: not even checked during its cool-down
    now[0] += spec.breaker_cooldown_s
    for i in range(spec.breaker_probes):  # half-open: health probes, one per round, no client traffic
        assert p.down == {"http://prefill"}
        await model.breakers.check_round(model.worker_healthy)
    assert p.down == set()
    seen.clear()
    await model.create_chat_completion(_request())
    assert seen[0] == "prefill"


async def test_5xx_answers_not_in_a_row_keep_the_worker():
    answers = iter([500, 200, 500, 200, 500, 200])

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "prefill":
            status = next(answers)
            if status != 200:
                return httpx.Response(status, json={"error": {"message": "busy", "code": status}})
            return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})
        return httpx.Response(200, json=_completion("Paris"))

    model, p = _model(handler)
    for _ in range(6):
        await model.create_chat_completion(_request())
    assert p.down == set()


async def test_a_refused_decode_worker_is_not_sent_a_prefill_again():
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.url.host)
        if req.url.host == "decode":
            raise httpx.ConnectError("refused", request=req)
        return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})

    model, p = _model(handler)
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ErrorResponse) and p.down == {"http://decode"} and not model.ready
    seen.clear()
    from kserve.errors import ModelNotReady

    with pytest.raises(ModelNotReady):  # 503 with Retry-After (runtime.server.errors)
        await model.create_chat_completion(_request())
    assert seen == []


class _Hanging(httpx.AsyncByteStream):
    """A response body that never sends a byte (a decode worker whose engine is stalled); records its close."""

    def __init__(self, closed: list) -> None:
        self.closed = closed

    async def __aiter__(self):
        await asyncio.Event().wait()
        yield b""  # pragma: no cover - never reached

    async def aclose(self) -> None:
        self.closed.append(True)


async def test_a_decode_leg_without_a_first_token_before_the_lease_ends_is_aborted_and_prefilled_locally():
    decode_kv, closed = [], []

    async def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        if req.url.host == "prefill":
            return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})
        decode_kv.append(body.get("kv_transfer_params"))
        if body.get("kv_transfer_params"):
            return httpx.Response(200, stream=_Hanging(closed), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, text=_chunk("Paris") + "data: [DONE]\n\n")

    pairing = CountingPairing(["http://prefill"], ["http://decode"])
    transport = httpx.MockTransport(handler)
    reg = CollectorRegistry()
    model = PDModel("m", pairing, metrics=RuntimeMetrics(reg), kv_lease_s=1.0, kv_lease_margin_s=0.5,
                    client_factory=lambda url: VllmClient(url, transport=transport))
    t0 = asyncio.get_running_loop().time()
    stream = await model.create_chat_completion(_request(stream=True))
    events = [e async for e in stream]
    took = asyncio.get_running_loop().time() - t0
    assert decode_kv == [KV, None]  # the handoff's leg, then the local prefill without it
    assert closed == [True]  # the stalled leg was closed (vLLM aborts a request whose client went away)
    assert "Paris" in "".join(events) and events[-1] == "data: [DONE]\n\n"
    assert 0.4 < took < 5.0  # it waited until the deadline (lease - margin), not for the lease's end
    from prometheus_client import generate_latest
    from runtime.engines.metrics import sample_sum

    text = generate_latest(reg).decode()
    assert sample_sum(text, "pdserve_kv_lease_expiries_total") == 1
    assert sample_sum(text, "pdserve_kv_late_reads_total") == 0
    assert sample_sum(text, "pdserve_requests_total", mode="local", status="ok") == 1
    _released_once(pairing)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_answer_that_arrives_after_the_lease_bound_is_not_used(stream):
    """The lease counts from when the prefill was sent: an answer delivered too late is never decoded from."""
    now, decode_kv = [0.0], []

    async def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        if req.url.host == "prefill":
            now[0] += 26.0  # the prefill worker's answer took 26 s to arrive: 4 s of a 30-s lease left
            return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})
        decode_kv.append(body.get("kv_transfer_params"))
        if body.get("stream"):
            return httpx.Response(200, text=_chunk("Paris") + "data: [DONE]\n\n")
        return httpx.Response(200, json=_completion("Paris"))

    pairing = CountingPairing(["http://prefill"], ["http://decode"])
    transport = httpx.MockTransport(handler)
    model = PDModel("m", pairing, metrics=RuntimeMetrics(CollectorRegistry()), clock=lambda: now[0],
                    client_factory=lambda url: VllmClient(url, transport=transport))
    out = await model.create_chat_completion(_request(stream=stream))
    if stream:
        assert "Paris" in "".join([e async for e in out])
    else:
        assert isinstance(out, ChatCompletion)
    assert decode_kv == [None]
    _released_once(pairing)
