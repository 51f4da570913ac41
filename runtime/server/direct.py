"""The runtime's two generation routes served straight from its ASGI edge (runtime.server.edge).

`POST {OPENAI_PREFIX}v1/completions` and `.../v1/chat/completions` through KServe cost, per request: FastAPI's
body parsing and request-model validation, KServe's second validation of the same model
(`CreateCompletionRequestAdapter.validate_python`), a task per request that watches for a client disconnect
(`with_cancellation`), and Starlette's `StreamingResponse` with a task group per stream. `serve_direct` does
the same work once: it validates the body with the same KServe request model (a plain body, whose fields the
model would keep as they are, is taken as it is: `plain_request`), calls the same
`PDModel.create_completion` / `create_chat_completion`, and writes the answer with ASGI messages itself, with
one task per request that cancels the work when the client goes away.

It answers as the KServe route does (same status, headers, body bytes), and it only takes requests whose
answer cannot differ: a body that is not a JSON object (or not sent as `application/json`), fails validation,
or names another model, and any request while the model is not ready, go on to KServe (`serve_direct`
returns False), whose error answers stay the one home of those cases. Exceptions the model raises
(`Overloaded`, `ModelNotReady`, ...) are answered by the app's own exception handlers (runtime.server.errors),
looked up as Starlette does. One difference is timing: a stream's 200 head goes out when the decode worker's
own 2xx head arrives (`send_head` in the model's context, `PDModel._stream`), not with the first token, so
that the client has read it by then. A stream that fails after that and before its first token (the worker
died and no other could take the request, sent an error event, or passed its read deadline) ends with an
error event and `[DONE]`, as a failure after the first token does, where KServe's route (which cannot send
the head before its handler returns) answers an HTTP error; so do the model's exceptions raised after it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
from kserve.protocol.rest.openai.types import ChatCompletionRequest, CompletionRequest, ErrorResponse
from starlette.requests import Request
from starlette.responses import Response

from runtime.server.errors import openai_error_body

log = logging.getLogger(__name__)

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
_SSE_DONE = b"data: [DONE]\n\n"


class _RawBody:
    """What `PDModel._request_body` reads of FastAPI's `Request`: the body as JSON (all fields), here the object
    `serve_direct` has parsed already (a shallow copy: the model changes top-level fields only), and the
    headers (names in lower case, as ASGI gives them)."""

    __slots__ = ("_body", "headers")

    def __init__(self, body: dict, headers: dict[str, str]) -> None:
        self._body = body
        self.headers = headers

    async def json(self) -> Any:
        return dict(self._body)


def _handler_for(app: Any, exc: BaseException) -> Callable | None:
    """The app's exception handler for `exc` (first match along its class's MRO, as Starlette looks it up);
    None for one only `Exception` matches: such an error is raised on, so that Starlette's outermost
    middleware answers 500 and logs it as it does on KServe's route."""
    handlers = getattr(app, "exception_handlers", None) or {}
    for cls in type(exc).__mro__:
        if cls in (Exception, BaseException):
            return None
        if cls in handlers:
            return handlers[cls]
    return None


#: Fields a plain request may hold (`plain_request`), each with the check its value must pass; every value that
#: passes is one vLLM 0.28's request model (vllm/entrypoints/openai/{chat_completion,completion}/protocol.py)
#: accepts as it is, or turns into the same value (an int for a float field: `_FLOAT_FIELDS`).
_INT64 = (-(2 ** 63), 2 ** 63 - 1)
_FLOAT_FIELDS = frozenset({"temperature", "top_p"})
_PLAIN_ROLES = frozenset({"system", "developer", "user", "assistant"})


def _is_int(v: Any) -> bool:
    return type(v) is int and _INT64[0] <= v <= _INT64[1]


def _is_number(v: Any) -> bool:
    return type(v) is float or _is_int(v)  # the edge has refused NaN and infinities (runtime.strict_json)


def _is_stream_options(v: Any) -> bool:
    return type(v) is dict and all(k in ("include_usage", "continuous_usage_stats") and (x is None or type(x) is bool)
                                   for k, x in v.items())


