"""The runtime's P/D request flow (runtime.server.model.PDModel), workers faked at the HTTP transport.

Specification:
* remote prefill then decode, with the prefill's kv_transfer_params, one request id, the client's fields;
* a prefill worker that fails (5xx / unreachable) → local prefill on the decode worker, counted as fallback;
* a prefill worker that rejects the request (4xx) → that error to the client, decode never called;
* streaming returns SSE strings ending in [DONE]; TTFT and request counters are recorded;
* client-supplied kv_transfer_params never reach a worker.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("kserve")

from kserve.protocol.rest.openai.types import ChatCompletion, ChatCompletionRequest, ErrorResponse  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from runtime.engines.client import VllmClient  # noqa: E402
from runtime.engines.metrics import sample_sum  # noqa: E402
from runtime.server.metrics import RuntimeMetrics  # noqa: E402
from runtime.server.model import PDModel  # noqa: E402
from runtime.server.pairing import RoundRobinPairing  # noqa: E402
from runtime.server.routing import estimate_prompt_tokens  # noqa: E402

KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "127.0.0.1",
      "remote_port": 1}


def _completion(content: str) -> dict:
    return {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}, "kv_transfer_params": None}


class FakeWorkers:
    """Records every call per worker host; `prefill_status` / `decode_status` decide how the prefill / decode
    worker answers (non-streaming)."""

    def __init__(self, prefill_status: int = 200, decode_status: int = 200):
        self.prefill_status, self.decode_status = prefill_status, decode_status
        self.calls: list[tuple[str, dict, str]] = []

    def handler(self, req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        self.calls.append((req.url.host, body, req.headers.get("x-request-id")))
        if req.url.host == "prefill":
            if self.prefill_status == 599:
                raise httpx.ConnectError("down", request=req)
            if self.prefill_status != 200:
                return httpx.Response(self.prefill_status, json={"error": {"message": "nope", "code": 400}})
            return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})
        if body.get("stream"):
            chunks = [{"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [{"index": 0, "delta": {"content": t}}]} for t in ("Pa", "ris")]
            if (body.get("stream_options") or {}).get("include_usage"):
                chunks.append({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                               "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                                        "total_tokens": 7}})
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text)
        if self.decode_status != 200:
            return httpx.Response(self.decode_status, json={"error": {"message": "decode says no", "code": 400}})
        return httpx.Response(200, json=_completion("Paris"))


def _model(workers: FakeWorkers) -> tuple[PDModel, CollectorRegistry]:
    reg = CollectorRegistry()
    transport = httpx.MockTransport(workers.handler)
    model = PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]), metrics=RuntimeMetrics(reg),
                    client_factory=lambda url: VllmClient(url, transport=transport))
    return model, reg


def _windowed_model(transport, window, registry=None) -> PDModel:
    """A one-pair runtime model over `transport` that feeds the planner's request `window`."""
    return PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]),
                   metrics=RuntimeMetrics(CollectorRegistry() if registry is None else registry),
                   client_factory=lambda url: VllmClient(url, transport=transport), observer=window)


def _request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "capital?"}], max_tokens=7,
                                 temperature=0, **extra)


def _metric(reg: CollectorRegistry, name: str, **labels) -> float:
    return reg.get_sample_value(name, labels) or 0.0


async def test_remote_prefill_then_decode_with_kv_params_and_one_request_id():
    w = FakeWorkers()
    model, reg = _model(w)
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ChatCompletion)
    assert out.choices[0].message.content == "Paris"
    (h1, pre, rid1), (h2, dec, rid2) = w.calls
    assert (h1, h2) == ("prefill", "decode")
    assert rid1 == rid2 and rid1.startswith("pdserve-")
    assert pre["max_tokens"] == 1 and pre["kv_transfer_params"]["do_remote_decode"] is True
    assert dec["kv_transfer_params"] == KV and dec["max_tokens"] == 7
    assert _metric(reg, "pdserve_requests_total", endpoint="chat", mode="remote", status="ok") == 1
    # not streamed: the client saw no first token apart from the answer (TTFT is observed for streams only)
    assert _metric(reg, "pdserve_ttft_seconds_count", endpoint="chat", mode="remote") == 0


