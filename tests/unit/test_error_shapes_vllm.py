"""Error answers of the runtime compared with vLLM 0.28's own OpenAI server (its code, installed with the runtime).

Specification:
* every error body the runtime builds (`openai_error_body`, the `ErrorResponse` objects the model returns, the
  events that end a stream) has `code` the int HTTP status, as vLLM's `ErrorInfo.code`;
* a generation POST without `Content-Type: application/json` (another media type or no header at all) is
  answered with the body vLLM's `validate_json_request` gets from its validation handler, byte for byte
  equal as JSON; one without the header whose body is not JSON goes on to the request models' 400;
* a request naming a model the runtime does not serve gets vLLM's 404 (`check_model`): message, type, param;
* `best_of`, a field vLLM 0.28's request models do not have and ignore, is served, not refused;
* a request shed by admission control (429) is counted in `pdserve_requests_total{mode="none", status="shed"}`.
"""

from __future__ import annotations

import asyncio
import json
import types

import httpx
import pytest

pytest.importorskip("kserve")
pytest.importorskip("vllm")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from kserve.errors import ModelNotFound  # noqa: E402
from kserve.protocol.rest.openai.types import ChatCompletion, Completion, ErrorResponse  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from vllm.entrypoints.openai.engine.protocol import ErrorResponse as VllmErrorResponse  # noqa: E402

from runtime.config import OverloadSpec  # noqa: E402
from runtime.engines.client import VllmClient  # noqa: E402
from runtime.server.edge import install_edge  # noqa: E402
from runtime.server.errors import (  # noqa: E402
    Overloaded,
    create_error_response,
    install_openai_error_handlers,
    openai_error_body,
)
from runtime.server.metrics import REQUEST_STATUSES, UNSERVED_MODE, RuntimeMetrics  # noqa: E402
from runtime.server.model import PDModel  # noqa: E402
from runtime.server.pairing import RoundRobinPairing  # noqa: E402
from tests.unit.test_server_model_request_shapes import Workers, _chat, _complete, _model  # noqa: E402

COMP, CHAT = "/openai/v1/completions", "/openai/v1/chat/completions"


def _vllm_validation_body(errors: list) -> dict:
    """What vLLM's own server answers for a RequestValidationError carrying `errors`."""
    from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler

    args = types.SimpleNamespace(log_error_stack=False)
    req = types.SimpleNamespace(app=types.SimpleNamespace(state=types.SimpleNamespace(args=args)),
                                state=types.SimpleNamespace())
    response = asyncio.run(validation_exception_handler(req, RequestValidationError(errors=errors)))
    assert response.status_code == 400
    return json.loads(response.body)


def _vllm_unknown_model_body(name: str) -> dict:
    """vLLM's answer to a request naming model `name` where it serves "m" (OpenAIModelRegistry.check_model)."""
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry

    registry = OpenAIModelRegistry(types.SimpleNamespace(), [BaseModelPath(name="m", model_path="m")])
    err = asyncio.run(registry.check_model(name))
    assert err is not None
    return err.model_dump()


def _vllm_takes(headers: dict) -> bool:
    """Whether vLLM's own media-type check (`validate_json_request`) passes a request with `headers`."""
    from vllm.entrypoints.serve.utils.api_utils import validate_json_request

    try:
        asyncio.run(validate_json_request(types.SimpleNamespace(headers=httpx.Headers(headers))))
    except RequestValidationError:
        return False
    return True


def _edge_app(seen: list[bytes]) -> FastAPI:
    app = FastAPI()
    install_openai_error_handlers(app)

    async def generate(request: Request):
        seen.append(await request.body())
        return {"ok": True}

    app.post(COMP)(generate)
    app.post(CHAT)(generate)
    install_edge(app, "m", is_ready=lambda: True)
    return app


def test_error_bodies_carry_the_int_status_as_vllms_error_info_does():
    body = openai_error_body("boom", err_type="BackendError", status=502)
    assert body["error"]["code"] == 502 and type(body["error"]["code"]) is int
    # vLLM's model reads the body back unchanged (a string code would be coerced, so the dumps would differ)
    assert VllmErrorResponse.model_validate(body).model_dump() == body
    err = create_error_response("too long", err_type="BadRequestError")
    assert isinstance(err, ErrorResponse)  # what KServe's routes test to answer it as an error
    assert err.model_dump() == {"error": {"message": "too long", "type": "BadRequestError", "param": None,
                                          "code": 400}}
    assert VllmErrorResponse.model_validate(err.model_dump()).model_dump() == err.model_dump()


def test_a_shed_and_a_refused_request_answer_an_int_code_over_http():
    app = FastAPI()
    install_openai_error_handlers(app)

    @app.post(CHAT)
    async def chat():
        raise Overloaded("The service is overloaded: retry after 2 s.", 2)

    r = TestClient(app).post(CHAT, json={})
    assert r.status_code == 429 and r.json()["error"]["code"] == 429


