"""Prefill-TP x decode-TP search under TTFT/ITL SLOs (DistServe-style placement, one GPU type).

For every pair (prefill TP ``p``, decode TP ``d``) in ``tps x tps``:

1. Rules: ``p`` and ``d`` divide the attention and KV heads (``ModelSpec.tp_divides_heads``); a block-FP8
   checkpoint's shards hold whole blocks (``ModelSpec.block_quant_problem``, vLLM refuses others); weights +
   activations fit (``PerfModel.fits``) and one (p90-length) request's KV fits one engine of each pool, prefill
   included (a DP rank of a data-parallel worker is one engine); ``p <= d`` unless the model uses MLA (vLLM
   NixlConnector refuses prefill TP > decode TP for non-MLA models).
2. Prefill: service times ``S = prefill_busy_s(isl, p)`` (the engine's occupancy, without the fixed TTFT
   latency that overlaps other requests' prefills) over the workload's prompt lengths (one length: M/D/1 as
   in DistServe, OSDI 2024; a sample or trace: M/G/1 with Pollaczek-Khinchine moments); TTFT p90 = p90 of
   (``prefill_time_s`` + KV transfer) + p90 queueing delay of S (``runtime.tuner.queueing``); per-worker
   goodput = the largest Poisson rate meeting the TTFT SLO.
3. Decode: the largest batch ``B`` with ``decode_step_time_s(B, p90 context, d) <= ITL SLO`` and
   ``B * mean(isl + osl) <= kv_capacity_tokens(d)``; per-worker goodput = ``B / step(B, mean isl + osl/2) /
   mean osl`` requests/s.
4. Goodput per GPU (requests/s/GPU) at the ideal P:D ratio = ``1 / (p / g_p + d / g_d)``; replicas for the
   workload rate = ``max(1, ceil(rate / g))`` per pool; $/Mtok = what those replicas cost per hour at on-demand
   prices / the output tokens per hour of the workload (rate x mean osl x 3600) x 1e6: the price of the
   deployment as written, idle capacity of the rounded-up pools included.

The winner needs the fewest GPUs for the workload rate, i.e. has the highest goodput per GPU at that rate
(ties: higher ideal-ratio goodput per GPU, then smaller TPs). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pydantic import ValidationError

from runtime.config import TP_DEGREES, DeploymentSpec, EngineSpec, ModelRef, PoolSpec, SloSpec, WorkloadSpec
from runtime.models.quant import PERF_PRECISION
from runtime.models.spec import ModelSpec
from runtime.perf.gpus import GpuSpec, get_gpu
from runtime.perf.instances import get_instance, instance_for, usd_per_gpu_hour
from runtime.perf.model import PerfModel
from runtime.perf.precision import format_support
from runtime.perf.worker import Layout, WorkerPerf
from runtime.tuner.layouts import check_parallelism, layout_problem, layouts, pair_problem, resolve_parallelism
from runtime.tuner.queueing import max_rate_under_ttft_mg1, mg1_wait_quantile_s
from runtime.tuner.workload import LengthSample, quantile

SLO_QUANTILE = 0.9
# NIXL KV transfer bandwidth per prefill GPU: EFA 3.2 Tb/s per 8-GPU p5 node = 50 GB/s per GPU
# (aiconfigurator h100_sxm.yaml node.inter_node_bw); the CPU dev machine moves KV over UCX TCP loopback.
KV_TRANSFER_BW_BYTES_PER_S = {"CPU": 1e9}
DEFAULT_KV_TRANSFER_BW_BYTES_PER_S = 50e9
MAX_DECODE_BATCH = 1024  # vLLM max_num_seqs upper bound searched


class TuningError(ValueError):
    """No deployment can be chosen; the message says why, with numbers."""


class InfeasibleSLOError(TuningError):
    """Every candidate misses the SLO; the message names the best candidate's predicted TTFT/ITL."""


class ModelDoesNotFitError(TuningError):
    """No candidate TP holds the weights and one request's KV; the message shows the memory arithmetic."""


class NotDeployableError(TuningError):
    """The winner's layout is one a DeploymentSpec pool refuses (``runtime.config.PoolSpec``); the message names
    the pool, its layout and the rule."""


class ContextTooLongError(TuningError):
    """The workload's requests (ISL + OSL) are longer than the model's ``max_position_embeddings``; the message
    names both numbers. vLLM refuses ``--max-model-len`` beyond the model's context at start."""


