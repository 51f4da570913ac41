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
