"""OpenAI-style error bodies for the runtime's /openai routes.

Body shape (OpenAI API reference, "Error codes"; vLLM's ErrorResponse):
`{"error": {"message": str, "type": str, "param": str | null, "code": int}}`, `code` the HTTP status as a
number (vLLM's `ErrorInfo.code`; KServe's own error type writes it as a string). KServe answers a request that
fails pydantic validation with FastAPI's 422 `{"detail": [...]}` and an unknown model with its own 404
`{"error": "..."}`; on paths under the OpenAI prefix these handlers answer in OpenAI's shape instead (400 for
a malformed request, 404 for an unknown model, with vLLM's message). vLLM's request models (which KServe's
OpenAI types are) also reject some requests with `VLLMValidationError` / `VLLMClientError`
(vllm/exceptions.py: an empty or null prompt, `stream_options` without `stream`, `top_logprobs` without
`logprobs`), which are not pydantic errors and would reach KServe's generic 500 handler: they get a 400 too,
as vLLM's own server answers.
Other paths keep KServe's behaviour.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from kserve.errors import (
    ModelNotFound,
    ModelNotReady,
    generic_exception_handler,
    model_not_found_handler,
    model_not_ready_handler,
)
from kserve.protocol.rest.openai.types import Error as _KServeError
from kserve.protocol.rest.openai.types import ErrorResponse as _KServeErrorResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

try:  # vLLM's client-error base class (vllm/exceptions.py); absent from older vLLM
    from vllm.exceptions import VLLMClientError
except ImportError:  # pragma: no cover - depends on the installed vLLM
    VLLMClientError = None

OPENAI_PREFIX = "/openai/"


def openai_error_body(message: str, *, err_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    """`{"error": {"message": str, "type": str, "param": str | None, "code": int}}`, `code` the HTTP status
    `status` (e.g. 400) as vLLM's `ErrorInfo` writes it."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": int(status)}}


class OpenAIError(_KServeError):
    """KServe's OpenAI error object with `code` the HTTP status as an int, as vLLM's `ErrorInfo` has it."""

    code: int


class OpenAIErrorResponse(_KServeErrorResponse):
    """An `ErrorResponse` KServe's OpenAI routes answer as an error (they test `isinstance` with KServe's class
    and answer `model_dump()` with status `int(error.code)`), whose body is vLLM's: `code` an int."""

    error: OpenAIError


def create_error_response(message: str, err_type: str = "BadRequestError", param: str | None = None,
                          status_code: HTTPStatus = HTTPStatus.BAD_REQUEST) -> OpenAIErrorResponse:
    """KServe's `create_error_response` (kserve.protocol.rest.openai.errors), as vLLM's server writes the
    object: `code` the int HTTP status `status_code`, `param` None unless given."""
    return OpenAIErrorResponse(error=OpenAIError(message=message, type=err_type, param=param,
                                                 code=int(status_code)))


#: KServe's message for a model it does not serve (kserve.errors.ModelNotFound), around the model's name.
_KSERVE_NOT_FOUND = ("Model with name ", " does not exist.")


def unknown_model_message(model_name: str | None) -> str:
    """vLLM's message for a request naming a model it does not serve (OpenAIServingModels' model check)."""
    return f"The model `{model_name}` does not exist."


def _not_found_model_name(exc: ModelNotFound) -> str:
    """The model name of KServe's `ModelNotFound` (its message is the only place it keeps it)."""
    text = str(exc)
    head, tail = _KSERVE_NOT_FOUND
    return text[len(head):-len(tail)] if text.startswith(head) and text.endswith(tail) else text


def _loc_to_param(loc: tuple | list) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or None


def validation_error_body(exc: RequestValidationError) -> dict[str, Any]:
    """400 body naming the first failing field (`param`) and listing every problem in `message`."""
    errors = list(exc.errors())
    params = [None if e.get("type") == "json_invalid" else _loc_to_param(e.get("loc", ())) for e in errors]
    msgs = [f"{p or 'body'}: {e.get('msg', 'invalid')}" for p, e in zip(params, errors)]
    return openai_error_body(
        "Invalid request: " + ("; ".join(msgs) if msgs else "malformed body"),
        err_type="BadRequestError",
        status=HTTPStatus.BAD_REQUEST,
        param=next((p for p in params if p), None),
    )


async def _validation_handler(request: Request, exc: RequestValidationError):
    if request.url.path.startswith(OPENAI_PREFIX):
        return JSONResponse(status_code=HTTPStatus.BAD_REQUEST, content=validation_error_body(exc))
    return await request_validation_exception_handler(request, exc)


async def _model_not_found_handler(request: Request, exc: ModelNotFound):
    if request.url.path.startswith(OPENAI_PREFIX):
        body = openai_error_body(unknown_model_message(_not_found_model_name(exc)), err_type="NotFoundError",
                                 status=HTTPStatus.NOT_FOUND, param="model")
        return JSONResponse(status_code=HTTPStatus.NOT_FOUND, content=body)
    return await model_not_found_handler(request, exc)


