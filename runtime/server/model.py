"""The pdserve runtime model: a KServe OpenAI model that serves each request prefill → decode.

For every /openai/v1/chat/completions or /openai/v1/completions request:
1. the `Pairing` (runtime.server.pairing round robin, or runtime.server.routing over the KV-aware
   runtime.router, fed the prompt's token ids) picks a prefill worker (or none) and a decode worker from the
   configured pool;
2. remote prefill: the request with max_tokens=1 and remote-decode `kv_transfer_params` goes to the prefill
   worker (runtime.engines.client protocol); a 4xx answer that is a vLLM/OpenAI error object about the request
   (not 401/403/404/407) is the client's fault and its message is returned; a failure, a 5xx or another 4xx
   (a deployment fault: worker auth, a proxy's page, a wrong path) makes the runtime prefill locally on the
   decode worker instead (counted in `pdserve_prefill_fallbacks_total`, reported as mode "local", never as a
   transfer); a worker body that is not forwarded is logged, never sent to the client;
3. decode: the original request (every field the client sent) plus the prefill's `kv_transfer_params`, with
   one `X-Request-Id` for both calls; streamed back as SSE or returned whole. A decode worker that becomes
   unreachable opens its circuit breaker (runtime.server.breakers, which every worker call reports to) and
   the request continues on another decode worker (streaming: with the text already sent appended,
   runtime.server.migration) while the pairing allows it; otherwise the client gets an OpenAI error (an error event inside a started stream). A stream that already sent
   reasoning or tool calls, or whose request a continuation would serve by other rules (output penalties, stop
   strings vLLM holds text back for, ...: `continuation_body`), is not migrated but ends with an error event
   that says why. An error event the worker sends inside its stream reaches the client (also when the runtime
   hides the usage chunk) and the request counts as an error.
   A decode worker that rejects the decode leg (a 4xx about the request: e.g. `max_tokens` beyond the context,
   `min_tokens` over `max_tokens`, fields the prefill leg does not carry) frees the handoff itself: vLLM 0.28's
   serving layer tells its KV connector, which has the prefill worker release the blocks at once (within 0.2 s
   of the client's answer: tests/e2e/test_server_decode_rejection.py), not at the end of the KV lease. So the
   client gets that rejection and nothing more is sent on the handoff: a request that read it (a "consume" with
   max_tokens=1) would read blocks the prefill worker has already released and another request may reuse.
   Nor are such requests refused before the prefill: that would copy vLLM's checks and messages here (the
   context check needs the prompt's token count) to save one prefill.

Client-supplied `kv_transfer_params` (also inside `vllm_xargs`) and `ec_transfer_params` are dropped: no
request field or header can make a worker talk to an address outside the configured pool. `vllm_xargs` keys
the runtime owns (`_RUNTIME_XARGS`, e.g. `kv_cache_report_mode`) are dropped too.

Worker clients (one httpx pool per worker URL) of workers that left the pairing's pool are closed once no
request, nudge or health check still uses them, so discovery churn does not leak connections.

Admission control (`overload.shed_ttft_factor` with a TTFT SLO) refuses a request whose predicted TTFT is over
its bound with `Overloaded` (429 with Retry-After), before any worker is called (runtime.router.admission).

Every request's router load is released exactly once, whatever ends it: an answer, a worker error, or the
client going away (KServe cancels the handler on disconnect). A streaming request contacts its decode worker
before the response starts, so a worker error before the first chunk is an HTTP error, not a 200 stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import Request
from kserve.errors import ModelNotReady
from kserve.protocol.rest.openai import OpenAIGenerativeModel
from kserve.protocol.rest.openai.types import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
)

from runtime.engines.client import CHAT_PATH, COMPLETIONS_PATH, BackendError, VllmClient
from runtime.engines.vllm_worker import DEFAULT_KV_LEASE_S
from runtime.redact import redact_userinfo
from runtime.config import OverloadSpec
from runtime.router.admission import ServiceTimeEstimate, decide, is_priority
from runtime.router.priority import vllm_priority
from runtime.server.breakers import WorkerBreakers
from runtime.server.errors import Overloaded, create_error_response, openai_error_body
from runtime.server.metrics import UNSERVED_MODE, RuntimeMetrics
from runtime.server.migration import (
    HELD_TOKENS_REASON,
    UNREPLAYABLE_REASON,
    NotContinuable,
    TokenTrail,
    carries_token_output,
    chat_as_completion,
    chat_tokenize_body,
    choice_has_output,
    chunk_progress,
    completion_as_chat_chunk,
    continuation_body,
    continuation_chunk,
    flag,
    ids_continuable,
    ids_nulled,
)
from runtime.server.pairing import Pairing, Route, RouteRequest
from runtime.server.routing import CHARS_PER_TOKEN, estimate_prompt_tokens
from runtime.server.shapes import (
    choices_per_prompt,
    fan_out,
    merge_answers,
    needs_local_prefill,
    num_choices,
    refusal,
    remap_chunk,
    response_id,
    sum_usage,
)
from runtime.server.tokenize import PromptTokenizer

_DROPPED_FIELDS = ("kv_transfer_params", "ec_transfer_params")
# vllm_xargs keys (vLLM SamplingParams.extra_args) the runtime owns, never taken from a client: the transfer
# params name worker addresses; kv_cache_report_mode="full" (vllm/v1/request.py, 0.28) makes a worker re-send
# BlockStored for every prefix-cache hit, which would distort the router's KV index. A deny-list, not an
# allow-list: other xargs are model-specific request options (e.g. DeepSeek-OCR's ngram_size).
_RUNTIME_XARGS = frozenset(_DROPPED_FIELDS) | {"kv_cache_report_mode"}
# Fields the runtime reads to decide how to serve a request (runtime.server.shapes, migration, the prefill
# leg): taken as the request model validated them, not as sent. vLLM validates leniently ("2", 2.0 and "true"
# are read as 2, 2 and True), so a raw "n": "2" would otherwise pass as one choice and be served as two on
# one KV handoff, and a raw "seed": "3" would give every fanned-out choice the same seed. `prompt` too: vLLM reads
# [[1, 2], ["3", "4"]] as two token-id prompts, [1.0, 2.0] as one; split as sent, ["3", "4"] would go to one
# handoff as two text prompts, and [1.0, 2.0] as two prompts.
_DECIDING_FIELDS = ("n", "best_of", "seed", "temperature", "use_beam_search", "echo", "logprobs", "top_logprobs",
                    "prompt_logprobs", "max_tokens", "max_completion_tokens", "min_tokens", "stream_options",
                    "add_generation_prompt", "continue_final_message", "prompt")
# A worker's 4xx with these statuses is a deployment fault (worker API key, proxy auth, wrong path or served
# model name), never a mistake of the client's request.
_DEPLOYMENT_4XX = frozenset({401, 403, 404, 407})
#: Headroom between the last moment the runtime starts a decode leg on a handoff and the lease's end,
#: seconds: the decode worker must receive the request, schedule it and send its first heartbeat or read.
DEFAULT_KV_LEASE_MARGIN_S = 5.0

logger = logging.getLogger(__name__)


class _StreamFailedEarly(Exception):
    """The decode stream failed before its first chunk (no migration possible): answer with an HTTP error."""

    def __init__(self, exc: BackendError) -> None:
        super().__init__(str(exc))
        self.exc = exc


def _worker_error_message(body: Any) -> str | None:
    """The message of a vLLM/OpenAI error object (`{"error": {"message": ...}}` or vLLM's older
    `{"object": "error", "message": ...}`); None for any other body (text, HTML, other JSON)."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if body.get("object") == "error" and isinstance(body.get("message"), str):
        return body["message"]
    return None


def _worker_error_param(body: Any) -> str | None:
    """The `param` (request field) a vLLM/OpenAI error object names, or None when it names none."""
    err = body.get("error") if isinstance(body, dict) else None
    param = (err if isinstance(err, dict) else body if isinstance(body, dict) else {}).get("param")
    return param if isinstance(param, str) and param else None


def _worker_error_type(body: Any, status: int) -> str:
    """The `type` a vLLM/OpenAI error object names (an identifier such as "RateLimitError"), else the error
    class the OpenAI Python client raises for `status` (openai/_exceptions.py; "BadRequestError" otherwise)."""
    err = body.get("error") if isinstance(body, dict) else None
    kind = (err if isinstance(err, dict) else body if isinstance(body, dict) else {}).get("type")
    if isinstance(kind, str) and kind.isidentifier() and len(kind) <= 64:
        return kind
    return {409: "ConflictError", 422: "UnprocessableEntityError", 429: "RateLimitError"}.get(status, "BadRequestError")


def _is_client_fault(exc: BackendError) -> bool:
    """The worker rejected the request itself: a 4xx other than 401/403/404/407 whose body is a vLLM/OpenAI
    error object. Any other 4xx (a proxy's HTML page, worker auth, a wrong path) is a deployment fault."""
    return (400 <= exc.status_code < 500 and exc.status_code not in _DEPLOYMENT_4XX
            and _worker_error_message(exc.body) is not None)


def _backend_error_response(exc: BackendError) -> ErrorResponse:
    """OpenAI error for a worker failure: a worker's rejection of the request (`_is_client_fault`) passes
    through with its message and `param`; anything else is a 502/5xx whose message names no internal address (the
    worker's body is logged, never returned)."""
    known = exc.status_code in HTTPStatus._value2member_map_
    if _is_client_fault(exc):
        err = create_error_response(message=str(_worker_error_message(exc.body)),
                                    err_type=_worker_error_type(exc.body, exc.status_code),
                                    status_code=HTTPStatus(exc.status_code) if known else HTTPStatus.BAD_REQUEST)
        err.error.param = _worker_error_param(exc.body)  # the field the worker named, as vLLM names it
        return err
    if 400 <= exc.status_code < 500:
        logger.warning("worker %s answered %d (a deployment fault, not the client's): %.500s",
                       exc.url, exc.status_code, exc.body)
    status = HTTPStatus(exc.status_code) if known and exc.status_code >= 500 else HTTPStatus.BAD_GATEWAY
    # a worker's own text may name hosts, paths or internals: the client gets the status only
    reason = "timed out" if status == HTTPStatus.GATEWAY_TIMEOUT else f"answered {exc.status_code}" if (
        exc.status_code >= 400 and exc.status_code != 502) else "gave no usable answer"
    return create_error_response(message=f"inference worker failed: it {reason}",
                                 err_type="BackendError", status_code=status)