def _is_messages(v: Any) -> bool:
    return type(v) is list and bool(v) and all(
        type(m) is dict and m.get("role") in _PLAIN_ROLES and type(m.get("content")) is str
        and all(k == "role" or k == "content" or (k == "name" and type(x) is str) for k, x in m.items())
        for m in v)


_COMMON_FIELDS = {"model": lambda v: type(v) is str, "stream": lambda v: v is None or type(v) is bool,
                  "stream_options": _is_stream_options, "max_tokens": _is_int,
                  "temperature": lambda v: v is None or _is_number(v), "top_p": lambda v: v is None or _is_number(v),
                  "user": lambda v: v is None or type(v) is str}
_PLAIN_FIELDS = {True: {**_COMMON_FIELDS, "messages": _is_messages, "max_completion_tokens": _is_int},
                 False: {**_COMMON_FIELDS, "prompt": lambda v: type(v) is str and v != ""}}
_REQUIRED = {True: "messages", False: "prompt"}


class _PlainRequest:
    """A plain request's fields as the request model would hold them, for what `PDModel._request_body` reads of
    a validated request (runtime.server.model): `stream`, the values (`__dict__`) and the model's
    `model_fields` (of the class, as pydantic keeps them)."""

    model_fields: dict = {}

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)
        self.__dict__.setdefault("stream", False)


class _PlainChat(_PlainRequest):
    model_fields = ChatCompletionRequest.model_fields


class _PlainCompletion(_PlainRequest):
    model_fields = CompletionRequest.model_fields


def plain_request(chat: bool, body: dict) -> _PlainRequest | None:
    """`body` (a chat completions body when `chat`, else a completions one, as JSON read it) as its validated
    request, without the request model, when it is *plain*: only the fields of `_PLAIN_FIELDS`, each of the
    JSON type vLLM's request model takes as it is (chat: non-empty `messages` of system/developer/user/assistant
    messages with string `content` and at most a string `name`; completions: a non-empty string `prompt`;
    integer token budgets; `stream_options` only with `stream` true, as vLLM's validator demands); else None
    (the request model validates it). Such a body passes every validator of the model and keeps its values
    (tests/unit/test_server_direct_plain.py checks both against the installed vLLM): validating it costs the
    model's tens of checks and defaults for each of about 90 fields, a large share of a request's time in the
    runtime, and nothing it could find wrong.

    Returns an object with the validated request's `stream`, field values and `model_fields`.
    """
    checks = _PLAIN_FIELDS[chat]
    for key, value in body.items():
        check = checks.get(key)
        if check is None or not check(value):
            return None
    if _REQUIRED[chat] not in body or (body.get("stream_options") and body.get("stream") is not True):
        return None
    values = {k: float(v) if k in _FLOAT_FIELDS and type(v) is int else v for k, v in body.items()}
    return (_PlainChat if chat else _PlainCompletion)(values)


