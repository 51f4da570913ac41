"""A migrated stream is the uninterrupted answer, or it is refused (runtime.server.migration + PDModel).

Specification: a stream whose decode worker dies mid-answer and continues on another worker gives the client
exactly what one uninterrupted worker would have sent (text, completion `logprobs.text_offset`, `token_ids`,
the prompt's `prompt_token_ids` once); a request whose sampling reads the output so far in a way a continuation
cannot reproduce (penalties over output tokens, bad words, multi-character stop strings vLLM holds text back
for, a prompt truncation, a chat rendered without a generation prompt) is not continued: the stream ends with
an OpenAI error event that says why, then `data: [DONE]`, and no other worker is asked.
Workers are faked at the HTTP transport, as vLLM 0.28 streams (continuous usage on every chunk).
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from runtime.server.migration import NotContinuable, continuation_body, continuation_chunk

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


# --- the continuation request: exact, or refused with a reason ---------------------------------------------

@pytest.mark.parametrize("extra, why", [
    ({"frequency_penalty": 1.5}, "frequency_penalty"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"frequency_penalty": "0.5"}, "frequency_penalty"),  # vLLM reads a numeric string as the number
    ({"bad_words": ["owl"]}, "bad_words"),
    ({"thinking_token_budget": 10}, "thinking_token_budget"),
    ({"repetition_detection": {"max_pattern_size": 4, "min_count": 3}}, "repetition_detection"),
    ({"use_beam_search": True}, "beam search"),
    ({"vllm_xargs": {"ngram_size": 3}}, "vllm_xargs"),
    ({"stop": ["owl ."]}, "stop strings of more than one character"),
    ({"stop": "the end", "include_stop_str_in_output": "false"}, "stop strings of more than one character"),
    ({"stop": ["wise old"], "include_stop_str_in_output": True}, "beginning of a stop string"),
    ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),   # the prompt had 4 tokens: it may have been cut
    ({"truncate_prompt_tokens": -1}, "truncate_prompt_tokens"),  # cut to the context left: not known here
    ({"seed": 7, "temperature": 0.8}, "seed with sampling"),  # the random state stays on the first worker
    ({"seed": 7}, "seed with sampling"),  # temperature unset: vLLM's default samples
])
def test_sampling_that_reads_the_output_so_far_is_refused_with_its_reason(extra, why):
    body = {"prompt": "Once upon a time", "max_tokens": 10, **extra}
    with pytest.raises(NotContinuable, match=why):
        continuation_body(COMPL, body, " there lived a wise", 4, prompt_tokens=4)


@pytest.mark.parametrize("extra", [
    {"repetition_penalty": 1.3},  # vLLM penalizes prompt and output tokens alike: the continuation's prompt holds both
    {"frequency_penalty": 0, "presence_penalty": 0.0, "bad_words": [], "vllm_xargs": {}},
    {"temperature": 0, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "logit_bias": {"5": 2.0}, "stop_token_ids": [7]},
    {"seed": 7, "temperature": 0},  # greedy: the seed draws nothing
    {"stop": ["."]},  # one character: vLLM holds nothing back
    {"stop": ["the end"], "include_stop_str_in_output": True},  # streamed whole; the text sent ends no prefix
])
def test_sampling_a_continuation_reproduces_is_continued(extra):
    body = {"prompt": "Once upon a time", "max_tokens": 10, **extra}
    out = continuation_body(COMPL, body, " there lived a wise", 4, prompt_tokens=4)
    assert out["prompt"] == "Once upon a time there lived a wise" and out["max_tokens"] == 6
    assert {k: out[k] for k in extra} == extra


@pytest.mark.parametrize("extra", [
    {"stop": ["\n\nUser:"]}, {"seed": 3, "temperature": 0.7}, {"frequency_penalty": 1.0},
    {"response_format": {"type": "json_object"}},
])
def test_a_stream_that_sent_nothing_generated_goes_whole_whatever_its_sampling(extra):
    # a role chunk or empty chunks (vLLM holding text back) were all the client got: the request itself is exact
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, **extra}
    assert continuation_body(CHAT, body, "", 0) == body
    with pytest.raises(NotContinuable):  # once something generated was sent, the refusals apply
        continuation_body(CHAT, body, "Hel", 1)


def test_hidden_reasoning_is_refused():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "include_reasoning": False}
    with pytest.raises(NotContinuable, match="include_reasoning"):
        continuation_body(CHAT, body, "Hello", 1)
    assert continuation_body(CHAT, {**body, "include_reasoning": True}, "Hello", 1)["max_tokens"] == 9


def test_a_prompt_shorter_than_its_truncation_continues_untruncated():
    body = {"prompt": "Once upon a time", "max_tokens": 10, "truncate_prompt_tokens": 5, "truncation_side": "left"}
    out = continuation_body(COMPL, body, " there", 1, prompt_tokens=4)
    # nothing was cut (4 < 5): the continuation (prompt + text sent, 5 tokens) must not be cut either
    assert "truncate_prompt_tokens" not in out and "truncation_side" not in out
    with pytest.raises(NotContinuable, match="truncate_prompt_tokens"):  # no usage: the prompt's size unknown
        continuation_body(COMPL, body, " there", 1, prompt_tokens=None)


def test_a_chat_rendered_without_a_generation_prompt_is_refused():
    body = {"messages": [{"role": "user", "content": "The sea is"}], "add_generation_prompt": False, "max_tokens": 9}
    with pytest.raises(NotContinuable, match="add_generation_prompt"):
        continuation_body(CHAT, body, " blue", 1)
    # nothing sent yet: the request itself
    assert continuation_body(CHAT, body, "", 0)["messages"] == body["messages"]


def test_a_continued_final_message_goes_on_inside_it_whatever_its_role():
    body = {"messages": [{"role": "user", "content": "The sea is"}], "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 9}
    out = continuation_body(CHAT, body, " blue", 1)
    assert out["messages"] == [{"role": "user", "content": "The sea is blue"}]
    parts = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "The sea is"}]}]}
    with pytest.raises(NotContinuable, match="final message"):
        continuation_body(CHAT, parts, " blue", 1)


def test_a_continuation_chunk_drops_its_prompt_fields_and_shifts_its_text_offsets():
    chunk = {"id": "x", "prompt_token_ids": [1, 2], "choices": [
        {"index": 0, "text": " owl", "prompt_token_ids": [1, 2, 3], "token_ids": [9],
         "logprobs": {"text_offset": [0, 4], "tokens": [" o", "wl"]}}]}
    assert continuation_chunk(chunk, 20) is True
    # a choice's prompt ids become null, as vLLM writes them on a completions stream's later chunks
    assert chunk == {"id": "x", "choices": [{"index": 0, "text": " owl", "prompt_token_ids": None, "token_ids": [9],
                                             "logprobs": {"text_offset": [20, 24], "tokens": [" o", "wl"]}}]}
    plain = {"id": "x", "choices": [{"index": 0, "text": " owl"}]}
    assert continuation_chunk(plain, 20) is False and plain == {"id": "x", "choices": [{"index": 0, "text": " owl"}]}


def test_a_chat_continuation_as_a_completion_keeps_sampling_and_drops_what_rendered_the_prompt():
    from runtime.server.migration import chat_as_completion

    cont = continuation_body(CHAT, {
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "stream": True,
        "max_completion_tokens": 10, "max_tokens": 99, "temperature": 0, "top_k": 3, "stop": ["."],
        "chat_template_kwargs": {"x": 1}, "tools": [{"type": "function"}], "tool_choice": "none",
        "return_token_ids": True, "logprobs": False, "top_logprobs": 0, "include_reasoning": True}, "Hello", 2)
    out = chat_as_completion(cont, [1, 2, 3], None)
    assert out == {"model": "m", "stream": True, "temperature": 0, "top_k": 3, "stop": ["."],
                   "return_token_ids": True, "prompt": [1, 2, 3], "max_tokens": 8}  # max_completion_tokens first
    assert chat_as_completion({**cont, "max_completion_tokens": None, "max_tokens": None}, [1, 2, 3], 10)[
        "max_tokens"] == 7  # no budget: the context left


@pytest.mark.parametrize("extra, why", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "media"),
    ({"tools": [{"type": "function"}], "tool_choice": "auto"}, "tools"),
    ({"logprobs": "true", "top_logprobs": 0}, "logprobs"),
    ({"return_tokens_as_token_ids": True, "mm_hashes": ["a"]}, "mm_hashes, return_tokens_as_token_ids"),
    ({"max_tokens": None}, "context length is unknown"),
])
def test_a_chat_continuation_a_completion_would_change_is_refused_with_its_reason(extra, why):
    from runtime.server.migration import chat_as_completion

    cont = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    with pytest.raises(NotContinuable, match=why):
        chat_as_completion(cont, [1, 2], None)


def test_a_completion_chunk_is_written_as_vllms_chat_chunk():
    from runtime.server.migration import completion_as_chat_chunk

    usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
    token = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m", "choices": [
        {"index": 0, "text": " owl", "logprobs": None, "finish_reason": None, "stop_reason": None,
         "prompt_token_ids": [1, 2], "token_ids": [9]}], "usage": usage}
    out = completion_as_chat_chunk(token)
    assert list(out) == ["id", "object", "created", "model", "choices", "usage"]
    # a running usage as the chat stream writes it: completion_tokens_details set, null without details
    assert out["object"] == "chat.completion.chunk" and out["usage"] == {**usage, "completion_tokens_details": None}
    assert out["choices"] == [{"index": 0, "delta": {"content": " owl"}, "logprobs": None, "finish_reason": None,
                               "token_ids": [9]}]  # stop_reason only once finished, as vLLM sets it
    last = completion_as_chat_chunk({**token, "choices": [{**token["choices"][0], "text": "", "token_ids": None,
                                                            "finish_reason": "stop", "stop_reason": "."}]})
    assert last["choices"] == [{"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": "stop",
                                "stop_reason": ".", "token_ids": None}]
    final = completion_as_chat_chunk({**token, "choices": []})  # the usage-only chunk: vLLM drops nulls there
    assert final["choices"] == [] and final["usage"] == usage


# --- streams through PDModel: the migrated stream equals the uninterrupted one -------------------------------

pytest.importorskip("kserve")

from tests.model_streams import DyingStream as _DyingStream  # noqa: E402

PROMPT = "Once upon a time"
ANSWER = [" there", " lived", " a", " wisé", " old", " owl", "\n", "Who", " loved", " the", " moon", "."]


def _token_id(piece: str) -> int:
    return 1000 + sum(map(ord, piece))


REFERENCE_IDS = [_token_id(p) for p in ("Once", " upon", " a", " time", *ANSWER)]
_PIECES = {_token_id(p): p for p in ("Once", " upon", " a", " time", *ANSWER)}


def _tokenize(text: str) -> list[str]:
    """The stand-in's tokenizer: words with their leading space; a newline merges with the word after it (as
    BPE tokenizers merge "\n" and the next word: the answer made them two tokens, text re-read gives one)."""
    return re.findall(r"\n?[^\s]+|\s?[^\s]+|\n", text)




def _event(chunk: dict) -> bytes:
    # compact, as vLLM writes its chunks (pydantic's model_dump_json)
    return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class GreedyCompletions:
    """Completions workers that answer as vLLM 0.28 streams one greedy answer (`ANSWER`, one token a chunk): the
    answer goes on after whatever part of it the prompt's tokens already end with (a text prompt is tokenized by
    `_tokenize`, token ids are read as they are; tokens the answer never made end it: "?"); `logprobs.text_offset`
    counts the characters of the worker's own output; each choice has `prompt_token_ids` (the prompt's ids on
    the first chunk with `return_token_ids`, else null) and `token_ids` (each token's id with `return_token_ids`,
    else null; `ids` False: null always, as an engine that does not return ids). A worker named in `cuts` dies
    after that many chunks, `extra_d0` chunks sent after d0's last."""

    def __init__(self, cuts: dict[str, int] | None = None, extra_d0: list[dict] = (), ids: bool = True):
        self.cuts, self.extra_d0, self.ids = cuts or {}, list(extra_d0), ids
        self.bodies: dict[str, list[dict]] = {"d0": [], "d1": [], "d2": []}
        self.detokenized: dict[str, list[list[int]]] = {"d0": [], "d1": [], "d2": []}

    def handler(self, req: httpx.Request) -> httpx.Response:
        host, body = req.url.host, json.loads(req.content)
        if req.url.path == "/detokenize":  # an id it never made is a character's first bytes
            self.detokenized[host].append(body["tokens"])
            return httpx.Response(200, json={"prompt": "".join(_PIECES.get(t, "\ufffd") for t in body["tokens"])})
        self.bodies[host].append(body)
        prompt = body["prompt"]
        prompt_ids = prompt if isinstance(prompt, list) else [_token_id(p) for p in _tokenize(prompt)]
        done = next((i for i in range(len(ANSWER) + 1) if prompt_ids == REFERENCE_IDS[:4 + i]), None)
        # a prompt that is no prefix of the answer's tokens: greedy decoding goes elsewhere
        pieces = (ANSWER[done:] if done is not None else ["?"] * len(ANSWER))[:body["max_tokens"]]
        out, offset = [], 0
        for n, piece in enumerate(pieces, 1):
            choice: dict = {"index": 0, "text": piece, "finish_reason": None}
            if n == len(pieces):
                choice["finish_reason"] = "length" if len(pieces) == body["max_tokens"] else "stop"
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"text_offset": [offset], "token_logprobs": [-0.25], "tokens": [piece],
                                      "top_logprobs": [{piece: -0.25}]}
            ids = self.ids and body.get("return_token_ids")
            choice["prompt_token_ids"] = prompt_ids if ids and n == 1 else None
            choice["token_ids"] = [_token_id(piece)] if ids else None
            offset += len(piece)
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}
            out.append(_event({"id": "cmpl-" + host, "object": "text_completion", "created": 1_700_000_000,
                               "model": "m", "choices": [choice], "usage": usage}))
        if host in self.cuts:
            extra = [_event(c) for c in self.extra_d0] if host == "d0" else []
            return httpx.Response(200, stream=_DyingStream(out[:self.cuts[host]] + extra))
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(pieces),
                 "total_tokens": len(prompt_ids) + len(pieces)}
        out.append(_event({"id": "cmpl-" + host, "object": "text_completion", "created": 1_700_000_000,
                           "model": "m", "choices": [], "usage": usage}))
        return httpx.Response(200, content=b"".join(out + [b"data: [DONE]\n\n"]))


