"""Continue a request on another decode worker after its worker died mid-generation (pure helpers).

The continuation is an ordinary request whose prompt ends with what was already generated:
* chat: the generated text becomes a final assistant message, rendered with `continue_final_message=true`
  and `add_generation_prompt=false` (vLLM chat-template options) so the model goes on from inside it;
* completions: the generated text is appended to a string prompt.
A chat request that already continued its final assistant message (`continue_final_message`) goes on inside
that message. `max_tokens` (and `max_completion_tokens`, and `min_tokens` down to 0) shrink by the tokens
already sent; a completions request without `max_tokens` had the API's default of 16
(`COMPLETIONS_DEFAULT_MAX_TOKENS`), which shrinks the same way. A chat request without either has the worker's
default: the context left after its prompt, which the longer prompt of the continuation shrinks by itself (a
model whose generation_config.json sets `max_new_tokens` is the exception: vLLM grants each attempt that many). The caller counts the tokens sent from the usage the decode worker sends with every chunk (it
asks for vLLM's `continuous_usage_stats`): a chunk may hold several tokens (vLLM's API server merges the
outputs it fell behind on; speculative decoding), so chunks are counted only where a worker sends no usage.

Reasoning text (vLLM's `delta.reasoning_content` / `delta.reasoning`) and tool calls (`delta.tool_calls`) are
generated output too (`choice_has_output`), but a continuation prompt cannot replay them faithfully (chat
templates drop or re-render reasoning, tool calls are parsed from text the client never saw): a stream that
sent any of them is not continued (`chunk_progress` reports it not replayable), the caller ends it with an error instead of
sending the client duplicate reasoning and more than `max_tokens` tokens.
"""

from __future__ import annotations

import copy
from typing import Any


#: The budget of a completions request that names no `max_tokens` (or null): OpenAI's documented default for
#: /v1/completions, and vLLM 0.28's (`CompletionRequest.max_tokens`, `normalize_null_max_tokens`). A
#: continuation must carry what is left of it, else the next worker grants a fresh 16.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# delta fields of generated output that a continuation cannot replay (vLLM 0.28 chat chunks)
_UNREPLAYABLE_DELTA = ("reasoning_content", "reasoning", "tool_calls", "function_call")
_UNREPLAYABLE_KEYS = frozenset(_UNREPLAYABLE_DELTA)


def _delta(choice: Any) -> dict:
    delta = choice.get("delta") if isinstance(choice, dict) else None
    return delta if isinstance(delta, dict) else {}


def _choice_has_tokens(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = _delta(choice)
    return bool(delta.get("content") or choice.get("text") or any(delta.get(k) for k in _UNREPLAYABLE_DELTA))


def choice_has_output(choice: Any) -> bool:
    """A streamed choice carries generated output: content, completion text, reasoning, a tool call, or a
    finish reason."""
    return _choice_has_tokens(choice) or bool(isinstance(choice, dict) and choice.get("finish_reason"))


def chunk_progress(chunk: dict[str, Any]) -> tuple[str, bool, bool]:
    """What a stream reads of every chunk it forwards, in one pass over the chunk's choices:
    (text, generated, replayable).

    text: the text choice 0 adds (chat `delta.content` or completion `text`; "" when none).
    generated: choice 0 carries a generated token (content, text, reasoning or a tool call); a role-only delta,
        a finish reason alone or a usage-only chunk carries none.
    replayable: False when any choice carries reasoning or a tool call, which a continuation request cannot
        include (see the module docstring). A delta without any of those keys (the common one) is passed over
        with one set test.
    """
    choices = chunk.get("choices") or ()
    if not choices:
        return "", False, True
    c = choices[0]
    text = (c.get("delta") or {}).get("content") or c.get("text") or ""
    generated = bool(text) or _choice_has_tokens(c)
    for c in choices:
        delta = c.get("delta") if isinstance(c, dict) else None
        if (isinstance(delta, dict) and not _UNREPLAYABLE_KEYS.isdisjoint(delta)
                and any(delta.get(k) for k in _UNREPLAYABLE_DELTA)):
            return text, generated, False
    return text, generated, True


def continuation_body(path: str, body: dict[str, Any], generated_text: str, num_generated_tokens: int) -> dict | None:
    """The request that continues `body` after `generated_text`; None when it cannot be continued
    (n > 1, a non-string completion prompt, echo/logprobs of the prompt, structured output, or nothing left to
    generate).

    Structured output (`response_format` other than text, vLLM's `structured_outputs`): the engine's grammar
    constrains the tokens it generates from the start of the answer, so a continuation would start the
    grammar again after text that is already inside it (a second JSON object in the middle of the first),
    and without the grammar nothing holds the rest to the schema; the client gets an error instead.

    Args:
        path: worker path ("/v1/chat/completions" or "/v1/completions").
        body: the original request body.
        generated_text: text already streamed to the client.
        num_generated_tokens: tokens already streamed (from the worker's running usage; chunks with generated
            output, `chunk_progress`, where it sends none).
    """
    if int(body.get("n") or 1) != 1 or body.get("echo") or body.get("prompt_logprobs"):
        return None
    fmt = body.get("response_format")
    if body.get("structured_outputs") is not None or (
            fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text")):
        return None
    out = copy.deepcopy(body)
    if not path.endswith("chat/completions") and out.get("max_tokens") is None:
        out["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS  # the budget the first worker applied
    for key in ("max_tokens", "max_completion_tokens"):
        if out.get(key) is not None:
            left = int(out[key]) - num_generated_tokens
            if left <= 0:
                return None
            out[key] = left
    if out.get("min_tokens"):  # vLLM refuses min_tokens > max_tokens: the floor shrinks with the budget
        out["min_tokens"] = max(0, int(out["min_tokens"]) - num_generated_tokens)
    if path.endswith("chat/completions"):
        messages = list(out.get("messages") or [])
        if not generated_text:
            return out
        last = messages[-1] if messages else None
        if (out.get("continue_final_message") and isinstance(last, dict) and last.get("role") == "assistant"
                and isinstance(last.get("content"), str)):
            # the client's own assistant message was being continued: the text goes on inside it (a second
            # assistant message would render as a new turn)
            messages[-1] = {**last, "content": last["content"] + generated_text}
        else:
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
