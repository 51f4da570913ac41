"""Challenger vs champion: is a new tuning winner worth replacing the deployment that is registered now?

A scheduled re-tune (``pdserve tune --like NAME --register NAME``) produces a *challenger*, the tuner's winner for
the new traffic. The *champion* is the DeploymentSpec behind MLflow alias ``champion``. Both are judged on the
SAME model, workload (mean lengths or trace sample, request rate), SLO and GPU budget, the challenger's:

1. :func:`evaluate_deployment` predicts the champion's deployment as it is written (its prefill/decode worker
   layouts: TP, and PP / DP / EP where set; its GPU and precision, its replicas) with the tuner's own
   arithmetic (:func:`runtime.tuner.search.evaluate_layout_pair`, :func:`runtime.tuner.search.evaluate` for
   plain TP), its GPUs those of its workers (``PoolSpec.gpus`` = tp x dp x pp each). With planner ``off``
   its fixed replicas must serve the rate (the workers :func:`evaluate` sizes for it); with planner ``sla`` or
   ``load`` the planner moves each pool within ``[min_replicas, max_replicas]``, so ``max_replicas`` must cover
   what the rate needs and the deployment uses ``max(needed, min_replicas)``. Either way it must fit the budget.
2. :func:`compare_with_champion` compares the two by what the deployment costs for that workload, lower is better:
   GPUs (``num_gpus``, the tuner's own first criterion) when both run on the same GPU type, else ``$/Mtok``
   (on-demand price per million output tokens; GPU counts of different GPU types do not compare). The
   improvement is ``(champion - challenger) / champion x 100`` percent; the alias moves when it is at least
   ``min_improvement_pct``, or when the champion cannot serve the workload at all (SLO miss, too few workers,
   over budget, the model does not fit its TP). Nothing comparable (different GPU types and no price for one):
   the champion stays.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from runtime.config import DeploymentSpec, PoolSpec, SloSpec, WorkloadSpec
from runtime.models.spec import ModelSpec
from runtime.perf.instances import usd_per_gpu_hour
from runtime.perf.model import PerfModel
from runtime.perf.worker import Layout
from runtime.tuner.search import (TP_CHOICES, Candidate, deployment_perf, evaluate, evaluate_layout_pair,
                                  node_network, resolve_gpu)
from runtime.tuner.workload import LengthSample

DEFAULT_MIN_IMPROVEMENT_PCT = 5.0  # `pdserve tune --min-improvement-pct` default, percent

__all__ = ["ChampionComparison", "DEFAULT_MIN_IMPROVEMENT_PCT", "champion_perf", "compare_with_champion",
           "evaluate_deployment"]


@dataclass(frozen=True)
class ChampionComparison:
    """The outcome of :func:`compare_with_champion`.

    ``metric`` is ``"num_gpus"`` (GPUs) or ``"usd_per_mtok"`` (USD per million output tokens), the cost compared
    (lower is better); ``""`` when none was needed (the champion cannot serve the workload) or none is
    comparable. ``champion_value`` / ``challenger_value`` are that metric (None when not compared);
    ``improvement_pct`` is ``(champion - challenger) / champion x 100`` (None when not compared; negative: the
    challenger costs more). ``replace`` says whether the challenger should become the champion; ``reason`` says
    why, with the numbers, for people.
    """

    champion: Candidate
    challenger: Candidate
    metric: str
    champion_value: float | None
    challenger_value: float | None
    improvement_pct: float | None
    min_improvement_pct: float
    replace: bool
    reason: str


def champion_perf(model: ModelSpec, spec: DeploymentSpec, challenger_perf: PerfModel | None = None) -> PerfModel:
    """The performance model of the champion ``spec``'s GPU and precision for ``model`` (the challenger's model),
    as the tuner builds it (``runtime.tuner.search.deployment_perf``: a quantised checkpoint's own weights; the
    nodes and their network of the tuner's search, which workers across nodes need).

    ``challenger_perf`` is reused when it is a PerfModel of the same model, GPU and precision (so both sides see
    the same calibration).

    Raises:
        KeyError: ``spec.gpu`` is not in the GPU catalog (message lists the names).
    """
    gpu = resolve_gpu(spec.gpu)
    p = challenger_perf
    node, net, _ = node_network(gpu, TP_CHOICES)
    want = deployment_perf(model, gpu, spec.precision, gpus_per_node=node, inter_node_bw_bytes_per_s=net)
    if isinstance(p, PerfModel) and p.model is model and p.gpu.name == gpu.name and (p.precision, p.kv_dtype_bytes) == (
            want.precision, want.kv_dtype_bytes):
        return p
    return want


def _cost_per_hour(gpu: str, prefill_gpus: int, decode_gpus: int, n_p: int, n_d: int, gpus_per_node: int,
                   prices: Mapping[str, float] | None = None) -> float | None:
    # as the search prices a worker: one across nodes rents whole nodes, at the per-GPU price of a node
    price_p = usd_per_gpu_hour(gpu, min(prefill_gpus, gpus_per_node), prices)
    price_d = usd_per_gpu_hour(gpu, min(decode_gpus, gpus_per_node), prices)
    if price_p is None or price_d is None:
        return None
    return n_p * prefill_gpus * price_p + n_d * decode_gpus * price_d


def _layout(pool: PoolSpec) -> Layout:
    return Layout(tp=pool.tp, pp=pool.pp, dp=pool.dp, ep=pool.ep)


def _predict(perf: PerfModel, spec: DeploymentSpec, slo: SloSpec, workload: WorkloadSpec,
             sample: LengthSample | None, prices: Mapping[str, float] | None) -> Candidate:
    """The tuner's prediction of the spec's two worker layouts (sized for the workload rate)."""
    pre, dec = _layout(spec.prefill), _layout(spec.decode)
    gmu = spec.engine.gpu_memory_utilization
    if pre.plain and dec.plain:
        return evaluate(perf, pre.tp, dec.tp, slo, workload, gmu, sample, prices)
    if not isinstance(perf, PerfModel):  # measured profiles (ProfilePerf) hold plain TP only
        return Candidate(pre.gpus, dec.gpus, feasible=False, prefill_layout=pre, decode_layout=dec,
                         reason=f"no performance model of the layouts {pre.label} / {dec.label}")
    cache: dict[tuple[bool, bool], PerfModel] = {}

    def perf_for(lay: Layout) -> PerfModel:
        # the layout's mapping on the same calibration, as the search's perf_for builds it
        key = (lay.ep and bool(perf.model.num_experts), lay.dp > 1)
        if key == (perf.expert_parallel, perf.attention_dp):
            return perf
        if key not in cache:
            p = copy.copy(perf)
            p.expert_parallel, p.attention_dp = key
            cache[key] = p
        return cache[key]

    return evaluate_layout_pair(perf_for, pre, dec, slo, workload, gmu, sample, perf.gpus_per_node,
                                perf.inter_node_bw_bytes_per_s, prices)


def evaluate_deployment(
    perf: PerfModel,
    spec: DeploymentSpec,
    slo: SloSpec,
    workload: WorkloadSpec,
    gpu_budget: int,
    sample: LengthSample | None = None,
    prices: Mapping[str, float] | None = None,
) -> Candidate:
    """Predict the deployment ``spec`` (its two worker layouts and replicas, on ``perf``'s GPU) serving
    ``workload`` under ``slo`` within ``gpu_budget`` GPUs.

    Args:
        perf: the performance model of ``spec``'s GPU and precision (:func:`champion_perf`).
        spec: the deployment (``prefill``/``decode`` ``tp``, ``pp``, ``dp``, ``ep``, ``replicas``,
            ``min_replicas``, ``max_replicas``; ``planner.mode``; ``engine.gpu_memory_utilization``).
        slo, workload, sample: as :func:`runtime.tuner.search.evaluate` (ms, tokens, requests/s).
        gpu_budget: GPUs the deployment may use (>= 1).
        prices: ``{GPU name: USD per GPU-hour}`` replacing the on-demand prices (give the challenger's tune
            the same mapping, or the two ``usd_per_mtok`` do not compare).

    Returns:
        A :class:`Candidate` whose ``prefill_replicas``/``decode_replicas``/``num_gpus`` are what the deployment
        runs for this workload (planner off: its fixed replicas; sla/load: the workers needed, at least
        ``min_replicas``; GPUs: workers x ``PoolSpec.gpus``) and whose ``usd_per_mtok`` prices those;
        ``ttft_ms`` is the p90 at the workers the rate needs (an upper bound when the deployment runs more).
        ``feasible`` is False, with ``reason``, when the layouts miss the SLO or do not fit, when the workers the
        rate needs exceed the fixed replicas (planner off) or ``max_replicas`` (planner on), or when they exceed
        ``gpu_budget``.

    Raises:
        ValueError: ``gpu_budget`` < 1.
    """
    if gpu_budget < 1:
        raise ValueError(f"gpu_budget must be >= 1, got {gpu_budget!r}")
    p_gpus, d_gpus = spec.prefill.gpus, spec.decode.gpus
    c = _predict(perf, spec, slo, workload, sample, prices)
    if not c.feasible:
        return c
    need_p, need_d = c.prefill_replicas, c.decode_replicas
    rate = f"{workload.request_rate_per_s:g} requests/s"
    if spec.planner.mode == "off":
        cap_p, cap_d = spec.prefill.replicas, spec.decode.replicas
        run_p, run_d = cap_p, cap_d
        bound = "fixed replicas (planner off)"
    else:
        cap_p, cap_d = spec.prefill.max_replicas, spec.decode.max_replicas
        run_p, run_d = max(need_p, spec.prefill.min_replicas), max(need_d, spec.decode.min_replicas)
        bound = f"max replicas (planner {spec.planner.mode})"
    if need_p > cap_p or need_d > cap_d:
        return replace(c, feasible=False, reason=f"needs {need_p}:{need_d} P:D workers for {rate}, the deployment's "
                                                 f"{bound} are {cap_p}:{cap_d}")
    gpus = run_p * p_gpus + run_d * d_gpus
    if gpus > gpu_budget:
        return replace(c, feasible=False, reason=f"runs {run_p}:{run_d} P:D workers = {gpus} GPUs for {rate}, over "
                                                 f"the GPU budget {gpu_budget}")
    usd = c.usd_per_mtok
    if usd is not None:  # evaluate() priced the workers it sized; scale to the workers that run
        node = int(getattr(perf, "gpus_per_node", 0) or perf.gpu.num_gpus_per_node)
        sized = _cost_per_hour(perf.gpu.name, p_gpus, d_gpus, need_p, need_d, node, prices)
        running = _cost_per_hour(perf.gpu.name, p_gpus, d_gpus, run_p, run_d, node, prices)
        usd = None if not sized or running is None else usd * running / sized
    return replace(c, prefill_replicas=run_p, decode_replicas=run_d, num_gpus=gpus, usd_per_mtok=usd)


def compare_with_champion(
    challenger: Candidate,
    champion: Candidate,
    *,
    same_gpu: bool,
    min_improvement_pct: float = DEFAULT_MIN_IMPROVEMENT_PCT,
) -> ChampionComparison:
    """Whether ``challenger`` (the tuner's winner) should replace ``champion`` (:func:`evaluate_deployment` of the
    registered deployment on the same workload, SLO and budget).

    Args:
        challenger: a feasible candidate (GPUs ``num_gpus``, ``usd_per_mtok`` USD per million output tokens).
        champion: the champion's deployment; infeasible when it cannot serve the workload.
        same_gpu: both run on the same GPU type (then GPUs compare; else only ``$/Mtok``).
        min_improvement_pct: the challenger must cost at least this many percent less (>= 0).

    Returns:
        A :class:`ChampionComparison` (see the module docstring for the rule).

    Raises:
        ValueError: ``challenger`` is infeasible, or ``min_improvement_pct`` is negative or not finite.
    """
    if not (isinstance(min_improvement_pct, (int, float)) and math.isfinite(min_improvement_pct)
            and min_improvement_pct >= 0):
        raise ValueError(f"min_improvement_pct must be a finite number >= 0, got {min_improvement_pct!r}")
    if not challenger.feasible:
        raise ValueError(f"the challenger {challenger.label} is infeasible ({challenger.reason}); only a tuning "
                         "winner can challenge the champion")

    def result(metric: str, ch: float | None, new: float | None, pct: float | None, ok: bool, why: str):
        return ChampionComparison(champion, challenger, metric, ch, new, pct, float(min_improvement_pct), ok, why)

    if not champion.feasible:
        return result("", None, None, None, True,
                      f"the champion ({champion.label}) cannot serve this workload: {champion.reason}")
    if same_gpu:
        metric, old, new, unit = "num_gpus", float(champion.num_gpus), float(challenger.num_gpus), "GPUs"
    elif champion.usd_per_mtok is not None and challenger.usd_per_mtok is not None:
        metric, old, new, unit = "usd_per_mtok", champion.usd_per_mtok, challenger.usd_per_mtok, "$/Mtok"
    else:
        return result("", None, None, None, False,
                      "the champion and the challenger run on different GPU types and at least one has no price, "
                      "so their costs do not compare; the champion stays")
    pct = (old - new) / old * 100.0 if old > 0 else 0.0
    ok = pct >= min_improvement_pct
    fmt = (lambda v: f"{v:g}") if metric == "num_gpus" else (lambda v: f"{v:.3f}")
    verdict = "at least" if ok else "less than"
    why = (f"the challenger ({challenger.label}, {fmt(new)} {unit}) costs {abs(pct):.1f}% "
           f"{'less' if pct >= 0 else 'more'} than the champion ({champion.label}, {fmt(old)} {unit}) for this "
           f"workload: {verdict} the {min_improvement_pct:g}% required")
    return result(metric, old, new, pct, ok, why)
