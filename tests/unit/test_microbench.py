"""runtime.perf.microbench: the GPU calibration plan's shapes and the fit that turns kernel timings into the
performance model's efficiencies (recovered from synthetic timings generated with known factors)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.modelfiles.load import load_model_spec
from runtime.perf.calibration import Efficiency
from runtime.perf.gpus import get_gpu
from runtime.perf.microbench import (
    MicrobenchError, attention_flops_bytes, calibration_plan, compare_with_model, fit_microbench,
    gemm_flops_bytes, gemm_shapes,
)

MODELS = CATALOG_DIR


@pytest.fixture(scope="module")
def llama70b():
    return load_model_spec(MODELS / "meta-llama--Meta-Llama-3.1-70B_config.json")


def test_gemm_shapes_of_llama_70b_at_tp8_by_hand(llama70b):
    # 64 query heads, 8 KV heads, head_dim 128, hidden 8192, FFN 28672: per rank 8 q + 1 k + 1 v heads
    assert gemm_shapes(llama70b, 8) == [("qkv", (8 + 2) * 128, 8192), ("o", 8192, 8 * 128),
                                        ("gate_up", 2 * 28672 // 8, 8192), ("down", 8192, 28672 // 8)]
    # more TP never widens a rank's GEMM
    for (_, n1, k1), (_, n2, k2) in zip(gemm_shapes(llama70b, 2), gemm_shapes(llama70b, 4)):
        assert n2 * k2 <= n1 * k1


def test_gemm_shapes_refuse_mla_and_tp_not_dividing_heads(llama70b):
    with pytest.raises(ValueError, match="does not divide 64"):
        gemm_shapes(llama70b, 3)
    with pytest.raises(ValueError, match="MLA"):
        gemm_shapes(load_model_spec(MODELS / "deepseek-ai--DeepSeek-V3_config.json"), 8)


def test_plan_covers_every_tp_dtype_and_kind_once(llama70b):
    scout = load_model_spec(MODELS / "meta-llama--Llama-4-Scout-17B-16E-Instruct_config.json")
    cases = calibration_plan([llama70b, scout, llama70b], tps=(1, 8), ms=(1, 64))
    keys = [tuple(sorted((k, v) for k, v in c.items() if k != "label")) for c in cases]
    assert len(keys) == len(set(keys))  # the repeated model adds nothing
    assert {c["kind"] for c in cases} == {"gemm", "grouped_gemm", "decode_attn", "prefill_attn", "copy"}
    fp8_rows = {c["m"] for c in cases if c["kind"] == "gemm" and c["dtype"] == "fp8"}
    assert fp8_rows == {16, 64}  # rounded up to the 16-row multiple torch._scaled_mm takes
    assert {c["m"] for c in cases if c["kind"] == "gemm" and c["dtype"] == "bf16"} == {1, 64}
    assert any(c["kind"] == "grouped_gemm" and c["experts"] == 16 for c in cases)


def test_flop_and_byte_counts_by_hand():
    f, b = gemm_flops_bytes({"kind": "gemm", "dtype": "fp8", "m": 4, "n": 10, "k": 8})
    assert (f, b) == (2 * 4 * 10 * 8, 10 * 8 + 4 * 8 + 4 * 10 * 2)
    f, b = gemm_flops_bytes({"kind": "grouped_gemm", "dtype": "bf16", "experts": 3, "m": 2, "n": 5, "k": 4})
    assert (f, b) == (3 * 2 * 2 * 5 * 4, 3 * ((5 * 4 + 2 * 4) * 2 + 2 * 5 * 2))
    f, b = attention_flops_bytes({"kind": "decode_attn", "batch": 2, "ctx": 100, "heads": 4, "head_dim": 8})
    assert (f, b) == (4 * 2 * 4 * 8 * 100, 2 * 2 * 4 * 100 * 8 * 2)
    f, _ = attention_flops_bytes({"kind": "prefill_attn", "batch": 1, "ctx": 100, "heads": 4, "head_dim": 8})
    assert f == 2 * 4 * 8 * 100 * 100


TRUE = {"memory": 0.85, "bf16": (0.72, 96.0), "fp8": (0.61, 180.0), "kv_memory": 0.9, "attention": 0.55,
        "moe": 0.8}


def _synthetic_rows(gpu) -> list[dict]:
    """Timings the model's own formulas give at the TRUE factors, for a plan over two real models."""
    bw = gpu.mem_bw_bytes_per_s
    mem = TRUE["memory"]
    models = [load_model_spec(MODELS / "meta-llama--Meta-Llama-3.1-8B_config.json"),
              load_model_spec(MODELS / "Qwen--Qwen3-30B-A3B_config.json")]
    rows = []
    for c in calibration_plan(models, tps=(1, 2), ms=(1, 16, 64, 256, 1024, 4096)):
        r = dict(c)
        if c["kind"] in ("gemm", "grouped_gemm"):
            comp, h = TRUE[c["dtype"]]
            f, b = gemm_flops_bytes(c)
            t = max(f / (gpu.peak_flops(c["dtype"]) * comp * c["m"] / (c["m"] + h)), b / (bw * mem))
            r["time_s"] = t / TRUE["moe"] if c["kind"] == "grouped_gemm" else t
        elif c["kind"] == "decode_attn":
            r["time_s"] = attention_flops_bytes(c)[1] / (bw * mem * TRUE["kv_memory"])
        elif c["kind"] == "prefill_attn":
            r["time_s"] = attention_flops_bytes(c)[0] / (gpu.peak_flops("bf16") * TRUE["attention"])
        else:
            r["time_s"] = 2 * c["bytes"] / (bw * mem)
        rows.append(r)
    return rows


