"""Decoding vLLM KV-event frames (layout of vllm/distributed/kv_events.py, array_like + tag=True)."""

import msgspec
import pytest

from runtime.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventDecodeError,
    decode_event,
    decode_multipart,
    decode_payload,
    encode_payload,
)


def _vllm_payload():
    # exactly what vLLM 0.28's msgspec encoder emits for KVEventBatch(ts, [BlockStored, BlockRemoved,
    # AllBlocksCleared]) (captured from vllm.distributed.kv_events): array-like batch, events as maps
    return msgspec.msgpack.encode([
        1712345678.5,
        [
            {"type": "BlockStored", "block_hashes": [111, 222], "parent_block_hash": None,
             "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None},
            {"type": "BlockRemoved", "block_hashes": [111], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        None,
    ])


def test_decodes_the_three_event_kinds():
    batch = decode_payload(_vllm_payload())
    assert batch.ts_s == 1712345678.5
    stored, removed, cleared = batch.events
    assert stored == BlockStored((111, 222), None, tuple(range(8)), 4, None, "GPU")
    assert removed == BlockRemoved((111,), "GPU")
    assert isinstance(cleared, AllBlocksCleared)


def test_the_older_array_layout_decodes_to_the_same_values():
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [111, 222], None, list(range(8)), 4, None, "GPU"],
                                            ["BlockRemoved", [111], "GPU"], ["AllBlocksCleared"]]])
    assert decode_payload(payload).events == decode_payload(_vllm_payload()).events


def test_extra_keys_are_kept_and_other_kv_cache_groups_skipped():
    payload = msgspec.msgpack.encode([0.0, [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": None, "medium": "GPU", "extra_keys": [["salt"], None]},
        {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "GPU", "group_idx": 1},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0},
    ]])
    batch = decode_payload(payload)
    assert batch.events[0].extra_keys == (("salt",), None)
    assert batch.num_unknown_events == 1 and len(batch.events) == 2


def test_a_map_event_missing_a_field_is_named():
    payload = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 2}]])
    batch = decode_payload(payload)  # the event is left out and counted, not the whole batch lost
    assert batch.events == (AllBlocksCleared(),) and batch.num_invalid_events == 1
    assert "missing 'token_ids'" in batch.first_error


def test_bytes_hashes_and_trailing_fields_of_newer_versions_are_accepted():
    payload = msgspec.msgpack.encode([0.0, [["BlockStored", [b"\x01" * 32], b"\x02" * 32, [1, 2], 2, None,
                                             None, "lora-name"]], 3])
    batch = decode_payload(payload)
    assert batch.events[0].block_hashes == (b"\x01" * 32,)
    assert batch.events[0].parent_block_hash == b"\x02" * 32
    assert batch.data_parallel_rank == 3


def test_unknown_event_kinds_are_counted_not_fatal():
    batch = decode_payload(msgspec.msgpack.encode([0.0, [["SomethingNew", 1], ["AllBlocksCleared"]]]))
    assert batch.num_unknown_events == 1 and len(batch.events) == 1


def test_multipart_frames_give_topic_and_big_endian_sequence_number():
    topic, seq, batch = decode_multipart([b"kv-events", (258).to_bytes(8, "big"), _vllm_payload()])
    assert topic == b"kv-events" and seq == 258 and len(batch.events) == 3


@pytest.mark.parametrize(
    "payload, needle",
    [
        (b"\xc1", "not msgpack"),
        (msgspec.msgpack.encode({"ts": 1}), "expected \\[ts, \\[events"),
        (msgspec.msgpack.encode(["x", []]), "ts must be a number"),
    ],
)
def test_malformed_payloads_are_rejected_naming_the_part(payload, needle):
    with pytest.raises(KvEventDecodeError, match=needle):
        decode_payload(payload)


@pytest.mark.parametrize(
    "event, needle",
    [
        (["BlockStored", [1], None], "BlockStored needs"),
        (["BlockStored", [1.5], None, [1], 1], "block_hashes"),
        (["BlockStored", [1], None, [1], 0], "block_size"),
    ],
)
def test_malformed_events_are_named_and_only_they_are_dropped(event, needle):
    with pytest.raises(KvEventDecodeError, match=needle):
        decode_event(event)
    batch = decode_payload(msgspec.msgpack.encode([0.0, [event, ["BlockRemoved", [7], "GPU"]]]))
    assert batch.events == (AllBlocksCleared(), BlockRemoved((7,), "GPU"))  # cleared first: see test_kv_events_robust
    assert batch.num_invalid_events == 1 and needle.split()[-1] in batch.first_error


def test_wrong_frame_count_or_seq_length_is_rejected():
    with pytest.raises(KvEventDecodeError, match="3 frames"):
        decode_multipart([b"t", _vllm_payload()])
    with pytest.raises(KvEventDecodeError, match="8 bytes"):
        decode_multipart([b"t", b"\x00", _vllm_payload()])


def test_encode_is_the_inverse_of_decode():
    batch = KvEventBatch(2.0, (BlockStored((1, 2), 9, (1, 2, 3, 4), 2, None, None, (("salt",), None)),
                               BlockRemoved((1,)), AllBlocksCleared()))
    assert decode_payload(encode_payload(batch)) == batch


def test_subscriber_add_and_remove_before_start_only_record_endpoints():
    from runtime.engines.kv_events import KvEventSubscriber

    sub = KvEventSubscriber({"w0": "tcp://127.0.0.1:5557"}, lambda w, b: None)
    assert sub.add("w1", "tcp://127.0.0.1:5558") is True
    assert sub.add("w1", "tcp://127.0.0.1:5558") is False  # already subscribed there
    assert sub.remove("w0") is True and sub.remove("w0") is False
    assert sub.endpoints == {"w1": "tcp://127.0.0.1:5558"}
    assert sub.active_workers == () and sub.stats.num_opened == 0  # nothing opened before start


async def test_subscriber_remove_closes_the_socket_and_drops_the_workers_counters():
    from runtime.engines.kv_events import KvEventSubscriber

    sub = KvEventSubscriber({"w0": "tcp://127.0.0.1:5557"}, lambda w, b: None)
    sub.start()
    try:
        assert sub.add("w1", "tcp://[::1]:5558") is True  # IPv6 endpoints need ZMQ's IPV6 option
        assert sub.active_workers == ("w0", "w1")
        sock = sub._socks["w1"]
        sub.stats.num_batches["w1"] = 3  # as if it had received batches
        assert sub.add("w1", "tcp://127.0.0.1:5559") is True  # moved: old socket closed, counters reset
        assert sock.closed and "w1" not in sub.stats.num_batches
        sock = sub._socks["w1"]
        assert sub.remove("w1") is True
        assert sock.closed and sub.active_workers == ("w0",)
        assert (sub.stats.num_opened, sub.stats.num_closed) == (3, 2)
        with pytest.raises(ValueError, match="'w2'.*tcp://nowhere"):
            sub.add("w2", "tcp://nowhere")
        assert "w2" not in sub.endpoints and sub.active_workers == ("w0",)
    finally:
        await sub.stop()
    assert sub.active_workers == () and sub.stats.num_closed == 3
