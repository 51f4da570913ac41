"""Efficiency factors that turn roofline peaks into predicted times, per GPU and precision.

A roofline time is ``max(flops / (peak_flops * compute), bytes / (mem_bw * memory)) + comm_bytes /
(link_bw * comm) + overhead``. The factors here are either fitted by least squares from measured
TTFT/TPOT (``python -m runtime.perf.fit`` writes ``runtime/perf/fitted.py``) or, where no measurement
exists for a GPU+precision, the defaults below:

* ``memory = 0.8``: aiconfigurator ``systems/*.yaml`` ``mem_bw_empirical_scaling_factor`` (NVIDIA).
* ``compute = 0.6``: typical large-GEMM utilisation of dense tensor cores in inference engines
  (cuBLAS reaches ~70% of peak on H100 BF16 for large square GEMMs; attention and small GEMMs less).
* ``comm = 0.7``: NCCL ring all-reduce bus bandwidth vs NVLink per-direction peak (nccl-tests on DGX H100).
* overheads: per decode step ~2 ms and per prefill ~5 ms (scheduler, sampling, launches; order of the
  constant terms of DistServe's A100 latency fits, ../shared/data/perf/distserve_profiler-*.json).

Pure data + lookup.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    source: str = "defaults (runtime/perf/calibration.py)"


DEFAULT = Efficiency()

# Defaults per GPU where the generic ones are known to be off.
_DEFAULTS_BY_GPU: dict[str, Efficiency] = {
    # The CPU entry's peaks are already measured sustained rates (runtime/perf/gpus.py).
    "CPU": Efficiency(compute=0.8, memory=0.8, comm=1.0, decode_step_overhead_s=0.01,
                      prefill_overhead_s=0.02, source="defaults for the measured CPU entry"),
}


# Where a GPU has no measurements, the fitted factors of a measured GPU of the same generation family and
# precision are transferred (efficiencies are fractions of each GPU's own peaks, so they carry over better
# than absolute times). Blackwell parts borrow from B200, everything else from H100 SXM.
_BLACKWELL = ("B200-SXM", "GB200", "B300-SXM", "GB300", "RTX-PRO-6000")


def _reference_gpu(gpu: str) -> str:
    return "B200-SXM" if gpu in _BLACKWELL else "H100-SXM"


def efficiency_for(gpu: str, precision: str) -> Efficiency:
    """Factors for (gpu, precision), first match wins:

    1. fitted for this GPU and precision (``runtime/perf/fitted.py``);
    2. defaults for GPUs whose catalog peaks are already measured rates (CPU);
    3. fitted for the reference GPU (B200-SXM for Blackwell, else H100-SXM) and this precision, transferred;
    4. fitted for this GPU at another precision;
    5. ``DEFAULT``.

    ``gpu`` is a catalog name (runtime.perf.gpus); precision one of bf16/fp16/fp8/fp4.
    """
    from dataclasses import replace

    from runtime.perf import fitted  # generated data module; pure

    table = fitted.FITTED
    p = "bf16" if precision.lower() == "fp16" else precision.lower()
    if (gpu, p) in table:
        return table[(gpu, p)]
    if gpu in _DEFAULTS_BY_GPU:
        return _DEFAULTS_BY_GPU[gpu]
    ref = _reference_gpu(gpu)
    if (ref, p) in table:
        return replace(table[(ref, p)], source=f"transferred from the {ref} {p} fit (no {gpu} measurements)")
    same_gpu = [v for (g, _), v in sorted(table.items()) if g == gpu]
    if same_gpu:
        return same_gpu[0]
    return DEFAULT
