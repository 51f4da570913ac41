"""Checks at the runtime's edge, before KServe's request models or any worker see a request (ASGI middleware).

KServe parses bodies with Python's `json`, which accepts `NaN`/`Infinity` and lone UTF-16 surrogates
(`"\\ud800"`); pydantic coerces `"stream": "false"` to False and accepts any string as a chat role. Such
requests then fail deep inside (a 500 with a non-OpenAI body) or are served as something the client did not
ask for. `EdgeMiddleware` answers them with an OpenAI 400 (`{"error": {"message", "type", "param",
"code"}}`, runtime.server.errors) naming the field:
* a JSON constant that is not a number in JSON (`NaN`, `Infinity`, `-Infinity`), or a number literal beyond
  the range of a double (`1e400`: Python's json reads it as infinity; runtime.strict_json);
* a string holding a lone surrogate (not encodable as UTF-8);
* a completions or chat completions body whose `model` is neither a string nor null (a body without one, or
  with null or "", is served by the served model, as vLLM serves it: `_name_served_model`);
* `stream` that is not a boolean or null;
* a chat message that is not an object, or whose `role` is not one of OpenAI's roles (`CHAT_ROLES`);
* a completions or chat completions body sent without `Content-Type: application/json` (another media type,
  or no header at all): vLLM's own 400 body (`validate_json_request`, answered by its validation handler),
  `UNSUPPORTED_MEDIA_TYPE`. A body without the header that is not JSON at all gets the request models' 400
  instead, as FastAPI reads it (as JSON) before vLLM checks the header.
It also answers, itself:
* `GET /openai/v1/models`: a list of one OpenAI model object, the served model's (KServe's own list gives its
  model card, whose `owned_by`, `root` and `max_model_len` are empty or null); `GET /openai/v1/models/{id}`: the
  same object, or an OpenAI 404;
* KServe's v1/v2 inference routes (`:predict`, `:explain`, `/infer`): a 404 saying the model serves the
  OpenAI API only (the OpenAI model has no tensor inference; KServe would answer 500);
* `POST /openai/v1/embeddings` and `/openai/v1/rerank`: an OpenAI 400 saying the model does not support that
  API (KServe's answer says so too, with `code` a string);
* `GET /v2/health/ready` while the model is not ready: 503 with `Retry-After` (KServe's server readiness is
  always true);
* a request body larger than `max_body_bytes` (`--max-body-bytes`, DEFAULT_MAX_BODY_BYTES): 413, read no
  further (a chunked one: up to `_DRAIN_BYTES` more are read and dropped, so that the client reads the
  answer), on the connection's last answer (uvicorn reads whatever a client sends into memory, and the
  checks above walk a body on the event loop, so one unbounded body would stall every stream the process
  serves). A declared `Content-Length` over it is refused before a byte is read, on any route.
Bodies are read whole only on POSTs under /openai/ (the OpenAI routes take JSON bodies). With a `direct`
server installed, a checked body posted to `/openai/v1/completions` or `/openai/v1/chat/completions` is
offered to it first (runtime.server.direct: the same answer without FastAPI's and KServe's per-request
layers); what it declines goes on to KServe.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import orjson

from runtime import strict_json
from runtime.server.errors import OPENAI_PREFIX, RETRY_AFTER_S, openai_error_body, unknown_model_message

#: Chat roles of the OpenAI chat completions API (and vLLM's), the only ones a message may carry.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

_INFER_ROUTE = re.compile(r"^/v[12]/models/[^/]+(/versions/[^/]+)?(:predict|:explain|/infer|/explain)$")
# KServe's v2 model metadata (tensor inputs and outputs): a generative model has none, and KServe's own answer
# for one is a 500 that breaks the client's connection
_V2_METADATA_ROUTE = re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?$")
# a served name may hold '/' (Hugging Face ids: org/model); ASGI's path is already percent-decoded
_MODELS_ROUTE = f"{OPENAI_PREFIX}v1/models"
#: OpenAI routes KServe registers for encoder models, which a generative model does not serve: path -> API name
_UNSERVED_OPENAI_ROUTES = {f"{OPENAI_PREFIX}v1/embeddings": "Embeddings", f"{OPENAI_PREFIX}v1/rerank": "Rerank"}
_MODEL_ROUTE = re.compile(r"^/openai/v1/models/(?P<id>.+)$")
_GENERATION_ROUTES = frozenset({f"{OPENAI_PREFIX}v1/completions", f"{OPENAI_PREFIX}v1/chat/completions"})
#: vLLM 0.28's answer to a generation request without `Content-Type: application/json`: its
#: `validate_json_request` raises FastAPI's RequestValidationError with one error, the string below, and its
#: validation handler writes "1 validation error:" and the error indented, with the status's phrase as `type`
#: (vllm/entrypoints/serve/exception_handling/handlers/validation.py)
UNSUPPORTED_MEDIA_TYPE = openai_error_body(
    "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
    err_type=HTTPStatus.BAD_REQUEST.phrase, status=HTTPStatus.BAD_REQUEST)

#: `direct(scope, raw_body, receive, send, parsed) -> bool`: serves a generation request itself (True) or
#: declines it, having sent nothing (False); `parsed` is the body as orjson read it, or None (read it again)
DirectServer = Callable[[dict, bytes, Callable, Callable, Any], Awaitable[bool]]


#: deepest nesting of objects and arrays a request body may have: far beyond any OpenAI request (the JSON
#: schemas of tools and response formats nest tens of levels), and well within what the runtime's JSON
#: writers and checks handle (Python's json recurses once per level, to about 1,000)
MAX_BODY_DEPTH = 128

#: largest request body the edge takes by default, bytes (64 MiB): a 128k-token context is under 1 MB as text
#: or token ids; several base64 images or a `prompt_embeds` tensor of a few thousand positions (2 bytes per
#: hidden dimension) are what take tens of MB
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
_TOO_DEEP = (f"the body nests objects and arrays more than {MAX_BODY_DEPTH} levels deep; send at most "
             f"{MAX_BODY_DEPTH}", None)


def _too_deep(raw: bytes, body: Any) -> bool:
    """`body`, read from `raw`, nests objects and arrays more than MAX_BODY_DEPTH levels deep. The brackets in
    `raw` bound the depth from above (one opens each level), so a body with fewer is never walked."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_BODY_DEPTH or not isinstance(body, (dict, list)):
        return False
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))
    return False


