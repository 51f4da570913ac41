"""A planner scale-down during streaming loses no request and no token (drain-safe scale-down).

Real processes on 127.0.0.1: the fast engine stand-in (bench/engine_standin.py: streams "t0 t1 ..." at a set
pace and speaks vLLM's P/D kv_transfer_params protocol) as every worker; the runtime's PDModel with the
KV-aware router (round-robin policy, every request prefilled remotely) and the local planner's actuator
managing one extra prefill and one extra decode worker beyond the configured pair.

Specification: with streams in flight on the extra workers, a decision back to the configured pair drains
them: they take no new request, stay alive while the router holds a request on them (the extra decode
worker's streams, the extra prefill worker's handoffs), and are stopped once those finish; every stream ends
with [DONE] and exactly the tokens a direct request gets.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from runtime.config import DeploymentSpec, ModelRef, OverloadSpec, PlannerSpec, RouterSpec
from runtime.engines.vllm_worker import free_port
from runtime.planner.types import ScalingDecision
from runtime.server.app import build_model, build_router_pairing
from runtime.server.planner_loop import RequestWindow
from tests.model_streams import stream_content
from runtime.server.planner_runtime import build_planner

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

from kserve.protocol.rest.openai.types import ChatCompletionRequest  # noqa: E402

STANDIN = Path(__file__).resolve().parents[2] / "bench" / "engine_standin.py"
TOKEN_INTERVAL_MS = 20
NUM_TOKENS = 60  # 1.2 s per stream at 20 ms a token: the scale-down lands mid-stream


class StandinWorker:
    """One engine stand-in process (the LocalActuator's worker interface), stopped by its own handle."""

    def __init__(self, role: str, index: int) -> None:
        self.role, self.index = role, index
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "StandinWorker":
        self.proc = subprocess.Popen([sys.executable, str(STANDIN), "--port", str(self.port), "--token-interval-ms",
                                      str(TOKEN_INTERVAL_MS), "--engine-id", f"{self.role}-{self.index}",
                                      "--model", "m"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 600.0, poll_interval_s: float = 1.0) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise RuntimeError(f"stand-in {self.base_url} exited")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"stand-in {self.base_url} not ready")
            time.sleep(min(poll_interval_s, 0.1) or 0.05)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def stats(self) -> dict:
        return httpx.get(f"{self.base_url}/stats", timeout=2.0).json()


async def _healthy(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=1.0) as c:
            return (await c.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def _stream_text(model, i: int) -> tuple[str, bool]:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": f"request {i} " * 4}],
                                max_tokens=NUM_TOKENS, temperature=0, stream=True)
    return await stream_content(await model.create_chat_completion(req))


def test_a_scale_down_during_streaming_loses_no_request_and_no_token():
    base = [StandinWorker("prefill", 90), StandinWorker("decode", 91)]
    made: list[StandinWorker] = []

    def factory(role, index):
        made.append(StandinWorker(role, index))
        return made[-1]

    for w in base:
        w.start()
    pairing = build_router_pairing(RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0),
                                   block_size_tokens=16, prefill_urls=[base[0].base_url],
                                   decode_urls=[base[1].base_url])
    model = build_model("m", prefill_urls=[base[0].base_url], decode_urls=[base[1].base_url], pairing=pairing,
                        registry=CollectorRegistry(), overload=OverloadSpec())
    spec = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(mode="load", drain_cap_s=60.0))
    rt = build_planner("local", spec=spec, model_config=None, pairing=pairing, window=RequestWindow(),
                       registry=CollectorRegistry(), is_healthy=_healthy, breakers=model.breakers, max_workers=2,
                       worker_factory=factory)
    act = rt.loop.actuator
    expected = "".join(f"t{i} " for i in range(NUM_TOKENS))

    async def scenario() -> None:
        for w in base:
            await asyncio.to_thread(w.wait_ready, 30.0)
        act.apply(ScalingDecision(now_s=0.0, prefill_replicas=2, decode_replicas=2))
        for _ in range(300):
            await rt.sync_pool()
            if len(pairing.workers) == 4:
                break
            await asyncio.sleep(0.1)
        assert len(pairing.workers) == 4
        await model.breakers.check_round(model.worker_healthy)
        streams = [asyncio.create_task(_stream_text(model, i)) for i in range(8)]
        await asyncio.sleep(0.4)  # mid-stream
        extra_urls = {w.base_url for w in made}
        assert all(pairing.load_of(u) is not None and pairing.load_of(u).num_requests > 0 for u in extra_urls)
        act.apply(ScalingDecision(now_s=1.0, prefill_replicas=1, decode_replicas=1))
        await rt.sync_pool()
        assert all(model.breakers.draining(u) for u in extra_urls)
        assert all(w.alive() for w in made)  # still serving their streams and handoffs
        late = await _stream_text(model, 99)  # admitted during the drain: served by the configured pair only
        assert late == (expected, True)
        while not all(s.done() for s in streams):
            await rt.sync_pool()
            await asyncio.sleep(0.05)
        results = [s.result() for s in streams]
        assert results == [(expected, True)] * len(streams)  # no request lost, no token lost or repeated
        for _ in range(50):
            await rt.sync_pool()
            if not any(w.alive() for w in made):
                break
            await asyncio.sleep(0.1)
        assert not any(w.alive() for w in made)  # drained, then stopped
        assert {w.url for w in pairing.workers.values()} == {w.base_url for w in base}
        assert act.inner.draining() == []

    try:
        asyncio.run(scenario())
        # the stopped extra decode worker served streams, the stopped extra prefill worker handoffs: both were
        # drained with work in flight; the configured pair served the rest and the late request
        assert base[1].stats()["remote_decodes"] >= 1 and base[0].stats()["prefills"] >= 1
    finally:
        rt.close()
        for w in base:
            w.stop()
    assert not any(w.alive() for w in made)
