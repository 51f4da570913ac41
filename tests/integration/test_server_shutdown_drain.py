"""SIGTERM to the runtime drains what it is serving (real processes on 127.0.0.1).

A decode engine stand-in (bench/engine_standin.py) paces tokens 100 ms apart; `python -m runtime.server` runs in
front of it with `--shutdown-delay-s` and `--shutdown-grace-s` (runtime/server/app.py `ShutdownDrain`).
Specification: once SIGTERM arrives /v2/health/ready answers 503 while requests are still served for the
delay; a stream in flight that ends within the grace completes, with `[DONE]`, and the process then exits;
a stream still open at the grace's end ends with an OpenAI error event (503) and `data: [DONE]`, and a
non-streaming request still waiting gets a 503 OpenAI error object, not a bare 500 or a cut connection.

The tests wait for what they need (a token streamed, a request at the worker, readiness turned 503) rather
than for fixed times, and each time bound lies ten seconds or more from both the rule under test and its
failure, so a loaded machine that pauses the test or the runtime for seconds changes no verdict.
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

from runtime.engines.metrics import sample_sum
from runtime.engines.vllm_worker import free_port
from runtime.paths import REPO_ROOT
from tests.integration.test_server_planner import _stop, _wait_http

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

TOKEN_MS = 100
WAIT_S = 60.0  # for a condition that a healthy run meets within a second or two


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


def _stream(url: str, max_tokens: int, out: dict, progress: threading.Condition) -> None:
    """POST a streaming completion; `out` gets the `data:` payloads, or the exception that ended the read, and
    `done` at the end; `progress` is notified of each payload and of the end."""
    events: list[str] = []
    out["events"] = events
    try:
        with httpx.stream("POST", f"{url}/openai/v1/completions", timeout=WAIT_S,
                          json={"model": "m", "prompt": "hi", "max_tokens": max_tokens, "stream": True}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    with progress:
                        events.append(line[6:])
                        progress.notify_all()
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    finally:
        with progress:
            out["done"] = True
            progress.notify_all()


def _wait_events(out: dict, progress: threading.Condition, n: int) -> bool:
    """Wait (up to WAIT_S) until the stream of `_stream` has brought `n` payloads; False if it ended first."""
    with progress:
        progress.wait_for(lambda: len(out.get("events", ())) >= n or out.get("done"), WAIT_S)
        return len(out.get("events", ())) >= n


def _completion(url: str, out: dict) -> None:
    try:
        r = httpx.post(f"{url}/openai/v1/completions", timeout=WAIT_S,
                       json={"model": "m", "prompt": "hi", "max_tokens": 300})
        out["status"], out["body"] = r.status_code, r.text
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)


def _wait_running(engine_url: str, n: int) -> None:
    """Poll the engine stand-in's /metrics until it has `n` requests running (a process of its own: nothing to
    await)."""
    deadline = time.monotonic() + WAIT_S
    with httpx.Client(timeout=WAIT_S) as c:
        while sample_sum(c.get(f"{engine_url}/metrics").text, "vllm:num_requests_running") < n:
            assert time.monotonic() < deadline, f"the engine never had {n} requests running"
            time.sleep(0.05)


def test_a_stream_that_ends_within_the_grace_completes_and_readiness_turns_503(tmp_path, decode_url):
    delay_s = 2.0
    rt = _runtime(tmp_path, decode_url, "--shutdown-delay-s", str(delay_s), "--shutdown-grace-s", "120")
    try:
        out: dict = {}
        progress = threading.Condition()
        reader = threading.Thread(target=_stream, args=(rt.url, 40, out, progress))  # ~4 s of tokens
        reader.start()
        assert _wait_events(out, progress, 1), (out, rt._tail())
        sigterm_at = time.monotonic()
        rt._proc.send_signal(signal.SIGTERM)
        # The drain begins after the last readiness request answered 200 was sent (or after the signal), and the
        # listener closes `delay_s` after the drain begins: a request refused or cut sooner than `delay_s` after
        # that is the failure this test is for; later, only a paused test (or runtime) sent it so late.
        not_draining_s = sigterm_at
        with httpx.Client(timeout=WAIT_S) as c:
            try:
                deadline = time.monotonic() + WAIT_S
                while True:  # uvicorn sees the signal on its next 0.1-s tick
                    sent_s = time.monotonic()
                    ready = c.get(f"{rt.url}/v2/health/ready").status_code
                    if ready != 200:
                        break
                    not_draining_s = sent_s
                    assert time.monotonic() < deadline, rt._tail()
                    time.sleep(0.05)
                assert ready == 503, ready
                # still serving during the delay: a request that arrives now is answered
                r = c.post(f"{rt.url}/openai/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
            except httpx.TransportError as exc:
                assert time.monotonic() - not_draining_s >= delay_s, (repr(exc), rt._tail())
        reader.join(WAIT_S)
        assert not reader.is_alive() and "error" not in out, (out, rt._tail())
        events = out["events"]
        assert events[-1] == "[DONE]", (events[-3:], rt._tail())
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices"))
        assert text == "".join(f"t{i} " for i in range(40))
        rt._proc.wait(150)
        assert time.monotonic() - sigterm_at < 60  # it left once the stream ended, not at the grace's end (120 s)
    finally:
        rt.stop()


def test_requests_still_open_at_the_grace_end_get_an_openai_error(tmp_path, decode_url):
    rt = _runtime(tmp_path, decode_url, "--shutdown-grace-s", "2")
    try:
        streamed: dict = {}
        progress = threading.Condition()
        reader = threading.Thread(target=_stream, args=(rt.url, 300, streamed, progress))  # ~30 s of tokens
        plain: dict = {}
        waiter = threading.Thread(target=_completion, args=(rt.url, plain))  # ~30 s to its answer
        reader.start()
        waiter.start()
        assert _wait_events(streamed, progress, 2), (streamed, rt._tail())  # tokens before the error
        _wait_running(decode_url, 2)  # the non-streaming request has reached the worker
        sigterm_at = time.monotonic()
        rt._proc.send_signal(signal.SIGTERM)
        reader.join(WAIT_S)
        waiter.join(WAIT_S)
        took = time.monotonic() - sigterm_at
        assert not reader.is_alive() and not waiter.is_alive(), rt._tail()
        assert "error" not in streamed, (streamed.get("error"), rt._tail())
        events = streamed["events"]
        assert events[-1] == "[DONE]", (events[-3:], rt._tail())
        err = json.loads(events[-2])["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError", err
        assert 1 < len(events) - 2 < 300  # some tokens came before the error
        assert plain.get("status") == 503, (plain, rt._tail())
        assert json.loads(plain["body"])["error"]["type"] == "ServiceUnavailableError"
        assert took < 20, took  # at the grace (2 s), not at KServe's default 30 s nor at the answers' end
        rt._proc.wait(WAIT_S)
    finally:
        rt.stop()
