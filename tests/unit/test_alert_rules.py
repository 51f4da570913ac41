"""The PrometheusRule of runtime/observability/alerts.py under `promtool test rules`: for every alert a case
with synthetic series where it fires and one where it stays silent. Needs Debian's `prometheus` package
(promtool); CI installs it (.ci/run)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from runtime.config import SloSpec
from runtime.observability import alerts as al
from runtime.server.metrics import catalog

PROMTOOL = shutil.which("promtool")
# skipped only where promtool is absent and not required (CI sets PDSERVE_REQUIRE_PROMETHEUS=1: .ci/run)
needs_promtool = pytest.mark.skipif(PROMTOOL is None and not os.environ.get("PDSERVE_REQUIRE_PROMETHEUS"),
                                    reason="promtool not installed (apt-get install prometheus)")


def _promtool() -> str:
    assert PROMTOOL, "PDSERVE_REQUIRE_PROMETHEUS is set but promtool is not on PATH (apt-get install prometheus)"
    return PROMTOOL

REMOTE = '{endpoint="chat",mode="remote"}'


def _latency(metric: str, per_min: float, good_per_min: float, le: str, minutes: int = 420) -> dict[str, str]:
    """A histogram's count and its `le` bucket growing by `per_min` and `good_per_min` requests a minute."""
    return {f"{metric}_count{REMOTE}": f"0+{per_min}x{minutes}",
            f'{metric}_bucket{{endpoint="chat",mode="remote",le="{le}"}}': f"0+{good_per_min}x{minutes}"}


TTFT_LE, ITL_LE = al._le(SloSpec().ttft_p90_ms / 1000), al._le(SloSpec().itl_p90_ms / 1000)
GOOD_ITL = _latency("pdserve_itl_seconds", 10, 9.9, ITL_LE)
GOOD_TTFT = _latency("pdserve_ttft_seconds", 10, 9.9, TTFT_LE)