def _model(workers, n: int = 2, chat_default_max_tokens: int | None = None):
    from prometheus_client import CollectorRegistry

    from runtime.engines.client import VllmClient
    from runtime.server.metrics import RuntimeMetrics
    from runtime.server.model import PDModel
    from runtime.server.pairing import RoundRobinPairing

    reg = CollectorRegistry()
    transport = httpx.MockTransport(workers.handler)
    model = PDModel("m", RoundRobinPairing([], [f"http://d{i}" for i in range(n)], migration_limit=n - 1),
                    metrics=RuntimeMetrics(reg), client_factory=lambda url: VllmClient(url, transport=transport),
                    chat_default_max_tokens=chat_default_max_tokens)
    return model, reg


async def _complete(workers, n: int = 2, **fields) -> list[dict]:
    from kserve.protocol.rest.openai.types import CompletionRequest

    model, _ = _model(workers, n)
    try:
        events = [e async for e in await model.create_completion(
            CompletionRequest(model="m", prompt=PROMPT, temperature=0, stream=True, **fields))]
    finally:
        await model.aclose()
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


@pytest.mark.parametrize("fields", [
    {"max_tokens": 9, "logprobs": 1},
    {"max_tokens": 9, "return_token_ids": True},
    {"max_tokens": 9, "logprobs": 0, "return_token_ids": True, "stream_options": {"include_usage": True}},
], ids=["logprobs", "token-ids", "both-and-usage"])
async def test_a_migrated_completion_stream_equals_the_uninterrupted_one(fields):
    reference = await _complete(GreedyCompletions(), **fields)
    w = GreedyCompletions({"d0": 4})
    migrated = await _complete(w, **fields)
    # the next worker reads the prompt's and the output's token ids (asked of every worker, hidden where the
    # client did not ask for them)
    assert w.bodies["d0"][0]["return_token_ids"] is True
    assert len(w.bodies["d1"]) == 1 and w.bodies["d1"][0]["prompt"] == REFERENCE_IDS[:4 + 4]
    # every chunk as one worker sends it: text offsets go on from the characters sent (not from 0 again), the
    # prompt's token ids come once (the client's prompt's, not the continuation's), the token ids in order
    assert migrated == reference
    offsets = [o for c in migrated for ch in c["choices"] for o in (ch.get("logprobs") or {}).get("text_offset", [])]
    if "logprobs" in fields:
        assert offsets == [len("".join(ANSWER[:i])) for i in range(9)]
    prompt_ids = [ch["prompt_token_ids"] for c in migrated for ch in c["choices"] if ch["prompt_token_ids"]]
    assert prompt_ids == ([REFERENCE_IDS[:4]] if fields.get("return_token_ids") else [])
    if not fields.get("return_token_ids"):
        assert all(ch["token_ids"] is None for c in migrated for ch in c["choices"])


