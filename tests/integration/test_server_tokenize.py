"""Prompt tokenization for routing (runtime.server.tokenize) with the real SmolLM2 tokenizer.

Specification: chat prompts are the chat template rendered with the generation prompt, encoded without
extra special tokens; completion prompts are encoded as vLLM does; token-id prompts pass through; what cannot
be tokenized here (batches, malformed messages) gives None so the request is routed on load alone.
(Equality with vLLM's own /tokenize is checked end to end in tests/e2e/test_server_router.py.)
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from runtime.server.tokenize import PromptTokenizer

    return PromptTokenizer(smollm2_dir)


def test_chat_prompt_ends_with_the_assistant_generation_prompt(tok):
    ids = tok.chat_token_ids({"messages": [{"role": "user", "content": "Hi"}]})
    text = tok.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_continue_final_message_leaves_the_assistant_turn_open(tok):
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
            "add_generation_prompt": False, "continue_final_message": True}
    assert tok.tokenizer.decode(tok.chat_token_ids(body)).endswith("<|im_start|>assistant\nHello")


def test_same_prefix_gives_same_leading_tokens(tok):
    a = tok.completion_token_ids({"prompt": "The quick brown fox jumps over the lazy dog. " * 5})
    b = tok.completion_token_ids({"prompt": "The quick brown fox jumps over the lazy dog. " * 5 + "And more."})
    assert b[: len(a) - 1] == a[:-1]


def test_token_id_prompts_pass_through_and_batches_are_not_tokenized(tok):
    assert tok.completion_token_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.completion_token_ids({"prompt": ["a", "b"]}) is None
    assert tok.chat_token_ids({"messages": "not a list"}) is None
    assert tok.token_ids("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})


# A request never chooses the template the router renders (vLLM refuses a request template unless started
# with --trust-request-chat-template); only plain data from chat_template_kwargs reaches the served template.
INJECTED = "INJECTED {{ messages[0]['content'] }}"
HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body", [
    {"messages": HI, "chat_template_kwargs": {"chat_template": INJECTED}},
    {"messages": HI, "chat_template": INJECTED},
    {"messages": HI, "chat_template_kwargs": {"conversation": [{"role": "user", "content": "other"}]}},
])
def test_a_request_cannot_choose_the_rendered_template_or_conversation(tok, body):
    assert tok.chat_token_ids(body) == tok.chat_token_ids({"messages": HI})
    assert "INJECTED" not in tok.tokenizer.decode(tok.chat_token_ids(body))


def test_a_slow_request_template_is_never_run(tok):
    import time

    burn = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    t0 = time.monotonic()
    ids = tok.chat_token_ids({"messages": HI, "chat_template_kwargs": {"chat_template": burn}})
    assert time.monotonic() - t0 < 5
    assert ids == tok.chat_token_ids({"messages": HI})


@pytest.mark.parametrize("kw", [{"tokenize": True}, {"return_dict": True}, {"return_tensors": "np"},
                                {"continue_final_message": True, "add_generation_prompt": True},
                                {"messages": []}, {"tools": "x"}, {"enable_thinking": {"nested": [1]}}])
def test_reserved_or_non_scalar_template_kwargs_are_ignored_not_raised(tok, kw):
    assert tok.chat_token_ids({"messages": HI, "chat_template_kwargs": kw}) == tok.chat_token_ids({"messages": HI})


def test_plain_template_kwargs_pass_as_data():
    from runtime.server.tokenize import template_kwargs

    assert template_kwargs({"enable_thinking": False, "reasoning_effort": "low", "n": 2, "x": None}) == {
        "enable_thinking": False, "reasoning_effort": "low", "n": 2, "x": None}
    assert template_kwargs({"chat_template": "t", "tokenize": True, "a b": 1, "big": "x" * 5000, "l": [1]}) == {}
    assert template_kwargs(["not", "a", "dict"]) == {}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}),
    ("/v1/completions", {"prompt": "a\ud800b"}),
    ("/v1/completions", {"prompt": ["a\udfffb"]}),
])
def test_a_prompt_the_tokenizer_refuses_routes_without_tokens(tok, path, body):
    assert tok.token_ids(path, body) is None
