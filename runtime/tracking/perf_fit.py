"""Adapter + command: fit the perf model's efficiency factors and write them as data.

    python -m runtime.tracking.perf_fit --csv SILICON_SAMPLE.csv [--out runtime/perf/fitted.py]
                                        [--measured RESULT.json ...]

Reads NVIDIA aiconfigurator's silicon sample (CSV; docs/benchmarks.md says where it is published) and the measured-mode results (JSON), fits them with the
pure `runtime.perf.fit` (which documents the model and the least-squares set-up) and writes
``runtime/perf/fitted.py`` atomically. Deterministic: same inputs, same file.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from runtime.modelfiles.load import load_model_spec
from runtime.models.spec import ModelSpec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.paths import REPO_ROOT
from runtime.perf.fit import GEMM_PRECISION, MODEL_CONFIGS, _Obs, fit_measured, fit_observations, observations, render
from runtime.perf.calibration import Efficiency

COMMAND = "python -m runtime.tracking.perf_fit"


def csv_observations(path: Path) -> list[_Obs]:
    """All observations of a silicon-sample CSV (rows of unknown models / formats are skipped)."""
    cache: dict[str, ModelSpec] = {}
    out: list[_Obs] = []
    with Path(path).open() as f:
        for row in csv.DictReader(f):
            stem = MODEL_CONFIGS.get(row["model_path"])
            if stem is None or GEMM_PRECISION.get(row["gemm_quant_mode"]) is None:
                continue
            if stem not in cache:
                cache[stem] = load_model_spec(CATALOG_DIR / f"{stem}_config.json")
            try:
                out.extend(observations(row, cache[stem]))
            except (KeyError, ValueError):
                continue
    return out


def fit_csv(path: Path) -> tuple[dict[tuple[str, str, str], Efficiency], dict[tuple[str, str, str], dict]]:
    """Pooled fit of a silicon-sample CSV: factors keyed ``("*", compute class, backend)`` for every class
    and backend with at least ``MIN_ROWS`` observations, and residual statistics per group."""
    try:
        return fit_observations(csv_observations(path), f"pooled least-squares fit on {Path(path).name} ({COMMAND})")
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e




def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fit perf-model efficiency factors (writes runtime/perf/fitted.py)")
    ap.add_argument("--csv", type=Path, required=True,
                    help="NVIDIA aiconfigurator silicon sample CSV (aiconfigurator repository, Apache-2.0; see docs/benchmarks.md)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "runtime" / "perf" / "fitted.py")
    measured_default = REPO_ROOT / "bench" / "results" / "perf_model_measure_cpu.json"
    ap.add_argument("--measured", type=Path, nargs="*",
                    default=[measured_default] if measured_default.is_file() else [],
                    help="measured-mode results to fit too (default: bench/results/perf_model_measure_cpu.json)")
    a = ap.parse_args(argv)
    if not a.csv.is_file():
        ap.error(f"--csv {a.csv} does not exist")
    fitted, residuals = fit_csv(a.csv)
    for path in a.measured:
        got = fit_measured(json.loads(Path(path).read_text()), f"least-squares fit on {Path(path).name} ({COMMAND})")
        if got is not None:
            key, fitted[key], residuals[key] = got
    text = render(fitted, residuals, a.csv.name)
    tmp = a.out.with_suffix(".py.tmp")
    tmp.write_text(text)
    tmp.replace(a.out)
    for k, e in fitted.items():
        print(k, e)
    for k, s in residuals.items():
        print(k, s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
