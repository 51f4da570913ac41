"""vLLM P/D request protocol of runtime.engines.client, checked at the HTTP transport (httpx.MockTransport).

Specification (vLLM NixlConnector protocol, docs/architecture.md#pd-disaggregation-with-nixl): the prefill call is
the original request with max_tokens=1, stream=false and remote-decode kv_transfer_params; the decode call is the
original request plus the prefill answer's kv_transfer_params, unchanged; both carry the same X-Request-Id; a
client's own kv_transfer_params never reach a worker; worker failures surface as BackendError with the status.
"""

from __future__ import annotations

import json

import httpx
import pytest

from runtime.engines.client import (
    CHAT_PATH,
    PREFILL_KV_TRANSFER_PARAMS,
    BackendError,
    VllmClient,
    decode_body,
    prefill_body,
)

ORIGINAL = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "top_k": 3}
KV_FROM_PREFILL = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
                   "remote_block_ids": [4, 5], "remote_host": "127.0.0.1", "remote_port": 5600}


def test_prefill_body_asks_one_token_no_stream_and_remote_decode():
    b = prefill_body(ORIGINAL)
    assert b["max_tokens"] == 1
    assert b["stream"] is False
    assert "stream_options" not in b
    assert b["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert b["messages"] == ORIGINAL["messages"] and b["top_k"] == 3 and b["temperature"] == 0
    assert ORIGINAL["max_tokens"] == 50 and "kv_transfer_params" not in ORIGINAL  # input untouched


def test_prefill_body_caps_max_completion_tokens_too():
    assert prefill_body({"max_completion_tokens": 9, "messages": []})["max_completion_tokens"] == 1


def test_decode_body_replaces_client_kv_params_with_prefill_ones():
    client_sent = {**ORIGINAL, "kv_transfer_params": {"remote_host": "203.0.113.9"}}
    assert decode_body(client_sent, KV_FROM_PREFILL)["kv_transfer_params"] == KV_FROM_PREFILL
    assert "kv_transfer_params" not in decode_body(client_sent, None)


class _Recorder:
    def __init__(self, handler):
        self.requests: list[httpx.Request] = []
        self._handler = handler

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self._handler(request)


async def test_prefill_then_decode_share_request_id_and_pass_kv_params_unchanged():
    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"choices": [{"message": {"content": "P"}}],
                                             "kv_transfer_params": KV_FROM_PREFILL})
        return httpx.Response(200, json={"choices": [{"message": {"content": "Paris"}}], "echo": body})

    rec = _Recorder(handler)
    async with VllmClient("http://prefill", transport=httpx.MockTransport(rec)) as c:
        kv = await c.prefill(CHAT_PATH, ORIGINAL, "rid-1")
        answer = await c.complete(CHAT_PATH, ORIGINAL, "rid-1", kv)
    assert kv == KV_FROM_PREFILL
    assert [r.headers["x-request-id"] for r in rec.requests] == ["rid-1", "rid-1"]
    assert [r.url.path for r in rec.requests] == [CHAT_PATH, CHAT_PATH]
    sent = answer["echo"]
    assert sent["kv_transfer_params"] == KV_FROM_PREFILL
    assert sent["max_tokens"] == 50 and sent["top_k"] == 3 and sent["stream"] is False


async def test_stream_yields_each_chunk_until_done():
    chunks = [{"choices": [{"delta": {"content": t}}]} for t in ("Pa", "ris", ".")]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n" + "data: {\"late\": 1}\n\n"

    def handler(req: httpx.Request) -> httpx.Response:
        assert json.loads(req.content)["stream"] is True
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async with VllmClient("http://decode", transport=httpx.MockTransport(handler)) as c:
        got = [ch async for ch in c.stream(CHAT_PATH, ORIGINAL, "rid", KV_FROM_PREFILL)]
    assert got == chunks


async def test_worker_error_status_becomes_backend_error_with_body():
    def handler(req):
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})

    async with VllmClient("http://w", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(BackendError) as ei:
            await c.prefill(CHAT_PATH, ORIGINAL, "rid")
    assert ei.value.status_code == 400
    assert ei.value.body["error"]["message"] == "prompt too long"


async def test_unreachable_worker_is_a_502_backend_error():
    def handler(req):
        raise httpx.ConnectError("refused", request=req)

    async with VllmClient("http://w", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(BackendError) as ei:
            await c.complete(CHAT_PATH, ORIGINAL, "rid")
        with pytest.raises(BackendError):
            [x async for x in c.stream(CHAT_PATH, ORIGINAL, "rid")]
        assert await c.healthy() is False
    assert ei.value.status_code == 502
