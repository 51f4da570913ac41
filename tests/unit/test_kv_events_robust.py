"""KV events that real vLLM sends besides plain GPU BlockStored/BlockRemoved, and bad events in a batch.

Specification:
* a batch is decoded event by event: a malformed event, an event of another medium (vLLM's KV offloading
  connector, vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py) and a token-less
  placeholder (``token_ids=[]``, ``block_size=0``) are left out and counted; the GPU events are kept;
* ``token_ids=[]`` never becomes ``None`` (the simulator's "engine hashes are router hashes" mode);
* the applier applies every good event of a batch even when one is bad, then raises naming the bad one.
(Re-reported prefix hits, ``kv_cache_report_mode="full"``, are kept out by the runtime dropping that
setting from client ``vllm_xargs``: tests/unit/test_server_model_clients.py; copies are counted,
tests/unit/test_kv_apply.py.)
"""

import msgspec
import pytest

from runtime.kv.apply import KvEventApplier, KvEventError
from runtime.kv.events import (
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    decode_event,
    decode_payload,
    encode_payload,
)
from runtime.kv.hashing import block_hashes
from runtime.kv.index import PrefixIndex

BS = 4
PROMPT = tuple(range(100, 116))  # 4 full blocks
OURS = block_hashes(PROMPT, BS)


def _setup():
    idx = PrefixIndex()
    idx.add_worker("A")
    return idx, KvEventApplier(idx, BS)


def _stored_map(hashes, tokens, *, block_size=BS, medium="GPU"):
    # field set of vLLM 0.28's BlockStored as its msgspec encoder writes it (map form)
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
            "token_ids": list(tokens), "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None, "group_idx": 0}


def _payload(*events):
    return msgspec.msgpack.encode([1.0, list(events)])


# ----------------------------------------------------------------------------------------- decoding
def test_offloading_placeholders_are_skipped_and_the_gpu_events_of_the_batch_kept():
    gpu = _stored_map([11, 12], PROMPT[:8])
    placeholder = _stored_map([555], [], block_size=0, medium="CPU")
    removed = {"type": "BlockRemoved", "block_hashes": [99], "medium": "GPU", "group_idx": 0}
    batch = decode_payload(_payload(gpu, placeholder, removed))
    assert batch.events == (BlockStored((11, 12), None, PROMPT[:8], BS, None, "GPU"), BlockRemoved((99,), "GPU"))
    assert (batch.num_skipped_events, batch.num_invalid_events) == (1, 0)


def test_offloaded_copies_under_gpu_engine_hashes_are_skipped_in_both_directions():
    # the offloading connector reports its CPU copy of block 11 under the same engine hash: evicting the
    # CPU copy must not drop the GPU block from the index
    batch = decode_payload(_payload(_stored_map([11], PROMPT[:4], medium="CPU"),
                                    {"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU"}))
    assert batch.events == () and batch.num_skipped_events == 2


def test_a_malformed_event_is_counted_and_named_and_the_rest_kept():
    bad = _stored_map([11], PROMPT[:4], block_size=-1)
    batch = decode_payload(_payload(bad, _stored_map([21], PROMPT[:4])))
    assert [ev.block_hashes for ev in batch.events] == [(21,)]
    assert batch.num_invalid_events == 1
    assert "payload.events[0]" in batch.first_error and "block_size" in batch.first_error


def test_empty_token_ids_stay_distinct_from_no_token_ids():
    # a vLLM event without tokens carries nothing router-comparable: skipped, never simulator mode (None)
    assert decode_event(_stored_map([OURS[0]], [], medium=None)) is None
    assert decode_payload(_payload(_stored_map([OURS[0]], [], medium=None))).num_skipped_events == 1
    assert decode_event(["BlockStored", [7], None, None, 512]).token_ids is None  # simulator / array form


def test_simulator_events_survive_an_encode_decode_round_trip():
    batch = KvEventBatch(3.0, (BlockStored((7, 8), None, None, 512),))
    assert decode_payload(encode_payload(batch)) == batch


# ----------------------------------------------------------------------------------------- applying
def test_one_bad_event_does_not_stop_the_rest_of_the_batch():
    idx, ap = _setup()
    ap.apply("A", [BlockStored((11, 12, 13, 14), None, PROMPT, BS)])
    other_block_size = BlockStored((21,), None, tuple(range(8)), 8)
    with pytest.raises(KvEventError, match="block_size=8") as err:
        ap.apply("A", [other_block_size, BlockRemoved((14,)), BlockStored((31,), None, (1, 2, 3), BS),
                       BlockRemoved((13,))])
    assert err.value.stats.num_rejected_events == 2  # the block size and the 3-token block
    assert err.value.stats.num_removed_blocks == 2
    assert idx.match(OURS) == {"A": 2}  # both removals after the bad events were applied


def test_events_without_tokens_or_of_another_medium_are_skipped_not_stored():
    idx, ap = _setup()
    stats = ap.apply("A", [BlockStored((OURS[0],), None, (), BS),  # engine hash must not become a router hash
                           BlockStored((11,), None, PROMPT[:4], BS, medium="CPU")])
    assert stats.num_skipped_events == 2 and idx.num_blocks("A") == 0
    ap.apply("A", [BlockStored((11,), None, PROMPT[:4], BS, medium="GPU"),
                   BlockRemoved((11,), medium="CPU")])  # the offloaded copy went, the GPU block stays
    assert idx.match(OURS) == {"A": 1}


def test_an_engine_hash_reported_with_other_tokens_replaces_its_old_block():
    idx, ap = _setup()
    ap.apply("A", [BlockStored((11,), None, PROMPT[:4], BS)])
    ap.apply("A", [BlockStored((11,), None, PROMPT[4:8], BS)])
    assert idx.num_blocks("A") == 1 and idx.match(OURS) == {}
    ap.apply("A", [BlockRemoved((11,))])
    assert idx.num_blocks("A") == 0


@pytest.mark.parametrize("bad_tokens", [[[1], 2, 3, 4], [1, {"a": 1}, 3, 4], [1, 2.5, 3, 4], [1, "2", 3, 4]])
def test_non_int_token_ids_are_a_malformed_event_counted_and_skipped(bad_tokens):
    bad = _stored_map([10], bad_tokens)
    good = _stored_map([11, 12, 13, 14], PROMPT)
    batch = decode_payload(_payload(bad, good))
    assert batch.num_invalid_events == 1 and "token_ids must be ints" in batch.first_error
    assert len(batch.events) == 1
    idx, app = _setup()
    app.apply("A", batch.events)
    assert idx.match(OURS) == {"A": 4}


def test_unhashable_tokens_of_a_hand_built_event_are_rejected_after_the_rest_of_the_batch():
    idx, app = _setup()
    bad = BlockStored((10,), None, ([1], 2, 3, 4), BS)  # type: ignore[arg-type]  # not from the decoder
    good = BlockStored((11, 12, 13, 14), None, PROMPT, BS)
    with pytest.raises(KvEventError) as exc:
        app.apply("A", [bad, good])
    assert exc.value.stats.num_rejected_events == 1 and exc.value.stats.num_stored_blocks == 4
    assert idx.match(OURS) == {"A": 4}
