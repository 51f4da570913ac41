"""pdserve's alert rules, one `Alert` each with its runbook, rendered as a prometheus-operator PrometheusRule.

Severities: `critical` (users are hurt now: page), `warning` (users will be hurt or a safety net is in use: act
within the working day), `info` (worth a look: no action required). The latency SLOs are the deployment's
(`runtime.config.SloSpec`: p90 TTFT and p90 ITL), so 10 % of requests may exceed each threshold: the error
budget is 0.1 and a burn rate of 1 spends it exactly over the SLO period.

Multi-window burn-rate alerts follow the Google SRE workbook, "Alerting on SLOs" (alert when both a long and a
short window burn faster than a factor; the short window ends the alert soon after the burn stops). The
workbook's factors 14.4 / 6 assume a 99.9 % objective; with a 0.1 budget the burn rate cannot exceed 10, so the
factors here are 5 (half of all requests slow: 1 h and 5 min windows, critical) and 2 (6 h and 30 min,
warning).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.config import SloSpec

#: Where the runbooks live, relative to the repository root; each alert's `runbook_url` is this file and the
#: alert's section (its anchor is the alert name in lower case).
RUNBOOK_DOC = "docs/operations.md"
RULE_NAME = "pdserve-alerts"
RULE_NAMESPACE = "monitoring"
SEVERITIES = ("critical", "warning", "info")
#: The SLO objective of both latency SLOs (p90: 90 % of requests within the threshold).
SLO_OBJECTIVE = 0.9


@dataclass(frozen=True)
class Alert:
    """One alerting rule and its runbook.

    Attributes:
        name: alert name (CamelCase, `Pdserve` prefix).
        group: the rule group it belongs to.
        severity: one of SEVERITIES.
        expr: PromQL; the alert fires for every series it returns for `for_`.
        for_: how long `expr` must hold, a Prometheus duration.
        summary: one line for the notification.
        meaning: what firing means (runbook).
        actions: what to check and do, in order (runbook).
    """

    name: str
    group: str
    severity: str
    expr: str
    for_: str
    summary: str
    meaning: str
    actions: tuple[str, ...]

    @property
    def anchor(self) -> str:
        return self.name.lower()


def _le(seconds: float) -> str:
    """The `le` label value prometheus_client writes for a bucket bound of `seconds` (Python's float repr)."""
    return repr(float(seconds))


def _bad_ratio(metric: str, le: str, window: str) -> str:
    return (f"(1 - sum(rate({metric}_bucket{{le=\"{le}\"}}[{window}])) / sum(rate({metric}_count[{window}])))")


def _burn(metric: str, le: str, factor: float, long_w: str, short_w: str) -> str:
    budget = round(1 - SLO_OBJECTIVE, 6)
    return (f"{_bad_ratio(metric, le, long_w)} / {budget} > {factor:g}\n"
            f"and\n{_bad_ratio(metric, le, short_w)} / {budget} > {factor:g}")


#: The `job` label of the runtime pods' scrape: prometheus-operator names a PodMonitor's job
#: "<namespace>/<PodMonitor name>", and runtime.deploy.render names the runtime's "<InferenceService>-runtime".
_RUNTIME_JOB = ".+/.+-runtime"


def _error_ratio(window: str) -> str:
    """The share of requests that failed by the service's fault: status `error` over `ok` and `error`. Client
    faults (`client_error`), abandoned requests (`cancelled`) and requests admission control shed (`shed`, 429,
    which PdserveRequestsShed watches) are in neither, so that neither a client's bad requests nor its
    impatience pages anyone (runtime.server.metrics.REQUEST_STATUSES)."""
    return (f'sum(rate(pdserve_requests_total{{status="error"}}[{window}]))\n'
            f'/ sum(rate(pdserve_requests_total{{status=~"ok|error"}}[{window}]))')


def alerts(slo: SloSpec | None = None) -> list[Alert]:
    """Every alert, for the latency SLOs `slo` (default: SloSpec's defaults).

    Raises:
        ValueError: an SLO threshold that is not a bucket bound of its histogram (the burn rate needs the
            count of requests within the threshold; runtime.server.metrics lists the buckets).
    """
    from runtime.server.metrics import _ITL_BUCKETS_S, _LATENCY_BUCKETS_S

    slo = slo or SloSpec()
    ttft_s, itl_s = slo.ttft_p90_ms / 1000, slo.itl_p90_ms / 1000
    for what, value, buckets in (("ttft", ttft_s, _LATENCY_BUCKETS_S), ("itl", itl_s, _ITL_BUCKETS_S)):
        if value not in buckets:
            raise ValueError(f"{what} SLO {value:g} s is not a bucket bound of pdserve_{what}_seconds {buckets}")
    ttft, itl = "pdserve_ttft_seconds", "pdserve_itl_seconds"
    slo_actions = (
        "Open the Serving dashboard: which mode (remote, local, migrated) is slow, and since when.",
        "Compare the planner's decided and applied replicas (Planner dashboard): a pool held below its decision "
        "(GPU budget, worker cap, failed starts) queues requests; see PdservePlannerAtGpuBudget.",
        "Queues: `vllm:num_requests_waiting` per worker and `pdserve_requests_in_flight`; a single hot worker "
        "points at routing (prefix affinity), all of them at capacity.",
        "KV/NIXL dashboard: slow or failing transfers inflate TTFT of remote requests.",
        "If capacity is short and the planner cannot add it, raise `planner.gpu_budget` or shed load "
        "(admission control) until it can.",
    )
    out = [
        Alert("PdserveTtftBudgetBurnFast", "pdserve-slo", "critical", _burn(ttft, _le(ttft_s), 5, "1h", "5m"), "2m",
              f"TTFT SLO (p90 <= {ttft_s:g} s) error budget burning at over 5x",
              f"Over the last hour and the last 5 minutes more than half of the streamed requests (the only ones "
              f"whose first token the client sees apart from the answer) took longer than {ttft_s:g} s to their "
              "first token; at this rate the month's budget is gone in under 6 days.",
              slo_actions),
        Alert("PdserveTtftBudgetBurnSlow", "pdserve-slo", "warning", _burn(ttft, _le(ttft_s), 2, "6h", "30m"), "15m",
              f"TTFT SLO (p90 <= {ttft_s:g} s) error budget burning at over 2x",
              f"Over the last 6 hours and 30 minutes more than 20 % of the streamed requests took longer than "
              f"{ttft_s:g} s to their first token.", slo_actions),
        Alert("PdserveItlBudgetBurnFast", "pdserve-slo", "critical", _burn(itl, _le(itl_s), 5, "1h", "5m"), "2m",
              f"ITL SLO (p90 <= {itl_s:g} s) error budget burning at over 5x",
              f"Over the last hour and the last 5 minutes more than half of the requests had a mean inter-token "
              f"latency above {itl_s:g} s.",
              ("Decode pool: `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` per decode worker; a "
               "full KV cache preempts requests.",
               *slo_actions[1:2], "GPU dashboard: throttling (temperature, power) or XID errors on decode nodes.")),
        Alert("PdserveItlBudgetBurnSlow", "pdserve-slo", "warning", _burn(itl, _le(itl_s), 2, "6h", "30m"), "15m",
              f"ITL SLO (p90 <= {itl_s:g} s) error budget burning at over 2x",
              f"Over the last 6 hours and 30 minutes more than 20 % of the requests had a mean inter-token latency "
              f"above {itl_s:g} s.",
              ("Decode pool: `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` per decode worker.",
               *slo_actions[1:2])),
        Alert("PdserveErrorRateHigh", "pdserve-errors", "critical", _error_ratio("5m") + " > 0.05",
              "5m", "More than 5 % of requests fail",
              "Requests end with an error (a worker's 5xx, no decode worker answering, a stream cut off, a 503 "
              "while the runtime is not ready). Clients' own faults (status client_error: a worker rejected "
              "the request), requests the client left (cancelled) and requests shed with 429 (shed: "
              "PdserveRequestsShed watches them) are not counted.",
              ("Serving dashboard: errors by mode; the runtime's log names the failing worker.",
               "Breakers (Serving dashboard): open breakers mean workers failing; check their pods and logs.",
               "No decode worker ready: the runtime answers 503; check the decode Deployment's pods.")),
        Alert("PdserveErrorRateElevated", "pdserve-errors", "warning", _error_ratio("15m") + " > 0.01",
              "15m", "More than 1 % of requests fail",
              "A sustained small error rate: one bad worker, a worker answering 4xx to requests it should take "
              "(a deployment fault), or short outages.",
              ("Serving dashboard: errors by mode and endpoint.",
               "The runtime's log: 5xx, resets and deployment-fault 4xx name the worker.")),
        Alert("PdserveNotReady", "pdserve-errors", "critical", "max by (namespace, job) (pdserve_ready) == 0", "1m",
              "No runtime replica of the InferenceService can serve",
              "Every runtime replica reports not ready: no decode worker is healthy and in rotation (breakers "
              "open or half-open, or no health check answered), so every request is refused with 503. A new "
              "InferenceService is not ready either until its decode workers have loaded the model.",
              ("The decode pods: running, ready, restarting? All failing at once points at a shared cause (a bad "
               "rollout, the model volume, the node group).",
               "Breakers (Serving dashboard) and the runtime's log: which workers fail their health checks.",
               "Roll back the last promotion if it coincides (`pdserve promote` canary).")),
        Alert("PdserveKvTransferFailures", "pdserve-kv", "warning",
              "sum(increase(vllm:nixl_num_failed_transfers_total[10m])) > 0", "0m",
              "NIXL KV transfers are failing",
              "A decode worker could not pull a prompt's KV blocks from its prefill worker; vLLM recomputes the "
              "prompt on the decode worker, so answers stay right but TTFT and decode capacity suffer.",
              ("KV/NIXL dashboard: which decode workers fail, and whether transfer time rose before.",
               "Network between the pools: on EFA nodes NIXL must use its LIBFABRIC backend (UCX silently falls "
               "back to TCP); security groups must allow the side-channel and UCX/EFA traffic.",
               "Prefill and decode must agree on dtype, block size and vLLM version (one EngineSpec).")),
        Alert("PdserveKvLeaseExpiries", "pdserve-kv", "warning",
              "(sum(increase(pdserve_kv_lease_expiries_total[10m])) or vector(0))\n"
              "+ (sum(increase(vllm:nixl_num_kv_expired_reqs_total[10m])) or vector(0)) > 0", "5m",
              "KV handoffs expire unread",
              "Decode legs could not start (or show a first token) within the prefill worker's KV lease, so the "
              "decode worker prefilled the request itself: the prefill work was wasted.",
              ("Decode pool saturated? `vllm:num_requests_waiting` on the decode workers; the planner's decode "
               "replicas.",
               "A lease too short for the decode queue: `engine.kv_lease_s` (prefill and runtime agree on it).")),
        Alert("PdserveKvLateReads", "pdserve-kv", "critical",
              "sum(increase(pdserve_kv_late_reads_total[10m])) > 0", "0m",
              "A decode worker may have read released KV blocks",
              "A streamed decode leg's first token came after its handoff's lease ended: the decode worker may "
              "have pulled blocks the prefill worker had already freed, so an answer may be wrong.",
              ("Find the requests in the runtime's log (\"first token after the KV lease ended\") and the prefill "
               "worker's log (\"Potentially invalid KV blocks\").",
               "Lengthen `engine.kv_lease_s` or add decode capacity; the target is 0.")),
        Alert("PdserveRouterIndexStale", "pdserve-router", "warning",
              "max by (worker) (pdserve_router_kv_event_age_seconds) > 600\n"
              "and on() sum(rate(pdserve_prompt_tokens_total[10m])) > 0", "10m",
              "The router has had no KV events from a worker for 10 minutes while serving",
              "The KV-aware router's prefix index for this worker is not being updated: routing decisions use a "
              "stale picture of its cache. A worker the router never chooses also sends no events.",
              ("Is the worker receiving requests (`vllm:prompt_tokens_total` on it)? If yes, its KV-event publisher "
               "or the runtime's subscription is broken: check `--kv-events-config` and the runtime's log.",
               "Restarting the runtime resubscribes; the index rebuilds from new events.")),
        Alert("PdserveRouterIndexResyncs", "pdserve-router", "info",
              "sum by (worker) (increase(pdserve_router_kv_missed_batches_total[15m])) > 0", "0m",
              "KV-event batches were missed: a worker's index entry was rebuilt",
              "Sequence gaps in a worker's KV events: the router cleared its entry for that worker and rebuilds "
              "it; prefix hits drop for a while.",
              ("Frequent gaps: the runtime is too busy to read the events (CPU) or the network drops them.",)),
        Alert("PdservePlannerAtGpuBudget", "pdserve-planner", "warning",
              "pdserve_planner_gpus >= pdserve_planner_gpu_budget", "15m",
              "The planner's decision uses its whole GPU budget",
              "The planner wants all the GPUs it may use; if load grows it cannot add capacity and the SLOs will "
              "be missed.",
              ("Planner dashboard: predicted vs observed rate; is the load real?",
               "Raise `planner.gpu_budget` (and the Karpenter NodePool limits) or shed load.")),
        Alert("PdservePlannerDiverging", "pdserve-planner", "warning",
              "abs(avg_over_time(pdserve_planner_predicted_rate_per_second[30m])\n"
              "  - avg_over_time(pdserve_planner_observed_rate_per_second[30m]))\n"
              "> 0.5 * avg_over_time(pdserve_planner_observed_rate_per_second[30m])\n"
              "and avg_over_time(pdserve_planner_observed_rate_per_second[30m]) > 0", "15m",
              "The planner's predicted request rate is off the observed rate by more than 50 %",
              "Over 30 minutes the planner's predicted rate and the observed rate differ by more than half the "
              "observed rate: it sizes the pools for load that does not come (waste) or misses load that does.",
              ("Planner dashboard: predicted vs observed rate, corrections.",
               "A traffic shape the predictor does not follow (e.g. a new daily pattern): choose another "
               "`planner.predictor` or window.")),
        Alert("PdservePlannerStalled", "pdserve-planner", "warning",
              "increase(pdserve_planner_ticks_total[10m]) == 0", "5m",
              "The planner has not ticked for 10 minutes",
              "The planner loop runs but makes no decisions: the pools no longer follow the load.",
              ("The runtime's log: \"planner tick failed\" with its traceback.",
               "Worker /metrics that do not answer slow each tick down (see the planner's read deadline).")),
        Alert("PdserveWorkerBreakerOpen", "pdserve-workers", "warning",
              "max by (role, worker) (pdserve_worker_breaker_state) == 2", "2m",
              "A worker's circuit breaker is open",
              "The router stopped sending traffic to this worker after consecutive failures or latency outliers; "
              "it probes it and closes the breaker when it answers.",
              ("The worker's pod: restarts, OOM kills, its log.",
               "GPU dashboard: XID errors or throttling on its node.")),
        Alert("PdserveAllDecodeBreakersOpen", "pdserve-workers", "critical",
              # half-open (1) keeps a worker out of rotation as open (2) does, and an open breaker turns half-open
              # at each probe: counting only 2 would reset the alert whenever a scrape meets a probe
              'count(pdserve_worker_breaker_state{role="decode"} >= 1)\n'
              '== count(pdserve_worker_breaker_state{role="decode"})', "1m",
              "Every decode worker's circuit breaker is open or half-open",
              "No decode worker receives traffic (an open breaker, or a half-open one probing): the runtime "
              "answers 503 to every request.",
              ("The decode pods: all failing at once points at a shared cause (a bad rollout, the model volume, "
               "the node group).", "Roll back the last promotion if it coincides (`pdserve promote` canary).")),
        # warning, not info: shed requests are refused users, and shedding is the safety net that keeps the rest
        # within the SLO
        Alert("PdserveRequestsShed", "pdserve-workers", "warning",
              "sum(rate(pdserve_requests_shed_total[5m])) > 0", "10m",
              "Requests are being shed",
              "Requests are refused to protect the service: 429 (reason queue_wait) because their predicted queue "
              "wait would break the TTFT SLO, or 503 (reason breaker_open) because every decode worker's breaker "
              "is open.",
              ("Planner dashboard: is it scaling up? At its GPU budget?",
               "Sustained shedding means capacity is short: raise the budget or the replicas.")),
        Alert("PdserveRuntimeTargetDown", "pdserve-scrape", "warning", f'up{{job=~"{_RUNTIME_JOB}"}} == 0', "5m",
              "Prometheus cannot scrape a runtime pod",
              "A runtime pod's `/metrics` does not answer Prometheus (the PodMonitor `<InferenceService>-runtime` "
              "of `pdserve promote`): the pod is down or overloaded, and its series, and every pdserve alert "
              "reading them, are missing for it.",
              ("The runtime pod: running, restarting, OOM-killed? Its log.",
               "Prometheus' Targets page: the scrape error (timeout, refused, DNS).")),
        Alert("PdserveRuntimeUnmonitored", "pdserve-scrape", "critical",
              f'absent(up{{job=~"{_RUNTIME_JOB}"}} == 1)', "5m",
              "No runtime pod is scraped: the pdserve alerts are blind",
              "Prometheus scrapes no runtime pod successfully: every runtime is down, or the PodMonitor or "
              "Prometheus' selection of it is broken. Either way the other pdserve alerts cannot fire, so an "
              "outage would go unseen. Where no InferenceService is deployed, remove the PrometheusRule.",
              ("`kubectl get pods,podmonitors -n NAMESPACE`: runtime pods and the `<name>-runtime` PodMonitor.",
               "The PodMonitor's `release` label must match the Prometheus' podMonitorSelector "
               "(infra/k8s/prometheus).")),
        Alert("PdservePipelineFailed", "pdserve-pipelines", "warning",
              'sum by (namespace) (increase(argo_workflows_total_count{phase=~"Failed|Error"}[1h])) > 0', "0m",
              "A pipeline or batch workflow failed (staging, tuning, promotion, batch, re-tuning)",
              "An Argo workflow (a Kubeflow pipeline run of stage_tune_promote, or a pdserve batch / re-tune "
              "workflow) ended Failed or Error in the last hour. Prometheus scrapes both workflow-controllers "
              "through the PodMonitors of infra/k8s/prometheus/argo-podmonitors.yaml.",
              ("`kubectl get workflows -n NAMESPACE` and the failed step's pod log.",
               "Staging failures: the S3 source and the FSx mount (space, the marker file); staging is resumable, "
               "so re-running the pipeline continues.")),
    ]
    for a in out:
        assert a.severity in SEVERITIES, a.name
    return out


def prometheus_rule(slo: SloSpec | None = None, runbook_base_url: str = "") -> dict:
    """The PrometheusRule object (monitoring.coreos.com/v1) with every alert of `alerts(slo)`, grouped by
    `Alert.group`, each with `severity` label and `summary`, `description` and `runbook_url` annotations (the
    runbook's section in RUNBOOK_DOC, below `runbook_base_url`: e.g. the repository's web address, so that
    Alertmanager and Grafana show a link that opens)."""
    groups: dict[str, list[dict]] = {}
    for a in alerts(slo):
        groups.setdefault(a.group, []).append({
            "alert": a.name,
            "expr": a.expr,
            "for": a.for_,
            "labels": {"severity": a.severity},
            "annotations": {"summary": a.summary, "description": a.meaning,
                            "runbook_url": f"{runbook_base_url}{RUNBOOK_DOC}#{a.anchor}"},
        })
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": RULE_NAME, "namespace": RULE_NAMESPACE,
                     "labels": {"release": "kube-prometheus-stack", "app.kubernetes.io/part-of": "pdserve"}},
        "spec": {"groups": [{"name": g, "rules": rules} for g, rules in groups.items()]},
    }



