"""Router: in-flight accounting, conditional disaggregation, KV events, failures, pool safety.

Property (hypothesis): under any interleaving of add/remove/route/first-token/complete, a decision only
names workers currently in the pool, and loads return to zero when every request completes.
"""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.config import RouterSpec
from runtime.kv.events import BlockStored
from runtime.router.core import MigrationLimitError, NoWorkersError, Router, UnknownRequestError

BS = 16
PROMPT = list(range(1000, 1000 + 64 * BS))  # 1024 tokens = 64 blocks


def _router(**spec):
    return Router(RouterSpec(**spec), BS)


def _stored(router, worker, tokens):
    hashes = tuple(range(len(tokens) // BS))
    router.apply_kv_events(worker, [BlockStored(hashes, None, tuple(tokens[: len(hashes) * BS]), BS)], 0.0)


def test_routes_a_prompt_to_the_worker_holding_its_blocks_from_real_token_events():
    r = _router()
    for w in ("a", "b", "c"):
        r.add_worker(w, "both")
    _stored(r, "b", PROMPT[:48 * BS])
    d = r.route("q", token_ids=PROMPT, now_s=0.0)
    assert d.decode_worker == "b" and d.prefill_worker is None
    assert d.overlap_blocks == 48 and d.uncached_tokens == 16 * BS
    assert d.reason == "local_no_prefill_pool"


def test_load_is_added_on_route_prefill_dropped_at_first_token_all_freed_on_completion():
    r = _router(disagg_min_uncached_tokens=0)
    r.add_worker("p", "prefill")
    r.add_worker("d", "decode")
    d = r.route("q", token_ids=PROMPT, now_s=0.0)
    assert (d.prefill_worker, d.decode_worker, d.reason) == ("p", "d", "remote")
    w = r.workers
    assert (w["p"].prefill_tokens, w["d"].decode_blocks) == (1024, 64)
    assert r.on_first_token("q") and not r.on_first_token("q")
    assert (w["p"].prefill_tokens, w["d"].decode_blocks) == (0, 64)
    assert r.on_complete("q") and not r.on_complete("q")
    assert (w["p"].num_requests, w["d"].num_requests, w["d"].decode_blocks) == (0, 0, 0)


def test_the_decode_pool_is_chosen_by_load_and_the_prefill_pool_by_queue():
    r = _router(disagg_min_uncached_tokens=0)
    r.add_worker("p0", "prefill")
    r.add_worker("p1", "prefill")
    r.add_worker("d0", "decode")
    r.add_worker("d1", "decode")
    first = r.route("q1", token_ids=PROMPT, now_s=0.0)
    r.on_first_token("q1")  # q1 now only decodes: 64 active blocks on its decode worker
    second = r.route("q2", token_ids=[t + 7000 for t in PROMPT], now_s=0.0)
    assert second.decode_worker != first.decode_worker
    # both prefill queues are empty: the tie goes to the one that has prefilled less so far
    assert second.prefill_worker != first.prefill_worker
    # once its KV events say it holds q1's blocks, a repeat of q1 prefills there despite q2's worker
    # being equally idle after q2's first token
    _stored(r, first.prefill_worker, PROMPT)
    r.on_first_token("q2")
    third = r.route("q3", token_ids=PROMPT, now_s=0.0)
    assert (third.prefill_worker, third.overlap_blocks, third.uncached_tokens) == (first.prefill_worker, 63, 16)


def test_a_short_uncached_part_is_prefilled_locally():
    r = _router(disagg_min_uncached_tokens=512)
    r.add_worker("p", "prefill")
    r.add_worker("d", "decode")
    _stored(r, "d", PROMPT[:40 * BS])  # 24 blocks = 384 uncached tokens < 512
    d = r.route("q", token_ids=PROMPT, now_s=0.0)
    assert (d.prefill_worker, d.decode_worker, d.reason) == (None, "d", "local_short")
    assert r.workers["d"].prefill_tokens == 384


def test_a_saturated_prefill_pool_falls_back_to_local_prefill():
    r = _router(disagg_min_uncached_tokens=0, disagg_max_prefill_queue_tokens=1500)
    r.add_worker("p", "prefill")
    r.add_worker("d", "decode")
    other = [t + 5000 for t in PROMPT]
    assert r.route("q1", token_ids=PROMPT, now_s=0.0).reason == "remote"  # p queues 1024
    assert r.route("q2", token_ids=other, now_s=0.0).reason == "remote"  # 1024 <= 1500; now 2048
    d3 = r.route("q3", token_ids=[t + 9000 for t in PROMPT], now_s=0.0)
    assert (d3.prefill_worker, d3.reason) == (None, "local_prefill_saturated")


def test_in_flight_prefixes_attract_followers_before_any_kv_event_arrives():
    r = _router(inflight_overlap=True)
    for w in ("a", "b"):
        r.add_worker(w, "both")
    other = r.route("q0", token_ids=[7] * 512, now_s=0.0)  # unrelated 512 tokens queue on one worker
    first = r.route("q1", token_ids=PROMPT, now_s=0.0)  # 1024 tokens go to the other one
    assert first.decode_worker != other.decode_worker
    # the follower shares 64 blocks that exist only as q1's in-flight prefill (no KV event yet):
    # there it waits 1024 tokens and computes 16; elsewhere it waits 512 and computes 1040
    second = r.route("q2", token_ids=PROMPT + [5] * BS, now_s=0.0)
    assert second.decode_worker == first.decode_worker and second.overlap_blocks == 64


def test_without_in_flight_overlap_the_follower_sees_no_cache_yet():
    r = _router(inflight_overlap=False)
    for w in ("a", "b"):
        r.add_worker(w, "both")
    r.route("q0", token_ids=[7] * 512, now_s=0.0)
    r.route("q1", token_ids=PROMPT, now_s=0.0)
    assert r.route("q2", token_ids=PROMPT + [5] * BS, now_s=0.0).overlap_blocks == 0


def test_approximate_mode_learns_from_decisions_and_forgets_after_the_ttl():
    r = _router(approx_ttl_s=10.0)
    r.add_worker("a", "both", kv_events=False)
    r.add_worker("b", "both", kv_events=False)
    first = r.route("q1", token_ids=PROMPT, now_s=0.0)
    r.on_complete("q1")
    assert r.overlaps(r.hashes_for(PROMPT)) == {first.decode_worker: 64}
    again = r.route("q2", token_ids=PROMPT, now_s=5.0)
    # all 64 blocks are known; vLLM recomputes the last prompt token, so 63 blocks are usable
    assert again.decode_worker == first.decode_worker and again.overlap_blocks == 63
    r.on_complete("q2")
    r.route("q3", token_ids=[1] * BS, now_s=20.0)  # any call past the TTL expires the entries
    assert r.overlaps(r.hashes_for(PROMPT)) == {}
    _stored(r, "a", PROMPT)  # a worker declared without events: stray events do not enter the index
    assert r.overlaps(r.hashes_for(PROMPT)) == {}


def test_a_removed_worker_leaves_the_index_and_is_never_chosen():
    r = _router()
    r.add_worker("a", "both")
    r.add_worker("b", "both")
    _stored(r, "a", PROMPT)
    r.route("q", token_ids=PROMPT, now_s=0.0)
    assert r.remove_worker("a") == ["q"]
    assert r.overlaps(r.hashes_for(PROMPT)) == {}
    assert r.route("q2", token_ids=PROMPT, now_s=0.0).decode_worker == "b"
    assert r.apply_kv_events("a", [], 0.0).num_stored_blocks == 0  # late events of a dead worker: ignored


def test_a_worker_back_under_its_id_takes_back_the_load_of_the_requests_still_on_it():
    # discovery saw the worker's readiness flap: it left and came back while its requests ran on
    r = _router()
    r.add_worker("a", "decode")
    r.add_worker("b", "decode")
    on_a = [q for q in ("q1", "q2", "q3", "q4") if r.route(q, token_ids=PROMPT, now_s=0.0).decode_worker == "a"]
    assert on_a and r.remove_worker("a") == on_a
    r.add_worker("a", "decode")
    assert r.workers["a"].num_requests == len(on_a) and r.workers["a"].decode_blocks == 64 * len(on_a)
    for q in ("q1", "q2", "q3", "q4"):
        r.on_complete(q)
    assert all((w.decode_blocks, w.num_requests, w.engine_requests) == (0, 0, 0) for w in r.workers.values())
    r.remove_worker("a")  # nothing in flight on it: back later as a newcomer
    r.add_worker("a", "decode")
    assert r.workers["a"].num_requests == 0


def test_prefill_failure_moves_the_prefill_to_the_decode_worker():
    r = _router(disagg_min_uncached_tokens=0)
    r.add_worker("p", "prefill")
    r.add_worker("d", "decode")
    r.route("q", token_ids=PROMPT, now_s=0.0)
    d = r.fallback_local_prefill("q")
    assert (d.prefill_worker, d.decode_worker, d.reason) == (None, "d", "local_prefill_failed")
    assert r.workers["p"].prefill_tokens == 0 and r.workers["d"].prefill_tokens == 1024
    r.on_complete("q")
    assert r.workers["d"].prefill_tokens == 0 and r.workers["d"].decode_blocks == 0


def test_decode_failure_migrates_up_to_the_limit_then_errors():
    r = _router(migration_limit=1)
    for w in ("a", "b", "c"):
        r.add_worker(w, "both")
    first = r.route("q", token_ids=PROMPT, now_s=0.0)
    moved = r.migrate("q", now_s=1.0, token_ids=PROMPT + [9] * 20)
    assert moved.decode_worker != first.decode_worker and moved.reason == "migrated"
    with pytest.raises(MigrationLimitError, match="migration_limit=1"):
        r.migrate("q", now_s=2.0)
    with pytest.raises(UnknownRequestError):
        r.in_flight("q")
    assert all(w.num_requests == 0 and w.decode_blocks == 0 for w in r.workers.values())


def test_a_newcomer_starts_at_the_pools_mean_cumulative_work_and_work_follows_the_cost_function():
    r = Router(RouterSpec(), BS, prefill_cost=lambda n, c: (n - c) / 1000.0)  # 1 ms per uncached token
    r.add_worker("a", "both")
    r.add_worker("b", "both")
    r.route("q1", token_ids=PROMPT, now_s=0.0)
    r.route("q2", token_ids=[t + 3 for t in PROMPT], now_s=0.0)
    assert sorted(w.prefill_work for w in r.workers.values()) == [1.024, 1.024]
    r.add_worker("c", "both")
    assert r.workers["c"].total_prefill_work == pytest.approx(1.024)


def test_bad_calls_are_rejected_clearly():
    r = _router()
    with pytest.raises(NoWorkersError):
        r.route("q", token_ids=PROMPT, now_s=0.0)
    r.add_worker("a", "both")
    with pytest.raises(ValueError, match="already in the pool"):
        r.add_worker("a", "decode")
    with pytest.raises(ValueError, match="role"):
        r.add_worker("x", "router")
    with pytest.raises(ValueError, match="exactly one"):
        r.route("q", now_s=0.0)
    r.route("q", token_ids=PROMPT, now_s=0.0)
    with pytest.raises(ValueError, match="already in flight"):
        r.route("q", block_hashes=[1, 2], now_s=0.0)


# ---------------------------------------------------------------- property
_ids = st.sampled_from([f"w{i}" for i in range(5)])
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), _ids, st.sampled_from(["prefill", "decode", "both"])),
        st.tuples(st.just("remove"), _ids, st.just("")),
        st.tuples(st.just("route"), st.integers(0, 3), st.sampled_from(["kv", "x"])),
        st.tuples(st.just("first"), st.integers(0, 30), st.just("")),
        st.tuples(st.just("done"), st.integers(0, 30), st.just("")),
        st.tuples(st.just("fallback"), st.integers(0, 30), st.just("")),
        st.tuples(st.just("migrate"), st.integers(0, 30), st.just("")),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, policy=st.sampled_from(["kv_aware", "round_robin", "random", "least_loaded", "dynamo_cost"]))