@pytest.mark.parametrize("client_ids", [False, True])
async def test_a_completion_cut_where_its_text_tokenizes_otherwise_continues_from_the_same_tokens(client_ids):
    # the answer made "\n" and "Who" as two tokens; the text sent, tokenized again, gives one "\nWho": a
    # continuation prompted with the text would decode on from other tokens, greedy or not
    reference = await _complete(GreedyCompletions(), max_tokens=11, return_token_ids=client_ids)
    assert "".join(c["choices"][0]["text"] for c in reference) == "".join(ANSWER[:11])
    w = GreedyCompletions({"d0": 8})
    assert await _complete(w, max_tokens=11, return_token_ids=client_ids) == reference
    assert w.bodies["d1"][0]["prompt"] == REFERENCE_IDS[:4 + 8] and w.bodies["d1"][0]["max_tokens"] == 3
    # an engine that returns no ids: the continuation goes on from the text (and here, as documented, elsewhere)
    w = GreedyCompletions({"d0": 8}, ids=False)
    chunks = await _complete(w, max_tokens=11)
    assert w.bodies["d1"][0]["prompt"] == PROMPT + "".join(ANSWER[:8])
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(ANSWER[:8]) + "???"


async def test_token_ids_are_not_asked_where_the_answer_holds_the_prompt():
    # vLLM leaves the echoed prompt's text out where it returns ids
    from kserve.protocol.rest.openai.types import CompletionRequest

    w = GreedyCompletions()
    model, _ = _model(w)
    req = CompletionRequest(model="m", prompt=PROMPT, temperature=0, stream=True, max_tokens=2, echo=True)
    try:
        [e async for e in await model.create_completion(req)]
    finally:
        await model.aclose()
    assert w.bodies["d0"] and all("return_token_ids" not in b for b in w.bodies["d0"])