@pytest.mark.parametrize("status", [500, 599])
async def test_failed_prefill_worker_falls_back_to_local_prefill(status):
    w = FakeWorkers(prefill_status=status)
    model, reg = _model(w)
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ChatCompletion)
    hosts = [c[0] for c in w.calls]
    assert hosts == ["prefill", "decode"]
    assert "kv_transfer_params" not in w.calls[1][1]
    assert _metric(reg, "pdserve_prefill_fallbacks_total") == 1
    assert _metric(reg, "pdserve_requests_total", endpoint="chat", mode="local", status="ok") == 1


async def test_prefill_rejecting_the_request_lets_the_decode_worker_answer_in_the_clients_terms():
    # the prefill leg's body is not the client's (max_tokens=1, no stream): its rejection may speak of that
    w = FakeWorkers(prefill_status=400, decode_status=400)
    model, reg = _model(w)
    out = await model.create_chat_completion(_request())
    assert isinstance(out, ErrorResponse)
    assert out.error.code == 400 and out.error.message == "decode says no"
    assert [c[0] for c in w.calls] == ["prefill", "decode"]
    assert "kv_transfer_params" not in w.calls[1][1]  # the client's request, prefilled on the decode worker
    assert _metric(reg, "pdserve_prefill_fallbacks_total") == 0  # not a worker failure
    served = FakeWorkers(prefill_status=400)
    model, _ = _model(served)
    assert not isinstance(await model.create_chat_completion(_request()), ErrorResponse)


async def test_streaming_yields_sse_and_done():
    w = FakeWorkers()
    model, reg = _model(w)
    gen = await model.create_chat_completion(_request(stream=True))
    events = [e async for e in gen]
    assert not any('"usage"' in e for e in events)  # asked of the worker for metrics, hidden from the client
    assert events[-1] == "data: [DONE]\n\n"
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    text = "".join(json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1])
    assert text == "Paris"
    assert w.calls[1][1]["stream"] is True
    assert _metric(reg, "pdserve_requests_total", endpoint="chat", mode="remote", status="ok") == 1


async def test_client_kv_transfer_params_never_reach_a_worker():
    w = FakeWorkers()
    model, _ = _model(w)
    evil = {"do_remote_prefill": True, "remote_host": "203.0.113.7", "remote_port": 9}
    await model.create_chat_completion(_request(kv_transfer_params=evil))
    pre, dec = w.calls[0][1], w.calls[1][1]
    assert pre["kv_transfer_params"]["remote_host"] is None
    assert dec["kv_transfer_params"] == KV
    assert "203.0.113.7" not in json.dumps([c[1] for c in w.calls])


def test_metrics_exposition_is_readable_by_the_engine_parser():
    from prometheus_client import generate_latest

    reg = CollectorRegistry()
    m = RuntimeMetrics(reg)
    m.requests.labels("chat", "remote", "ok").inc(3)
    assert sample_sum(generate_latest(reg).decode(), "pdserve_requests_total", mode="remote") == 3


async def test_stuck_prefill_worker_times_out_into_local_prefill():
    import asyncio

    class Stuck(FakeWorkers):
        async def handle_async(self, req: httpx.Request) -> httpx.Response:
            if req.url.host == "prefill":
                self.calls.append((req.url.host, json.loads(req.content), req.headers.get("x-request-id")))
                await asyncio.sleep(30)
            return self.handler(req)

    w = Stuck()
    reg = CollectorRegistry()
    transport = httpx.MockTransport(w.handle_async)
    model = PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]), metrics=RuntimeMetrics(reg),
                    client_factory=lambda url: VllmClient(url, transport=transport), prefill_timeout_s=0.2)
    out = await asyncio.wait_for(model.create_chat_completion(_request()), 5)
    assert isinstance(out, ChatCompletion)
    assert [c[0] for c in w.calls] == ["prefill", "decode"]
    assert "kv_transfer_params" not in w.calls[1][1]
    assert _metric(reg, "pdserve_prefill_fallbacks_total") == 1


