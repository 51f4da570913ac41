"""Simulated KV cache: prefix hits, LRU eviction tail-first, pinning, and events that keep the router's
index identical to the cache (property)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.kv.apply import KvEventApplier
from runtime.kv.events import BlockRemoved, BlockStored
from runtime.kv.index import PrefixIndex
from runtime.sim.worker import SimKvCache


def test_hits_are_the_cached_leading_blocks_and_new_blocks_are_announced():
    c = SimKvCache(8, 512)
    hit, ev = c.acquire([1, 2, 3])
    assert hit == 0 and ev == [BlockStored((1, 2, 3), None, None, 512)]
    c.release([1, 2, 3])
    hit, ev = c.acquire([1, 2, 4])
    assert hit == 2 and ev == [BlockStored((4,), 2, None, 512)]


def test_lru_evicts_the_tail_of_the_oldest_prompt_first_and_never_pinned_blocks():
    c = SimKvCache(4, 16)
    c.acquire([1, 2, 3])
    c.release([1, 2, 3])  # cached, unpinned; tail (3) is oldest
    c.acquire([9])  # pinned
    _, ev = c.acquire([7, 8])  # needs 2 blocks, 0 free -> evicts 3 then 2
    assert ev[0] == BlockRemoved((3, 2))
    assert 9 in c and 1 in c and 2 not in c
    assert c.num_overflow_blocks == 0


def test_over_commit_is_counted_when_everything_is_pinned():
    c = SimKvCache(2, 16)
    c.acquire([1, 2])
    c.acquire([3])
    assert c.num_overflow_blocks == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=5, unique=True), max_size=25),
       st.integers(1, 8))
def test_events_keep_the_router_index_equal_to_the_cache(prompts, capacity):
    cache = SimKvCache(capacity, 16)
    idx = PrefixIndex()
    idx.add_worker("w")
    ap = KvEventApplier(idx, 16)
    running = []
    for p in prompts:
        _, ev = cache.acquire(p)
        ap.apply("w", ev)
        running.append(p)
        if len(running) > 2:
            cache.release(running.pop(0))
        held = cache.blocks()
        assert {b for b in range(13) if idx.holds("w", b)} == held
