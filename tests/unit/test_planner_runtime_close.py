"""PlannerRuntime.close against a tick in progress: a tick runs in a worker thread that cancelling its task
does not stop, so close() waits for it, and no tick runs after close (else a late tick would start local
workers nobody stops)."""

from __future__ import annotations

import asyncio
import threading

from runtime.planner.types import ScalingDecision
from runtime.server.planner_runtime import PlannerRuntime


class _Closable:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class _BlockingLoop:
    interval_s = 0.01

    def __init__(self) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        self.ticks = 0
        self.actuator, self.client = _Closable(), _Closable()

    def clock(self) -> float:
        return 0.0

    def tick(self, now_s: float) -> ScalingDecision:
        self.ticks += 1
        self.entered.set()
        assert self.gate.wait(10)
        assert self.actuator.closed == 0, "the actuator was closed under a running tick"
        return ScalingDecision(now_s=now_s, prefill_replicas=1, decode_replicas=1)


async def test_close_waits_for_the_running_tick_and_no_tick_runs_after_it():
    loop = _BlockingLoop()
    rt = PlannerRuntime(loop)  # type: ignore[arg-type]
    task = asyncio.create_task(rt.tick())
    assert await asyncio.to_thread(loop.entered.wait, 10)
    task.cancel()  # the runtime shutting down: the thread keeps running
    closer = threading.Thread(target=rt.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and loop.actuator.closed == 0  # close waits for the tick
    loop.gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert (loop.actuator.closed, loop.client.closed) == (1, 1)
    assert await rt.tick() is None and loop.ticks == 1  # closed: no more ticks
    rt.close()  # idempotent
    assert (loop.actuator.closed, loop.client.closed) == (1, 1)