async def test_finished_requests_feed_the_planner_request_window():
    from runtime.server.planner_loop import RequestWindow

    w = FakeWorkers()
    reg = CollectorRegistry()
    transport = httpx.MockTransport(w.handler)
    window = RequestWindow()
    model = _windowed_model(transport, window, reg)
    await model.create_chat_completion(_request())
    [e async for e in await model.create_chat_completion(_request(stream=True))]
    stats = window.drain()
    assert stats.num_requests == 2
    assert stats.mean_isl_tokens == 5  # usage.prompt_tokens (streaming: usage asked of the worker)
    assert stats.mean_osl_tokens == (2 + 2) / 2  # usage.completion_tokens / two streamed text chunks
    assert stats.ttft_p90_s is not None and stats.ttft_p90_s >= 0
    # the planner gets the prefill's first token of both; the TTFT histogram only the streamed one's
    assert _metric(reg, "pdserve_ttft_seconds_count", endpoint="chat", mode="remote") == 1


async def test_a_request_is_an_arrival_in_the_window_it_came_in_not_when_its_prefill_answers():
    """The planner's window counts what the fleet simulator counts in a tick: the requests that arrived in it
    (a burst queued for prefill is demand now), the first tokens sent in it, the requests that ended in it."""
    from runtime.server.planner_loop import RequestWindow

    w = FakeWorkers()
    at_prefill, release = asyncio.Event(), asyncio.Event()

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "prefill":  # a prefill worker with a queue
            at_prefill.set()
            await release.wait()
        return w.handler(req)

    transport = httpx.MockTransport(handler)
    window = RequestWindow()
    model = _windowed_model(transport, window)
    task = asyncio.create_task(model.create_chat_completion(_request(stream=True,
                                                                     stream_options={"include_usage": True})))
    await asyncio.wait_for(at_prefill.wait(), 5.0)
    waiting = window.drain()
    assert waiting.num_requests == 1 and waiting.prompt_arrivals is not None
    assert waiting.mean_isl_tokens == estimate_prompt_tokens({"messages": [{"role": "user", "content": "capital?"}]})
    assert waiting.ttft_p90_s is None and waiting.mean_osl_tokens == 0.0  # nothing sent, nothing ended yet
    release.set()
    [e async for e in await task]
    done = window.drain()
    assert done.num_requests == 0  # counted once, in the window it came in
    assert done.ttft_p90_s is not None and done.mean_osl_tokens == 2


async def test_the_window_gets_means_and_durations_and_no_ttft_it_did_not_see():
    """The loop feeds the planner the means the simulator feeds it (TTFT, ITL, request duration); a
    non-streamed answer prefilled by its decode worker shows no first token, so it gives neither TTFT nor
    ITL (its whole duration as TTFT and ITL 0 would drag the ITL down and the TTFT up)."""
    from runtime.server.planner_loop import RequestWindow

    w = FakeWorkers()
    transport = httpx.MockTransport(w.handler)
    window = RequestWindow()
    reg = CollectorRegistry()
    model = _windowed_model(transport, window, reg)
    await model.create_chat_completion(_request())  # remote prefill: its TTFT is the prefill's answer
    stats = window.drain()
    assert stats.ttft_mean_s is not None and stats.duration_mean_s is not None
    assert stats.ttft_mean_s <= stats.duration_mean_s and stats.itl_mean_s is not None
    w.prefill_status = 500  # falls back to a local prefill: the answer comes whole
    await model.create_chat_completion(_request())
    stats = window.drain()
    assert stats.num_requests == 1 and stats.mean_osl_tokens == 2
    assert (stats.ttft_p90_s, stats.ttft_mean_s, stats.itl_p90_s, stats.itl_mean_s) == (None, None, None, None)
    assert stats.duration_mean_s is not None
    # nor does the client's TTFT histogram (streamed requests only: runtime.server.metrics), nor its ITL
    assert _metric(reg, "pdserve_ttft_seconds_count", endpoint="chat", mode="local") == 0
    assert _metric(reg, "pdserve_itl_seconds_count", endpoint="chat", mode="local") == 0


