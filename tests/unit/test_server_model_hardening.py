"""Worker answers the runtime must not pass on as is, and output that is not `content` (runtime.server.model
.PDModel), workers faked at the HTTP transport.

Specification:
* an error event a worker sends inside its stream (vLLM: `data: {"error": ...}`, no choices) reaches the client
  as an OpenAI error event, whether or not the client asked for usage, and the request counts as an error;
* response headers name workers, never addresses: discovery's "<role>@<URL>" ids become "<role>-<hex>";
* reasoning (`delta.reasoning_content` / `delta.reasoning`) and tool-call chunks are the first token: the
  router's prefill load ends and TTFT is observed there, not at the first `content` chunk;
* a tokenizer that raises costs the request its routing knowledge only (routed on load alone);
* a worker 4xx reaches the client only when it is a vLLM/OpenAI error object about the request; a 401/403/
  404/407 or a non-JSON body is a deployment fault: a 502 naming nothing internal, and a prefill worker
  answering so is skipped for local prefill.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("kserve")

from fastapi import Response  # noqa: E402
from kserve.protocol.rest.openai.types import ChatCompletion, ChatCompletionRequest, ErrorResponse  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from runtime.engines.client import VllmClient  # noqa: E402
from runtime.server.metrics import RuntimeMetrics  # noqa: E402
from runtime.server.model import PDModel  # noqa: E402
from runtime.server.pairing import Route, RoundRobinPairing  # noqa: E402
from tests.unit.test_server_model import KV, _completion  # noqa: E402


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _model(handler, pairing=None) -> tuple[PDModel, CollectorRegistry]:
    reg = CollectorRegistry()
    transport = httpx.MockTransport(handler)
    model = PDModel("m", pairing or RoundRobinPairing([], ["http://decode"]), metrics=RuntimeMetrics(reg),
                    client_factory=lambda url: VllmClient(url, transport=transport))
    return model, reg


def _request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=7, **extra)


def _requests(reg: CollectorRegistry, status: str, mode: str = "local") -> float:
    return reg.get_sample_value("pdserve_requests_total", {"endpoint": "chat", "mode": mode, "status": status}) or 0


# --- mid-stream error events ---------------------------------------------------------------------------------

ENGINE_ERROR = {"error": {"message": "engine died at 10.0.0.7: out of KV blocks", "type": "InternalServerError",
                          "param": None, "code": 500}}


@pytest.mark.parametrize("stream_options", [None, {"include_usage": True}])
async def test_a_worker_error_event_mid_stream_reaches_the_client_and_counts_as_an_error(stream_options):
    def handler(req):
        return httpx.Response(200, text=_event(_chunk({"content": "Par"})) + _event(ENGINE_ERROR)
                              + "data: [DONE]\n\n")

    model, reg = _model(handler)
    extra = {"stream_options": stream_options} if stream_options else {}
    events = [e async for e in await model.create_chat_completion(_request(stream=True, **extra))]
    assert events[-1] == "data: [DONE]\n\n"
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "Par"
    err = json.loads(events[-2][6:])["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 500
    assert "10.0.0.7" not in err["message"]  # a worker's 5xx text may name internals
    assert _requests(reg, "error") == 1 and _requests(reg, "ok") == 0
    await model.aclose()


async def test_a_worker_error_event_before_any_token_is_an_http_error():
    def handler(req):
        bad = {"error": {"message": "prompt too long for the KV cache", "type": "BadRequestError", "code": 400}}
        return httpx.Response(200, text=_event(bad) + "data: [DONE]\n\n")

    model, reg = _model(handler)
    out = await model.create_chat_completion(_request(stream=True))
    assert isinstance(out, ErrorResponse)
    assert out.error.code == 400 and out.error.message == "prompt too long for the KV cache"
    # the worker rejected the client's own request: the client's fault, not the service's error
    assert _requests(reg, "client_error") == 1 and _requests(reg, "error") == 0
    await model.aclose()


# --- worker ids in response headers --------------------------------------------------------------------------

def test_public_worker_ids_never_contain_an_address():
    from runtime.server.model import public_worker_id

    key = b"k" * 16
    assert public_worker_id("decode-0", key) == "decode-0"
    for wid in ("decode@http://10.244.1.17:8000", "prefill@http://user:secret@pod.svc:8000", "10.0.0.1",
                "http://10.0.0.1:8000", "a.b.c", "decode@", "x" * 100):
        out = public_worker_id(wid, key)
        assert "://" not in out and "@" not in out and ":" not in out and "." not in out
        assert "10.244" not in out and "secret" not in out and "pod" not in out
        assert out == public_worker_id(wid, key) and out != public_worker_id(wid, b"j" * 16)
    assert public_worker_id("decode@http://10.244.1.17:8000", key).startswith("decode-")
    assert public_worker_id("prefill@http://user:secret@pod.svc:8000", key).startswith("prefill-")
    assert public_worker_id("decode@http://a:1", key) != public_worker_id("decode@http://b:1", key)


class _DiscoveredIds(RoundRobinPairing):
    """Round robin whose routes carry discovery's worker ids ("<role>@<URL>")."""

    def choose(self, req):
        r = super().choose(req)
        return Route(r.prefill_url, r.decode_url, r.reason,
                     f"prefill@{r.prefill_url}" if r.prefill_url else None, f"decode@{r.decode_url}")


