"""SIGTERM to the runtime drains what it is serving (real processes on 127.0.0.1).

A decode engine stand-in (bench/engine_standin.py) paces tokens 100 ms apart; `python -m runtime.server` runs in
front of it with `--shutdown-delay-s` and `--shutdown-grace-s` (runtime/server/app.py `ShutdownDrain`).
Specification: once SIGTERM arrives /v2/health/ready answers 503 while requests are still served for the
delay; a stream in flight that ends within the grace completes, with `[DONE]`, and the process then exits;
a stream still open at the grace's end ends with an OpenAI error event (503) and `data: [DONE]`, and a
non-streaming request still waiting gets a 503 OpenAI error object, not a bare 500 or a cut connection.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from runtime.engines.vllm_worker import free_port
from runtime.paths import REPO_ROOT
from tests.integration.test_server_planner import _stop, _wait_http

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

TOKEN_MS = 100


@pytest.fixture
def decode_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "bench/engine_standin.py"), "--port", str(port),
                             "--model", "m", "--token-interval-ms", str(TOKEN_MS)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def _runtime(tmp_path, decode_url: str, *args: str):
    from runtime.server.launch import RuntimeProcess

    rt = RuntimeProcess("m", prefill_urls=[], decode_urls=[decode_url], log_path=tmp_path / "runtime.log",
                        extra_args=["--no-access-log", *args])
    rt.start()
    rt.wait_ready(120)
    return rt


def _stream(url: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    """POST a streaming completion; `out` gets the `data:` payloads, or the exception that ended the read."""
    events: list[str] = []
    out["events"] = events
    try:
        with httpx.stream("POST", f"{url}/openai/v1/completions", timeout=60,
                          json={"model": "m", "prompt": "hi", "max_tokens": max_tokens, "stream": True}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    finally:
        started.set()


def _completion(url: str, out: dict) -> None:
    try:
        r = httpx.post(f"{url}/openai/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "hi", "max_tokens": 100})
        out["status"], out["body"] = r.status_code, r.text
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)


def test_a_stream_that_ends_within_the_grace_completes_and_readiness_turns_503(tmp_path, decode_url):
    rt = _runtime(tmp_path, decode_url, "--shutdown-delay-s", "2", "--shutdown-grace-s", "30")
    try:
        out: dict = {}
        started = threading.Event()
        reader = threading.Thread(target=_stream, args=(rt.url, 40, out, started))  # ~4 s of tokens
        reader.start()
        assert started.wait(30), rt._tail()
        sigterm_at = time.monotonic()
        rt._proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # uvicorn sees the signal on its next 0.1-s tick
        with httpx.Client(timeout=10) as c:
            assert c.get(f"{rt.url}/v2/health/ready").status_code == 503
            # still serving during the delay: a request that arrives now is answered
            r = c.post(f"{rt.url}/openai/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
        reader.join(30)
        assert "error" not in out, (out, rt._tail())
        events = out["events"]
        assert events[-1] == "[DONE]", (events[-3:], rt._tail())
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices"))
        assert text == "".join(f"t{i} " for i in range(40))
        rt._proc.wait(30)
        assert time.monotonic() - sigterm_at < 15  # it left once the stream ended, not at the grace's end
    finally:
        rt.stop()


def test_requests_still_open_at_the_grace_end_get_an_openai_error(tmp_path, decode_url):
    rt = _runtime(tmp_path, decode_url, "--shutdown-grace-s", "2")
    try:
        streamed: dict = {}
        started = threading.Event()
        reader = threading.Thread(target=_stream, args=(rt.url, 300, streamed, started))  # ~30 s of tokens
        plain: dict = {}
        waiter = threading.Thread(target=_completion, args=(rt.url, plain))
        reader.start()
        waiter.start()
        assert started.wait(30), rt._tail()
        time.sleep(0.3)  # the non-streaming request has reached the worker
        sigterm_at = time.monotonic()
        rt._proc.send_signal(signal.SIGTERM)
        reader.join(30)
        waiter.join(30)
        took = time.monotonic() - sigterm_at
        assert "error" not in streamed, (streamed.get("error"), rt._tail())
        events = streamed["events"]
        assert events[-1] == "[DONE]", (events[-3:], rt._tail())
        err = json.loads(events[-2])["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError", err
        assert 1 < len(events) - 2 < 300  # some tokens came before the error
        assert plain.get("status") == 503, (plain, rt._tail())
        assert json.loads(plain["body"])["error"]["type"] == "ServiceUnavailableError"
        assert took < 10, took  # at the grace (2 s), not at KServe's default 30 s
        rt._proc.wait(15)
    finally:
        rt.stop()
