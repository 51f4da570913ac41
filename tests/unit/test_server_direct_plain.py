"""Plain requests skip the request model (runtime.server.direct.plain_request) and lose nothing by it.

Specification, checked against the installed vLLM's request models (ChatCompletionRequest,
CompletionRequest), so that a vLLM upgrade that adds a check or a field the plain path does not know fails
here: every body `plain_request` takes, the request model validates too, and the body PDModel sends the
workers (`_request_body`) is the same from either; bodies it declines (a field it does not know, a value of
another JSON type, `stream_options` without `stream`, an empty prompt) go to the request model; the direct
server serves a plain body without validating it and validates any other.
"""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("kserve")

from kserve.protocol.rest.openai.types import ChatCompletionRequest, CompletionRequest  # noqa: E402

from runtime.server.direct import _RawBody, plain_request  # noqa: E402
from runtime.server.model import PDModel  # noqa: E402

ints = st.one_of(st.integers(-3, 70000), st.sampled_from([2 ** 63 - 1, 2 ** 63, -(2 ** 63), -(2 ** 63) - 1]))
numbers = st.one_of(ints, st.floats(-5, 5, allow_nan=False), st.none())
text = st.text(max_size=12)
plain_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                       "content": text}, optional={"name": text})
# what a body may hold besides: values of other JSON types (which the request model may coerce or refuse),
# other roles, message fields and request fields; the plain path must decline each or keep its meaning
odd_value = st.one_of(st.booleans(), st.text(max_size=3), st.just([]), st.just({}), st.none(), st.floats(0, 2),
                      st.integers(-2, 2), st.just([{"type": "text", "text": "hi"}]))
odd_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["tool", "function", "bot", "user"]), "content": odd_value}),
    st.fixed_dictionaries({"role": st.just("user"), "content": text, "tool_call_id": text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": text, "name": st.integers(0, 3)}))
common = {"model": st.just("m"), "stream": st.one_of(st.booleans(), st.none()),
          "stream_options": st.one_of(st.none(), st.fixed_dictionaries(
              {}, optional={"include_usage": st.one_of(st.booleans(), st.none()),
                            "continuous_usage_stats": st.booleans()})),
          "max_tokens": ints, "temperature": numbers, "top_p": numbers, "user": st.one_of(text, st.none())}
FIELDS = ["model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "user", "messages", "prompt", "n", "seed", "tools", "logprobs", "stop", "extra_field"]


@st.composite
def bodies(draw, chat: bool) -> dict:
    """A plain body, or one with a field changed to a value (or a message) the plain path must judge."""
    if chat:
        body = draw(st.fixed_dictionaries({"messages": st.lists(plain_message, min_size=1, max_size=3)},
                                          optional={**common, "max_completion_tokens": ints}))
    else:
        body = draw(st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=12)}, optional=common))
    change = draw(st.sampled_from(["none", "value", "message"]))
    if change == "value":
        body[draw(st.sampled_from(FIELDS))] = draw(odd_value)
    elif change == "message" and chat:
        body["messages"] = [*body["messages"], draw(odd_message)]
    return body


chat_bodies, completion_bodies = bodies(True), bodies(False)


def _validated(chat: bool, body: dict):
    try:
        return (ChatCompletionRequest if chat else CompletionRequest).model_validate(json.loads(json.dumps(body)))
    except Exception:  # noqa: BLE001 - pydantic's ValidationError or vLLM's own validator errors
        return None


def _sent(request, body: dict) -> dict:
    """The body PDModel sends the workers for `request` (read from `body` as the edge parsed it)."""
    model = types.SimpleNamespace(name="served")
    return asyncio.run(PDModel._request_body(model, request, _RawBody(json.loads(json.dumps(body)), {})))


def _check(chat: bool, body: dict) -> bool:
    plain = plain_request(chat, json.loads(json.dumps(body)))
    if plain is None:
        return False
    validated = _validated(chat, body)
    assert validated is not None, f"the plain path took a body the request model refuses: {body}"
    assert _sent(plain, body) == _sent(validated, body), body
    assert bool(plain.stream) == bool(validated.stream)
    return True


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat_bodies)
def test_every_plain_chat_body_is_one_the_request_model_takes_and_sends_the_same(body):
    _check(True, body)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion_bodies)
def test_every_plain_completions_body_is_one_the_request_model_takes_and_sends_the_same(body):
    _check(False, body)


def test_common_request_shapes_are_plain_and_others_are_not():
    chat = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_tokens": 16, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    assert _check(True, chat)
    assert plain_request(True, chat).temperature == 0.0 and type(plain_request(True, chat).temperature) is float
    assert _check(False, {"model": "m", "prompt": "Once upon", "max_tokens": 8, "top_p": 0.9})
    for chat_body, body in [
        (True, {**chat, "stream": False}),  # stream_options without stream: vLLM's validator refuses it
        (True, {**chat, "tools": []}),  # a field the plain path does not know
        (True, {**chat, "max_tokens": 16.0}),  # a float the request model turns into an int
        (True, {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        (True, {**chat, "messages": []}),
        (True, {"model": "m", "max_tokens": 4}),  # no messages
        (False, {"model": "m", "prompt": ""}),  # vLLM refuses an empty prompt
        (False, {"model": "m", "prompt": [1, 2]}),  # token ids: the request model reads them
        (False, {"model": "m", "prompt": "x", "max_tokens": None}),  # vLLM sets its default (16)
    ]:
        assert plain_request(chat_body, body) is None, body


def test_the_direct_server_serves_a_plain_body_without_the_request_model(monkeypatch):
    from tests.unit.test_server_direct import CHAT, CHAT_BODY, _ask

    calls = []
    real = ChatCompletionRequest.model_validate.__func__

    def counting(cls, *a, **kw):
        calls.append(a)
        return real(cls, *a, **kw)

    monkeypatch.setattr(ChatCompletionRequest, "model_validate", classmethod(counting))
    taken: list[bool] = []
    answer = asyncio.run(_ask(True, taken, CHAT, json=CHAT_BODY))
    assert taken == [True] and answer[0] == 200 and calls == []
    answer = asyncio.run(_ask(True, taken, CHAT, json={**CHAT_BODY, "n": 1}))  # not plain: validated
    assert taken == [True, True] and answer[0] == 200 and len(calls) == 1
