"""The runtime's worker rotation (runtime.server.breakers) and overload answers of PDModel.

Specification: a worker leaves the rotation only through its breaker (k failed checks or 5xx in a row, a
refused connection at once, or checks far slower than its peers') and comes back through half-open probes
after the cool-down; one failed or slow check does not take it out; a starting worker's failed checks do not
count; the breaker state is exported per worker; every decode worker open is a 503 counted as shed; a
request whose predicted TTFT breaks the admission bound is a 429 with Retry-After and an OpenAI error body,
priority traffic last.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("kserve")

from fastapi import FastAPI  # noqa: E402
from kserve.errors import ModelNotReady  # noqa: E402
from kserve.protocol.rest.openai.types import ChatCompletionRequest  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from runtime.config import OverloadSpec, RouterSpec  # noqa: E402
from runtime.engines.client import BackendError, VllmClient  # noqa: E402
from runtime.router.breaker import BreakerState  # noqa: E402
from runtime.server.breakers import WorkerBreakers  # noqa: E402
from runtime.server.errors import Overloaded, install_openai_error_handlers  # noqa: E402
from runtime.server.metrics import RuntimeMetrics  # noqa: E402
from runtime.server.model import PDModel  # noqa: E402
from runtime.server.pairing import RoundRobinPairing  # noqa: E402
from runtime.server.routing import RouterPairing, WorkerEndpoint  # noqa: E402
from tests.unit.test_server_model import KV, _completion  # noqa: E402

SPEC = OverloadSpec(breaker_failures=3, breaker_cooldown_s=10, breaker_probes=2)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _router_pairing(n: int = 2) -> RouterPairing:
    workers = [WorkerEndpoint(f"w{i}", "both", f"http://127.0.0.1:{9000 + i}") for i in range(n)]
    return RouterPairing(RouterSpec(policy="round_robin"), 16, workers)


def _routable(p: RouterPairing) -> set[str]:
    return {w for w, load in p.router.workers.items() if load.available}


def _gauge(registry: CollectorRegistry, worker: str) -> float | None:
    return registry.get_sample_value("pdserve_worker_breaker_state", {"role": "both", "worker": worker})


async def test_a_dead_worker_opens_after_k_checks_and_closes_through_half_open_probes():
    p, clock, reg = _router_pairing(), Clock(), CollectorRegistry()
    metrics = RuntimeMetrics(reg)
    b = WorkerBreakers(p, SPEC, gauge=metrics.breaker_state, clock=clock)
    health = {"http://127.0.0.1:9000": True, "http://127.0.0.1:9001": True}
    checked: list[str] = []

    async def check(url: str) -> bool:
        checked.append(url)
        return health[url]

    await b.check_round(check)
    health["http://127.0.0.1:9001"] = False
    for _ in range(SPEC.breaker_failures - 1):
        await b.check_round(check)
        assert _routable(p) == {"w0", "w1"}  # fewer than k failed checks keep it
    await b.check_round(check)
    assert _routable(p) == {"w0"} and _gauge(reg, "w1") == 2 and _gauge(reg, "w0") == 0
    checked.clear()
    clock.now += SPEC.breaker_cooldown_s - 0.1
    await b.check_round(check)
    assert checked == ["http://127.0.0.1:9000"]  # open: no check during the cool-down
    clock.now += 0.1
    health["http://127.0.0.1:9001"] = True
    b.sync()
    assert _gauge(reg, "w1") == 1 and _routable(p) == {"w0"}  # half-open: probes only
    await b.check_round(check)
    assert _routable(p) == {"w0"}  # one good probe of two
    await b.check_round(check)
    assert _routable(p) == {"w0", "w1"} and _gauge(reg, "w1") == 0


async def test_one_failed_or_slow_check_does_not_take_a_worker_out():
    p, clock = _router_pairing(), Clock()
    b = WorkerBreakers(p, SPEC, clock=clock)
    answers = iter([True, False, True, False, True])

    async def check(url: str) -> bool:
        return next(answers) if url.endswith("9001") else True

    for _ in range(5):
        await b.check_round(check)
    assert _routable(p) == {"w0", "w1"}


async def test_a_worker_far_slower_than_its_peers_is_taken_out():
    p, clock = _router_pairing(3), Clock()
    b = WorkerBreakers(p, OverloadSpec(breaker_failures=2, breaker_latency_floor_s=0.2, breaker_latency_factor=5),
                       clock=clock)

    async def check(url: str) -> bool:
        if url.endswith("9002"):
            # answers 0.6 s later by the breakers' clock, after its peers' checks (concurrent, answered at
            # once) have ended: a pause of this process lengthens no check
            await asyncio.sleep(0)
            clock.now += 0.6
        return True

    for _ in range(4):  # windows fill (3 checks), then two slow checks in a row
        await b.check_round(check)
    assert _routable(p) == {"w0", "w1"}
    assert b.state("http://127.0.0.1:9002") is BreakerState.OPEN


async def test_a_starting_worker_is_spared_out_of_the_rotation_and_a_worker_that_leaves_is_forgotten():
    p, clock, reg = _router_pairing(), Clock(), CollectorRegistry()
    b = WorkerBreakers(p, SPEC, gauge=RuntimeMetrics(reg).breaker_state, clock=clock)

    up = {"9000"}

    async def check(url: str) -> bool:
        return url[-4:] in up

    for _ in range(SPEC.breaker_failures + 1):
        await b.check_round(check)
    # w1 never answered: still starting, its breaker not opened, but the router does not choose it (least
    # loaded, it would take every request, each then choosing again)
    assert _routable(p) == {"w0"} and b.state("http://127.0.0.1:9001") is BreakerState.CLOSED
    assert not b.usable("http://127.0.0.1:9001") and b.usable("http://127.0.0.1:9000")
    assert b.in_rotation("decode") == 1  # admission divides the queue by the workers that serve
    assert _gauge(reg, "w1") == 0
    up.add("9001")  # loaded: its first answer puts it in the rotation
    await b.check_round(check)
    assert _routable(p) == {"w0", "w1"} and b.usable("http://127.0.0.1:9001")
    p.remove_worker("w1")
    b.sync()
    assert _gauge(reg, "w1") is None and _gauge(reg, "w0") == 0


def test_requests_look_the_pool_up_only_when_it_changed(monkeypatch):
    import runtime.server.breakers as breakers_mod

    p, clock, reg = _router_pairing(), Clock(), CollectorRegistry()
    b = WorkerBreakers(p, SPEC, gauge=RuntimeMetrics(reg).breaker_state, clock=clock)
    lookups = []
    real = breakers_mod.pool_workers
    monkeypatch.setattr(breakers_mod, "pool_workers", lambda pairing: lookups.append(1) or real(pairing))
    for _ in range(50):  # what requests do: report calls, count workers in rotation
        b.record_call("http://127.0.0.1:9000", None)
        b.in_rotation("decode")
    assert len(lookups) == 1  # the first one after construction (no sync yet), then none
    p.add_worker(WorkerEndpoint("w2", "both", "http://127.0.0.1:9002"))
    b.record_call("http://127.0.0.1:9002", BackendError("http://127.0.0.1:9002", 502, "refused", unreachable=True))  # the new worker, at once
    assert len(lookups) == 2 and b.state("http://127.0.0.1:9002") is BreakerState.OPEN
    assert _routable(p) == {"w0", "w1"} and _gauge(reg, "w2") == 2
    p.remove_worker("w2")
    assert b.in_rotation("decode") == 2 and _gauge(reg, "w2") is None and len(lookups) == 3


# ---- PDModel: refused decode workers, 503 and 429 -----------------------------------------------------
def _request(content: str = "capital?", **extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}], max_tokens=7,
                                 temperature=0, **extra)


def _model(handler, *, prefill: bool = False, **kw) -> tuple[PDModel, CollectorRegistry]:
    reg = CollectorRegistry()
    pairing = RoundRobinPairing(["http://prefill"] if prefill else [], ["http://d0", "http://d1"])
    transport = httpx.MockTransport(handler)
    model = PDModel("m", pairing, metrics=RuntimeMetrics(reg),
                    client_factory=lambda url: VllmClient(url, transport=transport), **kw)
    return model, reg


async def test_traffic_moves_off_a_refused_worker_and_every_worker_open_is_a_counted_503():
    dead: set[str] = set()
    served: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host in dead:
            raise httpx.ConnectError("refused", request=req)
        served.append(req.url.host)
        return httpx.Response(200, json=_completion("Paris"))

    model, reg = _model(handler)
    await model.breakers.check_round(model.worker_healthy)  # both answer: serving
    served.clear()
    dead.add("d1")  # d1 dies between two checks
    for _ in range(4):
        await model.create_chat_completion(_request())
    assert model.breakers.state("http://d1") is BreakerState.OPEN
    assert set(served) == {"d0"} and len(served) >= 3  # the one request that hit d1 migrated
    dead.add("d0")
    await model.create_chat_completion(_request())  # refused: d0 opens too
    assert not model.ready
    with pytest.raises(ModelNotReady, match="circuit breaker"):
        await model.create_chat_completion(_request())
    assert reg.get_sample_value("pdserve_requests_shed_total", {"reason": "breaker_open", "priority": "high"}) == 1


async def test_an_overloaded_queue_is_shed_with_retry_after_and_priority_traffic_last():
    release = asyncio.Event()

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/health":
            return httpx.Response(200)
        if req.url.host == "prefill":
            await release.wait()  # the prefill queue does not move
            return httpx.Response(200, json={**_completion("P"), "kv_transfer_params": KV})
        return httpx.Response(200, json=_completion("Paris"))

    clock = Clock()
    model, reg = _model(handler, prefill=True, clock=clock, slo_ttft_s=1.0,
                        overload=OverloadSpec(shed_ttft_factor=2.0, shed_priority_factor=2.0))
    model.service.observe(0.5, ahead=0, servers=1)  # learned: 0.5 s per request on one prefill worker
    # a long prompt (priority bucket 1) and a short one (bucket 0)
    long_prompt, short_prompt = "word " * 1200, "capital?"
    tasks = []
    for i in range(4):  # predicted for the next: (4 + 1) x 0.5 = 2.5 s > 2 s
        tasks.append(asyncio.create_task(model.create_chat_completion(_request(short_prompt))))
        await asyncio.sleep(0.01)
    assert len(model._awaiting) == 4
    with pytest.raises(Overloaded) as shed:
        await model.create_chat_completion(_request(long_prompt))
    assert shed.value.retry_after_s == 1 and "predicted time to first token is 2.5 s" in shed.value.message
    assert reg.get_sample_value("pdserve_requests_shed_total", {"reason": "queue_wait", "priority": "normal"}) == 1
    # priority traffic's bound is 2 x 2 s: admitted
    tasks.append(asyncio.create_task(model.create_chat_completion(_request(short_prompt))))
    await asyncio.sleep(0.01)
    assert len(model._awaiting) == 5
    release.set()
    await asyncio.gather(*tasks)
    assert model._awaiting == {}  # every admitted request left the queue at its first token
    assert reg.get_sample_value("pdserve_requests_shed_total", {"reason": "queue_wait", "priority": "high"}) == 0


async def test_no_admission_control_without_a_factor_or_an_slo():
    model, _ = _model(lambda req: httpx.Response(200, json=_completion("Paris")), slo_ttft_s=1.0)
    model.service.observe(100.0, ahead=0, servers=1)
    model._awaiting.update({f"r{i}": (0, 1) for i in range(50)})
    model._admit("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})  # no shed_ttft_factor: admitted


def test_a_shed_request_is_a_429_with_retry_after_and_an_openai_body():
    app = FastAPI()
    install_openai_error_handlers(app)

    @app.post("/openai/v1/chat/completions")
    async def chat():
        raise Overloaded("The service is overloaded: retry after 7 s.", 7)

    r = TestClient(app).post("/openai/v1/chat/completions", json={})
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    assert r.json() == {"error": {"message": "The service is overloaded: retry after 7 s.", "type": "OverloadedError",
                                  "param": None, "code": 429}}


async def test_readiness_needs_a_serving_decode_capable_worker():
    workers = [WorkerEndpoint("p0", "prefill", "http://127.0.0.1:9100"),
               WorkerEndpoint("d0", "decode", "http://127.0.0.1:9101/")]
    p, clock = RouterPairing(RouterSpec(policy="round_robin"), 16, workers), Clock()
    b = WorkerBreakers(p, SPEC, clock=clock)
    health = {"http://127.0.0.1:9100": True, "http://127.0.0.1:9101": False}

    async def check(url: str) -> bool:
        return health[url]

    assert not b.any_decode_serving()  # nothing checked yet
    await b.check_round(check)
    assert not b.any_decode_serving()  # the prefill worker serves, the decode worker is still starting
    health["http://127.0.0.1:9101"] = True
    await b.check_round(check)
    assert b.any_decode_serving()
    b.record_call("http://127.0.0.1:9101", BackendError("http://127.0.0.1:9101", 502, "refused", unreachable=True))
    assert not b.any_decode_serving()  # its breaker opened


async def test_the_breaker_gauge_follows_state_changes_between_calls():
    p, clock, reg = _router_pairing(1), Clock(), CollectorRegistry()
    b = WorkerBreakers(p, SPEC, gauge=RuntimeMetrics(reg).breaker_state, clock=clock)

    async def check(url: str) -> bool:
        return True

    await b.check_round(check)
    url = "http://127.0.0.1:9000"
    for _ in range(3):
        b.record_call(url, None)
    assert _gauge(reg, "w0") == 0
    b.record_call(url, BackendError(url, 502, "refused", unreachable=True))
    assert _gauge(reg, "w0") == 2
    clock.now += SPEC.breaker_cooldown_s
    await b.check_round(check)  # the cool-down passed: a probe, half-open then closed after enough of them
    assert _gauge(reg, "w0") in (0, 1)
    for _ in range(SPEC.breaker_probes):
        await b.check_round(check)
    b.record_call(url, None)
    assert _gauge(reg, "w0") == 0


def test_the_503_says_why_in_sentences_and_when_to_retry():
    from runtime.server.errors import RETRY_AFTER_S, _not_ready_message

    why = _not_ready_message(ModelNotReady("m", "every decode worker is out of rotation (circuit breaker open)"))
    assert why == ("Model with name m is not ready. Every decode worker is out of rotation (circuit breaker "
                   f"open). Retry in {RETRY_AFTER_S} s.")
    assert _not_ready_message(ModelNotReady("m")) == ("Model with name m is not ready. No inference worker is "
                                                      f"answering; retry in {RETRY_AFTER_S} s.")


async def test_a_breaker_that_opens_abandons_the_workers_silent_calls_and_again_each_round_it_stays_out():
    """`on_down` gets the worker and the bound as its breaker opens on failed health checks and on every check
    round while it is open or half-open with its last check failed, never while it is closed. The bound is the
    breaker's evidence window: `breaker_failures` rounds of a check interval plus a health check's timeout."""
    p, clock = _router_pairing(), Clock()
    downs: list[tuple[str, float]] = []
    b = WorkerBreakers(p, SPEC, clock=clock, on_down=lambda url, s: downs.append((url, s)), check_interval_s=2.0)
    assert b.silent_s == SPEC.breaker_failures * (2.0 + 2.0)
    w0, w1 = "http://127.0.0.1:9000", "http://127.0.0.1:9001"
    health = {w0: True, w1: True}

    async def check(url: str) -> bool:
        return health[url]

    await b.check_round(check)
    health[w1] = False
    for _ in range(SPEC.breaker_failures - 1):
        await b.check_round(check)
    assert downs == []  # closed: nothing is abandoned
    await b.check_round(check)
    assert downs == [(w1, b.silent_s)]  # opened
    await b.check_round(check)
    assert downs == [(w1, b.silent_s)] * 2  # open: calls that fell silent since
    clock.now += SPEC.breaker_cooldown_s
    health[w1] = True
    await b.check_round(check)  # half-open: its last check failed, then its probe answers
    await b.check_round(check)  # half-open, its /health answering: a live worker's calls are left alone
    assert len(downs) == 3 and b.state(w1) is BreakerState.CLOSED
    await b.check_round(check)
    assert len(downs) == 3


async def test_a_breaker_opened_while_the_workers_health_answers_abandons_nothing():
    # 5xx answers, slow checks or one cut stream open a breaker on a live worker: its queued calls (a prefill
    # waiting in the engine's queue, a decode leg before its first token) are silent but not lost
    p, clock = _router_pairing(), Clock()
    downs: list[tuple[str, float]] = []
    b = WorkerBreakers(p, SPEC, clock=clock, on_down=lambda url, s: downs.append((url, s)), check_interval_s=2.0)
    w0 = "http://127.0.0.1:9000"

    async def healthy(url: str) -> bool:
        return True

    await b.check_round(healthy)
    for _ in range(SPEC.breaker_failures):
        b.record_call(w0, BackendError(w0, 500, "engine error"))
    assert b.state(w0) is BreakerState.OPEN
    b.record_call(w0, BackendError(w0, 502, "stream ended without [DONE]", unreachable=True))
    await b.check_round(healthy)
    assert downs == []
    # its /health then fails (the half-open probe): now its silent calls go
    clock.now += SPEC.breaker_cooldown_s

    async def failing(url: str) -> bool:
        return False

    await b.check_round(failing)
    await b.check_round(failing)
    assert downs and downs[-1] == (w0, b.silent_s)


async def test_a_stalled_worker_counts_failed_checks_and_stays_suspect_until_a_stream_produces(caplog):
    """`stalled` judges each closed worker whose /health answered: True (its begun streams all silent for
    `breaker_stall_s`) is a failed check, so `breaker_failures` such rounds open the breaker, and its silent
    calls are abandoned after the stall window (the evidence), not the longer health window; None (no begun
    stream) and False (one producing) are not. A worker judged stalled is asked with `waiting` (its queue waits
    count) until a verdict of False."""
    import logging

    p, clock = _router_pairing(), Clock()
    spec = SPEC.model_copy(update={"breaker_stall_s": 3.0})
    downs: list[tuple[str, float]] = []
    asked: list[tuple[str, float, bool]] = []
    w0, w1 = "http://127.0.0.1:9000", "http://127.0.0.1:9001"
    verdict: dict[str, bool | None] = {w0: None, w1: None}

    def stalled(url: str, window_s: float, waiting: bool) -> bool | None:
        asked.append((url, window_s, waiting))
        return verdict[url]

    b = WorkerBreakers(p, spec, clock=clock, on_down=lambda url, s: downs.append((url, s)), check_interval_s=2.0,
                       stalled=stalled)

    async def healthy(url: str) -> bool:
        return True

    caplog.set_level(logging.WARNING, logger="runtime.server.breakers")
    for _ in range(SPEC.breaker_failures + 1):
        await b.check_round(healthy)  # nothing to judge by: never a failure
    verdict[w0] = False
    await b.check_round(healthy)
    assert b.state(w0) is BreakerState.CLOSED and b.state(w1) is BreakerState.CLOSED
    assert {(u, s) for u, s, _ in asked} == {(w0, 3.0), (w1, 3.0)} and not any(wait for _, _, wait in asked)
    verdict[w1] = True
    for _ in range(SPEC.breaker_failures - 1):
        await b.check_round(healthy)
    assert b.state(w1) is BreakerState.CLOSED and downs == []
    asked.clear()
    await b.check_round(healthy)
    assert b.state(w1) is BreakerState.OPEN and b.state(w0) is BreakerState.CLOSED
    assert downs == [(w1, 3.0)] and (w1, 3.0, True) in asked  # min(silent_s 12 s, stall window 3 s)
    assert sum("stalled" in r.getMessage() for r in caplog.records) == SPEC.breaker_failures + 1  # + "opened"
    # back through the half-open probes (/health answers them): still suspect, so its queue waits count
    clock.now += SPEC.breaker_cooldown_s
    verdict[w1] = None
    for _ in range(SPEC.breaker_probes):
        await b.check_round(healthy)
    assert b.state(w1) is BreakerState.CLOSED
    asked.clear()
    await b.check_round(healthy)
    assert (w1, 3.0, True) in asked
    verdict[w1] = False  # one of its streams produced: no longer suspect
    await b.check_round(healthy)
    asked.clear()
    verdict[w1] = None
    await b.check_round(healthy)
    assert (w1, 3.0, False) in asked and b.state(w1) is BreakerState.CLOSED


def test_the_stall_window_defaults_to_the_breakers_evidence_window():
    b = WorkerBreakers(_router_pairing(), OverloadSpec(), check_interval_s=2.0)
    assert OverloadSpec().breaker_stall_s == b.silent_s == b.stall_s == 12.0
    with pytest.raises(ValueError):
        OverloadSpec(breaker_stall_s=0)
