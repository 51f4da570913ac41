"""bench/gpu_calibrate.py end to end on the CPU (the GPU run is the same code with --device cuda): the committed
plan is what `plan` writes today, `measure --quick` times and records every case, `analyse` fits the CSV."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_calibrate.py"


def _run(*args: str, timeout: float = 300) -> dict:
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_committed_plan_is_what_plan_writes(tmp_path):
    out = _run("plan", "--out", str(tmp_path / "plan.json"))
    assert out["cases"] > 1000
    assert json.loads((tmp_path / "plan.json").read_text()) == \
        json.loads((ROOT / "bench" / "gpu_calibration_plan.json").read_text())


def test_measure_quick_on_the_cpu_then_analyse(tmp_path):
    pytest.importorskip("torch")
    info = _run("measure", "--device", "cpu", "--quick", "--target-s", "0.005", "--out-csv", str(tmp_path / "m.csv"))
    assert info["device"] == "cpu" and info["timed"] + info["skipped"] == info["cases"] and info["timed"] >= 8
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert len(rows) == info["cases"]
    assert all(float(r["time_s"]) > 0 for r in rows if not r["skipped"])
    result = _run("analyse", str(tmp_path / "m.csv"), "--gpu", "CPU", "--out", str(tmp_path / "fit.json"))
    assert result["fit"]["gemm"]["bf16"]["rows"] == 4
    assert 0 < result["fit"]["memory"] <= 1
    assert result["vs_model"]["bf16.compute"]["model"] == pytest.approx(0.8)
    assert json.loads((tmp_path / "fit.json").read_text()) == result


def test_measure_stops_at_its_budget_and_keeps_the_header(tmp_path):
    pytest.importorskip("torch")
    info = _run("measure", "--device", "cpu", "--quick", "--budget-s", "0", "--out-csv", str(tmp_path / "m.csv"))
    assert info["timed"] == 0 and info["not_reached"] == info["cases"]
    assert (tmp_path / "m.csv").read_text().startswith("kind,dtype,m,n,k")


def test_analyse_refuses_a_csv_without_copy_rows_in_one_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("kind,dtype,m,n,k,time_s\ngemm,bf16,1,8,8,0.001\n")
    res = subprocess.run([sys.executable, str(SCRIPT), "analyse", str(bad), "--gpu", "H200-SXM"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == f"analyse: {bad}: H200-SXM: no copy rows: the memory efficiency every other fit " \
                                 "needs is missing"
    res = subprocess.run([sys.executable, str(SCRIPT), "analyse", str(bad), "--gpu", "H900"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "unknown GPU 'H900'" in res.stderr and "Traceback" not in res.stderr