@pytest.mark.parametrize("body, choices, ok", [
    ({"prompt": "a"}, 1, True), ({"prompt": [1, 2]}, 1, True), ({"prompt": "a"}, 2, False),
    ({"prompt": "a", "echo": "true"}, 1, False), ({"prompt_embeds": "AAAA"}, 1, False),
])
def test_ids_continuable(body, choices, ok):
    from runtime.server.migration import ids_continuable

    assert ids_continuable(body, choices) is ok


@pytest.mark.parametrize("fields, why", [
    ({"frequency_penalty": 1.5, "presence_penalty": 1.0}, "frequency_penalty"),
    ({"stop": ["the moon"]}, "stop strings"),
    ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),  # from text only: the ids are the cut prompt's
    ({"min_tokens": 2, "bad_words": ["owl"]}, "bad_words"),
])
async def test_a_stream_whose_sampling_reads_the_output_ends_with_an_error_that_says_why(fields, why):
    w = GreedyCompletions({"d0": 4}, ids="truncate_prompt_tokens" not in fields)
    chunks = await _complete(w, max_tokens=9, **fields)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "".join(ANSWER[:4])  # what d0 sent, no more
    err = chunks[-1]["error"]
    assert err["code"] == 502 and why in err["message"] and "cannot continue on another worker" in err["message"]
    assert w.bodies["d1"] == []