class _Invalid(ValueError):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _check_strings(value: Any, where: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _Invalid("the string holds a lone UTF-16 surrogate, which is not a character: send valid "
                           "Unicode", where or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, where)
            _check_strings(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{where}[{i}]")


def check_body(path: str, raw: bytes) -> tuple[str, str | None] | None:
    """(message, param) of the 400 for an OpenAI request body `raw` posted to `path`, or None when the edge
    has nothing against it (a body that is not JSON at all is left to the request models' own 400)."""
    return read_body(path, raw)[1]


def read_body(path: str, raw: bytes) -> tuple[Any, tuple[str, str | None] | None]:
    """(parsed, problem): `problem` as `check_body` gives it; `parsed` the body as orjson read it when orjson
    read it and its fields pass (what the direct server would read: it need not parse it again), else None."""
    try:
        # orjson takes only strict JSON in UTF-8 (no NaN/Infinity, no lone surrogates, finite numbers): a
        # body it takes and whose fields pass needs none of the checks below. Any other body is read as
        # Python's json reads it (orjson reads integers beyond 64 bits as floats), so that the message
        # quotes what the client sent.
        parsed = orjson.loads(raw)
        if _too_deep(raw, parsed):
            return None, _TOO_DEEP
        if _check_fields(path, parsed) is None:
            return parsed, None
    except orjson.JSONDecodeError:
        pass
    return None, _check_slowly(path, raw)


def _check_slowly(path: str, raw: bytes) -> tuple[str, str | None] | None:
    """check_body for a body orjson did not take, or whose fields did not pass, read by Python's json."""
    try:
        body = strict_json.loads(raw)
    except strict_json.JsonNumberError as exc:  # named where it stands, as the other checks name their field
        where = _cut_path(exc.path)
        return (f"{where}: {exc}" if where else str(exc)), where or None
    except RecursionError:  # nested beyond Python's recursion limit (orjson refuses beyond 1,024 levels)
        return _TOO_DEEP
    except (ValueError, UnicodeDecodeError):
        return None
    if _too_deep(raw, body):
        return _TOO_DEEP
    try:
        _check_strings(body, "")
    except _Invalid as exc:
        where = _cut_path(exc.param)
        return f"{where or 'body'}: {exc}", where
    return _check_fields(path, body)


#: longest field path an error names in full: keys are the client's own strings, of any length
_MAX_PARAM_CHARS = 100


def _cut_path(where: str | None) -> str | None:
    """A field path for an error's message and `param`, cut to _MAX_PARAM_CHARS characters (ending "...")."""
    if where is None or len(where) <= _MAX_PARAM_CHARS:
        return where
    return where[:_MAX_PARAM_CHARS - 3] + "..."


def _check_fields(path: str, body: Any) -> tuple[str, str | None] | None:
    """check_body's checks of a parsed body's fields: `model` on the generation routes, `stream` and the chat
    messages' roles."""
    if not isinstance(body, dict):
        return None
    model = body.get("model")
    if path in _GENERATION_ROUTES and model is not None and not isinstance(model, str):
        return ("model must be a string: the served model's name (GET /openai/v1/models lists it), got "
                f"{json.dumps(model)[:50]}"), "model"
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return f"stream must be true or false, got {json.dumps(stream)[:50]}", "stream"
    if path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
        for i, m in enumerate(body["messages"]):
            if not isinstance(m, dict):
                return f"messages[{i}] must be an object", f"messages[{i}]"
            role = m.get("role")
            if not isinstance(role, str) or role not in CHAT_ROLES:
                return (f"messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}, "
                        f"got {json.dumps(role)[:50]}", f"messages[{i}].role")
    return None


class Served:
    """The model the edge answers for: its OpenAI id, a readiness callable and what to tell the model about
    an OpenAI request that arrives while it is not ready (`on_unready(raw_body, path)`; KServe answers it 503),
    the server of the generation routes, if any (`direct`, a `DirectServer`), and the largest request body
    taken (`max_body_bytes`)."""

    def __init__(self, model_name: str = "", is_ready: Callable[[], bool] = lambda: False,
                 on_unready: Callable[[bytes, str], None] = lambda raw, path: None,
                 direct: DirectServer | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.model_name, self.is_ready, self.on_unready, self.direct = model_name, is_ready, on_unready, direct
        self.max_body_bytes = max_body_bytes


def install_edge(app: Any, model_name: str, is_ready: Callable[[], bool],
                 on_unready: Callable[[bytes, str], None] = lambda raw, path: None,
                 direct: DirectServer | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Put `EdgeMiddleware` in front of `app` (once per app) answering for `model_name` / `is_ready`, serving
    the generation routes with `direct` when given and refusing bodies over `max_body_bytes` (bytes, >= 1;
    ValueError otherwise)."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    served = getattr(app.state, "pdserve_served", None)
    if served is None:
        served = app.state.pdserve_served = Served()
        app.add_middleware(EdgeMiddleware, served=served)
    served.model_name, served.is_ready, served.on_unready = model_name, is_ready, on_unready
    served.direct, served.max_body_bytes = direct, max_body_bytes


class EdgeMiddleware:
    """ASGI middleware of the runtime app (see the module docstring).

    Args:
        app: the wrapped ASGI app.
        served: what it serves now (`served.model_name`, `served.is_ready()`); KServe's FastAPI app is one per
            process, so the middleware is added once and `served` is updated by each server built.
    """

    def __init__(self, app: Any, *, served: "Served") -> None:
        self.app, self.served = app, served
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.served.model_name

    def is_ready(self) -> bool:
        return self.served.is_ready()

    def model_object(self) -> dict:
        """The served model as an OpenAI model object (`id`, `object`, `created`, `owned_by`), the same in the
        list and by id."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdserve"}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        limit = self.served.max_body_bytes
        if _declared_length(scope) > limit:
            return await _too_large(send, path, limit)
        if _INFER_ROUTE.match(path) or (method == "GET" and _V2_METADATA_ROUTE.match(path)):
            msg = (f"model {self.model_name!r} serves the OpenAI API only: POST {OPENAI_PREFIX}v1/completions "
                   f"or {OPENAI_PREFIX}v1/chat/completions")
            return await _json(send, HTTPStatus.NOT_FOUND, {"error": msg})
        api = _UNSERVED_OPENAI_ROUTES.get(path) if method == "POST" else None
        if api is not None:  # KServe's own answer writes `code` as a string ("400") and `param` as ""
            msg = (f"Model {self.model_name} does not support the {api} API: it serves POST "
                   f"{OPENAI_PREFIX}v1/completions and {OPENAI_PREFIX}v1/chat/completions")
            return await _json(send, HTTPStatus.BAD_REQUEST,
                               openai_error_body(msg, err_type="BadRequestError", status=HTTPStatus.BAD_REQUEST))
        if method == "GET" and path == "/v2/health/ready" and not self.is_ready():
            return await _json(send, HTTPStatus.SERVICE_UNAVAILABLE, {"ready": False},
                               [(b"retry-after", str(RETRY_AFTER_S).encode())])
        if method == "GET" and path == _MODELS_ROUTE:
            return await _json(send, HTTPStatus.OK, {"object": "list", "data": [self.model_object()]})
        found = _MODEL_ROUTE.match(path) if method == "GET" else None
        if found:
            if found["id"] != self.model_name:
                body = openai_error_body(unknown_model_message(found["id"]), err_type="NotFoundError",
                                         status=HTTPStatus.NOT_FOUND, param="model")
                return await _json(send, HTTPStatus.NOT_FOUND, body)
            return await _json(send, HTTPStatus.OK, self.model_object())
        if method != "POST" or not path.startswith(OPENAI_PREFIX):
            return await self.app(scope, receive, send)
        chunks, more, size = [], True, 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            piece = message.get("body", b"")
            size += len(piece)
            if size > limit:  # a chunked body (no Content-Length) grew past it: keep none of it
                if more:
                    await _discard_body(receive, _DRAIN_BYTES)
                return await _too_large(send, path, limit)
            chunks.append(piece)
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        media = _media_type(scope)
        if media != "application/json" and path in _GENERATION_ROUTES and (media is not None
                                                                          or _json_or_empty(raw)):
            # FastAPI would read another media type as no object at all and answer a validation error that
            # names no cause, and a body without the header as JSON; vLLM refuses both with this body
            return await _json(send, HTTPStatus.BAD_REQUEST, UNSUPPORTED_MEDIA_TYPE)
        parsed, bad = read_body(path, raw)
        if bad is not None:
            message_text, param = bad
            body = openai_error_body("Invalid request: " + message_text, err_type="BadRequestError",
                                     status=HTTPStatus.BAD_REQUEST, param=param)
            return await _json(send, HTTPStatus.BAD_REQUEST, body)
        if path in _GENERATION_ROUTES:
            raw, parsed = _name_served_model(raw, parsed, self.model_name)
        if not self.is_ready():
            self.served.on_unready(raw, path)
        elif self.served.direct is not None and path in _GENERATION_ROUTES:
            if await self.served.direct(scope, raw, receive, send, parsed):
                return None
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


#: most bytes of a refused chunked body read and dropped before the 413 goes out: a client that is still
#: sending when the server closes gets a TCP reset, which may discard the answer before the client reads it
#: (nginx drains the same way, "lingering close"); a body longer still is cut off
_DRAIN_BYTES = 1024 * 1024


async def _discard_body(receive: Callable, budget: int) -> None:
    """Read and drop the rest of a request body, up to `budget` bytes."""
    more = True
    while more and budget > 0:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        budget -= len(message.get("body", b""))
        more = message.get("more_body", False)


def _name_served_model(raw: bytes, parsed: Any, model_name: str) -> tuple[bytes, Any]:
    """(raw, parsed) of a generation body, with `model` set to `model_name` where the client left it out,
    null or empty: vLLM serves such a request with its served model (OpenAIServingModels.check_model), where
    KServe would answer 404 naming a model "None". `parsed` as `read_body` gives it (None: not read by
    orjson; the body is read as Python's json reads it); a body that is not a JSON object is left alone."""
    body = parsed
    if body is None:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return raw, parsed
    if not isinstance(body, dict) or body.get("model") not in (None, ""):
        return raw, parsed
    body = {**body, "model": model_name}
    if parsed is None:  # Python's json writes back what it read (integers beyond 64 bits included)
        return json.dumps(body).encode(), None
    return orjson.dumps(body), body


def _media_type(scope: dict) -> str | None:
    """The request's `Content-Type` before its parameters, in lower case, as vLLM's `validate_json_request`
    reads it (not stripped: `application/json ;charset=utf-8` is not `application/json` to vLLM); None
    without the header."""
    for name, value in scope.get("headers") or ():
        if name == b"content-type":
            return value.decode("latin-1").lower().split(";", 1)[0]
    return None


def _json_or_empty(raw: bytes) -> bool:
    """`raw` is empty or JSON as FastAPI reads a body sent without `Content-Type` (Python's json, which takes
    `NaN`): FastAPI answers any other such body as invalid JSON before vLLM's media-type check runs."""
    if not raw:
        return True
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return True


def _declared_length(scope: dict) -> int:
    """The request's `Content-Length`, 0 without one or when it is not a number (uvicorn's parser refuses
    those before the app sees them)."""
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


async def _too_large(send: Callable, path: str, limit: int) -> None:
    """413 for a body over `limit` bytes; `connection: close`, as the rest of the body is never read."""
    message = (f"Request body too large: this server takes at most {limit} bytes (--max-body-bytes); "
               "send a smaller request")
    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    content: Any = (openai_error_body(message, err_type="BadRequestError", status=status)
                    if path.startswith(OPENAI_PREFIX) else {"error": message})
    await _json(send, status, content, [(b"connection", b"close")])


async def _json(send: Callable, status: int, content: Any, headers: list | None = None) -> None:
    data = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": int(status),
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})
