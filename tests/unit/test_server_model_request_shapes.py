"""PDModel serving request shapes end to end over faked workers (HTTP transport), as vLLM would answer them.

Specification:
* the runtime decides with the values the request model validated: `"n": "2"`, `"seed": "3"` and
  `"temperature": "0"` mean what vLLM reads them as (2, 3, 0), so a lenient `n` is still fanned out into one
  handoff per choice, seeded choices get `seed + j`, and greedy `n` > 1 is refused;
* the usage of a request with `n` > 1 counts the prompt once per prompt (vLLM's count), streaming or not;
* a merged stream with `continuous_usage_stats` keeps each chunk's own usage; its final usage is the sum of
  the sub-streams' final usage, each prompt counted once;
* usage details (cached prompt tokens, reasoning tokens) sum the same way, streaming or not;
* chat `echo` (prompt log-probabilities, `top_logprobs` 0 by default) and beam search are served whole by
  the decode worker with local prefill: no handoff, no fan-out (beam search's `n` is its beam width);
* prompts are split as vLLM validated them: `[[1, 2], ["3", "4"]]` is two token-id prompts, `[1.0, 2.0]` one;
* seeded choices whose seeds `seed + j` a request cannot carry (-1 means "no seed"; past 2**63 - 1) are served
  whole by the decode worker, as the aggregated server seeds them;
* what vLLM puts on an answer is kept: a fanned-out stream has one `created`, a stream's
  `system_fingerprint` (on the worker's usage chunk, which the runtime asks for) reaches the client on the
  finish chunks when it did not ask for usage, on the final usage chunk when it did, and a client's
  `request_id` names the answer (`cmpl-<id>`), streamed or not.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("kserve")

from kserve.protocol.rest.openai.types import (  # noqa: E402
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
)
from prometheus_client import CollectorRegistry  # noqa: E402

from runtime.engines.client import VllmClient  # noqa: E402
from runtime.server.metrics import RuntimeMetrics  # noqa: E402
from runtime.server.model import PDModel, _merge_streams  # noqa: E402
from runtime.server.pairing import RoundRobinPairing  # noqa: E402

KV = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "127.0.0.1",
      "remote_port": 1}
PROMPT_TOKENS = 5


class Workers:
    """A prefill and a decode worker. The decode worker answers each choice with text naming its seed, and
    counts usage as vLLM does (the prompt once, each choice's tokens); streams send one chunk per token with
    continuous usage when asked. `details` (usage details, e.g. `prompt_tokens_details`) go into each final
    usage the decode worker reports."""

    def __init__(self, details: dict | None = None) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.details = details or {}

    def handler(self, req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        self.calls.append((req.url.host, body))
        chat = req.url.path.endswith("chat/completions")
        if req.url.host == "prefill":
            return httpx.Response(200, json={**self._answer(chat, body, 1), "kv_transfer_params": KV})
        if body.get("stream"):
            return httpx.Response(200, text=self._stream(body, self.details))
        answer = self._answer(chat, body, 2)
        answer["usage"].update(self.details)
        return httpx.Response(200, json=answer)

    @staticmethod
    def _answer(chat: bool, body: dict, tokens: int) -> dict:
        n = int(body.get("n") or 1)
        text = f"seed={body.get('seed')}"
        choices = [{"index": j, "finish_reason": "length",
                    **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
                   for j in range(n)]
        return {"id": "x", "object": "chat.completion" if chat else "text_completion", "created": 1, "model": "m",
                "choices": choices, "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens * n,
                                              "total_tokens": PROMPT_TOKENS + tokens * n}}

    @staticmethod
    def _stream(body: dict, details: dict) -> str:
        options = body.get("stream_options") or {}
        continuous = options.get("include_usage") and options.get("continuous_usage_stats")
        chunks = []
        for k, piece in enumerate(["a", "b", "c"], 1):
            chunk = {"id": "x", "object": "text_completion", "created": 1, "model": "m",
                     "choices": [{"index": 0, "text": piece, "finish_reason": "length" if k == 3 else None}]}
            if continuous:
                chunk["usage"] = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": k,
                                  "total_tokens": PROMPT_TOKENS + k}
            chunks.append(chunk)
        if options.get("include_usage"):
            chunks.append({"id": "x", "object": "text_completion", "created": 1, "model": "m", "choices": [],
                           "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 3,
                                     "total_tokens": PROMPT_TOKENS + 3, **details}})
        return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    def hosts(self) -> list[str]:
        return [h for h, _ in self.calls]

    def decode_bodies(self) -> list[dict]:
        return [b for h, b in self.calls if h == "decode"]


class _Raw:
    """What PDModel reads of the HTTP request: the body exactly as the client sent it."""

    def __init__(self, body: dict) -> None:
        self._body = body

    async def json(self) -> dict:
        return json.loads(json.dumps(self._body))


def _model(workers: Workers) -> PDModel:
    transport = httpx.MockTransport(workers.handler)
    return PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]),
                   metrics=RuntimeMetrics(CollectorRegistry()),
                   client_factory=lambda url: VllmClient(url, transport=transport))


async def _complete(model: PDModel, **fields):
    body = {"model": "m", "prompt": "capital?", "max_tokens": 3, **fields}
    return await model.create_completion(CompletionRequest.model_validate(body), raw_request=_Raw(body))


async def _chat(model: PDModel, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "capital?"}], "max_tokens": 3, **fields}
    return await model.create_chat_completion(ChatCompletionRequest.model_validate(body), raw_request=_Raw(body))


async def _events(stream) -> list[dict]:
    out = []
    async for event in stream:
        data = event[len("data:"):].strip()
        if data != "[DONE]":
            out.append(json.loads(data))
    return out


@pytest.mark.parametrize("n", ["2", 2.0])
async def test_a_lenient_n_is_fanned_out_one_handoff_per_choice_with_seed_plus_j(n):
    w = Workers()
    out = await _complete(_model(w), n=n, seed="3", temperature=0.8)
    assert isinstance(out, Completion)
    assert w.hosts().count("prefill") == 2  # one handoff per choice, never one shared by two sequences
    assert sorted((b["n"], b["seed"]) for b in w.decode_bodies()) == [(1, 3), (1, 4)]
    assert [c.text for c in out.choices] == ["seed=3", "seed=4"]


async def test_a_lenient_greedy_temperature_with_n_2_is_refused_as_vllm_refuses_it():
    w = Workers()
    out = await _complete(_model(w), n=2, temperature="0")
    assert isinstance(out, ErrorResponse) and out.error.code == 400
    assert out.error.param == "n"
    assert w.calls == []


async def test_usage_of_n_choices_counts_the_prompt_once():
    w = Workers()
    out = await _chat(_model(w), n=3, temperature=0.8)
    assert isinstance(out, ChatCompletion)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (PROMPT_TOKENS, 6)
    assert out.usage.total_tokens == PROMPT_TOKENS + 6
    two = await _complete(_model(Workers()), prompt=["a", "b"], n=2, temperature=0.8)
    assert (two.usage.prompt_tokens, two.usage.completion_tokens) == (2 * PROMPT_TOKENS, 8)


@pytest.mark.parametrize("continuous", [False, True])
async def test_a_merged_stream_reports_usage_as_vllm_does(continuous):
    w = Workers()
    stream = await _complete(_model(w), n=2, temperature=0.8, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": continuous})
    events = await _events(stream)
    final = events[-1]
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": PROMPT_TOKENS, "completion_tokens": 6, "total_tokens": PROMPT_TOKENS + 6}
    token_chunks = [e for e in events if e["choices"]]
    assert len(token_chunks) == 6
    if continuous:  # each chunk: its prompt's tokens and its choice's tokens so far
        for index in (0, 1):
            mine = [e["usage"]["completion_tokens"] for e in token_chunks if e["choices"][0]["index"] == index]
            assert mine == [1, 2, 3]
    else:
        assert all("usage" not in e for e in token_chunks)


DETAILS = {"prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 1}}


async def test_usage_details_of_n_choices_count_the_prompt_once_and_every_choice():
    out = await _chat(_model(Workers(DETAILS)), n=3, temperature=0.8)
    assert isinstance(out, ChatCompletion)
    assert out.usage.prompt_tokens_details.cached_tokens == 4
    assert out.usage.completion_tokens_details.reasoning_tokens == 3
    two = await _complete(_model(Workers(DETAILS)), prompt=["a", "b"], n=2, temperature=0.8)
    assert two.usage.prompt_tokens_details.cached_tokens == 8
    assert two.usage.completion_tokens_details.reasoning_tokens == 4
    plain = await _chat(_model(Workers()), n=3, temperature=0.8)
    assert plain.usage.prompt_tokens_details is None and plain.usage.completion_tokens_details is None


@pytest.mark.parametrize("continuous", [False, True])
async def test_a_merged_streams_final_usage_carries_the_summed_details(continuous):
    stream = await _complete(_model(Workers(DETAILS)), prompt=["a", "b"], n=2, temperature=0.8, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": continuous})
    final = (await _events(stream))[-1]
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": 2 * PROMPT_TOKENS, "completion_tokens": 12, "total_tokens": 2 * PROMPT_TOKENS + 12,
        "prompt_tokens_details": {"cached_tokens": 8}, "completion_tokens_details": {"reasoning_tokens": 4}}


async def test_chat_echo_is_prefilled_on_the_decode_worker_not_from_a_handoff():
    w = Workers()
    out = await _chat(_model(w), echo=True, temperature=0)
    assert isinstance(out, ChatCompletion)
    assert w.hosts() == ["decode"]
    assert "kv_transfer_params" not in w.decode_bodies()[0]


async def test_chat_echo_without_top_logprobs_uses_the_handoff():
    w = Workers()
    await _chat(_model(w), echo=True, top_logprobs=None, temperature=0)
    assert w.hosts() == ["prefill", "decode"]


@pytest.mark.parametrize("temperature", [0, None])
async def test_beam_search_with_n_beams_is_served_whole_by_the_decode_worker(temperature):
    w = Workers()
    out = await _complete(_model(w), n=2, use_beam_search=True, temperature=temperature)
    assert isinstance(out, Completion)
    assert w.hosts() == ["decode"]
    assert w.decode_bodies()[0]["n"] == 2 and "kv_transfer_params" not in w.decode_bodies()[0]


async def _sub_stream(*events):
    for e in events:
        if isinstance(e, Exception):
            raise e
        yield e


async def test_a_merged_stream_ends_like_a_single_one_after_an_error_or_a_break():

    ok = 'data: {"id":"a","choices":[{"index":0,"text":"x"}]}\n\n'
    err = 'data: {"error":{"message":"boom","code":"502"}}\n\n'
    # an error event: passed on, then [DONE], as a single stream ends
    out = [e async for e in _merge_streams([_sub_stream(ok, err), _sub_stream(ok, ok, "data: [DONE]\n\n")], False, 2)]
    assert out[-2:] == [err, "data: [DONE]\n\n"]
    # a sub-stream that raises: the merged stream breaks off unended, never a complete-looking answer
    seen: list[str] = []
    with pytest.raises(RuntimeError, match="cut"):
        async for e in _merge_streams([_sub_stream(ok, RuntimeError("cut")), _sub_stream(ok, ok)], False, 2):
            seen.append(e)
    assert "data: [DONE]\n\n" not in seen


@pytest.mark.parametrize(("prompt", "sent"), [
    ([[1, 2], ["3", "4"]], [[1, 2], [3, 4]]),  # two token-id prompts, as vLLM reads them
    ([["5"], ["6"]], [[5], [6]]),
    ([1.0, 2.0], [[1, 2]]),  # one token-id prompt
])
async def test_prompts_are_split_as_vllm_validated_them(prompt, sent):
    w = Workers()
    out = await _complete(_model(w), prompt=prompt, temperature=1)
    assert isinstance(out, Completion)
    assert [b["prompt"] for b in w.decode_bodies()] == sent
    assert [c.index for c in out.choices] == list(range(len(sent)))


@pytest.mark.parametrize("seed", [-2, 2**63 - 1])
async def test_seeds_a_request_cannot_carry_are_served_whole(seed):
    w = Workers()
    out = await _complete(_model(w), n=3, seed=seed, temperature=1)
    assert isinstance(out, Completion) and len(out.choices) == 3
    assert w.hosts() == ["decode"]  # local prefill on the decode worker: no handoff, no fan-out
    assert [(b["n"], b["seed"]) for b in w.decode_bodies()] == [(3, seed)]


class _Stamped(Workers):
    """Streams as vLLM 0.28 stamps them: each stream its own `created`; `system_fingerprint` on the usage chunk
    when usage was asked for, else on the finish chunk (vllm/entrypoints/openai/completion/serving.py)."""

    FINGERPRINT = "vllm-0.28.0-abcd1234"

    def __init__(self) -> None:
        super().__init__()
        self.streams = 0

    def _stream(self, body: dict, details: dict) -> str:  # type: ignore[override]
        self.streams += 1
        include = (body.get("stream_options") or {}).get("include_usage")
        out = []
        for part in Workers._stream(body, details).split("\n\n"):
            if part.startswith("data: {"):
                c = json.loads(part[len("data: "):])
                c["created"] = 1000 + self.streams
                if not c["choices"] or (not include and c["choices"][0].get("finish_reason")):
                    c["system_fingerprint"] = self.FINGERPRINT
                part = "data: " + json.dumps(c)
            out.append(part)
        return "\n\n".join(out)


@pytest.mark.parametrize("fields", [{}, {"prompt": ["a", "b"]}, {"n": 2}])
@pytest.mark.parametrize("usage", [False, True])
async def test_streams_keep_one_created_and_the_system_fingerprint(fields, usage):
    options = {"stream_options": {"include_usage": True}} if usage else {}
    events = await _events(await _complete(_model(_Stamped()), temperature=1, stream=True, **fields, **options))
    assert len({e["created"] for e in events}) == 1, events
    stamped = [e for e in events if e.get("system_fingerprint") == _Stamped.FINGERPRINT]
    if usage:  # on the final usage chunk, as vLLM's
        assert stamped == [events[-1]] and events[-1]["choices"] == [] and events[-1]["usage"]
    else:  # on every choice's finish chunk
        finishes = [e for e in events if e["choices"] and e["choices"][0].get("finish_reason")]
        assert stamped == finishes and len(finishes) == (1 if not fields else 2)
        assert all(e["choices"] for e in events)  # and no usage chunk the client did not ask for


@pytest.mark.parametrize("fields", [{}, {"prompt": ["a", "b"]}, {"stream": True}, {"stream": True, "n": 2}])
async def test_the_clients_request_id_names_the_answer(fields):
    w = Workers()
    out = await _complete(_model(w), request_id="client-42", temperature=1, **fields)
    ids = {e["id"] for e in await _events(out)} if fields.get("stream") else {out.id}
    assert ids == {"cmpl-client-42"}
    assert all(b["request_id"] == "client-42" for b in w.decode_bodies())


class _TwoChoices(_Stamped):
    """A stream of `n` choices in one request (served whole by the decode worker), two chunks each,
    stamped as vLLM 0.28 stamps them."""

    def _stream(self, body: dict, details: dict) -> str:  # type: ignore[override]
        include = (body.get("stream_options") or {}).get("include_usage")
        chunks = []
        for k in (1, 2):
            for j in range(int(body.get("n") or 1)):
                c = {"id": "x", "object": "text_completion", "created": 1, "model": "m",
                     "choices": [{"index": j, "text": "t", "finish_reason": "length" if k == 2 else None}]}
                if k == 2 and not include:
                    c["system_fingerprint"] = self.FINGERPRINT
                chunks.append(c)
        if include:
            chunks.append({"id": "x", "object": "text_completion", "created": 1, "model": "m", "choices": [],
                           "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
                           "system_fingerprint": self.FINGERPRINT})
        return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


async def test_a_stream_of_several_choices_served_whole_stamps_every_finish_chunk():
    w = _TwoChoices()
    events = await _events(await _complete(_model(w), n=2, seed=2**63 - 1, temperature=1, stream=True))
    assert w.hosts() == ["decode"]  # served whole
    finishes = [(e["choices"][0]["index"], e.get("system_fingerprint")) for e in events
                if e["choices"][0].get("finish_reason")]
    assert sorted(finishes) == [(0, _Stamped.FINGERPRINT), (1, _Stamped.FINGERPRINT)]
    assert len(events) == 4 and all(e["choices"] for e in events)


async def test_a_merged_stream_keeps_the_choices_that_finished_before_an_error_or_a_break():

    fin = 'data: {"id":"a","created":1,"choices":[{"index":0,"text":"x","finish_reason":"stop"}]}\n\n'
    err = 'data: {"error":{"message":"boom","code":"502"}}\n\n'

    async def finished_then_waits():  # its usage chunk (and the fingerprint) never comes
        yield fin
        await asyncio.Event().wait()

    out = [e async for e in _merge_streams([finished_then_waits(), _sub_stream(err)], False, 1)]
    assert len(out) == 3 and out[1:] == [err, "data: [DONE]\n\n"]
    assert json.loads(out[0][len("data: "):])["choices"][0]["finish_reason"] == "stop"
    seen: list[str] = []
    with pytest.raises(RuntimeError, match="cut"):
        async for e in _merge_streams([finished_then_waits(), _sub_stream(RuntimeError("cut"))], False, 1):
            seen.append(e)
    assert len(seen) == 1 and '"finish_reason":"stop"' in seen[0]