async def test_failed_abandoned_and_shed_requests_are_demand_the_window_counts():
    """Without a tokenizer the prompt length comes from the worker's usage at the end: a request that never
    got there still arrived (estimated from its body), and so did one admission shed; short prompts count as
    priority traffic, as admission judges them."""
    import asyncio

    from runtime.server.errors import Overloaded
    from runtime.server.planner_loop import RequestWindow

    window = RequestWindow()
    failing = FakeWorkers(decode_status=400)
    transport = httpx.MockTransport(failing.handler)
    model = _windowed_model(transport, window)
    assert isinstance(await model.create_chat_completion(_request()), ErrorResponse)
    stats = window.drain()
    assert stats.num_requests == 1 and stats.num_priority_requests == 1 and stats.mean_isl_tokens > 0

    class Stalls(FakeWorkers):  # the decode leg never answers: the client gives up
        def handler(self, req):
            if req.url.host == "decode":
                raise httpx.ReadTimeout("stalled", request=req)
            return super().handler(req)

    transport2 = httpx.MockTransport(Stalls().handler)
    model.client_factory = lambda url: VllmClient(url, transport=transport2)
    model._clients.clear()
    gen = await model.create_chat_completion(_request(stream=True))
    await gen.aclose()  # the client went away before any token
    assert window.drain().num_requests == 1

    from runtime.config import OverloadSpec

    shedding = PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]),
                       metrics=RuntimeMetrics(CollectorRegistry()), observer=window, slo_ttft_s=1.0,
                       overload=OverloadSpec(shed_ttft_factor=1.0, shed_priority_factor=1.0),
                       client_factory=lambda url: VllmClient(url, transport=transport))
    shedding.service.observe(5.0, ahead=0, servers=1)  # a first token takes 5 s: over the 1-s bound
    shedding._awaiting["queued"] = (0, 1)  # one admitted request waits for its first token
    with pytest.raises(Overloaded):
        await shedding.create_chat_completion(_request())
    assert window.drain().num_requests == 1
    await asyncio.sleep(0)


class WaitsForNudge(FakeWorkers):
    """A decode worker that answers only once the prefill worker got a 1-token request (the stall that
    bench/pd_tail.py measures: vLLM's decode waits for the prefill engine's next forward pass)."""

    def __init__(self):
        super().__init__()
        import asyncio

        self.nudged = asyncio.Event()

    async def handle_async(self, req: httpx.Request) -> httpx.Response:
        import asyncio

        body = json.loads(req.content)
        if req.url.host == "prefill" and body.get("prompt") == ".":
            self.calls.append(("nudge", body, req.headers.get("x-request-id")))
            self.nudged.set()
            return httpx.Response(200, json=_completion("."))
        if req.url.host == "decode":
            await asyncio.wait_for(self.nudged.wait(), 5)
        return self.handler(req)


def _nudging_model(w: FakeWorkers, after_s: float) -> tuple[PDModel, CollectorRegistry]:
    reg = CollectorRegistry()
    transport = httpx.MockTransport(w.handle_async)
    model = PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]), metrics=RuntimeMetrics(reg),
                    client_factory=lambda url: VllmClient(url, transport=transport), prefill_nudge_after_s=after_s)
    return model, reg


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_waiting_for_its_first_token_gets_the_prefill_worker_nudged(stream):
    import asyncio

    w = WaitsForNudge()
    model, reg = _nudging_model(w, 0.05)
    out = await asyncio.wait_for(model.create_chat_completion(_request(stream=stream)), 5)
    if stream:
        events = [e async for e in out]
        assert any("Pa" in e for e in events) and events[-1] == "data: [DONE]\n\n"
    else:
        assert isinstance(out, ChatCompletion) and out.choices[0].message.content == "Paris"
    nudges = [c for c in w.calls if c[0] == "nudge"]
    assert len(nudges) >= 1
    body, rid = nudges[0][1], nudges[0][2]
    assert body["max_tokens"] == 1 and body["model"] == "m" and "kv_transfer_params" not in body
    assert rid.startswith("pdserve-nudge-") and rid != w.calls[0][2]  # its own request id
    assert _metric(reg, "pdserve_prefill_nudges_total") == len(nudges)


