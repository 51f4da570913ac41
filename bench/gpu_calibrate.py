"""Measure the performance model's efficiencies on a real GPU: one short, prepared run for a lent GPU machine.

    python bench/gpu_calibrate.py plan [--out bench/gpu_calibration_plan.json]        # here (needs pdserve)
    python3 bench/gpu_calibrate.py measure --out-csv $OUT/h200.csv [--budget-s 420]   # on the GPU (torch only)
    python bench/gpu_calibrate.py analyse $OUT/h200.csv --gpu H200-SXM                # here: fit + compare

``plan`` writes the cases of ``runtime.perf.microbench.calibration_plan`` for the models of the published
TensorRT-LLM tables (dense GEMMs of every projection at TP 1-8 and ISL/batch rows 1-8192 in bf16 and fp8,
expert GEMMs of the MoE models, decode and prefill attention, copies). ``measure`` needs nothing but PyTorch
(no pdserve import: the GPU machine's image has torch but not pydantic): it times every case with CUDA events
(median of the repeats after a warm-up, random inputs, weights rotated across enough copies to exceed twice
the L2 so the timings stream from HBM as a serving step does), writes one CSV row per case and prints ONE JSON
line (device, torch version, cases timed / skipped, wall time). It stops cleanly at ``--budget-s`` and keeps
what it timed. fp8 GEMMs use ``torch._scaled_mm`` (per-tensor scales, bf16 output); where it or the shape is
unsupported the case is recorded as skipped with the reason. ``analyse`` fits the rows
(``runtime.perf.microbench.fit_microbench``) and prints ONE JSON line with the measured efficiencies next to
the model's current ones (``efficiency_for(gpu, dtype, backend)``), ratios measured / model.

``--device cpu --quick`` runs a few small cases on the CPU: the tests use it to check the script end to end.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PLAN = ROOT / "bench" / "gpu_calibration_plan.json"
# the models of the TensorRT-LLM throughput table (docs/benchmarks.md) the plan covers (MLA models are not planned)
PLAN_MODELS = ("meta-llama--Meta-Llama-3.1-8B", "meta-llama--Meta-Llama-3.1-70B", "Qwen--Qwen3-32B",
               "mistralai--Mixtral-8x7B-v0.1", "Qwen--Qwen3-30B-A3B", "meta-llama--Llama-4-Scout-17B-16E-Instruct",
               "Qwen--Qwen3-235B-A22B")
COLUMNS = ("kind", "dtype", "m", "n", "k", "experts", "batch", "ctx", "heads", "head_dim", "bytes", "label",
           "time_s", "reps", "skipped")
L2_BYTES = 60 * 2**20  # H100 50 MB / H200 60 MB L2; rotation covers twice the larger


def plan(out: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from runtime.modelfiles.catalog import CATALOG_DIR
    from runtime.modelfiles.load import load_model_spec
    from runtime.perf.microbench import calibration_plan

    models = [load_model_spec(CATALOG_DIR / f"{m}_config.json") for m in PLAN_MODELS]
    cases = calibration_plan(models)
    out.write_text(json.dumps({"models": list(PLAN_MODELS), "cases": cases}, indent=0) + "\n")
    print(json.dumps({"plan": str(out), "cases": len(cases)}))
    return 0


# ---------------------------------------------------------------------------------------------------- measure


class Timer:
    """Median seconds per call of ``fn(i)`` (``i`` rotates input copies) after a warm-up."""

    def __init__(self, torch, device: str, target_s: float):
        self.torch, self.device, self.target_s = torch, device, target_s

    def _run(self, fn, reps: int, start: int) -> float:
        t = self.torch
        if self.device == "cuda":
            a, b = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            a.record()
            for i in range(reps):
                fn(start + i)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3 / reps
        t0 = time.perf_counter()
        for i in range(reps):
            fn(start + i)
        return (time.perf_counter() - t0) / reps

    def median_s(self, fn) -> tuple[float, int]:
        self._run(fn, 2, 0)  # warm-up: handles, kernel selection, lazy module load
        one = self._run(fn, 1, 2)
        reps = max(3, min(200, int(self.target_s / max(one, 1e-7) / 5)))
        samples = [self._run(fn, reps, 3 + j * reps) for j in range(5)]
        return statistics.median(samples), reps * 5


def _copies(torch, nbytes: float) -> int:
    return max(1, min(64, math.ceil(2 * L2_BYTES / max(nbytes, 1))))


def _case_fn(torch, c: dict, device: str):
    """A callable ``fn(i)`` running case ``c`` on rotating inputs, or raise (the case is then skipped)."""
    F = torch.nn.functional
    bf16 = torch.bfloat16
    kind, dt = c["kind"], c.get("dtype", "bf16")
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dtype=bf16):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    if kind in ("gemm", "grouped_gemm"):
        m, n, k = c["m"], c["n"], c["k"]
        e = c.get("experts") or 1
        wdt = torch.float8_e4m3fn if dt == "fp8" else bf16
        nw = _copies(torch, e * n * k * (1 if dt == "fp8" else 2))
        if kind == "gemm":
            x = rnd(m, k, dtype=wdt)
            ws = [rnd(n, k, dtype=wdt) for _ in range(nw)]
            if dt == "fp8":
                one = torch.ones((), device=device, dtype=torch.float32)
                torch._scaled_mm(x, ws[0].t(), scale_a=one, scale_b=one, out_dtype=bf16)  # raises if unsupported
                return lambda i: torch._scaled_mm(x, ws[i % nw].t(), scale_a=one, scale_b=one, out_dtype=bf16)
            return lambda i: x @ ws[i % nw].t()
        if dt == "fp8":
            raise RuntimeError("grouped fp8 GEMM not measured (no stable torch API)")
        x = rnd(e, m, k)
        ws = [rnd(e, n, k) for _ in range(nw)]
        return lambda i: torch.bmm(x, ws[i % nw].transpose(1, 2))
    if kind in ("decode_attn", "prefill_attn"):
        b, ctx, h, d = c["batch"], c["ctx"], c["heads"], c["head_dim"]
        q_len = 1 if kind == "decode_attn" else ctx
        nk = _copies(torch, 2 * b * h * ctx * d * 2)
        q = rnd(b, h, q_len, d)
        kv = [(rnd(b, h, ctx, d), rnd(b, h, ctx, d)) for _ in range(nk)]
        causal = kind == "prefill_attn"
        return lambda i: F.scaled_dot_product_attention(q, kv[i % nk][0], kv[i % nk][1], is_causal=causal)
    if kind == "copy":
        n = int(c["bytes"]) // 2
        src, dst = rnd(n), torch.empty(n, device=device, dtype=bf16)
        return lambda i: dst.copy_(src)
    raise ValueError(f"unknown kind {kind!r}")


def _quick_cases() -> list[dict]:
    cases = [{"kind": "gemm", "dtype": "bf16", "m": m, "n": 256, "k": 256, "label": "quick"} for m in (1, 16, 64, 256)]
    cases += [{"kind": "gemm", "dtype": "fp8", "m": 32, "n": 256, "k": 256, "label": "quick fp8"},
              {"kind": "grouped_gemm", "dtype": "bf16", "experts": 4, "m": 8, "n": 128, "k": 128, "label": "quick"},
              {"kind": "decode_attn", "dtype": "bf16", "batch": 2, "ctx": 256, "heads": 4, "head_dim": 64,
               "label": "quick"},
              {"kind": "prefill_attn", "dtype": "bf16", "batch": 1, "ctx": 128, "heads": 4, "head_dim": 64,
               "label": "quick"},
              {"kind": "copy", "dtype": "bf16", "bytes": 8 * 2**20, "label": "quick"}]
    return cases


def measure(plan_path: Path, out_csv: Path, device: str, budget_s: float, quick: bool, target_s: float) -> int:
    import torch

    t0 = time.perf_counter()
    if device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device visible to torch"}))
        return 2
    cases = _quick_cases() if quick else json.loads(plan_path.read_text())["cases"]
    timer = Timer(torch, device, target_s)
    timed = skipped = 0
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    with out_csv.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for c in cases:
            if time.perf_counter() - t0 > budget_s:
                break
            row = dict(c)
            try:
                with torch.inference_mode():
                    fn = _case_fn(torch, c, device)
                    row["time_s"], row["reps"] = timer.median_s(fn)
                timed += 1
            except Exception as e:  # an unsupported dtype / shape on this device: recorded, not fatal
                row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                skipped += 1
            w.writerow(row)
            f.flush()
            if device == "cuda":
                torch.cuda.empty_cache()
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "cases": len(cases), "timed": timed, "skipped": skipped, "not_reached": len(cases) - timed - skipped,
            "csv": str(out_csv), "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(info))
    return 0


# ---------------------------------------------------------------------------------------------------- analyse


def read_rows(path: Path) -> list[dict]:
    """Timed rows of a ``measure`` CSV, numbers as floats; skipped rows dropped."""
    rows = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            if r.get("skipped") or not r.get("time_s"):
                continue
            rows.append({k: (float(v) if k not in ("kind", "dtype", "label", "skipped") else v)
                         for k, v in r.items() if v not in ("", None)})
    return rows


def analyse(csv_path: Path, gpu_name: str, backend: str, out: Path | None) -> int:
    sys.path.insert(0, str(ROOT))
    from runtime.perf.calibration import efficiency_for
    from runtime.perf.gpus import get_gpu
    from runtime.perf.microbench import compare_with_model, fit_microbench

    from runtime.perf.microbench import MicrobenchError

    try:
        gpu = get_gpu(gpu_name)
        fit = fit_microbench(read_rows(csv_path), gpu)
    except (KeyError, OSError, MicrobenchError) as e:
        print(f"analyse: {csv_path}: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    result = {"gpu": gpu.name, "backend": backend, "fit": fit.as_dict(),
              "vs_model": compare_with_model(fit, {d: efficiency_for(gpu, d, backend) for d in ("bf16", "fp8")})}
    if out:
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="write the cases to time (needs pdserve)")
    p.add_argument("--out", type=Path, default=DEFAULT_PLAN)
    m = sub.add_parser("measure", help="time the plan's cases with PyTorch (run on the GPU machine)")
    m.add_argument("--plan", type=Path, default=DEFAULT_PLAN)
    m.add_argument("--out-csv", type=Path, required=True)
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    m.add_argument("--budget-s", type=float, default=420.0, help="stop starting cases after this many seconds")
    m.add_argument("--target-s", type=float, default=0.05, help="device seconds spent per case (about)")
    m.add_argument("--quick", action="store_true", help="a few small cases instead of the plan (CPU check)")
    an = sub.add_parser("analyse", help="fit the measured rows and compare with the model's efficiencies")
    an.add_argument("csv", type=Path)
    an.add_argument("--gpu", required=True, help="catalog name of the GPU measured, e.g. H200-SXM")
    an.add_argument("--backend", default="trtllm", help="whose fitted efficiencies to compare with")
    an.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        return plan(a.out)
    if a.cmd == "measure":
        return measure(a.plan, a.out_csv, a.device, a.budget_s, a.quick, a.target_s)
    return analyse(a.csv, a.gpu, a.backend, a.out)


if __name__ == "__main__":
    sys.exit(main())