async def serve_direct(model: Any, app: Any, scope: dict, raw: bytes, receive: Callable, send: Callable,
                       parsed: Any = None) -> bool:
    """Serve one generation request (`scope["path"]` ends with ``/completions``) whose body `raw` the edge has
    read whole and checked; False (nothing sent) when it must go on to KServe (see the module docstring).

    `model`: the served PDModel (`name`, `ready`, `create_completion`, `create_chat_completion`). `app`: the
    FastAPI app whose `exception_handlers` answer the model's exceptions. `parsed`: `raw` as orjson read it
    (runtime.server.edge.read_body), or None to read it here.
    """
    headers: dict[str, str] = {}
    for k, v in scope.get("headers", ()):  # a repeated header: its first value, as Starlette's Headers.get
        headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
    content_type = headers.get("content-type", "application/json").split(";", 1)[0].strip().lower()
    if content_type != "application/json":  # FastAPI reads other types differently: its answer decides
        return False
    try:
        body = orjson.loads(raw) if parsed is None else parsed
    except orjson.JSONDecodeError:
        return False
    if not isinstance(body, dict) or body.get("model") != model.name or not model.ready:
        return False
    chat = scope["path"].endswith("/chat/completions")
    request = plain_request(chat, body)
    if request is None:
        try:
            request = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
        except Exception:  # noqa: BLE001 - pydantic's ValidationError, or vLLM's own errors from its validators
            return False

    task = asyncio.current_task()
    gone = False

    async def watch() -> None:  # the client went away: stop the work (and the worker's) at once
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    sub = None  # as FastAPI's sub-response: the route headers the model sets on non-streaming answers
    if not request.stream:  # a stream's answer never carries them (KServe's route returns a StreamingResponse)
        sub = Response()
        del sub.headers["content-length"]
        sub.status_code = None
    head_sent = False

    async def send_head() -> None:  # a stream's 200 head, once (the model sends it when its decode worker's came)
        nonlocal head_sent
        if not head_sent:
            # sent only once the call returns: a send cancelled while it waits for the client to read (a
            # deadline in the model) wrote nothing, and the head is still to send
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            head_sent = True

    context = {"headers": headers, "response": sub, "send_head": send_head}
    create = model.create_chat_completion if chat else model.create_completion
    try:
        try:
            result = await create(request, raw_request=_RawBody(body, headers), context=context)
        except Exception as exc:  # noqa: BLE001 - answered as the app answers it
            handler = _handler_for(app, exc)
            if handler is None:
                if head_sent:  # the stream is open: end it with a 500 event, then raise on to be logged
                    await _send_error_event(send, orjson.dumps(openai_error_body(
                        "internal error", err_type="InternalServerError", status=500)))
                raise
            watcher.cancel()
            response = await handler(Request(scope), exc)
            if head_sent:  # the stream is open: its error is an event in it, as a worker's later error is
                await _send_error_event(send, response.body)
                return True
            await response(scope, receive, send)
            return True
        if head_sent and not isinstance(result, AsyncGenerator):
            watcher.cancel()
            body_err = result.model_dump() if isinstance(result, ErrorResponse) else result
            await _send_error_event(send, orjson.dumps(body_err, option=orjson.OPT_NON_STR_KEYS))
            return True
        if isinstance(result, AsyncGenerator):
            await send_head()
            last = b""  # the stream's terminating event, sent with the end of the body (one write, not two)
            try:
                async for chunk in result:
                    data = chunk if isinstance(chunk, bytes) else chunk.encode("utf-8")
                    if last:
                        await send({"type": "http.response.body", "more_body": True, "body": last})
                        last = b""
                    if data == _SSE_DONE:  # the generator ends right after it: no token waits behind it
                        last = data
                        continue
                    await send({"type": "http.response.body", "more_body": True, "body": data})
            finally:
                await result.aclose()
            watcher.cancel()
            await send({"type": "http.response.body", "body": last, "more_body": False})
            return True
        watcher.cancel()
        await _send_json(send, result, sub)
        return True
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()  # the cancellation was ours (the client left): nothing more to answer
        return True
    finally:
        watcher.cancel()


async def _send_error_event(send: Callable, error_json: bytes) -> None:
    """End an open stream with an error event (the OpenAI error object `error_json`) and `[DONE]`, as the
    model ends a stream whose worker failed after it began (runtime.server.model `PDModel._stream`)."""
    await send({"type": "http.response.body", "more_body": False,
                "body": b"data: " + error_json + b"\n\n" + _SSE_DONE})


async def _send_json(send: Callable, result: Any, sub: Any) -> None:
    """A non-streaming answer as KServe's route sends it: an ErrorResponse with its own status code; an
    OpenAI object with FastAPI's encoding (`model_dump(mode="json", by_alias=True)`), the route headers the
    model set on `sub` (None: none) and its status (200 unless set)."""
    if isinstance(result, ErrorResponse):
        status, content, extra = int(result.error.code), result.model_dump(), []
    else:
        status = (sub.status_code if sub is not None else None) or 200
        content = result.model_dump(mode="json", by_alias=True) if hasattr(result, "model_dump") else result
        extra = sub.raw_headers if sub is not None else []
    data = orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(data)).encode()), (b"content-type", b"application/json"),
                            *extra]})
    await send({"type": "http.response.body", "body": data})
