"""Decode-worker failover (runtime.server.migration + PDModel), workers faked at the HTTP transport.

Specification: when the decode worker dies mid-stream, the request continues on another
decode worker with the text generated so far appended to its prompt and the token budget reduced, up to
`migration_limit` times; the client sees one uninterrupted stream with one id; beyond the limit (or with no
other decode worker) the stream ends with an OpenAI error event, never a hang.
"""

from __future__ import annotations

import json

import httpx
import pytest

from runtime.procs import stop_process
from runtime.server.migration import NotContinuable, chunk_progress, continuation_body


def chunk_text(chunk: dict) -> str:
    """The text a streamed chunk adds (choice 0)."""
    return chunk_progress(chunk)[0]


CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def test_chat_continuation_appends_an_assistant_message_to_continue():
    body = {"messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 10, "stream": True}
    c = continuation_body(CHAT, body, "The capital", 2)
    assert c["messages"][-1] == {"role": "assistant", "content": "The capital"}
    assert c["continue_final_message"] is True and c["add_generation_prompt"] is False
    assert c["max_tokens"] == 8
    assert body["max_tokens"] == 10 and len(body["messages"]) == 1  # original untouched


def test_completion_continuation_extends_the_prompt():
    c = continuation_body(COMPL, {"prompt": "The capital of France is", "max_tokens": 5}, " Paris", 1)
    assert c["prompt"] == "The capital of France is Paris" and c["max_tokens"] == 4


@pytest.mark.parametrize("budget", [{}, {"max_tokens": None}])
def test_a_completion_without_max_tokens_continues_with_what_is_left_of_the_default(budget):
    # vLLM (and OpenAI) give a completions request without max_tokens 16 tokens; a continuation that named none
    # would get 16 more
    c = continuation_body(COMPL, {"prompt": "x", **budget}, " a b c d e", 5)
    assert c["max_tokens"] == 11
    with pytest.raises(NotContinuable, match="max_tokens"):
        continuation_body(COMPL, {"prompt": "x", **budget}, " a" * 16, 16)
    # a chat request's default is the context left after its prompt, which the continuation's longer prompt
    # shrinks by itself
    assert "max_tokens" not in continuation_body(CHAT, {"messages": [{"role": "user", "content": "x"}]}, "ab", 2)


def test_a_chat_without_a_budget_continues_with_what_is_left_of_the_workers_default():
    # the model's generation config max_new_tokens: vLLM grants every chat attempt without a budget that many
    chat = {"messages": [{"role": "user", "content": "x"}]}
    c = continuation_body(CHAT, chat, "ab", 2, chat_default_max_tokens=10)
    assert c["max_tokens"] == 8 and "max_tokens" not in chat
    with pytest.raises(NotContinuable, match="max_tokens"):
        continuation_body(CHAT, chat, "a" * 10, 10, chat_default_max_tokens=10)
    # a budget the request names is the budget, whatever the default
    c = continuation_body(CHAT, {**chat, "max_completion_tokens": 30}, "ab", 2, chat_default_max_tokens=10)
    assert c["max_completion_tokens"] == 28 and "max_tokens" not in c
    c = continuation_body(CHAT, {**chat, "max_tokens": 30}, "ab", 2, chat_default_max_tokens=10)
    assert c["max_tokens"] == 28
    # a completions request always has a budget (16 where it names none): the chat default does not apply
    assert continuation_body(COMPL, {"prompt": "x"}, "ab", 2, chat_default_max_tokens=10)["max_tokens"] == 14


def test_continuation_shrinks_min_tokens_by_the_tokens_sent():
    # min_tokens above the shrunk max_tokens would be refused by vLLM (min_tokens must be <= max_tokens)
    c = continuation_body(COMPL, {"prompt": "x", "max_tokens": 12, "min_tokens": 10}, " a b c d e", 5)
    assert (c["max_tokens"], c["min_tokens"]) == (7, 5)
    c = continuation_body(COMPL, {"prompt": "x", "max_tokens": 12, "min_tokens": 3}, " a b c d e", 5)
    assert c["min_tokens"] == 0


def test_chat_continuation_of_a_continued_final_message_extends_that_message():
    # the client asked the model to continue its assistant message: the continuation goes on inside the same
    # message (a second assistant message would render as a new turn, not as the same text)
    body = {"messages": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "It is"}],
            "max_tokens": 10, "add_generation_prompt": False, "continue_final_message": True}
    c = continuation_body(CHAT, body, " a ripe", 2)
    assert c["messages"] == [{"role": "user", "content": "Name a fruit."},
                             {"role": "assistant", "content": "It is a ripe"}]
    assert body["messages"][-1]["content"] == "It is"


@pytest.mark.parametrize("body", [
    {"prompt": [1, 2, 3], "max_tokens": 5},            # token-id prompt: text cannot be appended
    {"prompt": "x", "max_tokens": 5, "n": 2},           # several choices
    {"prompt": "x", "max_tokens": 2},                   # budget used up
    {"prompt": "x", "max_tokens": 9, "echo": True},     # echo would repeat the generated text
    {"prompt": "x", "max_tokens": 9, "response_format": {"type": "json_object"}},  # the grammar would restart
    {"prompt": "x", "max_tokens": 9, "structured_outputs": {"regex": "[a-z]+"}},
])
def test_uncontinuable_requests_are_refused(body):
    with pytest.raises(NotContinuable):
        continuation_body(COMPL, body, "ab", 2)


def test_chunk_text_reads_chat_and_completion_chunks():
    assert chunk_text({"choices": [{"delta": {"content": "Pa"}}]}) == "Pa"
    assert chunk_text({"choices": [{"text": "ris"}]}) == "ris"
    assert chunk_text({"choices": []}) == ""


# --- PDModel over two decode workers, the first dying mid-stream ------------------------------------------

pytest.importorskip("kserve")

from tests.model_streams import DyingStream as _DyingStream  # noqa: E402


def _sse(cid: str, texts: list[str]) -> list[bytes]:
    created = 1_700_000_000 + sum(map(ord, cid))  # each worker stamps its own answer
    return [f"data: {json.dumps({'id': cid, 'created': created, 'choices': [{'index': 0, 'delta': {'content': t}}]})}"
            "\n\n".encode() for t in texts]