@dataclass(frozen=True)
class Candidate:
    """One (prefill TP, decode TP) configuration and its predictions.

    Times in ms, rates in requests/s, ``goodput_per_gpu`` in requests/s/GPU, ``usd_per_mtok`` in USD per
    million output tokens (None when the GPU has no AWS price). ``feasible`` is False with ``reason`` set
    when a rule or the SLO is violated (predictions are still filled in where computable).
    """

    prefill_tp: int
    decode_tp: int
    feasible: bool
    reason: str = ""
    ttft_ms: float = math.inf  # p90 at the operating point (unloaded when infeasible)
    ttft_unloaded_ms: float = math.inf
    itl_ms: float = math.inf  # p90: step time at the chosen decode batch and the longest context
    decode_batch: int = 0
    prefill_goodput_rps: float = 0.0  # per prefill worker
    decode_goodput_rps: float = 0.0  # per decode worker
    goodput_per_gpu: float = 0.0
    prefill_replicas: int = 0
    decode_replicas: int = 0
    num_gpus: int = 0
    usd_per_mtok: float | None = None
    kv_capacity_tokens: int = 0  # per decode worker, all its DP ranks together
    # parallel layouts of the two pools (runtime.perf.worker.Layout); None: plain TP of prefill_tp / decode_tp
    # GPUs. With a layout, prefill_tp / decode_tp are the GPUs of one worker (tp x dp x pp).
    prefill_layout: Layout | None = None
    decode_layout: Layout | None = None
    prefill_kv_capacity_tokens: int = 0  # per prefill worker, all its DP ranks together (0: not computed)

    @property
    def kv_capacity_tokens_per_rank(self) -> int:
        """KV capacity of one DP rank of a decode worker, tokens: the longest sequence it holds."""
        return self.kv_capacity_tokens // self.decode.dp

    @property
    def prefill_kv_capacity_tokens_per_rank(self) -> int:
        """KV capacity of one DP rank of a prefill worker, tokens (0: not computed)."""
        return self.prefill_kv_capacity_tokens // self.prefill.dp

    @property
    def prefill(self) -> Layout:
        """The prefill workers' layout."""
        return self.prefill_layout or Layout(tp=self.prefill_tp)

    @property
    def decode(self) -> Layout:
        """The decode workers' layout."""
        return self.decode_layout or Layout(tp=self.decode_tp)

    @property
    def plain_tp(self) -> bool:
        """Both pools are plain single-node tensor parallelism (a DeploymentSpec pool with only ``tp`` set)."""
        return self.prefill.plain and self.decode.plain

    @property
    def label(self) -> str:
        if self.plain_tp:
            return f"p{self.prefill_tp}d{self.decode_tp}"
        return f"p[{self.prefill.label}]d[{self.decode.label}]"


