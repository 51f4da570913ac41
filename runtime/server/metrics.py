"""Prometheus metrics of the pdserve runtime (exported on the KServe server's /metrics).

Names follow Prometheus conventions (unit suffix, `_total` counters). Buckets of TTFT/ITL cover 10 ms … 60 s,
the range between a GPU TTFT SLO and a CPU test run.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RuntimeMetrics:
    """The runtime's counters and histograms, registered once in `registry`.

    Attributes:
        requests: `pdserve_requests_total{endpoint, mode, status}`; mode "remote" (P/D) or "local".
        ttft: `pdserve_ttft_seconds{endpoint, mode}`, arrival → first token (streaming: first streamed token
            as the client sees it; non-streaming remote: prefill answer, which carries the first token;
            non-streaming local: whole request, an upper bound).
        e2e: `pdserve_request_duration_seconds{endpoint, mode}`, arrival → last byte.
        prefill_fallbacks: `pdserve_prefill_fallbacks_total`, remote prefills that failed and were redone
            locally on the decode worker.
        routes: `pdserve_routes_total{reason}`, routing decisions by reason (remote, local_short, ...).
        prefill_nudges: `pdserve_prefill_nudges_total`, 1-token requests sent to a prefill worker while a decode
            waited for its first token (PDModel `prefill_nudge_after_s`).
        migrations: `pdserve_migrations_total`, requests moved to another decode worker after theirs died.
        kv_lease_expiries: `pdserve_kv_lease_expiries_total`, KV handoffs left unread because the decode leg
            could not start within the prefill worker's KV lease (the decode worker prefilled locally).
        kv_late_reads: `pdserve_kv_late_reads_total`, streamed decode legs whose first token came after the
            handoff's lease ended (the decode worker may have read released blocks; target 0).
        breaker_state: `pdserve_worker_breaker_state{role, worker}`, each worker's circuit breaker
            (runtime.router.breaker.BreakerState: 0 closed, 1 half-open, 2 open); `worker` is the id the
            response headers show (runtime.server.model.public_worker_id), never an address.
        shed: `pdserve_requests_shed_total{reason, priority}`, requests refused to protect the service:
            reason "queue_wait" (429, predicted TTFT over the admission bound) or "breaker_open" (503, every
            decode worker's breaker open); priority "high" (priority bucket 0) or "normal".
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = Counter(
            "pdserve_requests", "Requests served by the runtime.", ["endpoint", "mode", "status"], registry=registry
        )
        self.ttft = Histogram(
            "pdserve_ttft_seconds", "Time to first token, seconds.", ["endpoint", "mode"],
            buckets=_LATENCY_BUCKETS_S, registry=registry,
        )
        self.e2e = Histogram(
            "pdserve_request_duration_seconds", "Request duration, seconds.", ["endpoint", "mode"],
            buckets=_LATENCY_BUCKETS_S, registry=registry,
        )
        self.prefill_fallbacks = Counter(
            "pdserve_prefill_fallbacks", "Remote prefills that failed and ran locally on the decode worker.",
            registry=registry,
        )
        self.routes = Counter("pdserve_routes", "Routing decisions by reason.", ["reason"], registry=registry)
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