class TwoDecoders:
    def __init__(self, d1_dies: bool = False):
        self.d1_dies = d1_dies
        self.bodies: dict[str, list[dict]] = {"d0": [], "d1": []}

    def handler(self, req: httpx.Request) -> httpx.Response:
        host, body = req.url.host, json.loads(req.content)
        self.bodies[host].append(body)
        if host == "d0" or self.d1_dies:
            return httpx.Response(200, stream=_DyingStream(_sse(f"id-{host}", ["The", " capital"])))
        chunks = _sse("id-d1", [" of", " France", " is", " Paris."]) + [b"data: [DONE]\n\n"]
        return httpx.Response(200, content=b"".join(chunks))


def _model(workers: TwoDecoders, limit: int = 1):
    from prometheus_client import CollectorRegistry

    from runtime.engines.client import VllmClient
    from runtime.server.metrics import RuntimeMetrics
    from runtime.server.model import PDModel
    from runtime.server.pairing import RoundRobinPairing

    reg = CollectorRegistry()
    transport = httpx.MockTransport(workers.handler)
    model = PDModel("m", RoundRobinPairing([], ["http://d0", "http://d1"], migration_limit=limit),
                    metrics=RuntimeMetrics(reg), client_factory=lambda url: VllmClient(url, transport=transport))
    return model, reg


def _chat_request():
    from kserve.protocol.rest.openai.types import ChatCompletionRequest

    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Capital of France?"}],
                                 max_tokens=12, temperature=0, stream=True)


async def test_stream_continues_on_another_decode_worker_with_generated_text_appended():
    w = TwoDecoders()
    model, reg = _model(w)
    events = [e async for e in await model.create_chat_completion(_chat_request())]
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(chunk_text(c) for c in chunks) == "The capital of France is Paris."
    assert {c["id"] for c in chunks} == {"id-d0"}
    assert {c["created"] for c in chunks} == {1_700_000_000 + sum(map(ord, "id-d0"))}  # one answer's stamp
    cont = w.bodies["d1"][0]
    assert cont["messages"][-1] == {"role": "assistant", "content": "The capital"}
    assert cont["continue_final_message"] is True and cont["max_tokens"] == 10
    assert reg.get_sample_value("pdserve_migrations_total") == 1
    assert reg.get_sample_value("pdserve_requests_total", {"endpoint": "chat", "mode": "migrated", "status": "ok"}) == 1


async def test_beyond_the_migration_limit_the_stream_ends_with_an_error_event():
    w = TwoDecoders(d1_dies=True)
    model, reg = _model(w, limit=1)
    events = [e async for e in await model.create_chat_completion(_chat_request())]
    assert events[-1] == "data: [DONE]\n\n"
    last = json.loads(events[-2][6:])
    assert last["error"]["code"] == 502 and "inference worker failed" in last["error"]["message"]
    assert "migration_limit is used up" in last["error"]["message"]  # why it moves no more
    assert len(w.bodies["d0"]) == 1 and len(w.bodies["d1"]) == 1
    assert reg.get_sample_value("pdserve_requests_total", {"endpoint": "chat", "mode": "migrated", "status": "error"}) == 1


async def test_zero_migration_limit_never_migrates():
    w = TwoDecoders()
    model, _ = _model(w, limit=0)
    events = [e async for e in await model.create_chat_completion(_chat_request())]
    assert "migration_limit is used up" in json.loads(events[-2][6:])["error"]["message"]
    assert w.bodies["d1"] == []


async def test_a_non_streamed_answer_that_may_not_move_says_why():
    from kserve.protocol.rest.openai.types import ChatCompletionRequest, ErrorResponse

    w = TwoDecoders()
    model, _ = _model(w, limit=0)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=12)
    err = await model.create_chat_completion(req)
    assert isinstance(err, ErrorResponse) and "migration_limit is used up" in err.error.message
    assert w.bodies["d1"] == []
    await model.aclose()


async def test_two_migrations_append_the_text_once():
    class ThreeDecoders(TwoDecoders):
        def handler(self, req: httpx.Request) -> httpx.Response:
            host, body = req.url.host, json.loads(req.content)
            self.bodies.setdefault(host, []).append(body)
            if host in ("d0", "d1"):
                return httpx.Response(200, stream=_DyingStream(_sse(f"id-{host}", ["a" if host == "d0" else "b"])))
            return httpx.Response(200, content=b"".join(_sse("id-d2", ["c"]) + [b"data: [DONE]\n\n"]))

    from prometheus_client import CollectorRegistry

    from runtime.engines.client import VllmClient
    from runtime.server.metrics import RuntimeMetrics
    from runtime.server.model import PDModel
    from runtime.server.pairing import RoundRobinPairing

    w = ThreeDecoders()
    transport = httpx.MockTransport(w.handler)
    model = PDModel("m", RoundRobinPairing([], ["http://d0", "http://d1", "http://d2"], migration_limit=2),
                    metrics=RuntimeMetrics(CollectorRegistry()),
                    client_factory=lambda url: VllmClient(url, transport=transport))
    events = [e async for e in await model.create_chat_completion(_chat_request())]
    assert "".join(chunk_text(json.loads(e[6:])) for e in events[:-1]) == "abc"
    assert w.bodies["d2"][0]["messages"][-1] == {"role": "assistant", "content": "ab"}
    assert w.bodies["d2"][0]["max_tokens"] == 10


# --- reasoning and tool calls: generated output a continuation cannot replay -------------------------------

def test_reasoning_and_tool_call_chunks_are_generated_tokens_that_cannot_be_replayed():
    reasoning = {"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]}
    reasoning_new = {"choices": [{"index": 0, "delta": {"reasoning": "think"}}]}
    tool = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]}
    for chunk in (reasoning, reasoning_new, tool):
        assert chunk_progress(chunk) == ("", True, False), chunk
    assert chunk_progress({"choices": [{"index": 0, "delta": {"content": "Pa"}}]}) == ("Pa", True, True)