@dataclass
class TuneResult:
    """All candidates (feasible or not) and the winner; see :func:`tune`."""

    model: ModelSpec
    gpu: GpuSpec
    precision: str
    slo: SloSpec
    workload: WorkloadSpec
    candidates: list[Candidate]
    best: Candidate
    notes: list[str] = field(default_factory=list)
    perf: object = field(default=None, repr=False, compare=False)  # the PerfModel / ProfilePerf used
    parallelism: str = "tp"  # the search space used: tp or all (runtime.tuner.layouts)
    plain_tp_feasible: bool = True  # some plain single-node TP pair meets the SLO
    weight_precision: str = ""  # the PerfModel precision the weights were costed at ("" = precision)
    gpus_per_node: int = 0  # GPUs of one node in the search (0: the GPU's num_gpus_per_node)

    def peak_replicas(self, peak_rate_per_s: float) -> tuple[int, int]:
        """(prefill, decode) workers of the winner that serve ``peak_rate_per_s`` requests/s within the SLO:
        ``ceil(rate / goodput per worker)`` per pool, as the replicas for the workload rate (DistServe's
        per-instance goodput, Zhong et al. OSDI 2024); at least the replicas for the workload rate.

        Raises:
            ValueError: ``peak_rate_per_s`` is not a positive finite number.
        """
        if not (isinstance(peak_rate_per_s, (int, float)) and math.isfinite(peak_rate_per_s) and peak_rate_per_s > 0):
            raise ValueError(f"peak_rate_per_s must be a positive finite rate, got {peak_rate_per_s!r}")
        b = self.best

        def need(goodput: float, base: int) -> int:
            return base if goodput <= 0 else max(base, math.ceil(peak_rate_per_s / goodput - 1e-9))

        return need(b.prefill_goodput_rps, b.prefill_replicas), need(b.decode_goodput_rps, b.decode_replicas)

    def to_deployment_spec(self, model_ref: ModelRef, peak_rate_per_s: float | None = None, *,
                           max_model_len_tokens: int | None = None) -> DeploymentSpec:
        """The winner as a DeploymentSpec (planner bounds: 1 .. max(8, 2 x replicas) per pool, raised to
        :meth:`peak_replicas` when a ``peak_rate_per_s`` is given, e.g. a recorded trace's busiest 60 s, so
        the planner may scale up to what the peak needs). ``max_model_len_tokens``: the operator's vLLM
        ``--max-model-len`` instead of the derived one, checked by :meth:`max_model_len_tokens`.

        Raises:
            pydantic.ValidationError: when the precision is not one DeploymentSpec accepts (bf16/fp8).
            NotDeployableError: a winner's layout that a DeploymentSpec pool refuses (``PoolSpec`` layout rules;
                message: the pool, its layout and the rule). The tuner's layouts (``runtime.tuner.layouts``) all
                pass them.
            ValueError: a bad ``peak_rate_per_s`` or ``max_model_len_tokens``.
        """
        b = self.best
        node = self.gpus_per_node or self.gpu.num_gpus_per_node
        peak_p, peak_d = (0, 0) if peak_rate_per_s is None else self.peak_replicas(peak_rate_per_s)

        def pool(role: str, lay: Layout, replicas: int, peak: int) -> PoolSpec:
            layout = {} if lay.plain else {"pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "nodes": lay.nodes(node)}
            try:
                return PoolSpec(tp=lay.tp, replicas=replicas, min_replicas=1,
                                max_replicas=max(8, 2 * replicas, peak), **layout)
            except ValidationError as e:
                raise NotDeployableError(f"{role} workers {lay.label} on {node}-GPU nodes cannot be deployed: "
                                         + "; ".join(err["msg"] for err in e.errors())) from None

        return DeploymentSpec(
            model=model_ref.model_copy(update={
                "mla": self.model.is_mla, "quantization": self.model.quant_method,
                "context_tokens": self.model.max_context_tokens or self.model.max_position_embeddings or 0}),
            gpu=self.gpu.name,
            precision=self.precision,
            engine=EngineSpec(max_model_len_tokens=self.max_model_len_tokens(max_model_len_tokens),
                              kv_capacity_tokens=self.engine_kv_capacity_tokens),
            slo=self.slo.model_copy(),
            workload=self.workload.model_copy(),
            prefill=pool("prefill", b.prefill, b.prefill_replicas, peak_p),
            decode=pool("decode", b.decode, b.decode_replicas, peak_d),
        )

    def max_model_len_tokens(self, override: int | None = None) -> int:
        """vLLM ``--max-model-len`` for the winner, tokens: the model's context window (the length vLLM derives
        from its config, ``ModelSpec.max_context_tokens``), capped by the KV capacity of one prefill and one
        decode engine (vLLM refuses to start when one sequence of that length does not fit; an engine is one DP
        rank of a data-parallel worker, which holds whole sequences); for a LongRoPE model whose workload ISL +
        OSL fits its original context, that context (``ModelSpec.longrope_original_tokens``: vLLM's default, the
        longest that keeps the short factors for every sequence); never below the workload's ISL + OSL,
        which the search's rules keep within both capacities. Sized from the model, not from the workload's mean:
        a request longer than the mean must still be served (vLLM allocates KV blocks as a sequence grows, so a
        long limit costs nothing until a long request comes).

        ``override`` (the operator's choice, e.g. a shorter limit to refuse long prompts) replaces it when it
        is within the same bounds.

        Raises:
            ValueError: ``override`` is not a positive int, is below the workload's ISL + OSL (the requests
                the configuration was tuned for would be refused), above the model's context window (vLLM:
                "User-specified max_model_len ... is greater than the derived max_model_len") or above the KV
                capacity of one engine (vLLM refuses to start); the message gives the bound.
        """
        need = self.workload.isl_tokens + self.workload.osl_tokens
        context = self.model.max_context_tokens or self.model.max_position_embeddings
        want = context or max(need, EngineSpec.model_fields["max_model_len_tokens"].default)
        short = self.model.longrope_original_tokens
        if short and need <= short:
            # LongRoPE: above its original context vLLM applies the long factors to every sequence, short
            # ones included (runtime.models.spec.longrope_original_tokens); vLLM's own default is that length
            want = min(want, short)
        caps = self._engine_kv_caps()
        if override is None:
            return max(min([want, *caps]), need)
        self.workload.check_max_model_len(override)
        if context and override > context:
            raise ValueError(f"max_model_len {override} > the model's context window ({context} tokens): vLLM "
                             "refuses to start")
        if caps and override > min(caps):
            b = self.best
            at = (f"prefill TP {b.prefill_tp} / decode TP {b.decode_tp}" if b.plain_tp
                  else f"prefill {b.prefill.label} / decode {b.decode.label}, per DP rank")
            raise ValueError(f"max_model_len {override} > the KV capacity of one worker ({min(caps)} tokens at "
                             f"{at}): vLLM refuses to start; use a larger TP or a shorter limit")
        return override

    @property
    def engine_kv_capacity_tokens(self) -> int:
        """KV capacity of ONE engine of the winner, tokens: the smaller of one prefill and one decode engine (a
        DP rank of a data-parallel worker); 0 when unknown. What ``DeploymentSpec.engine.kv_capacity_tokens``
        records, unlike ``Candidate.kv_capacity_tokens`` (a whole decode worker, all its DP ranks)."""
        return min(self._engine_kv_caps(), default=0)

    def _engine_kv_caps(self) -> list[int]:
        """The KV capacity (tokens) of one decode and of one prefill engine of the winner, where known (one DP
        rank of a data-parallel worker: a rank holds whole sequences)."""
        caps = []
        if self.best.kv_capacity_tokens:
            caps.append(self.best.kv_capacity_tokens_per_rank)
        if self.best.prefill_kv_capacity_tokens:
            caps.append(self.best.prefill_kv_capacity_tokens_per_rank)
        elif isinstance(self.perf, PerfModel):
            caps.append(self.perf.kv_capacity_tokens(self.best.prefill_tp))
        return caps

    def markdown_table(self) -> str:
        """All candidates as a GitHub-flavoured Markdown table, winner marked with a star."""
        head = (
            "| | prefill | decode | TTFT p90 ms | ITL p90 ms | decode batch | goodput/GPU req/s "
            "| P:D replicas | GPUs | $/Mtok | status |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n"
        )
        rows = []
        for c in self.candidates:
            star = "★" if c == self.best else ""
            usd = "-" if c.usd_per_mtok is None else f"{c.usd_per_mtok:.3f}"
            rows.append(
                f"| {star} | {c.prefill.label} | {c.decode.label} | {_fmt(c.ttft_ms)} | {_fmt(c.itl_ms)} | "
                f"{c.decode_batch} | {c.goodput_per_gpu:.3f} | {c.prefill_replicas}:{c.decode_replicas} | "
                f"{c.num_gpus} | {usd} | {'ok' if c.feasible else c.reason} |"
            )
        title = (
            f"**{self.model.name}** on {self.gpu.name} ({self.precision}); SLO TTFT p90 ≤ "
            f"{self.slo.ttft_p90_ms:g} ms, ITL p90 ≤ {self.slo.itl_p90_ms:g} ms; workload ISL "
            f"{self.workload.isl_tokens}, OSL {self.workload.osl_tokens}, "
            f"{self.workload.request_rate_per_s:g} req/s\n\n"
        )
        return title + head + "\n".join(rows) + "\n"


def _fmt(ms: float) -> str:
    return "-" if math.isinf(ms) or math.isnan(ms) else f"{ms:.1f}"


def evaluate(
    perf: PerfModel,
    prefill_tp: int,
    decode_tp: int,
    slo: SloSpec,
    workload: WorkloadSpec,
    gpu_memory_utilization: float = 0.9,
    sample: LengthSample | None = None,
    prices: Mapping[str, float] | None = None,
) -> Candidate:
    """Predict one candidate (see the module docstring for the rules and formulas).

    ``prices`` (``{GPU name: USD per GPU-hour}``, runtime.perf.instances.parse_price_overrides) replaces the
    on-demand price of ``usd_per_mtok``.

    ``sample`` (ISL/OSL pairs, e.g. from a trace) replaces the workload's mean lengths: prefill uses the
    M/G/1 moments of its prompts' prefill times and their p90, decode the p90 context for ITL and the mean
    lengths for throughput and KV. ``workload.request_rate_per_s`` is the rate either way.
    """
    m = perf.model
    smp = sample or LengthSample.from_spec(workload)
    mean_osl = smp.mean_osl
    max_ctx = smp.context_quantile(SLO_QUANTILE)
    c = Candidate(prefill_tp, decode_tp, feasible=False)
    for tp in sorted({prefill_tp, decode_tp}):
        if not m.tp_divides_heads(tp):
            return replace(c, reason=f"TP {tp} does not divide {m.num_attention_heads} attention / "
                                     f"{m.num_kv_heads} KV heads")
        if tp > perf.gpu.num_gpus_per_node:
            return replace(c, reason=f"TP {tp} > {perf.gpu.num_gpus_per_node} GPUs per node")
        block = m.block_quant_problem(tp, expert_parallel=getattr(perf, "expert_parallel", False))
        if block:
            return replace(c, reason=f"TP {tp}: {block}")
        if not perf.fits(tp, gpu_memory_utilization):
            return replace(c, reason=f"weights do not fit at TP {tp}")
    if prefill_tp > decode_tp and not m.is_mla:
        return replace(c, reason="prefill TP > decode TP (NixlConnector, non-MLA)")
    return evaluate_workers(WorkerPerf(perf, Layout(tp=prefill_tp)), WorkerPerf(perf, Layout(tp=decode_tp)), c, slo,
                            workload, gpu_memory_utilization, sample, prices)


def evaluate_layout_pair(
    perf_for, prefill: Layout, decode: Layout, slo: SloSpec, workload: WorkloadSpec,
    gpu_memory_utilization: float = 0.9, sample: LengthSample | None = None, gpus_per_node: int = 8,
    network_bw_per_gpu_bytes_per_s: float = 0.0, prices: Mapping[str, float] | None = None,
) -> Candidate:
    """Predict one candidate of two layouts (``runtime.tuner.layouts`` rules, then as :func:`evaluate`).

    ``perf_for(layout)`` returns the PerfModel of a layout's mapping (``expert_parallel``, ``attention_dp``);
    ``gpus_per_node`` and ``network_bw_per_gpu_bytes_per_s`` (EFA share per GPU) describe the nodes;
    ``prices`` as in :func:`evaluate`.
    """
    m = perf_for(prefill).model
    c = Candidate(prefill.gpus, decode.gpus, feasible=False, prefill_layout=prefill, decode_layout=decode)
    for role, lay in (("prefill", prefill), ("decode", decode)):
        problem = layout_problem(m, lay, gpus_per_node)
        if problem:
            return replace(c, reason=f"{role} {lay.label}: {problem}" if not lay.plain else problem)
    problem = pair_problem(m, prefill, decode)
    if problem:
        return replace(c, reason=problem)
    workers = []
    for role, lay in (("prefill", prefill), ("decode", decode)):
        w = WorkerPerf(perf_for(lay), lay, network_bw_per_gpu_bytes_per_s)
        if not w.fits(gpu_memory_utilization):
            return replace(c, reason=f"weights do not fit at TP {lay.tp}" if lay.plain
                           else f"weights do not fit at {lay.label}")
        workers.append(w)
    return evaluate_workers(workers[0], workers[1], c, slo, workload, gpu_memory_utilization, sample, prices)


def evaluate_workers(
    pw: WorkerPerf, dw: WorkerPerf, c: Candidate, slo: SloSpec, workload: WorkloadSpec,
    gpu_memory_utilization: float = 0.9, sample: LengthSample | None = None,
    prices: Mapping[str, float] | None = None,
) -> Candidate:
    """The SLO arithmetic of :func:`evaluate` for a prefill worker ``pw`` and a decode worker ``dw`` that the
    rules accept; ``c`` is the candidate to fill in; ``prices`` as in :func:`evaluate`."""
    perf = pw.perf
    m = perf.model
    smp = sample or LengthSample.from_spec(workload)
    mean_osl = smp.mean_osl
    max_ctx = smp.context_quantile(SLO_QUANTILE)
    kv_cap = dw.kv_capacity_tokens(gpu_memory_utilization)
    c = replace(c, kv_capacity_tokens=kv_cap, prefill_kv_capacity_tokens=pw.kv_capacity_tokens(gpu_memory_utilization))
    # the longest request lies whole on one engine (a DP rank) of each pool, and vLLM refuses to start an engine
    # whose cache cannot hold --max-model-len (>= that request): the prefill worker holds the prompt's KV until
    # the decode worker has pulled it, and runs with the same limit
    for role, w, cap in (("", dw, c.kv_capacity_tokens_per_rank),
                         ("prefill ", pw, c.prefill_kv_capacity_tokens_per_rank)):
        if cap < max_ctx:
            per = " per DP rank" if w.layout.dp > 1 else ""
            return replace(c, reason=f"{role}KV capacity {cap} tokens{per} < one request ({max_ctx})")
    prefill_tp, decode_tp = pw.gpus, dw.gpus

    # prefill: M/G/1 over the sample's prompts (M/D/1 for a single length)
    bw = KV_TRANSFER_BW_BYTES_PER_S.get(perf.gpu.name, DEFAULT_KV_TRANSFER_BW_BYTES_PER_S)
    kv_tok = m.kv_bytes_per_token(perf.kv_dtype_bytes, 1)
    # a prompt's KV lies on its DP rank's tp x pp GPUs, each sending its share
    senders = pw.layout.tp * pw.layout.pp
    by_isl = {i: pw.prefill_time_s(i) for i in set(smp.isl_tokens)}
    busy_by_isl = {i: pw.prefill_busy_s(i) for i in set(smp.isl_tokens)}
    # the queue is served at the engine's occupancy; each request's TTFT carries the whole latency
    services = [busy_by_isl[i] for i in smp.isl_tokens]
    totals = [by_isl[i] + i * kv_tok / (bw * senders) for i in smp.isl_tokens]
    mean_s = sum(services) / len(services)
    m2_s = sum(s * s for s in services) / len(services)
    p90_total_s = quantile(totals, SLO_QUANTILE)
    ttft_slo_s = slo.ttft_p90_ms / 1e3
    g_p = max_rate_under_ttft_mg1(mean_s, m2_s, p90_total_s, ttft_slo_s, SLO_QUANTILE)
    ttft_unloaded_ms = p90_total_s * 1e3

    # decode: largest batch meeting ITL at the p90 context and fitting the KV (bisection; step time grows with B)
    itl_slo_s = slo.itl_p90_ms / 1e3
    mean_ctx = max(1, round(smp.mean_isl + mean_osl / 2))
    # vLLM's max_num_seqs bounds each engine: every DP rank of a data-parallel worker is one
    b_kv = min(MAX_DECODE_BATCH * dw.layout.dp, int(kv_cap // (smp.mean_isl + mean_osl)))
    step1_s = dw.decode_step_time_s(1, max_ctx)
    batch = 0
    if step1_s <= itl_slo_s and b_kv >= 1:
        lo, hi = 1, b_kv
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if dw.decode_step_time_s(mid, max_ctx) <= itl_slo_s:
                lo = mid
            else:
                hi = mid - 1
        batch = lo
    itl_ms = (dw.decode_step_time_s(batch, max_ctx) if batch else step1_s) * 1e3
    g_d = batch / dw.decode_step_time_s(batch, mean_ctx) / mean_osl if batch else 0.0

    c = replace(c, ttft_unloaded_ms=ttft_unloaded_ms, ttft_ms=ttft_unloaded_ms, itl_ms=itl_ms,
                decode_batch=batch, prefill_goodput_rps=g_p, decode_goodput_rps=g_d)
    misses = []
    if g_p <= 0:
        misses.append(f"TTFT {ttft_unloaded_ms:.1f} ms > {slo.ttft_p90_ms:g} ms")
    if g_d <= 0:
        misses.append(f"ITL {itl_ms:.1f} ms > {slo.itl_p90_ms:g} ms")
    if misses:
        return replace(c, reason="SLO miss: " + ", ".join(misses))

    rate = workload.request_rate_per_s
    n_p, n_d = max(1, math.ceil(rate / g_p - 1e-9)), max(1, math.ceil(rate / g_d - 1e-9))
    ttft_ms = (p90_total_s + mg1_wait_quantile_s(rate / n_p, mean_s, m2_s, SLO_QUANTILE)) * 1e3
    goodput_per_gpu = 1.0 / (prefill_tp / g_p + decode_tp / g_d)
    # a worker across nodes rents whole nodes: the per-GPU price of a node's instance
    node = pw.gpus_per_node
    price_p = usd_per_gpu_hour(perf.gpu.name, min(prefill_tp, node), prices)
    price_d = usd_per_gpu_hour(perf.gpu.name, min(decode_tp, node), prices)
    usd = None
    if price_p is not None and price_d is not None:
        usd_per_hour = n_p * prefill_tp * price_p + n_d * decode_tp * price_d
        usd = usd_per_hour / (rate * mean_osl * 3600.0) * 1e6
    return replace(c, feasible=True, ttft_ms=ttft_ms, goodput_per_gpu=goodput_per_gpu,
                   prefill_replicas=n_p, decode_replicas=n_d,
                   num_gpus=n_p * prefill_tp + n_d * decode_tp, usd_per_mtok=usd)


def check_context_length(model: ModelSpec, workload: WorkloadSpec, sample: LengthSample | None = None) -> None:
    """Refuse a workload longer than the model's context.

    The longest request the tuner plans for is the workload's ``isl_tokens + osl_tokens`` (the floor of
    ``TuneResult.max_model_len_tokens``) and, with a ``sample``, its p90 (``SLO_QUANTILE``) ``isl + osl`` (the
    context ``evaluate`` sizes ITL and KV for). vLLM refuses to start with ``--max-model-len`` above the
    model's context (``ModelSpec.max_context_tokens``: ``max_position_embeddings`` with RoPE scaling, as
    vLLM 0.28 ``vllm/config/model.py`` ``_get_and_verify_max_len`` derives it): "User-specified max_model_len
    (...) is greater than the derived max_model_len (...)", unless the operator sets
    VLLM_ALLOW_LONG_MAX_MODEL_LEN, which pdserve does not). No check when the config has no
    ``max_position_embeddings`` (0).

    Raises:
        ContextTooLongError: naming the tokens needed and the model's context.
    """
    limit = model.max_context_tokens or model.max_position_embeddings
    if not limit:
        return
    what = (f"max_position_embeddings {limit}" if limit == model.max_position_embeddings
            else f"context {limit} (max_position_embeddings {model.max_position_embeddings} with RoPE scaling)")
    need = workload.isl_tokens + workload.osl_tokens
    if need > limit:
        raise ContextTooLongError(
            f"{model.name}: workload ISL {workload.isl_tokens} + OSL {workload.osl_tokens} = {need} tokens "
            f"exceeds the model's {what} (config.json); "
            f"vLLM cannot serve requests that long: shorten ISL/OSL to at most {limit} tokens together"
        )
    if sample is not None:
        ctx = sample.context_quantile(SLO_QUANTILE)
        if ctx > limit:
            raise ContextTooLongError(
                f"{model.name}: the workload sample's p{SLO_QUANTILE * 100:g} ISL + OSL is {ctx} tokens, which "
                f"exceeds the model's {what} (config.json); "
                f"vLLM cannot serve requests that long"
            )


def resolve_gpu(name: str) -> GpuSpec:
    """A GPU catalog name/alias, or an AWS instance type (``p5.48xlarge`` -> H100-SXM).

    Raises:
        KeyError: neither a GPU nor an instance type; the message lists the GPU names.
    """
    try:
        return get_gpu(name)
    except KeyError as gpu_err:
        try:
            return get_gpu(get_instance(name).gpu)
        except KeyError:
            raise gpu_err from None


TP_CHOICES = TP_DEGREES  # the degrees a DeploymentSpec accepts (runtime.config)


def tp_choices(gpu: str) -> tuple[int, ...]:
    """The tensor-parallel degrees to search for a ``--gpu`` value: ``TP_CHOICES``, or for an AWS instance
    type those that fit on one instance (``g6e.xlarge``, one L40S: TP 1 only; ``g6e.12xlarge``: 1, 2, 4), since
    a worker's TP group lives on one node (NVLink/PCIe, not EFA). A GPU catalog name gets all of them.

    Raises:
        KeyError: neither a GPU nor an instance type (as `resolve_gpu`).
    """
    try:
        get_gpu(gpu)
        return TP_CHOICES
    except KeyError:
        pass
    try:
        inst = get_instance(gpu)
    except KeyError:
        resolve_gpu(gpu)  # raises the catalog's KeyError
        return TP_CHOICES
    return tuple(t for t in TP_CHOICES if t <= inst.num_gpus)


def perf_precisions(model: ModelSpec, precision: str) -> tuple[str, str | None]:
    """(weights, KV) PerfModel precisions for deploying ``model`` at ``precision``.

    The deployment precision (``DeploymentSpec.precision``) sets the KV-cache dtype and, for a 16-bit
    checkpoint, online FP8 quantisation (runtime.deploy.workers.precision_args); a quantised checkpoint
    (``ModelSpec.weight_format`` fp8 / fp8-block / mxfp4 / nvfp4) is loaded as it is stored, whatever the
    deployment precision, so its weights are costed in their own format. A checkpoint in a format pdserve does
    not model (``unknown``: AWQ, GPTQ, ...) is loaded as stored too, and vLLM runs it weight-only at the bf16
    tensor-core rate: its weights are costed as bf16 (``ModelSpec.precision_note``), its KV cache at the
    deployment precision. KV None: the PerfModel default.
    """
    p = precision.lower()
    fmt = model.weight_format
    if p == "fp32" or fmt == "bf16":
        return p, None
    kv = "fp8" if p in ("fp8", "fp4") else p
    if fmt == "unknown":
        # AWQ / GPTQ / other methods vLLM loads as stored and runs weight-only (Marlin W4A16: bf16 tensor-core
        # rate); the deployment precision only sets --kv-cache-dtype. Sized as bf16 (the note says so).
        return "bf16", (kv if kv != "bf16" else None)
    return PERF_PRECISION[fmt], kv


def deployment_perf(model: ModelSpec, gpu: GpuSpec, precision: str, **kw) -> PerfModel:
    """The PerfModel of ``model`` deployed at ``precision`` on ``gpu``: the weights in the checkpoint's own format,
    the KV cache at the deployment precision (``perf_precisions``). The one way the tuner, the champion
    comparison and the runtime planner build it, so all three size the same deployment alike. ``kw`` goes to
    PerfModel (layouts, network).

    Raises:
        ValueError: an unknown precision.
    """
    weights, kv = perf_precisions(model, precision)
    return PerfModel(model, gpu, weights, kv_precision=kv, **kw)


def _precision_notes(model: ModelSpec, g: GpuSpec, precision: str, weights: str, kv: str | None) -> list[str]:
    notes = []
    if model.precision_note:
        notes.append(model.precision_note)
    fmt = model.weight_format
    if fmt not in ("bf16", "unknown") and precision.lower() != "fp32":
        fs = format_support(g, fmt)
        how = (f"natively ({fs.kernel})" if fs.mode == "native"
               else f"weight-only ({fs.kernel}, {fs.compute_precision} GEMM rate)")
        notes.append(f"weights: {fmt} checkpoint ({model.quant_method}), costed at {weights} on {g.name}, {how}; "
                     f"KV cache {kv or weights}")
    elif fmt == "unknown" and kv:
        notes.append(f"weights: {model.quant_method or 'unknown'} checkpoint loaded as stored, costed as {weights} "
                     f"(weight-only kernels run at the bf16 rate); KV cache {kv}")
    return notes


def layout_arithmetic(perf_for, c: Candidate, workload: WorkloadSpec, gpu_memory_utilization: float,
                      sample: LengthSample | None, gpus_per_node: int, net: float) -> list[str]:
    """The memory and step arithmetic of candidate ``c``'s two workers, one line each: nodes, per-GPU memory
    plan, KV tokens per worker; prefill time of the mean prompt; decode step parts at the chosen batch."""
    smp = sample or LengthSample.from_spec(workload)
    isl = max(1, round(smp.mean_isl))
    out = []
    for role, lay in (("prefill", c.prefill), ("decode", c.decode)):
        w = WorkerPerf(perf_for(lay), lay, net)
        mb = w.memory_breakdown(gpu_memory_utilization)
        line = (f"{role} {lay.label} ({lay.gpus} GPUs, {lay.nodes(gpus_per_node)} node(s)): per GPU {mb.explain()}; "
                f"{w.kv_capacity_tokens(gpu_memory_utilization):,} KV tokens per worker")
        if lay.dp > 1:
            line += f" ({w.kv_capacity_tokens_per_rank(gpu_memory_utilization):,} per DP rank)"
        if role == "prefill":
            line += f"; prefill of {isl} tokens {w.prefill_time_s(isl) * 1e3:.1f} ms"
        elif c.decode_batch:
            ctx = smp.context_quantile(SLO_QUANTILE)
            b = w.perf.decode_breakdown(c.decode_batch, ctx, w.tp)
            line += (f"; decode step at batch {c.decode_batch}, context {ctx}: {b.total_s * 1e3:.1f} ms "
                     f"(GEMM/weights {max(b.compute_s - b.attn_compute_s, b.memory_s - b.kv_memory_s) * 1e3:.1f}, "
                     f"attention {max(b.attn_compute_s, b.kv_memory_s) * 1e3:.1f}, "
                     f"collectives {b.comm_s * 1e3:.1f} ms)")
        out.append(line)
    return out


def node_network(g: GpuSpec, tps: tuple[int, ...]) -> tuple[int, float, str]:
    """(GPUs per node, network bandwidth per GPU bytes/s, instance name) for the search: a node is the largest
    TP degree given (an instance type's GPU count), its network the AWS instance type of that GPU count."""
    node = min(g.num_gpus_per_node, max(tps))
    inst = instance_for(g.name, node)
    if inst is None or inst.num_gpus != node:
        return node, 0.0, ""
    return node, inst.network_bw_per_gpu_bytes_per_s, inst.name


def tune(
    model: ModelSpec,
    gpu: GpuSpec | str,
    slo: SloSpec,
    workload: WorkloadSpec,
    precision: str = "bf16",
    tps: tuple[int, ...] = TP_CHOICES,
    gpu_memory_utilization: float = 0.9,
    perf: PerfModel | None = None,
    sample: LengthSample | None = None,
    parallelism: str = "tp",
    prices: Mapping[str, float] | None = None,
) -> TuneResult:
    """Search the prefill x decode worker layouts and pick the configuration with the highest goodput per GPU.

    Args:
        model: architecture; gpu: catalog name, AWS instance type (e.g. ``p5.48xlarge``) or spec;
        slo: TTFT/ITL p90 targets (ms);
        workload: mean ISL/OSL (tokens) and request rate (req/s);
        precision: the deployment precision, bf16 or fp8 (KV cache and, for a 16-bit checkpoint, online FP8
            weights; ``perf_precisions``), or fp4 / fp32 for a PerfModel precision as it is; a quantised
            checkpoint's weights are costed in their own format (``ModelSpec.weight_format``);
        tps: TP degrees to try for each pool (the largest is a node's GPU count); perf: a prebuilt PerfModel
        (e.g. with other efficiencies, or ``runtime.tuner.profiles.ProfilePerf`` for measured mode: plain TP
        only); sample: ISL/OSL pairs (e.g. a trace, ``runtime.tuner.workload.LengthSample``) used instead of
        the workload's mean lengths;
        parallelism: ``tp`` (default), ``all`` or ``auto`` (``tp`` when plain TP has a feasible candidate, else
            ``all``); see ``runtime.tuner.layouts`` for the layouts and the pair rules. The default is what a
            caller that shows only ``prefill_tp`` / ``decode_tp`` can show; ask for ``auto`` or ``all`` where
            the caller shows ``Candidate.prefill.label`` / ``decode.label`` and ``TuneResult.notes``;
        prices: ``{GPU name: USD per GPU-hour}`` replacing the on-demand prices in ``usd_per_mtok``
            (runtime.perf.instances.parse_price_overrides / parse_price_file).

    Returns:
        TuneResult with every candidate, (prefill layout, decode layout) in search order (plain TP first:
        ``len(tps)**2`` candidates for ``tp``); ``notes`` say how the weights were costed, any precision that
        could not be told, and the layouts searched.

    Raises:
        ModelDoesNotFitError: no layout holds the weights + one request's KV (message: memory arithmetic of
            the largest TP).
        InfeasibleSLOError: candidates fit but none meets the SLO (message: the best candidate's
            predicted TTFT/ITL).
        TuningError: the GPU cannot run the checkpoint's weight format in the pinned vLLM (message: both).
        ValueError: an unknown parallelism.
        ContextTooLongError: the model's config gives ``max_position_embeddings`` and the workload's
            ISL + OSL (the length ``TuneResult.max_model_len_tokens`` must admit), or the p90 ISL + OSL of
            ``sample`` (the context the search sizes for), exceeds it (message: both numbers).
    """
    check_context_length(model, workload, sample)
    g = resolve_gpu(gpu) if isinstance(gpu, str) else gpu
    notes: list[str] = []
    if perf is not None:  # a prebuilt model (measured profiles, other efficiencies): plain TP as given
        pm = perf
        par = "tp"
        cands = [evaluate(pm, p, d, slo, workload, gpu_memory_utilization, sample, prices)
                 for p in tps for d in tps]
        weights = pm.precision
    else:
        weights, kv = perf_precisions(model, precision)
        if model.weight_format not in ("bf16", "unknown") and weights != precision.lower():
            fs = format_support(g, model.weight_format)
            if not fs.supported:
                raise TuningError(f"{model.name}: its {model.weight_format} weights cannot run on {g.name} in the "
                                  f"pinned vLLM ({fs.source})")
        notes += _precision_notes(model, g, precision, weights, kv)
        node, net, inst = node_network(g, tps)
        cache: dict[tuple[bool, bool], PerfModel] = {}

        def perf_for(layout: Layout) -> PerfModel:
            key = (layout.ep and bool(model.num_experts), layout.dp > 1)
            if key not in cache:
                cache[key] = deployment_perf(model, g, precision, expert_parallel=key[0], attention_dp=key[1],
                                             gpus_per_node=node, inter_node_bw_bytes_per_s=net)
            return cache[key]

        pm = perf_for(Layout())
        multi = net > 0

        def search(par: str) -> list[Candidate]:
            pre = layouts(model, tps, par, node, multi, "prefill")
            dec = layouts(model, tps, par, node, multi, "decode")
            return [evaluate_layout_pair(perf_for, p, d, slo, workload, gpu_memory_utilization, sample, node, net,
                                         prices)
                    for p in pre for d in dec]

        par = check_parallelism(parallelism)
        cands = search("tp")
        plain_ok = any(c.feasible for c in cands)
        par = resolve_parallelism(par, plain_ok)
        if par == "all":
            if parallelism.lower() == "auto":
                notes.append("plain tensor parallelism has no feasible candidate: other layouts searched")
            cands = search("all")
            notes.append(
                "searched: TP" + (", TP+EP and DP-attention+EP (MoE)" if model.num_experts else "")
                + f" layouts, and workers across {node}-GPU nodes "
                + (f"({inst}, {net / 1e9:.0f} GB/s network per GPU)" if multi
                   else f"(not searched: no AWS instance type with {node} {g.name} GPUs and a known network)"))
        elif model.num_experts:
            notes.append("parallelism 'all' also searches expert-parallel and data-parallel-attention workers")
    shown = precision if perf is None and precision.lower() in ("bf16", "fp8") else pm.precision
    ok = [c for c in cands if c.feasible]
    if ok:
        best = max(ok, key=lambda c: (-c.num_gpus, c.goodput_per_gpu, c.plain_tp, -c.decode_tp, -c.prefill_tp))
        if not best.plain_tp:
            notes += layout_arithmetic(perf_for, best, workload, gpu_memory_utilization, sample, node, net)
        plain = plain_ok if perf is None else True
        return TuneResult(model, g, shown, slo, workload, cands, best, notes=notes, perf=pm, parallelism=par,
                          gpus_per_node=min(g.num_gpus_per_node, max(tps)) if perf is not None else node,
                          weight_precision=weights, plain_tp_feasible=plain)

    rated = [c for c in cands if c.reason.startswith("SLO miss")]
    if not rated:
        allowed = [t for t in tps if model.tp_divides_heads(t) and t <= g.num_gpus_per_node
                   and not model.block_quant_problem(t)]
        big = max(allowed, default=min(tps))  # the arithmetic of the largest TP the rules allow
        mb = pm.memory_breakdown(big, gpu_memory_utilization)
        need = workload.isl_tokens + workload.osl_tokens
        if perf is not None:
            hint = ""
        elif par != "all":
            hint = "; expert / data-parallel and multi-node layouts were not searched (parallelism 'tp')"
        else:  # the wider search found no decode worker either: say why decode cannot grow further
            hint = ("; decode workers span nodes only through wide expert parallelism (MoE models): NixlConnector "
                    "refuses pipelined decode workers and tensor parallelism stays inside a node"
                    + ("" if net > 0 else f", and no network is known for {g.name} nodes"))
        raise ModelDoesNotFitError(
            f"{model.name} fits on no candidate on {g.name} ({shown}): at TP {big} per GPU "
            f"{mb.explain()}; one request needs {need} tokens x "
            f"{model.kv_bytes_per_token(pm.kv_dtype_bytes, big):.0f} B/token{hint}. Rules: "
            + "; ".join(sorted({c.reason for c in cands}))
        )

    def violation(c: Candidate) -> float:
        return max(c.ttft_unloaded_ms / slo.ttft_p90_ms, c.itl_ms / slo.itl_p90_ms)

    b = min(rated, key=violation)
    what = (f"prefill TP {b.prefill_tp} / decode TP {b.decode_tp}" if b.plain_tp
            else f"prefill {b.prefill.label} / decode {b.decode.label}")
    raise InfeasibleSLOError(
        f"no candidate meets TTFT p90 <= {slo.ttft_p90_ms:g} ms and ITL p90 <= {slo.itl_p90_ms:g} ms for "
        f"{model.name} on {g.name} ({shown}, ISL {workload.isl_tokens}, OSL {workload.osl_tokens}); "
        f"best candidate {what} predicts TTFT "
        f"{b.ttft_unloaded_ms:.1f} ms and ITL {b.itl_ms:.1f} ms"
    )
