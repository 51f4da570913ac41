"""Prompt token ids as vLLM computes them, for KV-aware routing (adapter: loads the tokenizer files).

vLLM's OpenAI server (vllm/entrypoints/openai, 0.28) tokenizes
* chat requests by rendering the model's chat template with `add_generation_prompt=True` (unless the request
  sets `add_generation_prompt`/`continue_final_message`) into text, then encoding that text with
  `add_special_tokens=False` (the template already holds the special tokens);
* completion requests by encoding the prompt string with `add_special_tokens=True`; a prompt that is already
  a list of token ids is used as is.
This module does the same with the served model's own tokenizer, so the router's block hashes equal the ones
the workers compute (checked against the workers' /tokenize in tests/e2e/test_server_router.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


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

    def chat_token_ids(self, body: dict[str, Any]) -> list[int] | None:
        """Token ids of a chat request's prompt, or None when the messages cannot be rendered here."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        kwargs: dict[str, Any] = {
            "add_generation_prompt": bool(body.get("add_generation_prompt", True)),
            "continue_final_message": bool(body.get("continue_final_message", False)),
        }
        if body.get("chat_template_kwargs"):
            kwargs.update(body["chat_template_kwargs"])
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception:  # multimodal parts, unknown roles …: route without prefix knowledge
            return None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def completion_token_ids(self, body: dict[str, Any]) -> list[int] | None:
        """Token ids of a completion request's prompt (a string or a list of ids), else None (batches)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """Dispatch on the worker path ("/v1/chat/completions" or "/v1/completions")."""
        return self.chat_token_ids(body) if path.endswith("chat/completions") else self.completion_token_ids(body)