async def test_a_refused_shape_and_a_worker_failure_are_int_coded_error_responses():
    w = Workers()
    out = await _complete(_model(w), n=2, temperature=0)
    assert isinstance(out, ErrorResponse) and out.model_dump()["error"]["code"] == 400

    def failing(req: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="engine dead")

    transport = httpx.MockTransport(failing)
    model = PDModel("m", RoundRobinPairing([], ["http://decode"]), metrics=RuntimeMetrics(CollectorRegistry()),
                    client_factory=lambda url: VllmClient(url, transport=transport))
    out = await _chat(model)
    assert isinstance(out, ErrorResponse) and type(out.error.code) is int and out.error.code >= 500
    await model.aclose()  # a stream's error events: test_server_model_faults, test_server_migration


@pytest.mark.parametrize("path", [COMP, CHAT])
@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"},
                                     {"content-type": "application/x-www-form-urlencoded"},
                                     # vLLM cuts the parameters off at ";" and compares what is left as it is
                                     {"content-type": "application/json ;charset=utf-8"}])
def test_a_body_not_sent_as_json_is_refused_with_vllms_body(path, headers):
    assert not _vllm_takes(headers)
    seen: list[bytes] = []
    with TestClient(_edge_app(seen)) as c:
        r = c.post(path, content=b'{"model": "m", "prompt": "x"}', headers=headers)
    assert r.status_code == 400, r.text
    assert r.json() == _vllm_validation_body(["Unsupported Media Type: Only 'application/json' is allowed"])
    assert r.json()["error"]["code"] == 400 and seen == []


def test_an_empty_body_without_content_type_is_refused_as_vllm_refuses_it():
    seen: list[bytes] = []
    with TestClient(_edge_app(seen)) as c:
        r = c.post(COMP, content=b"")
    assert r.status_code == 400 and "Unsupported Media Type" in r.json()["error"]["message"] and seen == []


def test_json_with_its_media_type_goes_on_and_a_non_json_body_is_left_to_the_request_models():
    seen: list[bytes] = []
    with TestClient(_edge_app(seen)) as c:
        ok = c.post(COMP, json={"model": "m", "prompt": "x"})
        with_charset = c.post(COMP, content=b'{"model": "m"}', headers={"content-type": "application/json; "
                                                                                         "charset=utf-8"})
        # FastAPI reads a body without the header as JSON and answers invalid JSON before vLLM's check runs
        not_json = c.post(COMP, content=b'{"model": ')
    assert ok.status_code == 200 and with_charset.status_code == 200
    assert _vllm_takes({"content-type": "application/json; charset=utf-8"})
    # the edge let it through (this test app's route takes any body; KServe's answers the invalid JSON)
    assert "Unsupported Media Type" not in not_json.text and seen[-1] == b'{"model": '


def test_an_unknown_model_is_vllms_404():
    app = FastAPI()
    install_openai_error_handlers(app)

    @app.post(CHAT)
    async def chat():
        raise ModelNotFound("nope")  # what KServe's OpenAI route raises for a model it does not serve

    r = TestClient(app).post(CHAT, json={"model": "nope"})
    assert r.status_code == 404
    assert r.json() == _vllm_unknown_model_body("nope")


def test_the_model_route_names_an_unknown_model_in_vllms_words():
    with TestClient(_edge_app([])) as c:
        r = c.get("/openai/v1/models/nope")
    assert r.status_code == 404 and r.json() == _vllm_unknown_model_body("nope")


@pytest.mark.parametrize("best_of", [3, "2", 1.0, "many"])
async def test_best_of_is_ignored_as_vllm_ignores_it(best_of):
    w = Workers()
    out = await _complete(_model(w), best_of=best_of)
    assert isinstance(out, Completion) and len(out.choices) == 1
    assert w.decode_bodies()[0]["best_of"] == best_of  # the worker, vLLM, ignores it in turn
    out = await _chat(_model(Workers()), best_of=best_of, n=2, temperature=0.5)
    assert isinstance(out, ChatCompletion) and len(out.choices) == 2


async def test_a_shed_request_is_counted_in_requests_total_apart_from_errors():
    assert "shed" in REQUEST_STATUSES
    reg = CollectorRegistry()
    transport = httpx.MockTransport(lambda req: httpx.Response(500))
    model = PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]), metrics=RuntimeMetrics(reg),
                    client_factory=lambda url: VllmClient(url, transport=transport), slo_ttft_s=1.0,
                    overload=OverloadSpec(shed_ttft_factor=2.0, shed_priority_factor=2.0))
    model.service.observe(0.5, ahead=0, servers=1)
    model._awaiting.update({f"r{i}": (0, 1) for i in range(50)})  # 50 ahead at 0.5 s each: over any bound
    with pytest.raises(Overloaded):
        await _chat(model, messages=[{"role": "user", "content": "word " * 1200}])
    with pytest.raises(Overloaded):
        await _complete(model)
    for endpoint in ("chat", "completions"):
        labels = {"endpoint": endpoint, "mode": UNSERVED_MODE}
        assert reg.get_sample_value("pdserve_requests_total", {**labels, "status": "shed"}) == 1
        assert reg.get_sample_value("pdserve_requests_total", {**labels, "status": "error"}) is None
    await model.aclose()
