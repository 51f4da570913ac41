"""Continue a request on another decode worker after its worker died mid-generation (pure helpers).

The continuation is an ordinary request whose prompt ends with what was already generated:
* chat: the generated text becomes a final assistant message, rendered with `continue_final_message=true`
  and `add_generation_prompt=false` (vLLM chat-template options) so the model goes on from inside it;
* completions of one prompt and one choice: the token ids of the prompt and of the output sent (`TokenTrail`,
  from vLLM's `return_token_ids`, which the caller asks of the decode worker and hides where the client did
  not ask for them), so the next worker reads the very tokens the first one had;
* other completions (a worker that returns no ids): the generated text is appended to a string prompt.
The chat API takes no token ids: a chat continuation of one choice is sent as chat only once the next worker's
`/tokenize` of its prompt (`chat_tokenize_body`) gives the prompt's and the output's ids (`TokenTrail`), so it
goes on from the same tokens too; where the text sent renders or tokenizes otherwise it goes as a completions
request of those ids (`chat_as_completion`; its chunks written as chat chunks, `completion_as_chat_chunk`), or,
where a completion would not keep the request's chat meaning (logprobs, tools, media), it is refused.
A chat request that already continued its final assistant message (`continue_final_message`) goes on inside that
message. `max_tokens` (and `max_completion_tokens`, and `min_tokens` down to 0) shrink by the tokens already sent;
a completions request without `max_tokens` had the API's default of 16 (`COMPLETIONS_DEFAULT_MAX_TOKENS`), which
shrinks the same way. A chat request without either has the worker's default: the context left after its prompt,
which the longer prompt of the continuation shrinks by itself, capped by the model's generation config
`max_new_tokens`, which vLLM grants each attempt whole: the continuation asks for what is left of it where the
caller knows it (`chat_default_max_tokens`: runtime.server.generation_defaults reads it from the folder the
workers load); where the caller does not, a continued answer can be longer than the uninterrupted one (and
so can one that names a budget where the workers' `--override-generation-config`, or a folder their
`--generation-config` names, sets `max_new_tokens`: vLLM caps every request by it then). The
caller counts the tokens sent from the usage the decode worker sends with every chunk (it asks for vLLM's
`continuous_usage_stats`): a chunk may hold several tokens (vLLM's API server merges the outputs it fell
behind on; speculative decoding), so chunks are counted only where a worker sends no usage.

Reasoning text (vLLM's `delta.reasoning_content` / `delta.reasoning`) and tool calls (`delta.tool_calls`) are
generated output too (`choice_has_output`), but a continuation prompt cannot replay them faithfully (chat templates
drop or re-render reasoning, tool calls are parsed from text the client never saw): a stream that sent any of them
is not continued (`chunk_progress` reports it not replayable), the caller ends it with an error instead of sending
the client duplicate reasoning and more than `max_tokens` tokens.

A continuation follows the rules of the uninterrupted request: a request whose shape or sampling reads what a
continuation changes (its output so far, its prompt) is refused (`NotContinuable`, with the reason the client's
error gives; the list is `continuation_body`'s), and the caller makes a continuation's chunks the uninterrupted
stream's (`continuation_chunk`). A continuation prompted with the text sent where the worker returns no ids
is tokenized again unchecked, so its tokens after the cut can differ from an uninterrupted run's
(`continuation_body` says where); one prompted with the token ids, or checked against them, goes on from the
same tokens.
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

#: Why a stream that sent reasoning or a tool call is not continued (the client's error says it).
UNREPLAYABLE_REASON = "reasoning or a tool call was sent, which a continuation's prompt cannot replay"
#: Why a stream that sent ids or logprobs of tokens whose text the worker held back is not continued.
HELD_TOKENS_REASON = ("token ids or logprobs were sent for tokens whose text the worker held back; a "
                      "continuation would make those tokens again")


class NotContinuable(ValueError):
    """A stream cannot be continued exactly on another worker; the message says why (for the client)."""


#: Fields of vLLM's `return_token_ids` in a stream chunk: a completions choice's `prompt_token_ids` and
#: `token_ids` (vLLM 0.28 writes both on every chunk, null when not asked for and `prompt_token_ids` after the
#: first: `CompletionResponseStreamChoice`), a chat choice's `token_ids` (on every chunk with output), and a
#: chat chunk's `prompt_token_ids` (on its first, the role chunk: `ChatCompletionStreamResponse`).
_ID_FIELDS = ("prompt_token_ids", "token_ids")

#: What renders a chat request's prompt, as vLLM's `POST /tokenize` takes it (`TokenizeChatRequest`, 0.28).
_RENDER_FIELDS = ("messages", "chat_template", "chat_template_kwargs", "tools", "add_special_tokens",
                  "mm_processor_kwargs", "media_io_kwargs")


def ids_continuable(body: dict[str, Any], num_choices: int) -> bool:
    """A request whose stream can continue from token ids (`TokenTrail`): one choice of one prompt
    (`num_choices` 1, runtime.server.shapes.num_choices) that is text or token ids, not embeddings, and no `echo`
    (with `return_token_ids` vLLM 0.28 leaves a completion's echoed prompt text out of the answer)."""
    return num_choices == 1 and body.get("prompt_embeds") is None and not flag(body.get("echo"))


# the id members' names as a worker's compact JSON writes them, each followed by its list
_ID_KEYS = (b'"token_ids":[', b'"prompt_token_ids":[')


def ids_nulled(data: bytes, count: int) -> bytes | None:
    """`data`, a worker's compact JSON of a chunk whose `count` id fields `TokenTrail.take` set to null, with
    those lists written as null; None when the bytes do not hold exactly `count` of them (encode the chunk
    then). A member's name follows "{" or ",", and a quote inside a string value is escaped, so only members
    match. Spares encoding every chunk of every stream again whose client did not ask for ids. Pure."""
    n = 0
    for key in _ID_KEYS:
        start = 0
        while (i := data.find(key, start)) >= 0:
            start = i + len(key)
            if i == 0 or data[i - 1] not in b",{":
                continue
            end = data.find(b"]", start)
            if end < 0:
                return None
            data = data[:start - 1] + b"null" + data[end + 1:]
            n += 1
    return data if n == count else None


def chat_tokenize_body(model: str, continuation: dict[str, Any]) -> dict[str, Any]:
    """The `POST /tokenize` body that renders a chat `continuation` (`continuation_body`'s) as the worker will:
    its messages with `continue_final_message` and no generation prompt, and the fields that change the
    rendering (`_RENDER_FIELDS`)."""
    out = {k: continuation[k] for k in _RENDER_FIELDS if k in continuation}
    out.update(model=model, add_generation_prompt=False, continue_final_message=True)
    return out


#: Chat request fields a completions request of the rendered prompt's ids carries as they are: sampling and
#: stream options that mean the same in vLLM 0.28's `CompletionRequest` and read only each step's logits or
#: how the stream is cut (the ones that read the output so far were refused by `continuation_body`).
_CHAT_AS_COMPLETION_CARRIED = frozenset((
    "model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "length_penalty", "logit_bias",
    "allowed_token_ids", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "seed", "stream", "stream_options", "stream_interval",
    "return_token_ids", "priority", "user", "cache_salt", "session_id", "request_id", "kv_transfer_params",
    "n", "frequency_penalty", "presence_penalty", "bad_words", "use_beam_search"))
#: Chat request fields that only render the prompt (its ids hold what they did) or count the budget
#: (`max_tokens` is set from them), dropped from the completions request.
_CHAT_AS_COMPLETION_DROPPED = frozenset((
    "messages", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents", "reasoning_effort", "include_reasoning", "truncate_prompt_tokens",
    "truncation_side", "max_tokens", "max_completion_tokens", "return_prompt_text", "return_assistant_tokens_mask",
    "echo", "response_format"))
#: Chat request fields `chat_as_completion` refuses on their value, dropped where it does not.
_CHAT_AS_COMPLETION_CHECKED = frozenset(("tools", "tool_choice", "parallel_tool_calls", "logprobs", "top_logprobs"))


def chat_as_completion(continuation: dict[str, Any], token_ids: list[int], max_model_len: int | None) -> dict:
    """A chat `continuation` (`continuation_body`'s) as a `/v1/completions` request prompted with `token_ids`
    (`TokenTrail.ids`: the chat prompt as the first worker rendered it and the output sent), for a chat stream
    whose text sent renders otherwise in a chat continuation (a template that trims the continued message, a
    newline that merges with the word after it): the completions API takes token ids, so the next worker goes
    on from the very tokens the answer was made of. `PDModel._stream` turns its chunks into chat chunks
    (`completion_as_chat_chunk`).

    `max_tokens` is what is left of the chat budget (`max_completion_tokens`, else `max_tokens`, as vLLM reads
    them); with neither, the context left after the prompt (`max_model_len` tokens, the worker's `/v1/models`),
    which is what a chat request without a budget gets and what the completions API would not give (its
    default is 16).

    Raises:
        NotContinuable: a field whose chat meaning a completion does not keep: logprobs (chat and completions
            write them in other forms), tools the model may call (a completion's text is not parsed for tool
            calls), a message with other content than text (the completion would lack its media), a field this
            function does not know, or no budget and no `max_model_len`.
    """
    if flag(continuation.get("logprobs")):  # without it vLLM reads no top_logprobs
        raise NotContinuable("logprobs: a completion writes them in another form than a chat answer")
    if continuation.get("tools") and continuation.get("tool_choice") != "none":
        raise NotContinuable("tools the model may call: a completion's text is not parsed for tool calls")
    for m in continuation.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(not (isinstance(p, dict) and p.get("type") == "text") for p in content):
            raise NotContinuable("a message holds media, which a prompt of token ids lacks")
    known = _CHAT_AS_COMPLETION_CARRIED | _CHAT_AS_COMPLETION_DROPPED | _CHAT_AS_COMPLETION_CHECKED
    unknown = sorted(k for k, v in continuation.items() if v is not None and v is not False and k not in known)
    if unknown:
        raise NotContinuable(f"{', '.join(unknown)}: no completions request is known to keep its chat meaning")
    budget = continuation.get("max_completion_tokens") or continuation.get("max_tokens")
    if budget is None:
        if max_model_len is None:
            raise NotContinuable("the request names no max_tokens and the next worker's context length is unknown")
        budget = max_model_len - len(token_ids)
        if budget <= 0:
            raise NotContinuable("no context left after the answer so far")
    out = {k: v for k, v in continuation.items() if k in _CHAT_AS_COMPLETION_CARRIED}
    out.update(prompt=list(token_ids), max_tokens=int(budget))
    return out


def completion_as_chat_chunk(chunk: dict[str, Any]) -> dict[str, Any]:
    """A completions stream's `chunk` (a `chat_as_completion` request's) written as vLLM 0.28 writes a chat
    stream's (`ChatCompletionStreamResponse`, `exclude_unset`): each choice's text as `delta.content`, its
    `finish_reason`, `stop_reason` once finished, `token_ids`; logprobs null (refused); the prompt's ids left
    out (the client had the chat prompt's on the first chunk); a chunk with choices has a running usage's
    `completion_tokens_details` (null where the completion has none: the chat stream sets it on every such
    chunk, the completions stream never). Members in vLLM's order. Pure."""
    out: dict[str, Any] = {k: chunk[k] for k in ("id",) if k in chunk}
    out["object"] = "chat.completion.chunk"
    out.update({k: chunk[k] for k in ("created", "model") if k in chunk})
    choices = []
    for c in chunk.get("choices") or ():
        if not isinstance(c, dict):
            continue
        d: dict[str, Any] = {"index": c.get("index", 0), "delta": {"content": c.get("text") or ""},
                             "logprobs": None, "finish_reason": c.get("finish_reason")}
        if c.get("finish_reason") is not None:
            d["stop_reason"] = c.get("stop_reason")
        d["token_ids"] = c.get("token_ids")
        choices.append(d)
    out["choices"] = choices
    out.update({k: v for k, v in chunk.items() if k not in ("id", "object", "created", "model", "choices")
                and k not in _PROMPT_FIELDS})
    usage = out.get("usage")
    if choices and isinstance(usage, dict) and "completion_tokens_details" not in usage:
        out["usage"] = {**usage, "completion_tokens_details": None}
    return out


class TokenTrail:
    """The token ids of one stream, from the chunks of a worker asked for `return_token_ids`: the client's
    prompt's (the first attempt's first chunk; a continuation's prompt is longer) and every output token sent,
    in order. `ids()` is the prompt a continuation goes on from: the prompt's ids and the output's up to the
    last chunk with text. The tokens after it came with empty text (vLLM holds back the bytes of a character
    until it is whole) and are left out: a prompt of ids that ends inside a character makes vLLM 0.28's
    detokenizer send the whole decoded prompt as the continuation's first text, and the next worker makes
    those tokens again from the same ids. None when a chunk with text came without its ids (a worker or
    engine that does not return them): the caller continues from text then."""

    __slots__ = ("prompt", "output", "complete", "held", "last_text")

    def __init__(self) -> None:
        self.prompt: list[int] | None = None
        self.output: list[int] = []
        self.complete = True
        self.held = 0  # the last output ids, which came with empty text
        # the ids of the last chunk with text: of several tokens, its last can end inside a character too
        self.last_text: list[int] = []

    def take(self, chunk: dict[str, Any], hide: bool) -> int:
        """Read the prompt's ids and choice 0's from a streamed `chunk` (completions or chat) before it is sent;
        with `hide` (the client did not ask for ids) set the id fields to null, as a worker not asked for them
        writes them. Returns the number of fields it set to null."""
        hidden = 0
        prompt = chunk.get("prompt_token_ids")  # a chat stream's first chunk
        if prompt is not None:
            if self.prompt is None and isinstance(prompt, list):
                self.prompt = prompt
            if hide:
                chunk["prompt_token_ids"] = None
                hidden += 1
        for c in chunk.get("choices") or ():
            if not isinstance(c, dict):
                continue
            if c.get("index", 0) == 0:
                prompt, ids = c.get("prompt_token_ids"), c.get("token_ids")
                if self.prompt is None and isinstance(prompt, list):
                    self.prompt = prompt
                text = c.get("text") or (isinstance(c.get("delta"), dict) and c["delta"].get("content"))
                if isinstance(ids, list):
                    self.output.extend(ids)
                    self.held = 0 if text else self.held + len(ids)
                    if text:
                        self.last_text = ids
                elif text:
                    self.complete = False
            if hide:
                for key in _ID_FIELDS:
                    if c.get(key) is not None:
                        c[key] = None
                        hidden += 1
        return hidden

    def sent(self) -> int | None:
        """Output tokens a continuation goes on after (those up to the last chunk with text), or None when
        their ids are not all known."""
        return len(self.output) - self.held if self.complete and self.prompt is not None else None

    def ids(self) -> list[int] | None:
        """The prompt's ids and the output's up to the last chunk with text, or None when not all known."""
        n = self.sent()
        return None if n is None else [*self.prompt, *self.output[:n]]


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


def flag(value: Any) -> bool:
    """A request's boolean as vLLM's lenient validation reads it ("true", "1", "yes", "on" are true)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "on", "t", "true", "y", "yes")
    return bool(value)


def _nonzero(value: Any, default: float = 0.0) -> bool:
    """A numeric sampling parameter set off its no-op `default`; one that is not a number counts as set (the
    worker would refuse it, or read it in a way this module does not)."""
    if value is None:
        return False
    try:
        return float(value) != default
    except (TypeError, ValueError):
        return True


def _greedy(temperature: Any) -> bool:
    """`temperature` makes vLLM sample greedily (0); unset or not a number is not greedy (vLLM's default,
    or the model's generation config, may sample)."""
    try:
        return temperature is not None and float(temperature) == 0.0
    except (TypeError, ValueError):
        return False


def _refuse_output_dependent_sampling(body: dict[str, Any], generated_text: str) -> None:
    """Raise `NotContinuable` when a sampling parameter of `body` reads the output generated so far in a way a
    continuation (whose prompt holds that output) cannot reproduce; see `continuation_body`."""
    if _nonzero(body.get("frequency_penalty")) or _nonzero(body.get("presence_penalty")):
        raise NotContinuable("frequency_penalty and presence_penalty count the tokens generated so far, which a "
                             "continuation's prompt holds and vLLM does not count")
    if body.get("bad_words"):
        raise NotContinuable("bad_words are matched against the tokens generated so far, which a continuation's "
                             "prompt holds and vLLM does not match")
    if body.get("thinking_token_budget") is not None:
        raise NotContinuable("thinking_token_budget counts the thinking tokens generated so far, which a "
                             "continuation's prompt holds")
    if body.get("repetition_detection"):
        raise NotContinuable("repetition_detection looks for repeats in the tokens generated so far, which a "
                             "continuation's prompt holds")
    if body.get("seed") is not None and not _greedy(body.get("temperature")):
        raise NotContinuable("seed with sampling: the sampler's random state on the first worker cannot be carried "
                             "to another, so the rest would not be the seeded answer")
    if body.get("use_beam_search"):
        raise NotContinuable("beam search keeps several candidate sequences that a continuation cannot carry")
    if body.get("vllm_xargs"):
        raise NotContinuable("vllm_xargs are read by the worker's custom logits processors, which may count the "
                             "tokens generated so far, which a continuation's prompt holds")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else [] if stop is None else None
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise NotContinuable("stop is not a string or a list of strings")
    if stops and not flag(body.get("include_stop_str_in_output")) and max(map(len, stops)) > 1:
        raise NotContinuable("stop strings of more than one character: vLLM holds back the text that may begin one, "
                             "so the text sent ends inside a token and the tokens behind it are not known")
    if any(generated_text.endswith(s[:k]) for s in stops for k in range(1, len(s))):
        raise NotContinuable("the text sent ends with the beginning of a stop string, which vLLM would not match "
                             "across the continuation's prompt")


def continuation_body(path: str, body: dict[str, Any], generated_text: str, num_generated_tokens: int, *,
                      prompt_tokens: int | None = None, token_ids: list[int] | None = None,
                      chat_default_max_tokens: int | None = None) -> dict:
    """The request that continues `body` after `generated_text`: the same request prompted with the token ids
    of its prompt and of the output sent (`token_ids`, completions), else with the text sent appended to its
    prompt (completions) or as the assistant's open message (chat), so that a worker goes on from there;
    `body` itself when nothing generated was sent. Raises `NotContinuable` (its message says why, for the
    client's error) where the rest would follow other rules than the uninterrupted answer's (the list below).

    From `token_ids` the next worker reads the tokens the first one had (the prompt's as that worker read them,
    after any `truncate_prompt_tokens` cut, which the continuation therefore goes without), up to the last
    text sent (`TokenTrail.ids`: tokens whose text vLLM held back are made again). A prompt of text is
    tokenized again: where the text's last tokens tokenize otherwise inside the longer prompt (a newline and the
    text after it can merge into one token), where a chat template trims the final message (Llama 3.1's
    `| trim`), or where a chunk carried several tokens and vLLM held back the last one's incomplete character
    (the count of tokens sent includes it), the tokens after the cut, and a greedy answer with them, can differ
    from the uninterrupted ones (chat, whose API takes no token ids, continues from text, and the caller sends
    it only where the next worker renders it into the stream's own ids, else as a completion of those ids:
    `PDModel._checked_continuation`).

    Carried over, each as the uninterrupted request applies it (vLLM 0.28's sampler, vllm/v1/sample, and
    output processing):
    * `max_tokens` / `max_completion_tokens` (the completions default of 16 when unset; a chat request's
      `chat_default_max_tokens` when it names neither) shrink by the tokens sent; `min_tokens` too (down to 0):
      vLLM counts it over the request's own output tokens, and it also gates stop strings;
    * `repetition_penalty`: vLLM applies it to the tokens of the prompt and of the output alike, and the
      continuation's prompt holds both;
    * `temperature`, `top_p`, `top_k`, `min_p`, `logit_bias`, `allowed_token_ids`, `stop_token_ids`,
      `ignore_eos`, `logprobs`, `top_logprobs`, `logprob_token_ids`: each step reads only that step's logits;
      `seed` with `temperature` 0 (greedy: the seed draws nothing);
    * `stop` when vLLM streams all text at once (`include_stop_str_in_output`, or stop strings of one character)
      and the text sent does not end with the beginning of a stop string: a stop string found in the rest lies
      in the continuation's own output, where vLLM looks for it;
    * `truncate_prompt_tokens` K when the first attempt's prompt (`prompt_tokens`) was shorter than K: nothing
      was cut, and the continuation goes without it (always, from `token_ids`);
    * chat `continue_final_message`: the text goes on inside the final message (whatever its role).
    The caller shifts a continuation's completion `logprobs.text_offset` by the characters sent before it and
    drops its `prompt_token_ids` (`continuation_chunk`).

    Refused (`NotContinuable`):
    * `n` > 1, `echo`, `prompt_logprobs`: the answer holds more than one generated text, or the prompt;
    * a completions prompt that is not one string (token ids, embeddings) and no `token_ids`: the text cannot be
      appended;
    * structured output (`response_format` other than text, `structured_outputs`): the engine's grammar would
      start again inside the answer (a second JSON object in the middle of the first), and without it nothing
      holds the rest to the schema;
    * `frequency_penalty` / `presence_penalty` not 0: vLLM counts output tokens only, and the earlier output
      is prompt in the continuation;
    * `bad_words`: vLLM matches a multi-token bad word's first tokens against the output tokens only;
    * `seed` with sampling (`temperature` not 0, or unset): the first worker's random state is not carried, so
      the rest would differ from the seeded answer a client can reproduce;
    * `thinking_token_budget`, `repetition_detection`, `vllm_xargs` (what a worker's custom logits processors
      read): they read, or may read, the output so far; beam search (`use_beam_search`): its beams are lost;
    * `stop` strings of more than one character without `include_stop_str_in_output`: vLLM holds back the
      text that may begin one, so the text sent ends inside a token and the tokens sent are not known; and any
      stop string whose beginning ends the text sent (vLLM would not match it across the prompt);
    * `truncate_prompt_tokens` without `token_ids` when the prompt may have been cut (K <= the prompt's
      tokens, -1, or no usage):
      vLLM would truncate the continuation's prompt (original prompt + text sent) from a side and at a length
      that does not keep the same tokens;
    * chat with `add_generation_prompt` false (and no `continue_final_message`): the model went on after the
      conversation without an assistant header, which no chat request can render after the text sent; a
      continued final message whose content is not a string;
    * `include_reasoning` false: the worker made reasoning that the client did not get and that a
      continuation's prompt would lack;
    * nothing left of `max_tokens`.

    Args:
        path: worker path ("/v1/chat/completions" or "/v1/completions").
        body: the original request body (not changed).
        generated_text: text already streamed to the client.
        num_generated_tokens: tokens already streamed (from the worker's running usage; chunks with generated
            output, `chunk_progress`, where it sends none).
        prompt_tokens: the client's prompt tokens as the first worker counted them (its usage), None if unknown.
        token_ids: a completions stream's prompt and output token ids (`TokenTrail.ids`), None if not known.
        chat_default_max_tokens: what the workers give a chat request that names neither `max_tokens` nor
            `max_completion_tokens`, besides the context left after its prompt (the model's generation config
            `max_new_tokens`: runtime.server.generation_defaults), None where they give the context left or it
            is not known. Each attempt would get it whole: a continuation asks for what is left of it (vLLM
            still caps that by the context left, which the continuation's longer prompt shrinks as the
            uninterrupted answer's output would have).

    Raises:
        NotContinuable: the request's shape cannot be continued by the rules of the uninterrupted answer.
    """
    if int(body.get("n") or 1) != 1:
        raise NotContinuable("several choices")
    if flag(body.get("echo")) or body.get("prompt_logprobs") is not None:
        raise NotContinuable("echo and prompt_logprobs answer with the prompt, which a continuation changes")
    if not generated_text and num_generated_tokens == 0:
        # nothing generated reached the client (a role chunk, or empty chunks while vLLM held text back): the
        # request itself, sent again, is the uninterrupted answer whatever its sampling
        return copy.deepcopy(body)
    fmt = body.get("response_format")
    if body.get("structured_outputs") is not None or (
            fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text")):
        raise NotContinuable("structured output: the grammar would start again inside the answer")
    if body.get("include_reasoning") is not None and not flag(body.get("include_reasoning")):
        raise NotContinuable("include_reasoning is false: the worker made reasoning the client did not get, and "
                             "a continuation's prompt would lack it")
    _refuse_output_dependent_sampling(body, generated_text)
    out = copy.deepcopy(body)
    chat = path.endswith("chat/completions")
    if not chat and out.get("max_tokens") is None:
        out["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS  # the budget the first worker applied
    elif (chat and chat_default_max_tokens is not None and out.get("max_tokens") is None
          and out.get("max_completion_tokens") is None):
        out["max_tokens"] = chat_default_max_tokens  # the model's default, which the first worker applied
    for key in ("max_tokens", "max_completion_tokens"):
        if out.get(key) is not None:
            left = int(out[key]) - num_generated_tokens
            if left <= 0:
                raise NotContinuable(f"no {key} left")
            out[key] = left
    if out.get("min_tokens"):  # vLLM refuses min_tokens > max_tokens: the floor shrinks with the budget
        out["min_tokens"] = max(0, int(out["min_tokens"]) - num_generated_tokens)
    if token_ids is not None and not chat:
        # the ids are the prompt as the first worker read it (cut already, where it was cut)
        out.pop("truncate_prompt_tokens", None)
        out.pop("truncation_side", None)
        out["prompt"] = token_ids
        return out
    if out.get("truncate_prompt_tokens") is not None:
        try:
            limit = int(out["truncate_prompt_tokens"])
        except (TypeError, ValueError):
            limit = -1
        if not (limit > 0 and prompt_tokens is not None and prompt_tokens < limit):
            raise NotContinuable("truncate_prompt_tokens may have cut the prompt, and the continuation's longer "
                                 "prompt would be cut elsewhere")
        # nothing was cut: the continuation's prompt (the same prompt and the text sent) is not cut either
        del out["truncate_prompt_tokens"]
        out.pop("truncation_side", None)
    if chat:
        if not generated_text:
            return out
        messages = list(out.get("messages") or [])
        last = messages[-1] if messages else None
        if flag(out.get("continue_final_message")):
            if not (isinstance(last, dict) and isinstance(last.get("content"), str)):
                raise NotContinuable("the continued final message has no text content to extend")
            # the client's final message was being continued: the text goes on inside it (a second message
            # would render as a new turn)
            messages[-1] = {**last, "content": last["content"] + generated_text}
        elif "add_generation_prompt" in out and not flag(out["add_generation_prompt"]):
            raise NotContinuable("add_generation_prompt is false: the model went on after the conversation "
                                 "without an assistant header, which a continuation cannot render")
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
        raise NotContinuable("the prompt is not one string (token ids or embeddings): the text sent cannot be "
                             "appended to it")
    out["prompt"] = prompt + generated_text
    return out


#: Fields of a streamed chunk (and of its choices) that describe the prompt: the client's request's come with
#: the first attempt; a continuation's describe its own prompt (the client's prompt and the text sent).
_PROMPT_FIELDS = ("prompt_token_ids", "prompt_text", "prompt_logprobs")


def continuation_chunk(chunk: dict[str, Any], text_before: int) -> bool:
    """Make a continuation's streamed `chunk` (in place) the uninterrupted answer's: drop the fields that
    describe the continuation's prompt (`prompt_token_ids`, `prompt_text`, `prompt_logprobs`; a choice's become
    null, as vLLM writes them on a completions stream's later chunks) and shift each completion choice's
    `logprobs.text_offset` by `text_before`, the characters (Python `str` length, as vLLM counts them) of text
    the client got before the continuation began. Returns whether it changed anything."""
    changed = False
    for key in _PROMPT_FIELDS:
        if key in chunk:
            del chunk[key]
            changed = True
    for c in chunk.get("choices") or ():
        if not isinstance(c, dict):
            continue
        for key in _PROMPT_FIELDS:
            if c.get(key) is not None:
                c[key] = None
                changed = True
        lp = c.get("logprobs")
        offsets = lp.get("text_offset") if isinstance(lp, dict) else None
        if text_before and isinstance(offsets, list) and offsets:
            lp["text_offset"] = [o + text_before if isinstance(o, int) else o for o in offsets]
            changed = True
    return changed


def carries_token_output(chunk: dict[str, Any]) -> bool:
    """A streamed chunk gives the client per-token output (`token_ids`, or logprobs) for choice 0: with empty
    text, the worker held its text back (a character's first bytes), and a continuation would make those tokens,
    and send their ids and logprobs, again."""
    choices = chunk.get("choices") or ()
    c = choices[0] if choices else None
    if not isinstance(c, dict):
        return False
    lp = c.get("logprobs")
    return bool(c.get("token_ids") or (isinstance(lp, dict) and (lp.get("content") or lp.get("tokens"))))
