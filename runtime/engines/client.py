"""Async HTTP client for one vLLM OpenAI server, speaking vLLM's P/D `kv_transfer_params` protocol.

Protocol (vLLM NixlConnector, examples/online_serving/disaggregated_serving/;
docs/architecture.md#pd-disaggregation-with-nixl):
1. prefill: the original request with `max_tokens=1`, `stream=false` and `kv_transfer_params` =
   `PREFILL_KV_TRANSFER_PARAMS` (do_remote_decode=true); its response carries `kv_transfer_params` that name
   the prefill engine, its blocks and its NIXL side channel.
2. decode: the original request plus those `kv_transfer_params`, unchanged; the decode worker pulls the KV
   blocks with NIXL and continues generation. Both calls carry the same `X-Request-Id`.
Without `kv_transfer_params` a request is served locally (aggregated; also the failover path).
A call with `dp_rank` carries vLLM's `X-data-parallel-rank` header (`DP_RANK_HEADER`): a worker with data
parallelism runs it on that engine (rank) instead of choosing one with its own load balancer.

The client never decides where to send a request: its `base_url` is fixed at construction from configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson

from runtime.engines.h1 import H1Error, H1Pool
from runtime.redact import redact_userinfo

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: how long a streamed answer's body may take to end after its `data: [DONE]` before its connection is dropped
#: rather than reused (`_finish_body`); the server ends it in the write after `[DONE]`
DONE_BODY_END_S = 0.1
CHAT_PATH = "/v1/chat/completions"
#: seconds a health check (`VllmClient.healthy`) waits for the worker's answer
HEALTH_TIMEOUT_S = 2.0
#: the request header that pins a request to one data-parallel engine of a vLLM server (vLLM 0.28
#: `OpenAIServing._get_data_parallel_rank`)
DP_RANK_HEADER = "X-data-parallel-rank"
COMPLETIONS_PATH = "/v1/completions"


class BackendError(RuntimeError):
    """A worker answered with a non-2xx status, answered something that is not the protocol, or could not
    be reached.

    Attributes:
        status_code: HTTP status of the worker's answer; 502 when there was no usable answer, 504 when it
            timed out.
        body: the worker's response body (parsed JSON when possible, else text), or what went wrong.
        url: the URL called, its userinfo (credentials) redacted.
        unreachable: True only when the worker process looks gone (connection refused or reset, the
            connection dropped mid-answer, a stream that ended before its `data: [DONE]`, a call abandoned
            after its worker was judged down and sent nothing for a while): the router then takes it out of
            the pool and a decode request may migrate. A worker that answered (any status, or a malformed
            body) or was only slow (timeout) is not unreachable.
        broken: the worker's stream broke the protocol mid-answer (an event that is not a JSON chunk): what
            came before it is sound, so a decode request may continue on another worker, but the worker is
            not known gone (its breaker counts a failure, as for a 5xx, never opens at once).
    """

    def __init__(self, url: str, status_code: int, body: Any, *, unreachable: bool = False,
                 broken: bool = False) -> None:
        url = redact_userinfo(url)  # logged and shown: never the credentials of a worker URL
        self.url, self.status_code, self.body, self.unreachable = url, status_code, body, unreachable
        self.broken = broken
        super().__init__(f"{url} answered {status_code}: {str(body)[:500]}")


# httpx errors that mean the worker process is gone (refused, reset, closed mid-answer), as opposed to
# slow (timeouts: the worker may be busy) or a local misuse
_GONE = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.CloseError)


def _transport_error(url: str, exc: httpx.HTTPError) -> BackendError:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return BackendError(url, 504, f"{type(exc).__name__}: the worker did not answer in time")
    gone = isinstance(exc, _GONE) or isinstance(exc, httpx.ConnectTimeout)
    return BackendError(url, 502, f"{type(exc).__name__}: {exc}", unreachable=gone)


def _wire_error(url: str, exc: BaseException) -> BackendError:
    """The BackendError of a failure of the runtime's own HTTP path (runtime.engines.h1), with the same meaning
    as `_transport_error`'s: a refused or timed-out connect, a reset or a connection closed before the answer
    ended is an unreachable worker; a read timeout a 504; an answer that is not HTTP a 502 of a worker that is
    still there."""
    if isinstance(exc, H1Error):
        return BackendError(url, 502, str(exc), unreachable=exc.gone)
    return BackendError(url, 504, f"{type(exc).__name__}: the worker did not answer in time")


def _json_loads(data: bytes | str) -> Any:
    """JSON text → value: orjson (strict RFC 8259, several times faster than the stdlib on small objects),
    the stdlib for what orjson refuses but Python's json writes (NaN, Infinity, as a Python worker may).

    Raises:
        ValueError: not JSON for either.
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def _json_dumps(obj: Any) -> bytes:
    """Compact JSON bytes of a request body (orjson; the stdlib for integers beyond 64 bits, which orjson
    refuses and a client's JSON may hold).

    Raises:
        TypeError, ValueError: `obj` is not JSON-serialisable.
    """
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":")).encode()


