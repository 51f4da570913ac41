"""Applying KV events: the router re-hashes token ids, so engine hash seeds cannot zero the scores."""

import pytest

from runtime.kv.apply import KvEventApplier, KvEventError
from runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from runtime.kv.hashing import block_hashes
from runtime.kv.index import PrefixIndex, UnknownWorkerError

BS = 4
PROMPT = list(range(100, 116))  # 4 full blocks of 4 tokens
OURS = block_hashes(PROMPT, BS)


def _setup(*workers):
    idx = PrefixIndex()
    for w in workers:
        idx.add_worker(w)
    return idx, KvEventApplier(idx, BS)


def test_engines_with_different_hash_seeds_still_match_the_router_hashes():
    idx, ap = _setup("A", "B")
    # two engines report the same tokens under unrelated engine hashes (different PYTHONHASHSEED)
    ap.apply("A", [BlockStored((11, 12, 13, 14), None, tuple(PROMPT), BS)])
    ap.apply("B", [BlockStored((b"x1", b"x2"), None, tuple(PROMPT[:8]), BS)])
    assert idx.match(OURS) == {"A": 4, "B": 2}


def test_later_events_chain_through_the_engine_parent_hash():
    idx, ap = _setup("A")
    ap.apply("A", [BlockStored((11, 12), None, tuple(PROMPT[:8]), BS)])
    ap.apply("A", [BlockStored((13, 14), 12, tuple(PROMPT[8:]), BS)])
    assert idx.match(OURS) == {"A": 4}


def test_block_removed_translates_engine_hashes_back():
    idx, ap = _setup("A")
    ap.apply("A", [BlockStored((11, 12, 13, 14), None, tuple(PROMPT), BS)])
    stats = ap.apply("A", [BlockRemoved((14, 13))])
    assert stats.num_removed_blocks == 2
    assert idx.match(OURS) == {"A": 2}


def test_all_blocks_cleared_empties_the_worker():
    idx, ap = _setup("A")
    ap.apply("A", [BlockStored((11, 12, 13, 14), None, tuple(PROMPT), BS), AllBlocksCleared()])
    assert idx.match(OURS) == {}
    assert idx.num_blocks("A") == 0


def test_an_unknown_parent_skips_the_blocks_and_counts_them():
    idx, ap = _setup("A")
    stats = ap.apply("A", [BlockStored((13, 14), 999, tuple(PROMPT[8:]), BS)])
    assert stats.num_orphan_blocks == 2 and stats.num_stored_blocks == 0
    assert idx.num_blocks("A") == 0


def test_events_without_tokens_use_engine_hashes_as_router_hashes():
    idx, ap = _setup("A")
    ap.apply("A", [BlockStored((7, 8, 9), None, None, 512)])
    ap.apply("A", [BlockRemoved((9,))])
    assert idx.match([7, 8, 9]) == {"A": 2}


def test_block_size_mismatch_is_an_error_naming_block_size():
    idx, ap = _setup("A")
    with pytest.raises(KvEventError, match="block_size=8"):
        ap.apply("A", [BlockStored((1,), None, tuple(range(8)), 8)])


def test_token_count_must_match_the_blocks():
    idx, ap = _setup("A")
    with pytest.raises(KvEventError, match="token_ids has 7 tokens"):
        ap.apply("A", [BlockStored((1, 2), None, tuple(range(7)), BS)])


def test_events_of_an_unknown_worker_are_rejected():
    idx, ap = _setup("A")
    with pytest.raises(UnknownWorkerError):
        ap.apply("Z", [AllBlocksCleared()])


def test_salted_blocks_never_match_a_plain_prompt_with_the_same_tokens():
    idx, ap = _setup("A", "B")
    ap.apply("A", [BlockStored((11, 12, 13, 14), None, tuple(PROMPT), BS, extra_keys=(("salt-1",), None, None, None))])
    ap.apply("B", [BlockStored((21, 22), None, tuple(PROMPT[:8]), BS, extra_keys=(None, None))])
    assert idx.match(OURS) == {"B": 2}


def test_two_copies_of_a_block_leave_the_index_with_the_last_one():
    # vLLM's block pool may hold two physical blocks with one hash (the same prefix computed by two requests
    # at once): it reports BlockStored twice and, on eviction, BlockRemoved twice
    idx, ap = _setup("A")
    ev = BlockStored((11, 12), None, tuple(PROMPT[:8]), BS)
    stats = ap.apply("A", [ev, ev])
    assert (stats.num_stored_blocks, stats.num_repeated_blocks) == (4, 2)
    ap.apply("A", [BlockRemoved((11, 12))])
    assert idx.match(OURS) == {"A": 2}  # one copy is still cached: still a prefix hit
    ap.apply("A", [BlockRemoved((11, 12))])
    assert idx.match(OURS) == {}  # never report a block the worker no longer has
    ap.apply("A", [BlockStored((11, 12), None, tuple(PROMPT[:8]), BS), BlockRemoved((11, 12))])
    assert idx.match(OURS) == {}