async def test_route_headers_name_no_worker_address():
    def handler(req):
        if req.url.host == "10.244.3.9":
            return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})
        return httpx.Response(200, json=_completion("ok"))

    model, _ = _model(handler, _DiscoveredIds(["http://10.244.3.9:8000"], ["http://10.244.1.17:8000"]))
    resp = Response()
    out = await model.create_chat_completion(_request(), context={"response": resp})
    assert isinstance(out, ChatCompletion)
    headers = {k: v for k, v in resp.headers.items() if k.startswith("x-pdserve")}
    assert headers["x-pdserve-prefill-worker"].startswith("prefill-")
    assert headers["x-pdserve-decode-worker"].startswith("decode-")
    assert not any("10.244" in v or "@" in v or "://" in v for v in headers.values()), headers
    await model.aclose()


# --- reasoning and tool calls are the first token ------------------------------------------------------------

class _RecordingPairing(RoundRobinPairing):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.first_tokens: list[str] = []

    def on_first_token(self, request_id, now_s):
        self.first_tokens.append(request_id)
        super().on_first_token(request_id, now_s)


@pytest.mark.parametrize("delta", [
    {"reasoning_content": "think "}, {"reasoning": "think "},
    {"tool_calls": [{"index": 0, "id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
])
async def test_a_reasoning_or_tool_call_chunk_is_the_first_token(delta):
    now = [0.0]
    seen: list[tuple[int, float | None]] = []

    def handler(req):
        return httpx.Response(200, text=_event(_chunk({"role": "assistant", "content": ""})) + _event(_chunk(delta))
                              + _event(_chunk(delta)) + _event(_chunk({"content": "answer"}))
                              + _event(_chunk({}, "stop")) + "data: [DONE]\n\n")

    pairing = _RecordingPairing([], ["http://decode"])
    model, reg = _model(handler, pairing)
    model.clock = lambda: now[0]
    gen = await model.create_chat_completion(_request(stream=True))
    async for _ in gen:
        seen.append((len(pairing.first_tokens),
                     reg.get_sample_value("pdserve_ttft_seconds_count", {"endpoint": "chat", "mode": "local"}) or 0.0))
        now[0] += 1.0
    # event 0: the empty role chunk (no token yet); event 1: the reasoning/tool-call chunk is the first token
    assert seen[0] == (0, 0.0)
    assert seen[1] == (1, 1.0)
    assert reg.get_sample_value("pdserve_ttft_seconds_sum", {"endpoint": "chat", "mode": "local"}) == 1.0
    await model.aclose()


# --- worker 4xx: the client's mistake or the deployment's -----------------------------------------------------

PROXY_401 = "<html>401 Authorization Required - nginx at gw-internal.corp:8443</html>"


@pytest.mark.parametrize(("status", "body"), [
    (401, PROXY_401), (403, {"error": {"message": "bad key for gw-internal.corp", "code": 403}}),
    (404, {"object": "error", "message": "model m-internal does not exist", "code": 404}),
    (407, PROXY_401), (400, PROXY_401), (400, {"detail": "gw-internal.corp"}),
])
async def test_a_deployment_fault_4xx_of_the_decode_worker_is_a_502_naming_nothing_internal(status, body):
    def handler(req):
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    model, reg = _model(handler)
    for stream in (False, True):
        out = await model.create_chat_completion(_request(stream=stream))
        assert isinstance(out, ErrorResponse)
        assert out.error.code == 502, out
        assert "gw-internal" not in out.error.message and "m-internal" not in out.error.message
        assert "nginx" not in out.error.message
    await model.aclose()


@pytest.mark.parametrize("body", [{"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                                             "param": "max_tokens", "code": 400}},
                                  {"object": "error", "message": "max_tokens is too large", "code": 400}])
async def test_a_worker_rejecting_the_request_passes_its_message_through(body):
    model, _ = _model(lambda req: httpx.Response(400, json=body))
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ErrorResponse)
    assert out.error.code == 400 and out.error.message == "max_tokens is too large"
    # the field the worker named, as vLLM names it; none (null, not "") when the worker named none
    assert out.error.param == (body["error"]["param"] if "error" in body else None)
    await model.aclose()


@pytest.mark.parametrize(("status", "text"), [(401, PROXY_401), (403, "forbidden"), (404, "Not Found"),
                                              (400, PROXY_401)])
async def test_a_prefill_worker_deployment_fault_falls_back_to_local_prefill(status, text):
    hosts = []

    def handler(req):
        hosts.append(req.url.host)
        if req.url.host == "prefill":
            return httpx.Response(status, text=text)
        return httpx.Response(200, json=_completion("ok"))

    model, reg = _model(handler, RoundRobinPairing(["http://prefill"], ["http://decode"]))
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ChatCompletion) and out.choices[0].message.content == "ok"
    assert hosts == ["prefill", "decode"]
    assert reg.get_sample_value("pdserve_prefill_fallbacks_total") == 1
    assert _requests(reg, "ok") == 1
    await model.aclose()


# --- a tokenizer failure is routing knowledge lost, not a 500 --------------------------------------------------

async def test_a_tokenizer_that_raises_routes_the_request_on_load_alone():
    class Broken:
        def token_ids(self, path, body):
            raise TypeError("TextEncodeInput must be Union[...]")

    model, reg = _model(lambda req: httpx.Response(200, json=_completion("ok")))
    model.tokenizer = Broken()
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ChatCompletion) and out.choices[0].message.content == "ok"
    assert _requests(reg, "ok") == 1
    await model.aclose()


@pytest.mark.parametrize(("status", "body", "kind"), [
    (429, {"error": {"message": "too many requests", "type": "RateLimitError", "code": 429}}, "RateLimitError"),
    (429, {"object": "error", "message": "too many requests", "code": 429}, "RateLimitError"),
    (422, {"object": "error", "message": "unprocessable", "code": 422}, "UnprocessableEntityError"),
    (400, {"error": {"message": "bad", "type": "not an identifier!", "code": 400}}, "BadRequestError")])
async def test_a_worker_rejection_keeps_its_status_and_error_type(status, body, kind):
    model, _ = _model(lambda req: httpx.Response(status, json=body))
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ErrorResponse)
    assert (out.error.code, out.error.type) == (status, kind)
    await model.aclose()