# a failed prefill whose decode worker left, with no other decode worker: NoWorkersError, the request freed
@example(ops=[("add", "w0", "decode"), ("route", 0, "kv"), ("remove", "w0", ""), ("fallback", 0, "")],
         policy="kv_aware")
def test_routing_never_picks_a_worker_outside_the_pool(ops, policy):
    r = Router(RouterSpec(policy=policy, disagg_min_uncached_tokens=0), BS)
    pool: set[str] = set()
    n = 0
    for op, a, b in ops:
        if op == "add" and a not in pool:
            r.add_worker(a, b)
            pool.add(a)
        elif op == "remove":
            r.remove_worker(a)
            pool.discard(a)
        elif op == "route":
            try:
                d = r.route(f"q{n}", block_hashes=list(range(a, a + 8)), now_s=float(n))
            except NoWorkersError:
                assert not any(w.can_decode for w in r.workers.values())
                continue
            assert d.decode_worker in pool and (d.prefill_worker is None or d.prefill_worker in pool)
            n += 1
        elif op == "first":
            r.on_first_token(f"q{a}")
        elif op == "fallback":
            try:
                d = r.fallback_local_prefill(f"q{a}", now_s=float(n))
            except UnknownRequestError:
                pass
            except NoWorkersError:  # its decode worker left, and no other is in the pool: the request is freed
                assert not any(w.can_decode for w in r.workers.values()) and f"q{a}" not in r._requests
            else:
                assert d.decode_worker in pool and d.prefill_worker is None
        elif op == "migrate":
            try:
                r.migrate(f"q{a}", now_s=float(n))
            except (UnknownRequestError, MigrationLimitError, NoWorkersError):
                pass
        else:
            r.on_complete(f"q{a}")
        _check_engine_requests(r)
    for i in range(n):
        r.on_complete(f"q{i}")
    assert all((w.prefill_tokens, w.decode_blocks, w.num_requests, w.engine_requests) == (0, 0, 0, 0)
               for w in r.workers.values())


