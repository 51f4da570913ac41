"""What the runtime's metrics say of requests the service did not serve (runtime.server.model.PDModel with its
workers faked at the HTTP transport, counted in a real prometheus_client registry).

Specification:
* while the model is not ready, every generation request the edge refuses (503) is counted
  `pdserve_requests_total{mode="none", status="error"}` and `pdserve_ready` is 0; 1 once a decode worker serves;
* a worker's rejection of the client's own request (4xx with an error object) is `status="client_error"`, a
  request the client left is `status="cancelled"`, streamed or not; a worker's 5xx stays `status="error"`;
* `pdserve_ttft_seconds` observes streamed requests only;
* the KV-event series name a worker by the keyed id the breaker gauge shows, never its discovered id, and a
  worker that publishes KV events has an age from when it joined, before its first batch.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("kserve")

from kserve.protocol.rest.openai.types import ChatCompletionRequest  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from runtime.config import RouterSpec  # noqa: E402
from runtime.engines.client import VllmClient  # noqa: E402
from runtime.engines.kv_events import SubscriberStats  # noqa: E402
from runtime.server.metrics import RuntimeMetrics  # noqa: E402
from runtime.server.model import PDModel, public_worker_id  # noqa: E402
from runtime.server.pairing import RoundRobinPairing  # noqa: E402
from runtime.server.routing import RouterPairing, WorkerEndpoint  # noqa: E402
from tests.unit.test_server_model import KV, _completion  # noqa: E402

CHAT_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
REJECTION = {"error": {"message": "This model's maximum context length is 4096 tokens.", "type": "BadRequestError",
                       "param": None, "code": 400}}


def _model(handler, prefill: bool = False) -> tuple[PDModel, CollectorRegistry]:
    reg = CollectorRegistry()
    transport = httpx.MockTransport(handler)
    model = PDModel("m", RoundRobinPairing(["http://prefill"] if prefill else [], ["http://decode"]),
                    metrics=RuntimeMetrics(reg), client_factory=lambda url: VllmClient(url, transport=transport))
    return model, reg


def _requests(reg: CollectorRegistry, **labels: str) -> float:
    return sum(s.value for fam in reg.collect() if fam.name == "pdserve_requests" for s in fam.samples
               if s.name == "pdserve_requests_total" and all(s.labels.get(k) == v for k, v in labels.items()))


def _request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "capital?"}], max_tokens=7, **extra)


def _stream_text() -> str:
    chunks = [{"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"content": t}}]} for t in ("Pa", "ris")]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


async def test_an_outage_counts_every_refused_request_as_an_error_and_exports_readiness():
    def down(req):
        raise httpx.ConnectError("refused", request=req)

    model, reg = _model(down)
    assert reg.get_sample_value("pdserve_ready") == 0.0  # no health check has answered yet
    for _ in range(10):
        await model.breakers.check_round(model.worker_healthy)
    assert not model.ready and reg.get_sample_value("pdserve_ready") == 0.0
    for _ in range(7):
        model.count_unready(CHAT_BODY, "/openai/v1/chat/completions")
    model.count_unready(b'{"model": "m", "prompt": "x"}', "/v1/completions")
    model.count_unready(b"", "/v1/models")  # not a generation request: no request of the error ratio
    assert _requests(reg, endpoint="chat", mode="none", status="error") == 7
    assert _requests(reg, endpoint="completions", mode="none", status="error") == 1
    assert _requests(reg) == 8
    await model.aclose()

    healthy, reg = _model(lambda req: httpx.Response(200, json=_completion("Paris")))
    await healthy.breakers.check_round(healthy.worker_healthy)
    assert healthy.ready and reg.get_sample_value("pdserve_ready") == 1.0
    await healthy.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_rejected_client_request_is_a_client_error_and_a_worker_failure_an_error(stream):
    def handler(req):
        if req.url.path == "/health":
            return httpx.Response(200)
        content = json.loads(req.content)["messages"][0]["content"]
        if content == "too long":
            return httpx.Response(400, json=REJECTION)
        if content == "crash":
            return httpx.Response(500, text="internal")
        return httpx.Response(200, text=_stream_text()) if stream else httpx.Response(200, json=_completion("Paris"))

    model, reg = _model(handler)
    for content in ("ok", "too long", "crash"):
        out = await model.create_chat_completion(ChatCompletionRequest(
            model="m", max_tokens=7, stream=stream, messages=[{"role": "user", "content": content}]))
        if hasattr(out, "__aiter__"):
            [e async for e in out]
    assert _requests(reg, status="ok") == 1
    assert _requests(reg, status="client_error") == 1
    assert _requests(reg, status="error") == 1
    await model.aclose()


async def test_a_request_the_client_left_is_cancelled_not_an_error():
    entered, never = asyncio.Event(), asyncio.Event()

    async def handler(req):
        if req.url.path == "/health":
            return httpx.Response(200)
        entered.set()
        await never.wait()  # the worker is still decoding when the client goes

    model, reg = _model(handler)
    task = asyncio.create_task(model.create_chat_completion(_request()))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _requests(reg, status="cancelled") == 1 and _requests(reg, status="error") == 0
    await model.aclose()


async def test_a_stream_the_client_closed_is_cancelled_not_an_error():
    model, reg = _model(lambda req: httpx.Response(200, text=_stream_text()))
    gen = await model.create_chat_completion(_request(stream=True))
    await gen.__anext__()  # the client read the first event, then disconnected
    await gen.aclose()
    assert _requests(reg, status="cancelled") == 1 and _requests(reg, status="error") == 0
    await model.aclose()


@pytest.mark.parametrize("prefill", [False, True])
async def test_ttft_is_observed_for_streamed_requests_only(prefill):
    def handler(req):
        if req.url.host == "prefill":
            return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})
        if json.loads(req.content).get("stream"):
            return httpx.Response(200, text=_stream_text())
        return httpx.Response(200, json=_completion("Paris"))

    model, reg = _model(handler, prefill=prefill)
    mode = "remote" if prefill else "local"
    await model.create_chat_completion(_request())
    assert (reg.get_sample_value("pdserve_ttft_seconds_count", {"endpoint": "chat", "mode": mode}) or 0) == 0
    assert reg.get_sample_value("pdserve_request_duration_seconds_count", {"endpoint": "chat", "mode": mode}) == 1
    [e async for e in await model.create_chat_completion(_request(stream=True))]
    assert reg.get_sample_value("pdserve_ttft_seconds_count", {"endpoint": "chat", "mode": mode}) == 1
    await model.aclose()


async def test_kv_event_series_name_workers_by_the_breaker_gauges_keyed_id_and_age_from_joining():
    now = [100.0]
    silent, talking = "decode@aaaaaaaaaaaa", "decode@bbbbbbbbbbbb"  # discovered ids: unkeyed hashes of URLs
    pairing = RouterPairing(RouterSpec(), 16, [
        WorkerEndpoint(silent, "decode", "http://10.0.0.1:8000", "tcp://10.0.0.1:5557"),
        WorkerEndpoint(talking, "decode", "http://10.0.0.2:8000", "tcp://10.0.0.2:5557"),
        WorkerEndpoint("decode@cccccccccccc", "decode", "http://10.0.0.3:8000")], clock=lambda: now[0])
    reg = CollectorRegistry()
    model = PDModel("m", pairing, metrics=RuntimeMetrics(reg), clock=lambda: now[0],
                    client_factory=lambda url: VllmClient(url, transport=httpx.MockTransport(
                        lambda req: httpx.Response(200))))
    await model.breakers.check_round(model.worker_healthy)
    stats = SubscriberStats()
    stats.bump(stats.num_batches, talking)
    now[0] = 150.0
    pairing.last_event_s[talking] = now[0]  # as apply_batch records a batch
    model.metrics.kv_index.source = lambda: (stats, pairing.last_event_s, pairing.clock)
    now[0] = 100.0 + 3600  # an hour later: the silent worker never published a batch

    text = generate_latest(reg).decode()
    assert "decode@" not in text  # no unkeyed id in any series
    breaker_ids = {s.labels["worker"] for fam in reg.collect() if fam.name == "pdserve_worker_breaker_state"
                   for s in fam.samples}
    assert breaker_ids == {public_worker_id(w, model._header_key) for w in pairing.workers}
    ages = {s.labels["worker"]: s.value for fam in reg.collect() if fam.name == "pdserve_router_kv_event_age_seconds"
            for s in fam.samples}
    key = model._header_key
    assert ages == {public_worker_id(silent, key): 3600.0, public_worker_id(talking, key): 3550.0}
    assert set(ages) <= breaker_ids
    assert reg.get_sample_value("pdserve_router_kv_event_batches_total",
                                {"worker": public_worker_id(talking, key)}) == 1
    await model.aclose()
