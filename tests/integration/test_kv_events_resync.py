"""KV-event subscriber resynchronisation against a real ZMQ PUB socket on 127.0.0.1 (vLLM's publisher side).

Specification: events are incremental, so a lost batch or a restarted worker would leave blocks in the
router's index that the worker no longer holds. A gap in the sequence numbers, or a sequence number that
goes back, clears that worker's index entry (and hash translations) before the batch is applied; it is
counted (`num_missed_batches` for gaps, `num_resyncs` for both). Malformed events inside a batch (also a
`medium` that is not a string) are counted per worker and resync it the same way (a left-out one may have been
a removal); the rest of the batch still reaches the router. A message that fails to decode in any way is
counted and dropped, and the reader goes on (the gap it leaves resyncs the worker).
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest

from runtime.config import RouterSpec
from runtime.engines.kv_events import KvEventSubscriber
from runtime.kv.events import BlockRemoved, BlockStored, KvEventBatch, encode_payload
from runtime.server.app import build_router_pairing
from tests.integration.zmq_publisher import bound_publisher, wait_for

pytestmark = pytest.mark.integration
zmq = pytest.importorskip("zmq")

BS = 16
A = tuple(range(1000, 1000 + 2 * BS))  # a 2-block prompt
B = tuple(range(5000, 5000 + 2 * BS))
WORKER = "decode-0"


async def _send(pub, seq: int, *events) -> None:
    await pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), encode_payload(KvEventBatch(float(seq), events))])


class _Rig:
    """A router pairing with one KV-event decode worker, subscribed to a real PUB socket."""

    def __init__(self) -> None:
        self.pub, endpoint, self._close_pub = bound_publisher()
        self.pairing = build_router_pairing(RouterSpec(policy="kv_aware"), block_size_tokens=BS, prefill_urls=[],
                                            decode_urls=["http://127.0.0.1:1"], decode_kv_events=[endpoint])
        self.got: list[KvEventBatch] = []
        self.sub = KvEventSubscriber(self.pairing.kv_event_endpoints(), self._on_batch)

    def _on_batch(self, worker_id: str, batch: KvEventBatch) -> None:
        self.got.append(batch)
        self.pairing.apply_batch(worker_id, batch)

    def overlap(self, tokens) -> dict[str, int]:
        r = self.pairing.router
        return r.overlaps(r.hashes_for(tokens))

    async def joined(self) -> int:
        """Publish empty probes (seq 0, 1, ...) until one arrives (ZMQ slow joiner); the next seq to use."""
        seq = 0
        while not self.got:
            await _send(self.pub, seq)
            seq += 1
            await asyncio.sleep(0.05)
            assert seq < 200, "the subscriber never joined"
        return seq

    async def sent(self, seq: int, *events) -> None:
        n = len(self.got)
        await _send(self.pub, seq, *events)
        await wait_for(lambda: len(self.got) > n, f"batch seq={seq}")

    async def sent_raw(self, seq: int, events: list[dict], what: str) -> None:
        """Publish events as raw msgpack maps (shapes no encoder of ours writes) and wait for the batch."""
        n = len(self.got)
        await self.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"),
                                       msgspec.msgpack.encode([float(seq), events])])
        await wait_for(lambda: len(self.got) > n, what)

    async def close(self) -> None:
        await self.sub.stop()
        self._close_pub()


@contextlib.asynccontextmanager
async def _started():
    """A rig whose subscriber has joined: (the rig, the next sequence number to publish); closed on exit."""
    rig = _Rig()
    rig.sub.start()
    try:
        yield rig, await rig.joined()
    finally:
        await rig.close()


async def test_a_missed_batch_clears_the_worker_so_no_phantom_block_survives():
    async with _started() as (rig, seq):
        await rig.sent(seq, BlockStored((11, 12), None, A, BS))
        assert rig.overlap(A) == {WORKER: 2}
        # seq+1 (BlockRemoved of 11, 12) is lost on the way; the worker recomputes A and evicts it again
        await rig.sent(seq + 2, BlockStored((11, 12), None, A, BS))
        await rig.sent(seq + 3, BlockRemoved((12,)), BlockRemoved((11,)))
        assert rig.overlap(A) == {}
        assert rig.sub.stats.num_missed_batches[WORKER] == 1
        assert rig.sub.stats.num_resyncs[WORKER] == 1


async def test_a_gap_drops_blocks_stored_before_it_until_they_are_reported_again():
    async with _started() as (rig, seq):
        await rig.sent(seq, BlockStored((11, 12), None, A, BS))
        await rig.sent(seq + 5, BlockStored((21, 22), None, B, BS))
        assert rig.overlap(A) == {}  # under-reported: the lost batches may have evicted it
        assert rig.overlap(B) == {WORKER: 2}
        assert rig.sub.stats.num_missed_batches[WORKER] == 4


async def test_a_restarted_worker_sequence_reset_drops_its_old_blocks():
    async with _started() as (rig, seq):
        await rig.sent(seq, BlockStored((11, 12), None, A, BS))
        assert rig.overlap(A) == {WORKER: 2}
        # vLLM restarts on the same endpoint: its publisher counts from 0 again, its cache is empty
        await rig.sent(0, BlockStored((77, 78), None, B, BS))
        assert rig.overlap(A) == {}
        assert rig.overlap(B) == {WORKER: 2}
        assert rig.sub.stats.num_resyncs[WORKER] == 1
        await rig.sent(1, BlockRemoved((78,)))  # in sequence again: no further resync
        assert rig.overlap(B) == {WORKER: 1} and rig.sub.stats.num_resyncs[WORKER] == 1


async def test_malformed_and_offloaded_events_are_counted_and_the_rest_applied():
    async with _started() as (rig, seq):
        good = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": list(A),
                "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}
        bad = {**good, "block_hashes": [1.5]}
        placeholder = {**good, "block_hashes": [99], "token_ids": [], "block_size": 0, "medium": "CPU"}
        await rig.sent_raw(seq, [bad, placeholder, good], "the mixed batch")
        assert rig.overlap(A) == {WORKER: 2}
        assert rig.sub.stats.num_invalid_events[WORKER] == 1 and rig.sub.stats.num_resyncs[WORKER] == 1


async def test_a_malformed_removal_resyncs_the_worker_so_the_evicted_block_is_not_credited():
    async with _started() as (rig, seq):
        await rig.sent(seq, BlockStored((11, 12), None, A, BS))
        assert rig.overlap(A) == {WORKER: 2}
        # the worker evicted block 11; its removal arrives with a hash of a type no engine sends
        await rig.sent_raw(seq + 1, [{"type": "BlockRemoved", "block_hashes": [11.0], "medium": "GPU"}],
                           "the batch with the malformed removal")
        assert rig.overlap(A) == {}  # under-reported until stored again, never a block the worker lacks
        assert rig.sub.stats.num_invalid_events[WORKER] == 1 and rig.sub.stats.num_resyncs[WORKER] == 1
        assert WORKER not in rig.sub.stats.num_missed_batches  # in sequence: resynced for the bad event alone
        await rig.sent(seq + 2, BlockStored((21, 22), None, B, BS))
        assert rig.overlap(B) == {WORKER: 2} and rig.sub.stats.num_resyncs[WORKER] == 1


async def test_an_event_with_an_unhashable_medium_does_not_end_the_reader():
    async with _started() as (rig, seq):
        await rig.sent(seq, BlockStored((11, 12), None, A, BS))
        await rig.sent_raw(seq + 1, [{"type": "BlockRemoved", "block_hashes": [11], "medium": ["GPU"]}],
                           "the batch with the list medium")
        assert rig.sub.stats.num_invalid_events[WORKER] == 1 and rig.overlap(A) == {}
        await rig.sent(seq + 2, BlockStored((21, 22), None, B, BS))  # the reader is still there
        assert rig.overlap(B) == {WORKER: 2} and rig.sub.active_workers == (WORKER,)
        assert not rig.sub._tasks[WORKER].done()


async def test_any_failure_to_decode_a_message_is_counted_and_the_reader_goes_on(monkeypatch):
    import runtime.engines.kv_events as kv_events

    real = kv_events.decode_multipart

    def decode(frames):
        if frames[2] == b"poison":  # stands for a decoder bug: an exception that is no KvEventDecodeError
            raise TypeError("unhashable type: 'list'")
        return real(frames)

    monkeypatch.setattr(kv_events, "decode_multipart", decode)
    async with _started() as (rig, seq):
        await rig.sent(seq, BlockStored((11, 12), None, A, BS))
        await rig.pub.send_multipart([b"kv-events", (seq + 1).to_bytes(8, "big"), b"poison"])
        await rig.sent(seq + 2, BlockStored((21, 22), None, B, BS))
        assert rig.sub.stats.num_decode_errors[WORKER] == 1
        # the dropped message leaves a gap: the worker is resynced, blocks stored before it are not credited
        assert rig.sub.stats.num_missed_batches[WORKER] == 1 and rig.sub.stats.num_resyncs[WORKER] == 1
        assert rig.overlap(A) == {} and rig.overlap(B) == {WORKER: 2}
        assert not rig.sub._tasks[WORKER].done()