# (series, eval time, {alert: [extra labels of each firing alert]}); an alert with [] must stay silent there.
CASES = [
    ({**_latency("pdserve_ttft_seconds", 10, 2, TTFT_LE), **GOOD_ITL}, "70m",
     {"PdserveTtftBudgetBurnFast": [{}], "PdserveTtftBudgetBurnSlow": [{}],
      "PdserveItlBudgetBurnFast": [], "PdserveItlBudgetBurnSlow": []}),
    ({**_latency("pdserve_ttft_seconds", 10, 7, TTFT_LE), **_latency("pdserve_itl_seconds", 10, 7, ITL_LE)}, "70m",
     {"PdserveTtftBudgetBurnFast": [], "PdserveTtftBudgetBurnSlow": [{}],
      "PdserveItlBudgetBurnFast": [], "PdserveItlBudgetBurnSlow": [{}]}),
    ({**GOOD_TTFT, **_latency("pdserve_itl_seconds", 10, 1, ITL_LE)}, "70m",
     {"PdserveItlBudgetBurnFast": [{}], "PdserveItlBudgetBurnSlow": [{}],
      "PdserveTtftBudgetBurnFast": [], "PdserveTtftBudgetBurnSlow": []}),
    ({'pdserve_requests_total{endpoint="chat",mode="remote",status="error"}': "0+1x60",
      'pdserve_requests_total{endpoint="chat",mode="remote",status="ok"}': "0+9x60"}, "40m",
     {"PdserveErrorRateHigh": [{}], "PdserveErrorRateElevated": [{}]}),
    ({'pdserve_requests_total{endpoint="chat",mode="remote",status="error"}': "0+0.2x60",
      'pdserve_requests_total{endpoint="chat",mode="remote",status="ok"}': "0+9.8x60"}, "40m",
     {"PdserveErrorRateHigh": [], "PdserveErrorRateElevated": [{}]}),
    ({'pdserve_requests_total{endpoint="chat",mode="remote",status="error"}': "0+0.05x60",
      'pdserve_requests_total{endpoint="chat",mode="remote",status="ok"}': "0+99.95x60"}, "40m",
     {"PdserveErrorRateHigh": [], "PdserveErrorRateElevated": []}),
    # a total outage: every request a 503 at the edge (mode none, status error), every replica not ready; another
    # InferenceService with one ready replica of two stays silent
    ({'pdserve_requests_total{endpoint="chat",mode="remote",status="ok"}': "0+10x20 200x40",
      'pdserve_requests_total{endpoint="chat",mode="none",status="error"}': "0x20 0+10x40",
      'pdserve_ready{namespace="pdserve",job="pdserve/m-runtime",instance="a"}': "1x20 0x40",
      'pdserve_ready{namespace="pdserve",job="pdserve/m-runtime",instance="b"}': "1x20 0x40",
      'pdserve_ready{namespace="pdserve",job="pdserve/n-runtime",instance="c"}': "1x60",
      'pdserve_ready{namespace="pdserve",job="pdserve/n-runtime",instance="d"}': "0x60"}, "40m",
     {"PdserveErrorRateHigh": [{}], "PdserveErrorRateElevated": [{}],
      "PdserveNotReady": [{"namespace": "pdserve", "job": "pdserve/m-runtime"}]}),
    ({'pdserve_ready{namespace="pdserve",job="pdserve/m-runtime",instance="a"}': "1x60"}, "40m",
     {"PdserveNotReady": []}),
    # clients' own faults and cancellations neither page nor dilute the service's errors: 0.6 errors in 10
    # served requests (6 %) fire the critical alert although 5 more a minute were the clients' faults
    ({'pdserve_requests_total{endpoint="chat",mode="remote",status="error"}': "0+0.6x60",
      'pdserve_requests_total{endpoint="chat",mode="remote",status="ok"}': "0+9.4x60",
      'pdserve_requests_total{endpoint="chat",mode="local",status="client_error"}': "0+3x60",
      'pdserve_requests_total{endpoint="chat",mode="remote",status="cancelled"}': "0+2x60"}, "40m",
     {"PdserveErrorRateHigh": [{}], "PdserveErrorRateElevated": [{}]}),
    ({'pdserve_requests_total{endpoint="chat",mode="remote",status="ok"}': "0+5x60",
      'pdserve_requests_total{endpoint="chat",mode="local",status="client_error"}': "0+3x60",
      'pdserve_requests_total{endpoint="chat",mode="remote",status="cancelled"}': "0+2x60"}, "40m",
     {"PdserveErrorRateHigh": [], "PdserveErrorRateElevated": []}),
    # scrape targets: one runtime pod of two down (another job's target down is not pdserve's)
    ({'up{job="pdserve/m-runtime",instance="10.0.0.1:8080"}': "1x10 0x30",
      'up{job="pdserve/m-runtime",instance="10.0.0.2:8080"}': "1x40",
      'up{job="monitoring/node-exporter",instance="10.0.1.1:9100"}': "0x40"}, "30m",
     {"PdserveRuntimeTargetDown": [{"job": "pdserve/m-runtime", "instance": "10.0.0.1:8080"}],
      "PdserveRuntimeUnmonitored": []}),
    ({'up{job="pdserve/m-runtime",instance="10.0.0.1:8080"}': "1x10 0x30"}, "30m",
     {"PdserveRuntimeTargetDown": [{"job": "pdserve/m-runtime", "instance": "10.0.0.1:8080"}],
      "PdserveRuntimeUnmonitored": [{}]}),
    ({'up{job="monitoring/node-exporter",instance="10.0.1.1:9100"}': "1x40"}, "30m",  # no runtime target at all
     {"PdserveRuntimeTargetDown": [], "PdserveRuntimeUnmonitored": [{}]}),
    ({'vllm:nixl_num_failed_transfers_total{model_name="m"}': "0x30 1x30",
      "pdserve_kv_lease_expiries_total": "0x20 1+1x20", "pdserve_kv_late_reads_total": "0x60"}, "35m",
     {"PdserveKvTransferFailures": [{}], "PdserveKvLeaseExpiries": [{}], "PdserveKvLateReads": []}),
    ({'vllm:nixl_num_failed_transfers_total{model_name="m"}': "0x60", "pdserve_kv_lease_expiries_total": "0x60",
      'vllm:nixl_num_kv_expired_reqs_total{model_name="m"}': "0x60", "pdserve_kv_late_reads_total": "0x10 1x50"},
     "15m", {"PdserveKvTransferFailures": [], "PdserveKvLeaseExpiries": [], "PdserveKvLateReads": [{}]}),
    ({'vllm:nixl_num_kv_expired_reqs_total{model_name="m"}': "0x20 2x40"}, "30m",
     {"PdserveKvLeaseExpiries": [{}]}),
    ({'pdserve_router_kv_event_age_seconds{worker="prefill-0"}': "0+60x60",
      'pdserve_router_kv_event_age_seconds{worker="decode-0"}': "5x60", "pdserve_prompt_tokens_total": "0+100x60",
      'pdserve_router_kv_missed_batches_total{worker="decode-0"}': "0x20 3x40",
      'pdserve_router_kv_missed_batches_total{worker="prefill-0"}': "0x60"}, "30m",
     {"PdserveRouterIndexStale": [{"worker": "prefill-0"}], "PdserveRouterIndexResyncs": [{"worker": "decode-0"}]}),
    ({'pdserve_router_kv_event_age_seconds{worker="prefill-0"}': "0+60x60", "pdserve_prompt_tokens_total": "0x60",
      'pdserve_router_kv_missed_batches_total{worker="prefill-0"}': "0x60"}, "30m",
     {"PdserveRouterIndexStale": [], "PdserveRouterIndexResyncs": []}),
    ({"pdserve_planner_gpus": "8x60", "pdserve_planner_gpu_budget": "8x60",
      "pdserve_planner_predicted_rate_per_second": "10x60", "pdserve_planner_observed_rate_per_second": "4x60",
      "pdserve_planner_ticks_total": "0+1x10 10x50"}, "50m",
     {"PdservePlannerAtGpuBudget": [{}], "PdservePlannerDiverging": [{}], "PdservePlannerStalled": [{}]}),
    ({"pdserve_planner_gpus": "6x60", "pdserve_planner_gpu_budget": "8x60",
      "pdserve_planner_predicted_rate_per_second": "5x60", "pdserve_planner_observed_rate_per_second": "4x60",
      "pdserve_planner_ticks_total": "0+1x60"}, "50m",
     {"PdservePlannerAtGpuBudget": [], "PdservePlannerDiverging": [], "PdservePlannerStalled": []}),
    ({"pdserve_planner_predicted_rate_per_second": "1x60", "pdserve_planner_observed_rate_per_second": "0x60"},
     "50m", {"PdservePlannerDiverging": []}),
    ({'pdserve_worker_breaker_state{role="prefill",worker="prefill-0"}': "0x5 2x25",
      'pdserve_worker_breaker_state{role="decode",worker="decode-0"}': "0x30",
      'pdserve_worker_breaker_state{role="decode",worker="decode-1"}': "1x30",
      'pdserve_requests_shed_total{reason="queue_wait",priority="normal"}': "0x30"}, "20m",
     {"PdserveWorkerBreakerOpen": [{"role": "prefill", "worker": "prefill-0"}], "PdserveAllDecodeBreakersOpen": [],
      "PdserveRequestsShed": []}),
    ({'pdserve_worker_breaker_state{role="decode",worker="decode-0"}': "2x30",
      'pdserve_worker_breaker_state{role="decode",worker="decode-1"}': "2x30",
      'pdserve_requests_shed_total{reason="queue_wait",priority="normal"}': "0+5x30"}, "20m",
     {"PdserveWorkerBreakerOpen": [{"role": "decode", "worker": "decode-0"}, {"role": "decode", "worker": "decode-1"}],
      "PdserveAllDecodeBreakersOpen": [{}], "PdserveRequestsShed": [{}]}),
    # the only decode worker half-open (probing, out of rotation) for 30 minutes: no decode worker serves
    ({'pdserve_worker_breaker_state{role="decode",worker="decode-0"}': "1x30",
      'pdserve_worker_breaker_state{role="prefill",worker="prefill-0"}': "0x30"}, "20m",
     {"PdserveWorkerBreakerOpen": [], "PdserveAllDecodeBreakersOpen": [{}]}),
    ({'argo_workflows_total_count{namespace="kubeflow",phase="Failed"}': "0x10 1x20",
      'argo_workflows_total_count{namespace="pdserve",phase="Succeeded"}': "0+1x30"}, "15m",
     {"PdservePipelineFailed": [{"namespace": "kubeflow"}]}),
    ({'argo_workflows_total_count{namespace="pdserve",phase="Succeeded"}': "0+1x30",
      'argo_workflows_total_count{namespace="kubeflow",phase="Running"}': "0+1x30"}, "15m",
     {"PdservePipelineFailed": []}),
]