def _stream_error_event(chunk: dict, url: str) -> BackendError | None:
    """The worker's mid-stream error event (vLLM: `data: {"error": {...}}`, no choices) as a BackendError
    (status from its `code`, 500 when it has none), or None for any other chunk."""
    if chunk.get("choices") or not chunk.get("error"):
        return None
    err = chunk.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    try:
        status = int(code)
    except (TypeError, ValueError):
        status = 500
    return BackendError(url, status if 400 <= status < 600 else 500, chunk)


#: A decode worker's server errors for a request it produced nothing of: vLLM answers 500 once its engine is
#: gone (a crash; a leg that lands between its engine's shutdown and its HTTP server's closing, as a drained pod
#: stops), 502/503 say the same of what serves it. Nothing was generated, so the request is served on another
#: worker as one whose worker is unreachable is (within `RouterSpec.migration_limit`); a worker's bug that
#: fails every request fails it there too, once. 504 is the runtime's own read timeout: a slow worker, still
#: generating, is not a failed one.
_REFUSED_BEFORE_OUTPUT = frozenset({500, 502, 503})


def _worker_aborted(url: str, choices: Any) -> BackendError | None:
    """A BackendError for a worker that finished a choice with ``"abort"``, or None. The runtime reads a
    worker's answer only while its client waits, so the abort is the worker's own: vLLM aborts every request
    it holds when it shuts down (SIGTERM: at once, or at the end of `--shutdown-timeout`; a drain that reached
    its cap), and answers them as finished, cut short. Unreachable, as a worker that died: the request
    continues on another decode worker, never reaches the client as a whole answer."""
    if not isinstance(choices, list) or not any(
            isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices):
        return None
    return BackendError(url, 502, "the worker aborted the request (shutting down)", unreachable=True)


ROUTE_HEADERS = ("x-pdserve-route", "x-pdserve-prefill-worker", "x-pdserve-decode-worker",
                 "x-pdserve-overlap-blocks")


# a worker id shown as is in a response header: a short plain name such as "decode-0"
_PLAIN_WORKER_ID = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,62}")


def public_worker_id(worker_id: str, key: bytes) -> str:
    """`worker_id` as a response header may show it: a plain configured name (letters, digits, `_`, `-`,
    starting with a letter) as is; any other id (discovery's "<role>@<URL>", anything with an address, a
    dot, a colon or userinfo) as "<role>-<12 hex digits>", the role being the part before "@" when plain
    (else "worker") and the digits an HMAC-SHA256 of the id under `key` (stable for one key, not reversible
    without it: a bare hash of a pod IP could be reversed by trying the pod network's addresses)."""
    if _PLAIN_WORKER_ID.fullmatch(worker_id):
        return worker_id
    role = worker_id.split("@", 1)[0] if "@" in worker_id else ""
    role = role if _PLAIN_WORKER_ID.fullmatch(role) else "worker"
    return f"{role}-{hmac.new(key, worker_id.encode('utf-8', 'replace'), hashlib.sha256).hexdigest()[:12]}"


