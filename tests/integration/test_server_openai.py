"""The real runtime server (KServe ModelServer, `python -m runtime.server`) on 127.0.0.1, no vLLM workers.

Specification: the OpenAI routes exist (KServe would skip them silently); a malformed request gets 400 with an
OpenAI error body naming the field, before any worker is called; an unknown model gets an OpenAI-style 404;
an unreachable decode worker gives a 502 OpenAI error that names no internal address; /metrics exports the
runtime's counters.
"""

from __future__ import annotations

import httpx
import pytest

from runtime.engines.metrics import sample_sum
from runtime.engines.vllm_worker import free_port

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

MODEL = "tiny"


@pytest.fixture(scope="module")
def runtime_alone(tmp_path_factory):
    from runtime.server.launch import RuntimeProcess

    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    rt = RuntimeProcess(MODEL, prefill_urls=[dead[0]], decode_urls=[dead[1]],
                        log_path=tmp_path_factory.mktemp("rt") / "runtime.log")
    try:
        rt.start()
        rt.wait_ready(180, serving=False)  # its workers are down: the server alone
        yield rt, dead
    finally:
        rt.stop()


def _assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert isinstance(err["message"], str) and err["message"]
    return err


def test_openai_routes_are_served(runtime_alone):
    rt, _ = runtime_alone
    r = httpx.get(f"{rt.url}/openai/v1/models", timeout=10)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    one = httpx.get(f"{rt.url}/openai/v1/models/{MODEL}", timeout=10)
    assert one.status_code == 200 and one.json()["id"] == MODEL and one.json()["object"] == "model"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("chat/completions", {"model": MODEL}, "messages"),
        ("chat/completions", {"model": MODEL, "messages": "hello"}, "messages"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
         "temperature"),
        ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ],
)
def test_malformed_request_is_400_naming_the_field(runtime_alone, path, body, param):
    rt, _ = runtime_alone
    err = _assert_openai_error(httpx.post(f"{rt.url}/openai/v1/{path}", json=body, timeout=10), 400)
    assert err["param"] == param
    assert param in err["message"]
    assert err["type"] == "BadRequestError"


def test_unparseable_json_is_400(runtime_alone):
    rt, _ = runtime_alone
    r = httpx.post(f"{rt.url}/openai/v1/chat/completions", content=b'{"model": ',
                   headers={"content-type": "application/json"}, timeout=10)
    _assert_openai_error(r, 400)


def test_unknown_model_is_openai_404(runtime_alone):
    rt, _ = runtime_alone
    r = httpx.post(f"{rt.url}/openai/v1/chat/completions",
                   json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}, timeout=10)
    err = _assert_openai_error(r, 404)
    assert err["param"] == "model" and err["message"] == "The model `nope` does not exist."  # vLLM's words
    assert err["type"] == "NotFoundError"


def test_unreachable_workers_make_it_unready_503_with_retry_after(runtime_alone):
    rt, dead = runtime_alone
    r = httpx.post(f"{rt.url}/openai/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    err = _assert_openai_error(r, 503)
    assert int(r.headers["retry-after"]) > 0
    assert not any(u.split("//")[1] in err["message"] for u in dead)
    for probe in ("/v2/health/ready", f"/v1/models/{MODEL}"):
        ready = httpx.get(f"{rt.url}{probe}", timeout=10)
        assert ready.status_code == 503 and int(ready.headers["retry-after"]) > 0, (probe, ready.text)
    assert httpx.get(f"{rt.url}/v2/health/live", timeout=10).status_code == 200
    metrics = httpx.get(f"{rt.url}/metrics", timeout=10).text
    assert sample_sum(metrics, "pdserve_prefill_fallbacks_total") == 0  # no worker was even tried
