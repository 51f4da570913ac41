"""SLO probe: TTFT/ITL of a small streaming request set against a freshly rolled-out revision (adapter).

For each prompt one streaming OpenAI chat completion (`POST <url>/openai/v1/chat/completions`,
`stream: true`) is sent; TTFT = time from sending to the first SSE chunk carrying content, ITL =
(time of last content chunk − first) / (content chunks − 1) per request (the per-request mean TPOT, as in
DistServe, OSDI'24, §2). Returned as p90 over requests (numpy linear interpolation); a request with one
content chunk has a TTFT but no ITL, and when no request has two or more, ITL is unmeasured
(`itl_p90_ms` None), which fails the verdict rather than passing the ITL SLO on no evidence (a server that
sends the whole answer in one chunk cannot show its ITL). A request that fails
(HTTP error, no content, transport error, or a chunk that is not an OpenAI chat-completion chunk, e.g.
`data: []` or `{"choices": [null]}`) counts in `num_errors` and not in the percentiles; the probe itself
never raises on what the server sends.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Iterable

import httpx
import numpy as np

from runtime.deploy.rollout import ProbeResult

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
)


class MalformedChunk(ValueError):
    """An SSE `data:` payload that is not an OpenAI chat.completion.chunk object."""


def delta_content(chunk: object) -> str:
    """The text of `choices[0].delta.content` of one decoded chunk ("" when the chunk carries none: a role-only
    delta, a usage chunk with `choices: []`, `content: null`).

    Raises:
        MalformedChunk: the chunk, a choice or a delta is not a JSON object, or content is not a string.
    """
    if not isinstance(chunk, dict):
        raise MalformedChunk(f"chunk is {type(chunk).__name__}, not an object")
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise MalformedChunk("choices is not a list")
    if not choices:
        return ""
    choice = choices[0]
    if not isinstance(choice, dict):
        raise MalformedChunk(f"choices[0] is {type(choice).__name__}, not an object")
    delta = choice.get("delta") or {}
    if not isinstance(delta, dict):
        raise MalformedChunk(f"choices[0].delta is {type(delta).__name__}, not an object")
    content = delta.get("content")
    if content is not None and not isinstance(content, str):
        raise MalformedChunk(f"choices[0].delta.content is {type(content).__name__}, not a string")
    return content or ""


def _p90(values: list[float]) -> float:
    return float(np.percentile(values, 90)) if values else float("inf")


def probe(url: str, *, model: str, prompts: Iterable[str] = DEFAULT_PROMPTS, max_tokens: int = 32,
          client: httpx.Client | None = None, timeout_s: float = 60.0,
          clock: Callable[[], float] = time.perf_counter) -> ProbeResult:
    """Measure TTFT/ITL p90 (ms) of one streaming request per prompt, sequentially.

    Args:
        url: base URL of the runtime (an InferenceService revision URL), without `/openai/...`.
        model: OpenAI `model` field (the served model name).

    Returns:
        ProbeResult (ms); failed or malformed responses are counted in `num_errors`, never raised;
        `itl_p90_ms` is None when no request streamed two or more content chunks.
    """
    own = client is None
    client = client or httpx.Client(timeout=timeout_s)
    ttfts_ms: list[float] = []
    itls_ms: list[float] = []
    n = errors = 0
    try:
        for prompt in prompts:
            n += 1
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0.0, "stream": True}
            times: list[float] = []
            t0 = clock()
            try:
                with client.stream("POST", url.rstrip("/") + "/openai/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        errors += 1
                        continue
                    for line in r.iter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        if delta_content(json.loads(data)):
                            times.append(clock())
            except (httpx.HTTPError, httpx.StreamError, ValueError):  # ValueError: bad JSON/UTF-8, MalformedChunk
                errors += 1
                continue
            if not times:
                errors += 1
                continue
            ttfts_ms.append((times[0] - t0) * 1000.0)
            if len(times) > 1:
                itls_ms.append((times[-1] - times[0]) / (len(times) - 1) * 1000.0)
    finally:
        if own:
            client.close()
    return ProbeResult(ttft_p90_ms=_p90(ttfts_ms), itl_p90_ms=_p90(itls_ms) if itls_ms else None,
                       num_requests=n, num_errors=errors)