def test_chunk_progress_reads_text_generated_and_replayable():
    cases = [
        ({"choices": [{"index": 0, "delta": {"content": "Pa"}}]}, ("Pa", True, True)),
        ({"choices": [{"index": 0, "text": "ris"}]}, ("ris", True, True)),
        # a role-only delta, a finish reason alone, usage-only chunks: no generated token
        ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, ("", False, True)),
        ({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, ("", False, True)),
        ({"choices": [{"index": 0, "delta": None, "text": ""}]}, ("", False, True)),
        ({"choices": [], "usage": {"completion_tokens": 3}}, ("", False, True)),
        ({"usage": None}, ("", False, True)),
        # an empty reasoning key beside content is replayable; a tool call on any choice is not
        ({"choices": [{"index": 0, "delta": {"reasoning": "", "content": "x"}}]}, ("x", True, True)),
        ({"choices": [{"index": 0, "delta": {"content": "a"}},
                      {"index": 1, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]},
         ("a", True, False)),
        ({"choices": [{"index": 0, "delta": {"function_call": {"name": "f"}}}]}, ("", True, False)),
    ]
    for chunk, expected in cases:
        assert chunk_progress(chunk) == expected, chunk


class ReasoningThenDies(TwoDecoders):
    """d0 streams reasoning chunks (and optionally content) then dies; d1 would answer everything again."""

    def __init__(self, deltas: list[dict]):
        super().__init__()
        self.deltas = deltas

    def handler(self, req: httpx.Request) -> httpx.Response:
        host, body = req.url.host, json.loads(req.content)
        self.bodies[host].append(body)
        chunks = [f"data: {json.dumps({'id': 'id-' + host, 'choices': [{'index': 0, 'delta': d}]})}\n\n".encode()
                  for d in self.deltas]
        if host == "d0":
            return httpx.Response(200, stream=_DyingStream(chunks))
        return httpx.Response(200, content=b"".join(chunks + [b"data: [DONE]\n\n"]))


@pytest.mark.parametrize("deltas", [
    [{"reasoning_content": f"think{i} "} for i in range(4)],
    [{"reasoning": "think "}, {"content": "The"}],
    [{"tool_calls": [{"index": 0, "id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
])
async def test_a_stream_that_sent_reasoning_or_tool_calls_is_not_migrated_but_ends_with_an_error(deltas):
    w = ReasoningThenDies(deltas)
    model, reg = _model(w)
    events = [e async for e in await model.create_chat_completion(_chat_request())]
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == deltas  # each sent once, never repeated
    assert chunks[-1]["error"]["code"] == 502
    assert w.bodies["d1"] == []
    assert reg.get_sample_value("pdserve_requests_total", {"endpoint": "chat", "mode": "local", "status": "error"}) == 1
    await model.aclose()


# --- token counts from the worker's running usage: chunks holding several tokens, usage across attempts ----

class CoalescingDecoders(TwoDecoders):
    """Workers that answer as vLLM does with `continuous_usage_stats`: every chunk carries the running usage,
    and a chunk may hold several tokens (vLLM's API server merges outputs it fell behind on). A token is one
    word here; d0 sends two chunks of two tokens each, then dies."""

    def handler(self, req: httpx.Request) -> httpx.Response:
        host, body = req.url.host, json.loads(req.content)
        self.bodies[host].append(body)
        assert body["stream_options"]["continuous_usage_stats"] is True  # the runtime always asks for it
        prompt = len(" ".join(m["content"] for m in body["messages"]).split())
        pieces = ["The capital", " of France"] if host == "d0" else [" is", " Paris."][:body["max_tokens"]]
        done, out = 0, []
        for p in pieces:
            done += len(p.split())
            usage = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            chunk = {"id": "id-" + host, "choices": [{"index": 0, "delta": {"content": p}}], "usage": usage}
            out.append(f"data: {json.dumps(chunk)}\n\n".encode())
        if host == "d0":
            return httpx.Response(200, stream=_DyingStream(out))
        usage = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        out.append(f"data: {json.dumps({'id': 'id-d1', 'choices': [], 'usage': usage})}\n\n".encode())
        return httpx.Response(200, content=b"".join(out + [b"data: [DONE]\n\n"]))


@pytest.mark.parametrize("running", [False, True])
async def test_a_continuation_asks_for_the_tokens_left_and_the_usage_counts_every_attempt(running):
    from kserve.protocol.rest.openai.types import ChatCompletionRequest

    w = CoalescingDecoders()
    model, _ = _model(w)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Capital of France?"}],
                                max_tokens=6, temperature=0, stream=True,
                                stream_options={"include_usage": True, "continuous_usage_stats": running})
    events = [e async for e in await model.create_chat_completion(req)]
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(chunk_text(c) for c in chunks) == "The capital of France is Paris."
    # four tokens in two chunks were sent: the continuation may generate two more, not four
    assert w.bodies["d1"][0]["max_tokens"] == 2
    final = chunks[-1]
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    running_usage = [c.get("usage") for c in chunks[:-1]]
    if running:  # the client's running usage: its prompt, and every token so far across both workers
        assert [u["completion_tokens"] for u in running_usage] == [2, 4, 5, 6]
        assert {u["prompt_tokens"] for u in running_usage} == {3}
    else:
        assert running_usage == [None] * 4
    await model.aclose()


class SplitCharacterDecoders(TwoDecoders):
    """Completions workers that answer as vLLM does while a character's bytes span tokens: the tokens that end
    inside the character come with `text: ""` (vLLM's detokenizer holds their bytes back) though the running
    usage counts them. One token is one character of "ab🎉cd" here, the emoji two tokens (its first one
    sent as ""); d0 sends "a", "b" and the emoji's first token, then dies."""

    def handler(self, req: httpx.Request) -> httpx.Response:
        host, body = req.url.host, json.loads(req.content)
        self.bodies[host].append(body)
        if host == "d0":
            pieces = ["a", "b", ""]
        else:  # the continuation regenerates from after the text the client has
            pieces = {"ab": ["", "🎉", "c", "d"]}[body["prompt"][len("Say: "):]][:body["max_tokens"]]
        out = []
        for done, p in enumerate(pieces, 1):
            usage = {"prompt_tokens": 2, "completion_tokens": done, "total_tokens": 2 + done}
            chunk = {"id": "cmpl-" + host, "choices": [{"index": 0, "text": p}], "usage": usage}
            out.append(f"data: {json.dumps(chunk)}\n\n".encode())
        if host == "d0":
            return httpx.Response(200, stream=_DyingStream(out))
        usage = {"prompt_tokens": 2, "completion_tokens": len(pieces), "total_tokens": 2 + len(pieces)}
        out.append(f"data: {json.dumps({'id': 'cmpl-d1', 'choices': [], 'usage': usage})}\n\n".encode())
        return httpx.Response(200, content=b"".join(out + [b"data: [DONE]\n\n"]))


async def test_tokens_whose_text_was_held_back_are_generated_again_not_counted_as_sent():
    from kserve.protocol.rest.openai.types import CompletionRequest

    w = SplitCharacterDecoders()
    model, _ = _model(w)
    req = CompletionRequest(model="m", prompt="Say: ", max_tokens=6, temperature=0, stream=True,
                            stream_options={"include_usage": True})
    events = [e async for e in await model.create_completion(req)]
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    # two tokens reached the client as text; the third (half the emoji) did not: the continuation, prompted
    # with "ab", makes both halves of the emoji again, so its budget is 6 - 2, not 6 - 3
    assert w.bodies["d1"][0]["max_tokens"] == 4
    assert "".join(chunk_text(c) for c in chunks) == "ab🎉cd"
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    await model.aclose()


async def test_a_client_that_did_not_ask_for_usage_gets_none_though_the_workers_send_it():
    w = CoalescingDecoders()
    model, _ = _model(w)
    events = [e async for e in await model.create_chat_completion(_chat_request())]
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"]
    await model.aclose()


def test_a_trailing_usage_is_cut_from_the_workers_bytes_and_anything_else_is_left_to_re_encoding():
    import orjson

    from runtime.server.model import _without_trailing_usage

    usage = b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":null}'
    data = b'{"id":"x","choices":[{"index":0,"delta":{"content":"say \\"usage\\":"}}],' + usage + b"}"
    chunk = orjson.loads(data)
    cut = _without_trailing_usage(data, chunk)
    assert orjson.loads(cut) == {k: v for k, v in chunk.items() if k != "usage"}
    for other in (b'{"id":"x","usage":{"a":1},"choices":[]}',  # usage not last
                  b'{"id": "x", "choices": [], "usage": {"a": 1}}'):  # not compact
        assert _without_trailing_usage(other, orjson.loads(other)) is None


async def test_a_continued_chat_stream_opens_the_assistant_message_once():
    class RoleFirst(TwoDecoders):  # each worker opens its stream with a role-only delta, as vLLM does
        def handler(self, req: httpx.Request) -> httpx.Response:
            host = req.url.host
            self.bodies[host].append(json.loads(req.content))
            opening = {"id": "id-" + host, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            role = [f"data: {json.dumps(opening)}\n\n".encode()]
            if host == "d0":
                return httpx.Response(200, stream=_DyingStream(role + _sse("id-d0", ["The", " capital"])))
            rest = _sse("id-d1", [" is", " Paris."]) + [b"data: [DONE]\n\n"]
            return httpx.Response(200, content=b"".join(role + rest))

    model, _ = _model(RoleFirst())
    events = [e async for e in await model.create_chat_completion(_chat_request())]
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert sum("role" in c["choices"][0]["delta"] for c in chunks) == 1
    assert "".join(chunk_text(c) for c in chunks) == "The capital is Paris."
    await model.aclose()


class FinishesThenDies(TwoDecoders):
    """d0 sends the whole answer, its finish reason (and, with `final_usage`, the usage-only chunk) and then
    drops the connection before `data: [DONE]`."""

    def __init__(self, final_usage: bool):
        super().__init__()
        self.final_usage = final_usage

    def handler(self, req: httpx.Request) -> httpx.Response:
        host, body = req.url.host, json.loads(req.content)
        self.bodies[host].append(body)
        out = []
        for k, (text, finish) in enumerate([("Paris", None), (".", "stop")], 1):
            usage = {"prompt_tokens": 5, "completion_tokens": k, "total_tokens": 5 + k,
                     "prompt_tokens_details": {"cached_tokens": 4}}
            out.append({"id": "id-" + host, "choices": [{"index": 0, "delta": {"content": text},
                                                         "finish_reason": finish}], "usage": usage})
        if self.final_usage:
            out.append({"id": "id-" + host, "choices": [], "usage": out[-1]["usage"]})
        return httpx.Response(200, stream=_DyingStream([f"data: {json.dumps(c)}\n\n".encode() for c in out]))


@pytest.mark.parametrize("final_usage", [False, True])
async def test_a_worker_that_dies_after_the_finish_reason_ends_the_answer_it_gave_not_a_continuation(final_usage):
    from kserve.protocol.rest.openai.types import ChatCompletionRequest

    w = FinishesThenDies(final_usage)
    model, reg = _model(w)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Capital of France?"}],
                                max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    events = [e async for e in await model.create_chat_completion(req)]
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(chunk_text(c) for c in chunks) == "Paris."
    assert [c for c in chunks if "error" in c] == [] and w.bodies["d1"] == []  # no continuation after the end
    usage = [c["usage"] for c in chunks if not c.get("choices")]
    assert usage == [{"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                      "prompt_tokens_details": {"cached_tokens": 4}}]  # exactly one, the worker's own
    assert reg.get_sample_value("pdserve_requests_total", {"endpoint": "chat", "mode": "local", "status": "ok"}) == 1
    await model.aclose()


def test_a_continuations_usage_is_the_clients_request_whatever_the_worker_reports():
    from runtime.server.model import _stream_usage

    cont = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
            "prompt_tokens_details": {"cached_tokens": 8}}
    # the client's prompt, every attempt's tokens, and no cached count of the continuation's longer prompt
    assert _stream_usage(cont, 5, 4) == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    # a worker that sent no running usage before: the prompt is the continuation's, the tokens still add up
    assert _stream_usage(cont, None, 4) == {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}
    assert _stream_usage(cont, 9, 0) is cont  # nothing generated before: the worker's own usage
    assert _stream_usage({"prompt_tokens": "x", "completion_tokens": None}, None, 3)["completion_tokens"] == 3


class TwoChoicesThenDies(TwoDecoders):
    """d0 serves a two-choice stream whole: choice 0 finishes, choice 1 is cut off by the connection's end."""

    def handler(self, req: httpx.Request) -> httpx.Response:
        host, body = req.url.host, json.loads(req.content)
        self.bodies[host].append(body)
        out = [{"id": "c", "object": "text_completion", "choices": [{"index": i, "text": t, "finish_reason": f}]}
               for i, t, f in ((0, "A", None), (1, "B", None), (0, "", "stop"), (1, "B", None))]
        return httpx.Response(200, stream=_DyingStream([f"data: {json.dumps(c)}\n\n".encode() for c in out]))


async def test_a_stream_of_several_choices_is_answered_only_when_every_choice_finished():
    """One choice's finish reason is not the end of a stream that holds two: the worker dying before the
    other's is an error, never a silently cut answer."""
    from kserve.protocol.rest.openai.types import CompletionRequest

    w = TwoChoicesThenDies()
    model, reg = _model(w)
    # beam search is served whole on the decode worker (no fan-out), so one stream holds both choices
    req = CompletionRequest(model="m", prompt="Capital of France?", max_tokens=12, n=2, use_beam_search=True,
                            stream=True)
    events = [e async for e in await model.create_completion(req)]
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "error" in chunks[-1], chunks
    assert reg.get_sample_value("pdserve_requests_total",
                                {"endpoint": "completions", "mode": "local", "status": "error"}) == 1
    await model.aclose()


class FirstRefuses(TwoDecoders):
    """d0 refuses the connection (dead before its breaker noticed); d1 streams a completion and its [DONE]."""

    def handler(self, req: httpx.Request) -> httpx.Response:
        host, body = req.url.host, json.loads(req.content)
        self.bodies[host].append(body)
        if host == "d0":
            raise httpx.ConnectError("connection refused", request=req)
        chunks = [{"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": t, "finish_reason": f}]}
                  for t, f in (("Par", None), ("is", "length"))]
        return httpx.Response(200, content=b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks)
                              + b"data: [DONE]\n\n")


@pytest.mark.parametrize("extra", [{"prompt": [1, 2, 3]}, {"prompt": "x", "echo": True}])
async def test_a_stream_no_continuation_can_carry_goes_whole_to_another_worker_before_its_first_chunk(extra):
    """Nothing was sent yet: the request itself moves, whatever its shape (a token-id prompt or echo cannot be
    continued after text was sent, but they need no continuation here)."""
    from kserve.protocol.rest.openai.types import CompletionRequest

    w = FirstRefuses()
    model, reg = _model(w)
    events = [e async for e in await model.create_completion(
        CompletionRequest(model="m", max_tokens=2, stream=True, **extra))]
    assert events[-1] == "data: [DONE]\n\n" and not any('"error"' in e for e in events)
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == "Paris"
    assert w.bodies["d1"][0]["prompt"] == extra["prompt"] and w.bodies["d1"][0]["max_tokens"] == 2
    assert reg.get_sample_value("pdserve_migrations_total") == 1
    await model.aclose()


async def test_a_migration_no_continuation_can_carry_is_not_counted():
    from kserve.protocol.rest.openai.types import CompletionRequest

    class SendsThenDies(TwoDecoders):
        def handler(self, req: httpx.Request) -> httpx.Response:
            self.bodies[req.url.host].append(json.loads(req.content))
            chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "Par"}]}
            return httpx.Response(200, stream=_DyingStream([f"data: {json.dumps(chunk)}\n\n".encode()]))

    w = SendsThenDies()
    model, reg = _model(w)
    events = [e async for e in await model.create_completion(
        CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=5, stream=True))]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]\n\n" and w.bodies["d1"] == []
    assert (reg.get_sample_value("pdserve_migrations_total") or 0) == 0
    await model.aclose()


