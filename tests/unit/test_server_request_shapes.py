"""runtime.server.shapes: which request shapes fan out, run with local prefill or are refused, and how the
fanned-out answers merge back in vLLM's choice order."""

from __future__ import annotations

import pytest

from runtime.server.shapes import (
    MAX_FAN_OUT,
    add_usage,
    fan_out,
    merge_answers,
    needs_local_prefill,
    refusal,
    remap_chunk,
    sum_usage,
)

C, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize(("path", "body"), [
    (C, {"prompt": "a"}), (C, {"prompt": ["a"]}), (C, {"prompt": [1, 2, 3]}), (C, {"prompt": [[1, 2]]}),
    (C, {"prompt": "a", "n": 1}), (CHAT, {"messages": [], "n": 1}),
    # no handoff (local prefill): the decode worker serves the whole request, as the aggregated server does
    (C, {"prompt": ["a", "b"], "n": 2, "prompt_logprobs": 1}), (C, {"prompt": "a", "n": 3, "use_beam_search": True}),
    (CHAT, {"messages": [], "n": 2, "echo": True}),
    # more than MAX_FAN_OUT requests: served whole with local prefill, not as that many handoffs
    (C, {"prompt": "a", "n": MAX_FAN_OUT + 1, "temperature": 1}),
    (C, {"prompt": ["a"] * 3, "n": MAX_FAN_OUT // 2, "temperature": 1}),
    (CHAT, {"messages": [], "n": 20000, "temperature": 1}),
])
def test_one_prompt_one_choice_is_served_whole(path, body):
    assert fan_out(path, body) is None


def test_prompts_and_choices_fan_out_prompt_major_with_seeds_per_choice():
    subs = fan_out(C, {"prompt": ["a", [5, 6]], "n": 2, "seed": 7, "stream": True})
    assert [(s["prompt"], s["n"], s["seed"]) for s in subs] == [("a", 1, 7), ("a", 1, 8), ([5, 6], 1, 7),
                                                               ([5, 6], 1, 8)]
    assert all(s["stream_options"]["include_usage"] for s in subs)
    chat = fan_out(CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 3})
    assert len(chat) == 3 and all("seed" not in s and s["n"] == 1 for s in chat)


def test_fan_out_up_to_the_bound_and_seed_minus_one_stays_unseeded():
    assert len(fan_out(C, {"prompt": "a", "n": MAX_FAN_OUT, "temperature": 1})) == MAX_FAN_OUT
    assert needs_local_prefill(C, {"prompt": "a", "n": MAX_FAN_OUT + 1, "temperature": 1})
    # vLLM reads seed -1 as no seed: every choice samples unseeded, none gets seed 0, 1, ...
    assert [s["seed"] for s in fan_out(C, {"prompt": "a", "n": 3, "seed": -1})] == [-1, -1, -1]


def test_merge_answers_reindexes_choices_and_sums_usage():
    answers = [{"id": f"c{i}", "choices": [{"index": 0, "text": t}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
               for i, t in enumerate(["x", "y", "z"])]
    merged = merge_answers(answers)
    assert merged["id"] == "c0"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "x"), (1, "y"), (2, "z")]
    assert merged["usage"] == {"prompt_tokens": 6, "completion_tokens": 9, "total_tokens": 15}
    assert add_usage(None, None) is None
    # n=3 choices of one prompt: the prompt is counted once, as vLLM counts it
    assert merge_answers(answers, n=3)["usage"] == {"prompt_tokens": 2, "completion_tokens": 9, "total_tokens": 11}


def _usage(prompt: int, completion: int, cached: int | None, reasoning: int | None, **mm: int) -> dict:
    prompt_details = None if cached is None else {"cached_tokens": cached, **({"multimodal_tokens": mm} if mm else {})}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": prompt_details,
            "completion_tokens_details": None if reasoning is None else {"reasoning_tokens": reasoning}}