@pytest.mark.parametrize("ids, limit", [(False, 5), (True, 5), (True, 3)])
async def test_a_prompt_its_truncation_did_not_cut_is_continued_without_it(ids, limit):
    # the prompt has 4 tokens: 5 cut nothing; from ids (the prompt as the worker read it) any cut is kept
    w = GreedyCompletions({"d0": 4}, ids=ids)
    await _complete(w, max_tokens=9, truncate_prompt_tokens=limit)
    assert w.bodies["d1"] and "truncate_prompt_tokens" not in w.bodies["d1"][0]


async def test_output_of_tokens_whose_text_was_held_back_is_never_made_twice():
    # d0 sends a token with empty text (vLLM holds back a character's first bytes), then dies
    held = {"id": "cmpl-d0", "object": "text_completion", "created": 1_700_000_000, "model": "m",
            "choices": [{"index": 0, "text": "", "finish_reason": None, "prompt_token_ids": None, "token_ids": [7]}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}}
    # from the ids up to the last text sent (a prompt of ids ending inside a character makes vLLM send the whole
    # decoded prompt as the first text): the next worker makes the held token again, counted once
    w = GreedyCompletions({"d0": 3}, extra_d0=[held])
    chunks = await _complete(w, max_tokens=9, stream_options={"include_usage": True})
    assert w.bodies["d1"][0]["prompt"] == REFERENCE_IDS[:4 + 3] and w.bodies["d1"][0]["max_tokens"] == 6
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "".join(ANSWER[:9])
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}
    # the client got that token's logprobs (or ids): made again, they would come twice; from ids or from text
    lp = {"text_offset": [17], "token_logprobs": [-0.5], "tokens": ["bytes:\\xc3"], "top_logprobs": [{"x": -0.5}]}
    with_lp = {**held, "choices": [{**held["choices"][0], "logprobs": lp}]}
    for ids in (True, False):
        w = GreedyCompletions({"d0": 3}, extra_d0=[with_lp], ids=ids)
        chunks = await _complete(w, max_tokens=9, logprobs=1)
        assert "held back" in chunks[-1]["error"]["message"] and w.bodies["d1"] == []
    # from the text, without ids or logprobs, the held token is simply made again by the continuation
    plain = {**held, "choices": [{"index": 0, "text": "", "finish_reason": None}]}
    w = GreedyCompletions({"d0": 3}, extra_d0=[plain], ids=False)
    chunks = await _complete(w, max_tokens=9)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(ANSWER[:9])


@pytest.mark.parametrize("last, refused", [([_token_id(" a"), 7], True),
                                           ([_token_id(" a"), _token_id(" wisé")], False)],
                         ids=["ends-inside-a-character", "whole-characters"])
