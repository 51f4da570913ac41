"""Async HTTP client for one vLLM OpenAI server, speaking vLLM's P/D `kv_transfer_params` protocol.

Protocol (vLLM NixlConnector, examples/online_serving/disaggregated_serving/ and ../shared/DESIGN.md):
1. prefill: the original request with `max_tokens=1`, `stream=false` and `kv_transfer_params` =
   `PREFILL_KV_TRANSFER_PARAMS` (do_remote_decode=true); its response carries `kv_transfer_params` that name
   the prefill engine, its blocks and its NIXL side channel.
2. decode: the original request plus those `kv_transfer_params`, unchanged; the decode worker pulls the KV
   blocks with NIXL and continues generation. Both calls carry the same `X-Request-Id`.
Without `kv_transfer_params` a request is served locally (aggregated; also the failover path).

The client never decides where to send a request: its `base_url` is fixed at construction from configuration.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class BackendError(RuntimeError):
    """A worker answered with a non-2xx status or could not be reached.

    Attributes:
        status_code: HTTP status of the worker's answer; 502 when it could not be reached.
        body: the worker's response body (parsed JSON when possible, else text).
        url: the URL called.
    """

    def __init__(self, url: str, status_code: int, body: Any) -> None:
        self.url, self.status_code, self.body = url, status_code, body
        super().__init__(f"{url} answered {status_code}: {str(body)[:500]}")


def prefill_body(body: dict) -> dict:
    """The prefill request for `body`: same fields, one token, no streaming, remote-decode KV params."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def decode_body(body: dict, kv_transfer_params: dict | None) -> dict:
    """The decode request: the original `body` plus the prefill answer's `kv_transfer_params` (if any)."""
    out = copy.deepcopy(body)
    out.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def _decode_error_body(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text


class VllmClient:
    """Calls one worker. Share one instance per worker; close it with `aclose` (or `async with`).

    Args:
        base_url: "http://host:port" of the worker (from configuration, never from a request).
        timeout_s: read timeout per call, seconds (connect timeout is 5 s).
        transport: optional httpx transport (tests may pass a real ASGI app transport).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "VllmClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def post_json(self, path: str, body: dict, request_id: str) -> dict:
        """POST `body` to `path`, return the JSON answer. Raises BackendError on non-2xx or transport errors."""
        url = self.base_url + path
        try:
            resp = await self._http.post(path, json=body, headers={"X-Request-Id": request_id})
        except httpx.HTTPError as exc:
            raise BackendError(url, 502, f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 300:
            raise BackendError(url, resp.status_code, _decode_error_body(resp))
        return resp.json()

    async def prefill(self, path: str, body: dict, request_id: str) -> dict | None:
        """Run the prefill step of `body`; returns the `kv_transfer_params` for the decode worker (or None).

        Raises:
            BackendError: the worker failed or is unreachable.
        """
        answer = await self.post_json(path, prefill_body(body), request_id)
        return answer.get("kv_transfer_params")

    async def complete(self, path: str, body: dict, request_id: str, kv_transfer_params: dict | None = None) -> dict:
        """Non-streaming (decode) call: returns the OpenAI response object as a dict. Raises BackendError."""
        b = decode_body(body, kv_transfer_params)
        b["stream"] = False
        b.pop("stream_options", None)
        return await self.post_json(path, b, request_id)

    async def stream(
        self, path: str, body: dict, request_id: str, kv_transfer_params: dict | None = None
    ) -> AsyncIterator[dict]:
        """Streaming (decode) call: yields each SSE chunk's JSON object, stops at `data: [DONE]`.

        Raises:
            BackendError: non-2xx status (raised before the first chunk) or a broken connection.
        """
        b = decode_body(body, kv_transfer_params)
        b["stream"] = True
        url = self.base_url + path
        try:
            async with self._http.stream("POST", path, json=b, headers={"X-Request-Id": request_id}) as resp:
                if resp.status_code >= 300:
                    await resp.aread()
                    raise BackendError(url, resp.status_code, _decode_error_body(resp))
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    yield json.loads(data)
        except httpx.HTTPError as exc:
            raise BackendError(url, 502, f"{type(exc).__name__}: {exc}") from exc

    async def metrics_text(self) -> str:
        """GET /metrics (Prometheus text). Raises BackendError."""
        url = self.base_url + "/metrics"
        try:
            resp = await self._http.get("/metrics")
        except httpx.HTTPError as exc:
            raise BackendError(url, 502, str(exc)) from exc
        if resp.status_code != 200:
            raise BackendError(url, resp.status_code, resp.text)
        return resp.text

    async def healthy(self) -> bool:
        """True when GET /health answers 200 within the timeout."""
        try:
            return (await self._http.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False
