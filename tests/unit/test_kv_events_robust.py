"""KV events that real vLLM sends besides plain GPU BlockStored/BlockRemoved, and bad events in a batch.

Specification:
* a batch is decoded event by event: a malformed event (also a ``medium`` that is not a string), an event
  of an unknown medium and a token-less placeholder (``token_ids=[]``, ``block_size=0``) are left out and
  counted; a batch with a malformed event starts with ``AllBlocksCleared``, so a left-out removal never leaves
  the index crediting a block the worker evicted; GPU events and the offload
  tiers' events (``CPU``/``STORAGE``: vLLM's KV offloading connector,
  vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py) are kept with their medium;
* the applier indexes each medium apart: a CPU-tier removal never drops the GPU copy;
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
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventDecodeError,
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


def test_offloaded_copies_are_kept_with_their_medium_and_unknown_media_skipped():
    # the offloading connector reports its CPU copy of block 11 under the same engine hash
    batch = decode_payload(_payload(_stored_map([11], PROMPT[:4], medium="CPU"),
                                    {"type": "BlockRemoved", "block_hashes": [11], "medium": "STORAGE"},
                                    _stored_map([12], PROMPT[:4], medium="TAPE"),
                                    {"type": "BlockRemoved", "block_hashes": [12], "medium": "TAPE"}))
    assert batch.events == (BlockStored((11,), None, PROMPT[:4], BS, None, "CPU"), BlockRemoved((11,), "STORAGE"))
    assert batch.num_skipped_events == 2


def test_a_malformed_event_is_counted_and_named_and_the_rest_kept():
    bad = _stored_map([11], PROMPT[:4], block_size=-1)
    batch = decode_payload(_payload(bad, _stored_map([21], PROMPT[:4])))
    assert isinstance(batch.events[0], AllBlocksCleared)
    assert [ev.block_hashes for ev in batch.events[1:]] == [(21,)]
    assert batch.num_invalid_events == 1
    assert "payload.events[0]" in batch.first_error and "block_size" in batch.first_error


@pytest.mark.parametrize("medium", [["GPU"], {"tier": "GPU"}, 7])
def test_a_medium_that_is_not_a_string_makes_the_event_invalid_not_the_decoder_raise(medium):
    # a list or map is unhashable: looked up among the known media it raised TypeError out of the decoder
    removed = {"type": "BlockRemoved", "block_hashes": [7], "medium": medium}
    batch = decode_payload(_payload(_stored_map([11], PROMPT[:4]), removed, {**_stored_map([12], PROMPT[:4]),
                                                                             "medium": medium}))
    assert batch.num_invalid_events == 2 and "medium must be a string" in batch.first_error
    assert batch.events == (AllBlocksCleared(), BlockStored((11,), None, PROMPT[:4], BS, None, "GPU"))
    with pytest.raises(KvEventDecodeError, match="medium"):
        decode_event(["BlockRemoved", [7], medium])


def test_a_malformed_removal_leaves_no_block_the_worker_evicted_in_the_index():
    idx, ap = _setup()
    ap.apply("A", decode_payload(_payload(_stored_map(OURS[:2], PROMPT[:8]))).events)
    assert idx.match(OURS) == {"A": 2}
    # the worker evicted both blocks; the removal of the first reaches the router with a hash of the wrong type
    batch = decode_payload(_payload({"type": "BlockRemoved", "block_hashes": [1.5], "medium": "GPU"},
                                    {"type": "BlockRemoved", "block_hashes": [OURS[1]], "medium": "GPU"}))
    ap.apply("A", batch.events)
    assert batch.num_invalid_events == 1 and idx.match(OURS) == {}


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


def test_events_without_tokens_or_of_an_unindexed_medium_are_skipped_not_stored():
    idx, ap = _setup()  # no offload tier indexed
    stats = ap.apply("A", [BlockStored((OURS[0],), None, (), BS),  # engine hash must not become a router hash
                           BlockStored((11,), None, PROMPT[:4], BS, medium="CPU")])
    assert stats.num_skipped_events == 2 and idx.num_blocks("A") == 0
    ap.apply("A", [BlockStored((11,), None, PROMPT[:4], BS, medium="GPU"),
                   BlockRemoved((11,), medium="CPU")])  # the offloaded copy went, the GPU block stays
    assert idx.match(OURS) == {"A": 1}