def steady_stream(body: dict) -> bool:
    """A streamed `body` whose answer vLLM writes a chunk of at every engine step (what a stall verdict,
    runtime.engines.h1.H1Pool.stall_verdict, judges by): not one with a `stream_interval` above 1 (vLLM 0.28
    writes a chunk every that many tokens) nor one with `tools` (a tool-call parser holds its deltas back
    until it has parsed a call)."""
    interval = body.get("stream_interval")
    return (interval is None or interval == 1) and not body.get("tools")


def prefill_body(body: dict) -> dict:
    """The prefill request for `body`: same fields, one token, no streaming, remote-decode KV params. A
    shallow copy: only top-level fields change, and `body` is left as it is."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens; the decode worker enforces it
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def decode_body(body: dict, kv_transfer_params: dict | None) -> dict:
    """The decode request: the original `body` plus the prefill answer's `kv_transfer_params` (if any). A
    shallow copy, as `prefill_body`'s."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def _chunk_shape_ok(chunk: dict) -> bool:
    """The fields the runtime reads have the OpenAI chunk types: ``choices`` a list of objects whose
    ``delta`` (if any) is an object, ``usage`` an object or null. An ``error`` event passes (vLLM sends
    one when generation fails mid-stream)."""
    choices = chunk.get("choices", [])
    if not isinstance(choices, list):
        return False
    for c in choices:  # one pass, no generator: this runs on every streamed chunk
        if not isinstance(c, dict) or not isinstance(c.get("delta", {}), (dict, type(None))):
            return False
    return isinstance(chunk.get("usage"), (dict, type(None)))


class _ReadDeadline:
    """The read timeout of one answer: `timeout_s` seconds of waiting for the worker's next bytes, with one
    timer per answer rather than one made and cancelled around every read (once per streamed token: several per
    cent of the runtime's CPU, bench/frontend.py). The timer fires at most once per `timeout_s`; a wait that has
    lasted `timeout_s` by then cancels the waiting task, and that cancellation comes out of `run` as
    asyncio.TimeoutError, as `asyncio.timeout` does (any other cancellation goes on). Time the caller spends
    between two reads does not count.

    It cancels the task waiting now: an answer whose first piece one task reads and whose rest another does
    (a response streamed by a task of its own) is timed in each."""

    __slots__ = ("_loop", "_task", "_timeout_s", "_since", "_handle", "_fired")

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None  # the task of the current wait
        self._timeout_s = timeout_s
        self._since: float | None = None  # loop time the current wait began; None when not waiting
        self._handle: asyncio.TimerHandle | None = None
        self._fired = False

    async def run(self, awaitable: Any) -> Any:
        """`await awaitable` (a wait for the worker) within the read timeout. Raises asyncio.TimeoutError."""
        self._task = task = asyncio.current_task()
        self._since = now = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(now + self._timeout_s, self._check)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._fired and task.uncancel() == 0:
                raise asyncio.TimeoutError from None
            raise
        finally:
            self._since = self._task = None

    def _check(self) -> None:
        self._handle = None
        since = self._since
        if since is None or self._fired or self._task is None:  # not waiting: the next wait arms it again
            return
        due = since + self._timeout_s
        if self._loop.time() >= due:
            self._fired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_at(due, self._check)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _TimedPieces:
    """A response's body pieces (runtime.engines.h1.Response) as an async iterator, each awaited within the
    answer's `_ReadDeadline`."""

    __slots__ = ("_resp", "_deadline")

    def __init__(self, resp: Any, deadline: _ReadDeadline) -> None:
        self._resp, self._deadline = resp, deadline

    def __aiter__(self) -> "_TimedPieces":
        return self

    async def __anext__(self) -> bytes:
        piece = await self._deadline.run(self._resp.read_piece())
        if piece is None:
            raise StopAsyncIteration
        return piece