def vllm_client_error_body(exc: Exception) -> dict[str, Any]:
    """400 body of a vLLM request-model rejection; `param` is the exception's `parameter` when it names one. The
    message is the exception's text as vLLM's own server writes it (`VLLMValidationError` appends
    "(parameter=..., value=...)")."""
    param = getattr(exc, "parameter", None)
    message = str(exc)
    return openai_error_body(message or "invalid request", err_type="BadRequestError", status=HTTPStatus.BAD_REQUEST,
                             param=param if isinstance(param, str) else None)


async def _vllm_client_error_handler(request: Request, exc: Exception):
    if request.url.path.startswith(OPENAI_PREFIX):
        return JSONResponse(status_code=HTTPStatus.BAD_REQUEST, content=vllm_client_error_body(exc))
    return await generic_exception_handler(request, exc)


#: Seconds a client is told to wait (`Retry-After`) while the model is not ready: about two of the runtime's
#: worker health checks (every 2 s), after which a worker that started answering is routed to.
RETRY_AFTER_S = 5


def _not_ready_message(exc: ModelNotReady) -> str:
    """KServe's "Model with name M is not ready." and the runtime's reason as a sentence, or, without one,
    that no worker answers; then when to retry."""
    base = f"Model with name {exc.model_name} is not ready."
    text = str(exc)
    detail = text[len(base):].strip().rstrip(".") if text.startswith(base) else ""
    if not detail:
        # not "yet": the workers may have answered before and gone (every decode worker died)
        return f"{base} No inference worker is answering; retry in {RETRY_AFTER_S} s."
    return f"{base} {detail[:1].upper()}{detail[1:]}. Retry in {RETRY_AFTER_S} s."


async def _model_not_ready_handler(request: Request, exc: ModelNotReady):
    """503 with `Retry-After`; OpenAI-shaped under the OpenAI prefix."""
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    if request.url.path.startswith(OPENAI_PREFIX):
        body = openai_error_body(_not_ready_message(exc), err_type="ServiceUnavailableError",
                                 status=HTTPStatus.SERVICE_UNAVAILABLE)
        return JSONResponse(status_code=HTTPStatus.SERVICE_UNAVAILABLE, content=body, headers=headers)
    response = await model_not_ready_handler(request, exc)
    response.headers.update(headers)
    return response


class Overloaded(Exception):
    """A request shed by admission control (runtime.server.model `PDModel._admit`): answered 429 with
    `Retry-After: retry_after_s` and an OpenAI error body carrying `message`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


async def _overloaded_handler(request: Request, exc: Overloaded):
    body = openai_error_body(exc.message, err_type="OverloadedError", status=HTTPStatus.TOO_MANY_REQUESTS)
    return JSONResponse(status_code=HTTPStatus.TOO_MANY_REQUESTS, content=body,
                        headers={"Retry-After": str(exc.retry_after_s)})


async def _http_exception_handler(request: Request, exc: StarletteHTTPException):
    """Routing errors (404 no such route, 405 wrong method) under the OpenAI prefix in OpenAI's shape."""
    if request.url.path.startswith(OPENAI_PREFIX):
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "InvalidRequestError")
        message = (f"{request.method} {request.url.path}: " +
                   ("no such route" if exc.status_code == 404 else str(exc.detail)))
        return JSONResponse(status_code=exc.status_code, headers=getattr(exc, "headers", None),
                            content=openai_error_body(message, err_type=kind, status=exc.status_code))
    from fastapi.exception_handlers import http_exception_handler

    return await http_exception_handler(request, exc)


async def _internal_error_handler(request: Request, exc: Exception):
    """An exception no other handler answers (a runtime bug): under the OpenAI prefix a JSON 500 in OpenAI's
    shape, as vLLM's server answers one (its `Exception` handler), with a fixed message (the exception's text
    may name internals, such as a worker's address); elsewhere Starlette's plain 500. Starlette's outermost
    middleware calls it, then raises the exception on to be logged."""
    if request.url.path.startswith(OPENAI_PREFIX):
        body = openai_error_body("internal error", err_type="InternalServerError",
                                 status=HTTPStatus.INTERNAL_SERVER_ERROR)
        return JSONResponse(status_code=HTTPStatus.INTERNAL_SERVER_ERROR, content=body)
    return PlainTextResponse("Internal Server Error", status_code=HTTPStatus.INTERNAL_SERVER_ERROR)


def install_openai_error_handlers(app: FastAPI) -> None:
    """Register the handlers on `app` (after KServe registered its own, so these win)."""
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(ModelNotReady, _model_not_ready_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(ModelNotFound, _model_not_found_handler)
    app.add_exception_handler(Overloaded, _overloaded_handler)
    app.add_exception_handler(Exception, _internal_error_handler)
    if VLLMClientError is not None:
        app.add_exception_handler(VLLMClientError, _vllm_client_error_handler)
