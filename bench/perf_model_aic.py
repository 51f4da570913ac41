"""Side-by-side runner: NVIDIA AIConfigurator's max-throughput prediction for rows of a TensorRT-LLM table.

    .venv-bench-perf/bin/python bench/perf_model_aic.py --table DATA/perf/trtllm_throughput_dev.csv \
        --models DATA/models --out bench/results/perf_model_aic.json [--stride 5] [--budget-s 1500]

Runs in the optional benchmark venv ``.venv-bench-perf`` (``pip install aiconfigurator==0.12.0``; it is not a
pdserve dependency). For every ``stride``-th row with TP = PP... = 1 pipeline stage, it asks AIConfigurator's
``cli_estimate`` (mode ``agg``, backend ``trtllm``, its silicon database) for the per-GPU output throughput at
three in-flight batch sizes — the ``max_batch_size`` trtllm-bench would pick for the row
(``runtime.perf.throughput.trtllm_bench_settings``, TensorRT-LLM's own heuristic) and its half and quarter —
and keeps the best point without a KV-capacity warning. A row AIConfigurator cannot estimate (no database for
the GPU, unknown model, every point over memory) counts as not covered. Calls cost ~2 s each on the dev
machine, hence the row stride and a wall-clock budget. Writes one JSON file: per-row predictions, coverage,
and AIConfigurator's median / p90 absolute % error on the rows it covered. bench/perf_model.py reads it.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.modelfiles.load import load_model_spec  # noqa: E402
from runtime.paths import print_json_line, write_text_atomically  # noqa: E402
from runtime.perf.gpus import get_gpu  # noqa: E402
from runtime.perf.model import PerfModel  # noqa: E402
from runtime.perf.throughput import trtllm_bench_settings  # noqa: E402

# catalog GPU -> AIConfigurator system name
SYSTEMS = {"H100-SXM": "h100_sxm", "H200-SXM": "h200_sxm", "A100-SXM-80GB": "a100_sxm",
           "A100-PCIe-80GB": "a100_pcie", "L40S": "l40s", "B200-SXM": "b200_sxm", "GB200": "gb200"}
QUANT = {"bf16": ("bfloat16", "bfloat16"), "fp8": ("fp8", "fp8"), "fp4": ("nvfp4", "fp8")}


def _model_dir(stem: str, root: Path, models: Path) -> str:
    """A local model folder holding the model's config.json from `models` (AIConfigurator reads local folders; this machine
    cannot reach the Hugging Face hub)."""
    d = root / stem
    if not d.is_dir():
        d.mkdir(parents=True)
        (d / "config.json").write_text((models / f"{stem}_config.json").read_text())
    return str(d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, required=True, help="throughput table CSV (docs/benchmarks.md)")
    ap.add_argument("--models", type=Path, required=True,
                    help="folder of the models' full HF configs, <org>--<model>_config.json (AIConfigurator reads fields the built-in catalog leaves out)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stride", type=int, default=5, help="evaluate every N-th row (calls are slow)")
    ap.add_argument("--budget-s", type=float, default=1500.0, help="stop after this many seconds")
    a = ap.parse_args(argv)
    # checked before the (long) AIConfigurator run, so a typo cannot lose its result at the end
    if a.stride < 1:
        ap.error(f"--stride must be >= 1, got {a.stride}")
    if not (math.isfinite(a.budget_s) and a.budget_s > 0):
        ap.error(f"--budget-s must be a finite number of seconds > 0, got {a.budget_s}")
    if a.out.is_dir():
        ap.error(f"--out {a.out}: is a folder; give the JSON file to write")
    try:
        a.out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {a.out}: cannot create its folder: {e.strerror or e}")
    if not os.access(a.out.parent, os.W_OK | os.X_OK):
        ap.error(f"--out {a.out}: folder {a.out.parent} is not writable")
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from aiconfigurator.cli.api import cli_estimate  # optional dependency, separate venv

    import bench.perf_model as pmb  # table name -> config mapping, one source of truth

    rows = list(csv.DictReader(a.table.open()))
    tmp = tempfile.TemporaryDirectory(prefix="pdserve-aic-")
    models_root = Path(tmp.name)
    out_rows, t0 = [], time.perf_counter()
    for i, r in enumerate(rows):
        if i % a.stride or time.perf_counter() - t0 > a.budget_s:
            continue
        stem = pmb.MODEL_CONFIGS.get(r["model"].strip().lower())
        prec = pmb.PRECISIONS.get(r["precision"].strip().lower())
        gpu = get_gpu(r["gpu"])
        rec = {**pmb._key(r), "measured": float(r["per_gpu_output_tok_s"]), "predicted": None}
        out_rows.append(rec)
        system = SYSTEMS.get(gpu.name)
        if stem is None or prec is None or system is None or int(r.get("pp") or 1) != 1:
            rec["why"] = "not mapped"
            continue
        tp, isl, osl = int(r["tp"]), int(r["isl"]), int(r["osl"])
        spec = load_model_spec(a.models / f"{stem}_config.json")
        pm = PerfModel(spec, gpu, prec)
        moe = {"moe_tp_size": tp, "moe_ep_size": 1} if spec.num_experts else {}
        max_batch, _ = trtllm_bench_settings(pm, isl, osl, tp)
        gemm, kv = QUANT[prec]
        best = None
        for b in sorted({max(1, max_batch // 4), max(1, max_batch // 2), max(1, max_batch)}):
            try:
                res = cli_estimate(_model_dir(stem, models_root, a.models), system, backend_name="trtllm", isl=isl,
                                   osl=osl, batch_size=b, tp_size=tp, gemm_quant_mode=gemm,
                                   kvcache_quant_mode=kv, moe_quant_mode=gemm if spec.num_experts else None,
                                   **moe)
            except Exception as e:  # noqa: BLE001 - AIConfigurator raises many kinds; record and go on
                rec["why"] = f"{type(e).__name__}: {str(e)[:120]}"
                continue
            if res.kv_cache_warning:
                rec.setdefault("why", "over KV capacity")
                continue
            v = res.tokens_per_second_per_gpu
            if v > 0 and (best is None or v > best[0]):
                best = (v, b)
        if best:
            rec.update(predicted=round(best[0], 1), batch=best[1])
            rec.pop("why", None)
    tmp.cleanup()
    covered = [x for x in out_rows if x["predicted"]]
    errs = [abs(x["predicted"] - x["measured"]) / x["measured"] * 100 for x in covered]
    summary = {
        "tool": "aiconfigurator 0.12.0 cli_estimate (agg, trtllm, silicon database)",
        "stride": a.stride, "rows": len(out_rows), "covered": len(covered),
        "median_abs_pct_error": round(statistics.median(errs), 2) if errs else None,
        "p90_abs_pct_error": round(pmb._pct(errs, 0.9), 2) if errs else None,
        "wall_s": round(time.perf_counter() - t0, 1),
        "table": a.table.name, "details": out_rows,
    }
    print_json_line({k: v for k, v in summary.items() if k != "details"})  # first: the result is never lost
    try:
        write_text_atomically(a.out, json.dumps(summary, indent=0) + "\n")
    except OSError as e:
        print(f"error: --out {a.out}: cannot write the results ({e.strerror or e}); they follow on stderr",
              file=sys.stderr)
        print(json.dumps(summary), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