def _rules_file() -> dict:
    return {"groups": al.prometheus_rule()["spec"]["groups"]}


def _test_file() -> dict:
    by_name = {a.name: a for a in al.alerts()}
    tests = []
    for series, at, expect in CASES:
        tests.append({
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": [{
                "eval_time": at, "alertname": name,
                "exp_alerts": [{"exp_labels": {**labels, "severity": by_name[name].severity},
                                "exp_annotations": {"summary": by_name[name].summary,
                                                    "description": by_name[name].meaning,
                                                    "runbook_url": f"{al.RUNBOOK_DOC}#{by_name[name].anchor}"}}
                               for labels in fired],
            } for name, fired in expect.items()],
        })
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_is_silent():
    fires = {n for _, _, e in CASES for n, f in e.items() if f}
    silent = {n for _, _, e in CASES for n, f in e.items() if not f}
    names = {a.name for a in al.alerts()}
    assert names - fires == set() and names - silent == set()
    assert {a.severity for a in al.alerts()} == set(al.SEVERITIES)


def test_alerts_read_only_catalogued_metrics():
    """Every metric an alert reads is in the catalog, or is Argo's workflow counter."""
    known = {m.name for m in catalog()} | {"argo_workflows_total_count", "up"}  # up: Prometheus' own, per target
    for a in al.alerts():
        used = set(re.findall(r"\b(?:pdserve_|vllm:|DCGM_|argo_)[A-Za-z0-9_:]*|\bup(?=\{)", a.expr))
        unknown = {m for m in used if m not in known and re.sub(r"_(bucket|count)$", "", m) not in known}
        assert used and not unknown, (a.name, unknown)


