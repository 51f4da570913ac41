"""Calibration: the least-squares fit is reproducible, stays in bounds, and its output is importable data."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from runtime.paths import data_dir
from runtime.perf import fitted
from runtime.perf.calibration import DEFAULT, efficiency_for
from runtime.perf.fit import MIN_ROWS, fit_csv, main, render

SAMPLE = data_dir() / "perf" / "aiconfigurator_silicon_sample.csv"


@pytest.fixture(scope="module")
def small_csv(tmp_path_factory) -> Path:
    """Real rows: H200 fp8 Llama-3.1-70B / Llama-3.1-8B aggregated measurements."""
    with SAMPLE.open() as f:
        reader = csv.DictReader(f)
        rows = [r for r in reader if r["system"] == "h200_sxm" and r["mode"] == "agg"
                and r["model_path"] in ("meta-llama/Llama-3.1-70B", "nvidia/Llama-3.1-8B-Instruct-FP8")]
        fields = reader.fieldnames
    p = tmp_path_factory.mktemp("fit") / "sample.csv"
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    assert len(rows) > MIN_ROWS
    return p


def test_fit_is_deterministic_bounded_and_reports_residuals(small_csv):
    a, ra = fit_csv(small_csv)
    b, rb = fit_csv(small_csv)
    assert a == b and ra == rb
    eff = a[("H200-SXM", "fp8")]
    assert 0 < eff.compute <= 1 and 0 < eff.memory <= 1 and 0 < eff.comm <= 1
    assert eff.decode_step_overhead_s >= 0 and eff.prefill_overhead_s >= 0
    res = ra[("H200-SXM", "fp8")]
    assert res["tpot_rows"] > 0 and res["ttft_rows"] > 0
    assert 0 <= res["tpot_median_abs_pct_error"] <= res["tpot_p90_abs_pct_error"]


def test_rendered_module_round_trips(small_csv):
    fit, res = fit_csv(small_csv)
    ns: dict = {}
    exec(render(fit, res, small_csv.name), ns)  # noqa: S102 - our own generated data module
    assert ns["FITTED"] == fit and ns["RESIDUALS"] == res


def test_command_writes_the_module(small_csv, tmp_path):
    out = tmp_path / "fitted.py"
    assert main(["--csv", str(small_csv), "--out", str(out)]) == 0
    assert "FITTED" in out.read_text() and "H200-SXM" in out.read_text()


def test_shipped_fitted_data_covers_hopper_and_blackwell():
    assert ("H100-SXM", "fp8") in fitted.FITTED and ("B200-SXM", "fp8") in fitted.FITTED
    for key, stats in fitted.RESIDUALS.items():
        assert key in fitted.FITTED and stats["rows"] >= MIN_ROWS


def test_efficiency_lookup_order():
    assert efficiency_for("H100-SXM", "fp8") == fitted.FITTED[("H100-SXM", "fp8")]
    assert efficiency_for("CPU", "bf16").source.startswith("defaults for the measured CPU")
    l40s = efficiency_for("L40S", "fp8")  # no L40S measurements: transferred from H100
    assert "transferred from the H100-SXM" in l40s.source
    assert l40s.compute == fitted.FITTED[("H100-SXM", "fp8")].compute
    assert efficiency_for("A100-SXM-80GB", "fp16") == efficiency_for("A100-SXM-80GB", "bf16")
    assert DEFAULT.memory == 0.8