def _headers(request_id: str, dp_rank: int | None) -> dict[str, str]:
    """The headers of a call to a worker: its `X-Request-Id` and, with `dp_rank`, `DP_RANK_HEADER`."""
    if dp_rank is None:
        return {"X-Request-Id": request_id}
    return {"X-Request-Id": request_id, DP_RANK_HEADER: str(dp_rank)}


class VllmClient:
    """Calls one worker. Share one instance per worker; close it with `aclose` (or `async with`).

    Args:
        base_url: "http://host:port" of the worker (from configuration, never from a request).
        timeout_s: read timeout per call (the longest wait for the next bytes of an answer), seconds; the
            connect timeout is 5 s.
        transport: optional httpx transport (tests pass `httpx.MockTransport` or an ASGI app transport);
            without one the client speaks HTTP/1.1 itself (runtime.engines.h1).

    Why its own HTTP/1.1: every request crosses the runtime twice (prefill answer, decode stream), and the
    client's per-call and per-chunk cost is most of the runtime's own CPU per request. Keep-alive connections on
    asyncio protocols with httptools' parser cost less than aiohttp's client, which cost several times less than
    httpx's (bench/frontend.py, docs/benchmarks.md "Front door"). httpx stays for injected transports.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http: httpx.AsyncClient | None = None
        self._pool: H1Pool | None = None
        if transport is not None:
            # No cap on connections: the worker's own scheduler queues what it cannot run, so a pool cap would
            # only hide a second queue here (httpx's default, 100, holds the 101st stream until one ends).
            self._http = httpx.AsyncClient(
                base_url=self.base_url,
                timeout=httpx.Timeout(timeout_s, connect=5.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                transport=transport,
            )
        else:
            self._pool = H1Pool(self.base_url, connect_timeout_s=5.0)

    def abandon_silent(self, silent_s: float) -> int:
        """Fail this worker's calls in flight that have received nothing for `silent_s` seconds (their readers
        get the BackendError of a worker gone: `unreachable`); calls still receiving are left alone. For a
        worker the runtime has judged down (runtime.server.breakers). Returns the number failed; 0 with an
        injected httpx transport, whose calls this client cannot see."""
        return 0 if self._pool is None else self._pool.abandon_silent(silent_s)

    def stall_verdict(self, window_s: float, *, waiting: bool = False) -> bool | None:
        """Whether this worker's streams in flight show it stalled (runtime.engines.h1.H1Pool.stall_verdict):
        True (every stream past its first chunk silent for `window_s` seconds), False (one is producing), None
        (nothing to judge by; always with an injected httpx transport, whose calls this client cannot see)."""
        return None if self._pool is None else self._pool.stall_verdict(window_s, waiting=waiting)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        if self._pool is not None:
            self._pool.close()

    async def __aenter__(self) -> "VllmClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _post(self, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """POST `data` (JSON) to `path`: (status, body). Raises BackendError on transport errors."""
        async with self._post_stream(path, data, headers) as (status, pieces):
            return status, b"".join([p async for p in pieces])

    async def _get(self, path: str, timeout_s: float | None = None) -> tuple[int, bytes]:
        """GET `path`: (status, body); `timeout_s` bounds the whole call. Raises BackendError."""
        url = self.base_url + path
        if self._http is not None:
            try:
                resp = await self._http.get(path, **({} if timeout_s is None else {"timeout": timeout_s}))
            except httpx.HTTPError as exc:
                raise _transport_error(url, exc) from exc
            return resp.status_code, resp.content
        try:
            async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
                resp = await self._pool.request("GET", path, {})
                try:
                    return resp.status, await resp.read()
                finally:
                    resp.release()
        except (H1Error, asyncio.TimeoutError) as exc:
            raise _wire_error(url, exc) from exc

    @contextlib.asynccontextmanager
    async def _post_stream(self, path: str, data: bytes, headers: dict[str, str], steady: bool = True):
        """POST `data` to `path` and yield (status, pieces): `pieces` an async iterator of the body's bytes as
        they arrive. Raises BackendError on transport errors (also while the body is read)."""
        url = self.base_url + path
        headers = {**headers, "Content-Type": "application/json"}
        if self._http is not None:
            try:
                async with self._http.stream("POST", path, content=data, headers=headers) as resp:
                    yield resp.status_code, resp.aiter_bytes()
            except httpx.HTTPError as exc:
                raise _transport_error(url, exc) from exc
            return
        deadline = _ReadDeadline(self.timeout_s)
        try:
            resp = await deadline.run(self._pool.request("POST", path, headers, data,  # the head is a read too
                                                         steady=steady))
            try:
                yield resp.status, _TimedPieces(resp, deadline)
            finally:
                resp.release()
        except (H1Error, asyncio.TimeoutError) as exc:
            raise _wire_error(url, exc) from exc
        finally:
            deadline.close()

    async def post_json(self, path: str, body: dict, request_id: str, dp_rank: int | None = None) -> dict:
        """POST `body` to `path`, return the JSON answer. Raises BackendError on non-2xx or transport errors.
        `dp_rank`: the data-parallel rank to run it on (`DP_RANK_HEADER`); None: the worker chooses."""
        url = self.base_url + path
        status, raw = await self._post(path, _json_dumps(body), _headers(request_id, dp_rank))
        if status >= 300:
            raise BackendError(url, status, _error_body(raw))
        try:
            answer = _json_loads(raw)
        except ValueError:
            raise BackendError(url, 502, f"answered {status} with a body that is not JSON") from None
        if not isinstance(answer, dict):
            raise BackendError(url, 502, f"answered {status} with JSON that is not an object")
        return answer

    async def tokenize(self, body: dict, request_id: str) -> list[int]:
        """The token ids vLLM's `POST /tokenize` gives for `body` (a chat body: `messages` rendered with the
        worker's chat template and the body's rendering options). Raises BackendError on a failure or an answer
        without a list of integer `tokens`."""
        answer = await self.post_json("/tokenize", body, request_id)
        tokens = answer.get("tokens")
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            raise BackendError(self.base_url + "/tokenize", 502, "answered without a list of token ids")
        return tokens

    async def detokenize(self, tokens: list[int], request_id: str) -> str:
        """The text vLLM's `POST /detokenize` gives `tokens` (bytes of a character cut off at either end read as
        U+FFFD). Raises BackendError on a failure or an answer without a string `prompt`."""
        answer = await self.post_json("/detokenize", {"tokens": tokens}, request_id)
        text = answer.get("prompt")
        if not isinstance(text, str):
            raise BackendError(self.base_url + "/detokenize", 502, "answered without the text of the tokens")
        return text

    async def max_model_len(self, model: str) -> int | None:
        """The context length (tokens) vLLM's `GET /v1/models` gives the served model named `model` (its
        `max_model_len`), or None where the worker names no such model or gives no length. Raises BackendError on
        a failure."""
        status, raw = await self._get("/v1/models")
        if status >= 300:
            raise BackendError(self.base_url + "/v1/models", status, _error_body(raw))
        try:
            cards = _json_loads(raw).get("data")
        except (ValueError, AttributeError):
            raise BackendError(self.base_url + "/v1/models", 502, "answered with a body that is not a model list") \
                from None
        for card in cards if isinstance(cards, list) else ():
            if isinstance(card, dict) and card.get("id") == model:
                n = card.get("max_model_len")
                return n if type(n) is int and n > 0 else None
        return None

    async def prefill(self, path: str, body: dict, request_id: str, dp_rank: int | None = None) -> dict | None:
        """Run the prefill step of `body` (on data-parallel rank `dp_rank` when given); returns the
        `kv_transfer_params` for the decode worker (or None).

        Raises:
            BackendError: the worker failed or is unreachable.
        """
        answer = await self.post_json(path, prefill_body(body), request_id, dp_rank)
        return answer.get("kv_transfer_params")

    async def complete(self, path: str, body: dict, request_id: str, kv_transfer_params: dict | None = None,
                       dp_rank: int | None = None) -> dict:
        """Non-streaming (decode) call (on data-parallel rank `dp_rank` when given): returns the OpenAI
        response object as a dict. Raises BackendError."""
        b = decode_body(body, kv_transfer_params)
        b["stream"] = False
        b.pop("stream_options", None)
        return await self.post_json(path, b, request_id, dp_rank)

    async def stream(
        self, path: str, body: dict, request_id: str, kv_transfer_params: dict | None = None,
        dp_rank: int | None = None,
    ) -> AsyncIterator[dict]:
        """Streaming (decode) call: yields each SSE chunk's JSON object, stops at `data: [DONE]`.

        Raises:
            BackendError: as `stream_events`.
        """
        async with contextlib.aclosing(self.stream_events(path, body, request_id, kv_transfer_params,
                                                          dp_rank=dp_rank)) as events:
            async for _, chunk in events:
                yield chunk

    async def stream_events(
        self, path: str, body: dict, request_id: str, kv_transfer_params: dict | None = None,
        on_head: Callable[[], Awaitable[None]] | None = None, dp_rank: int | None = None,
    ) -> AsyncIterator[tuple[bytes, dict]]:
        """Streaming (decode) call: yields (data, chunk) per SSE event — `data` the event's JSON text as the
        worker sent it (a caller that changes nothing forwards it without encoding it again), `chunk` its
        object — and stops at `data: [DONE]`. Lines other than `data:` ones (comments, `event:`) are skipped.
        `on_head` (optional) is awaited once the worker's 2xx head is in, before its first event is read.
        `dp_rank`: the data-parallel rank to run it on (`DP_RANK_HEADER`); None: the worker chooses.

        Raises:
            BackendError: non-2xx status (raised before the first chunk); a broken connection, or a stream
                that ends without `data: [DONE]` (a truncated answer must not look complete), both
                `unreachable`; an event that is not an OpenAI chunk (`broken`).

        Why a clean end without `[DONE]` is a worker gone: vLLM ends every stream it ends itself with
        `[DONE]` (an error event, a shutdown's aborted choices and a client's disconnect included), so a body
        that ends without it was cut where its server stopped; a proxy between the runtime and the worker
        can turn that reset into a cleanly framed end.
        """
        b = decode_body(body, kv_transfer_params)
        b["stream"] = True
        url = self.base_url + path
        async with self._post_stream(path, _json_dumps(b), _headers(request_id, dp_rank),
                                     steady=steady_stream(b)) as (status, pieces):
            if status >= 300:
                raw = b"".join([p async for p in pieces])
                raise BackendError(url, status, _error_body(raw))
            if on_head is not None:
                await on_head()
            buf = b""
            async for piece in pieces:
                buf += piece
                if b"\n" not in piece:
                    continue
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        await _finish_body(pieces)
                        return
                    yield data, _stream_chunk(url, data)
            for line in buf.split(b"\n"):  # a last line without its newline
                data = line[5:].strip() if line.startswith(b"data:") else None
                if data == b"[DONE]":
                    return
                if data is not None:
                    yield data, _stream_chunk(url, data)
        raise BackendError(url, 502, "stream ended without data: [DONE]", unreachable=True)

    async def metrics_text(self) -> str:
        """GET /metrics (Prometheus text). Raises BackendError."""
        status, raw = await self._get("/metrics")
        text = raw.decode("utf-8", "replace")
        if status != 200:
            raise BackendError(self.base_url + "/metrics", status, text)
        return text

    async def healthy(self) -> bool:
        """True when GET /health answers 200 within `HEALTH_TIMEOUT_S` seconds."""
        try:
            return (await self._get("/health", HEALTH_TIMEOUT_S))[0] == 200
        except BackendError:
            return False


async def _finish_body(pieces: AsyncIterator[bytes]) -> None:
    """Read a streamed answer's body to its end after `data: [DONE]`, for at most `DONE_BODY_END_S`.

    Why: vLLM's server (Starlette's StreamingResponse) writes the end of the body (the last chunk of the chunked
    encoding) after `[DONE]`, in a write of its own; a response released before its body ended cannot be
    reused, so its connection is closed, and the next decode leg to that worker opens a new one (a TCP
    handshake on its time to first token, the worker's accept, a socket in TIME_WAIT per request). The end
    follows `[DONE]` at once; a server that does not end the body in time loses its connection as before.
    Bytes after `[DONE]` are not read as events."""
    try:
        async with asyncio.timeout(DONE_BODY_END_S):
            async for _ in pieces:
                pass
    except (TimeoutError, H1Error, httpx.HTTPError):
        pass


def _error_body(raw: bytes) -> Any:
    """A worker's error answer: its JSON when it is JSON, else its text."""
    try:
        return _json_loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _stream_chunk(url: str, data: bytes) -> dict:
    """The chunk object of one SSE event's `data`. Raises BackendError when it is not an OpenAI chunk."""
    try:
        chunk = _json_loads(data)
    except ValueError:
        raise BackendError(url, 502, "stream event is not JSON", broken=True) from None
    if not isinstance(chunk, dict) or not _chunk_shape_ok(chunk):
        raise BackendError(url, 502, "stream event is not an OpenAI completion chunk", broken=True)
    return chunk