def test_fit_recovers_the_factors_the_timings_were_made_with():
    gpu = get_gpu("H200-SXM")
    fit = fit_microbench(_synthetic_rows(gpu), gpu)
    assert fit.memory == pytest.approx(TRUE["memory"], rel=1e-3)
    for dt in ("bf16", "fp8"):
        comp, h = TRUE[dt]
        assert fit.gemm[dt].compute == pytest.approx(comp, rel=0.01)
        assert fit.gemm[dt].gemm_half_tokens == pytest.approx(h, rel=0.03)
        assert fit.gemm[dt].rms_log_residual < 0.01
        assert fit.moe[dt] == pytest.approx(TRUE["moe"], rel=0.02)
    assert fit.kv_memory == pytest.approx(TRUE["kv_memory"], rel=1e-3)
    assert fit.attention == pytest.approx(TRUE["attention"], rel=1e-3)


def test_a_slower_gpu_fits_lower_efficiencies():
    gpu = get_gpu("H200-SXM")
    rows = _synthetic_rows(gpu)
    slow = [dict(r, time_s=r["time_s"] * 1.5) if r["kind"] == "gemm" and r["dtype"] == "bf16" else r for r in rows]
    assert fit_microbench(slow, gpu).gemm["bf16"].compute < 0.9 * fit_microbench(rows, gpu).gemm["bf16"].compute


def test_bad_rows_are_refused_by_name():
    gpu = get_gpu("H200-SXM")
    copy = {"kind": "copy", "dtype": "bf16", "bytes": 2**30, "time_s": 1e-3, "label": "c"}
    with pytest.raises(MicrobenchError, match="no copy rows"):
        fit_microbench([{"kind": "gemm", "dtype": "bf16", "m": 1, "n": 2, "k": 2, "time_s": 1.0}], gpu)
    with pytest.raises(MicrobenchError, match="unknown kind 'gemv'"):
        fit_microbench([copy, {"kind": "gemv", "time_s": 1.0}], gpu)
    with pytest.raises(MicrobenchError, match=r"'x'.*time_s=-1.0 must be positive"):
        fit_microbench([copy, {"kind": "gemm", "dtype": "bf16", "m": 1, "n": 2, "k": 2, "time_s": -1.0,
                               "label": "x"}], gpu)
    with pytest.raises(MicrobenchError, match="no 'n'"):
        fit_microbench([copy] + [{"kind": "gemm", "dtype": "bf16", "m": 1, "k": 2, "time_s": 1.0}] * 3, gpu)


def test_compare_with_model_gives_measured_over_model():
    gpu = get_gpu("H200-SXM")
    fit = fit_microbench(_synthetic_rows(gpu), gpu)
    cmp = compare_with_model(fit, {"bf16": Efficiency(compute=0.36, gemm_half_tokens=0.0)})
    assert cmp["bf16.compute"]["ratio"] == pytest.approx(0.72 / 0.36, rel=0.02)
    assert cmp["bf16.gemm_half_tokens"]["ratio"] is None  # the model's 0: no size effect, no ratio
    assert math.isclose(cmp["bf16.memory"]["measured"], 0.85, rel_tol=1e-3)


def test_copies_are_planned_first_so_a_run_cut_by_its_budget_can_still_be_fitted(llama70b):
    """`measure` times the plan in order and stops at --budget-s; fit_microbench refuses rows without a copy (the
    memory efficiency every other fit divides by). With the copies last (index 1598 of 1602 in the committed
    plan), any run the budget cut short could not be analysed at all."""
    plan = calibration_plan([llama70b])
    kinds = [c["kind"] for c in plan]
    assert kinds[:4] == ["copy"] * 4 and "copy" not in kinds[4:]
    import json
    from pathlib import Path

    committed = json.loads((Path(__file__).resolve().parents[2] / "bench/gpu_calibration_plan.json").read_text())
    assert [c["kind"] for c in committed["cases"][:4]] == ["copy"] * 4
