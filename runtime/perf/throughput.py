"""Steady-state maximum throughput of aggregated serving (in-flight batching with chunked prefill).

With ``B`` sequences in flight, each of ISL ``isl`` and OSL ``osl``, every iteration emits ``B`` tokens and,
on average, prefills ``B * isl / osl`` prompt tokens (each sequence is replaced by a new prompt every ``osl``
iterations). Mean context is ``isl + osl / 2``. Throughput = ``B / mixed_step_time_s(B, ...)`` tokens/s per
worker; the maximum is searched over ``B`` up to the KV-cache limit ``kv_capacity / (isl + osl)`` and
``max_batch`` (TensorRT-LLM / vLLM ``max_num_seqs``), and over per-iteration tokens ``<= max_num_tokens``.
This is what TensorRT-LLM's ``trtllm-bench`` max-throughput tables measure (perf-overview.md).

Pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.perf.model import PerfModel

DEFAULT_MAX_BATCH = 4096
DEFAULT_MAX_NUM_TOKENS = 16384


@dataclass(frozen=True)
class ThroughputPoint:
    """Best operating point: output tokens/s per worker and per GPU, batch, ITL of that batch (s)."""

    output_tokens_per_s: float
    output_tokens_per_s_per_gpu: float
    batch: int
    step_s: float


def agg_throughput(perf: PerfModel, isl: int, osl: int, tp: int, batch: int) -> ThroughputPoint:
    """Output throughput of one worker at a fixed in-flight batch."""
    ctx = isl + max(1, osl // 2)
    step = perf.mixed_step_breakdown(batch, ctx, batch * isl / osl, isl, tp).total_s
    tps = batch / step
    return ThroughputPoint(tps, tps / tp, batch, step)


def max_agg_throughput(
    perf: PerfModel,
    isl: int,
    osl: int,
    tp: int,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS,
    gpu_memory_utilization: float = 0.9,
    kv_capacity_tokens: int | None = None,
) -> ThroughputPoint | None:
    """The batch (power of two, or the KV limit) with the highest output tokens/s; None if nothing fits.

    ``kv_capacity_tokens`` overrides the vLLM-style capacity (e.g. TensorRT-LLM's
    ``kv_cache_free_gpu_mem_fraction`` of the memory left after weights, see :func:`trtllm_kv_capacity_tokens`).
    """
    if tp > perf.gpu.num_gpus_per_node:
        return None
    cap = perf.kv_capacity_tokens(tp, gpu_memory_utilization) if kv_capacity_tokens is None else kv_capacity_tokens
    b_max = min(max_batch, cap // (isl + osl), int(max_num_tokens / (1 + isl / osl)))
    if b_max < 1:
        return None
    batches = sorted({b for b in (2**i for i in range(13)) if b <= b_max} | {b_max})
    return max((agg_throughput(perf, isl, osl, tp, b) for b in batches),
               key=lambda p: p.output_tokens_per_s)


def trtllm_bench_settings(perf: PerfModel, isl: int, osl: int, tp: int,
                          kv_cache_gpu_mem_fraction: float = 0.95) -> tuple[int, int]:
    """``(max_batch_size, max_num_tokens)`` that ``trtllm-bench`` picks for a dataset of ISL/OSL.

    Mirrors TensorRT-LLM ``tensorrt_llm/bench/build/tuning.py`` (``calc_engine_setting`` +
    ``finetune_setting``, NVIDIA, Apache-2.0): requests that fit in ``fraction`` of (total GPU memory -
    weights) at ISL+OSL tokens each, capped at 4096; max tokens ``min(bs * (1 + isl/osl), 32768)``; then both
    rounded up (batch to 32/128/256 steps, minimum 64; tokens to 256/512/1024 steps, minimum 2048).
    Returns (0, 0) when the weights do not fit.
    """
    m = perf.model
    heads = max(tp, m.num_kv_heads)
    per_token = (m.kv_bytes_per_token(perf.kv_dtype_bytes, 1) if m.is_mla
                 else 2 * m.num_layers * heads * m.head_dim * perf.kv_dtype_bytes)
    bytes_per_param = {"fp8": 1.0, "fp4": 0.5}.get(perf.precision, 2.0)  # tuning.py BYTES_PER_ELEM
    free = perf.gpu.memory_bytes * tp - m.num_params * bytes_per_param
    requests = free * kv_cache_gpu_mem_fraction / (per_token * (isl + osl))
    if requests < 1:
        return 0, 0
    raw_bs = min(requests, 4096)
    raw_tokens = min(raw_bs * (1 + isl / osl), 32768)
    if raw_bs < 256:
        bs = max(64, 32 * math.ceil(raw_bs / 32))
    elif raw_bs < 1024:
        bs = 128 * math.ceil(raw_bs / 128)
    else:
        bs = 256 * math.ceil(raw_bs / 256)
    if raw_tokens < 4096:
        tokens = max(2048, 256 * math.ceil(raw_tokens / 256))
    elif raw_tokens < 8192:
        tokens = 512 * math.ceil(raw_tokens / 512)
    else:
        tokens = 1024 * math.ceil(raw_tokens / 1024)
    return bs, tokens


def trtllm_kv_capacity_tokens(perf: PerfModel, tp: int, free_fraction: float = 0.9,
                              max_num_tokens: int = 8192) -> int:
    """KV capacity as TensorRT-LLM sizes it: ``kv_cache_free_gpu_mem_fraction`` (default 0.9) of the memory
    still free after weights, activations and runtime reserve (TensorRT-LLM docs, "KV cache memory")."""
    mb = perf.memory_breakdown(tp, 1.0, max_num_tokens=max_num_tokens)
    if mb.kv_bytes <= 0:
        return 0
    return int(mb.kv_bytes * free_fraction // perf.model.kv_bytes_per_token(perf.kv_dtype_bytes, tp))
