"""Prometheus metrics of the pdserve runtime (exported on the KServe server's /metrics), and the catalog of
every metric the dashboards and alert rules use (`catalog`; docs/operations.md is generated from it).

Names follow Prometheus conventions (unit suffix, `_total` counters). Buckets of TTFT/e2e cover 10 ms … 60 s,
the range between a GPU TTFT SLO and a CPU test run; ITL buckets 5 ms … 5 s (a GPU decode step to a starved
CPU one). The default SLOs (runtime.config.SloSpec: TTFT 2 s, ITL 50 ms) are bucket bounds, as the
burn-rate alerts (runtime.observability.alerts) need.

Serving modes (label `mode`): `remote` (P/D: prefilled on a prefill worker, KV pulled over NIXL), `local`
(prefilled on the decode worker: the router's choice, a failed or late prefill, or a shape that needs it) and
`migrated` (continued on another decode worker after its own died, which prefills the continuation locally).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS_S = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

#: The values of the `mode` label (see the module docstring).
SERVING_MODES = ("remote", "local", "migrated")
#: The values of `pdserve_requests_total`'s `status` label. `error` is the service's failure, the only one
#: the error-rate alerts count; a client's own fault (`client_error`: a worker rejected the request it was
#: sent, 4xx) and a client that left before its answer (`cancelled`) say nothing of the service's health.
#: `shed` is a request admission control refused with 429 (mode `none`): the service protecting its SLO,
#: which the shed alert watches (`pdserve_requests_shed_total`), apart from the error rate.
REQUEST_STATUSES = ("ok", "error", "client_error", "cancelled", "shed")
#: The `mode` of a request no worker served: refused while the runtime was not ready or no decode worker could
#: take it (status `error`: the service is down for it), or shed by admission control (status `shed`).
UNSERVED_MODE = "none"


class KvIndexCollector:
    """The router's KV-event feed per worker, read at scrape time from `source()`: (the subscriber's
    `runtime.engines.kv_events.SubscriberStats`, `{worker_id: monotonic seconds of its last applied batch}`,
    the clock those seconds come from), or None while the runtime has no KV-event subscriber (then it exports
    nothing). Families: `pdserve_router_kv_event_batches_total{worker}`,
    `pdserve_router_kv_missed_batches_total{worker}` (sequence gaps: the worker's index entry was cleared and
    is rebuilt), `pdserve_router_kv_event_age_seconds{worker}` (seconds since its last applied batch, or
    since the worker joined the pool while it has sent none). `label` maps a worker id to the `worker` label:
    the server sets it to the keyed public id the breaker gauge and the response headers show
    (runtime.server.model.public_worker_id), since a discovered id is an unkeyed hash of the worker's URL."""

    def __init__(self) -> None:
        self.source: Callable[[], tuple[object, Mapping[str, float], Callable[[], float]] | None] = lambda: None
        self.label: Callable[[str], str] = lambda worker: worker

    def describe(self) -> list:
        return self._families()

    def collect(self) -> Iterable:
        families = self._families()
        src = self.source()
        if src is None:
            return families
        stats, last_s, clock = src
        batches, missed, age = families
        label = self.label
        for worker, n in sorted(getattr(stats, "num_batches", {}).items()):
            batches.add_metric([label(worker)], n)
        gaps = getattr(stats, "num_missed_batches", {})
        for worker in sorted(set(gaps) | set(getattr(stats, "num_batches", {}))):  # 0 for a worker without gaps
            missed.add_metric([label(worker)], gaps.get(worker, 0))
        now = clock()
        for worker, t in sorted(last_s.items()):
            age.add_metric([label(worker)], max(0.0, now - t))
        return families

    @staticmethod
    def _families() -> list:
        return [
            CounterMetricFamily("pdserve_router_kv_event_batches", "KV-event batches applied to the router's "
                                "index, per worker.", labels=["worker"]),
            CounterMetricFamily("pdserve_router_kv_missed_batches", "KV-event batches missed (sequence gaps); the "
                                "worker's index entry was cleared and is rebuilt.", labels=["worker"]),
            GaugeMetricFamily("pdserve_router_kv_event_age_seconds", "Seconds since the last KV-event batch of "
                              "the worker was applied to the router's index (since it joined the pool while it "
                              "has sent none).", labels=["worker"]),
        ]