async def test_no_nudge_when_the_first_token_comes_in_time_or_nudging_is_off():
    w = FakeWorkers()

    async def fast(req):
        return w.handler(req)

    w.handle_async = fast
    model, reg = _nudging_model(w, 0.5)
    await model.create_chat_completion(_request())
    [e async for e in await model.create_chat_completion(_request(stream=True))]
    assert [c[0] for c in w.calls] == ["prefill", "decode", "prefill", "decode"]
    assert _metric(reg, "pdserve_prefill_nudges_total") == 0
    with pytest.raises(ValueError, match="prefill_nudge_after_s"):
        _nudging_model(w, 0)


class _FixedTokens:
    """A tokenizer stand-in: every prompt has `n` tokens."""

    def __init__(self, n: int):
        self.n = n

    def token_ids(self, path: str, body: dict) -> list[int]:
        return list(range(self.n))


@pytest.mark.parametrize("num_tokens,enabled,expected", [(500, True, 1_000_000), (3000, True, 1_002_000),
                                                         (70000, True, 1_007_000), (3000, False, None)])
async def test_prefill_request_carries_the_runtimes_vllm_priority(num_tokens, enabled, expected):
    # wall clock at 1000 s: priority = 1000 x (1000 s + prompt-length bucket x 1 s) (runtime/router/priority.py)
    workers = FakeWorkers()
    model, _ = _model(workers)
    model.tokenizer, model.prefill_priority, model.wall_clock = _FixedTokens(num_tokens), enabled, lambda: 1000.0
    out = await model.create_chat_completion(_request(priority=-5))
    assert not isinstance(out, ErrorResponse)
    (prefill,) = [b for host, b, _ in workers.calls if host == "prefill"]
    (decode,) = [b for host, b, _ in workers.calls if host == "decode"]
    assert prefill.get("priority") == (expected if enabled else -5)  # never the client's when enabled
    assert decode.get("priority") == -5  # the decode request is the client's


async def test_without_a_tokenizer_the_priority_comes_from_the_estimated_length():
    # no tokenizer (fixed pairing, or a prompt the router cannot tokenize): 12,000 characters ~ 3,000 tokens
    workers = FakeWorkers()
    model, _ = _model(workers)
    model.prefill_priority, model.wall_clock = True, lambda: 1000.0
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x" * 12000}], max_tokens=7,
                                priority=-(2**62))
    assert not isinstance(await model.create_chat_completion(req), ErrorResponse)
    (prefill,) = [b for host, b, _ in workers.calls if host == "prefill"]
    assert prefill["priority"] == 1_002_000


