"""pdserve's Grafana dashboards as code: serving (P/D), planner, KV/NIXL and GPUs (DCGM exporter).

Each dashboard is a Grafana dashboard JSON model (schemaVersion 39) with a `datasource` variable (any
Prometheus data source) and time-series panels; every query is plain PromQL with fixed `[5m]` windows, so it
runs as written against Prometheus's HTTP API (tests/e2e/test_dashboards_prometheus.py executes every one). The files land
in infra/k8s/prometheus/dashboards/ (`python -m runtime.docs_gen`), whose kustomization makes one ConfigMap
with the Grafana sidecar's label (kube-prometheus-stack: `grafana_dashboard: "1"`).
"""

from __future__ import annotations

import json
import re
from typing import Callable

from runtime.observability.alerts import rule_yaml

RULES_FILE = "pdserve-alerts.yaml"
DASHBOARD_DIR = "dashboards"
SIDECAR_LABEL = 'grafana_dashboard: "1"'
PROMETHEUS_DIR = "infra/k8s/prometheus"
SCHEMA_VERSION = 39
_DS = {"type": "prometheus", "uid": "${datasource}"}

Target = tuple[str, str]  # (PromQL, legend)
Panel = tuple[str, str, list[Target]]  # (title, Grafana unit, targets)


def _q(quantile: float, metric: str, by: str) -> str:
    return f"histogram_quantile({quantile:g}, sum by (le, {by}) (rate({metric}_bucket[5m])))"


SERVING: list[Panel] = [
    ("Requests per second by mode and status", "reqps",
     [("sum by (mode, status) (rate(pdserve_requests_total[5m]))", "{{mode}} {{status}}")]),
    # the error-rate alerts' ratio: clients' own faults (client_error), abandoned requests (cancelled) and
    # requests admission control shed (shed, 429) apart
    ("Error ratio (service errors; client errors, cancellations and sheds apart)", "percentunit",
     # written as 1 - (the rest) so that a service without a single error shows 0, not "no data"
     [('1 - sum(rate(pdserve_requests_total{status="ok"}[5m])) / sum(rate(pdserve_requests_total{status=~"ok|error"}'
       '[5m]))', "errors"),
      ('1 - sum(rate(pdserve_requests_total{status=~"ok|error"}[5m])) / sum(rate(pdserve_requests_total[5m]))',
       "client errors, cancellations, sheds")]),
    ("Runtime replicas ready", "short", [("sum(pdserve_ready)", "ready"), ("count(pdserve_ready)", "replicas")]),
    ("TTFT p50 / p90 by mode", "s",
     [(_q(0.5, "pdserve_ttft_seconds", "mode"), "p50 {{mode}}"),
      (_q(0.9, "pdserve_ttft_seconds", "mode"), "p90 {{mode}}")]),
    ("ITL p50 / p90 by mode", "s",
     [(_q(0.5, "pdserve_itl_seconds", "mode"), "p50 {{mode}}"),
      (_q(0.9, "pdserve_itl_seconds", "mode"), "p90 {{mode}}")]),
    ("Request duration p90 by mode", "s", [(_q(0.9, "pdserve_request_duration_seconds", "mode"), "p90 {{mode}}")]),
    ("Requests in flight (runtime) and engine queues", "short",
     [("sum by (endpoint) (pdserve_requests_in_flight)", "runtime {{endpoint}}"),
      ("sum by (instance) (vllm:num_requests_waiting)", "waiting {{instance}}"),
      ("sum by (instance) (vllm:num_requests_running)", "running {{instance}}")]),
    ("Queue wait p90: runtime (arrival to routed) and engine", "s",
     [(_q(0.9, "pdserve_queue_wait_seconds", "endpoint"), "runtime {{endpoint}}"),
      (_q(0.9, "vllm:request_queue_time_seconds", "instance"), "engine {{instance}}")]),
    ("Routing decisions by reason", "reqps", [("sum by (reason) (rate(pdserve_routes_total[5m]))", "{{reason}}")]),
    ("Fallbacks, migrations, nudges", "reqps",
     [("sum(rate(pdserve_prefill_fallbacks_total[5m]))", "prefill fallbacks"),
      ("sum(rate(pdserve_migrations_total[5m]))", "migrations"),
      ("sum(rate(pdserve_prefill_nudges_total[5m]))", "prefill nudges")]),
    ("Circuit breakers (0 closed, 1 half-open, 2 open)", "short",
     [("max by (role, worker) (pdserve_worker_breaker_state)", "{{role}} {{worker}}")]),
    ("Requests shed", "reqps",
     [("sum by (reason, priority) (rate(pdserve_requests_shed_total[5m]))", "{{reason}} {{priority}}")]),
]

