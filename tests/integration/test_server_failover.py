"""Decode-worker death mid-stream, with real processes on 127.0.0.1.

The runtime (`python -m runtime.server`, KServe) fronts two decode workers. They are small stand-in HTTP
servers speaking vLLM's streaming protocol, because the fault — a worker process that exits in the middle of
a response — cannot be induced on demand in a shared vLLM worker: worker A streams two tokens and then the
process exits (os._exit: sockets reset, no [DONE]); worker B answers continuations and records them.

Specification: the client receives one uninterrupted stream ending in [DONE] with A's tokens followed by B's;
B receives the original conversation plus A's text as an open assistant message (continue_final_message) and
a token budget reduced by what A sent; the runtime counts one migration; with B also dying the stream ends in
an OpenAI error event, never a hang.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from runtime.engines.metrics import sample_sum
from runtime.engines.vllm_worker import free_port

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

STANDIN = r'''
import json, os, sys, asyncio
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODE, PORT, RECORD = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def chunk(text):
    return "data: " + json.dumps({"id": "std-" + MODE, "object": "chat.completion.chunk", "created": 1,
        "model": "m", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}) + "\n\n"

async def chat(request):
    body = await request.json()
    with open(RECORD, "a") as fh:
        fh.write(json.dumps(body) + "\n")
    async def gen():
        if MODE == "dies":
            for t in ("The", " capital"):
                yield chunk(t)
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            os._exit(3)
        for t in (" of", " France", " is", " Paris."):
            yield chunk(t)
        yield "data: [DONE]\n\n"
    return StreamingResponse(gen(), media_type="text/event-stream")

async def health(request):
    return JSONResponse({})

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])
uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
'''


class StandIn:
    def __init__(self, mode: str, tmp_path):
        self.port = free_port()
        self.record = tmp_path / f"{mode}-{self.port}.jsonl"
        self.proc = subprocess.Popen([sys.executable, "-c", STANDIN, mode, str(self.port), str(self.record)])
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(f"stand-in {self.url} did not start")

    def bodies(self) -> list[dict]:
        return [json.loads(line) for line in self.record.read_text().splitlines()] if self.record.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _runtime(decode_urls: list[str], tmp_path):
    from runtime.server.launch import RuntimeProcess

    rt = RuntimeProcess("m", prefill_urls=[], decode_urls=decode_urls, log_path=tmp_path / "runtime.log")
    rt.start()
    return rt


def _stream_chat(url: str) -> list[str]:
    body = {"model": "m", "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 12,
            "stream": True}
    with httpx.stream("POST", f"{url}/openai/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]


@pytest.mark.parametrize("second_dies", [False, True], ids=["migrates", "limit-reached"])
def test_decode_worker_dying_mid_stream(tmp_path, second_dies):
    a = StandIn("dies", tmp_path)
    b = StandIn("dies" if second_dies else "serves", tmp_path)
    rt = None
    try:
        a.wait_ready()
        b.wait_ready()
        rt = _runtime([a.url, b.url], tmp_path)
        rt.wait_ready(180)
        events = _stream_chat(rt.url)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert a.proc.wait(10) == 3  # the first worker really died mid-response
        metrics = httpx.get(f"{rt.url}/metrics", timeout=10).text
        assert sample_sum(metrics, "pdserve_migrations_total") == 1
        cont = b.bodies()[0]
        assert cont["messages"][-1] == {"role": "assistant", "content": "The capital"}
        assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
        assert cont["max_tokens"] == 10
        if second_dies:
            assert chunks[-1]["error"]["code"] == 502
            text = "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1])
            assert text == "The capital" * 2  # both workers' tokens reached the client before the error
        else:
            assert all("error" not in c for c in chunks)
            assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "The capital of France is Paris."
            assert {c["id"] for c in chunks} == {"std-dies"}
    finally:
        if rt is not None:
            rt.stop()
        a.stop()
        b.stop()
