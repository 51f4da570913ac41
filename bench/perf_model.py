"""Benchmark: predicted vs published per-GPU max output throughput (TensorRT-LLM perf-overview tables).

    python bench/perf_model.py --table DATA/perf/trtllm_throughput_dev.csv [--out bench/results/...]

Prints ONE JSON line: rows (compared), skipped (no config / unknown GPU), not_fit (model says the weights
don't fit where the table has a number), median_abs_pct_error, p90_abs_pct_error, by_gpu {gpu: {rows,
median, p90}}, by_precision, by_trtllm_version, sweep_s (one model's full tune sweep: 4 prefill TPs x 4 decode TPs x every
ISL/OSL pair of the table), and aiconfigurator: NVIDIA AIConfigurator's error on a sample of the same rows
next to ours on those rows (null unless bench/perf_model_aic.py has been run in the optional venv
``.venv-bench-perf``; ``--aiconfigurator run`` runs it first).

Prediction per row: runtime.perf.throughput.trtllm_bench_throughput, a model of the run the page documents:
``TRTLLM_BENCH_NUM_REQUESTS`` identical requests queued at once; the engine limits trtllm-bench derives for the
dataset (``trtllm_bench_settings``: max_batch_size <= 4096, max_num_tokens <= 32768, from the device memory
left after the weights at ISL+OSL per request); KV = 0.9 (``kv_cache_free_gpu_mem_fraction``) of the memory free
after weights, activations at max_num_tokens and the runtime reserve; GUARANTEED_NO_EVICT admits as many
requests as the KV cache holds at ISL+OSL each; they run in cycles (prompts prefilled in max_num_tokens
chunks behind the generation tokens, then generation only), the last cycle holding the remainder. Step times
come from ``PerfModel(..., backend="trtllm")``: the efficiency factors pooled-fitted on the aiconfigurator
silicon sample (``python -m runtime.tracking.perf_fit``) and that sample's TensorRT-LLM overheads. The table itself is
never used for fitting; GPUs absent from the sample (A100, L40S) use the same pooled factors.

Honesty note (also in the JSON line, ``model_notes``): this table is the validation set and HAS BEEN LOOKED AT
while the model was developed (per-row errors in ``bench/results/perf_model.rows.json``). No constant is
fitted on it. Each term of the model below is argued from a source and chosen by its fit on the aiconfigurator
silicon sample (the calibration set), but its error on this table was also seen for every variant tried, and
one variant (attention-DP + expert parallelism for the MoE rows) was dropped because of it:

1. all-reduce = NCCL's cost model (NVIDIA/nccl ``src/graph/tuning.cc``: the faster of the LL and Simple
   protocols with their base + per-hop latencies) at the fabric's nccl-tests large-message bus bandwidth
   (H100/H200 NVSwitch 460-480 GB/s, A100 NVLink-3 230-250, PCIe ~40/64 of the link; Blackwell assumed like
   Hopper); the pooled ``comm`` efficiency applies to NVLink fabrics only (every system of the sample is
   NVLink), PCIe GPUs (L40S, A100-PCIe) keep the default 0.7 (``calibration.efficiency_for``);
2. the calibration fit decodes at the batch the KV cache holds (TensorRT-LLM GUARANTEED_NO_EVICT reserves
   ISL+OSL per request) and charges the other closed-loop clients ``(B/R - 1)`` request times of waiting;
3. attention-kernel efficiencies (KV read, attention FLOPs) are per serving backend (XQA / FlashInfer /
   FlashAttention are different kernels), attention bounded by FlashAttention-3's 75% of peak;
4. a fused-MoE efficiency for the expert GEMMs (routing / permutation around the grouped GEMM, MegaBlocks),
   with the GEMM half-efficiency rows bounded below by the 64-row tensor-core tile (without that bound the
   fit collapses to 7.5 rows, which no tensor-core kernel has);
5. NVFP4 checkpoints of MLA models keep the attention projections in FP8 (nvidia/DeepSeek-R1-NVFP4-v2 model
   card), so DeepSeek NVFP4 rows charge their attention GEMMs to the FP8 class;
6. the run the table documents (two perf-overview.md pages and trtllm-bench's source): a finite dataset,
   NO_EVICT admission, cycles with chunked prompts and a partial last cycle, not an endless steady state;
   device memory as the driver reports it and TensorRT-LLM's "0.9 of the free memory" KV rule inside
   ``PerfModel`` (the calibration fit uses the same rule);
7. every TTFT of the silicon sample carries a fitted fixed latency of its deployment (model, system, backend,
   version; ``runtime.perf.fit.deployment``) instead of one prefill overhead per backend: the sample's own
   low-load TTFTs differ by 100-150 ms between models on the same GPUs and engine for the same prefill work,
   and one shared constant would push that difference into the compute efficiencies;
8. memory-bound element-wise activation traffic (norms, residual adds, gated activation, MoE token copies)
   as its own term at the memory efficiency (no fitted parameter);
9. TensorRT-LLM's overlap scheduler: the PyTorch executor's per-sequence host work bounds the decode step
   instead of adding to it, at a cost FIXED from a source (the sample cannot size it; Grace hosts 2.75x
   slower), charged only on the table's PyTorch-backend (1.0-era) rows.

Known errors (``model_notes["known_errors"]``): 7-8B dense models, whose decode is KV-read bound, are
predicted 0.75-0.9x (the fitted TensorRT-LLM KV-read efficiency); the TensorRT-LLM 1.0 FP4 rows are the
least accurate group. Alternatives measured and not adopted, with their figures:
``model_notes["alternatives_not_adopted"]``; the reasoning: docs/design/perf-model.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.config import SloSpec, WorkloadSpec  # noqa: E402
from runtime.modelfiles.load import load_model_spec  # noqa: E402
from runtime.modelfiles.catalog import CATALOG_DIR  # noqa: E402
from runtime.paths import print_json_line  # noqa: E402
from runtime.perf.gpus import get_gpu  # noqa: E402
from runtime.perf.model import PerfModel  # noqa: E402
from runtime.perf.throughput import (  # noqa: E402
    trtllm_bench_settings,
    trtllm_bench_throughput,
    trtllm_kv_capacity_tokens,
)
from runtime.tuner.search import TuningError, tune  # noqa: E402

# Table model names -> config files in the model catalog (runtime/modelfiles/catalog). Llama 3 / 3.3 70B share Llama-3.1-70B's
# architecture (same layers, heads, FFN and vocabulary sizes).
MODEL_CONFIGS = {
    "llama v3 70b": "meta-llama--Meta-Llama-3.1-70B",
    "llama v3.1 70b": "meta-llama--Meta-Llama-3.1-70B",
    "llama 3.3 70b": "meta-llama--Meta-Llama-3.1-70B",
    "llama v3.1 8b": "meta-llama--Meta-Llama-3.1-8B",
    "llama 3.1 8b": "meta-llama--Meta-Llama-3.1-8B",
    "llama 3.1 405b": "meta-llama--Meta-Llama-3.1-405B",
    "llama v3.1 405b": "meta-llama--Meta-Llama-3.1-405B",
    "mistral 7b": "mistralai--Mistral-7B-v0.1",
    "mixtral 8x7b": "mistralai--Mixtral-8x7B-v0.1",
    "mixtral 8x22b": "mistralai--Mixtral-8x22B-v0.1",
    "llama 4 scout": "meta-llama--Llama-4-Scout-17B-16E-Instruct",
    "llama 4 maverick": "meta-llama--Llama-4-Maverick-17B-128E-Instruct",
    "qwen3-235b-a22b": "Qwen--Qwen3-235B-A22B",
    "qwen3-30b-a3b": "Qwen--Qwen3-30B-A3B",
}
# ``$num_requests`` of each ISL/OSL dataset, from the "Preparing a Dataset" table of the same perf-overview.md
# pages (0.14 and 1.0-era; the 1.0 page adds 1000/2000). Other pairs are modelled as an endless run.
TRTLLM_BENCH_NUM_REQUESTS = {
    (128, 128): 30000, (128, 2048): 3000, (128, 4096): 1500, (1000, 2000): 1500, (2048, 128): 3000,
    (2048, 2048): 1500, (5000, 500): 1500, (1000, 1000): 3000, (500, 2000): 3000, (20000, 2000): 1000,
}
PRECISIONS = {"fp16": "bf16", "bf16": "bf16", "fp8": "fp8", "fp4": "fp4", "nvfp4": "fp4"}


def _pct(errs: list[float], q: float) -> float | None:
    if not errs:
        return None
    s = sorted(errs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _summary(errs: list[float]) -> dict:
    return {"rows": len(errs), "median_abs_pct_error": _r(statistics.median(errs) if errs else None),
            "p90_abs_pct_error": _r(_pct(errs, 0.9))}


def _r(x):
    return None if x is None else round(x, 2)


# How the 1.0-era page ran its MoE rows ("For MoE models": ``trtllm-bench --tp $tp_size --pp $pp_size --ep
# $ep_size ...`` with ``enable_attention_dp: true`` in ``llm_options.yml``; NVIDIA/TensorRT-LLM
# docs/source/performance/perf-overview.md @ 00f37686aa85 nests that key under ``cuda_graph_config``, a later
# revision with the same numbers prints it at the top level). ``$ep_size`` is given for no table (the column
# headers say only "TP8" / "TP4"): "dep" = attention DP + EP = TP (what later pages, with new measurements,
# label "DEP<n>"), "adp" = attention DP + MoE TP (``tensorrt_llm/mapping.py`` default when no EP size is set),
# "ep" = EP = TP without attention DP, "tp" = plain TP (default). ``MOE_MAPPINGS`` maps a --moe-mapping choice
# to PerfModel(expert_parallel=, attention_dp=).
MOE_MAPPINGS = {"tp": (False, False), "dep": (True, True), "adp": (False, True), "ep": (True, False)}
V1_SOURCE_MARK = "00f37686aa85"


def row_mapping(r: dict, spec, moe_mapping: str) -> tuple[bool, bool]:
    """``(expert_parallel, attention_dp)`` for one table row: the page's MoE mapping for the 1.0-era rows
    of MoE models on more than one GPU, plain TP otherwise."""
    if spec.num_experts and int(r["tp"]) > 1 and V1_SOURCE_MARK in r.get("source", ""):
        return MOE_MAPPINGS[moe_mapping]
    return False, False


def pytorch_backend(r: dict) -> bool:
    """True when the row was measured with TensorRT-LLM's PyTorch backend: the 1.0-era page says "Starting with
    v0.19, testing was performed using the PyTorch backend" (``trtllm-bench ... --backend pytorch``); the 0.14
    page built TensorRT engines (``trtllm-bench build``) run by the C++ executor. Only the PyTorch backend's
    Python executor does per-request host work each step (``Efficiency.decode_seq_overhead_s``, a lower bound
    of the step under its overlap scheduler: ``model.OVERLAP_SCHEDULER_BACKENDS``); the C++ executor's rows get
    none."""
    m = re.search(r"(\d+)\.(\d+)", r.get("trtllm_version") or "")  # "0.14.0", "1.0-era", "v0.19.0", "0.19rc1"
    return m is not None and (int(m[1]), int(m[2])) >= (0, 19)


def evaluate_table(path: Path, moe_mapping: str = "tp") -> tuple[dict, list[dict]]:
    rows = list(csv.DictReader(Path(path).open()))
    models_dir = CATALOG_DIR
    cache: dict = {}
    errs, by_gpu, by_prec, by_version, details = [], {}, {}, {}, []
    skipped = not_fit = 0
    for r in rows:
        stem = MODEL_CONFIGS.get(r["model"].strip().lower())
        prec = PRECISIONS.get(r["precision"].strip().lower())
        try:
            gpu = get_gpu(r["gpu"])
        except KeyError:
            gpu = None
        if stem is None or prec is None or gpu is None or int(r.get("pp") or 1) != 1:
            skipped += 1
            continue
        if stem not in cache:
            cache[stem] = load_model_spec(models_dir / f"{stem}_config.json")
        ep, adp = row_mapping(r, cache[stem], moe_mapping)
        pm = PerfModel(cache[stem], gpu, prec, backend="trtllm", expert_parallel=ep, attention_dp=adp)
        if not pytorch_backend(r):
            # TensorRT engine + C++ executor: no Python per-request host work (see pytorch_backend)
            pm.eff = replace(pm.eff, decode_seq_overhead_s=0.0)
        tp, isl, osl = int(r["tp"]), int(r["isl"]), int(r["osl"])
        max_batch, max_tokens = trtllm_bench_settings(pm, isl, osl, tp)
        # attention DP: every rank schedules its own requests up to max_batch_size / max_num_tokens
        dp = tp if adp else 1
        pt = None
        if max_batch:
            pt = trtllm_bench_throughput(pm, isl, osl, tp, max_batch * dp, max_tokens * dp,
                                         trtllm_kv_capacity_tokens(pm, tp, max_num_tokens=max_tokens),
                                         num_requests=TRTLLM_BENCH_NUM_REQUESTS.get((isl, osl)))
        measured = float(r["per_gpu_output_tok_s"])
        if pt is None:
            not_fit += 1
            details.append({**_key(r), "measured": measured, "predicted": None})
            continue
        e = abs(pt.output_tokens_per_s_per_gpu - measured) / measured * 100
        errs.append(e)
        by_gpu.setdefault(gpu.name, []).append(e)
        by_prec.setdefault(prec, []).append(e)
        by_version.setdefault(r.get("trtllm_version") or "?", []).append(e)
        details.append({**_key(r), "measured": measured, "predicted": round(pt.output_tokens_per_s_per_gpu, 1),
                        "batch": pt.batch, "abs_pct_error": round(e, 1)})
    out = {
        "rows": len(errs),
        "skipped": skipped,
        "not_fit": not_fit,
        "median_abs_pct_error": _r(statistics.median(errs)) if errs else None,
        "p90_abs_pct_error": _r(_pct(errs, 0.9)),
        "by_gpu": {g: _summary(v) for g, v in sorted(by_gpu.items())},
        "by_precision": {p: _summary(v) for p, v in sorted(by_prec.items())},
        "by_trtllm_version": {p: _summary(v) for p, v in sorted(by_version.items())},
    }
    return out, details


def sweep_seconds(path: Path) -> float:
    """Wall time of one model's full sweep: 4 x 4 TPs for every ISL/OSL pair in the table (Llama-3.1-70B,
    H100-SXM, fp8)."""
    pairs = sorted({(int(r["isl"]), int(r["osl"])) for r in csv.DictReader(Path(path).open())})
    m = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json")
    t0 = time.perf_counter()
    for isl, osl in pairs:
        try:
            tune(m, "H100-SXM", SloSpec(ttft_p90_ms=5000, itl_p90_ms=100),
                 WorkloadSpec(isl_tokens=isl, osl_tokens=osl), precision="fp8")
        except TuningError:
            pass
    return time.perf_counter() - t0


AIC_RESULTS = Path(__file__).resolve().parent / "results" / "perf_model_aic.json"
AIC_VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv-bench-perf" / "bin" / "python"


def aiconfigurator_side_by_side(path: Path, details: list[dict], mode: str = "cached") -> dict | None:
    """AIConfigurator's error on the rows it covered, next to ours on the same rows.

    ``mode``: ``off`` -> None; ``run`` -> run bench/perf_model_aic.py in the optional venv
    ``.venv-bench-perf`` first (skipped, with a note, when that venv is absent; ~7 s per row); ``cached`` ->
    read ``bench/results/perf_model_aic.json`` from an earlier run (None when absent or for another table).
    """
    if mode == "off":
        return None
    if mode == "run":
        if not AIC_VENV_PYTHON.is_file():
            return {"note": f"aiconfigurator not installed ({AIC_VENV_PYTHON} missing); skipped"}
        subprocess.run([str(AIC_VENV_PYTHON), str(Path(__file__).with_name("perf_model_aic.py")), "--table",
                        str(path), "--out", str(AIC_RESULTS)], check=True, stdout=subprocess.DEVNULL)
    if not AIC_RESULTS.is_file():
        return None
    aic = json.loads(AIC_RESULTS.read_text())
    if aic.get("table") != Path(path).name:
        return None
    ours = {tuple(d[k] for k in KEY_FIELDS): d for d in details}
    mine, theirs = [], []
    for d in aic["details"]:
        o = ours.get(tuple(d[k] for k in KEY_FIELDS))
        if d.get("predicted") and o and o.get("predicted"):
            theirs.append(abs(d["predicted"] - d["measured"]) / d["measured"] * 100)
            mine.append(o["abs_pct_error"])
    return {"tool": aic["tool"], "rows_sampled": aic["rows"], "covered": aic["covered"],
            "coverage_pct": _r(100 * aic["covered"] / aic["rows"]) if aic["rows"] else None,
            "median_abs_pct_error": _r(statistics.median(theirs)) if theirs else None,
            "p90_abs_pct_error": _r(_pct(theirs, 0.9)),
            "ours_on_same_rows": {"rows": len(mine), "median_abs_pct_error": _r(statistics.median(mine))
                                  if mine else None, "p90_abs_pct_error": _r(_pct(mine, 0.9))},
            "wall_s": aic.get("wall_s")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, required=True,
                    help="CSV with the columns of trtllm_throughput_dev.csv (source, model, gpu, precision, tp, isl, "
                         "osl, per_gpu_output_tok_s, ...): the TensorRT-LLM table docs/benchmarks.md describes")
    ap.add_argument("--out", type=Path, help="also write the JSON line (+ per-row details) here")
    ap.add_argument("--aiconfigurator", choices=("cached", "run", "off"), default="cached",
                    help="side-by-side AIConfigurator numbers: from the last run (default), run now, or none")
    ap.add_argument("--moe-mapping", choices=sorted(MOE_MAPPINGS), default="tp",
                    help="mapping of the 1.0-era MoE rows on > 1 GPU (see MOE_MAPPINGS); default plain TP")
    a = ap.parse_args(argv)
    if not a.table.is_file():
        ap.error(f"--table {a.table} does not exist")
    out, details = evaluate_table(a.table, a.moe_mapping)
    out["moe_mapping"] = a.moe_mapping
    out["sweep_s"] = round(sweep_seconds(a.table), 3)
    out["aiconfigurator"] = aiconfigurator_side_by_side(a.table, details, a.aiconfigurator)
    out["model_notes"] = MODEL_NOTES
    print_json_line(out, a.out)
    if a.out:
        a.out.with_suffix(".rows.json").write_text(json.dumps(details, indent=0))
    return 0


KEY_FIELDS = ("model", "gpu", "precision", "tp", "isl", "osl")
MODEL_NOTES = {'validation_table_seen': True,
 'fitted_on': 'aiconfigurator_silicon_sample.csv only (python -m runtime.tracking.perf_fit)',
 'model_terms': ['all-reduce: NCCL tuning.cc protocol choice (LL vs Simple latencies) at nccl-tests bus bandwidth',
                 'fit: decode batch capped by KV capacity, closed-loop KV wait in TTFT',
                 'fit: attention-kernel efficiencies per serving backend, attention <= 0.75 (FlashAttention-3)',
                 'fused-MoE efficiency of the expert GEMMs (fitted), GEMM half-efficiency rows >= 64 (tile size)',
                 'NVFP4 MLA checkpoints: attention projections in FP8 (nvidia DeepSeek-R1 NVFP4 model cards)',
                 "trtllm-bench run model (throughput.trtllm_bench_throughput): the page's num_requests identical "
                 'requests queued at once, admitted while their ISL+OSL KV fits (GUARANTEED_NO_EVICT), run in '
                 'cycles whose prompts are prefilled in max_num_tokens chunks behind the generation tokens (FCFS '
                 'chunked context), last cycle partial; replaces the endless steady state with piggy-backed '
                 'prompt tokens',
                 'device memory = what the driver reports (GpuSpec.cuda_memory_bytes: H100 81559 MiB, H200 143771 '
                 'MiB nvidia-smi; B200 178.35 GiB, GB200 184.31 GiB cudaMemGetInfo), not the marketing GiB',
                 'per-backend KV memory rule in PerfModel (model.KV_MEMORY_RULES): TensorRT-LLM KV = '
                 'free_gpu_memory_fraction 0.9 x (memory - weights - activations - reserve), vLLM/SGLang a '
                 "fraction of the total; the calibration fit sizes each silicon row with its own engine's rule",
                 'calibration: one fitted fixed TTFT latency per silicon-sample deployment '
                 '(model|system|backend|version, 53 constants, runtime.perf.fit.deployment) replaces the '
                 "per-backend prefill overhead in the fit; the backend's prefill_overhead_s is the median of its "
                 "deployments' constants (TTFT predictions only; the throughput prediction uses TPOT-side terms). "
                 'Evidence from the sample alone: B200 TensorRT-LLM TTFT at concurrency 4, ISL 1024, TP8: '
                 'Llama-3.1-70B 58-79 ms, DeepSeek-R1/V3 159-210 ms for rooflines within ~5 ms; B200 '
                 'Llama-3.1-70B TP1 ISL 8192: FP8 590 ms vs NVFP4 395 ms needs NVFP4 GEMMs >= 0.37 of peak, the '
                 'old fit had 0.21. The fit is stable under 4 restarts (3 random; cost 125.92-125.93, fp4 '
                 '0.389-0.390)',
                 'calibration.efficiency_for: GPUs without NVLink keep DEFAULT.comm (0.7); the pooled comm (0.99) '
                 'is fitted on NVLink systems only, where vLLM / TensorRT-LLM run their own NVLink all-reduce '
                 'kernels (vLLM disables its custom all-reduce on more than two PCIe-only GPUs)',
                 'PerfModel charges memory-bound element-wise activation traffic (its own kernels, added to every '
                 'step at the memory efficiency; no new fitted parameter): per token and layer 10 hidden values '
                 '(two RMSNorms read + write, two residual adds read 2 write 1), 3 x intermediate / tp for the '
                 'gated activation, and per MoE layer top_k x 3 hidden for the expand / finalize token copies '
                 '(TensorRT-LLM expandInputRowsKernel / finalizeMoeRoutingKernel; MegaBlocks), 2 bytes each '
                 '(model.activation_bytes_per_token). Calibration cost 125.92 -> 124.89, rms log residual 0.513 '
                 '-> 0.5086 (TTFT median / p90 32.8 / 80.9 -> 32.1 / 84.3 %, TPOT 13.4 / 42.4 -> 13.4 / 41.7 %), '
                 'the same optimum from the previous solution as start; fitted compute bf16 0.64 -> 0.71, fp8 '
                 '0.49 -> 0.53, fp4 0.39 -> 0.42, memory 0.838 -> 0.854, TensorRT-LLM per-sequence decode '
                 'overhead 4.0 -> 0.4 us (the batch-proportional traffic replaces it). Table 10.34 / 30.56 -> '
                 '10.00 / 31.79 % (0.14: 8.64 / 22.12 -> 8.86 / 21.53; 1.0: 15.36 / 53.39 -> 16.45 / 57.66; bf16 '
                 "8.85 -> 8.01 median): kept on the calibration result although the table's p90 got worse; the "
                 '1.0 Qwen3-235B TP8 rows move 0.84-0.89x -> 0.73-0.77x (modelled as plain TP: each rank copies '
                 'whole hidden rows; the page ran them with EP), Qwen3-30B-A3B TP1 stays 1.5-2x too fast (its '
                 'per-sequence overhead went down with the refit)',
                 "PerfModel(expert_parallel=, attention_dp=): MoE experts split whole across the worker's GPUs "
                 '(EP = tp) and TensorRT-LLM attention data parallelism (non-expert weights replicated, each rank '
                 'its own 1/tp of the sequences, KV = whole-model KV / tp with no replicated heads, all-gather + '
                 'reduce-scatter around each MoE layer instead of the all-reduces); defaults unchanged (plain '
                 "TP), so the table and the fit are unchanged. On the silicon sample's own attention-DP + EP "
                 'decode rows (46 disaggregated TPOTs at the current fitted efficiencies) the mapping gives rms '
                 'log residual 0.228 (median ratio 0.98) against 0.751 when the same rows are modelled as plain '
                 'TP; 25 aggregated TPOTs 0.280 vs 0.362',
                 'bench --moe-mapping {tp,dep,adp,ep} for the 1.0-era MoE rows on > 1 GPU: the page runs MoE '
                 "models with '--ep $ep_size' and enable_attention_dp but gives no EP size, so the default stays "
                 'tp. Table median / p90: tp 10.00 / 31.79, dep 10.25 / 34.67, adp 9.86 / 30.49, ep 9.85 / 30.52 '
                 '(1.0-era: 16.45 / 57.66, 18.26 / 55.24, 14.36 / 49.30, 14.36 / 57.66); picking adp because it '
                 'scores best would fit the table',
                 "TensorRT-LLM's PyTorch executor prepares step i+1 on the host while the GPU runs step i (its "
                 'overlap scheduler, on by default): the per-sequence host work bounds the decode step from below '
                 'instead of adding to it (model.OVERLAP_SCHEDULER_BACKENDS, TimeBreakdown.host_s). The cost is '
                 'FIXED from a source, not fitted: NVIDIA/TensorRT-LLM PR #10273 (GB200, gpt-oss-120b, 1536 '
                 "requests per rank: 'average per iteration host_step_time is 45.11 ms', 29.4 us per request on a "
                 'Grace host), over the Grace/x86 slowdown of PyTorch host calls from NVIDIA/TransformerEngine '
                 'issue #2053 (nn.Linear forward CPU time GB200 37.08 us vs DGX H100 13.48 us): 10.7 us per '
                 "request on x86, 29.4 us on GB200/GB300/GH200 (gpus.GRACE_HOSTED). The sample's TensorRT-LLM "
                 'steps (batches <= 256) are GPU-bound for any value up to ~60 us (rms 0.5085-0.5087 at 1-60 us, '
                 "0.5095 at 100 us), so the fit cannot size it. Only the table's PyTorch-backend rows (the "
                 "1.0-era page: 'Starting with v0.19, testing was performed using the PyTorch backend') carry it; "
                 'the 0.14 rows ran engines under the C++ executor. Calibration cost 124.887 -> 124.911, rms '
                 '0.5086 -> 0.5088 (the free additive 0.38 us per-sequence term is gone; MoE efficiency 0.747 -> '
                 '0.773). Table 10.00 / 31.79 -> 10.06 / 31.44 % (1.0-era 16.45 / 57.66 -> 16.25 / 55.26; GB200 '
                 '18.26 / 85.75 -> 12.86 / 68.16): the Qwen3-30B-A3B FP4 TP1 rows at batches of 1000-4096 go from '
                 '1.1-4.8x to 1.1-2.3x too fast; Llama-4 Scout TP1 (batches 200-600) stays GPU-bound and ~1.4x '
                 'fast'],
 'findings': ['the TensorRT-LLM KV-read efficiency (0.71) is NOT pulled down by the MLA rows: with MLA on its own '
              'factor it stays 0.71. The two large TensorRT-LLM 1.0.0rc3 H100 groups set it: Llama-3.1-8B BF16 '
              '(177 TPOTs, pred/meas 1.055) wants faster KV reads, Qwen/Qwen3-32B at FP8 GEMMs (176, pred/meas '
              '0.94) slower. Qwen/Qwen3-32B is the BF16 checkpoint quantised by the engine; without a '
              "kv_cache_quant_algo in the checkpoint TensorRT-LLM's 'auto' KV dtype would be BF16, i.e. twice the "
              'KV bytes the model charges for FP8 rows. Not adopted: the sample has no KV-dtype column, and '
              "'every row at BF16 KV' fits worse (rms 0.5936 against 0.513); a per-checkpoint KV dtype rule needs "
              'the aiconfigurator run configs',
              'DeepSeek-R1 and DeepSeek-V3 (same architecture) have opposite TensorRT-LLM TPOT residuals (R1 '
              '1.1-1.4x slow on B200, V3 0.7-0.85x fast on B200/GB200/GB300/H200): a per-deployment difference '
              '(MTP, attention DP, versions), not an MLA kernel efficiency',
              '1.0 MoE rows at TP1 on Blackwell FP4 (Qwen3-30B-A3B, Llama-4 Scout) stay the p90 drivers; a '
              'sourced candidate not yet modelled: memory-bound MoE activation traffic outside the GEMMs (router '
              'top-k, token permute / un-permute, gated activation, finalize-reduce: ~top_k x (2 hidden + 3 '
              'moe_intermediate) x 2 B per token and MoE layer, ~5 MB per token for Qwen3-30B-A3B over 48 layers, '
              "~2.5 ms per step at batch 4096 on B200 against ~2 ms of NVFP4 weight reads), which the sample's "
              'batches (<= 512) can hardly size'],
 'alternatives_not_adopted': ["1.0-era rows at kv_cache_free_gpu_mem_fraction 0.95 (the page: 'in many cases'): "
                              '1.0 p90 58.5 -> 60.0',
                              'CUDA-graph padding of generation-only steps to the 1.0 llm_options.yml batch '
                              'sizes: 1.0 p90 58.5 -> 55.0 but overall median 9.68 -> 9.92, p90 36.09 -> 36.36',
                              '(rms figures below compare with 0.5229, the deployment-constant fit while the '
                              'constants were bounded by 5 s; with the final 60 s bound, which no constant '
                              'reaches, it is 0.513)',
                              'fused-MoE efficiency per compute class: fp4 MoE fitted ~1.0, no calibration gain '
                              '(rms 0.5229 -> 0.5233)',
                              'compute classes per GPU generation (Hopper / Blackwell): rms 0.7089 -> 0.7026, '
                              'NVFP4 stays 0.209',
                              'GEMM half-efficiency rows per compute class: free, the fit keeps fp4 at ~66 rows; '
                              "fp4 bounded below by 300 or 800 rows (vLLM PR #20646's B200 NVFP4 CUTLASS "
                              'benchmark, N=6144 K=4096, fits h ~ 800 vs bf16 ~ 150-190): calibration rms 0.7216 '
                              '/ 0.7279 (worse), fp4 compute 0.60 / 1.0, table fp4 p90 87 / 108 %',
                              'TTFT observations only at concurrency <= 4 / 8 / 16 instead of deployment '
                              'constants: fp4 compute 0.25-0.26, table median 12.1-13.2 %',
                              'deployment key without the backend version: rms 0.5985 (vs 0.5229), fp4 0.267',
                              'prefill-attention efficiency bounded below by 0.5 (FlashAttention-2: 50-73% of '
                              'A100 peak): rms 0.5319 vs 0.5229 (the sample does not ask for it); table 9.90 / '
                              '32.25 % - not adopted, it would be chosen by the table',
                              'a separate MLA attention efficiency: the optimiser ends at a higher cost than '
                              'without it (128.6 vs 128.3: non-convex), dropped',
                              "every silicon row at bf16 KV (the engines' 'auto' KV dtype for checkpoints without "
                              'KV scales): rms 0.5936 vs 0.513, dropped',
                              '1.0 rows without chunked prefill (trtllm-bench get_settings: '
                              'enable_chunked_prefill defaults to False, max_num_tokens >= max ISL + max batch): '
                              '1.0 median 15.3 -> 17.3 %, p90 ~same; not sure the 1.0 release had that default, '
                              'dropped',
                              '0.95 KV fraction on the 1.0 rows again: 10.13 / 30.62 % (no change), dropped',
                              '(compared with the fit without them: calibration cost / unweighted rms log '
                              'residual 125.92 / 0.513; table 10.34 / 30.56 %; measured without the '
                              'activation-traffic term)',
                              'MLA decode attention charged for whole 64-row tensor-core tiles (FlashMLA packs '
                              's_q * h_q / h_kv query rows into kBlockM = 64 blocks, deepseek-ai/FlashMLA README '
                              'get_mla_metadata; TP8 = 16 heads per rank = 4x the useful FLOPs): calibration '
                              'WORSE, cost 125.92 -> 126.45 (same optimum from the old solution as start), rms '
                              '0.513 -> 0.5167, TTFT median 32.8 -> 33.2 %; fp4 compute 0.39 -> 0.30-0.34, '
                              'TensorRT-LLM attention 0.17 -> 0.29, KV-read 0.71 -> 0.83-0.88; dropped on the '
                              'calibration result (table not run)',
                              'one shared KV-read efficiency for the MLA decode kernels (Efficiency.mla_kv_memory '
                              "replacing the backend's kv_memory on DeepSeek rows; FlashMLA / trtllm-gen MLA are "
                              'other kernels than GQA paged attention): cost 125.92 -> 125.64 with one more '
                              'parameter, rms 0.513 -> 0.5134, TPOT median 13.41 -> 13.03 %; fitted mla_kv 0.35, '
                              'but the TensorRT-LLM GQA KV-read efficiency only moved 0.706 -> 0.713 and the '
                              'per-family TPOT residuals did not change (DeepSeek-R1 trtllm pred/meas 1.25 -> '
                              '1.28, DeepSeek-V3 trtllm 0.82 -> 0.85, Llama-3.1-8B trtllm 1.055 -> 1.048). Table '
                              '9.66 / 30.79 % (1.0 p90 53.4 -> 65.8: the shared memory / moe factors shifted, MoE '
                              'rows faster). Within fit noise and not the effect it was meant to fix: dropped',
                              "refit with the silicon sample's attention-DP rows admitted (+78 TPOTs): rms 0.5086 "
                              '-> 0.5062, TensorRT-LLM KV-read 0.694 -> 0.763, attention 0.20 -> 0.27; table tp '
                              '9.63 / 33.65 (1.0-era p90 57.66 -> 61.2): median better, p90 worse; not adopted',
                              'MoE activation traffic outside the GEMMs (findings): already charged by '
                              'activation_bytes_per_token (8.45 MB per token for Qwen3-30B-A3B at TP1); the '
                              'uncharged remainder (finalize output write, router logits) is ~2 %',
                              'the Grace-host 29.4 us per request on every host: rms 0.5085, table 10.39 / 33.12 '
                              '% with the 0.14 rows (Mixtral TP8 0.14 rows host-bound at 0.48-0.53x) and 10.10 / '
                              '31.98 % without: the source is a Grace host',
                              'the fixed per-step overhead overlapped too (max(kernels, o_d + n o_s)): '
                              'calibration worse (rms 0.5096, o_d 0.86 -> 2.5 ms); table not run',
                              'TensorRT-LLM KV-read efficiency pinned at 0.8 / 0.9 / 1.0 (the KV-bound 8B rows at '
                              '0.71-0.75x want it faster): rms 0.5089 / 0.5089 / 0.5097 vs 0.5087 free at 0.69; '
                              'no source for a bound, table not run',
                              "SGLang's overlap scheduler (on by default since v0.4, "
                              "'--disable-overlap-schedule') modelled the same way, its per-sequence host cost "
                              'fitted: calibration rms 0.5088 -> 0.5093 (TPOT median 13.41 -> 13.53 %), dropped '
                              '(the table has no SGLang rows)',
                              'BF16 KV cache on the 1.0-era FP4 rows (suspect: NVFP4 checkpoints without '
                              "kv_cache_quant_algo run an 'auto' BF16 KV; no hf_quant_config of those checkpoints "
                              'at hand to check): MoE FP4 rows only 10.06 / 31.44 -> 10.00 / 31.70 % '
                              '(rows over 25 %: 110 -> 113; Qwen3-30B-A3B / Scout TP1 come in, Qwen3-235B / '
                              'Maverick TP8 go further out), every FP4 row 10.48 / 33.07 %: not the cause of the '
                              'TP1 MoE gap, nothing adopted'],
 'known_errors': ['0.14 Llama-70B FP8 TP1 on H100 (batch 8-24, 1.5-1.8x too fast on decode-heavy rows): the FP16 '
                  'TP2 rows with the same ~71 GB of weights per GPU and the same batches are within 0.89-1.07 '
                  '(except 2048/2048, 1.9-2.4x, out of line with their own neighbours), so the KV capacity is not '
                  'the culprit; the prefill-heavy FP8 TP1 rows (2048/128, 128/128) are within 7%, which leaves '
                  'small-batch FP8 decode GEMMs of that release (its page lists the unfused FP8 gated-MLP as a '
                  'known issue) - not fitted',
                  '0.14 TP4/TP8 long-output rows (1.25-1.6x too fast): the implied batch is 20-60% of the KV '
                  'limit even with 50+ GB free per GPU, so not a fixed memory overhead; 0.14-era decode attention '
                  'may be slower than the 1.0-era kernels of the calibration set (not fitted: that would fit the '
                  'table)',
                  '1.0 H100 Llama-4 Scout TP4 / Maverick TP8 (EP + attention DP on the page): 1.4-2.4x too fast, '
                  'implied batch ~1/3 of the KV limit while the H200 rows of the same models are close',
                  'Qwen3-30B-A3B TP1 on B200/GB200: 1.3-4.2x too fast; GB200 (Grace host) measures below B200 at '
                  '128/128, which points at host (CPU) overhead of the PyTorch backend at batches of 1000-4096',
                  'dense NVFP4 on Blackwell 0.6-0.75x: the pooled fp4 compute efficiency (~0.21) of the '
                  'calibration set',
                  "TensorRT-LLM KV-read efficiency: the sample's dense TPOTs (Llama-3.1-8B H100 bf16, "
                  'Llama-3.1-70B H200 fp8) are predicted 6-16% slow and its DeepSeek decode rows 19-33% fast; one '
                  'shared factor leaves KV-bound 7-8B rows of the table at 0.75-0.9x',
                  '1.0 MoE at TP1 on Blackwell FP4 (Qwen3-30B-A3B 1.2-2.4x, Llama-4 Scout 1.1-1.65x too fast; '
                  'GB200 below B200 at 128/128): host-side per-request work of the PyTorch backend at batches of '
                  '1000-4096 is the suspect; the sample (batches <= 256-512) cannot size it',
                  '1.0 Llama-4 on H100 (Scout TP4 1.4x, Maverick TP8 2x too fast; H200 within 10%): the 1.0 page '
                  'lists no FP8 Scout checkpoint, so which weights ran is unknown',
                  '0.14 H100 FP8 TP1 Llama-70B (1.6x) and H100 FP16 TP4/TP8 (1.2-1.3x)']}


def _key(r: dict) -> dict:
    return {k: r[k] for k in KEY_FIELDS}


if __name__ == "__main__":
    from runtime.procs import install_sigterm_handler

    install_sigterm_handler()  # SIGTERM stops the servers/subprocesses this run started, like Ctrl-C
    raise SystemExit(main())
