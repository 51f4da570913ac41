"""KV-event subscription (runtime.engines.kv_events) against a real ZMQ PUB socket on 127.0.0.1.

Specification: every published batch reaches the callback decoded, tagged with its worker id, in order;
a gap in sequence numbers is counted as missed batches; an undecodable frame is counted and skipped without
ending the subscription; `stop` ends the readers.
"""

from __future__ import annotations

import asyncio

import pytest

from runtime.engines.kv_events import KvEventSubscriber
from runtime.kv.events import BlockRemoved, BlockStored, KvEventBatch, encode_payload
from tests.integration.zmq_publisher import bound_publisher, wait_for

pytestmark = pytest.mark.integration
zmq = pytest.importorskip("zmq")


def _batch(i: int) -> KvEventBatch:
    return KvEventBatch(ts_s=float(i), events=(BlockStored((i,), None, tuple(range(16)), 16), BlockRemoved((i,))))


async def test_batches_arrive_in_order_and_gaps_and_garbage_are_counted():
    pub, endpoint, close_pub = bound_publisher()
    got: list[tuple[str, KvEventBatch]] = []
    sub = KvEventSubscriber({"decode-0": endpoint}, lambda w, b: got.append((w, b)))
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
        await wait_for(lambda: len(got) >= n_before + 4)
        tail = got[n_before:]
        assert [w for w, _ in tail] == ["decode-0"] * 4
        assert [b.ts_s for _, b in tail] == [start, start + 1, start + 3, start + 4]
        assert isinstance(tail[0][1].events[0], BlockStored) and isinstance(tail[0][1].events[1], BlockRemoved)
        assert sub.stats.num_missed_batches["decode-0"] >= 1
        assert sub.stats.num_decode_errors["decode-0"] == 1
    finally:
        await sub.stop()
        close_pub()
    assert sub.active_workers == ()


async def test_callback_errors_do_not_end_the_subscription():
    pub, endpoint, close_pub = bound_publisher()
    seen: list[float] = []

    def on_batch(worker_id, batch):
        seen.append(batch.ts_s)
        raise RuntimeError("boom")

    sub = KvEventSubscriber({"w": endpoint}, on_batch)
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
        close_pub()