def test_a_plain_text_response_format_does_not_stop_a_continuation():
    out = continuation_body(COMPL, {"prompt": "x", "max_tokens": 9, "response_format": {"type": "text"}}, "ab", 2)
    assert out is not None and out["prompt"] == "xab" and out["max_tokens"] == 7


# --- a worker that shuts down answers its requests as aborted ----------------------------------------------

class AbortsThenContinues(TwoDecoders):
    """d0 answers as vLLM 0.28 does when SIGTERM ends its engine (shutdown mode "abort", or the end of
    `--shutdown-timeout`): the stream's next chunk finishes the choice with "abort" (with `flushed` text held back
    for a stop string, else none), then `data: [DONE]`, a clean end; a non-streamed request gets a 200 whose
    choice is cut short with "abort". d1 serves normally."""

    def __init__(self, flushed: str = ""):
        super().__init__()
        self.flushed = flushed

    def handler(self, req: httpx.Request) -> httpx.Response:
        host, body = req.url.host, json.loads(req.content)
        self.bodies[host].append(body)
        if not body.get("stream"):
            text, finish = ("The capital", "abort") if host == "d0" else ("Paris.", "stop")
            return httpx.Response(200, json={
                "id": f"id-{host}", "object": "chat.completion", "created": 1_700_000_000, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
        if host == "d0":
            abort = {"id": "id-d0", "choices": [{"index": 0, "delta": {"content": self.flushed} if self.flushed else {},
                                                 "finish_reason": "abort"}]}
            chunks = _sse("id-d0", ["The", " capital"]) + [f"data: {json.dumps(abort)}\n\n".encode(),
                                                           b"data: [DONE]\n\n"]
        else:
            chunks = _sse("id-d1", [" of", " France"]) + [
                f"data: {json.dumps({'id': 'id-d1', 'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}"
                "\n\n".encode(), b"data: [DONE]\n\n"]
        return httpx.Response(200, content=b"".join(chunks))


@pytest.mark.parametrize("flushed", ["", " held"])
async def test_a_stream_the_worker_aborts_continues_on_another_worker_never_ends_as_aborted(flushed):
    w = AbortsThenContinues(flushed)
    model, reg = _model(w)
    events = [e async for e in await model.create_chat_completion(_chat_request())]
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(chunk_text(c) for c in chunks) == f"The capital{flushed} of France"
    reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    assert reasons.count("stop") == 1 and "abort" not in reasons and reasons[-1] == "stop"
    assert w.bodies["d1"][0]["messages"][-1] == {"role": "assistant", "content": f"The capital{flushed}"}
    assert reg.get_sample_value("pdserve_migrations_total") == 1
    assert reg.get_sample_value("pdserve_requests_total", {"endpoint": "chat", "mode": "migrated", "status": "ok"}) == 1
    await model.aclose()


async def test_a_non_streamed_answer_the_worker_aborted_is_served_again_by_another_worker():
    from kserve.protocol.rest.openai.types import ChatCompletionRequest

    w = AbortsThenContinues()
    model, reg = _model(w)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Capital of France?"}],
                                max_tokens=12, temperature=0)
    answer = (await model.create_chat_completion(req)).model_dump()
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["choices"][0]["message"]["content"] == "Paris."
    assert len(w.bodies["d0"]) == 1 and w.bodies["d1"][0]["messages"] == w.bodies["d0"][0]["messages"]
    assert reg.get_sample_value("pdserve_migrations_total") == 1
    await model.aclose()


class RefusesThenServes(TwoDecoders):
    """d0 answers `status` at the door, before any output (vLLM: 500 once its engine is gone, e.g. a leg that
    lands between a drained pod's engine shutdown and its HTTP server's close); d1 serves normally."""

    def __init__(self, status: int):
        super().__init__()
        self.status = status

    def handler(self, req: httpx.Request) -> httpx.Response:
        host, body = req.url.host, json.loads(req.content)
        self.bodies[host].append(body)
        if host == "d0":
            return httpx.Response(self.status, json={"error": {"message": "EngineCore encountered an issue",
                                                               "type": "InternalServerError", "code": self.status}})
        if not body.get("stream"):
            return httpx.Response(200, json={
                "id": "id-d1", "object": "chat.completion", "created": 1_700_000_000, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
        chunks = _sse("id-d1", ["Paris", "."]) + [
            f"data: {json.dumps({'id': 'id-d1', 'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}"
            "\n\n".encode(), b"data: [DONE]\n\n"]
        return httpx.Response(200, content=b"".join(chunks))


@pytest.mark.parametrize("stream", [True, False])
async def test_a_worker_that_fails_a_request_before_any_output_is_not_the_clients_answer(stream):
    w = RefusesThenServes(500)
    model, reg = _model(w)
    req = _chat_request().model_copy(update={"stream": stream})
    if stream:
        events = [e async for e in await model.create_chat_completion(req)]
        assert events[-1] == "data: [DONE]\n\n"
        assert "".join(chunk_text(json.loads(e[6:])) for e in events[:-1]) == "Paris."
    else:
        answer = (await model.create_chat_completion(req)).model_dump()
        assert answer["choices"][0]["message"]["content"] == "Paris."
    assert len(w.bodies["d0"]) == 1 and w.bodies["d1"][0]["messages"] == w.bodies["d0"][0]["messages"]
    assert reg.get_sample_value("pdserve_migrations_total") == 1
    await model.aclose()


async def test_a_slow_worker_is_not_failed_over():
    """504 is the runtime's own read timeout: the worker is still generating, so the request is not served
    twice; the client gets the error."""
    w = RefusesThenServes(504)
    model, reg = _model(w)
    answer = await model.create_chat_completion(_chat_request().model_copy(update={"stream": False}))
    assert answer.error.code == 504
    assert w.bodies["d1"] == [] and not reg.get_sample_value("pdserve_migrations_total")
    await model.aclose()


# --- a worker judged down (its breaker opened) holding calls that receive nothing: real loopback servers ---------

# The silence bound and stall window of the tests below that must tell a live stream from a silent one: longer
# than any pause a loaded machine gives this process (the stand-in workers run in it too, so a pause silences a
# producing stream for as long), and the stand-ins' gaps are set from it.
STALL_S = 2.5


class LoopbackWorkers:
    """Raw HTTP workers on 127.0.0.1 (`asyncio.start_server`), each in its `mode`: "ok" streams (or answers
    whole) `max_tokens` words "w{k} " (k from the number of such words in the prompt, so a continuation goes on
    where the text sent ends); "hang" reads the request and never answers; "stall" streams 2 words, then
    nothing; "slow" streams a word every STALL_S / 5 s; "slower" a word every STALL_S / 4 s; "queued" sends a
    stream's head at once and its first word STALL_S + 1 s later (a queue wait), then the rest at once; "prefill"
    answers a prefill leg with
    `KV`. A GET (a health check) is answered 200 in every mode. `bodies` records each worker's POSTs."""

    def __init__(self, **modes: str):
        self.modes = modes
        self.bodies: dict[str, list[dict]] = {name: [] for name in modes}
        self.urls: dict[str, str] = {}
        self._servers: list = []

    async def __aenter__(self) -> "LoopbackWorkers":
        import asyncio

        for name in self.modes:
            server = await asyncio.start_server(lambda r, w, n=name: self._serve(n, r, w), "127.0.0.1", 0)
            self._servers.append(server)
            self.urls[name] = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        for server in self._servers:
            server.close()

    async def _serve(self, name: str, reader, writer) -> None:
        import asyncio
        import re

        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = json.loads(await reader.readexactly(length)) if length else {}
                if head.startswith(b"GET "):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self.bodies[name].append(body)
                mode = self.modes[name]
                if mode == "hang":
                    await asyncio.sleep(60)
                if mode == "prefill":
                    raw = json.dumps({"id": "p", "choices": [{"index": 0, "text": "w0 "}],
                                      "kv_transfer_params": KV_PARAMS}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(raw), raw))
                    await writer.drain()
                    continue
                off = len(re.findall(r"w\d+ ", body.get("prompt", "")))
                words = [f"w{off + i} " for i in range(body.get("max_tokens", 16))]
                if not body.get("stream"):
                    raw = json.dumps({"id": f"id-{name}", "object": "text_completion", "created": 1, "model": "m",
                                      "choices": [{"index": 0, "text": "".join(words), "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 2, "completion_tokens": len(words),
                                                "total_tokens": 2 + len(words)}}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(raw), raw))
                    await writer.drain()
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for i, word in enumerate(words):
                    if mode == "stall" and i == 2:
                        await asyncio.sleep(60)
                    if mode == "slow":
                        await asyncio.sleep(STALL_S / 5)
                    if mode == "slower" or (mode == "queued" and i == 0):
                        await asyncio.sleep(STALL_S / 4 if mode == "slower" else STALL_S + 1.0)
                    last = i == len(words) - 1
                    event = b"data: " + json.dumps({"id": f"id-{name}", "object": "text_completion", "created": 1,
                                                    "model": "m", "choices": [{"index": 0, "text": word,
                                                    "finish_reason": "length" if last else None}]}).encode() + b"\n\n"
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


KV_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
             "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 1}


def _loopback_model(w: LoopbackWorkers, prefill: list[str] = (), **kw):
    from prometheus_client import CollectorRegistry

    from runtime.server.metrics import RuntimeMetrics
    from runtime.server.model import PDModel
    from runtime.server.pairing import RoundRobinPairing

    reg = CollectorRegistry()
    pairing = RoundRobinPairing([w.urls[p] for p in prefill], [w.urls["d0"], w.urls["d1"]])
    model = PDModel("m", pairing, metrics=RuntimeMetrics(reg), **kw)
    for url in w.urls.values():
        model.breakers.record_check(url, True)  # answered a check: not a starting worker
    return model, reg


async def _until(cond, timeout_s: float = 10.0) -> None:
    """Wait (polling every 10 ms) until `cond()` is true; AssertionError after `timeout_s`."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _judge_down(model, url: str) -> None:
    for _ in range(model.overload.breaker_failures):
        model.breakers.record_check(url, False)


async def _serve_text(model, stream: bool) -> str:
    from kserve.protocol.rest.openai.types import CompletionRequest

    req = CompletionRequest(model="m", prompt="hello there", max_tokens=6, stream=stream)
    answer = await model.create_completion(req)
    if not stream:
        return answer.choices[0].text
    events = [e async for e in answer]
    assert events[-1] == "data: [DONE]\n\n" and not any('"error"' in e for e in events), events
    return "".join(chunk_text(json.loads(e[6:])) for e in events[:-1])


@pytest.mark.parametrize("mode, stream", [("hang", True), ("hang", False), ("stall", True)],
                         ids=["hung-stream", "hung-whole", "stalled-mid-stream"])
async def test_calls_silent_on_a_worker_judged_down_move_to_another(mode, stream):
    """d0 accepts the request and then sends nothing (before its answer, or after two words): once its breaker
    opens, the call, silent for longer than the bound, is abandoned as a dead worker's and the request moves:
    whole before any output, as a continuation of the words sent mid-stream. Not after the read timeout."""
    import asyncio

    async with LoopbackWorkers(d0=mode, d1="ok") as w:
        model, reg = _loopback_model(w)
        model.breakers.silent_s = 0.3
        try:
            task = asyncio.create_task(_serve_text(model, stream))
            await _until(lambda: w.bodies["d0"])
            await asyncio.sleep(0.5)  # silent for longer than the bound (a pause only lengthens it)
            assert len(w.bodies["d0"]) == 1 and not task.done()
            await _judge_down(model, w.urls["d0"])
            assert await asyncio.wait_for(task, 5) == "w0 w1 w2 w3 w4 w5 "
        finally:
            await model.aclose()
    assert reg.get_sample_value("pdserve_migrations_total") == 1
    if mode == "stall":
        assert w.bodies["d1"][0]["prompt"] == "hello therew0 w1 " and w.bodies["d1"][0]["max_tokens"] == 4


async def test_a_stream_still_producing_on_a_worker_judged_down_is_not_cut():
    import asyncio

    async with LoopbackWorkers(d0="slow", d1="ok") as w:
        model, reg = _loopback_model(w)
        model.breakers.silent_s = STALL_S
        try:
            task = asyncio.create_task(_serve_text(model, True))
            await _until(lambda: w.bodies["d0"])
            await _judge_down(model, w.urls["d0"])
            while not task.done():  # the stream lasts longer than the bound: silence counts from the last word
                await asyncio.sleep(0.1)
                model._abandon_silent(w.urls["d0"], model.breakers.silent_s)  # as each check round does
            assert await asyncio.wait_for(task, 30) == "w0 w1 w2 w3 w4 w5 "
        finally:
            await model.aclose()
    assert w.bodies["d1"] == [] and not reg.get_sample_value("pdserve_migrations_total")


async def _check_rounds(model, interval_s: float = 0.05) -> None:
    """The runtime's check loop (runtime.server.app), every `interval_s` seconds."""
    from runtime.server.breakers import check_loop

    await check_loop(model.breakers, model.worker_healthy, interval_s=interval_s)


@pytest.mark.parametrize("mode", ["queued", "slower"], ids=["first-token-after-the-window", "slow-stream"])
async def test_a_live_worker_is_not_stalled_by_a_queue_wait_or_slow_tokens(mode):
    """Check rounds with a stall window of STALL_S: d0's stream waits 1 s longer for its first word (queued in
    the engine), or gets a word every STALL_S / 4: neither is a stall, so d0 stays in rotation and serves the
    whole answer."""
    import asyncio

    from runtime.config import OverloadSpec
    from runtime.router.breaker import BreakerState

    async with LoopbackWorkers(d0=mode, d1="ok") as w:
        model, reg = _loopback_model(w, overload=OverloadSpec(breaker_stall_s=STALL_S))
        checks = asyncio.create_task(_check_rounds(model))
        try:
            task = asyncio.create_task(_serve_text(model, True))
            states = []
            while not task.done():
                states.append(model.breakers.state(w.urls["d0"]))
                await asyncio.sleep(0.05)
            assert await task == "w0 w1 w2 w3 w4 w5 "
            assert len(states) > 15 and set(states) == {BreakerState.CLOSED}
        finally:
            checks.cancel()
            await model.aclose()
    assert len(w.bodies["d0"]) == 1 and w.bodies["d1"] == [] and not reg.get_sample_value("pdserve_migrations_total")


def _standin(port: int, *extra: str):
    import subprocess
    import sys

    from runtime.paths import REPO_ROOT

    return subprocess.Popen([sys.executable, str(REPO_ROOT / "bench/engine_standin.py"), "--port", str(port),
                             "--model", "m", "--token-interval-ms", "20", *extra])


async def test_a_stalled_worker_whose_health_answers_loses_its_stream_to_another_worker(caplog):
    """Real processes: d0 (bench/engine_standin.py --stall-after 3) streams 3 tokens and then nothing while its
    /health answers. With a stall window of 0.5 s, check rounds judge it stalled, its breaker opens and its
    stream moves to d1 as a continuation: the client gets the whole answer d1 alone gives, in seconds, not
    after the 60 s read timeout."""
    import asyncio
    import logging
    import time

    import httpx

    from runtime.config import OverloadSpec
    from runtime.engines.vllm_worker import free_port
    from runtime.router.breaker import BreakerState

    ports = [free_port(), free_port()]
    procs = [_standin(ports[0], "--stall-after", "3"), _standin(ports[1])]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    w = LoopbackWorkers()
    w.urls = {"d0": urls[0], "d1": urls[1]}
    caplog.set_level(logging.WARNING, logger="runtime.server.breakers")
    try:
        async with httpx.AsyncClient() as http:
            for url in urls:
                for _ in range(200):
                    try:
                        if (await http.get(url + "/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.05)
            model, reg = _loopback_model(w, overload=OverloadSpec(breaker_stall_s=0.5), timeout_s=60.0)
            checks = asyncio.create_task(_check_rounds(model))
            try:
                t0 = time.monotonic()
                text = await asyncio.wait_for(_serve_standin(model), 20)
                took = time.monotonic() - t0
                state = model.breakers.state(urls[0])
            finally:
                checks.cancel()
                await model.aclose()
            stats = [(await http.get(url + "/stats")).json() for url in urls]
            healthy = (await http.get(urls[0] + "/health")).status_code
    finally:
        for proc in procs:
            stop_process(proc, 10.0)
    assert text == "".join(f"t{i} " for i in range(8))  # d1's own answer to the request: nothing lost or repeated
    assert took < 10 and state is not BreakerState.CLOSED and healthy == 200
    assert stats[0]["requests"] == 1 and stats[1]["requests"] == 1
    assert reg.get_sample_value("pdserve_migrations_total") == 1
    assert any("stalled" in r.getMessage() for r in caplog.records)


async def _serve_standin(model) -> str:
    from kserve.protocol.rest.openai.types import CompletionRequest

    answer = await model.create_completion(CompletionRequest(model="m", prompt="hello", max_tokens=8, stream=True))
    events = [e async for e in answer]
    assert events[-1] == "data: [DONE]\n\n" and not any('"error"' in e for e in events), events
    return "".join(chunk_text(json.loads(e[6:])) for e in events[:-1])


async def test_the_kv_lease_retry_avoids_a_decode_worker_judged_down():
    """The decode leg on the handoff shows no first token before the lease's deadline; its worker's breaker
    opened meanwhile (its call not yet silent for the bound): the retry without the handoff goes to another
    decode worker, not to the worker judged down again."""
    import asyncio

    async with LoopbackWorkers(p="prefill", d0="hang", d1="ok") as w:
        # the lease's deadline (2.5 s after the handoff) leaves room for a pause before d0 is judged down
        model, reg = _loopback_model(w, prefill=["p"], kv_lease_s=3.0, kv_lease_margin_s=0.5)
        model.breakers.silent_s = 100.0
        try:
            task = asyncio.create_task(_serve_text(model, True))
            await _until(lambda: w.bodies["d0"])
            assert len(w.bodies["d0"]) == 1
            await _judge_down(model, w.urls["d0"])
            assert await asyncio.wait_for(task, 5) == "w0 w1 w2 w3 w4 w5 "
        finally:
            await model.aclose()
    assert len(w.bodies["d0"]) == 1 and "kv_transfer_params" not in w.bodies["d1"][0]


@pytest.mark.parametrize("cut, d0_state", [
    ([], "OPEN"),  # the body ends, cleanly framed, without [DONE]: the worker's server stopped (via a proxy)
    ([b'data: {"id": "x", "choices": [\n\n', *_sse("id-d0", [" of"]), b"data: [DONE]\n\n"], "CLOSED"),  # not JSON
    ([b'data: {"id": "x", "choices": 3}\n\n'], "CLOSED"),  # JSON, but not a completion chunk
], ids=["end-without-done", "invalid-json-event", "not-a-chunk"])
async def test_a_stream_cut_cleanly_or_broken_mid_answer_continues_on_another_worker(cut, d0_state):
    """After two tokens d0's stream ends without `data: [DONE]`, or carries an event that is not an OpenAI
    chunk: the words sent are sound, so the stream continues on d1 as after a reset. A clean end counts as
    the worker gone (its breaker opens); a broken event as one failure (a request-specific fault must not take
    every worker out it migrates to)."""
    from runtime.router.breaker import BreakerState

    w = TwoDecoders()
    w.handler_d0 = lambda: httpx.Response(200, content=b"".join(_sse("id-d0", ["The", " capital"]) + cut))
    base = w.handler

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "d0":
            w.bodies["d0"].append(json.loads(req.content))
            return w.handler_d0()
        return base(req)

    w.handler = handler
    model, reg = _model(w)
    events = [e async for e in await model.create_chat_completion(_chat_request())]
    assert events[-1] == "data: [DONE]\n\n" and not any('"error"' in e for e in events), events
    assert "".join(chunk_text(json.loads(e[6:])) for e in events[:-1]) == "The capital of France is Paris."
    assert w.bodies["d1"][0]["messages"][-1] == {"role": "assistant", "content": "The capital"}
    assert reg.get_sample_value("pdserve_migrations_total") == 1
    assert model.breakers.state("http://d0") is BreakerState[d0_state]
