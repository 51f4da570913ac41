"""Performance profiles the SLA planner and the fleet simulator read: per-replica prefill time by
ISL and decode step time by (batch, context), tabulated once from the performance model.

Build them with :func:`build_profile` from anything with the ``runtime.perf.model.PerfModel``
methods ``prefill_time_s(isl_tokens, tp, batch)`` (and, optionally, ``prefill_busy_s``), ``decode_step_time_s(batch, context_tokens, tp)``
and ``kv_capacity_tokens(tp, gpu_memory_utilization)`` (the PERF engineer's roofline +
calibration; this module adds no performance formula of its own). Lookups interpolate linearly
(numpy.interp), like Dynamo's profiling interpolators (``prefill_interpolator`` /
``decode_interpolator``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

ISL_GRID_TOKENS = (1, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 32768)
CONTEXT_GRID_TOKENS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
BATCH_GRID = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class PerfLike(Protocol):
    def prefill_time_s(self, isl_tokens: int, tp: int, batch: int = 1) -> float: ...

    # optional: ``prefill_busy_s(isl_tokens, tp, batch)`` (engine occupancy); without it busy = latency

    def decode_step_time_s(self, batch: int, context_tokens: int, tp: int) -> float: ...

    def kv_capacity_tokens(self, tp: int, gpu_memory_utilization: float = 0.9) -> int: ...


@dataclass(frozen=True)
class PrefillProfile:
    """Prefill of one request on one worker with TP ``tp`` (batch 1), by ISL: ``time_s`` its latency
    (TTFT without queueing), ``busy_s`` how long it occupies the worker (``PerfModel.prefill_busy_s``:
    the fixed API-side latency overlaps the next prefill). ``busy_s`` None: the same as ``time_s``."""

    tp: int
    isl_grid_tokens: tuple[int, ...]
    time_s: tuple[float, ...]
    busy_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.busy_s is not None and len(self.busy_s) != len(self.isl_grid_tokens):
            raise ValueError(f"PrefillProfile.busy_s has {len(self.busy_s)} points for {len(self.isl_grid_tokens)} ISLs")
        if self.busy_s is not None and any(not 0 < b <= t * (1 + 1e-9) for b, t in zip(self.busy_s, self.time_s)):
            raise ValueError("PrefillProfile.busy_s must be > 0 and <= time_s at every ISL (occupancy is part of the latency)")

    def _interp(self, ys: tuple[float, ...], isl_tokens: float | np.ndarray) -> float | np.ndarray:
        x = np.asarray(self.isl_grid_tokens, dtype=float)
        y = np.asarray(ys, dtype=float)
        isl = np.asarray(isl_tokens, dtype=float)
        out = np.interp(isl, x, y)
        # linear extrapolation past the last grid point (compute grows at least linearly)
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        out = np.where(isl > x[-1], y[-1] + slope * (isl - x[-1]), out)
        return float(out) if np.ndim(out) == 0 else out

    def prefill_time_s(self, isl_tokens: float | np.ndarray) -> float | np.ndarray:
        """Seconds from start to first token for ``isl_tokens`` (scalar or array), linear
        interpolation/extrapolation."""
        return self._interp(self.time_s, isl_tokens)

    def busy_time_s(self, isl_tokens: float | np.ndarray) -> float | np.ndarray:
        """Seconds the prefill of ``isl_tokens`` (scalar or array) occupies the worker (<= the latency)."""
        return self._interp(self.time_s if self.busy_s is None else self.busy_s, isl_tokens)

    def tokens_per_s(self, isl_tokens: float) -> float:
        """Prefill throughput of one busy worker at this ISL, tokens/s."""
        return float(isl_tokens) / float(self.busy_time_s(isl_tokens))


@dataclass(frozen=True)
class DecodeProfile:
    """Decode step time of one worker with TP ``tp`` by (context, batch); KV capacity per worker."""

    tp: int
    context_grid_tokens: tuple[int, ...]
    batch_grid: tuple[int, ...]
    step_time_s: tuple[tuple[float, ...], ...]  # [context][batch]
    kv_capacity_tokens: int
    max_num_seqs: int = 512

    def step_s(self, batch: float, context_tokens: float) -> float:
        """Seconds per decode step (= ITL) at ``batch`` running sequences of mean ``context_tokens``."""
        b = min(max(float(batch), 1.0), float(self.batch_grid[-1]))
        table = np.asarray(self.step_time_s, dtype=float)
        per_ctx = np.array([np.interp(b, self.batch_grid, row) for row in table])
        return float(np.interp(float(context_tokens), self.context_grid_tokens, per_ctx))

    def step_s_array(self, batch: np.ndarray, context_tokens: float) -> np.ndarray:
        """Vectorised :meth:`step_s` over an array of batch sizes at one context length."""
        table = np.asarray(self.step_time_s, dtype=float)
        ctx = float(context_tokens)
        cg = np.asarray(self.context_grid_tokens, dtype=float)
        j = int(np.clip(np.searchsorted(cg, ctx) - 1, 0, len(cg) - 2))
        w = float(np.clip((ctx - cg[j]) / (cg[j + 1] - cg[j]), 0.0, 1.0))
        row = (1 - w) * table[j] + w * table[j + 1]
        b = np.clip(np.asarray(batch, dtype=float), 1.0, float(self.batch_grid[-1]))
        return np.interp(b, self.batch_grid, row)

    def max_batch(self, itl_target_s: float, context_tokens: float, seq_tokens: float) -> int:
        """Largest running batch whose step time is <= ``itl_target_s`` and whose KV
        (``batch * seq_tokens``) fits; 0 if even batch 1 misses the target or does not fit."""
        kv_cap = int(self.kv_capacity_tokens // max(seq_tokens, 1.0))
        hi = min(self.max_num_seqs, kv_cap)
        if hi < 1 or self.step_s(1, context_tokens) > itl_target_s:
            return 0
        lo = 1
        while lo < hi:  # binary search on a monotone step time
            mid = (lo + hi + 1) // 2
            if self.step_s(mid, context_tokens) <= itl_target_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def tokens_per_s(self, itl_target_s: float, context_tokens: float, seq_tokens: float) -> float:
        """Decode throughput of one worker at its largest SLO-meeting batch, tokens/s (0 if none)."""
        b = self.max_batch(itl_target_s, context_tokens, seq_tokens)
        return 0.0 if b == 0 else b / self.step_s(b, context_tokens)


@dataclass(frozen=True)
class ServiceProfile:
    """Prefill profile at the prefill TP, decode profile at the decode TP, and a prefill profile at
    the decode TP (aggregated serving prefills on decode workers)."""

    prefill: PrefillProfile
    decode: DecodeProfile
    agg_prefill: PrefillProfile


def _prefill_profile(perf: PerfLike, tp: int) -> PrefillProfile:
    times = tuple(float(perf.prefill_time_s(int(isl), tp, 1)) for isl in ISL_GRID_TOKENS)
    busy_fn = getattr(perf, "prefill_busy_s", None)  # a stand-in without it: occupancy = latency
    busy = None if busy_fn is None else tuple(float(busy_fn(int(isl), tp, 1)) for isl in ISL_GRID_TOKENS)
    return PrefillProfile(tp=tp, isl_grid_tokens=ISL_GRID_TOKENS, time_s=times, busy_s=busy)


def build_profile(
    perf: PerfLike,
    prefill_tp: int,
    decode_tp: int,
    *,
    gpu_memory_utilization: float = 0.9,
    max_num_seqs: int = 512,
) -> ServiceProfile:
    """Tabulate a :class:`ServiceProfile` from a performance model.

    Raises ValueError naming ``prefill_tp`` / ``decode_tp`` when the model does not fit at that TP
    (``kv_capacity_tokens`` is 0: a worker that could not start).
    """
    if int(perf.kv_capacity_tokens(prefill_tp, gpu_memory_utilization)) <= 0:
        raise ValueError(f"prefill_tp={prefill_tp}: the model leaves no KV-cache room on this GPU")
    kv = int(perf.kv_capacity_tokens(decode_tp, gpu_memory_utilization))
    if kv <= 0:
        raise ValueError(f"decode_tp={decode_tp}: the model leaves no KV-cache room on this GPU")
    steps = tuple(
        tuple(float(perf.decode_step_time_s(b, ctx, decode_tp)) for b in BATCH_GRID) for ctx in CONTEXT_GRID_TOKENS
    )
    decode = DecodeProfile(
        tp=decode_tp,
        context_grid_tokens=CONTEXT_GRID_TOKENS,
        batch_grid=BATCH_GRID,
        step_time_s=steps,
        kv_capacity_tokens=kv,
        max_num_seqs=max_num_seqs,
    )
    return ServiceProfile(
        prefill=_prefill_profile(perf, prefill_tp), decode=decode, agg_prefill=_prefill_profile(perf, decode_tp)
    )


def analytic_profile(
    *,
    prefill_s_per_token: float,
    decode_base_s: float,
    decode_s_per_seq: float,
    kv_capacity_tokens: int,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    max_num_seqs: int = 512,
) -> ServiceProfile:
    """A hand-checkable profile: prefill time ``isl * prefill_s_per_token`` (both TPs), decode step
    ``decode_base_s + batch * decode_s_per_seq`` at every context. Linear, so interpolation is exact.
    For tests and worked examples; real deployments use :func:`build_profile`."""
    pre = PrefillProfile(
        tp=prefill_tp, isl_grid_tokens=ISL_GRID_TOKENS, time_s=tuple(i * prefill_s_per_token for i in ISL_GRID_TOKENS)
    )
    agg = PrefillProfile(tp=decode_tp, isl_grid_tokens=ISL_GRID_TOKENS, time_s=pre.time_s)
    row = tuple(decode_base_s + b * decode_s_per_seq for b in BATCH_GRID)
    dec = DecodeProfile(
        tp=decode_tp,
        context_grid_tokens=CONTEXT_GRID_TOKENS,
        batch_grid=BATCH_GRID,
        step_time_s=tuple(row for _ in CONTEXT_GRID_TOKENS),
        kv_capacity_tokens=kv_capacity_tokens,
        max_num_seqs=max_num_seqs,
    )
    return ServiceProfile(prefill=pre, decode=dec, agg_prefill=agg)