async def test_a_completion_whose_last_chunk_of_several_tokens_ends_inside_a_character_is_refused(last, refused):
    # vLLM merged two tokens into d0's last chunk ("a" and, in the first case, a character's first bytes, held
    # back): from ids ending there, vLLM would send the whole decoded prompt as the continuation's first text
    both = {"id": "cmpl-d0", "object": "text_completion", "created": 1_700_000_000, "model": "m",
            "choices": [{"index": 0, "text": " a" if refused else " a wisé", "finish_reason": None,
                         "prompt_token_ids": None, "token_ids": last}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}}
    w = GreedyCompletions({"d0": 2}, extra_d0=[both])
    chunks = await _complete(w, max_tokens=9)
    assert w.detokenized["d1"] == [last]
    if refused:
        assert "ends inside a character" in chunks[-1]["error"]["message"] and w.bodies["d1"] == []
    else:
        assert w.bodies["d1"][0]["prompt"] == REFERENCE_IDS[:4 + 4] and "error" not in chunks[-1]


async def test_a_chat_without_a_generation_prompt_ends_with_an_error_that_says_why():
    from kserve.protocol.rest.openai.types import ChatCompletionRequest

    class Chat:
        def __init__(self):
            self.bodies: dict[str, list[dict]] = {"d0": [], "d1": []}

        def handler(self, req: httpx.Request) -> httpx.Response:
            self.bodies[req.url.host].append(json.loads(req.content))
            out = [_event({"id": "c", "choices": [{"index": 0, "delta": {"content": t}}]}) for t in (" blue", " and")]
            return httpx.Response(200, stream=_DyingStream(out))

    w = Chat()
    model, _ = _model(w)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "The sea is"}], max_tokens=9,
                                temperature=0, stream=True, add_generation_prompt=False)
    events = [e async for e in await model.create_chat_completion(req)]
    await model.aclose()
    assert events[-1] == "data: [DONE]\n\n"
    err = json.loads(events[-2][6:])["error"]
    assert "add_generation_prompt" in err["message"] and w.bodies["d1"] == []


# --- chat: continued from the text sent only where the worker renders it into the answer's very tokens --------

HEADER = 7  # the stand-in template's assistant header, one token


class GreedyChat:
    """Chat workers that answer as vLLM 0.28 streams one greedy answer (`ANSWER` after the user's message, one
    token a chunk; a role chunk first). The template renders the user's message's tokens and `HEADER`, then an
    assistant message continued (`continue_final_message`) as its text's tokens (`_tokenize`; with `trim`, as
    Llama 3.1's template, the text stripped first); the answer goes on after whatever part of it the rendered
    prompt already ends with ("?" once it holds tokens the answer never made). `return_token_ids` puts the
    prompt's ids on the role chunk and each token's id on its chunk (null otherwise, as vLLM writes them;
    never with `ids` False). `POST /tokenize` renders as a request would; `POST /v1/completions` of token ids
    goes on the same way after them, streamed as vLLM 0.28 streams a completion; a chat request without
    `max_tokens` gets the context left of `max_model_len` tokens, which `GET /v1/models` gives the served model
    "m" (with `card`; else it lists no model), capped by `max_new_tokens` where it is set (the model's generation
    config, as vLLM's `get_max_tokens` takes its default). A worker named in `cuts` dies after that many content
    chunks."""

    max_model_len = 64

    def __init__(self, cuts: dict[str, int] | None = None, ids: bool = True, trim: bool = False, card: bool = True,
                 max_new_tokens: int | None = None):
        self.cuts, self.ids, self.trim, self.card = cuts or {}, ids, trim, card
        self.max_new_tokens = max_new_tokens
        self.bodies: dict[str, list[dict]] = {"d0": [], "d1": [], "d2": []}
        self.completions: dict[str, list[dict]] = {"d0": [], "d1": [], "d2": []}
        self.tokenized: dict[str, list[dict]] = {"d0": [], "d1": [], "d2": []}

    def _pieces(self, prompt_ids: list[int], max_tokens: int) -> list[str]:
        head = [_token_id(p) for p in _tokenize(PROMPT)] + [HEADER]
        reference = head + [_token_id(p) for p in ANSWER]
        done = next((i for i in range(len(ANSWER) + 1) if prompt_ids == reference[:len(head) + i]), None)
        # a prompt that is no prefix of the answer's tokens: greedy decoding goes elsewhere
        return (ANSWER[done:] if done is not None else ["?"] * len(ANSWER))[:max_tokens]

    def _completion(self, host: str, body: dict) -> httpx.Response:
        self.completions[host].append(body)
        prompt_ids = body["prompt"]
        assert isinstance(prompt_ids, list), prompt_ids
        pieces = self._pieces(prompt_ids, body["max_tokens"])
        ids = self.ids and body.get("return_token_ids")
        out = []
        for n, piece in enumerate(pieces, 1):
            finish = ("length" if len(pieces) == body["max_tokens"] else "stop") if n == len(pieces) else None
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                      "prompt_token_ids": prompt_ids if ids and n == 1 else None,
                      "token_ids": [_token_id(piece)] if ids else None}
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}
            out.append(_event({"id": "cmpl-" + host, "object": "text_completion", "created": 1_700_000_001,
                               "model": "m", "choices": [choice], "usage": usage}))
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(pieces),
                 "total_tokens": len(prompt_ids) + len(pieces)}
        out.append(_event({"id": "cmpl-" + host, "object": "text_completion", "created": 1_700_000_001,
                           "model": "m", "choices": [], "usage": usage}))
        return httpx.Response(200, content=b"".join(out + [b"data: [DONE]\n\n"]))

    def render(self, body: dict) -> list[int]:
        user, *rest = body["messages"]
        ids = [_token_id(p) for p in _tokenize(user["content"])] + [HEADER]
        if rest:
            text = rest[0]["content"]
            ids += [_token_id(p) for p in _tokenize(text.strip() if self.trim else text)]
        return ids

    def handler(self, req: httpx.Request) -> httpx.Response:
        host = req.url.host
        if req.url.path == "/v1/models":
            card = {"id": "m", "object": "model", "max_model_len": self.max_model_len}
            return httpx.Response(200, json={"object": "list", "data": [card] if self.card else []})
        body = json.loads(req.content)
        if req.url.path == "/tokenize":
            self.tokenized[host].append(body)
            return httpx.Response(200, json={"count": len(self.render(body)), "tokens": self.render(body)})
        if req.url.path == "/v1/completions":
            return self._completion(host, body)
        self.bodies[host].append(body)
        prompt_ids = self.render(body)
        # a chat request without a budget gets the context left after its prompt, capped by the model's default,
        # as vLLM grants it
        budget = body.get("max_tokens") or min(self.max_model_len - len(prompt_ids),
                                               self.max_new_tokens or self.max_model_len)
        pieces = self._pieces(prompt_ids, budget)
        ids = self.ids and body.get("return_token_ids")
        base = {"id": "chatcmpl-" + host, "object": "chat.completion.chunk", "created": 1_700_000_000, "model": "m"}
        out = [_event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}],
                       "prompt_token_ids": prompt_ids if ids else None})]
        for n, piece in enumerate(pieces, 1):
            finish = ("length" if len(pieces) == budget else "stop") if n == len(pieces) else None
            # vLLM 0.28 writes stop_reason on the finishing chunk only (ChatCompletionResponseStreamChoice)
            choice = {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": finish,
                      **({"stop_reason": None} if finish else {}), "token_ids": [_token_id(piece)] if ids else None}
            out.append(_event({**base, "choices": [choice]}))
        if host in self.cuts:
            return httpx.Response(200, stream=_DyingStream(out[:1 + self.cuts[host]]))
        return httpx.Response(200, content=b"".join(out + [b"data: [DONE]\n\n"]))