PLANNER: list[Panel] = [
    ("Replicas: decided and applied", "short",
     [("max(pdserve_planner_prefill_replicas)", "prefill decided"),
      ("max(pdserve_planner_decode_replicas)", "decode decided"),
      ("max by (pool) (pdserve_planner_applied_replicas)", "{{pool}} applied")]),
    ("GPUs: decision and budget", "short",
     [("max(pdserve_planner_gpus)", "decision"), ("max(pdserve_planner_gpu_budget)", "budget")]),
    ("Request rate: predicted, observed, served", "reqps",
     [("max(pdserve_planner_predicted_rate_per_second)", "predicted"),
      ("max(pdserve_planner_observed_rate_per_second)", "observed (planner)"),
      ("sum(rate(pdserve_requests_total[5m]))", "served (runtime)")]),
    ("Predicted input / output length", "short",
     [("max(pdserve_planner_predicted_isl_tokens)", "ISL tokens"),
      ("max(pdserve_planner_predicted_osl_tokens)", "OSL tokens")]),
    ("Observed TTFT / ITL p90 (planner window)", "s",
     [("max(pdserve_planner_observed_ttft_p90_seconds)", "TTFT p90"),
      ("max(pdserve_planner_observed_itl_p90_seconds)", "ITL p90")]),
    ("SLA corrections (observed / model)", "short",
     [("max(pdserve_planner_ttft_correction)", "TTFT"), ("max(pdserve_planner_itl_correction)", "ITL")]),
    ("Prefill load", "short",
     [("max(pdserve_planner_observed_peak_prefill_tokens_per_second)", "peak prompt tokens/s"),
      ("max(pdserve_planner_observed_prefill_time_mean_seconds)", "mean prefill time s"),
      ("max(pdserve_planner_observed_arrival_dispersion)", "arrival dispersion")]),
    ("Modes: burst, aggregated", "short",
     [("max(pdserve_planner_burst)", "burst"), ("max(pdserve_planner_aggregated)", "aggregated")]),
    ("Scale events (1 h)", "short",
     [("sum by (pool, direction) (increase(pdserve_planner_scale_events_total[1h]))", "{{pool}} {{direction}}")]),
    ("Planner ticks per minute", "short", [("sum(rate(pdserve_planner_ticks_total[5m])) * 60", "ticks")]),
]

KV: list[Panel] = [
    ("NIXL transfer time p50 / p90 (decode workers)", "s",
     [(_q(0.5, "vllm:nixl_xfer_time_seconds", "instance"), "p50 {{instance}}"),
      (_q(0.9, "vllm:nixl_xfer_time_seconds", "instance"), "p90 {{instance}}")]),
    ("NIXL transfers per second", "ops",
     [("sum by (instance) (rate(vllm:nixl_xfer_time_seconds_count[5m]))", "{{instance}}")]),
    ("Bytes per NIXL transfer", "bytes",
     [("sum by (instance) (rate(vllm:nixl_bytes_transferred_sum[5m]))"
       " / sum by (instance) (rate(vllm:nixl_bytes_transferred_count[5m]))", "{{instance}}")]),
    ("Failed NIXL transfers (5 min)", "short",
     [("sum by (instance) (increase(vllm:nixl_num_failed_transfers_total[5m]))", "{{instance}}")]),
    ("KV lease: expiries and late reads (5 min)", "short",
     [("sum(increase(pdserve_kv_lease_expiries_total[5m]))", "runtime: handoffs expired unread"),
      ("sum by (instance) (increase(vllm:nixl_num_kv_expired_reqs_total[5m]))", "vLLM expired {{instance}}"),
      ("sum(increase(pdserve_kv_late_reads_total[5m]))", "late reads (target 0)")]),
    ("Prefix cache hits: predicted by the router vs realised by vLLM", "percentunit",
     [("sum(rate(pdserve_prefix_predicted_tokens_total[5m])) / sum(rate(pdserve_prompt_tokens_total[5m]))",
       "predicted"),
      ("sum(rate(vllm:prefix_cache_hits_total[5m])) / sum(rate(vllm:prefix_cache_queries_total[5m]))", "realised")]),
    ("KV cache usage", "percentunit", [("max by (instance) (vllm:kv_cache_usage_perc)", "{{instance}}")]),
    ("Router index: seconds since each worker's last KV event", "s",
     [("max by (worker) (pdserve_router_kv_event_age_seconds)", "{{worker}}")]),
    ("Router index: KV-event batches per second and missed batches (1 h)", "short",
     [("sum by (worker) (rate(pdserve_router_kv_event_batches_total[5m]))", "batches/s {{worker}}"),
      ("sum by (worker) (increase(pdserve_router_kv_missed_batches_total[1h]))", "missed {{worker}}")]),
]

