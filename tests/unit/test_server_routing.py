"""Runtime side of the KV-aware router (runtime.server.routing.RouterPairing) over the real pure Router.

Specification: routes name only configured workers (ids and URLs from configuration); a worker whose KV
events say it holds the prompt's prefix gets the request, with the predicted overlap; short uncached prompts
are prefilled locally; a failed prefill turns into a local prefill on the same decode worker; a worker marked
down is not chosen but keeps its index entry, which it has again when marked up (only removal drops it); a
prompt the runtime could not tokenize is routed and charged by its estimated length; learned (approximate)
entries are bounded per worker and a prompt the worker rejected before its first token is not learned.
"""

from __future__ import annotations

import pytest

from runtime.config import RouterSpec
from runtime.kv.events import BlockStored, KvEventBatch
from runtime.server.pairing import RouteRequest
from runtime.server.routing import RouterPairing, WorkerEndpoint, estimate_prompt_tokens

BS = 16


def _pairing(roles=("both", "both"), **spec_kw) -> RouterPairing:
    workers = [WorkerEndpoint(f"w{i}", role, f"http://127.0.0.1:{9000 + i}", f"tcp://127.0.0.1:{5000 + i}")
               for i, role in enumerate(roles)]
    return RouterPairing(RouterSpec(**spec_kw), BS, workers, clock=lambda: 0.0)


def _stored(tokens: list[int]) -> KvEventBatch:
    n = len(tokens) // BS
    return KvEventBatch(ts_s=0.0, events=(BlockStored(tuple(range(100, 100 + n)), None, tuple(tokens[: n * BS]), BS),))


