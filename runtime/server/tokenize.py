"""Prompt token ids as vLLM computes them, for KV-aware routing (adapter: loads the tokenizer files).

vLLM's OpenAI server (vllm/entrypoints/openai, 0.28) tokenizes
* chat requests by rendering the model's chat template with `add_generation_prompt=True` (unless the request
  sets `add_generation_prompt`/`continue_final_message`) into text, then encoding that text with
  `add_special_tokens=False` (the template already holds the special tokens);
* completion requests by encoding the prompt string with `add_special_tokens=True`; a prompt that is already
  a list of token ids is used as is.
This module does the same with the served model's own tokenizer, so the router's block hashes equal the ones
the workers compute (checked against the workers' /tokenize in tests/e2e/test_server_router.py).

Only the served model's own chat template is ever rendered here. A request's `chat_template` (top level or
inside `chat_template_kwargs`) is never used: a client-written Jinja template would run in the router (vLLM
itself refuses one unless started with --trust-request-chat-template), and one with nested loops would burn
the router's CPU. From `chat_template_kwargs` only plain data reaches the template (`template_kwargs`).
(The body forwarded to the workers keeps those fields: vLLM answers 400 to a request template unless the
operator trusts them, and that 400 reaches the client.)
A prompt the tokenizer cannot encode (e.g. a lone UTF-16 surrogate) gives None: routed on load alone.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

# Names a request's chat_template_kwargs may not set: apply_chat_template's own parameters (they choose the
# template, make it return ids or a dict, or replace the conversation) and the names it renders with. The
# installed tokenizer's signature is added at load time (PromptTokenizer.__init__).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "processor_kwargs", "sanitize_control_tokens",
})
# longest string value of a chat_template_kwargs entry passed to the template, characters
_MAX_TEMPLATE_KWARG_CHARS = 1024


def template_kwargs(chat_template_kwargs: Any, reserved: frozenset[str] = _RESERVED_TEMPLATE_KWARGS) -> dict:
    """The entries of a request's `chat_template_kwargs` that may reach the served chat template: identifier
    keys that are not `reserved` (apply_chat_template parameters such as `chat_template` or `tokenize`) with
    plain values (bool, int, float, None, or a string of at most 1024 characters), e.g. `enable_thinking`.
    Anything else is dropped (not an error: the worker decides what it accepts)."""
    if not isinstance(chat_template_kwargs, dict):
        return {}
    return {k: v for k, v in chat_template_kwargs.items()
            if isinstance(k, str) and k.isidentifier() and k not in reserved
            and (v is None or isinstance(v, (bool, int, float))
                 or (isinstance(v, str) and len(v) <= _MAX_TEMPLATE_KWARG_CHARS))}


class PromptTokenizer:
    """Token ids of an OpenAI request body, with the served model's tokenizer and chat template.

    Args:
        tokenizer_dir: HF folder with the tokenizer files (the served model folder).

    Raises:
        OSError: when the folder has no loadable tokenizer (from transformers).
    """

    def __init__(self, tokenizer_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        try:
            params = inspect.signature(self.tokenizer.apply_chat_template).parameters
        except (TypeError, ValueError):
            params = {}
        self._reserved = _RESERVED_TEMPLATE_KWARGS | frozenset(params)

    def chat_token_ids(self, body: dict[str, Any]) -> list[int] | None:
        """Token ids of a chat request's prompt, or None when the messages cannot be rendered here."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        kwargs: dict[str, Any] = {
            "add_generation_prompt": bool(body.get("add_generation_prompt", True)),
            "continue_final_message": bool(body.get("continue_final_message", False)),
        }
        data = template_kwargs(body.get("chat_template_kwargs"), self._reserved)
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        try:
            # the served template only: chat_template=None whatever the request says
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=None, **data, **kwargs)
        except Exception:  # multimodal parts, unknown roles …: route without prefix knowledge
            return None
        return self._encode(text, add_special_tokens=False) if isinstance(text, str) else None

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int] | None:
        """Token ids of `text`, or None when the tokenizer refuses it (a lone surrogate gives TypeError)."""
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception:
            return None

    def completion_token_ids(self, body: dict[str, Any]) -> list[int] | None:
        """Token ids of a completion request's prompt (a string or a list of ids), else None (batches)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """Dispatch on the worker path ("/v1/chat/completions" or "/v1/completions")."""
        return self.chat_token_ids(body) if path.endswith("chat/completions") else self.completion_token_ids(body)
