"""The Grafana dashboards (runtime.observability.dashboards): well-formed models, only catalogued metrics,
PromQL that Prometheus parses, and the committed files in infra/ current."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from runtime import docs_gen
from runtime.observability import dashboards as db
from runtime.server.metrics import catalog

PROMTOOL = shutil.which("promtool")


def test_four_dashboards_with_unique_uids_and_panel_ids():
    ds = db.dashboards()
    assert [d["uid"] for d in ds] == ["pdserve-serving", "pdserve-planner", "pdserve-kv", "pdserve-gpus"]
    for d in ds:
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)) and all(p["targets"] for p in d["panels"]), d["uid"]
        for p in d["panels"]:
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        assert d["templating"]["list"][0]["name"] == "datasource"


def test_dcgm_frame_buffer_panels_read_mebibytes():
    # DCGM_FI_DEV_FB_USED / _FREE are MiB; Grafana's "decmbytes" would show them 4.9 % low
    for title, unit, queries in db.GPUS:
        if any("DCGM_FI_DEV_FB_" in q for q, _ in queries):
            assert unit == "mbytes", title


def test_every_query_reads_catalogued_metrics_only():
    known = {m.name for m in catalog()}
    for uid, title, expr in db.panel_queries():
        used = db.query_metrics(expr)
        assert used and used <= known, (uid, title, used - known)
    gpu = {n for uid, _, e in db.panel_queries() if uid == "pdserve-gpus" for n in db.query_metrics(e)}
    assert gpu == {m.name for m in catalog() if m.source == "DCGM exporter"}


def test_query_metrics_names_families():
    assert db.query_metrics("rate(vllm:nixl_xfer_time_seconds_bucket[5m]) / pdserve_prompt_tokens_total") == {
        "vllm:nixl_xfer_time_seconds", "pdserve_prompt_tokens_total"}


@pytest.mark.skipif(PROMTOOL is None and not os.environ.get("PDSERVE_REQUIRE_PROMETHEUS"),
                    reason="promtool not installed (apt-get install prometheus)")
def test_every_query_parses(tmp_path):
    assert PROMTOOL, "promtool required (PDSERVE_REQUIRE_PROMETHEUS) but not on PATH"
    rules = [{"record": f"pdserve:panel_{i}", "expr": e} for i, (_, _, e) in enumerate(db.panel_queries())]
    (tmp_path / "q.yaml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    r = subprocess.run([PROMTOOL, "check", "rules", "q.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "x:y", "expr": "sum(rate(x[5m])"}]}]}))
    assert subprocess.run([PROMTOOL, "check", "rules", "bad.yaml"], cwd=tmp_path, capture_output=True,
                          timeout=120).returncode != 0


def test_committed_monitoring_files_are_current():
    assert docs_gen.stale_artifacts() == [], "run `python -m runtime.docs_gen` and commit the result"
    kust = yaml.safe_load((docs_gen.ROOT / db.PROMETHEUS_DIR / db.DASHBOARD_DIR / "kustomization.yaml").read_text())
    gen = kust["configMapGenerator"][0]
    assert gen["options"]["labels"]["grafana_dashboard"] == "1"
    for f in gen["files"]:
        assert json.loads((docs_gen.ROOT / db.PROMETHEUS_DIR / db.DASHBOARD_DIR / f).read_text())["panels"]
    top = yaml.safe_load((docs_gen.ROOT / db.PROMETHEUS_DIR / "kustomization.yaml").read_text())
    assert {db.RULES_FILE, db.DASHBOARD_DIR} <= set(top["resources"])


def test_a_stale_monitoring_file_is_named(tmp_path):
    for rel, make in db.artifacts().items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(make())
    assert docs_gen.stale_artifacts(tmp_path) == []
    (tmp_path / db.PROMETHEUS_DIR / db.RULES_FILE).write_text("old\n")
    assert docs_gen.stale_artifacts(tmp_path) == [f"{db.PROMETHEUS_DIR}/{db.RULES_FILE}"]
