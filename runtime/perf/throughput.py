"""Steady-state maximum throughput of aggregated serving (in-flight batching with chunked prefill).

With ``B`` sequences in flight, each of ISL ``isl`` and OSL ``osl``, every iteration emits ``B`` tokens and,
on average, prefills ``B * isl / osl`` prompt tokens (each sequence is replaced by a new prompt every ``osl``
iterations). Mean context is ``isl + osl / 2``. Throughput = ``B / mixed_step_time_s(B, ...)`` tokens/s per
worker; the maximum is searched over ``B`` up to the KV-cache limit ``kv_capacity / (isl + osl)`` and
``max_batch`` (TensorRT-LLM / vLLM ``max_num_seqs``), and over per-iteration tokens ``<= max_num_tokens``.
This is the steady state the tuner assumes (requests arriving at random times).

TensorRT-LLM's ``trtllm-bench`` max-throughput tables (perf-overview.md) are measured differently: a FINITE
dataset of ``num_requests`` identical requests is queued at once and the run's throughput is total output
tokens over total time. :func:`trtllm_bench_throughput` models that run from the documented scheduler
(cycles of concurrent requests, chunked context, the last partial cycle); see its docstring.

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
    free = perf.gpu.cuda_memory_bytes * tp - m.num_params * bytes_per_param  # tuning.py get_device_memory()
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
    """KV capacity as TensorRT-LLM sizes it, whatever ``perf.backend`` is: ``kv_cache_free_gpu_mem_fraction``
    (default 0.9) of the memory still free after weights, activations at ``max_num_tokens`` and runtime
    reserve (TensorRT-LLM docs, "Memory Usage of TensorRT-LLM"; the "of_free" rule of
    ``runtime.perf.model.KV_MEMORY_RULES``, which ``PerfModel(..., backend="trtllm").kv_capacity_tokens``
    applies at 8192 tokens)."""
    mb = perf.memory_breakdown(tp, 1.0, max_num_tokens=max_num_tokens)
    if mb.kv_bytes <= 0:
        return 0
    return int(mb.kv_bytes * free_fraction // perf.kv_bytes_per_token_rank(tp))


def bench_cycle_s(perf: PerfModel, isl: int, osl: int, tp: int, batch: int, max_num_tokens: int) -> float:
    """Seconds for ``batch`` identical requests (ISL ``isl``, OSL ``osl``) admitted together to finish, when the
    previous cycle's requests are finishing at the same time (a saturated ``trtllm-bench`` run).

    TensorRT-LLM's in-flight batching scheduler schedules generation tokens first and fills the rest of the
    per-iteration token budget (``max_num_tokens``) with context chunks, first come first served (TensorRT-LLM
    docs, "Tuning Max Batch Size and Max Num Tokens": the scheduler visualisation and "Revisiting Paged Context
    Attention and Context Chunking"; trtllm-bench runs ``ContextChunkingPolicy.FIRST_COME_FIRST_SERVED`` with
    chunking on, ``tensorrt_llm/bench/run/dataclasses.py``). Requests of one cycle are admitted at the same
    iteration, so their prompts (``batch * isl`` tokens) are prefilled in ``K = ceil(batch * isl /
    (max_num_tokens - batch))`` context-carrying iterations, each also carrying ``batch`` generation tokens,
    and the remaining ``osl - K`` iterations are generation only:

        cycle = K * mixed_step(batch, chunk = batch * isl / K) + (osl - K) * decode_step(batch)

    at the mean context ``isl + osl / 2``. When ``K > osl`` the run is context-bound: ``K`` mixed iterations with
    ``batch * osl / K`` generation tokens each. Unlike the steady state of :func:`agg_throughput`, the prompt
    tokens arrive in bursts, so they cannot all ride along for free on memory-bound decode iterations.

    Raises:
        ValueError: batch < 1 or max_num_tokens <= batch.
    """
    if batch < 1 or max_num_tokens <= batch:
        raise ValueError(f"need 1 <= batch < max_num_tokens, got batch={batch}, max_num_tokens={max_num_tokens}")
    ctx = isl + max(1, osl // 2)
    prompt_tokens = batch * isl
    k = math.ceil(prompt_tokens / (max_num_tokens - batch))
    if k <= osl:
        t = k * perf.mixed_step_breakdown(batch, ctx, prompt_tokens / k, isl, tp).total_s
        if osl > k:
            t += (osl - k) * perf.decode_breakdown(batch, ctx, tp).total_s
        return t
    gen = max(1, round(batch * osl / k))
    return k * perf.mixed_step_breakdown(gen, ctx, prompt_tokens / k, isl, tp).total_s


def trtllm_bench_throughput(
    perf: PerfModel,
    isl: int,
    osl: int,
    tp: int,
    max_batch: int,
    max_num_tokens: int,
    kv_capacity_tokens: int,
    num_requests: int | None = None,
) -> ThroughputPoint | None:
    """Output tokens/s of one ``trtllm-bench throughput`` run of ``num_requests`` identical requests, or None
    when not one request fits.

    The run (TensorRT-LLM perf-overview.md, 0.14 and 1.0: "a local inference client is fed requests at an
    infinite rate", uniform ISL/OSL from ``prepare_dataset.py ... --input-stdev=0 --output-stdev=0``,
    ``$num_requests`` per ISL/OSL listed there; reported throughput = output tokens / total latency):

    * concurrency ``B = min(max_batch, kv_capacity_tokens // (isl + osl), max_num_tokens / (1 + isl/osl),
      num_requests)``: the default GUARANTEED_NO_EVICT capacity scheduler admits a request only when the KV
      blocks for its whole ISL + OSL are free (TensorRT-LLM docs, "Useful Runtime Options": capacity scheduler
      policy; trtllm-bench sets ``IFBSchedulingPolicy.NO_EVICT``) and never beyond ``max_batch_size``;
    * the requests run in ``ceil(N / B)`` cycles (:func:`bench_cycle_s`): identical requests admitted together
      finish together and free their blocks together; the last cycle holds the ``N mod B`` left over;
    * ``num_requests=None``: an endless run, i.e. every cycle full.

    Returns the point with ``batch = B``, ``step_s`` = the decode iteration (ITL) at ``B``.
    """
    if tp > perf.gpu.num_gpus_per_node:
        return None
    b = min(max_batch, kv_capacity_tokens // (isl + osl), int(max_num_tokens / (1 + isl / osl)))
    if num_requests is not None:
        if num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {num_requests}")
        b = min(b, num_requests)
    if b < 1:
        return None
    if num_requests is None:
        n, total_s = b, bench_cycle_s(perf, isl, osl, tp, b, max_num_tokens)
    else:
        n = num_requests
        full, last = divmod(n, b)
        total_s = full * bench_cycle_s(perf, isl, osl, tp, b, max_num_tokens)
        if last:
            total_s += bench_cycle_s(perf, isl, osl, tp, last, max_num_tokens)
    tps = n * osl / total_s
    step = perf.decode_breakdown(b, isl + max(1, osl // 2), tp).total_s
    return ThroughputPoint(tps, tps / tp, b, step)