async def test_text_hidden_in_other_fields_still_counts_for_the_priority():
    # 480k characters in a tool description (rendered into the prompt by chat templates) must not look short
    workers = FakeWorkers()
    model, _ = _model(workers)
    model.prefill_priority, model.wall_clock = True, lambda: 1000.0
    model.tokenizer = _FixedTokens(5)  # a tokenizer that counted only the message text
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 480_000, "parameters": {}}}]
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=7, tools=tools)
    assert not isinstance(await model.create_chat_completion(req), ErrorResponse)
    (prefill,) = [b for host, b, _ in workers.calls if host == "prefill"]
    assert prefill["priority"] == 1_007_000  # ~120k tokens: bucket 7, as the same text in a message


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_prefill_whose_decode_worker_left_the_pool_is_served_by_another(stream):
    """Discovery (or a scale-down) removes the request's decode worker while its prefill runs, and the prefill
    fails: the request is prefilled and answered on the other decode worker, not a plain-text 500."""
    from runtime.config import RouterSpec
    from runtime.server.routing import RouterPairing, WorkerEndpoint

    pairing = RouterPairing(RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0), 16, [
        WorkerEndpoint("p", "prefill", "http://prefill"), WorkerEndpoint("d0", "decode", "http://decode"),
        WorkerEndpoint("d1", "decode", "http://decode1")])
    w = FakeWorkers(prefill_status=500)
    served: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "prefill":
            for wid in [i for i, e in pairing.workers.items() if e.role == "decode"][:1]:
                pairing.remove_worker(wid)  # the first decode worker, the round robin's choice, leaves
        else:
            served.append(req.url.host)
        return w.handler(req)

    transport = httpx.MockTransport(handler)
    reg = CollectorRegistry()
    model = PDModel("m", pairing, metrics=RuntimeMetrics(reg),
                    client_factory=lambda url: VllmClient(url, transport=transport))
    out = await model.create_chat_completion(_request(stream=stream))
    if stream:
        events = [e async for e in out]
        assert events[-1] == "data: [DONE]\n\n" and not any('"error"' in e for e in events)
    else:
        assert isinstance(out, ChatCompletion) and out.choices[0].message.content == "Paris"
    assert served == ["decode1"]
    assert all((x.num_requests, x.engine_requests) == (0, 0) for x in pairing.router.workers.values())


async def test_requests_refused_while_not_ready_and_clients_gone_during_tokenization_are_demand():
    import asyncio

    from runtime.server.planner_loop import RequestWindow

    window = RequestWindow()
    transport = httpx.MockTransport(FakeWorkers().handler)
    model = PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]),
                    metrics=RuntimeMetrics(CollectorRegistry()), observer=window,
                    client_factory=lambda url: VllmClient(url, transport=transport))
    # the edge answers 503 while nothing serves: each request it splits into is an arrival
    model.count_unready(json.dumps({"model": "m", "prompt": ["a", "b"], "n": 2}).encode(), "/openai/v1/completions")
    model.count_unready(json.dumps({"model": "m", "messages": []}).encode(), "/openai/v1/chat/completions")
    model.count_unready(b"not json", "/openai/v1/embeddings")  # not a generation route: not the planner's
    stats = window.drain()
    assert stats.num_requests == 5 and len(stats.prompt_arrivals) == 5

    import threading

    entered, go, left = threading.Event(), threading.Event(), threading.Event()

    class SlowTokenizer:  # a long chat template: it ends when the test says, after the client has left
        def token_ids(self, path, body):
            entered.set()
            go.wait(10.0)
            left.set()
            return [1, 2, 3]

    model.tokenizer = SlowTokenizer()
    task = asyncio.create_task(model.create_chat_completion(_request()))
    while not entered.is_set():
        await asyncio.sleep(0.01)
    task.cancel()  # the client left while its prompt was tokenized
    with pytest.raises(asyncio.CancelledError):
        await task
    assert window.drain().num_requests == 1
    go.set()
    assert await asyncio.to_thread(left.wait, 10.0)  # the tokenizer's thread ends


@pytest.mark.parametrize("body", [
    {"model": "m", "max_tokens": 7,
     "messages": [{"role": "user", "content": "h\u00e9llo \u4e16\u754c \n \" \\ \u0001"}]},
    {"model": "m", "prompt": ["a" * 1000, "b"], "seed": 2**70, "stop": None},  # beyond orjson's 64 bits
    {"model": "m", "prompt": "lone \ud800 surrogate"},  # orjson cannot write it
    {"model": "m", "prompt": [1, 2, 3], "temperature": 0.5, "logit_bias": {"50256": -100}},
])
def test_json_chars_counts_what_pythons_json_writes(body):
    from runtime.server.model import _json_chars

    assert _json_chars(body) == len(json.dumps(body, ensure_ascii=False, separators=(",", ":")))


