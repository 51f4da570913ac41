"""Prefix index: hand-checked longest-prefix matches, eviction, workers leaving, approximate TTL entries.

Properties (hypothesis): after any sequence of store/remove/clear/learn/expire/remove_worker,
`match` equals the longest prefix computed from a plain worker → set-of-blocks model; in particular it
never reports a block a worker evicted and never reports a removed worker.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.kv.index import PrefixIndex, UnknownWorkerError


def _index(**held):
    idx = PrefixIndex()
    for w, blocks in held.items():
        idx.add_worker(w)
        idx.store(w, blocks)
    return idx


def test_longest_prefix_per_worker():
    idx = _index(A=[1, 2, 3], B=[1, 2], C=[2, 3])
    assert idx.match([1, 2, 3, 4]) == {"A": 3, "B": 2}


def test_a_gap_stops_the_match():
    idx = _index(A=[1, 3, 4])
    assert idx.match([1, 2, 3, 4]) == {"A": 1}
    assert idx.match([2, 3]) == {}
    assert idx.match([]) == {}


def test_removed_blocks_are_no_longer_reported():
    idx = _index(A=[1, 2, 3])
    idx.remove("A", [3, 99])
    assert idx.match([1, 2, 3]) == {"A": 2}
    idx.remove("A", [1])
    assert idx.match([1, 2, 3]) == {}


def test_a_block_stored_twice_needs_two_removals():
    idx = _index(A=[1])
    idx.store("A", [1])
    idx.remove("A", [1])
    assert idx.match([1]) == {"A": 1}
    idx.remove("A", [1])
    assert idx.match([1]) == {}


def test_clear_and_remove_worker():
    idx = _index(A=[1, 2], B=[1, 2])
    idx.clear("A")
    assert idx.match([1, 2]) == {"B": 2}
    idx.remove_worker("B")
    assert idx.match([1, 2]) == {}
    assert idx.workers == ("A",)


def test_a_new_worker_reusing_a_freed_slot_inherits_nothing():
    idx = _index(A=[1, 2], B=[5])
    idx.remove_worker("A")
    idx.add_worker("C")
    assert idx.match([1, 2]) == {}
    assert idx.num_blocks("C") == 0
    assert idx.match([5]) == {"B": 1}


def test_unknown_worker_is_named():
    idx = PrefixIndex()
    with pytest.raises(UnknownWorkerError, match="'ghost'"):
        idx.store("ghost", [1])


def test_learned_entries_expire_after_their_ttl():
    idx = PrefixIndex()
    idx.add_worker("A")
    idx.learn("A", [1, 2], expires_at_s=10.0)
    assert idx.match([1, 2]) == {"A": 2}
    assert idx.expire(9.9) == 0
    idx.learn("A", [1], expires_at_s=20.0)  # refresh block 1 only
    assert idx.expire(10.0) == 1
    assert idx.match([1, 2]) == {"A": 1}
    assert idx.expire(20.0) == 1
    assert idx.match([1]) == {}


def test_learned_entries_are_bounded_by_capacity_oldest_first():
    idx = PrefixIndex()
    idx.add_worker("A", approx_capacity_blocks=3)
    idx.learn("A", [1, 2], 100.0)
    idx.learn("A", [3, 4], 100.0)
    assert idx.num_blocks("A") == 3
    assert not idx.holds("A", 1) and idx.holds("A", 4)


# ---------------------------------------------------------------- property
_workers = st.sampled_from(["w0", "w1", "w2", "w3"])
_blocks = st.lists(st.integers(0, 7), max_size=6)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), _workers, _blocks),
        st.tuples(st.just("remove"), _workers, _blocks),
        st.tuples(st.just("clear"), _workers, st.just([])),
        st.tuples(st.just("drop"), _workers, st.just([])),
        st.tuples(st.just("add"), _workers, st.just([])),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, query=st.lists(st.integers(0, 7), min_size=1, max_size=8))
def test_match_equals_the_set_model_and_never_reports_evicted_blocks(ops, query):
    idx = PrefixIndex()
    model: dict[str, dict[int, int]] = {}
    for op, w, blocks in ops:
        if op == "add":
            idx.add_worker(w)
            model.setdefault(w, {})
        elif w not in model:
            continue
        elif op == "store":
            idx.store(w, blocks)
            for b in blocks:
                model[w][b] = model[w].get(b, 0) + 1
        elif op == "remove":
            idx.remove(w, blocks)
            for b in blocks:
                if b in model[w]:
                    model[w][b] -= 1
                    if model[w][b] == 0:
                        del model[w][b]
        elif op == "clear":
            idx.clear(w)
            model[w].clear()
        elif op == "drop":
            idx.remove_worker(w)
            del model[w]
    expected = {}
    for w, held in model.items():
        n = 0
        for b in query:
            if b not in held:
                break
            n += 1
        if n:
            expected[w] = n
    got = idx.match(query)
    assert got == expected
    for w, n in got.items():
        assert all(b in model[w] for b in query[:n])


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(0, 5), _workers, _blocks), max_size=30),
       query=st.lists(st.integers(0, 7), min_size=1, max_size=8))
def test_learned_entries_are_reported_exactly_until_they_expire(steps, query):
    ttl = 4.0
    idx = PrefixIndex()
    model: dict[str, dict[int, float]] = {}
    now = 0.0
    for dt, w, blocks in steps:
        now += dt
        idx.add_worker(w)
        idx.expire(now)
        for m in model.values():
            for b in [b for b, exp in m.items() if exp <= now]:
                del m[b]
        idx.learn(w, blocks, now + ttl)
        model.setdefault(w, {}).update({b: now + ttl for b in blocks})
        expected = {}
        for wid, held in model.items():
            n = 0
            for b in query:
                if b not in held:
                    break
                n += 1
            if n:
                expected[wid] = n
        assert idx.match(query) == expected
