"""Worker clients and forwarded fields of the runtime model (runtime.server.model.PDModel), workers faked at
the HTTP transport.

Specification:
* `vllm_xargs` keys the runtime owns never reach a worker from a client: the transfer params and
  `kv_cache_report_mode` (vLLM 0.28 vllm/v1/request.py; "full" re-sends BlockStored for every prefix-cache
  hit); other xargs pass through unchanged;
* the client of a worker that left the pool is closed and forgotten (discovery churn leaks nothing), but
  not while a request still uses it: it is closed when that request ends.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("kserve")

from kserve.protocol.rest.openai.types import ChatCompletion, ChatCompletionRequest  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from runtime.config import RouterSpec  # noqa: E402
from runtime.deploy.discovery import PoolMembership  # noqa: E402
from runtime.engines.client import VllmClient  # noqa: E402
from runtime.server.app import build_router_pairing  # noqa: E402
from runtime.server.discovery_sync import apply_membership  # noqa: E402
from runtime.server.metrics import RuntimeMetrics  # noqa: E402
from runtime.server.model import PDModel  # noqa: E402
from tests.unit.test_server_model import _completion  # noqa: E402  (the same fake worker answer)


class _Req:
    """A validated request stand-in: `_request_body` falls back to `model_dump` without a raw request."""

    stream = False

    def __init__(self, body: dict) -> None:
        self._body = body

    def model_dump(self, **_) -> dict:
        return dict(self._body)


class _Recorder:
    """`client_factory` whose clients record their closing."""

    def __init__(self, handler) -> None:
        self.transport = httpx.MockTransport(handler)
        self.made: list[str] = []
        self.closed: list[str] = []

    def __call__(self, url: str) -> VllmClient:
        rec = self

        class Client(VllmClient):
            async def aclose(self) -> None:
                rec.closed.append(url)
                await super().aclose()

        self.made.append(url)
        return Client(url, transport=self.transport)


def _pool_model(handler) -> tuple[PDModel, object, _Recorder]:
    pairing = build_router_pairing(RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0),
                                   block_size_tokens=16, prefill_urls=[], decode_urls=[])
    rec = _Recorder(handler)
    model = PDModel("m", pairing, metrics=RuntimeMetrics(CollectorRegistry()), client_factory=rec)
    return model, pairing, rec


async def _settle() -> None:
    for _ in range(5):  # closing runs in its own task
        await asyncio.sleep(0)


async def test_runtime_owned_xargs_are_dropped_and_the_others_kept():
    pairing = build_router_pairing(RouterSpec(policy="round_robin"), block_size_tokens=16, prefill_urls=[],
                                   decode_urls=["http://d"])
    model = PDModel("m", pairing, metrics=RuntimeMetrics(CollectorRegistry()))
    xargs = {"kv_cache_report_mode": "full", "kv_transfer_params": {"remote_host": "evil"},
             "ec_transfer_params": {}, "ngram_size": 30}
    body = await model._request_body(_Req({"model": "x", "prompt": "hi", "vllm_xargs": xargs}), None)
    assert body["vllm_xargs"] == {"ngram_size": 30}


async def test_clients_of_workers_that_left_the_pool_are_closed():
    model, pairing, rec = _pool_model(lambda req: httpx.Response(200))
    for i in range(1, 21):  # pod churn: every rollout brings new addresses
        url = f"http://10.0.1.{i}:8000"
        apply_membership(pairing, PoolMembership((), (url,)))
        assert await model.worker_healthy(url)
    await _settle()
    assert list(model._clients) == ["http://10.0.1.20:8000"]
    assert sorted(rec.closed) == sorted(rec.made[:-1])  # every departed worker's pool was closed
    await model.aclose()
    assert sorted(rec.closed) == sorted(rec.made)


async def test_a_departed_workers_client_stays_open_until_its_request_ends():
    started, release = asyncio.Event(), asyncio.Event()

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path.endswith("/health"):
            return httpx.Response(200)
        started.set()
        await release.wait()  # a long decode
        return httpx.Response(200, json=_completion("Paris"))

    model, pairing, rec = _pool_model(handler)
    old, new = "http://10.0.1.1:8000", "http://10.0.1.2:8000"
    apply_membership(pairing, PoolMembership((), (old,)))
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "capital?"}], max_tokens=3)
    task = asyncio.ensure_future(model.create_chat_completion(request))
    await asyncio.wait_for(started.wait(), 5)
    apply_membership(pairing, PoolMembership((), (new,)))  # the old worker leaves while serving
    assert await model.worker_healthy(new)  # a new client: the sweep must skip the busy one
    await _settle()
    assert old not in rec.closed and old in model._clients
    release.set()
    answer = await asyncio.wait_for(task, 5)
    assert isinstance(answer, ChatCompletion)
    await _settle()
    assert rec.closed == [old] and list(model._clients) == [new]
    await model.aclose()


async def test_a_static_pool_keeps_its_clients():
    model, pairing, rec = _pool_model(lambda req: httpx.Response(200))
    apply_membership(pairing, PoolMembership(("http://p:1",), ("http://d:1",)))
    for _ in range(3):
        assert await model.worker_healthy("http://p:1") and await model.worker_healthy("http://d:1")
    await _settle()
    assert rec.made == ["http://p:1", "http://d:1"] and rec.closed == []
    await model.aclose()