@pytest.mark.parametrize("stream", [False, True])
async def test_the_routes_accounting_waits_until_the_decode_leg_is_sent(stream):
    """The route's counters, the router's release of the prefill load and the first token's record run once
    the decode leg's request is written, off the path to the first token; by the request's end they have."""
    seen = []

    class Recording(FakeWorkers):
        def handler(self, req: httpx.Request) -> httpx.Response:
            if req.url.host == "decode":
                seen.append((sum(s.value for m in reg.collect() if m.name == "pdserve_routes" for s in m.samples
                                 if s.name == "pdserve_routes_total"), len(model._awaiting)))
            return super().handler(req)

    w = Recording()
    model, reg = _model(w)
    out = await model.create_chat_completion(_request(stream=stream))
    if stream:
        assert '"ris"' in "".join([c async for c in out])
    assert seen == [(0.0, 1)]  # not counted yet, still waiting for its first token
    assert sum(s.value for m in reg.collect() if m.name == "pdserve_routes" for s in m.samples
               if s.name == "pdserve_routes_total") == 1.0
    assert model._awaiting == {} and model._deferred == {}


def test_a_migration_runs_the_first_routes_accounting_before_the_router_moves_the_request():
    """A decode leg that fails before the event loop turns (its deferred accounting not run yet) must not
    have that accounting run after the router moved it: it would release the new route's prefill load."""
    from runtime.engines.client import BackendError

    model, _ = _model(FakeWorkers())
    order = []
    model._deferred["r1"] = lambda: order.append("accounting")
    model.pairing.on_decode_failed = lambda rid, now: order.append("moved") or None
    from runtime.server.pairing import Route

    assert model._migrate(BackendError("http://decode", 502, "gone", unreachable=True),
                          Route("http://prefill", "http://decode", "test", "prefill-0", "decode-0"), "r1") is None
    assert order == ["accounting", "moved"] and "r1" not in model._deferred


async def test_a_request_queued_for_its_tokenizer_is_already_an_arrival_and_gets_its_token_count():
    import threading

    from runtime.server.planner_loop import RequestWindow

    w = FakeWorkers()
    transport = httpx.MockTransport(w.handler)
    go, entered = threading.Event(), threading.Event()

    class SlowTokenizer:  # a long chat template: tokenized off the event loop, seconds later
        def token_ids(self, path, body):
            entered.set()
            go.wait(5.0)
            return list(range(123))

    window = RequestWindow()
    model = PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]), metrics=RuntimeMetrics(CollectorRegistry()),
                    client_factory=lambda url: VllmClient(url, transport=transport), observer=window,
                    tokenizer=SlowTokenizer())
    task = asyncio.create_task(model.create_chat_completion(_request()))
    while not entered.is_set():
        await asyncio.sleep(0.01)
    assert window.drain().num_requests == 1  # counted as it came in, not once tokenized
    go.set()
    await task
    assert window.drain().num_requests == 0
    # within one window, the tokenizer's count replaces the body's estimate
    go.set()
    await model.create_chat_completion(_request())
    stats = window.drain()
    assert stats.num_requests == 1 and stats.mean_isl_tokens == 123


async def test_a_remote_prefill_whose_answer_never_reaches_its_client_gives_the_window_no_first_token():
    """A non-streamed answer's first token is its remote prefill's, once the client has the answer: a decode leg
    that fails leaves the planner's window without a TTFT sample (the client saw no token), though the request
    arrived."""
    from runtime.server.planner_loop import RequestWindow

    window = RequestWindow()
    w = FakeWorkers(decode_status=400)
    transport = httpx.MockTransport(w.handler)
    model = _windowed_model(transport, window)
    assert isinstance(await model.create_chat_completion(_request()), ErrorResponse)
    assert [c[0] for c in w.calls] == ["prefill", "decode"]  # the prefill answered; the decode leg failed
    stats = window.drain()
    assert stats.num_requests == 1 and (stats.ttft_p90_s, stats.ttft_mean_s) == (None, None)
    w.decode_status = 200
    await model.create_chat_completion(_request())
    assert window.drain().ttft_mean_s is not None  # answered: its prefill's first token