async def _chat(workers, chat_default_max_tokens: int | None = None, **fields) -> list[dict]:
    from kserve.protocol.rest.openai.types import ChatCompletionRequest

    model, _ = _model(workers, chat_default_max_tokens=chat_default_max_tokens)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": PROMPT}], temperature=0,
                                stream=True, **fields)
    try:
        events = [e async for e in await model.create_chat_completion(req)]
    finally:
        await model.aclose()
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def _content(chunks: list[dict]) -> str:
    return "".join((c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c.get("choices"))


@pytest.mark.parametrize("client_ids", [False, True])
async def test_a_chat_continuation_the_next_worker_renders_into_the_same_tokens_is_sent(client_ids):
    reference = await _chat(GreedyChat(), max_tokens=11, return_token_ids=client_ids)
    assert _content(reference) == "".join(ANSWER[:11])
    w = GreedyChat({"d0": 4})
    assert await _chat(w, max_tokens=11, return_token_ids=client_ids) == reference
    assert w.bodies["d0"][0]["return_token_ids"] is True
    # d1 rendered the continuation before it was sent: the prompt's tokens and the four sent
    assert [len(t["messages"]) for t in w.tokenized["d1"]] == [2] and len(w.bodies["d1"]) == 1
    assert w.tokenized["d1"][0]["continue_final_message"] is True
    assert w.bodies["d1"][0]["messages"][-1] == {"role": "assistant", "content": "".join(ANSWER[:4])}


@pytest.mark.parametrize("client_ids", [False, True])
@pytest.mark.parametrize("cut, trim", [(8, False), (7, True)], ids=["newline-merges", "template-trims"])
async def test_a_chat_continuation_that_renders_into_other_tokens_goes_on_as_a_completion_of_the_ids(
        cut, trim, client_ids):
    # after "\nWho" the text tokenizes into one token where the answer made two; a template that trims the
    # message drops the "\n" sent: either way a chat continuation would go on from other tokens, so the next
    # worker gets a completion of the very ids, and the client the uninterrupted chat chunks
    reference = await _chat(GreedyChat(trim=trim), max_tokens=11, return_token_ids=client_ids)
    w = GreedyChat({"d0": cut}, trim=trim)
    assert await _chat(w, max_tokens=11, return_token_ids=client_ids) == reference
    assert len(w.tokenized["d1"]) == 1 and w.bodies["d1"] == []  # checked, then not sent as chat
    (sent,) = w.completions["d1"]
    head = [_token_id(p) for p in _tokenize(PROMPT)] + [HEADER]
    assert sent["prompt"] == head + [_token_id(p) for p in ANSWER[:cut]] and sent["max_tokens"] == 11 - cut
    assert "messages" not in sent and sent["temperature"] == 0 and sent["return_token_ids"] is True


async def test_a_chat_without_a_budget_goes_on_as_a_completion_with_the_context_left():
    reference = await _chat(GreedyChat())
    assert _content(reference) == "".join(ANSWER)
    w = GreedyChat({"d0": 8})
    assert await _chat(w) == reference
    (sent,) = w.completions["d1"]  # the chat default, not the completions API's 16
    assert sent["max_tokens"] == 64 - len(sent["prompt"])


@pytest.mark.parametrize("cut", [4, 8], ids=["as-chat", "as-completion"])
async def test_a_chat_without_a_budget_continues_with_what_is_left_of_the_models_default(tmp_path, cut):
    # the model's generation_config.json sets max_new_tokens: vLLM gives every chat request without a budget
    # that many tokens (capped by the context left), a continuation too, so it must ask for what is left
    from runtime.server.generation_defaults import chat_default_max_tokens

    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 10, "temperature": 0.6}))
    default = chat_default_max_tokens(tmp_path)
    reference = await _chat(GreedyChat(max_new_tokens=10))
    assert _content(reference) == "".join(ANSWER[:10])
    w = GreedyChat({"d0": cut}, max_new_tokens=10)
    assert await _chat(w, chat_default_max_tokens=default) == reference
    (sent,) = w.bodies["d1"] or w.completions["d1"]  # cut 8: "\nWho" renders otherwise, so as a completion
    assert sent["max_tokens"] == 10 - cut and bool(w.completions["d1"]) == (cut == 8)