def _check_engine_requests(r: Router) -> None:
    """Each worker's `engine_requests` is what its engine holds of the router's requests: the ones prefilling
    on it, and the ones decoding on it once their prefill is done or when it prefills them itself."""
    expected = {wid: 0 for wid in r.workers}
    for q in r._requests.values():
        local = q.prefill is None or q.prefill is q.decode
        holder = q.decode if local or q.prefill_done else q.prefill
        if holder.worker_id in expected and r.workers[holder.worker_id] is holder:
            expected[holder.worker_id] += 1
    assert {wid: w.engine_requests for wid, w in r.workers.items()} == expected


# -- aggregated pools count decode load -----------------------------------------------------------------

def test_aggregated_kv_aware_counts_decode_load_so_a_cached_prefix_does_not_take_every_request():
    import collections
    import random

    r = Router(RouterSpec(), BS, seed=1)
    for i in range(4):
        r.add_worker(f"w{i}", "both")
    rng = random.Random(0)
    hot = [rng.randrange(1000) for _ in range(2048)]
    _stored(r, "w0", hot)
    inflight, count = collections.deque(), collections.Counter()
    for k in range(1000):
        d = r.route(f"r{k}", now_s=0.0, token_ids=hot + [rng.randrange(1000) for _ in range(64)])
        count[d.decode_worker] += 1
        r.on_first_token(f"r{k}")  # prefill done before the next arrival: only decode load remains
        inflight.append(f"r{k}")
        if len(inflight) > 64:
            r.on_complete(inflight.popleft())
    # with decode free (weight 0) all 1000 went to w0: its cache saves 2,048 tokens a request
    assert count["w0"] < 950 and min(count[f"w{i}"] for i in range(1, 4)) > 15


