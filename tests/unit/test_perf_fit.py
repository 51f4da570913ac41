"""Calibration: the pooled least-squares fit is reproducible, stays in bounds, leaves out what the model does
not describe, and its output is importable data looked up per compute class and serving backend."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from runtime.paths import data_dir
from runtime.perf import fitted
from runtime.perf.calibration import DEFAULT, compute_class, efficiency_for
from runtime.perf.fit import MIN_ROWS, fit_csv, main, observations, render
from runtime.perf.gpus import get_gpu
from runtime.models.load import load_model_spec

SAMPLE = data_dir() / "perf" / "aiconfigurator_silicon_sample.csv"
L70 = load_model_spec(data_dir() / "models" / "meta-llama--Meta-Llama-3.1-70B_config.json")


def _rows(pred) -> tuple[list[dict], list[str]]:
    with SAMPLE.open() as f:
        reader = csv.DictReader(f)
        return [r for r in reader if pred(r)], reader.fieldnames


@pytest.fixture(scope="module")
def small_csv(tmp_path_factory) -> Path:
    """Real rows: H200 Llama-3.1-70B / Llama-3.1-8B aggregated measurements (vLLM and TensorRT-LLM, fp8)."""
    rows, fields = _rows(lambda r: r["system"] == "h200_sxm" and r["mode"] == "agg"
                         and r["model_path"] in ("meta-llama/Llama-3.1-70B", "nvidia/Llama-3.1-8B-Instruct-FP8"))
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
    assert set(a) == {("*", "fp8", "trtllm"), ("*", "fp8", "vllm")}
    vllm, trt = a[("*", "fp8", "vllm")], a[("*", "fp8", "trtllm")]
    for eff in (vllm, trt):
        assert 0 < eff.compute <= 1 and 0 < eff.memory <= 1 and 0 < eff.comm <= 1 and 0 < eff.attention <= 1
        assert eff.decode_step_overhead_s >= 0 and eff.prefill_overhead_s >= 0 and eff.decode_seq_overhead_s >= 0
    # pooled: GPU-side factors are shared, only the backend overheads differ
    assert (vllm.compute, vllm.memory, vllm.kv_memory) == (trt.compute, trt.memory, trt.kv_memory)
    res = ra[("H200-SXM", "fp8", "vllm")]
    assert res["tpot_rows"] > 0 and res["ttft_rows"] > 0
    assert 0 <= res["tpot_median_abs_pct_error"] <= res["tpot_p90_abs_pct_error"]
    assert ra[("*", "*", "*")]["rows"] == sum(s["rows"] for k, s in ra.items() if k != ("*", "*", "*"))


def test_rows_the_model_does_not_describe_are_left_out():
    rows, _ = _rows(lambda r: r["model_path"] == "meta-llama/Llama-3.1-70B" and r["system"] == "h200_sxm"
                    and r["mode"] == "agg")
    row = dict(rows[0])
    assert len(observations(row, L70)) == 2  # steady-state TPOT + TTFT
    assert observations({**row, "attention_dp_size": "4"}, L70) == []  # attention data parallelism
    assert observations({**row, "tp_size": "16"}, L70) == []  # wider than one 8-GPU node
    assert observations({**row, "gemm_quant_mode": "int4_wo"}, L70) == []  # format not modelled


def test_rendered_module_round_trips(small_csv):
    fit, res = fit_csv(small_csv)
    ns: dict = {}
    exec(render(fit, res, small_csv.name), ns)  # noqa: S102 - our own generated data module
    assert ns["FITTED"] == fit and ns["RESIDUALS"] == res


def test_command_writes_the_module(small_csv, tmp_path):
    out = tmp_path / "fitted.py"
    assert main(["--csv", str(small_csv), "--out", str(out), "--measured"]) == 0
    text = out.read_text()
    assert "FITTED" in text and "'trtllm'" in text and "H200-SXM" in text


def test_shipped_fitted_data_covers_every_class_and_backend():
    for cls in ("bf16", "fp8", "fp4"):
        for backend in ("vllm", "sglang", "trtllm"):
            assert ("*", cls, backend) in fitted.FITTED
    for key, stats in fitted.RESIDUALS.items():
        assert stats["rows"] >= 1 and len(key) == 3


def test_compute_class_follows_the_tensor_cores():
    assert compute_class(get_gpu("A100-SXM-80GB"), "fp8") == "bf16"  # no FP8 tensor cores
    assert compute_class(get_gpu("H100-SXM"), "fp4") == "fp8"  # no FP4 tensor cores
    assert compute_class(get_gpu("B200-SXM"), "fp4") == "fp4"
    assert compute_class(get_gpu("L40S"), "fp16") == "bf16"


def test_efficiency_lookup_order():
    assert efficiency_for("H100-SXM", "fp8") == fitted.FITTED[("*", "fp8", "vllm")]
    assert efficiency_for("H100-SXM", "fp8", "trtllm") == fitted.FITTED[("*", "fp8", "trtllm")]
    assert efficiency_for("L40S", "fp8").compute == fitted.FITTED[("*", "fp8", "vllm")].compute
    assert efficiency_for("A100-SXM-80GB", "fp8") == efficiency_for("A100-SXM-80GB", "bf16")
    assert efficiency_for("A100-SXM-80GB", "fp16") == efficiency_for("A100-SXM-80GB", "bf16")
    assert efficiency_for("CPU", "fp32") == fitted.FITTED[("CPU", "fp32", "vllm")]
    assert efficiency_for("CPU", "bf16").source.startswith("defaults for the measured CPU")
    other = efficiency_for("H100-SXM", "fp8", "some-engine")
    assert other.compute == fitted.FITTED[("*", "fp8", "vllm")].compute and "none fitted" in other.source
    assert DEFAULT.memory == 0.8