async def test_a_chat_without_a_budget_of_a_model_without_a_default_continues_with_the_context_left(tmp_path):
    from runtime.server.generation_defaults import chat_default_max_tokens

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    default = chat_default_max_tokens(tmp_path)
    assert default is None
    reference = await _chat(GreedyChat())
    w = GreedyChat({"d0": 4})
    assert await _chat(w, chat_default_max_tokens=default) == reference
    (sent,) = w.bodies["d1"]  # the worker's own default: the context left after the longer prompt
    assert "max_tokens" not in sent and "max_completion_tokens" not in sent


@pytest.mark.parametrize("fields, card, why", [
    ({"max_tokens": 11, "logprobs": True, "top_logprobs": 1}, True, "logprobs"),
    ({"max_tokens": 11, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, True, "tools"),
    ({}, False, "context length is unknown"),
], ids=["logprobs", "tools", "no-budget-no-context"])
async def test_a_chat_continuation_a_completion_cannot_carry_ends_with_an_error_that_says_why(fields, card, why):
    w = GreedyChat({"d0": 8}, card=card)
    chunks = await _chat(w, **fields)
    assert _content(chunks[:-1]) == "".join(ANSWER[:8])
    err = chunks[-1]["error"]
    assert "renders or tokenizes otherwise" in err["message"] and why in err["message"]
    assert "cannot continue on another worker" in err["message"]
    assert len(w.tokenized["d1"]) == 1 and w.bodies["d1"] == [] and w.completions["d1"] == []


async def test_a_chat_stream_whose_worker_returns_no_ids_continues_unchecked():
    w = GreedyChat({"d0": 4}, ids=False)
    chunks = await _chat(w, max_tokens=11)
    assert _content(chunks) == "".join(ANSWER[:11])
    assert w.tokenized["d1"] == [] and len(w.bodies["d1"]) == 1


def test_ids_are_nulled_in_the_workers_bytes_and_only_in_its_id_members():
    from runtime.server.migration import ids_nulled

    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": 'say ,"token_ids":[1] and {"token_ids":[2]'},
                                     "token_ids": [42, 7]}], "prompt_token_ids": [1, 2]}
    data = json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()
    out = ids_nulled(data, 2)
    assert json.loads(out) == {**chunk, "choices": [{**chunk["choices"][0], "token_ids": None}],
                               "prompt_token_ids": None}
    assert ids_nulled(data, 3) is None  # not the fields the chunk had: encoded again instead