def test_aggregated_pile_up_guard_works_with_two_workers():
    # against the mean of all workers a worker of two never holds more than twice it, so the guard never
    # fired: 60 long-running requests sharing a prefix cached on w0 all went to w0
    import collections

    r = Router(RouterSpec(), BS, seed=1)
    for i in range(2):
        r.add_worker(f"w{i}", "both")
    prefix = list(range(4096))
    _stored(r, "w0", prefix)
    count = collections.Counter()
    for k in range(60):
        d = r.route(f"q{k}", now_s=0.0, token_ids=prefix + [10_000 + k] * 64)
        r.on_first_token(f"q{k}")  # the requests keep decoding
        count[d.decode_worker] += 1
    assert count["w1"] >= 5 and count["w0"] > count["w1"]  # the cache still pulls, but not everything


def test_aggregated_pool_spreads_by_decode_load_with_a_higher_decode_weight():
    r = Router(RouterSpec(decode_weight=1.0), BS)
    r.add_worker("a", "both"), r.add_worker("b", "both")
    _stored(r, "a", PROMPT)
    r.route("busy", token_ids=list(range(50_000, 50_000 + 256 * BS)), now_s=0.0)  # decoding on one of them
    r.on_first_token("busy")
    busy = r.in_flight("busy").decode_worker
    d = r.route("q", token_ids=PROMPT, now_s=0.0)
    assert d.decode_worker != busy