def priority_tokens(body: dict, prompt_tokens: int | None) -> int:
    """Prompt length (tokens) a prefill's priority is computed from: the largest of the router's token count
    (`prompt_tokens`, None when it could not tokenize), `estimate_prompt_tokens(body)` and the whole body's
    JSON characters / `CHARS_PER_TOKEN`. Text a chat template renders from other fields (`tools`, tool-call
    arguments, content parts of other types) counts too, so no body shape makes a long prompt look short;
    a body's JSON is at most a little longer than its text, so honest prompts keep their bucket."""
    chars = _json_chars(body)
    return max(prompt_tokens or 0, estimate_prompt_tokens(body), -(-chars // CHARS_PER_TOKEN))


def _json_chars(body: dict) -> int:
    """Characters of `body` as compact JSON with its text unescaped (`json.dumps(body, ensure_ascii=False,
    separators=(",", ":"))`). orjson writes that text about 40 x faster (a 40 kB prompt: 2 us against 84),
    the same but for floats, which it may write a character or two shorter or longer (1e-7 for 1e-07): a
    prompt-length estimate needs no more. Python's json writes what orjson refuses (an integer beyond 64
    bits, a lone surrogate)."""
    try:
        return len(orjson.dumps(body).decode())
    except TypeError:  # orjson.JSONEncodeError is one
        return len(json.dumps(body, ensure_ascii=False, separators=(",", ":")))


def _priority_label(body: dict) -> str:
    """The `priority` label of `pdserve_requests_shed_total`: "high" for priority traffic (prompt in priority
    bucket 0, runtime.router.admission.is_priority, judged by `priority_tokens`), else "normal"."""
    return "high" if is_priority(priority_tokens(body, None)) else "normal"


def _set_route_headers(context: dict | None, route: Route, key: bytes) -> None:
    """Worker ids (never addresses: `public_worker_id`) and the route reason as response headers
    (non-streaming responses)."""
    response = (context or {}).get("response")
    if response is None:
        return
    prefill = public_worker_id(route.prefill_worker, key) if route.prefill_worker else "local"
    values = (route.reason, prefill, public_worker_id(route.decode_worker, key), str(route.overlap_blocks))
    for name, value in zip(ROUTE_HEADERS, values):
        response.headers[name] = value


def _is_first_token(chunk: dict) -> bool:
    """Some choice of the chunk carries generated output (content, text, reasoning, a tool call or a finish
    reason): the decode worker's prefill is over."""
    return any(choice_has_output(c) for c in chunk.get("choices") or ())


class PDModel(OpenAIGenerativeModel):
    """KServe OpenAI model that forwards to vLLM prefill/decode workers.

    Args:
        name: the OpenAI `model` name clients use (also the workers' `--served-model-name`).
        pairing: chooses the workers of each request (URLs from configuration only).
        metrics: Prometheus metrics holder.
        timeout_s: read timeout of each worker call, seconds.
        clock: monotonic clock in seconds (injected for tests).
        client_factory: builds the client of one worker URL (default `VllmClient(url, timeout_s=...)`; tests
            pass one with an httpx transport).
        tokenizer: when given, each request's prompt token ids go to the pairing (KV-aware routing).
        prefill_timeout_s: a remote prefill slower than this counts as failed (local prefill instead), so a
            stuck prefill worker cannot hang requests, seconds.
        observer: optional request window of the planner loop (runtime.server.planner_loop.RequestWindow:
            `record_arrival(isl_tokens, priority=..., ago_s=..., key=...)` once per request as it comes in,
            answered or not (shed, failed and abandoned requests are demand too), `correct_arrival(key,
            isl_tokens)` with the worker's prompt count where the arrival had an estimate,
            `record_first_token(ttft_s)` when a first token reaches its client (a non-streamed answer: its
            remote prefill's; none where the decode worker prefilled it) and `record_finish(osl_tokens, itl_s,
            duration_s)` per answered request).
        prefill_nudge_after_s: when set, a request whose decode has not produced its first token this many
            seconds after a remote prefill sends the prefill worker a 1-token request, and again every as many
            seconds until the first token (`pdserve_prefill_nudges_total`). Why: with vLLM's NIXL pull
            connector on CPU, a decode worker sometimes waits for the prefill engine's next forward pass or
            its 30-s KV lease to expire (bench/pd_tail.py: P/D TTFT p99 30.6 s, 8 % of requests over 5 s on
            a 2-core host; a 1-token request to the prefill ends the wait, a health check does not; with the
            runtime nudging after 2 s, p99 6.5 s, 2 of 120 over 5 s). Non-streaming requests show no first
            token, so they are nudged until the whole answer arrives. None (default): never.
        traffic_log: optional recorder of finished requests (runtime.server.traffic.TrafficLog:
            `record(input_tokens, output_tokens)` from the workers' usage), the input of re-tuning.
        kv_lease_s: seconds a prefill worker keeps a handoff's KV blocks for the decode worker (vLLM NIXL
            `kv_lease_duration`, 30 s by default; the workers' EngineSpec.kv_lease_s when set).
        kv_lease_margin_s: a decode leg that would start later than `kv_lease_s - kv_lease_margin_s` after the
            prefill request was sent (the earliest the lease can have begun) does not use the handoff: the
            decode worker prefills locally instead; a streamed decode leg without a first token by then is
            closed and prefilled locally too (both `pdserve_kv_lease_expiries_total`). A non-streaming leg shows
            no first token: only its start is bounded.
        chat_default_max_tokens: the budget the decode workers give a chat request that names none, besides
            the context left (the model's generation config `max_new_tokens`,
            runtime.server.generation_defaults, read at start-up); None where they give the context left or it
            is not known. A migrated stream's continuation asks for what is left of it
            (runtime.server.migration.continuation_body).

    TTFT (`pdserve_ttft_seconds`): streamed requests only — arrival to the first streamed token, as the client
    sees it (remote: prefill + NIXL pull + first decode step). A non-streamed client sees no token before the
    whole answer; the planner is still told a remote prefill's time as its first token.
    """

    def __init__(
        self,
        name: str,
        pairing: Pairing,
        *,
        metrics: RuntimeMetrics,
        timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        client_factory: Callable[[str], VllmClient] | None = None,
        tokenizer: PromptTokenizer | None = None,
        prefill_timeout_s: float = 120.0,
        observer: Any | None = None,
        prefill_nudge_after_s: float | None = None,
        prefill_priority: bool = False,
        wall_clock: Callable[[], float] = time.time,
        traffic_log: Any | None = None,
        kv_lease_s: float = DEFAULT_KV_LEASE_S,
        kv_lease_margin_s: float = DEFAULT_KV_LEASE_MARGIN_S,
        overload: OverloadSpec | None = None,
        slo_ttft_s: float | None = None,
        chat_default_max_tokens: int | None = None,
    ) -> None:
        super().__init__(name)
        self.chat_default_max_tokens = chat_default_max_tokens
        if not 0 <= kv_lease_margin_s < kv_lease_s:
            raise ValueError(f"kv_lease_margin_s={kv_lease_margin_s}: expected 0 <= margin < kv_lease_s={kv_lease_s}")
        self.kv_lease_s = kv_lease_s
        self.kv_lease_margin_s = kv_lease_margin_s
        self.traffic_log = traffic_log
        self.pairing = pairing
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.clock = clock
        self._client_factory = client_factory or (lambda url: VllmClient(url, timeout_s=timeout_s))
        self._clients: dict[str, VllmClient] = {}
        self._uses: dict[object, set[str]] = {}  # user (request id, nudger, health check) -> URLs it uses now
        self._url_users: dict[str, int] = {}  # URL -> number of users of its client now
        self._closing: set[asyncio.Task] = set()  # clients of departed workers being closed
        self.tokenizer = tokenizer
        self.prefill_timeout_s = prefill_timeout_s
        self.observer = observer
        if prefill_nudge_after_s is not None and not prefill_nudge_after_s > 0:
            raise ValueError(f"prefill_nudge_after_s={prefill_nudge_after_s}: expected seconds > 0 or None")
        self.prefill_nudge_after_s = prefill_nudge_after_s
        self.prefill_priority = prefill_priority
        self.wall_clock = wall_clock  # Unix seconds: prefill priorities must agree across runtime replicas
        self._header_key = secrets.token_bytes(16)  # keys the worker ids in response headers
        self.overload = overload or OverloadSpec()
        if slo_ttft_s is not None and not slo_ttft_s > 0:
            raise ValueError(f"slo_ttft_s={slo_ttft_s}: expected seconds > 0 or None")
        self.slo_ttft_s = slo_ttft_s
        self.breakers = WorkerBreakers(pairing, self.overload, gauge=metrics.breaker_state, clock=clock,
                                       label=lambda wid: public_worker_id(wid, self._header_key),
                                       on_down=self._abandon_silent, stalled=self._stall_verdict)
        # every series naming a worker shows the keyed id the breaker gauge shows, never a discovered id
        # (an unkeyed hash of the worker's URL); readiness read at scrape time, as it changes between requests
        metrics.kv_index.label = lambda wid: public_worker_id(wid, self._header_key)
        metrics.ready.set_function(lambda: 1.0 if self.ready else 0.0)
        self.breakers.sync()
        self.service = ServiceTimeEstimate()  # per-request service time, from first tokens (admission control)
        # request id -> (requests waiting for a first token, servers) when it was admitted; popped at its first
        # token or its end
        self._awaiting: dict[str, tuple[int, int]] = {}
        # request id -> its route's accounting, run after its decode leg is sent (`_record_route`)
        self._deferred: dict[str, Callable[[], None]] = {}

    @property
    def ready(self) -> bool:
        """Some decode worker (every decode worker can also prefill locally) has answered a health check and
        its breaker is closed (runtime.server.breakers): requests can be served. False until a check answers."""
        return self.breakers.any_decode_serving()

    @ready.setter
    def ready(self, value: bool) -> None:
        """KServe's `load()` and constructor set `ready`; here readiness is the workers' health only."""

    def decode_urls(self) -> list[str]:
        """Base URLs of the pairing's decode-capable workers (roles "decode" and "both")."""
        workers = getattr(self.pairing, "workers", None)
        if isinstance(workers, dict):
            return [w.url.rstrip("/") for w in workers.values() if getattr(w, "role", "decode") != "prefill"]
        return [u.rstrip("/") for u in getattr(self.pairing, "decode_urls", [])]

    def _note_answer(self, url: str, exc: BackendError | None) -> None:
        """Report a worker call's outcome (None: answered) to the worker's breaker (runtime.server.breakers)."""
        self.breakers.record_call(url, exc)

    def _abandon_silent(self, url: str, silent_s: float) -> None:
        """The worker at `url` is judged down (its breaker opened): its calls in flight silent for `silent_s`
        seconds fail as a dead worker's would, so that their requests migrate (runtime.server.breakers)."""
        for key, client in list(self._clients.items()):
            if key.rstrip("/") == url:
                n = client.abandon_silent(silent_s)
                if n:
                    logger.warning("worker %s judged down: %d call(s) silent for %.0f s or more abandoned",
                                   redact_userinfo(url), n, silent_s)

    def _stall_verdict(self, url: str, window_s: float, waiting: bool) -> bool | None:
        """Whether the worker at `url` is stalled by its streams in flight (runtime.engines.h1.H1Pool.stall_verdict
        over its clients: False when one is producing, else True when one is silent, else None)."""
        verdicts = [client.stall_verdict(window_s, waiting=waiting)
                    for key, client in list(self._clients.items()) if key.rstrip("/") == url]
        if False in verdicts:
            return False
        return True if True in verdicts else None

    def worker_urls(self) -> list[str]:
        """Base URLs of every worker of the pairing's pool (prefill and decode), for health checks."""
        pool = self._pool_urls()
        return sorted(pool) if pool is not None else self.decode_urls()

    def _client(self, url: str, user: object = None) -> VllmClient:
        """The client of worker `url`, recorded as used by `user` until `_release(user)`. Creating a client
        also closes the unused clients of workers no longer in the pool (discovery churn)."""
        if user is not None and url not in self._uses.setdefault(user, set()):
            self._uses[user].add(url)
            self._url_users[url] = self._url_users.get(url, 0) + 1
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = self._client_factory(url)
            pool = self._pool_urls()
            if pool is not None:
                for old in [u for u in self._clients if u != url and u.rstrip("/") not in pool]:
                    if not self._url_users.get(old):
                        self._close_later(old)
        return client

    def _release(self, user: object) -> None:
        """`user` no longer uses its clients; those of workers that left the pool are closed when unused."""
        urls = self._uses.pop(user, ())
        pool = None
        for url in urls:
            left = self._url_users.get(url, 1) - 1
            if left > 0:
                self._url_users[url] = left
                continue
            self._url_users.pop(url, None)
            pool = self._pool_urls() if pool is None else pool
            if pool is not None and url.rstrip("/") not in pool:
                self._close_later(url)

    def _pool_urls(self) -> frozenset[str] | None:
        """Base URLs of the pairing's pool (runtime.server.routing.RouterPairing `workers`, including workers
        marked down, or RoundRobinPairing's URL lists); None for a pairing that exposes neither."""
        workers = getattr(self.pairing, "workers", None)
        if isinstance(workers, dict):
            urls = [getattr(w, "url", None) for w in workers.values()]
            return frozenset(u.rstrip("/") for u in urls) if all(isinstance(u, str) for u in urls) else None
        prefill, decode = getattr(self.pairing, "prefill_urls", None), getattr(self.pairing, "decode_urls", None)
        if isinstance(prefill, list) and isinstance(decode, list):
            return frozenset(u.rstrip("/") for u in [*prefill, *decode])
        return None

    def _close_later(self, url: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to close it in: the next sweep or aclose() does
            return
        client = self._clients.pop(url, None)
        if client is None:
            return
        task = loop.create_task(client.aclose(), name=f"close-client:{url}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def worker_healthy(self, url: str) -> bool:
        """GET <url>/health answered 200 within its timeout (the check `check_loop` feeds the breakers)."""
        user = object()
        try:
            return await self._client(url, user).healthy()
        finally:
            self._release(user)

    async def worker_metrics(self, url: str) -> str:
        """GET <url>/metrics (Prometheus text): the engine's own gauges (runtime.server.engine_load).

        Raises:
            BackendError: the worker failed or is unreachable.
        """
        user = object()
        try:
            return await self._client(url, user).metrics_text()
        finally:
            self._release(user)

    async def aclose(self) -> None:
        """Close every worker client (also those of departed workers still being closed)."""
        clients = list(self._clients.values())  # a request may add a client while we await a close
        self._clients.clear()
        for c in clients:
            await c.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def _request_body(self, request: Any, raw_request: Request | None) -> dict:
        """The body as the client sent it (all fields), minus internal fields; `model` set to ours."""
        body: Any = None
        if raw_request is not None:
            try:
                body = await raw_request.json()
            except (ValueError, RuntimeError):
                body = None
        if not isinstance(body, dict):
            body = request.model_dump(mode="json", exclude_unset=True)
        for f in _DROPPED_FIELDS:
            body.pop(f, None)
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict):
            body["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in _RUNTIME_XARGS}
        # the validated value decides (pydantic reads "false" as False; the raw JSON string is truthy)
        body["stream"] = bool(getattr(request, "stream", False))
        fields = getattr(type(request), "model_fields", {})
        values = getattr(request, "__dict__", {})  # not getattr: a deprecated field (max_tokens) warns per read
        for key in _DECIDING_FIELDS:
            if key in body and key in fields and key in values:
                value = values[key]
                body[key] = value.model_dump(mode="json", exclude_unset=True) if hasattr(value, "model_dump") else value
        # vLLM names the answer after the client's X-Request-Id header, else its request_id field (shapes.response_id)
        headers = getattr(raw_request, "headers", None)
        client_rid = headers.get("x-request-id") if headers is not None else None
        if client_rid is not None:
            body["request_id"] = client_rid
        body["model"] = self.name
        return body

    async def create_completion(
        self, request: CompletionRequest, raw_request: Request | None = None, context: dict | None = None
    ) -> AsyncGenerator[str, None] | Completion | ErrorResponse:
        body = await self._request_body(request, raw_request)
        return await self._dispatch(COMPLETIONS_PATH, "completions", body, Completion, context)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request | None = None, context: dict | None = None
    ) -> AsyncGenerator[str, None] | ChatCompletion | ErrorResponse:
        body = await self._request_body(request, raw_request)
        return await self._dispatch(CHAT_PATH, "chat", body, ChatCompletion, context)

    async def _dispatch(self, path: str, endpoint: str, body: dict, response_type: type,
                        context: dict | None) -> Any:
        """Serve `body` as runtime.server.shapes says: refused (400 naming the field), fanned out into one
        prefill → decode per prompt and choice (answers merged in vLLM's choice order), or served whole."""
        refused = refusal(path, body)
        if refused is not None:
            message, param = refused
            err = create_error_response(message, err_type="BadRequestError", status_code=HTTPStatus.BAD_REQUEST)
            err.error.param = param
            return err
        self._admit(path, body)
        subs = fan_out(path, body)
        if subs is None:
            return await self._serve(path, endpoint, body, response_type, context)
        results = await asyncio.gather(*(self._serve(path, endpoint, sub, response_type, None) for sub in subs),
                                       return_exceptions=True)
        failed = next((r for r in results if isinstance(r, (ErrorResponse, BaseException))), None)
        if failed is not None:
            for r in results:  # streams that did start hold worker requests and router load: close them
                if isinstance(r, AsyncGenerator):
                    await r.aclose()
            if isinstance(failed, BaseException):
                raise failed
            return failed
        n = choices_per_prompt(body)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return _merge_streams(results, bool(options.get("include_usage")), n,
                                  bool(options.get("include_usage") and options.get("continuous_usage_stats")))
        answers = [r.model_dump(mode="json", exclude_unset=True) for r in results]
        try:
            merged = merge_answers(answers, n)
        except ValueError as exc:  # a worker answered a one-choice request with another number of choices
            logger.warning("fanned-out %s request: %s", endpoint, exc)
            return _backend_error_response(BackendError("decode", HTTPStatus.BAD_GATEWAY, str(exc)))
        return response_type.model_validate(merged)

    def count_unready(self, raw_body: bytes, path: str = "") -> None:
        """A request refused because the model is not ready (runtime.server.edge; `path` as received): demand
        the planner's window counts, as it counts a shed one (a generation route's), counted in
        `pdserve_requests_total{mode="none", status="error"}` (a generation route's: the service is down for it,
        and the error-rate alerts must see it) and in `pdserve_requests_shed_total{reason="breaker_open"}` when
        that is because decode breakers are open."""
        try:
            body = json.loads(raw_body)
        except ValueError:
            body = None
        body = body if isinstance(body, dict) else {}
        if path.endswith("/completions"):
            chat = path.endswith("/chat/completions")
            self._record_refused(CHAT_PATH if chat else COMPLETIONS_PATH, body)
            self.metrics.child(self.metrics.requests, "chat" if chat else "completions", UNSERVED_MODE,
                               "error").inc()
        if self.breakers.any_open("decode"):
            self.metrics.shed.labels("breaker_open", _priority_label(body)).inc()

    def _record_refused(self, path: str, body: dict) -> None:
        """A request refused before it was served (shed, not ready) in the planner's window: an arrival for
        each request it splits into. Unseen, shedding would hide the very load that calls for
        more workers."""
        if self.observer is None:
            return
        for sub in fan_out(path, body) or [body]:
            self._record_arrival(sub, None, 0.0)

    def _servers(self) -> int:
        """Workers in rotation that make the first tokens: the prefill workers, or the decode workers when no
        prefill worker is in rotation (they prefill locally)."""
        return self.breakers.in_rotation("prefill") or self.breakers.in_rotation("decode")

    def _admit(self, path: str, body: dict) -> None:
        """Admission control (runtime.router.admission): with `overload.shed_ttft_factor` and a TTFT SLO,
        raise `Overloaded` (429 with Retry-After, counted in `pdserve_requests_shed_total` and in
        `pdserve_requests_total{mode="none", status="shed"}`) when the request's
        predicted TTFT exceeds the bound; priority traffic's bound is `shed_priority_factor` times higher."""
        factor = self.overload.shed_ttft_factor
        if factor is None or self.slo_ttft_s is None:
            return
        label = _priority_label(body)
        d = decide(ahead=len(self._awaiting), servers=self._servers(), service_s=self.service.value,
                   slo_ttft_s=self.slo_ttft_s, factor=factor, priority=label == "high",
                   priority_factor=self.overload.shed_priority_factor)
        if d.admit:
            return
        self.metrics.shed.labels("queue_wait", label).inc()
        self.metrics.child(self.metrics.requests, "chat" if path.endswith("/chat/completions") else "completions",
                           UNSERVED_MODE, "shed").inc()
        self._record_refused(path, body)  # the planner sizes for the demand, shed requests included
        raise Overloaded(f"The service is overloaded: this request's predicted time to first token is "
                         f"{d.predicted_ttft_s:.1f} s, over the {d.bound_s:.1f} s it admits; retry after "
                         f"{d.retry_after_s} s.", d.retry_after_s)

    def _first_token(self, rid: str, ttft_s: float | None) -> None:
        """Request `rid` has its first token (`ttft_s` seconds after arrival; None: no first-token time, e.g. a
        non-streaming local answer): it no longer waits, and its time teaches the service-time estimate."""
        entry = self._awaiting.pop(rid, None)
        if entry is not None and ttft_s is not None:
            self.service.observe(ttft_s, *entry)

    async def _prefill(self, route: Route, path: str, body: dict, rid: str,
                       prompt_tokens: int | None = None) -> tuple[Route, dict | None]:
        """Run the remote prefill; on worker failure switch to local prefill (`pdserve_prefill_fallbacks_total`);
        on the worker's rejection of the request (`_is_client_fault`) too, uncounted, so that the client's
        error comes from the decode worker, about the client's own request. With `prefill_priority` (the prefill workers run
        `--scheduling-policy priority`) the prefill request's vLLM `priority` is always the runtime's:
        `runtime.router.priority.vllm_priority` of the prompt length (`prompt_tokens`, or
        `priority_tokens`) at the wall clock, replacing any the client sent: short prompts are not queued
        behind long ones, and no client jumps the queue."""
        if route.prefill_url is None:
            return route, None
        if self.prefill_priority:
            body = {**body, "priority": vllm_priority(priority_tokens(body, prompt_tokens), self.wall_clock())}
        try:
            # asyncio.timeout bounds the call in this task (wait_for would run it in a task of its own)
            async with asyncio.timeout(self.prefill_timeout_s):
                kv = await self._client(route.prefill_url, rid).prefill(path, body, rid, dp_rank=route.prefill_dp_rank)
        except asyncio.TimeoutError:
            kv = None
        except BackendError as exc:
            self._note_answer(route.prefill_url, exc)
            if _is_client_fault(exc):
                # the prefill leg's rejection speaks of the leg (max_tokens=1, no stream); the decode worker,
                # given the client's own request, answers it or rejects it in the client's terms
                logger.info("prefill worker %s rejected request %s: serving it on the decode worker: %.300s",
                            exc.url, rid, exc.body)
                return self._prefill_locally(rid), None
            if 400 <= exc.status_code < 500:
                logger.warning("prefill worker %s answered %d (a deployment fault): prefilling locally: %.500s",
                               exc.url, exc.status_code, exc.body)
            kv = None
        else:
            self._note_answer(route.prefill_url, None)
        if kv is None:  # worker down, 5xx, a deployment-fault 4xx, or a worker without a KV connector
            self.metrics.prefill_fallbacks.inc()
            return self._prefill_locally(rid), None
        return route, kv

    def _prefill_locally(self, rid: str) -> Route:
        """The route on which the decode worker prefills request `rid` itself (`Pairing.on_prefill_failed`);
        when that worker is no longer usable (its breaker opened while the request waited on it: a retry
        there would wait on a worker judged down), another decode worker's (`Pairing.on_decode_failed`, a
        migration within `RouterSpec.migration_limit`).

        Raises:
            ModelNotReady: its decode worker left the pool, or is out of rotation, and no other can take the
                request (a 503 with Retry-After).
        """
        try:
            route = self.pairing.on_prefill_failed(rid, self.clock())
        except RuntimeError as exc:  # runtime.router.core.NoWorkersError: the request is freed
            raise ModelNotReady(self.name, str(exc)) from exc
        if self.breakers.usable(route.decode_url):
            return route
        new = self.pairing.on_decode_failed(rid, self.clock())
        if new is None:
            raise ModelNotReady(self.name, "the request's decode worker is out of rotation and no other decode "
                                "worker can take it")
        self.metrics.migrations.inc()
        return new

    def _start_nudger(self, route: Route, kv: dict | None, first_token: asyncio.Event) -> asyncio.Task | None:
        """The task that nudges `route`'s prefill worker until `first_token` is set (see `prefill_nudge_after_s`);
        None when nudging is off or the prefill ran locally."""
        if kv is None or route.prefill_url is None or self.prefill_nudge_after_s is None:
            return None
        return asyncio.create_task(self._nudge_prefill(route.prefill_url, first_token))

    async def _nudge_prefill(self, url: str, first_token: asyncio.Event) -> None:
        """Every `prefill_nudge_after_s` without a first token: one 1-token completion on the prefill worker
        (its own request id, no KV transfer). Errors are ignored: the nudge is best effort."""
        body = {"model": self.name, "prompt": ".", "max_tokens": 1, "temperature": 0}
        user = object()  # the nudger holds the client until it ends (it may outlive the request by a step)
        try:
            while True:
                try:
                    await asyncio.wait_for(first_token.wait(), self.prefill_nudge_after_s)
                    return
                except asyncio.TimeoutError:
                    pass
                self.metrics.prefill_nudges.inc()
                try:
                    await self._client(url, user).complete(COMPLETIONS_PATH, body,
                                                           f"pdserve-nudge-{uuid.uuid4().hex}")
                except (BackendError, ValueError):
                    pass
        finally:
            self._release(user)

    async def _serve(self, path: str, endpoint: str, body: dict, response_type: type, context: dict | None = None) -> Any:
        t0 = self.clock()
        rid = f"pdserve-{uuid.uuid4().hex}"
        # an arrival in the planner's window as it comes in (runtime.server.planner_loop), before a tokenizer
        # that a burst of long chat templates queues: the body's estimate until the tokenizer or the worker counts
        self._record_arrival(body, None, 0.0, rid)
        token_ids = None
        if self.tokenizer is not None:  # chat templates of long prompts take seconds: off the event loop
            try:
                token_ids = await asyncio.to_thread(self.tokenizer.token_ids, path, body)
            except Exception:  # routing knowledge only: a prompt the tokenizer chokes on is routed on load
                logger.warning("could not tokenize a %s request for routing; routing on load alone", endpoint,
                               exc_info=True)
                token_ids = None
            if token_ids is not None and self.observer is not None:
                self.observer.correct_arrival(rid, len(token_ids))
        try:
            route = self.pairing.choose(RouteRequest(rid, path, body, token_ids, t0))
            # a decode worker known dead (health check, refused connection) is not worth a prefill: choose
            # again, as many times as there are decode workers, while another may be alive
            tries = None
            while not self.breakers.usable(route.decode_url):
                tries = len(self.decode_urls()) if tries is None else tries
                self.pairing.on_complete(rid, self.clock(), False)
                if tries == 0:
                    raise RuntimeError("no decode worker is answering")
                tries -= 1
                route = self.pairing.choose(RouteRequest(rid, path, body, token_ids, t0))
        except RuntimeError as exc:
            self.metrics.child(self.metrics.requests, endpoint, UNSERVED_MODE, "error").inc()
            if self.breakers.any_open("decode"):  # every decode worker out: a clear 503, never a wait
                self.metrics.shed.labels("breaker_open", _priority_label(body)).inc()
                exc = RuntimeError("every decode worker is out of rotation (circuit breaker open or half-open)")
            raise ModelNotReady(self.name, str(exc)) from exc  # 503 with Retry-After (runtime.server.errors)
        self.metrics.child(self.metrics.queue_wait, endpoint).observe(self.clock() - t0)
        self.metrics.child(self.metrics.in_flight, endpoint).inc()  # decremented by _count, which _finish calls once
        self._awaiting[rid] = (len(self._awaiting), self._servers())
        # from here on the route holds router load: released by _finish exactly once, on every path out
        state = {"route": route, "mode": None, "owner": "serve"}
        try:
            return await self._serve_route(path, endpoint, body, response_type, context, rid, t0, token_ids, state)
        except asyncio.CancelledError:  # the client left: not the service's failure
            state["status"] = "cancelled"
            raise
        finally:
            if state["owner"] == "serve":  # an exception, a cancellation (client gone) or an early return
                self._finish(rid, endpoint, state["route"], t0, ok=False, mode=state["mode"],
                             status=state.get("status"))

    async def _serve_route(self, path: str, endpoint: str, body: dict, response_type: type, context: dict | None,
                           rid: str, t0: float, token_ids: list[int] | None, state: dict) -> Any:
        route = state["route"]
        if route.prefill_url is not None and needs_local_prefill(path, body):
            # prompt log-probabilities and beam search need the prompt computed where the answer is made
            route = dataclasses.replace(self._prefill_locally(rid), reason="local_shape")
        # The prefill worker starts the handoff's lease when its engine finishes the request, which can be long
        # before its answer arrives here (a starved API server, a slow network): the earliest the lease can
        # have begun is when the prefill request was sent, so the lease bounds count from then.
        kv_at = self.clock()
        route, kv = await self._prefill(route, path, body, rid, None if token_ids is None else len(token_ids))
        if kv is not None and self._decode_start_late(kv_at):
            # the decode leg would start too close to (or after) the lease's end: it could read released
            # blocks. The decode worker prefills itself instead; the handoff's blocks expire unread.
            self.metrics.kv_lease_expiries.inc()
            logger.warning("request %s: decode leg not started within the KV lease (%.0f s, margin %.0f s): "
                           "prefilling locally", rid, self.kv_lease_s, self.kv_lease_margin_s)
            route, kv = self._prefill_locally(rid), None
        state["route"] = route
        mode = state["mode"] = "remote" if kv is not None else "local"
        _set_route_headers(context, route, self._header_key)
        now = self.clock()
        # the prefill produced the first token: its load is gone
        prefill_done_s = now - t0 if kv is not None else None
        # What only records the route runs once the decode leg's request is written, on the event loop's next
        # turn while the decode worker works, not on the path to the first token; `_finish` runs it first if
        # it has not run by then.
        self._deferred[rid] = functools.partial(self._record_route, rid, route, token_ids, now,
                                                prefill_done_s)
        asyncio.get_running_loop().call_soon(self._run_deferred, rid)
        decode = self._client(route.decode_url, rid)
        if body.get("stream"):
            gen = self._stream(decode, path, endpoint, body, rid, kv, route, t0, mode, token_ids is None,
                               kv_at + self.kv_lease_s, (context or {}).get("send_head"))
            state["owner"] = "stream"  # the generator's own finally releases the load from here on
            try:
                first = await gen.__anext__()
            except _StreamFailedEarly as early:
                return _backend_error_response(early.exc)
            return _Prepended(first, gen)
        first_token = asyncio.Event()
        nudger = self._start_nudger(route, kv, first_token)
        try:
            while True:
                try:
                    answer = await decode.complete(path, body, rid, kv, dp_rank=route.decode_dp_rank)
                    aborted = _worker_aborted(route.decode_url, answer.get("choices"))
                    if aborted is not None:  # cut short by the worker's shutdown: served again elsewhere
                        raise aborted
                    self._note_answer(route.decode_url, None)
                    break
                except BackendError as exc:
                    # nothing of a whole answer reached the client, whatever the worker had done
                    new = self._migrate(exc, route, rid, started=False)
                    if new is None:  # a rejected decode leg's handoff is freed by the decode worker (see above)
                        if _is_client_fault(exc):  # the client's own request, rejected: not the service's failure
                            state["status"] = "client_error"
                        err = _backend_error_response(exc)
                        if _moves(exc, False):  # it could have moved: say why it did not
                            err.error.message = f"{err.error.message}; {NO_WORKER_LEFT_REASON}"
                        return err
                    route, kv, decode, mode = new, None, self._client(new.decode_url, rid), "migrated"
                    state["route"], state["mode"] = route, mode
        finally:
            first_token.set()
            if nudger is not None:
                nudger.cancel()
        answer.pop("kv_transfer_params", None)
        named = response_id(path, body)
        if named is not None and "id" in answer:
            answer["id"] = named
        try:
            result = response_type.model_validate(answer)
        except ValueError:  # pydantic ValidationError: the worker's 200 is not an OpenAI response
            return _backend_error_response(BackendError(route.decode_url, 502, "not an OpenAI response object"))
        total_s = self.clock() - t0
        # the first token is seen only when a remote prefill made it; otherwise the client got it with the
        # whole answer, and the split between prefill and decode is unknown: no ITL, and the planner is told
        # nothing of either. pdserve_ttft_seconds is not observed for any non-streamed answer: the client sees
        # no token before the whole answer, so neither the prefill's time (remote) nor the whole request's
        # (local) is the TTFT the SLO means, and each would skew it differently (runtime.server.metrics).
        ttft_s = prefill_done_s if (kv is not None and prefill_done_s is not None) else None
        if ttft_s is not None:  # the planner's first token: the remote prefill's, of an answer its client got
            self._observe_first_token(ttft_s)
        num_out = (answer.get("usage") or {}).get("completion_tokens") or 0
        if num_out > 1 and ttft_s is not None:
            self.metrics.child(self.metrics.itl, endpoint, mode).observe((total_s - ttft_s) / (num_out - 1))
        state["owner"] = "done"
        self._finish(rid, endpoint, route, t0, ok=True, mode=mode)
        usage = answer.get("usage") or {}
        self._observe(rid, usage, token_ids is None, ttft_s, total_s, usage.get("completion_tokens") or 0)
        return result

    def _record_route(self, rid: str, route: Route, token_ids: list[int] | None, routed_at: float,
                      prefill_done_s: float | None) -> None:
        """Count request `rid`'s route (`routed_at`: clock when its prefill leg ended) and, with a remote
        prefill (`prefill_done_s` after arrival), release its prefill load and record its first token."""
        self.metrics.child(self.metrics.routes, route.reason or "none").inc()
        if token_ids is not None:
            self.metrics.prompt_tokens.inc(len(token_ids))
            predicted = route.overlap_blocks * getattr(self.pairing, "block_size_tokens", 0)
            self.metrics.prefix_predicted_tokens.inc(min(predicted, len(token_ids)))
        if prefill_done_s is not None:
            self.pairing.on_first_token(rid, routed_at)
            self._first_token(rid, prefill_done_s)

    def _run_deferred(self, rid: str) -> None:
        """Run request `rid`'s deferred work (`_record_route`) once: errors are logged, never raised (it runs
        as an event-loop callback, or from `_finish`)."""
        work = self._deferred.pop(rid, None)
        if work is None:
            return
        try:
            work()
        except Exception:  # noqa: BLE001 - accounting must not fail the request or the loop
            logger.exception("recording the route of request %s failed", rid)

    def _decode_start_late(self, kv_at: float) -> bool:
        """A decode leg starting now would start after `kv_lease_s - kv_lease_margin_s` from `kv_at`."""
        return self.clock() - kv_at > self.kv_lease_s - self.kv_lease_margin_s

    def _observe(self, rid: str, usage: dict, estimated_isl: bool, ttft_s: float | None, total_s: float,
                 osl_tokens: int, itl_s: float | None = None) -> None:
        """Feed the planner's request window and the traffic log (each if any) with request `rid`, finished:
        its worker's prompt count corrects the arrival's estimate (`estimated_isl`: no tokenizer counted it),
        its output length, ITL (from `ttft_s` when not given; `ttft_s` None: its first token was not seen, no
        ITL) and duration `total_s`."""
        prompt_tokens = _count(usage, "prompt_tokens")  # a worker's usage is not trusted to hold numbers
        if self.traffic_log is not None:
            self.traffic_log.record(prompt_tokens, int(osl_tokens), ago_s=total_s)
        if self.observer is None:
            return
        if estimated_isl and prompt_tokens > 0:
            self.observer.correct_arrival(rid, prompt_tokens)
        if itl_s is None and osl_tokens > 1 and ttft_s is not None:
            itl_s = (total_s - ttft_s) / (osl_tokens - 1)
        self.observer.record_finish(int(osl_tokens), itl_s, total_s)

    def _observe_first_token(self, ttft_s: float) -> None:
        """A first token reached its client `ttft_s` seconds after the request arrived: the planner's window."""
        if self.observer is not None:
            self.observer.record_first_token(ttft_s)

    def _record_arrival(self, body: dict, prompt_tokens: int | None, ago_s: float, rid: str | None = None) -> None:
        """One request's arrival `ago_s` seconds ago in the planner's window (if any), named `rid` for its
        correction: `prompt_tokens` (None: unknown, the body's estimate,
        runtime.server.routing.estimate_prompt_tokens), priority traffic as admission judges it
        (runtime.router.admission.is_priority of `priority_tokens`)."""
        if self.observer is None:
            return
        n = estimate_prompt_tokens(body) if prompt_tokens is None else prompt_tokens
        self.observer.record_arrival(n, priority=is_priority(priority_tokens(body, n)), ago_s=ago_s, key=rid)

    def _migrate(self, exc: BackendError, route: Route, rid: str, *, started: bool = True,
                 count: bool = True) -> Route | None:
        """After a decode failure: the route to continue on, or None (no migration: the worker answered, or was
        only slow, or the request may not move again). `started`: the failed attempt produced output; one that
        did not and was refused with a server error (`_REFUSED_BEFORE_OUTPUT`) moves like a dead worker's, and
        so does one whose stream broke the protocol (`BackendError.broken`: what it sent before is sound).
        `count`: count the migration here (else the caller counts it once it sends the continuation)."""
        self._run_deferred(rid)  # the first route's accounting before the router moves the request
        self._note_answer(route.decode_url, exc)
        if not _moves(exc, started):
            return None
        new = self.pairing.on_decode_failed(rid, self.clock())
        if new is not None and count:
            self.metrics.migrations.inc()
        return new

    async def _checked_continuation(self, path: str, cont: dict, trail: TokenTrail | None, decode_url: str,
                                    rid: str) -> tuple[str, dict | None, str | None]:
        """The continuation `cont` as it may be sent to the decode worker at `decode_url`: `(path, request, None)`,
        or `(path, None, why not)`. The checks need the stream's prompt and output ids (`trail`), and ask that
        worker:
        * chat (prompted with the text sent): the worker's own rendering of `cont` (`POST /tokenize`) must give
          exactly those ids, so that it goes on from the uninterrupted answer's tokens. Where it renders otherwise
          (a chat template that trims the continued message, text that tokenizes otherwise inside the longer
          prompt: a newline merged with the word after it) the continuation goes as a completions request of
          those ids (`chat_as_completion`, whose chunks `_stream` writes as chat chunks), or, where a completion
          would not keep the request's chat meaning, not at all;
        * completions (prompted with the ids up to the last chunk with text): that chunk, when it held several
          tokens, must not end inside a character (`POST /detokenize` of its ids ends with U+FFFD: vLLM held the
          bytes back), else the prompt of ids ends there and vLLM 0.28 sends the whole decoded prompt as the
          continuation's first text.
        Without the ids (a worker that does not return them) the continuation is sent unchecked
        (docs/serving.md)."""
        ids = trail.ids() if trail is not None else None
        if ids is None or not trail.output:  # nothing generated was sent: the request itself goes again
            return path, cont, None
        client = self._client(decode_url, rid)
        try:
            if path == CHAT_PATH:
                if await client.tokenize(chat_tokenize_body(self.name, cont), rid) == ids:
                    return path, cont, None
                has_budget = bool(cont.get("max_completion_tokens")) or cont.get("max_tokens") is not None
                try:
                    as_completion = chat_as_completion(
                        cont, ids, None if has_budget else await client.max_model_len(self.name))
                except NotContinuable as exc:
                    return path, None, ("the text sent renders or tokenizes otherwise in a chat continuation's "
                                        f"prompt than the tokens the answer was made of, and {exc}")
                return COMPLETIONS_PATH, as_completion, None
            if len(trail.last_text) > 1 and (await client.detokenize(trail.last_text, rid)).endswith("\ufffd"):
                return path, None, "the last text sent ends inside a character whose bytes the worker held back"
        except BackendError as exc:
            return path, None, f"the next worker could not check the continuation's prompt ({exc})"
        return path, cont, None

    async def _stream(
        self, decode: VllmClient, path: str, endpoint: str, body: dict, rid: str, kv: dict | None,
        route: Route, t0: float, mode: str, estimated_isl: bool = True, lease_end: float | None = None,
        send_head: Callable[[], Awaitable[None]] | None = None,
    ) -> AsyncGenerator[str, None]:
        """The client's stream, from decode workers' streams (a migration continues it on another).

        `send_head` (the edge's, runtime.server.direct; None on KServe's route): sends the client the stream's
        200 head; awaited when the first decode worker's own 2xx head arrives, so that the client has read
        the head by the first token (as vLLM's P/D proxy and vllm-router forward the decode worker's head).
        Until then a failure is an HTTP error (`_StreamFailedEarly`); after it, an error event in the stream.
        A stream with nothing sent yet goes whole to another worker either way."""
        ok = False
        status = None  # pdserve_requests_total's status when not "ok"/"error" (RuntimeMetrics.requests)
        head_sent = False

        async def on_head() -> None:
            nonlocal head_sent
            if send_head is not None and not head_sent:
                await send_head()  # a send cancelled (the lease deadline) wrote nothing: not sent
                head_sent = True

        local_prefill = kv is None  # the router's prefill load ends at the first streamed token
        first_s = last_s = None
        usage: dict = {}
        sent: list[str] = []  # content / completion text sent to the client (replayed by a continuation)
        num_tokens = 0  # chunks with a generated token sent (content, reasoning or tool call: chunk_progress)
        replayable = True  # no reasoning or tool call sent: a continuation can carry all that was sent
        # ids or logprobs of tokens whose text the worker held back went to the client since the last text
        # (`carries_token_output`): a continuation would send them again
        held_token_output = False
        text_before = 0  # characters of text sent before this attempt (its completion text_offset start there)
        # the first attempt's (or the client's name for the request): one answer's across a migration
        stream_id, stream_created = response_id(path, body), None
        # Ask the worker for usage on every chunk (vLLM's continuous usage stats): its completion_tokens count
        # the tokens sent exactly, where chunks do not (vLLM puts several tokens in one chunk when its API
        # server falls behind the engine, or with speculative decoding), so that a continuation asks for what
        # is left of max_tokens and the usage the client gets counts every attempt. Hidden where the client
        # did not ask for it.
        options = body.get("stream_options") or {}
        client_wants_usage = bool(options.get("include_usage"))
        client_wants_running_usage = client_wants_usage and bool(options.get("continuous_usage_stats"))
        base = body if client_wants_running_usage else {**body, "stream_options": {
            **options, "include_usage": True, "continuous_usage_stats": True}}
        want_choices, finished_choices = num_choices(path, body), set()
        # A stream of one choice continues from the token ids of its prompt and output (migration.TokenTrail): a
        # completion's continuation is prompted with them, a chat continuation is checked against them
        # (`_checked_continuation`); the worker is asked for them, and they are hidden where the client did
        # not ask.
        trail = TokenTrail() if ids_continuable(body, want_choices) else None
        hide_ids = trail is not None and not flag(body.get("return_token_ids"))
        if hide_ids:
            base = {**base, "return_token_ids": True}
        prompt_tokens: int | None = None  # the client's prompt, from the first attempt's usage
        tokens_before = 0  # tokens sent by the attempts before this one
        attempt_usage: dict | None = None  # this attempt's latest usage from the worker
        # its usage as of the last chunk whose output the client got: a token that ends inside a character
        # (bytes of a UTF-8 sequence, held back by vLLM's detokenizer) comes in a chunk with empty text though
        # the usage counts it, and a continuation (prompted with the text sent) makes it again
        attempt_sent_usage: dict | None = None
        attempt_chunks = 0  # this attempt's chunks with a generated token
        # every choice's finish reason / the final usage chunk went to the client (a body served whole can
        # hold several choices: n > 1 or several prompts that need the decode worker's own prefill)
        finished = usage_sent = False
        last: dict = {}  # the last chunk sent (its id, object, created, model)
        # the chunks that finish a choice, held back while the client did not ask for usage: vLLM stamps its
        # system_fingerprint on them then, but the worker (asked for usage) puts it on its usage chunk, which
        # follows them; (text sent as is, the chunk)
        held: list[tuple[str, dict]] = []

        def release_held() -> list[str]:
            out = [f"data: {text}\n\n" for text, _ in held]
            held.clear()
            return out

        def continuation() -> tuple[dict | None, str | None]:
            """(the request that goes on from what the client got, None) or (None, why there is none)."""
            if not yielded:  # nothing sent: the request itself, whatever its shape
                return base, None
            if not replayable:
                return None, UNREPLAYABLE_REASON
            if held_token_output:
                return None, HELD_TOKENS_REASON
            ids = trail.ids() if trail is not None else None
            try:
                return continuation_body(path, base, "".join(sent), tokens_before, prompt_tokens=prompt_tokens,
                                         token_ids=ids, chat_default_max_tokens=self.chat_default_max_tokens), None
            except NotContinuable as exc:
                return None, str(exc)

        attempt, attempt_path = base, path  # a chat continuation may go as a completion (`_checked_continuation`)
        yielded = False
        first_token = asyncio.Event()
        nudger = self._start_nudger(route, kv, first_token)
        try:
            while True:
                try:
                    leg = decode.stream_events(attempt_path, attempt, rid, kv, on_head, dp_rank=route.decode_dp_rank)
                    async with contextlib.aclosing(leg) as events:
                        chunks = events.__aiter__()
                        while True:
                            wait_s = None  # a leg on a handoff must show its first token before the deadline
                            if kv is not None and first_s is None and lease_end is not None:
                                wait_s = max(0.0, lease_end - self.kv_lease_margin_s - self.clock())
                            try:
                                if wait_s is None:
                                    data, chunk = await chunks.__anext__()
                                elif wait_s <= 0:  # past the deadline: the stream is not read again
                                    raise asyncio.TimeoutError
                                else:  # bounded in this task (wait_for would start a task per call)
                                    async with asyncio.timeout(wait_s):
                                        data, chunk = await chunks.__anext__()
                            except StopAsyncIteration:
                                break
                            # (an error event has no choices: a chunk with choices is not read again for one)
                            worker_err = None if chunk.get("choices") else _stream_error_event(chunk, route.decode_url)
                            if worker_err is not None:  # the worker gave up mid-stream: client told, error
                                logger.warning("decode worker %s sent an error event mid-stream: %.500s",
                                               redact_userinfo(route.decode_url), chunk)
                                raise worker_err
                            aborted = _worker_aborted(route.decode_url, chunk.get("choices"))
                            if aborted is not None:
                                if not any(chunk_progress(chunk)[:2]):  # vLLM's abort output has no new token
                                    raise aborted
                                # text the worker held back (a stop string's prefix) is flushed with it: sent,
                                # as not finished, before the stream continues elsewhere
                                chunk["choices"] = [{**c, "finish_reason": None} if isinstance(c, dict) else c
                                                    for c in chunk["choices"]]
                            # the worker's own text goes out unless the runtime changes the chunk
                            changed = aborted is not None or "kv_transfer_params" in chunk
                            if attempt_path != path:  # a chat continuation's completion: its chunks as chat's
                                chunk, changed = completion_as_chat_chunk(chunk), True
                            chunk.pop("kv_transfer_params", None)
                            stream_id = stream_id or chunk.get("id")
                            if stream_id and "id" in chunk and chunk["id"] != stream_id:
                                # one id across a migration, or the client's (shapes.response_id): vLLM writes
                                # "id" first, so the worker's bytes need not be encoded again for it
                                worker_id = b'{"id":' + orjson.dumps(chunk["id"])
                                if not changed and isinstance(data, bytes) and data.startswith(worker_id):
                                    data = b'{"id":' + orjson.dumps(stream_id) + data[len(worker_id):]
                                    chunk["id"] = stream_id
                                else:
                                    chunk["id"], changed = stream_id, True
                            stream_created = stream_created or chunk.get("created")
                            if stream_created and "created" in chunk and chunk["created"] != stream_created:
                                chunk["created"], changed = stream_created, True
                            token = (local_prefill or first_s is None) and _is_first_token(chunk)
                            if local_prefill and token:
                                # this decode worker's own prefill is done (also after a migration)
                                local_prefill = False
                                self.pairing.on_first_token(rid, self.clock())
                            if first_s is None and token:
                                if kv is not None and lease_end is not None and self.clock() > lease_end:
                                    self.metrics.kv_late_reads.inc()
                                    logger.warning("request %s: first token after the KV lease ended: the "
                                                   "decode worker may have read released blocks", rid)
                                first_token.set()
                                first_s = self.clock() - t0  # what the client sees, NIXL pull included
                                self._first_token(rid, first_s)
                                self._observe_first_token(first_s)
                                self.metrics.child(self.metrics.ttft, endpoint, mode).observe(first_s)
                            u = chunk.get("usage")
                            if u:
                                attempt_usage = u
                                if (prompt_tokens is not None or tokens_before) and client_wants_usage:
                                    # a continuation's own counts: the client's prompt, every attempt's tokens
                                    chunk["usage"], changed = _stream_usage(u, prompt_tokens, tokens_before), True
                            if "usage" in chunk and not (client_wants_running_usage or (
                                    client_wants_usage and not chunk.get("choices"))):
                                cut = None if changed else _without_trailing_usage(data, chunk)
                                del chunk["usage"]
                                if cut is None:
                                    changed = True
                                else:  # the worker's own text less its usage, not the chunk encoded again
                                    data = cut
                            if not client_wants_usage and not chunk.get("choices"):
                                # the usage-only final chunk the client did not ask for; vLLM stamps its
                                # system_fingerprint on the finish chunk when no usage chunk follows
                                fingerprint = chunk.get("system_fingerprint")
                                if fingerprint is not None:
                                    held[:] = [(orjson.dumps({**c, "system_fingerprint": fingerprint}).decode(), c)
                                               for _, c in held]
                                continue
                            if trail is not None:
                                hidden = trail.take(chunk, hide_ids)
                                if hidden:  # the worker's own text with its ids nulled, not the chunk encoded again
                                    cut = None if changed or not isinstance(data, bytes) else ids_nulled(data, hidden)
                                    if cut is None:
                                        changed = True
                                    else:
                                        data = cut
                            if yielded and attempt is not base:
                                if _role_only(chunk):
                                    continue  # a continuation's opening role delta: the client has had one
                                # its prompt's fields and its own text offsets, as the uninterrupted answer's
                                changed = continuation_chunk(chunk, text_before) or changed
                            text, generated, chunk_ok = chunk_progress(chunk)
                            if text:
                                sent.append(text)
                                held_token_output = False
                            elif carries_token_output(chunk):
                                held_token_output = True
                            if generated:
                                num_tokens += 1
                                attempt_chunks += 1
                                attempt_sent_usage = u or attempt_sent_usage
                                last_s = self.clock() - t0
                            replayable = replayable and chunk_ok
                            choices = chunk.get("choices")
                            if choices:
                                finished_choices.update(c.get("index", 0) for c in choices
                                                        if isinstance(c, dict) and c.get("finish_reason"))
                                finished = len(finished_choices) >= want_choices
                            else:
                                usage_sent = usage_sent or "usage" in chunk
                            last = chunk
                            yielded = True
                            text_out = orjson.dumps(chunk).decode() if changed else data.decode()
                            if not client_wants_usage and choices and any(
                                    isinstance(c, dict) and c.get("finish_reason") for c in choices):
                                held.append((text_out, chunk))  # until the usage chunk's fingerprint
                                continue
                            yield f"data: {text_out}\n\n"
                            if aborted is not None:
                                raise aborted
                    for finished_event in release_held():
                        yield finished_event
                    ok = True
                    self._note_answer(route.decode_url, None)
                    break
                except asyncio.TimeoutError:
                    # The handoff's lease would end before this decode leg made its first token (the decode worker
                    # has not read the KV, or has not admitted the request: its engine can stall in one step for
                    # longer than the lease on a starved CPU). Closing the stream aborts the request on the decode
                    # worker, before it reads; the decode worker then prefills the request itself.
                    self.metrics.kv_lease_expiries.inc()
                    logger.warning("request %s: no first token %.0f s before the KV lease ends: the decode worker "
                                   "prefills it locally", rid, self.kv_lease_margin_s)
                    prompt_tokens, tokens_before = _attempt_ends(attempt_usage, attempt_chunks, prompt_tokens,
                                                                 tokens_before, attempt_sent_usage, trail)
                    attempt_usage, attempt_sent_usage, attempt_chunks = None, None, 0
                    cont, refusal = continuation()
                    cont_path = path
                    if cont is not None and cont is not base:
                        cont_path, cont, refusal = await self._checked_continuation(path, cont, trail,
                                                                                    route.decode_url, rid)
                    if cont is None:
                        message = _refused_message("the inference worker did not answer in time", refusal)
                        err = openai_error_body(message, err_type="BackendError",
                                                status=int(HTTPStatus.GATEWAY_TIMEOUT))
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    try:
                        route = self._prefill_locally(rid)
                    except ModelNotReady as exc:
                        err = openai_error_body(str(exc), err_type="ServiceUnavailableError",
                                                status=int(HTTPStatus.SERVICE_UNAVAILABLE))
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    kv, decode, attempt, mode = None, self._client(route.decode_url, rid), cont, "local"
                    attempt_path = cont_path
                    local_prefill = True
                    text_before = sum(map(len, sent))
                except BackendError as exc:
                    if finished:  # the answer was whole: the worker went away before its [DONE]; end it there
                        self._note_answer(route.decode_url, exc)
                        for finished_event in release_held():
                            yield finished_event
                        if client_wants_usage and not usage_sent and attempt_usage is not None:
                            final = {k: last[k] for k in ("id", "object", "created", "model") if k in last}
                            final.update(choices=[], usage=_stream_usage(attempt_usage, prompt_tokens, tokens_before))
                            yield f"data: {orjson.dumps(final).decode()}\n\n"
                        ok = True
                        break
                    started = attempt_chunks > 0
                    prompt_tokens, tokens_before = _attempt_ends(attempt_usage, attempt_chunks, prompt_tokens,
                                                                 tokens_before, attempt_sent_usage, trail)
                    attempt_usage, attempt_sent_usage, attempt_chunks = None, None, 0
                    # nothing sent yet: the request itself goes to another worker, whatever its shape; else a
                    # continuation of what was sent, where one follows the request's rules (`continuation`)
                    cont, refusal = continuation()
                    if not _moves(exc, started):
                        refusal = None  # the worker answered: no other would have been asked, whatever the shape
                    if cont is not None:
                        new = self._migrate(exc, route, rid, started=started, count=False)
                        if new is None and _moves(exc, started):
                            refusal = NO_WORKER_LEFT_REASON
                    else:
                        self._note_answer(route.decode_url, exc)
                        new = None
                    cont_path = path
                    if new is None:
                        cont = None
                    elif cont is not base:
                        cont_path, cont, refusal = await self._checked_continuation(path, cont, trail,
                                                                                    new.decode_url, rid)
                    if cont is not None:
                        self.metrics.migrations.inc()
                        logger.warning("request %s: continues on decode worker %s after %d tokens sent (%s)", rid,
                                       redact_userinfo(new.decode_url), tokens_before,
                                       _continued_how(path, cont is base, trail, cont_path != path))
                    if cont is None:
                        # the worker rejected the client's own request: counted apart from the service's errors
                        status = "client_error" if _is_client_fault(exc) else None
                        if not yielded and not head_sent:  # nothing sent: the caller answers an HTTP error
                            raise _StreamFailedEarly(exc) from exc
                        for finished_event in release_held():  # choices that did finish, then the error
                            yield finished_event
                        err = _backend_error_response(exc).error
                        body_err = openai_error_body(_refused_message(err.message, refusal), err_type=err.type,
                                                     status=int(err.code), param=err.param or None)
                        yield f"data: {json.dumps(body_err)}\n\n"
                        break
                    route, kv, decode, attempt, mode = new, None, self._client(new.decode_url, rid), cont, "migrated"
                    attempt_path = cont_path
                    local_prefill = True  # the new decode worker prefills; its load ends at its first token
                    text_before = sum(map(len, sent))
        except (asyncio.CancelledError, GeneratorExit):  # the client left (or the stream was closed unread)
            status = "cancelled"
            raise
        finally:
            first_token.set()
            if nudger is not None:
                nudger.cancel()
            self._finish(rid, endpoint, route, t0, ok=ok, mode=mode, status=None if ok else status)
        if ok and first_s is not None:
            tokens = tokens_before + max(_completion_tokens(attempt_usage), attempt_chunks)  # a chunk: 1+ tokens
            if attempt_usage is not None:
                usage = _stream_usage(attempt_usage, prompt_tokens, tokens_before)
            itl_s = (last_s - first_s) / (tokens - 1) if tokens > 1 and last_s is not None else None
            if itl_s is not None:
                self.metrics.child(self.metrics.itl, endpoint, mode).observe(itl_s)
            self._observe(rid, usage, estimated_isl, first_s, self.clock() - t0, tokens, itl_s)
        yield "data: [DONE]\n\n"

    def _finish(self, rid: str, endpoint: str, route: Route, t0: float, *, ok: bool, mode: str | None = None,
                status: str | None = None) -> None:
        """Release the request's router load (``Pairing.on_complete``, once per request) and its worker
        clients, then count it; the releases do not depend on the metrics."""
        self._run_deferred(rid)
        self._awaiting.pop(rid, None)
        try:
            self.pairing.on_complete(rid, self.clock(), ok)
        finally:
            try:
                self._release(rid)
            finally:
                self._count(endpoint, route, t0, ok, mode, status)

    def _count(self, endpoint: str, route: Route, t0: float, ok: bool, mode: str | None,
               status: str | None = None) -> None:
        """Count one finished request in the request and e2e metrics (`status`: one of REQUEST_STATUSES that
        overrides "ok"/"error")."""
        mode = mode or ("remote" if route.prefill_url else "local")
        self.metrics.child(self.metrics.requests, endpoint, mode, status or ("ok" if ok else "error")).inc()
        self.metrics.child(self.metrics.e2e, endpoint, mode).observe(self.clock() - t0)
        self.metrics.child(self.metrics.in_flight, endpoint).dec()


#: Why a stream that could move did not: the pairing gave no other decode worker (`Pairing.on_decode_failed`).
NO_WORKER_LEFT_REASON = "no other worker may take it (its router.migration_limit is used up, or none is up)"


def _moves(exc: BackendError, started: bool) -> bool:
    """A decode failure after which the request may go on on another worker (`PDModel._migrate`): the worker is
    gone or broke the protocol, or refused with a server error before any output (`started` False). Pure."""
    return exc.unreachable or exc.broken or (not started and exc.status_code in _REFUSED_BEFORE_OUTPUT)


def _continued_how(path: str, whole: bool, trail: TokenTrail | None, as_completion: bool = False) -> str:
    """How a migrated stream goes on, for the log: the request sent whole, a continuation from token ids (a chat
    one `as_completion`: `PDModel._checked_continuation`), one checked against them, or one from the text sent,
    unchecked (a worker that returns no ids). Pure."""
    if whole:
        return "the request whole: nothing generated was sent"
    if as_completion:
        return "from the token ids sent, as a completion: the text sent renders otherwise in a chat continuation"
    if trail is None or trail.sent() is None:
        return "from the text sent, unchecked: the worker returned no token ids"
    return "from the token ids sent" if path != CHAT_PATH else "from the text sent, checked against the token ids"


def _refused_message(message: str, refusal: str | None) -> str:
    """The client's error `message`, with why the stream did not continue on another worker when `refusal`
    says (`runtime.server.migration.continuation_body`). Pure."""
    return message if refusal is None else f"{message}; the stream cannot continue on another worker: {refusal}"


def _without_trailing_usage(data: bytes, chunk: dict) -> bytes | None:
    """`data`, a worker's compact JSON of `chunk`, less its `usage` member when that is the last one (vLLM
    writes the usage field after the choices), else None. Cutting the bytes spares re-encoding every chunk of
    every stream whose client did not ask for running usage. Pure."""
    if next(reversed(chunk)) != "usage" or not data.endswith(b"}"):
        return None
    i = data.rfind(b',"usage":')
    return data[:i] + b"}" if i > 0 else None


def _role_only(chunk: dict) -> bool:
    """A chat chunk that only opens the assistant's message (`delta` of a role and empty content, no finish
    reason, no logprobs), as a continuation's first chunk does. Pure."""
    choices = chunk.get("choices")
    if not choices or len(choices) != 1:
        return False
    c = choices[0]
    delta = c.get("delta")
    return (isinstance(delta, dict) and "role" in delta and not delta.get("content")
            and set(delta) <= {"role", "content"} and not c.get("finish_reason") and not c.get("logprobs"))


def _count(usage: dict | None, key: str) -> int:
    """A worker usage's token count under `key` (0 when absent or not a number). Pure."""
    try:
        return int((usage or {}).get(key) or 0)
    except (TypeError, ValueError):
        return 0


def _completion_tokens(usage: dict | None) -> int:
    """A worker usage's completion tokens (0 when absent or not a number). Pure."""
    return _count(usage, "completion_tokens")


def _attempt_ends(usage: dict | None, chunks: int, prompt_tokens: int | None, tokens_before: int,
                  sent_usage: dict | None, trail: TokenTrail | None = None) -> tuple[int | None, int]:
    """(the client's prompt tokens, the tokens sent so far) once a decode attempt ends that sent `chunks` chunks
    with a token, last reported `usage`, and reported `sent_usage` with the last chunk whose output reached the
    client (the first attempt's prompt is the client's). Tokens counted after that chunk (a character's first
    bytes, held back by the worker's detokenizer) are not in the text sent, so a continuation makes them again
    and they are not counted here (from the stream's token ids, `trail`, when they are all known, as
    `TokenTrail.sent` counts them). Pure."""
    if prompt_tokens is None and usage is not None:
        try:
            prompt_tokens = int(usage.get("prompt_tokens") or 0) or None
        except (TypeError, ValueError):
            prompt_tokens = None
    sent = trail.sent() if trail is not None else None
    return prompt_tokens, sent if sent is not None else tokens_before + max(_completion_tokens(sent_usage), chunks)


def _stream_usage(usage: dict, prompt_tokens: int | None, tokens_before: int) -> dict:
    """An attempt's usage as the client's request's: the prompt tokens are the first attempt's when known (a
    continuation's prompt also holds the text generated before it; its prompt details, cached tokens among
    them, are the continuation's and are left out) and the completion tokens add the `tokens_before` earlier
    attempts sent. The usage itself when no attempt sent tokens before this one. Pure."""
    if not tokens_before:  # nothing was generated before this attempt: its prompt is the client's
        return usage
    p = _count(usage, "prompt_tokens") if prompt_tokens is None else prompt_tokens
    c = _completion_tokens(usage) + tokens_before
    out = {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
    out.update(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
    return out


async def _merge_streams(streams: list[AsyncGenerator[str, None]], include_usage: bool, n: int = 1,
                         continuous_usage: bool = False) -> AsyncGenerator[str, None]:
    """One SSE stream from the sub-streams of a fan-out (runtime.server.shapes, `n` choices per prompt):
    chunks of stream i carry choice index i and the first stream's id, in arrival order; each sub-stream's
    last usage (its final usage chunk) goes into one final usage chunk (`sum_usage`: each prompt counted
    once) when the client asked for it; with `continuous_usage` a chunk keeps its own usage (its prompt's
    tokens and its choice's tokens so far, as vLLM's continuous usage stats are), else chunks carry none;
    an error event of any sub-stream ends the whole stream (then `[DONE]`; the others are closed), and a
    sub-stream that raises breaks it off unended (the exception propagates, as from a single stream). Closing
    this closes every sub-stream."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncGenerator[str, None]) -> None:
        try:
            async for event in stream:
                await queue.put((i, event))
        except Exception as exc:  # noqa: BLE001 - handed to the merging loop, which raises it there
            await queue.put((i, exc))  # a sub-stream that broke off must not read as one that finished
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    usages: list[dict | None] = [None] * len(streams)  # each sub-stream's latest usage
    stream_id = created = fingerprint = None
    last: dict = {}
    # without usage for the client, vLLM stamps system_fingerprint on each choice's finish chunk; a sub-stream
    # (asked for usage) puts it on its usage chunk after that: its finish chunk waits for it here
    held: dict[int, dict] = {}

    def release_held() -> list[str]:
        out = [f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in held.values()]
        held.clear()
        return out

    open_streams = len(streams)
    try:
        while open_streams:
            i, event = await queue.get()
            if event is done:
                open_streams -= 1
                if i in held:
                    yield f"data: {json.dumps(held.pop(i), separators=(',', ':'))}\n\n"
                continue
            if isinstance(event, Exception):  # as a single stream does: the client's stream breaks off unended
                for finished_event in release_held():  # the choices that did finish first
                    yield finished_event
                raise event
            data = event[len("data:"):].strip() if event.startswith("data:") else ""
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("error") and not chunk.get("choices"):
                for finished_event in release_held():  # the choices that did finish first
                    yield finished_event
                yield event  # then [DONE], as a single stream ends after its error event
                yield "data: [DONE]\n\n"
                return
            fingerprint = chunk.get("system_fingerprint") or fingerprint
            chunk_usage = chunk.get("usage") if continuous_usage and chunk.get("choices") else None
            usages[i] = chunk.pop("usage", None) or usages[i]
            if chunk_usage:
                chunk["usage"] = chunk_usage
            choices = chunk.get("choices")
            if not choices:  # a sub-stream's usage-only chunk: summed into the final one
                if i in held:
                    out = held.pop(i)
                    own = chunk.get("system_fingerprint")  # this sub-stream's worker's
                    if own is not None:
                        out["system_fingerprint"] = own
                    yield f"data: {json.dumps(out, separators=(',', ':'))}\n\n"
                continue
            if len(choices) != 1:  # one prompt, one choice: anything else is not this sub-request's answer
                for finished_event in release_held():  # the choices that did finish first
                    yield finished_event
                raise BackendError("decode", 502, f"sub-stream {i} sent {len(choices)} choices in one chunk")
            stream_id = stream_id or chunk.get("id")
            created = created or chunk.get("created")
            last = chunk
            out = remap_chunk(chunk, i, stream_id, created)
            if not include_usage and choices[0].get("finish_reason"):
                held[i] = out
                continue
            yield f"data: {json.dumps(out, separators=(',', ':'))}\n\n"
        usage = sum_usage(usages, n)
        if include_usage and usage is not None:
            final = {k: last[k] for k in ("object", "model") if k in last}
            final.update({"id": stream_id, "created": created, "choices": [], "usage": usage})
            if fingerprint is not None:
                final["system_fingerprint"] = fingerprint
            yield f"data: {json.dumps(final, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


_GIVEN = object()  # _Prepended's first item once it has been given


class _Prepended(AsyncGenerator):
    """``first``, then the rest of ``rest``; closing this closes ``rest`` (its finally releases the load).

    Each item of ``rest`` is handed over by ``rest``'s own awaitable: a stream's chunks do not pass through
    one more generator frame each on their way to the client."""

    __slots__ = ("_first", "_rest")

    def __init__(self, first: str, rest: AsyncGenerator[str, None]) -> None:
        self._first, self._rest = first, rest

    def __anext__(self):  # what `async for` calls on every item: one call, not two, once `first` is given
        if self._first is _GIVEN:
            return self._rest.__anext__()
        return self.asend(None)

    def asend(self, value: Any):
        if self._first is _GIVEN:
            return self._rest.asend(value)
        first, self._first = self._first, _GIVEN
        return _value(first)

    async def athrow(self, typ, val=None, tb=None):  # as a generator stopped at its yield: close, then raise
        self._first = _GIVEN
        await self._rest.aclose()
        if val is None:
            raise typ if isinstance(typ, BaseException) else typ()
        raise val.with_traceback(tb) if tb is not None else val

    def aclose(self):
        self._first = _GIVEN
        return self._rest.aclose()


async def _value(item: str) -> str:
    return item
