"""KvEventSubscriber.stop(): it closes everything, and never swallows the cancellation of its caller."""

import asyncio

import pytest

pytest.importorskip("zmq")

from runtime.engines.kv_events import KvEventSubscriber  # noqa: E402


def test_stop_closes_every_subscription():
    async def run():
        sub = KvEventSubscriber({"w0": "tcp://127.0.0.1:9", "w1": "tcp://127.0.0.1:10"}, lambda w, b: None)
        sub.start()  # ZMQ connects lazily: no publisher needed
        await asyncio.sleep(0)
        await sub.stop()
        return sub

    sub = asyncio.run(run())
    assert sub.active_workers == () and sub.stats.num_closed == 2


def test_cancelling_the_task_in_stop_cancels_it_after_closing():
    async def run():
        sub = KvEventSubscriber({"w": "tcp://127.0.0.1:9"}, lambda w, b: None)
        sub.start()
        await asyncio.sleep(0.01)
        outer = asyncio.ensure_future(sub.stop())
        await asyncio.sleep(0)  # outer now waits for the cancelled reader inside stop()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        return sub

    sub = asyncio.run(run())
    assert sub.active_workers == () and sub.stats.num_closed == 1
