"""Planner profiles: TTFT vs ISL per prefill TP, ITL (and throughput) vs batch x context per decode TP.

The same information NVIDIA Dynamo's SLA profiler hands its planner (``profile_sla.py``: prefill TTFT and
throughput per GPU vs ISL; decode ITL and throughput per GPU vs KV usage x context length), here predicted by
``runtime.perf.model.PerfModel`` (or filled from measurements by an adapter). Pure data + builders;
``runtime.tracking.profiles_io.write_profiles`` writes them as JSON.

Shapes: ``prefill[tp]`` is a list of ``PrefillPoint`` over ``isl_grid``; ``decode[tp]`` is a list of
``DecodePoint`` over ``batch_grid x context_grid`` (points whose KV does not fit are omitted).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from runtime.perf.model import PerfModel

DEFAULT_ISL_GRID = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_BATCH_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_CONTEXT_GRID = (256, 1024, 4096, 16384)


@dataclass(frozen=True)
class PrefillPoint:
    isl_tokens: int
    ttft_ms: float  # unloaded prefill time of one prompt (its TTFT without queueing or KV transfer)
    tokens_per_s_per_gpu: float  # prompt tokens per second per GPU of a busy worker (isl / busy / tp)
    busy_ms: float | None = None  # engine occupancy of that prefill (PerfModel.prefill_busy_s); None: unknown


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context_tokens: int
    itl_ms: float
    tokens_per_s_per_gpu: float
    kv_usage: float  # fraction of the worker's KV capacity in use


@dataclass
class PlannerProfiles:
    """Predicted (or measured) latency curves per TP degree; ``source`` says which."""

    model: str
    gpu: str
    precision: str
    prefill: dict[int, list[PrefillPoint]] = field(default_factory=dict)
    decode: dict[int, list[DecodePoint]] = field(default_factory=dict)
    source: str = "runtime.perf.model roofline"

    def to_dict(self) -> dict:
        """JSON-ready dict (TP keys as strings)."""
        return {
            "model": self.model,
            "gpu": self.gpu,
            "precision": self.precision,
            "source": self.source,
            "prefill": {str(tp): [asdict(p) for p in pts] for tp, pts in self.prefill.items()},
            "decode": {str(tp): [asdict(p) for p in pts] for tp, pts in self.decode.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "PlannerProfiles":
        """Inverse of :meth:`to_dict`. Raises KeyError/TypeError naming nothing beyond Python's own."""
        return cls(
            model=d["model"],
            gpu=d["gpu"],
            precision=d["precision"],
            source=d.get("source", ""),
            prefill={int(tp): [PrefillPoint(**p) for p in pts] for tp, pts in d["prefill"].items()},
            decode={int(tp): [DecodePoint(**p) for p in pts] for tp, pts in d["decode"].items()},
        )

    def ttft_ms(self, tp: int, isl_tokens: int) -> float:
        """Linear interpolation of the prefill curve of ``tp`` (clamped at the ends)."""
        pts = self.prefill[tp]
        xs, ys = [p.isl_tokens for p in pts], [p.ttft_ms for p in pts]
        return _interp(isl_tokens, xs, ys)


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def build_profiles(
    perf: PerfModel,
    prefill_tps: tuple[int, ...],
    decode_tps: tuple[int, ...],
    isl_grid: tuple[int, ...] = DEFAULT_ISL_GRID,
    batch_grid: tuple[int, ...] = DEFAULT_BATCH_GRID,
    context_grid: tuple[int, ...] = DEFAULT_CONTEXT_GRID,
    gpu_memory_utilization: float = 0.9,
) -> PlannerProfiles:
    """Predict the curves for the given TP degrees (TPs that do not fit are skipped)."""
    out = PlannerProfiles(perf.model.name, perf.gpu.name, perf.precision)
    for tp in prefill_tps:
        if not perf.fits(tp, gpu_memory_utilization):
            continue
        pts = []
        for isl in isl_grid:
            t, busy = perf.prefill_time_s(isl, tp), perf.prefill_busy_s(isl, tp)
            pts.append(PrefillPoint(isl, t * 1e3, isl / busy / tp, busy * 1e3))
        out.prefill[tp] = pts
    for tp in decode_tps:
        cap = perf.kv_capacity_tokens(tp, gpu_memory_utilization)
        if cap <= 0 or not perf.fits(tp, gpu_memory_utilization):
            continue
        pts = []
        for ctx in context_grid:
            for b in batch_grid:
                if b * ctx > cap:
                    break
                t = perf.decode_step_time_s(b, ctx, tp)
                pts.append(DecodePoint(b, ctx, t * 1e3, b / t / tp, b * ctx / cap))
        out.decode[tp] = pts
    return out


