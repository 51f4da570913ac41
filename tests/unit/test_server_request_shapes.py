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
    num_choices,
    refusal,
    remap_chunk,
    response_id,
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


def test_an_empty_item_of_a_prompt_list_goes_as_a_list_of_one():
    # vLLM's request model refuses `prompt: ""` itself; as an item of a list it is tokenized (a BOS token, or the
    # engine's "The decoder prompt cannot be empty"), so a sub-request keeps it in a list of one
    subs = fan_out(C, {"prompt": ["", "a", [], [5]]})
    assert [s["prompt"] for s in subs] == [[""], "a", [[]], [5]]


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
    out = remap_chunk({"id": "b", "created": 9, "choices": [{"index": 0, "text": "t"}]}, 1, "a", 7)
    assert out == {"id": "a", "created": 7, "choices": [{"index": 1, "text": "t"}]}  # one creation time


def test_merge_answers_refuses_a_sub_answer_that_is_not_one_choice():
    one = {"id": "a", "choices": [{"index": 0, "text": "x"}]}
    two = {"id": "b", "choices": [{"index": 0, "text": "y"}, {"index": 1, "text": "z"}]}
    with pytest.raises(ValueError, match="sub-answer 1 holds 2 choices"):
        merge_answers([one, two])
    with pytest.raises(ValueError, match="sub-answer 0 holds 0 choices"):
        merge_answers([{"id": "a", "choices": []}, one])


def test_merged_answers_carry_no_single_requests_engine_metrics():
    answers = [{"id": "a", "metrics": {"ttft_s": 0.1}, "choices": [{"index": 0, "text": t}]} for t in "xy"]
    assert merge_answers(answers)["metrics"] is None  # vLLM reports none for several prompts or choices


@pytest.mark.parametrize(("body", "fans_out"), [
    ({"seed": 5, "n": 3}, True), ({"seed": -1, "n": 3}, True), ({"seed": -5, "n": 3}, True),
    ({"seed": 2**63 - 3, "n": 3}, True),
    # a choice's seed would be -1 ("no seed" in a request, a real seed in vLLM's parallel sampling)
    ({"seed": -2, "n": 3}, False), ({"seed": -3, "n": 3}, False),
    ({"seed": 2**63 - 2, "n": 3}, False),  # past the largest seed a request may carry
])
def test_seeded_choices_fan_out_only_when_every_seed_is_a_requests_seed(body, fans_out):
    subs = fan_out(C, {"prompt": "a", "temperature": 1, **body})
    assert (subs is not None) is fans_out
    if subs is not None and body["seed"] != -1:
        assert [s["seed"] for s in subs] == [body["seed"] + j for j in range(body["n"])]


def test_response_id_is_the_clients_request_id():
    assert response_id(C, {"request_id": "r1"}) == "cmpl-r1"
    assert response_id(CHAT, {"request_id": "r1"}) == "chatcmpl-r1"
    assert response_id(C, {}) is None and response_id(C, {"request_id": None}) is None
    assert response_id(C, {"request_id": ""}) == "cmpl-"  # as vLLM: an empty id is the client's id


@pytest.mark.parametrize(("body", "choices"), [
    ({"prompt": "a", "n": 2}, 2), ({"prompt": ["a", "b"], "n": 3}, 6), ({"prompt_embeds": "ZW1i"}, 1),
    ({"prompt_embeds": ["ZW1i", "ZW1j"], "n": 2}, 4),
    ({"prompt_embeds": ["ZW1i"], "prompt": ["a", "b"]}, 3),  # vLLM: the embeddings, then the prompts
])
def test_num_choices_counts_every_prompt_and_embedding(body, choices):
    assert num_choices(C, body) == choices


@pytest.mark.parametrize(("path", "body", "local"), [
    (C, {"prompt": "a", "echo": True, "logprobs": 0}, True), (C, {"prompt": "a", "echo": True}, False),
    (C, {"prompt": "a", "logprobs": 2}, False), (C, {"prompt": "a", "prompt_logprobs": 1}, True),
    (CHAT, {"messages": [], "prompt_logprobs": 0}, True), (C, {"prompt": "a", "use_beam_search": True}, True),
    # chat echo asks vLLM for prompt log-probabilities (top_logprobs, default 0) unless top_logprobs is null
    (CHAT, {"messages": [], "echo": True}, True), (CHAT, {"messages": [], "echo": True, "top_logprobs": None}, False),
    (CHAT, {"messages": [], "echo": False}, False),
    # prompt embeddings: nothing to split or count per prompt; the decode worker takes them whole
    (C, {"prompt_embeds": ["ZW1i", "ZW1j"]}, True), (C, {"prompt_embeds": None, "prompt": "a"}, False),
])
def test_shapes_that_need_the_prompt_computed_locally(path, body, local):
    assert needs_local_prefill(path, body) is local


@pytest.mark.parametrize(("path", "body", "param"), [
    # vLLM 0.28's request models have no best_of and ignore unknown fields: any value is served as vLLM serves it
    (C, {"prompt": "a", "best_of": 2}, None), (C, {"prompt": "a", "best_of": 1}, None),
    (C, {"prompt": "a", "best_of": "2"}, None), (C, {"prompt": "a", "best_of": 2.0}, None),
    (C, {"prompt": "a", "best_of": "many"}, None), (C, {"prompt": "a", "best_of": True}, None),
    (C, {"prompt": "a", "suffix": "z"}, "suffix"), (C, {"prompt": "a", "suffix": ""}, None),
    (CHAT, {"messages": [], "best_of": 3}, None), (CHAT, {"messages": [], "n": 2, "temperature": 0}, "n"),
    (CHAT, {"messages": [], "n": 2, "temperature": 0.5}, None), (CHAT, {"messages": [], "n": 2}, None),
    (C, {"prompt": "a", "n": 2, "temperature": 0, "use_beam_search": True}, None),  # n beams: vLLM serves it
    # vLLM raises a temperature in (0, 0.01) to 0.01 (sampling, served); only 0 is greedy
    (C, {"prompt": "a", "n": 2, "temperature": 1e-6}, None), (C, {"prompt": "a", "n": 2, "temperature": 0.0}, "n"),
])
def test_refusals_name_the_field(path, body, param):
    got = refusal(path, body)
    assert (got and got[1]) == (param or None)