def _req(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(rid, "/v1/completions", {"prompt": "ignored"}, tokens, 0.0)


PROMPT = list(range(1000, 1000 + 10 * BS + 5))


def test_request_goes_to_the_worker_whose_events_hold_its_prefix():
    p = _pairing()
    p.apply_batch("w1", _stored(PROMPT))
    r = p.choose(_req("a", PROMPT))
    assert r.decode_worker == "w1"
    assert r.decode_url == "http://127.0.0.1:9001"
    assert r.prefill_url is None  # aggregated pool: local prefill
    assert r.overlap_blocks == 10


def test_routes_only_name_configured_workers():
    p = _pairing()
    urls = {w.url for w in p.workers.values()}
    for i in range(20):
        r = p.choose(_req(f"r{i}", [i] * 40))
        assert r.decode_url in urls and r.decode_worker in p.workers
        p.on_complete(f"r{i}", 0.0, True)


def test_long_uncached_prompt_is_prefilled_remotely_short_one_locally():
    p = _pairing(roles=("prefill", "decode"), disagg_min_uncached_tokens=64)
    long_r = p.choose(_req("long", PROMPT))
    assert long_r.prefill_worker == "w0" and long_r.prefill_url == "http://127.0.0.1:9000"
    assert long_r.reason == "remote"
    short_r = p.choose(_req("short", PROMPT[:20]))
    assert short_r.prefill_url is None and short_r.reason == "local_short"


def test_failed_prefill_becomes_local_prefill_on_the_same_decode_worker():
    p = _pairing(roles=("prefill", "decode"), disagg_min_uncached_tokens=0)
    first = p.choose(_req("a", PROMPT))
    fb = p.on_prefill_failed("a", 0.0)
    assert fb.prefill_url is None and fb.decode_worker == first.decode_worker
    assert fb.reason == "local_prefill_failed"


def test_down_worker_is_not_chosen_and_comes_back_with_its_index_entry():
    p = _pairing()
    p.apply_batch("w1", _stored(PROMPT))
    cached = p.router.overlaps(p.router.hashes_for(PROMPT))["w1"]
    p.mark_down("http://127.0.0.1:9001/")
    for i in range(5):
        assert p.choose(_req(f"d{i}", PROMPT)).decode_worker == "w0"
    p.mark_up("http://127.0.0.1:9001")
    assert "w1" in p.router.workers
    # one missed health check is no restart: the cache it still holds stays indexed and attracts the prompt
    assert p.router.overlaps(p.router.hashes_for(PROMPT))["w1"] == cached
    assert p.choose(_req("back", PROMPT)).decode_worker == "w1"


def test_blocks_chained_on_a_kept_entry_apply_after_down_up():
    p = _pairing()
    p.apply_batch("w1", _stored(PROMPT))
    p.mark_down("http://127.0.0.1:9001")
    p.mark_up("http://127.0.0.1:9001")
    n = len(PROMPT) // BS
    nxt = list(range(5000, 5000 + BS))
    ev = BlockStored((10_000,), n - 1 + 100, tuple(nxt), BS)  # parent = the last engine hash of _stored
    p.apply_batch("w1", KvEventBatch(1.0, (ev,)))
    assert p.router.overlaps(p.router.hashes_for(PROMPT[: n * BS] + nxt))["w1"] == n + 1


def test_removed_worker_loses_its_index_entry():
    p = _pairing()
    p.apply_batch("w1", _stored(PROMPT))
    p.remove_worker("w1")
    assert "w1" not in p.router.workers
    assert p.router.overlaps(p.router.hashes_for(PROMPT)) == {}


def test_unknown_url_is_ignored_by_health_marks():
    p = _pairing()
    assert p.mark_down("http://203.0.113.1:1") == []
    assert set(p.router.workers) == {"w0", "w1"}


def test_kv_event_endpoints_come_from_configuration():
    assert _pairing().kv_event_endpoints() == {"w0": "tcp://127.0.0.1:5000", "w1": "tcp://127.0.0.1:5001"}


def test_duplicate_worker_ids_are_rejected():
    with pytest.raises(ValueError):
        RouterPairing(RouterSpec(), BS, [WorkerEndpoint("w", "both", "http://a"), WorkerEndpoint("w", "both", "http://b")])


def test_workers_added_and_removed_at_run_time_join_and_leave_the_pool():
    p = _pairing(roles=("both",))
    p.add_worker(WorkerEndpoint("w9", "both", "http://127.0.0.1:9009"))
    assert set(p.router.workers) == {"w0", "w9"}
    with pytest.raises(ValueError):
        p.add_worker(WorkerEndpoint("w10", "both", "http://127.0.0.1:9009/"))
    p.remove_worker("w0")
    for i in range(3):
        assert p.choose(_req(f"r{i}", PROMPT)).decode_url == "http://127.0.0.1:9009"
    assert p.remove_worker("nope") == []


def test_prefill_worker_found_dead_mid_request_falls_back_locally():
    p = _pairing(roles=("prefill", "decode"), disagg_min_uncached_tokens=0)
    r = p.choose(_req("a", PROMPT))
    assert r.prefill_worker == "w0"
    p.mark_down(r.prefill_url)
    fb = p.on_prefill_failed("a", 0.0)
    assert fb.prefill_url is None and fb.decode_worker == "w1"
    p.on_complete("a", 0.0, True)
    nxt = p.choose(_req("b", PROMPT))
    assert nxt.prefill_url is None  # no prefill pool left: local
    assert p.on_decode_failed("b", 0.0) is None  # no other decode worker to migrate to


# -- prompts the runtime could not tokenize ----------------------------------------------------------

@pytest.mark.parametrize("body, tokens", [
    ({"prompt": "word " * 2000}, 2500),                            # 10,000 chars / 4
    ({"prompt": ["word " * 2000, "word " * 2000]}, 5000),          # a batch: both prompts count
    ({"prompt": [7] * 300}, 300),                                   # token ids
    ({"prompt": [[7] * 300, [8] * 200]}, 500),                      # a batch of token-id lists
    ({"messages": [{"role": "user", "content": "abcd" * 100},
                                 {"role": "user",
                    "content": [{"type": "text", "text": "abcd" * 50}, {"type": "image_url"}]}]},
     150),
    ({"prompt": {"weird": 1}, "messages": "no"}, 0),                 # nonsense: 0, never raises
])
def test_prompt_length_estimate(body, tokens):
    assert estimate_prompt_tokens(body) == tokens


def test_untokenizable_batch_is_charged_its_estimated_length_and_prefilled_remotely():
    p = _pairing(roles=("prefill", "decode"))
    big = "word " * 20000  # ~25,000 tokens each
    r = p.choose(RouteRequest("batch", "/v1/completions", {"prompt": [big, big]}, None, 0.0))
    assert r.reason == "remote" and r.prefill_worker == "w0"  # not local_short as a 0-token prompt would be
    assert r.overlap_blocks == 0
    loads = p.router.workers
    assert loads["w0"].prefill_tokens == 50_000
    assert loads["w1"].decode_blocks == 50_000 // BS
    p.on_complete("batch", 1.0, False)
    assert loads["w0"].prefill_tokens == 0 and loads["w1"].decode_blocks == 0


def test_untokenizable_prompt_gets_no_prefix_match():
    p = _pairing()
    p.apply_batch("w1", _stored(PROMPT))
    p.router.workers["w1"].prefill_work = -1e9  # w1 would win on load alone; the overlap must stay 0
    r = p.choose(RouteRequest("x", "/v1/completions", {"prompt": "text " * 100}, None, 0.0))
    assert r.overlap_blocks == 0


# -- approximate (no KV events) entries --------------------------------------------------------------

def _approx_pairing(**kw) -> RouterPairing:
    return RouterPairing(RouterSpec(), BS, [WorkerEndpoint("d", "decode", "http://127.0.0.1:9100")],
                         clock=lambda: 0.0, **kw)


def test_learned_entries_are_bounded_per_worker():
    p = _approx_pairing(approx_capacity_tokens=1000 * BS)
    for i in range(5):
        p.choose(_req(f"r{i}", list(range(i * 10**6, i * 10**6 + 600 * BS))))
        p.on_complete(f"r{i}", 0.0, True)
    assert p.router.index.num_blocks("d") == 1000


def test_learned_entries_are_bounded_by_default():
    from runtime.server.routing import DEFAULT_APPROX_CAPACITY_TOKENS

    p = _approx_pairing()
    for i in range(3):
        p.choose(_req(f"r{i}", list(range(i * 10**7, i * 10**7 + 50_000 * BS))))
        p.on_first_token(f"r{i}", 0.0)
        p.on_complete(f"r{i}", 0.0, True)
    assert p.router.index.num_blocks("d") <= DEFAULT_APPROX_CAPACITY_TOKENS // BS


def test_prompt_failed_before_its_first_token_is_not_learned():
    p = _approx_pairing()
    shared = list(range(1000, 1000 + 20 * BS))
    p.choose(_req("ok", shared))
    p.on_first_token("ok", 0.0)
    p.on_complete("ok", 0.0, True)
    p.choose(_req("rejected", shared + list(range(9000, 9000 + 30 * BS))))
    p.on_complete("rejected", 0.0, False)
    # the prefix the successful request taught stays; the rejected request's own blocks are forgotten
    assert p.router.index.num_blocks("d") == 20
    assert p.router.overlaps(p.router.hashes_for(shared))["d"] == 20


def _stored_salted(tokens: list[int], salt: str) -> KvEventBatch:
    """A BlockStored as vLLM 0.28 reports a salted prompt: the salt in block 0's extra keys only."""
    n = len(tokens) // BS
    extra = ((salt,),) + (None,) * (n - 1)
    return KvEventBatch(ts_s=0.0, events=(BlockStored(tuple(range(100, 100 + n)), None, tuple(tokens[: n * BS]), BS,
                                                      extra_keys=extra),))


def _salted_req(rid: str, tokens: list[int], salt: object) -> RouteRequest:
    return RouteRequest(rid, "/v1/completions", {"prompt": "ignored", "cache_salt": salt}, tokens, 0.0)


def test_a_salted_request_matches_the_blocks_cached_under_its_salt_only():
    p = _pairing()
    p.apply_batch("w0", _stored(PROMPT))  # another tenant's unsalted copy
    p.apply_batch("w1", _stored_salted(PROMPT, "tenant-a"))
    r = p.choose(_salted_req("a", PROMPT, "tenant-a"))
    assert (r.decode_worker, r.overlap_blocks) == ("w1", 10)
    p.on_complete("a", 0.0, True)
    other = p.choose(_salted_req("b", PROMPT, "tenant-b"))  # vLLM would reuse none of either copy
    assert other.overlap_blocks == 0
    p.on_complete("b", 0.0, True)
    plain = p.choose(_req("c", PROMPT))
    assert (plain.decode_worker, plain.overlap_blocks) == ("w0", 10)


@pytest.mark.parametrize("salt", ["", None, 7, ["tenant-a"]])
def test_a_cache_salt_vllm_would_refuse_is_not_hashed(salt):
    # vLLM answers 400 for these (cache_salt: a non-empty string); routing falls back to plain hashes
    p = _pairing()
    p.apply_batch("w1", _stored(PROMPT))
    r = p.choose(_salted_req("a", PROMPT, salt))
    assert (r.decode_worker, r.overlap_blocks) == ("w1", 10)
