"""OpenAI-shaped errors of the real runtime app (KServe RESTServer built by runtime.server.app, in process on
127.0.0.1; the decode worker is a dead port, never reached).

Specification: requests that vLLM's request models reject with VLLMValidationError (not a pydantic error:
empty or null prompt, stream_options without stream, top_logprobs without logprobs) get a 400 with
an OpenAI error body, as vLLM's own server answers, instead of KServe's generic 500.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")
pytest.importorskip("vllm.exceptions")

MSG = [{"role": "user", "content": "hi"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_vllm_request_model_rejections_are_openai_400s():
    from prometheus_client import CollectorRegistry

    from runtime.server.app import build_model, build_rest_server

    dead = f"http://127.0.0.1:{_free_port()}"
    model = build_model("m", prefill_urls=[], decode_urls=[dead], registry=CollectorRegistry())
    port = _free_port()
    rest = build_rest_server(model, host="127.0.0.1", http_port=port)
    task = asyncio.create_task(rest.start())
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            for _ in range(400):
                try:
                    if (await c.get("/v2/health/ready")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
            cases = [("/openai/v1/completions", {"prompt": ""}),
                     ("/openai/v1/completions", {"prompt": None}),
                     ("/openai/v1/chat/completions", {"messages": MSG, "stream_options": {"include_usage": True}}),
                     ("/openai/v1/chat/completions", {"messages": MSG, "top_logprobs": 5})]
            for path, body in cases:
                r = await c.post(path, json={"model": "m", **body})
                assert r.status_code == 400, (body, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["code"] == "400" and err["type"] == "BadRequestError" and err["message"]
                assert dead.split("//")[1] not in r.text
    finally:
        rest._server.should_exit = True  # uvicorn's own shutdown
        try:
            await asyncio.wait_for(task, 10)
        except BaseException:
            task.cancel()
        await model.aclose()