def test_disaggregated_prefill_choice_still_ignores_decode_load_by_default():
    r = _router(disagg_min_uncached_tokens=0)
    for w, role in (("p0", "prefill"), ("p1", "prefill"), ("d", "decode")):
        r.add_worker(w, role)
    r.workers["p0"].decode_blocks = 10**6  # not a decoder: must not matter
    _stored(r, "p0", PROMPT)
    assert r.route("q", token_ids=PROMPT, now_s=0.0).prefill_worker == "p0"


# -- prompt length and hashing -----------------------------------------------------------------------

def test_only_the_first_max_hashed_tokens_are_hashed_but_the_whole_prompt_is_charged():
    from runtime.router.core import MAX_HASHED_PROMPT_TOKENS

    r = _router()
    r.add_worker("a", "both", kv_events=False)
    n = MAX_HASHED_PROMPT_TOKENS * 4
    d = r.route("huge", token_ids=range(n), now_s=0.0)
    assert r.index.num_blocks("a") == MAX_HASHED_PROMPT_TOKENS // BS  # learned/matched prefix is capped
    assert d.num_prompt_blocks == n // BS and r.workers["a"].decode_blocks == n // BS
    assert d.uncached_tokens == n and r.workers["a"].prefill_tokens == n


def test_a_prompt_known_only_by_its_length_is_charged_without_prefix_matching():
    r = _router()
    r.add_worker("a", "both"), r.add_worker("b", "both")
    _stored(r, "a", PROMPT)
    d = r.route("q", block_hashes=[], num_prompt_tokens=40_000, now_s=0.0)
    assert d.overlap_blocks == 0 and d.uncached_tokens == 40_000 and d.num_prompt_blocks == 40_000 // BS
    assert r.workers[d.decode_worker].decode_blocks == 40_000 // BS


# -- suspended workers and learned entries of failed requests -----------------------------------------

def test_a_suspended_worker_keeps_its_index_entry_and_load_but_is_never_chosen():
    r = _router()
    r.add_worker("a", "both"), r.add_worker("b", "both")
    _stored(r, "a", PROMPT)
    r.route("x", token_ids=PROMPT, now_s=0.0)
    assert r.suspend_worker("a") == ["x"] and r.suspend_worker("a") == []
    assert all(r.route(f"q{i}", token_ids=PROMPT, now_s=0.0).decode_worker == "b" for i in range(5))
    assert r.overlaps(r.hashes_for(PROMPT))["a"] == 64
    assert r.on_complete("x") and r.workers["a"].decode_blocks == 0  # its load is released as usual
    assert r.resume_worker("a") and not r.resume_worker("a")
    assert r.route("back", token_ids=PROMPT, now_s=0.0).decode_worker == "a"


def test_only_suspended_decoders_means_no_workers():
    r = _router()
    r.add_worker("a", "both")
    r.suspend_worker("a")
    with pytest.raises(NoWorkersError):
        r.route("q", token_ids=PROMPT, now_s=0.0)


def test_a_request_failed_before_its_first_token_unlearns_only_its_own_blocks():
    r = _router()
    r.add_worker("a", "both", kv_events=False)
    shared = PROMPT[: 16 * BS]
    r.route("ok", token_ids=shared, now_s=0.0)
    r.on_first_token("ok")
    r.on_complete("ok")
    r.route("bad", token_ids=PROMPT, now_s=1.0)
    assert r.index.num_blocks("a") == 64
    r.on_complete("bad", ok=False)
    assert r.index.num_blocks("a") == 16
    r.route("late", token_ids=PROMPT, now_s=2.0)
    r.on_first_token("late")
    r.on_complete("late", ok=False)  # failed after its prefill: the worker did compute the blocks
    assert r.index.num_blocks("a") == 64