def rule_yaml(slo: SloSpec | None = None, runbook_base_url: str = "") -> str:
    """`prometheus_rule(slo)` as YAML (multi-line expressions as literal blocks), as committed in
    infra/k8s/prometheus/pdserve-alerts.yaml."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    head = "# generated by `python -m runtime.docs_gen` from runtime/observability/alerts.py; do not edit by hand\n"
    return head + yaml.dump(prometheus_rule(slo, runbook_base_url), Dumper=_Dumper, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    """`python -m runtime.observability.alerts --ttft-ms MS --itl-ms MS [--out FILE]`: the PrometheusRule for
    other latency SLOs than the committed infra/k8s/prometheus/pdserve-alerts.yaml's (SloSpec's defaults). Each
    threshold must be a bucket bound of its histogram. Returns the exit status (2: a threshold refused)."""
    import argparse
    import sys
    from pathlib import Path

    default = SloSpec()
    ap = argparse.ArgumentParser(
        prog="python -m runtime.observability.alerts",
        description="Write pdserve's alert rules (a prometheus-operator PrometheusRule) for your latency SLOs; "
                    "apply the file in place of infra/k8s/prometheus/pdserve-alerts.yaml.")
    ap.add_argument("--ttft-ms", type=float, default=default.ttft_p90_ms,
                    help=f"TTFT SLO, p90, milliseconds (default {default.ttft_p90_ms:g}); a bucket bound of "
                         "pdserve_ttft_seconds")
    ap.add_argument("--itl-ms", type=float, default=default.itl_p90_ms,
                    help=f"ITL SLO, p90, milliseconds (default {default.itl_p90_ms:g}); a bucket bound of "
                         "pdserve_itl_seconds")
    ap.add_argument("--runbook-base-url", default="",
                    help=f"prefix of each alert's runbook_url, ending in '/', before {RUNBOOK_DOC}#<alert> (e.g. "
                         "https://github.com/ORG/pdserve/blob/main/): Alertmanager and Grafana then link to the "
                         "runbook (default: the path in the repository)")
    ap.add_argument("--out", type=Path, default=None, help="write the YAML here (default: standard output)")
    a = ap.parse_args(argv)
    if a.runbook_base_url and not (a.runbook_base_url.startswith(("https://", "http://"))
                                   and a.runbook_base_url.endswith("/")):
        print(f"error: --runbook-base-url must be an http(s) URL ending in '/', got {a.runbook_base_url!r}",
              file=sys.stderr)
        return 2
    try:
        text = rule_yaml(SloSpec(ttft_p90_ms=a.ttft_ms, itl_p90_ms=a.itl_ms), a.runbook_base_url)
    except ValueError as exc:  # not a bucket bound, or not a number > 0 (pydantic's ValidationError)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base = f" --runbook-base-url {a.runbook_base_url}" if a.runbook_base_url else ""
    text = text.replace("# generated by `python -m runtime.docs_gen`",
                        f"# generated by `python -m runtime.observability.alerts --ttft-ms {a.ttft_ms:g} "
                        f"--itl-ms {a.itl_ms:g}{base}`", 1)
    if a.out is None:
        sys.stdout.write(text)
    else:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