class RuntimeMetrics:
    """The runtime's counters and histograms, registered once in `registry`.

    Attributes:
        requests: `pdserve_requests_total{endpoint, mode, status}`; mode in SERVING_MODES, or UNSERVED_MODE
            for a request no worker served (refused as not ready, or shed with 429); status in
            REQUEST_STATUSES.
        ttft: `pdserve_ttft_seconds{endpoint, mode}`, arrival → first streamed token as the client sees it.
            Streamed requests only: a non-streamed answer reaches the client whole, so its first token is
            never seen apart from its last (with local prefill the runtime cannot tell them apart; with remote
            prefill the prefill answer's time is not what the client waited), and mixing either in would make
            the TTFT SLO measure different things by the share of non-streamed traffic. Their latency is `e2e`.
        ready: `pdserve_ready`, 1 while the runtime can serve (some decode worker healthy and in rotation: the
            model's readiness), else 0; read at scrape time from the function the server sets.
        itl: `pdserve_itl_seconds{endpoint, mode}`, mean inter-token latency of one request: (last token − first
            token) / (output tokens − 1); requests with one output token are not observed.
        e2e: `pdserve_request_duration_seconds{endpoint, mode}`, arrival → last byte.
        in_flight: `pdserve_requests_in_flight{endpoint}`, requests routed and not finished (the runtime's queue).
        queue_wait: `pdserve_queue_wait_seconds{endpoint}`, arrival → routed (tokenization and the routing
            decision), the time the runtime holds a request before any worker sees it.
        prefill_fallbacks: `pdserve_prefill_fallbacks_total`, remote prefills that failed and were redone
            locally on the decode worker.
        routes: `pdserve_routes_total{reason}`, routing decisions by reason (remote, local_short, ...).
        prompt_tokens: `pdserve_prompt_tokens_total`, prompt tokens of the routed requests the runtime tokenized.
        prefix_predicted_tokens: `pdserve_prefix_predicted_tokens_total`, of those, the tokens the router
            predicted cached on the worker that prefills (overlap blocks × block size, at most the prompt);
            the realised hits are vLLM's `vllm:prefix_cache_hits_total`.
        prefill_nudges: `pdserve_prefill_nudges_total`, 1-token requests sent to a prefill worker while a decode
            waited for its first token (PDModel `prefill_nudge_after_s`).
        migrations: `pdserve_migrations_total`, requests moved to another decode worker after theirs died.
        kv_lease_expiries: `pdserve_kv_lease_expiries_total`, KV handoffs left unread because the decode leg
            could not start within the prefill worker's KV lease (the decode worker prefilled locally).
        kv_late_reads: `pdserve_kv_late_reads_total`, streamed decode legs whose first token came after the
            handoff's lease ended (the decode worker may have read released blocks; target 0).
        kv_index: the router's KV-event feed (KvIndexCollector); the server sets its `source`.
        breaker_state: `pdserve_worker_breaker_state{role, worker}`, each worker's circuit breaker
            (runtime.router.breaker.BreakerState: 0 closed, 1 half-open, 2 open); `worker` is the id the
            response headers show (runtime.server.model.public_worker_id), never an address.
        shed: `pdserve_requests_shed_total{reason, priority}`, requests refused to protect the service:
            reason "queue_wait" (429, predicted TTFT over the admission bound) or "breaker_open" (503, every
            decode worker's breaker open); priority "high" (priority bucket 0) or "normal".
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter(
            "pdserve_requests", "Requests the runtime answered, by status: ok; error (the service failed it, or "
            "refused it with 503 while not ready: mode none); client_error (a worker rejected the client's own "
            "request, 4xx); cancelled (the client left before its answer); shed (refused with 429 by admission "
            "control: mode none). Error-rate alerts count error only.",
            ["endpoint", "mode", "status"], registry=registry
        )
        self.ready = Gauge("pdserve_ready", "1 while the runtime can serve (a decode worker healthy and in "
                           "rotation), else 0.", registry=registry)
        self.ttft = Histogram(
            "pdserve_ttft_seconds", "Time to first streamed token, seconds. Streamed requests only: a non-streamed "
            "answer shows the client no token before its last (its latency: pdserve_request_duration_seconds).",
            ["endpoint", "mode"],
            buckets=_LATENCY_BUCKETS_S, registry=registry,
        )
        self.itl = Histogram(
            "pdserve_itl_seconds", "Mean inter-token latency of a request, seconds.", ["endpoint", "mode"],
            buckets=_ITL_BUCKETS_S, registry=registry,
        )
        self.e2e = Histogram(
            "pdserve_request_duration_seconds", "Request duration, seconds.", ["endpoint", "mode"],
            buckets=_LATENCY_BUCKETS_S, registry=registry,
        )
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests routed and not finished.", ["endpoint"],
                               registry=registry)
        self.queue_wait = Histogram(
            "pdserve_queue_wait_seconds", "Arrival to routed (tokenization and routing), seconds.", ["endpoint"],
            buckets=_WAIT_BUCKETS_S, registry=registry,
        )
        self.prefill_fallbacks = Counter(
            "pdserve_prefill_fallbacks", "Remote prefills that failed and ran locally on the decode worker.",
            registry=registry,
        )
        self.routes = Counter("pdserve_routes", "Routing decisions by reason.", ["reason"], registry=registry)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of the routed, tokenized requests.",
                                     registry=registry)
        self.prefix_predicted_tokens = Counter(
            "pdserve_prefix_predicted_tokens", "Prompt tokens the router predicted cached on the worker that "
            "prefills.", registry=registry)
        self.prefill_nudges = Counter(
            "pdserve_prefill_nudges", "1-token requests sent to a prefill worker whose decode waited for a first "
            "token (PDModel prefill_nudge_after_s).", registry=registry)
        self.migrations = Counter("pdserve_migrations", "Requests continued on another decode worker.",
                                  registry=registry)
        self.kv_lease_expiries = Counter(
            "pdserve_kv_lease_expiries", "KV handoffs not used because the decode leg could not start within "
            "the KV lease.", registry=registry)
        self.kv_late_reads = Counter(
            "pdserve_kv_late_reads", "Streamed decode legs whose first token came after the KV lease ended.",
            registry=registry)
        self.breaker_state = Gauge(
            "pdserve_worker_breaker_state", "Circuit breaker of each worker: 0 closed, 1 half-open, 2 open.",
            ["role", "worker"], registry=registry)
        self.shed = Counter(
            "pdserve_requests_shed", "Requests refused to protect the service (429 queue_wait, 503 breaker_open).",
            ["reason", "priority"], registry=registry)
        for reason in ("queue_wait", "breaker_open"):  # every series exists from the start, at 0, so rate()
            for priority in ("high", "normal"):  # and the dashboards see "none shed", not "no data"
                self.shed.labels(reason, priority)
        self.kv_index = KvIndexCollector()
        registry.register(self.kv_index)
        self._children: dict[tuple, object] = {}

    def child(self, metric: MetricWrapperBase, *values: str):
        """`metric.labels(*values)`, looked up once per label set: every request observes the same few
        series, and prometheus-client's `labels` checks and locks on each call. Only for metrics whose series
        are never removed (all of this class's but `breaker_state`), since a removed series' child would be
        kept here."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found


@dataclass(frozen=True)
class MetricInfo:
    """One metric family of the catalog.

    Attributes:
        name: the family's name as scraped (counters with their `_total`; histograms without their
            `_bucket`/`_sum`/`_count` suffixes).
        type: "counter", "gauge" or "histogram".
        labels: the family's own label names (scrape labels such as `instance` come on top).
        help: what it measures, with its unit.
        source: who exports it: "runtime", "planner", "vLLM" or "DCGM exporter".
    """

    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    source: str


def _wrapper_info(metric: MetricWrapperBase, source: str) -> MetricInfo:
    kind = metric._type  # prometheus_client's own field: "counter", "gauge", "histogram", ...
    name = metric._name + ("_total" if kind == "counter" else "")
    return MetricInfo(name, kind, tuple(metric._labelnames), metric._documentation, source)


def _families_of(obj: object, source: str) -> list[MetricInfo]:
    """Every metric attribute of `obj` (wrappers and collectors), as catalog entries."""
    out = []
    for value in vars(obj).values():
        if isinstance(value, MetricWrapperBase):
            out.append(_wrapper_info(value, source))
        elif hasattr(value, "describe") and hasattr(value, "collect"):
            for fam in value.describe():
                name = fam.name + ("_total" if fam.type == "counter" else "")
                labels = tuple(getattr(fam, "_labelnames", ()))
                out.append(MetricInfo(name, fam.type, labels, fam.documentation, source))
    return out


#: Metrics of vLLM (v1 engine, vllm/v1/metrics/loggers.py; NIXL: vllm/distributed/kv_transfer/kv_connector/
#: v1/nixl/stats.py, vLLM 0.28.0) that the dashboards and alert rules use; each worker exports them on /metrics.
VLLM_METRICS = (
    MetricInfo("vllm:num_requests_running", "gauge", ("model_name",), "Requests in the engine's running batch.",
               "vLLM"),
    MetricInfo("vllm:num_requests_waiting", "gauge", ("model_name",), "Requests queued in the engine.", "vLLM"),
    MetricInfo("vllm:kv_cache_usage_perc", "gauge", ("model_name",), "KV-cache blocks in use, fraction 0-1.",
               "vLLM"),
    MetricInfo("vllm:prefix_cache_queries_total", "counter", ("model_name",), "Prompt tokens looked up in the "
               "prefix cache.", "vLLM"),
    MetricInfo("vllm:prefix_cache_hits_total", "counter", ("model_name",), "Prompt tokens found in the prefix "
               "cache.", "vLLM"),
    MetricInfo("vllm:time_to_first_token_seconds", "histogram", ("model_name",), "Engine TTFT, seconds (a "
               "decode worker's counts from its own arrival).", "vLLM"),
    MetricInfo("vllm:inter_token_latency_seconds", "histogram", ("model_name",), "Engine inter-token latency, "
               "seconds.", "vLLM"),
    MetricInfo("vllm:request_queue_time_seconds", "histogram", ("model_name",), "Time requests waited in the "
               "engine's queue, seconds.", "vLLM"),
    MetricInfo("vllm:request_prefill_time_seconds", "histogram", ("model_name",), "Engine prefill time per "
               "request, seconds.", "vLLM"),
    MetricInfo("vllm:prompt_tokens_total", "counter", ("model_name",), "Prompt tokens processed.", "vLLM"),
    MetricInfo("vllm:generation_tokens_total", "counter", ("model_name",), "Tokens generated.", "vLLM"),
    MetricInfo("vllm:nixl_xfer_time_seconds", "histogram", ("model_name",), "NIXL KV transfer duration, "
               "seconds (on the worker that pulls: the decode worker).", "vLLM"),
    MetricInfo("vllm:nixl_bytes_transferred", "histogram", ("model_name",), "Bytes per NIXL KV transfer.",
               "vLLM"),
    MetricInfo("vllm:nixl_num_failed_transfers_total", "counter", ("model_name",), "Failed NIXL KV transfers.",
               "vLLM"),
    MetricInfo("vllm:nixl_num_kv_expired_reqs_total", "counter", ("model_name",), "Requests whose KV blocks "
               "expired unread on the prefill worker (the lease ended).", "vLLM"),
)

#: Metrics of NVIDIA's DCGM exporter (dcgm-exporter's default counters, etc/default-counters.csv) that the GPU
#: dashboard uses; the exporter (infra/k8s/gpu: NVIDIA's dcgm-exporter chart on every GPU node) labels them with
#: `gpu`, `UUID`, `Hostname`, `modelName` and, with pod mapping, `pod`/`namespace`/`container`.
DCGM_METRICS = (
    MetricInfo("DCGM_FI_DEV_GPU_UTIL", "gauge", ("gpu", "UUID", "Hostname"), "GPU utilisation, percent.",
               "DCGM exporter"),
    MetricInfo("DCGM_FI_DEV_FB_USED", "gauge", ("gpu", "UUID", "Hostname"), "Frame-buffer memory used, MiB.",
               "DCGM exporter"),
    MetricInfo("DCGM_FI_DEV_FB_FREE", "gauge", ("gpu", "UUID", "Hostname"), "Frame-buffer memory free, MiB.",
               "DCGM exporter"),
    MetricInfo("DCGM_FI_DEV_GPU_TEMP", "gauge", ("gpu", "UUID", "Hostname"), "GPU temperature, °C.",
               "DCGM exporter"),
    MetricInfo("DCGM_FI_DEV_POWER_USAGE", "gauge", ("gpu", "UUID", "Hostname"), "Power draw, W.",
               "DCGM exporter"),
    MetricInfo("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", ("gpu", "UUID", "Hostname"), "PCIe transmit rate, "
               "bytes/s.", "DCGM exporter"),
    MetricInfo("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", ("gpu", "UUID", "Hostname"), "PCIe receive rate, "
               "bytes/s.", "DCGM exporter"),
    MetricInfo("DCGM_FI_DEV_XID_ERRORS", "gauge", ("gpu", "UUID", "Hostname"), "Last XID error code (0: none).",
               "DCGM exporter"),
)


def catalog() -> list[MetricInfo]:
    """Every metric family the runtime and its planner export (read from a fresh registry, so every family
    registered in RuntimeMetrics and PlannerGauges is listed), then VLLM_METRICS and DCGM_METRICS."""
    from runtime.server.planner_loop import PlannerGauges

    registry = CollectorRegistry()
    return [*_families_of(RuntimeMetrics(registry), "runtime"), *_families_of(PlannerGauges(registry), "planner"),
            *VLLM_METRICS, *DCGM_METRICS]