def test_an_slo_off_the_histogram_buckets_is_refused():
    with pytest.raises(ValueError, match="not a bucket bound of pdserve_ttft_seconds"):
        al.alerts(SloSpec(ttft_p90_ms=1234))


@needs_promtool
def test_rules_pass_promtool_check(tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_rules_file()))
    r = subprocess.run([_promtool(), "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_unit_tests(tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_rules_file()))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(_test_file(), sort_keys=False))
    r = subprocess.run([_promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]


@needs_promtool
def test_promtool_tests_can_fail(tmp_path):
    """A case claiming a silent alert fires must fail under promtool (the harness is not vacuous)."""
    doc = _test_file()
    doc["tests"] = [doc["tests"][-1]]
    doc["tests"][0]["alert_rule_test"][0]["exp_alerts"] = [{"exp_labels": {"severity": "warning"}}]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_rules_file()))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run([_promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0


def test_rules_for_other_slos_are_written_by_the_module_and_a_threshold_off_the_buckets_is_refused(tmp_path, capsys):
    import yaml

    from runtime.observability.alerts import main

    out = tmp_path / "rules.yaml"
    assert main(["--ttft-ms", "1000", "--itl-ms", "35", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# generated by `python -m runtime.observability.alerts --ttft-ms 1000 --itl-ms 35`")
    rule = yaml.safe_load(text)
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert any('pdserve_ttft_seconds_bucket{le="1.0"}' in e for e in exprs)
    assert any('pdserve_itl_seconds_bucket{le="0.035"}' in e for e in exprs)
    assert not any('le="2.0"' in e or 'le="0.05"' in e for e in exprs)  # nothing left at the defaults
    assert main(["--ttft-ms", "1500"]) == 2
    assert "not a bucket bound of pdserve_ttft_seconds" in capsys.readouterr().err
    assert main(["--itl-ms", "-5"]) == 2
    linked = tmp_path / "linked.yaml"
    assert main(["--runbook-base-url", "https://git.example/pdserve/blob/main/", "--out", str(linked)]) == 0
    urls = {r["annotations"]["runbook_url"] for g in yaml.safe_load(linked.read_text())["spec"]["groups"]
            for r in g["rules"]}
    assert urls and all(u.startswith("https://git.example/pdserve/blob/main/docs/operations.md#pdserve") for u in urls)
    assert main(["--runbook-base-url", "git.example/x"]) == 2


def _flapping_outage(shift: int, workers: int = 3, samples: int = 180) -> dict[str, str]:
    """Decode breakers through an outage, one sample per 15 s scrape: closed for 75 s, then open (2) with a
    half-open probe (1) every fourth scrape, each worker's probe at another phase (`shift` moves them all)."""
    cycle = (2, 2, 1, 2)
    return {f'pdserve_worker_breaker_state{{role="decode",worker="decode-{k}"}}':
            " ".join(["0"] * 5 + [str(cycle[(i + shift + k) % 4]) for i in range(samples - 5)])
            for k in range(workers)}


@needs_promtool
@pytest.mark.parametrize("shift", range(4))
def test_all_decode_breakers_alert_fires_through_a_flapping_outage(tmp_path, shift):
    """Half-open breakers are out of rotation too: PdserveAllDecodeBreakersOpen fires from its `for` after the
    outage began to the end, whatever scrape meets a probe (an alert on "every breaker == 2" resets at each)."""
    rule = next(a for a in al.alerts() if a.name == "PdserveAllDecodeBreakersOpen")
    case = {"interval": "15s",
            "input_series": [{"series": s, "values": v} for s, v in _flapping_outage(shift).items()],
            "alert_rule_test": [{"eval_time": f"{m}m", "alertname": rule.name,
                                 "exp_alerts": [{"exp_labels": {"severity": "critical"}, "exp_annotations": {
                                     "summary": rule.summary, "description": rule.meaning,
                                     "runbook_url": f"{al.RUNBOOK_DOC}#{rule.anchor}"}}] if m >= 3 else []}
                                for m in range(1, 45)]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_rules_file()))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "15s",
                                                        "tests": [case]}, sort_keys=False))
    r = subprocess.run([_promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
