"""GPU micro-benchmarks for the performance model: what to time (a plan) and what the timings say (a fit).

The performance model (``runtime.perf.model``) prices every step as rooflines divided by efficiencies
(``runtime.perf.calibration.Efficiency``) that are fitted from published serving measurements. Where a GPU is at
hand, the same efficiencies can be measured directly on the kernels they stand for; ``bench/gpu_calibrate.py``
times the cases of :func:`calibration_plan` with PyTorch on the GPU and :func:`fit_microbench` turns the rows it
writes into the model's terms:

* ``gemm`` rows (``m`` x ``k`` activations times a ``k`` x ``n`` weight, the projections of real models at each
  TP): per dtype the large-GEMM ``compute`` efficiency and ``gemm_half_tokens`` ``h`` of the model's
  ``compute * m / (m + h)`` (``PerfModel.gemm_efficiency``), fitted by least squares on log time with the
  weight read as a memory floor, ``t = max(flops / (peak * compute * m / (m + h)), bytes / (bw * memory))``;
* ``copy`` rows (device-to-device copies): the ``memory`` efficiency, bytes read + written over time over
  the catalog bandwidth (aiconfigurator's ``mem_bw_empirical_scaling_factor`` is the same quantity);
* ``decode_attn`` rows (one query token per sequence over a ``ctx``-token KV cache): ``kv_memory``, the KV
  read rate relative to the copy rate;
* ``prefill_attn`` rows (causal attention over ``ctx`` tokens): ``attention``, FLOPs over time over the bf16
  peak;
* ``grouped_gemm`` rows (``experts`` GEMMs of ``m`` rows each in one batched call): ``moe``, the dense-fit
  time of the same rows over the measured time (at most 1, like ``Efficiency.moe``).

Rows are plain dicts (CSV columns of ``bench/gpu_calibrate.py``): ``kind``, ``dtype`` and the shape fields
above, ``time_s`` (median seconds per call). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from runtime.models.spec import ModelSpec
from runtime.perf.gpus import GpuSpec

KINDS = ("gemm", "grouped_gemm", "decode_attn", "prefill_attn", "copy")
DTYPE_BYTES = {"bf16": 2.0, "fp8": 1.0}
DEFAULT_MS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_TPS = (1, 2, 4, 8)


class MicrobenchError(ValueError):
    """Rows that cannot be fitted (missing columns, unknown kind, no rows of a kind the fit needs)."""


def gemm_shapes(model: ModelSpec, tp: int) -> list[tuple[str, int, int]]:
    """``(projection, n, k)`` of the dense GEMMs one rank runs per layer at tensor parallelism ``tp``: the fused
    QKV (column-parallel), attention output (row-parallel) and, for dense layers, the fused gate/up and the
    down projection (Megatron-LM column/row split; vLLM ``QKVParallelLinear`` / ``MergedColumnParallelLinear``
    / ``RowParallelLinear``). KV heads are replicated when ``tp`` exceeds them (``ModelSpec.kv_heads_per_rank``).

    Raises:
        ValueError: ``tp`` does not divide the attention heads, or an MLA model (its low-rank projections are
            not planned).
    """
    if model.is_mla:
        raise ValueError(f"{model.name}: MLA attention projections are not planned")
    if not model.tp_divides_heads(tp):
        raise ValueError(f"{model.name}: TP {tp} does not divide {model.num_attention_heads} attention heads")
    d, q = model.head_dim, model.num_attention_heads // tp
    kv = model.kv_heads_per_rank(tp)
    shapes = [("qkv", (q + 2 * kv) * d, model.hidden_size), ("o", model.hidden_size, q * d)]
    if model.num_dense_layers and model.intermediate_size % tp == 0:
        inter = model.intermediate_size // tp
        shapes += [("gate_up", 2 * inter, model.hidden_size), ("down", model.hidden_size, inter)]
    return shapes


def calibration_plan(models: Iterable[ModelSpec], *, tps: Iterable[int] = DEFAULT_TPS,
                     ms: Iterable[int] = DEFAULT_MS, dtypes: Iterable[str] = ("bf16", "fp8")) -> list[dict]:
    """The cases ``bench/gpu_calibrate.py measure`` times: dense GEMMs of every model's projections at every TP
    that divides its heads (``ms`` rows each, every dtype), the expert GEMMs of MoE models as grouped GEMMs (the
    routed rows per expert a decode or prefill step gives them), decode and prefill attention at the head
    geometry of each model at TP 1, and copies of 64 MiB to 4 GiB, planned first (``measure`` stops at its
    budget in plan order; every fit needs them). Duplicate shapes are planned once.

    Returns:
        list of row dicts without ``time_s``, each with ``kind``, ``dtype``, shape fields and ``label``.
    """
    ms, tps, dtypes = sorted(set(ms)), sorted(set(tps)), list(dict.fromkeys(dtypes))
    cases: dict[tuple, dict] = {}

    def add(**c: Any) -> None:
        key = tuple(sorted((k, v) for k, v in c.items() if k != "label"))
        cases.setdefault(key, c)

    # copies first: every other fit divides by the memory efficiency they measure, and `measure` stops at its
    # budget in plan order, so a run cut short must already have them
    for mib in (64, 256, 1024, 4096):
        add(kind="copy", dtype="bf16", bytes=mib * 2**20, label=f"copy {mib} MiB")
    for model in models:
        for tp in (t for t in tps if model.tp_divides_heads(t)):
            for proj, n, k in gemm_shapes(model, tp):
                for dt in dtypes:
                    for m in ms:  # torch._scaled_mm (fp8) takes rows in multiples of 16, as FP8 GEMM tiles pad
                        add(kind="gemm", dtype=dt, m=16 * math.ceil(m / 16) if dt == "fp8" else m, n=n, k=k,
                            label=f"{model.name} tp{tp} {proj}")
            if model.num_experts and model.moe_intermediate_size % tp == 0:
                inter = model.moe_intermediate_size // tp
                for dt in dtypes:
                    for rows in (1, 8, 32, 128, 512):
                        add(kind="grouped_gemm", dtype=dt, experts=model.num_experts, m=rows, n=2 * inter,
                            k=model.hidden_size, label=f"{model.name} tp{tp} experts gate_up")
                        add(kind="grouped_gemm", dtype=dt, experts=model.num_experts, m=rows,
                            n=model.hidden_size, k=inter, label=f"{model.name} tp{tp} experts down")
        heads = model.num_attention_heads
        for batch, ctx in ((1, 4096), (16, 2048), (64, 2048), (256, 1024), (64, 8192)):
            add(kind="decode_attn", dtype="bf16", batch=batch, ctx=ctx, heads=heads, head_dim=model.head_dim,
                label=f"{model.name} decode attention")
        for ctx in (1024, 4096, 16384):
            add(kind="prefill_attn", dtype="bf16", batch=1, ctx=ctx, heads=heads, head_dim=model.head_dim,
                label=f"{model.name} prefill attention")
    return list(cases.values())


# ------------------------------------------------------------------------------------------------ row arithmetic


def _num(row: dict, key: str) -> float:
    try:
        v = float(row[key])
    except KeyError:
        raise MicrobenchError(f"{row.get('kind', '?')} row {row.get('label', '')!r}: no {key!r}") from None
    except (TypeError, ValueError):
        raise MicrobenchError(f"{row.get('kind', '?')} row {row.get('label', '')!r}: {key}={row[key]!r} is "
                              "not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise MicrobenchError(f"{row.get('kind', '?')} row {row.get('label', '')!r}: {key}={row[key]!r} must be "
                              "positive")
    return v


def gemm_flops_bytes(row: dict) -> tuple[float, float]:
    """FLOPs (``2 m n k`` per GEMM, times ``experts``) and the minimum HBM bytes (weights and activations at
    the row's dtype, output in bf16) of a ``gemm`` / ``grouped_gemm`` row."""
    m, n, k = (_num(row, c) for c in ("m", "n", "k"))
    e = _num(row, "experts") if row.get("kind") == "grouped_gemm" else 1.0
    w = DTYPE_BYTES.get(str(row.get("dtype")), 2.0)
    return 2.0 * m * n * k * e, e * ((n * k + m * k) * w + m * n * 2.0)


def attention_flops_bytes(row: dict) -> tuple[float, float]:
    """FLOPs and KV bytes of an attention row: decode ``4 b h d ctx`` FLOPs over ``2 b h ctx d`` bf16 K and V
    values; causal prefill ``2 b h d ctx^2`` FLOPs (half of ``4 b h d ctx^2``, FlashAttention-2's count) over
    the same K/V bytes."""
    b, ctx, h, d = (_num(row, c) for c in ("batch", "ctx", "heads", "head_dim"))
    kv_bytes = 2.0 * b * h * ctx * d * 2.0
    if row.get("kind") == "decode_attn":
        return 4.0 * b * h * d * ctx, kv_bytes
    return 2.0 * b * h * d * ctx * ctx, kv_bytes


# ------------------------------------------------------------------------------------------------------- fitting


@dataclass(frozen=True)
class GemmFit:
    """Large-GEMM efficiency and half-efficiency rows of one dtype; ``rms_log_residual`` over ``rows``."""

    compute: float
    gemm_half_tokens: float
    rows: int
    rms_log_residual: float


@dataclass(frozen=True)
class MicrobenchFit:
    """The model's efficiencies as one GPU's kernels measured them (``None``: no rows of that kind).

    ``gemm`` maps a dtype (bf16, fp8) to its :class:`GemmFit`; ``moe`` and ``kv_memory`` are medians over their
    rows, ``memory`` the best copy (streaming asymptote), ``attention`` the best causal prefill.
    """

    gpu: str
    memory: float | None
    gemm: dict[str, GemmFit] = field(default_factory=dict)
    kv_memory: float | None = None
    attention: float | None = None
    moe: dict[str, float] = field(default_factory=dict)
    rows: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gemm_time(flops: float, nbytes: float, m: float, peak: float, bw: float, compute: float, half: float,
               memory: float) -> float:
    return max(flops / (peak * compute * m / (m + half)), nbytes / (bw * memory))


def fit_gemm(rows: list[dict], gpu: GpuSpec, dtype: str, memory: float) -> GemmFit:
    """Least-squares fit (scipy ``least_squares`` on log time) of ``compute`` in (0, 1] and ``gemm_half_tokens``
    in [0, 4096] to the ``gemm`` rows of ``dtype``, with the weight read as a floor at ``memory``.

    Raises:
        MicrobenchError: fewer than 3 rows of that dtype.
    """
    from scipy.optimize import least_squares

    rs = [r for r in rows if r.get("kind") == "gemm" and r.get("dtype") == dtype]
    if len(rs) < 3:
        raise MicrobenchError(f"{gpu.name} {dtype}: {len(rs)} gemm rows, need at least 3 to fit")
    peak, bw = gpu.peak_flops(dtype), gpu.mem_bw_bytes_per_s
    obs = [(*gemm_flops_bytes(r), _num(r, "m"), _num(r, "time_s")) for r in rs]

    def resid(x):
        return [math.log(_gemm_time(f, b, m, peak, bw, x[0], x[1], memory) / t) for f, b, m, t in obs]

    sol = least_squares(resid, x0=[0.7, 64.0], bounds=([1e-3, 0.0], [1.0, 4096.0]))
    res = resid(sol.x)
    return GemmFit(compute=round(float(sol.x[0]), 4), gemm_half_tokens=round(float(sol.x[1]), 1), rows=len(rs),
                   rms_log_residual=round(math.sqrt(sum(v * v for v in res) / len(res)), 4))


def fit_microbench(rows: Iterable[dict], gpu: GpuSpec) -> MicrobenchFit:
    """Fit every efficiency the rows measure on ``gpu`` (see the module docstring).

    Raises:
        MicrobenchError: a row of unknown kind or with a missing / non-positive field, or no ``copy`` row
            (every other fit divides by the measured memory rate).
    """
    rows = list(rows)
    for r in rows:
        if r.get("kind") not in KINDS:
            raise MicrobenchError(f"row {r.get('label', '')!r}: unknown kind {r.get('kind')!r}; expected one of "
                                  f"{', '.join(KINDS)}")
        _num(r, "time_s")
    bw = gpu.mem_bw_bytes_per_s
    copies = [2.0 * _num(r, "bytes") / _num(r, "time_s") / bw for r in rows if r["kind"] == "copy"]
    if not copies:
        raise MicrobenchError(f"{gpu.name}: no copy rows: the memory efficiency every other fit needs is missing")
    memory = min(1.0, max(copies))
    gemm = {dt: fit_gemm(rows, gpu, dt, memory) for dt in DTYPE_BYTES
            if sum(1 for r in rows if r["kind"] == "gemm" and r.get("dtype") == dt) >= 3}
    decode = [attention_flops_bytes(r)[1] / (bw * memory) / _num(r, "time_s")
              for r in rows if r["kind"] == "decode_attn"]
    prefill = [attention_flops_bytes(r)[0] / gpu.peak_flops("bf16") / _num(r, "time_s")
               for r in rows if r["kind"] == "prefill_attn"]
    moe: dict[str, float] = {}
    for dt, g in gemm.items():
        ratios = []
        for r in rows:
            if r["kind"] == "grouped_gemm" and r.get("dtype") == dt:
                f, b = gemm_flops_bytes(r)
                dense = _gemm_time(f, b, _num(r, "m"), gpu.peak_flops(dt), bw, g.compute, g.gemm_half_tokens, memory)
                ratios.append(min(1.0, dense / _num(r, "time_s")))
        if ratios:
            moe[dt] = round(statistics.median(ratios), 4)
    return MicrobenchFit(
        gpu=gpu.name, memory=round(memory, 4), gemm=gemm,
        kv_memory=round(min(1.0, statistics.median(decode)), 4) if decode else None,
        attention=round(min(1.0, max(prefill)), 4) if prefill else None, moe=moe, rows=len(rows))


def compare_with_model(fit: MicrobenchFit, fitted: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Measured vs the model's current factors, per efficiency: ``{"<dtype>.compute": {"measured": x,
    "model": y, "ratio": x / y}, ...}``. ``fitted`` maps a dtype to an ``Efficiency`` (or anything with its
    attributes), e.g. ``{d: efficiency_for(gpu, d, "trtllm") for d in ("bf16", "fp8")}``."""
    out: dict[str, dict[str, float | None]] = {}

    def put(name: str, measured: float | None, model: float | None) -> None:
        ratio = None if measured is None or not model else round(measured / model, 3)
        out[name] = {"measured": measured, "model": model, "ratio": ratio}

    for dt, eff in fitted.items():
        g = fit.gemm.get(dt)
        put(f"{dt}.compute", g.compute if g else None, eff.compute)
        put(f"{dt}.gemm_half_tokens", g.gemm_half_tokens if g else None, eff.gemm_half_tokens)
        put(f"{dt}.moe", fit.moe.get(dt), eff.moe)
        put(f"{dt}.memory", fit.memory, eff.memory)
        put(f"{dt}.kv_memory", fit.kv_memory, eff.kv_memory)
        put(f"{dt}.attention", fit.attention, eff.attention)
    return out
