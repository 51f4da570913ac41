"""Continue a request on another decode worker after its worker died mid-generation (pure helpers).

The continuation is an ordinary request whose prompt ends with what was already generated:
* chat: the generated text becomes a final assistant message, rendered with `continue_final_message=true`
  and `add_generation_prompt=false` (vLLM chat-template options) so the model goes on from inside it;
* completions: the generated text is appended to a string prompt.
`max_tokens` (and `max_completion_tokens`) shrink by the tokens already sent. Token counts come from the
stream: vLLM sends one chunk per generated token, except where a multi-byte character spans tokens (then
fewer chunks than tokens, and the continuation may generate a token or two more than asked).
"""

from __future__ import annotations

import copy
from typing import Any


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a streamed chunk adds (chat `delta.content` or completion `text`) of choice 0."""
    choices = chunk.get("choices") or ()
    if not choices:
        return ""
    c = choices[0]
    return (c.get("delta") or {}).get("content") or c.get("text") or ""


def continuation_body(path: str, body: dict[str, Any], generated_text: str, num_generated_tokens: int) -> dict | None:
    """The request that continues `body` after `generated_text`; None when it cannot be continued
    (n > 1, a non-string completion prompt, echo/logprobs of the prompt, or nothing left to generate).

    Args:
        path: worker path ("/v1/chat/completions" or "/v1/completions").
        body: the original request body.
        generated_text: text already streamed to the client.
        num_generated_tokens: tokens already streamed (chunks with text).
    """
    if int(body.get("n") or 1) != 1 or body.get("echo") or body.get("prompt_logprobs"):
        return None
    out = copy.deepcopy(body)
    for key in ("max_tokens", "max_completion_tokens"):
        if out.get(key) is not None:
            left = int(out[key]) - num_generated_tokens
            if left <= 0:
                return None
            out[key] = left
    if path.endswith("chat/completions"):
        messages = list(out.get("messages") or [])
        if not generated_text:
            return out
        messages.append({"role": "assistant", "content": generated_text})
        out["messages"] = messages
        out["add_generation_prompt"] = False
        out["continue_final_message"] = True
        return out
    prompt = out.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    out["prompt"] = prompt + generated_text
    return out
