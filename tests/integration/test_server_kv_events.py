"""KV-event subscription (runtime.engines.kv_events) against a real ZMQ PUB socket on 127.0.0.1.

Specification: every published batch reaches the callback decoded, tagged with its worker id, in order;
a gap in sequence numbers is counted as missed batches; an undecodable frame is counted and skipped without
ending the subscription; `stop` ends the readers.
"""

from __future__ import annotations

import asyncio

import pytest

from runtime.engines.kv_events import KvEventSubscriber
from runtime.engines.vllm_worker import free_port
from runtime.kv.events import BlockRemoved, BlockStored, KvEventBatch, encode_payload

pytestmark = pytest.mark.integration
zmq = pytest.importorskip("zmq")


def _batch(i: int) -> KvEventBatch:
    return KvEventBatch(ts_s=float(i), events=(BlockStored((i,), None, tuple(range(16)), 16), BlockRemoved((i,))))


async def _wait_for(pred, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not pred():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.02)


async def test_batches_arrive_in_order_and_gaps_and_garbage_are_counted():
    import zmq.asyncio

    port = free_port()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    got: list[tuple[str, KvEventBatch]] = []
    sub = KvEventSubscriber({"decode-0": f"tcp://127.0.0.1:{port}"}, lambda w, b: got.append((w, b)))
    sub.start()
    try:
        # PUB/SUB joins asynchronously: publish a probe until the subscriber sees one (slow-joiner).
        seq = 0
        while not got:
            await pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), encode_payload(_batch(seq))])
            seq += 1
            await asyncio.sleep(0.05)
        n_before = len(got)
        start = seq
        for i in (start, start + 1, start + 3):  # start+2 never sent
            await pub.send_multipart([b"kv-events", i.to_bytes(8, "big"), encode_payload(_batch(i))])
        await pub.send_multipart([b"kv-events", b"short", b"junk"])
        await pub.send_multipart([b"kv-events", (start + 4).to_bytes(8, "big"), encode_payload(_batch(start + 4))])
        await _wait_for(lambda: len(got) >= n_before + 4)
        tail = got[n_before:]
        assert [w for w, _ in tail] == ["decode-0"] * 4
        assert [b.ts_s for _, b in tail] == [start, start + 1, start + 3, start + 4]
        assert isinstance(tail[0][1].events[0], BlockStored) and isinstance(tail[0][1].events[1], BlockRemoved)
        assert sub.stats.num_missed_batches["decode-0"] >= 1
        assert sub.stats.num_decode_errors["decode-0"] == 1
    finally:
        await sub.stop()
        pub.close(0)
        ctx.term()
    assert sub.active_workers == ()


async def test_callback_errors_do_not_end_the_subscription():
    import zmq.asyncio

    port = free_port()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    seen: list[float] = []

    def on_batch(worker_id, batch):
        seen.append(batch.ts_s)
        raise RuntimeError("boom")

    sub = KvEventSubscriber({"w": f"tcp://127.0.0.1:{port}"}, on_batch)
    sub.start()
    try:
        i = 0
        while len(seen) < 3:
            await pub.send_multipart([b"kv-events", i.to_bytes(8, "big"), encode_payload(_batch(i))])
            i += 1
            await asyncio.sleep(0.05)
            assert i < 200
        assert seen == sorted(seen)
    finally:
        await sub.stop()
        pub.close(0)
        ctx.term()