class ProfilePerf:
    """A PerfModel stand-in whose prefill/decode times come from (measured) planner profiles.

    Memory questions (``fits``, ``kv_capacity_tokens``, ``memory_breakdown``) and the model/GPU/precision are
    delegated to ``base``; ``prefill_time_s`` interpolates the TTFT-vs-ISL curve of the TP (linear in ISL,
    scaled linearly by ``batch``), ``decode_step_time_s`` interpolates ITL bilinearly over batch x context
    (clamped to the grid). For a TP the profiles do not cover, ``base``'s prediction is used.
    ``tune(..., perf=ProfilePerf(profiles, base))`` is the tuner's measured mode.
    """

    def __init__(self, profiles: PlannerProfiles, base: PerfModel) -> None:
        self.profiles = profiles
        self.base = base
        self.model, self.gpu, self.precision = base.model, base.gpu, base.precision
        self.kv_dtype_bytes = base.kv_dtype_bytes

    def fits(self, tp: int, gpu_memory_utilization: float = 0.9) -> bool:
        return self.base.fits(tp, gpu_memory_utilization)

    def kv_capacity_tokens(self, tp: int, gpu_memory_utilization: float = 0.9) -> int:
        return self.base.kv_capacity_tokens(tp, gpu_memory_utilization)

    def memory_breakdown(self, tp: int, gpu_memory_utilization: float = 0.9):
        return self.base.memory_breakdown(tp, gpu_memory_utilization)

    def prefill_time_s(self, isl_tokens: int, tp: int, batch: int = 1) -> float:
        if not self.profiles.prefill.get(tp):
            return self.base.prefill_time_s(isl_tokens, tp, batch)
        return self.profiles.ttft_ms(tp, isl_tokens) / 1e3 * batch

    def prefill_busy_s(self, isl_tokens: int, tp: int, batch: int = 1) -> float:
        """Engine occupancy of the prefill: the profile's ``busy_ms`` curve where it has one (predicted
        profiles), else the whole measured TTFT (a measurement cannot tell latency from occupancy, so
        the queueing model stays on the safe side); ``base``'s for a TP the profiles do not cover."""
        pts = self.profiles.prefill.get(tp)
        if not pts:
            return self.base.prefill_busy_s(isl_tokens, tp, batch)
        if all(p.busy_ms is not None for p in pts):
            busy = _interp(isl_tokens, [p.isl_tokens for p in pts], [p.busy_ms for p in pts]) / 1e3 * batch
            return min(busy, self.prefill_time_s(isl_tokens, tp, batch))  # occupancy is part of the latency
        return self.prefill_time_s(isl_tokens, tp, batch)

    def decode_step_time_s(self, batch: int, context_tokens: int, tp: int) -> float:
        pts = self.profiles.decode.get(tp)
        if not pts:
            return self.base.decode_step_time_s(batch, context_tokens, tp)
        by_ctx: dict[int, list[DecodePoint]] = {}
        for p in pts:
            by_ctx.setdefault(p.context_tokens, []).append(p)
        ctxs = sorted(by_ctx)
        itl_at = [
            _interp(batch, [p.batch for p in sorted(by_ctx[c], key=lambda p: p.batch)],
                    [p.itl_ms for p in sorted(by_ctx[c], key=lambda p: p.batch)])
            for c in ctxs
        ]
        return _interp(context_tokens, ctxs, itl_at) / 1e3