def test_usage_details_sum_each_prompts_once_and_every_choices():
    # 2 prompts x n=2: prompt details of each prompt's first choice, completion details of all four choices
    usages = [_usage(8, 3, 4, 1, image=2), _usage(8, 5, 8, 2, image=2), _usage(6, 2, 0, 0, audio=3),
              _usage(6, 4, 6, 3, audio=3)]
    assert sum_usage(usages, 2) == {
        "prompt_tokens": 14, "completion_tokens": 14, "total_tokens": 28,
        "prompt_tokens_details": {"cached_tokens": 4, "multimodal_tokens": {"image": 2, "audio": 3}},
        "completion_tokens_details": {"reasoning_tokens": 6}}
    # 4 prompts, one choice each: every prompt's details count
    assert sum_usage(usages, 1)["prompt_tokens_details"] == {"cached_tokens": 18,
                                                             "multimodal_tokens": {"image": 4, "audio": 6}}
    # a part without details counts nothing; the others still sum
    assert sum_usage([_usage(8, 3, None, None), _usage(6, 2, 5, 1)], 1)["prompt_tokens_details"] == {
        "cached_tokens": 5}
    # null in every part stays null (vLLM's non-streaming answer), absent stays absent (its final stream chunk)
    merged = sum_usage([_usage(8, 3, None, None), _usage(8, 2, None, None)], 2)
    assert merged["prompt_tokens_details"] is None and merged["completion_tokens_details"] is None
    bare = sum_usage([{"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}] * 2, 2)
    assert bare == {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14}
    # summing leaves the parts as they were
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 4, "multimodal_tokens": {"image": 2}}


def test_remap_chunk_sets_index_and_id():
    out = remap_chunk({"id": "b", "choices": [{"index": 0, "text": "t"}]}, 3, "a")
    assert out == {"id": "a", "choices": [{"index": 3, "text": "t"}]}


@pytest.mark.parametrize(("path", "body", "local"), [
    (C, {"prompt": "a", "echo": True, "logprobs": 0}, True), (C, {"prompt": "a", "echo": True}, False),
    (C, {"prompt": "a", "logprobs": 2}, False), (C, {"prompt": "a", "prompt_logprobs": 1}, True),
    (CHAT, {"messages": [], "prompt_logprobs": 0}, True), (C, {"prompt": "a", "use_beam_search": True}, True),
    # chat echo asks vLLM for prompt log-probabilities (top_logprobs, default 0) unless top_logprobs is null
    (CHAT, {"messages": [], "echo": True}, True), (CHAT, {"messages": [], "echo": True, "top_logprobs": None}, False),
    (CHAT, {"messages": [], "echo": False}, False),
])
def test_shapes_that_need_the_prompt_computed_locally(path, body, local):
    assert needs_local_prefill(path, body) is local


@pytest.mark.parametrize(("path", "body", "param"), [
    (C, {"prompt": "a", "best_of": 2}, "best_of"), (C, {"prompt": "a", "best_of": 1}, None),
    # read as a lax int, as a client library may send it: 1 in any spelling is served, 2 in any is refused
    (C, {"prompt": "a", "best_of": "1"}, None), (C, {"prompt": "a", "best_of": 1.0}, None),
    (C, {"prompt": "a", "best_of": "2"}, "best_of"), (C, {"prompt": "a", "best_of": 2.0}, "best_of"),
    (C, {"prompt": "a", "best_of": "many"}, "best_of"), (C, {"prompt": "a", "best_of": True}, "best_of"),
    (C, {"prompt": "a", "suffix": "z"}, "suffix"), (C, {"prompt": "a", "suffix": ""}, None),
    (CHAT, {"messages": [], "best_of": 3}, "best_of"), (CHAT, {"messages": [], "n": 2, "temperature": 0}, "n"),
    (CHAT, {"messages": [], "n": 2, "temperature": 0.5}, None), (CHAT, {"messages": [], "n": 2}, None),
    (C, {"prompt": "a", "n": 2, "temperature": 0, "use_beam_search": True}, None),  # n beams: vLLM serves it
    # vLLM raises a temperature in (0, 0.01) to 0.01 (sampling, served); only 0 is greedy
    (C, {"prompt": "a", "n": 2, "temperature": 1e-6}, None), (C, {"prompt": "a", "n": 2, "temperature": 0.0}, "n"),
])
def test_refusals_name_the_field(path, body, param):
    got = refusal(path, body)
    assert (got and got[1]) == (param or None)