def test_a_failed_remote_prefill_is_unlearned_on_the_prefill_worker_and_learned_on_the_decoder():
    r = _router(disagg_min_uncached_tokens=0)
    r.add_worker("p", "prefill", kv_events=False), r.add_worker("d", "decode", kv_events=False)
    assert r.route("q", token_ids=PROMPT, now_s=0.0).prefill_worker == "p"
    assert r.index.num_blocks("p") == 64
    r.fallback_local_prefill("q", now_s=1.0)
    assert r.index.num_blocks("p") == 0 and r.index.num_blocks("d") == 64


def test_a_salted_request_migrates_to_the_worker_holding_its_salted_blocks():
    r = _router(migration_limit=2)
    for w in ("a", "b", "c"):
        r.add_worker(w, "both")
    n = 48
    for w in ("a", "b"):  # both hold the prompt cached under the tenant's salt
        r.apply_kv_events(w, [BlockStored(tuple(range(n)), None, tuple(PROMPT[: n * BS]), BS,
                                          extra_keys=(("s3cret",),) + (None,) * (n - 1))], 0.0)
    first = r.route("q", token_ids=PROMPT, now_s=0.0, cache_salt="s3cret")
    assert first.decode_worker in ("a", "b") and first.overlap_blocks == n
    moved = r.migrate("q", now_s=1.0, token_ids=PROMPT + [9] * 20, cache_salt="s3cret")
    assert moved.decode_worker == ({"a", "b"} - {first.decode_worker}).pop() and moved.overlap_blocks == n


def test_a_failed_prefill_whose_decode_worker_left_the_pool_goes_to_another_decode_worker():
    r = _router(disagg_min_uncached_tokens=0, migration_limit=0)
    for w, role in (("p", "prefill"), ("d0", "decode"), ("d1", "decode")):
        r.add_worker(w, role)
    first = r.route("q", token_ids=PROMPT, now_s=0.0)
    assert first.prefill_worker == "p"
    r.remove_worker(first.decode_worker)  # discovery or a scale-down while the prefill runs
    d = r.fallback_local_prefill("q", now_s=1.0)  # no migration counted: the limit of 0 does not refuse it
    other = ({"d0", "d1"} - {first.decode_worker}).pop()
    assert (d.prefill_worker, d.decode_worker, d.reason) == (None, other, "local_prefill_failed")
    assert r.workers[other].prefill_tokens == 1024 and r.workers[other].engine_requests == 1
    assert r.workers["p"].num_requests == 0 and r.workers["p"].prefill_tokens == 0
    r.on_complete("q")
    assert all((w.num_requests, w.engine_requests, w.prefill_tokens, w.decode_blocks) == (0, 0, 0, 0)
               for w in r.workers.values())
    r.route("q2", token_ids=PROMPT, now_s=2.0)
    r.remove_worker(other)
    with pytest.raises(NoWorkersError):  # none left: the request is freed
        r.fallback_local_prefill("q2", now_s=3.0)
    with pytest.raises(UnknownRequestError):
        r.in_flight("q2")


def test_prompts_shorter_than_a_block_still_spread_over_the_decode_workers():
    # a decoding request holds at least one KV block whatever its prompt; counted as none, requests of prompts
    # under a block tied on every decode worker and all went to the one that had prefilled least so far (one
    # local prefill, e.g. a migration, tipped every later tie away from its worker)
    r = _router(disagg_min_uncached_tokens=0)
    r.add_worker("p", "prefill")
    r.add_worker("d0", "decode")
    r.add_worker("d1", "decode")
    r.workers["d0"].total_prefill_work = 40.0  # what one local prefill on d0 left behind
    chosen = [r.route(f"q{i}", token_ids=[7, 8, 9], now_s=0.0).decode_worker for i in range(20)]
    assert sorted((chosen.count("d0"), chosen.count("d1"))) == [10, 10], chosen
    for i in range(20):
        r.on_complete(f"q{i}")
    assert all(w.decode_blocks == 0 and w.num_requests == 0 for w in r.workers.values())
