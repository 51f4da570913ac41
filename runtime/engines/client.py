"""Async HTTP client for one vLLM OpenAI server, speaking vLLM's P/D `kv_transfer_params` protocol.

Protocol (vLLM NixlConnector, examples/online_serving/disaggregated_serving/;
docs/architecture.md#pd-disaggregation-with-nixl):
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
    """A worker answered with a non-2xx status, answered something that is not the protocol, or could not
    be reached.

    Attributes:
        status_code: HTTP status of the worker's answer; 502 when there was no usable answer, 504 when it
            timed out.
        body: the worker's response body (parsed JSON when possible, else text), or what went wrong.
        url: the URL called.
        unreachable: True only when the worker process looks gone (connection refused or reset, the
            connection dropped mid-answer): the router then takes it out of the pool and a decode request
            may migrate. A worker that answered (any status, or a malformed body) or was only slow
            (timeout) is not unreachable.
    """

    def __init__(self, url: str, status_code: int, body: Any, *, unreachable: bool = False) -> None:
        self.url, self.status_code, self.body, self.unreachable = url, status_code, body, unreachable
        super().__init__(f"{url} answered {status_code}: {str(body)[:500]}")


# httpx errors that mean the worker process is gone (refused, reset, closed mid-answer), as opposed to
# slow (timeouts: the worker may be busy) or a local misuse
_GONE = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.CloseError)


def _transport_error(url: str, exc: httpx.HTTPError) -> BackendError:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return BackendError(url, 504, f"{type(exc).__name__}: the worker did not answer in time")
    gone = isinstance(exc, _GONE) or isinstance(exc, httpx.ConnectTimeout)
    return BackendError(url, 502, f"{type(exc).__name__}: {exc}", unreachable=gone)


def prefill_body(body: dict) -> dict:
    """The prefill request for `body`: same fields, one token, no streaming, remote-decode KV params."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens; the decode worker enforces it
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


def _chunk_shape_ok(chunk: dict) -> bool:
    """The fields the runtime reads have the OpenAI chunk types: ``choices`` a list of objects whose
    ``delta`` (if any) is an object, ``usage`` an object or null. An ``error`` event passes (vLLM sends
    one when generation fails mid-stream)."""
    choices = chunk.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        return False
    if any(not isinstance(c.get("delta", {}), (dict, type(None))) for c in choices):
        return False
    return isinstance(chunk.get("usage"), (dict, type(None)))


class VllmClient:
    """Calls one worker. Share one instance per worker; close it with `aclose` (or `async with`).

    Args:
        base_url: "http://host:port" of the worker (from configuration, never from a request).
        timeout_s: read timeout per call, seconds (connect timeout is 5 s).
        transport: optional httpx transport (tests may pass a real ASGI app transport).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        # No cap on connections: the worker's own scheduler queues what it cannot run, so a pool cap would
        # only hide a second queue here (httpx's default, 100, holds the 101st stream until one ends).
        # Keep-alive for as many as are open, so a busy worker's streams do not reconnect per request.
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
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
            raise _transport_error(url, exc) from exc
        if resp.status_code >= 300:
            raise BackendError(url, resp.status_code, _decode_error_body(resp))
        try:
            answer = resp.json()
        except ValueError:
            raise BackendError(url, 502, f"answered {resp.status_code} with a body that is not JSON") from None
        if not isinstance(answer, dict):
            raise BackendError(url, 502, f"answered {resp.status_code} with JSON that is not an object")
        return answer

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
            BackendError: non-2xx status (raised before the first chunk), a broken connection, an event
                that is not a JSON object, or a stream that ends without `data: [DONE]` (a truncated
                answer must not look complete).
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
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise BackendError(url, 502, "stream event is not JSON") from None
                    if not isinstance(chunk, dict) or not _chunk_shape_ok(chunk):
                        raise BackendError(url, 502, "stream event is not an OpenAI completion chunk")
                    yield chunk
        except httpx.HTTPError as exc:
            raise _transport_error(url, exc) from exc
        raise BackendError(url, 502, "stream ended without data: [DONE]")

    async def metrics_text(self) -> str:
        """GET /metrics (Prometheus text). Raises BackendError."""
        url = self.base_url + "/metrics"
        try:
            resp = await self._http.get("/metrics")
        except httpx.HTTPError as exc:
            raise _transport_error(url, exc) from exc
        if resp.status_code != 200:
            raise BackendError(url, resp.status_code, resp.text)
        return resp.text

    async def healthy(self) -> bool:
        """True when GET /health answers 200 within the timeout."""
        try:
            return (await self._http.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False