GPUS: list[Panel] = [
    ("GPU utilisation", "percent", [("avg by (Hostname, gpu) (DCGM_FI_DEV_GPU_UTIL)", "{{Hostname}} GPU {{gpu}}")]),
    # DCGM reports frame-buffer memory in MiB: Grafana's "mbytes" (mebibytes), not "decmbytes" (10^6 bytes)
    ("Frame-buffer memory used", "mbytes",
     [("max by (Hostname, gpu) (DCGM_FI_DEV_FB_USED)", "used {{Hostname}} GPU {{gpu}}"),
      ("max by (Hostname, gpu) (DCGM_FI_DEV_FB_FREE)", "free {{Hostname}} GPU {{gpu}}")]),
    ("GPU temperature", "celsius", [("max by (Hostname, gpu) (DCGM_FI_DEV_GPU_TEMP)", "{{Hostname}} GPU {{gpu}}")]),
    ("Power draw", "watt", [("max by (Hostname, gpu) (DCGM_FI_DEV_POWER_USAGE)", "{{Hostname}} GPU {{gpu}}")]),
    ("PCIe throughput", "Bps",
     [("max by (Hostname, gpu) (DCGM_FI_PROF_PCIE_TX_BYTES)", "tx {{Hostname}} GPU {{gpu}}"),
      ("max by (Hostname, gpu) (DCGM_FI_PROF_PCIE_RX_BYTES)", "rx {{Hostname}} GPU {{gpu}}")]),
    ("Last XID error (0: none)", "short", [("max by (Hostname, gpu) (DCGM_FI_DEV_XID_ERRORS)",
                                             "{{Hostname}} GPU {{gpu}}")]),
]

#: (uid, title, panels) of every dashboard.
DASHBOARDS: list[tuple[str, str, list[Panel]]] = [
    ("pdserve-serving", "pdserve / Serving (P/D)", SERVING),
    ("pdserve-planner", "pdserve / Planner", PLANNER),
    ("pdserve-kv", "pdserve / KV cache and NIXL", KV),
    ("pdserve-gpus", "pdserve / GPUs (DCGM)", GPUS),
]


def dashboard(uid: str, title: str, panels: list[Panel]) -> dict:
    """One Grafana dashboard JSON model: panels two to a row, 12 × 8 grid units each, ids from 1."""
    out = []
    for i, (ptitle, unit, targets) in enumerate(panels):
        out.append({
            "id": i + 1, "type": "timeseries", "title": ptitle, "datasource": _DS,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
            "targets": [{"refId": chr(ord("A") + j), "datasource": _DS, "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(targets)],
        })
    return {
        "uid": uid, "title": title, "tags": ["pdserve"], "editable": True, "schemaVersion": SCHEMA_VERSION,
        "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "timezone": "browser",
        "templating": {"list": [{"name": "datasource", "label": "Data source", "type": "datasource",
                                 "query": "prometheus", "hide": 0, "current": {}}]},
        "panels": out,
    }


def dashboards() -> list[dict]:
    """Every dashboard of DASHBOARDS as Grafana JSON models."""
    return [dashboard(uid, title, panels) for uid, title, panels in DASHBOARDS]


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, PromQL) of every query of every panel."""
    return [(d["uid"], p["title"], t["expr"]) for d in dashboards() for p in d["panels"] for t in p["targets"]]


def query_metrics(expr: str) -> set[str]:
    """The metric names a PromQL query reads (histogram `_bucket`/`_sum`/`_count` series as their family name)."""
    names = re.findall(r"\b(?:pdserve_|vllm:|DCGM_)[A-Za-z0-9_:]*", expr)
    return {re.sub(r"_(bucket|sum|count)$", "", n) if not n.endswith("_total") else n for n in names}


def _kustomization() -> str:
    files = "\n".join(f"      - {uid}.json" for uid, _, _ in DASHBOARDS)
    return ("# generated by `python -m runtime.docs_gen` from runtime/observability/dashboards.py; do not edit by hand\n"
            "# pdserve's Grafana dashboards, one ConfigMap the Grafana sidecar of kube-prometheus-stack loads\n"
            f"# (label {SIDECAR_LABEL}).\n"
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: monitoring\n"
            "configMapGenerator:\n  - name: pdserve-dashboards\n    files:\n" + files + "\n"
            "    options:\n      disableNameSuffixHash: true\n      labels:\n"
            f"        {SIDECAR_LABEL}\n        app.kubernetes.io/part-of: pdserve\n")


def artifacts() -> dict[str, Callable[[], str]]:
    """Generated monitoring files by path from the checkout root (written by `python -m runtime.docs_gen`)."""
    out: dict[str, Callable[[], str]] = {f"{PROMETHEUS_DIR}/{RULES_FILE}": rule_yaml,
                                         f"{PROMETHEUS_DIR}/{DASHBOARD_DIR}/kustomization.yaml": _kustomization}
    for d in dashboards():
        out[f"{PROMETHEUS_DIR}/{DASHBOARD_DIR}/{d['uid']}.json"] = (
            lambda d=d: json.dumps(d, indent=2, sort_keys=True) + "\n")
    return out
