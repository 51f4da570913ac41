"""Planner benchmark: replay a recorded trace or a synthetic shape on the fleet simulator with perf-model engines
and compare planners. Prints ONE JSON line; ``--out`` also writes it to a file.

    .venv/bin/python bench/planner.py --trace DATA/traces/azure2023_conv.csv \
        [--model Llama-3.1-70B --gpu H100-SXM --rate-scale 10 --prefill-tp 2 --decode-tp 4]

``--rate-scale K`` replays each request K times with uniform sub-second jitter (seeded), so the
hour keeps its shape and bursts while the cluster grows to tens of GPUs. Planners:
``pdserve_sla`` (runtime.planner SLA mode: burst_quantile rate predictor, square-root staffing of
prefill, prefill service time corrected by the engines' observed prefill time), ``pdserve_load`` (load mode),
``dynamo_sla`` (Dynamo's published throughput-based replica formula, runtime.planner.dynamo_baseline,
ticking at its default 180 s), ``dynamo_sla_load`` (the same plus Dynamo 1.x's load-based +-1 steps as
the throughput result's upper layer, on a 10-s tick like its ``load_adjustment_interval``),
``dynamo_planner`` (NVIDIA Dynamo's own planner, ``ai-dynamo==1.0.2`` ``PrefillPlanner`` /
``DecodePlanner`` in dry-run, driven by bench/dynamo_planner_driver.py in ``--dynamo-venv``; listed
under ``skipped_planners`` with the reason when that venv is absent),
``static_peak`` (the oracle's per-window maximum of each pool, all hour); ``--extra-predictors``
adds ``pdserve_sla_<predictor>`` runs; ``--dynamo-matched`` adds ``dynamo_sla_matched``, Dynamo's formula
with the smallest load headroom that reaches ``--target-attainment`` (default 0.99; the search in
``dynamo_sla_matched_search``), a comparison with ``pdserve_sla`` at equal attainment, and the converse,
``pdserve_sla_at_dynamo_gpu_hours``: ``pdserve_sla`` with the largest square-root staffing beta whose GPU-hours
stay within the cheapest Dynamo row's (``pdserve_sla_at_dynamo_gpu_hours_search``), a comparison at equal
GPU-hours; ``--ablations``
adds ``ablation_<name>`` runs of ``pdserve_sla`` with one rule or constant undone each (see ``ABLATIONS``). Every planner starts
from the same warm fleet (``--warm-start``, default ``oracle_lead``: the oracle plan's maximum over the
first scale-up's lead plus one window) and ticks every ``--interval-s`` (Dynamo: its default 180 s).
``oracle_gpu_hours``: hindsight per-window minimum that meets the SLO, the windows sized in order
from the state the previous ones left, workers instant (runtime.sim.oracles.sequential_oracle; its
replay's attainment is ``oracle_slo_attainment``). ``oracle_lower_bound_gpu_hours``: every window
sized from empty (runtime.sim.oracles.oracle_gpu_seconds), with
``oracle_lower_bound_replay_slo_attainment``, what that plan attains when replayed.

Diagnostics in the same line: GPU-hours per pool for every planner and the oracle;
``oracle_hold_1window_sim``, the oracle plan launched a worker start ahead and held one window after,
replayed on the simulator (a perfect forecast's cost and attainment); ``oracle_reacting_sim``, the oracle
plan with no foresight beyond the window in progress (each tick asks for the pools the oracle gave the
current window, ready a worker start later, held one window), replayed: what perfect knowledge of the
present attains when the fleet must react to a burst (a reference for planners without foresight;
standing headroom attains more, at its cost); ``excess_vs_oracle_gpu_hours``
splitting each planner's excess per pool into that start-lag/hold share and its own forecast/headroom
share; ``pdserve_sla_by_window``, oracle vs planner workers per oracle window.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pickle
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.modelfiles.catalog import CATALOG_DIR  # noqa: E402
from runtime.models.spec import ModelSpec  # noqa: E402
from runtime.paths import print_json_line  # noqa: E402
from runtime.perf.gpus import get_gpu  # noqa: E402
from runtime.perf.model import PerfModel  # noqa: E402
from runtime.planner.dynamo_baseline import DynamoSlaBaseline  # noqa: E402
from runtime.planner.predictors import PREDICTORS  # noqa: E402
from runtime.planner.profiles import build_profile  # noqa: E402
from runtime.planner.state_machine import PlannerStateMachine  # noqa: E402
from runtime.planner.types import PlannerConfig, ScalingDecision, TickInput  # noqa: E402
from runtime.sim import shapes  # noqa: E402
from runtime.sim.fleet import (  # noqa: E402
    Controller,
    PREFILL_ORDERS,
    FleetConfig,
    Trace,
    simulate,
    static_controller,
)
from runtime.sim.oracles import oracle_gpu_seconds, sequential_oracle  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from planner_dynamo import DynamoPlannerProcess, dynamo_profile_payload  # noqa: E402,F401

MODELS_DIR = CATALOG_DIR
DYNAMO_VENV = ROOT / ".venv-bench-planner"  # ai-dynamo==1.0.2 + its planner's imports (optional)
DYNAMO_LOAD_TICK_S = 10.0  # Dynamo load_adjustment_interval_seconds choices are 5 or 10
# the oracles' search bound, workers per pool: above every pool the planners reach on the development set
# (the Mooncake trace at x10 needs ~120 prefill workers a window). An oracle held below what a window needs
# attains less than the planners and is no reference; ``oracle_at_bound`` in the JSON says when a window's
# plan reached it.
ORACLE_MAX_REPLICAS = 256

# pdserve_sla with one rule or constant changed (PlannerConfig overrides; "interval_s" also sets the simulator's
# tick). runtime/planner/state_machine.py numbers the rules; docs/design/planner.md gives the results.
# "all_refinements_off": square-root staffing alone (beta 1.5 on a two-tick level, M/M/c up to 90 % utilisation,
# TTFT-p90 correction, no decode band, rules 8, 10, 11 and 14 and the window hold off);
# "peak_term_instead_of_staffing": the peak term (rule 6) in place of staffing, with 60 s prefill / 180 s decode
# scale-down delays and +25 % burst headroom.
# One rule off each: "ttft_p90_correction" (correction from TTFT p90, not the engines' prefill time),
# "no_decode_band" (rule 4), "launch_on_tick" (rule 8), "fixed_beta" (rule 11: beta 1.65 scaled by the arrival
# dispersion instead of measured), "no_dispersion" (rule 11 off and beta 1.65 as given), "no_queue_floor"
# (rule 12), "no_decode_floor" (rule 13), "no_recurrence_hold" (rule 14), "no_window_hold" (rules 11 and 13 on
# the predictor window alone). The other rows change one setting.
# "tick_10s": 10-s ticks, windows scaled to the same seconds.
_REFINEMENTS_OFF = dict(prefill_staffing_beta=1.5, prefill_level_window_ticks=2, target_utilization=0.9,
                 correct_by_prefill_time=False, decode_band=False, scale_up_on_level=False,
                 staffing_dispersion_ref=None, measure_burst=False, recurrence_hold=False, window_hold_s=0.0)
ABLATIONS: dict[str, dict] = {
    "all_refinements_off": _REFINEMENTS_OFF,
    "peak_term_instead_of_staffing": _REFINEMENTS_OFF | dict(
        size_on_peak=True, prefill_staffing_beta=None, scale_down_delay_s=60.0, cooldown_s=60.0,
        burst_headroom=0.25, decode_scale_down_delay_s=180.0),
    "ttft_p90_correction": dict(correct_by_prefill_time=False),
    "no_dispersion": dict(staffing_dispersion_ref=None, measure_burst=False),
    "staffing_level_window_2": dict(prefill_level_window_ticks=2),
    "target_utilization_0.9": dict(target_utilization=0.9),
    "peak_term_and_staffing": dict(size_on_peak=True),
    "prefill_scale_down_60s": dict(scale_down_delay_s=60.0, cooldown_s=60.0),
    "decode_scale_down_180s": dict(decode_scale_down_delay_s=180.0),
    "burst_headroom_25pct": dict(burst_headroom=0.25),
    "token_rate_predictors": dict(size_on_tokens=True),
    "no_decode_band": dict(decode_band=False),
    "launch_on_tick": dict(scale_up_on_level=False),
    "tick_10s": dict(interval_s=10.0, predictor_window_ticks=30, prefill_level_window_ticks=3),
    "no_queue_floor": dict(queue_floor=False),
    "no_decode_floor": dict(decode_floor=False),
    "fixed_beta": dict(measure_burst=False),
    "no_recurrence_hold": dict(recurrence_hold=False),
    "no_window_hold": dict(window_hold_s=0.0),
}


def _number_list(option: str, text: str, problems: list[str]) -> list[float]:
    """``text`` as a comma list of numbers; an unreadable one appends a problem naming ``option`` and gives []."""
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        problems.append(f"{option} must be a comma list of numbers, got {text!r}")
        return []


MAX_TRACE_TOKENS = 10_000_000  # far above any context window: a larger count is a corrupt line


def load_trace(path: Path, rate_scale: int, seed: int, start_s: float = 0.0,
               duration_s: float | None = None) -> Trace:
    """A recorded trace, read by the product's one trace reader (runtime.tracking.traces.read_trace): an
    Azure-format CSV (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``: the Azure LLM inference traces),
    a BurstGPT CSV (``Timestamp`` s, ``Request tokens``, ``Response tokens``), Mooncake JSON lines
    (``timestamp`` ms, ``input_length``, ``output_length``), the runtime's ``--traffic-log``, or a directory of
    one format's files merged in time. Arrivals are seconds from the first request; with ``start_s`` /
    ``duration_s`` only those that arrived in ``[start_s, start_s + duration_s)`` of that clock are kept (an
    hour of a week-long trace). A request with no prompt (0 input tokens: a failed request in BurstGPT) is
    left out, as the tuner leaves it out; one with 0 output tokens (it only prefilled) decodes one token, the
    fleet simulator's least. The requests are then replicated ``rate_scale`` times (:func:`replicate`).

    Raises:
        SystemExit: naming the trace, for a missing file, a format error (the reader's message: file, line and
            column), a trace without arrival times, a token count over ``MAX_TRACE_TOKENS``, or no request in
            the window.
    """
    from runtime.traces.formats import TraceFormatError, merged_times
    from runtime.tracking.traces import read_trace

    try:
        files, skipped = read_trace(path)
        if merged_times(files, str(path)) is None:  # also refuses files of both time kinds
            raise TraceFormatError(f"{path}: the planner bench replays arrivals, and this trace has no usable "
                                   "arrival times (timestamp / TIMESTAMP / Timestamp on every line)")
    except (OSError, TraceFormatError) as e:
        raise SystemExit(f"--trace: {e}") from None  # the reader's message names the file
    if skipped:
        print(f"--trace {path}: left out {len(skipped)} file(s) that are not traces: {', '.join(skipped[:5])}",
              file=sys.stderr)
    t = np.concatenate([np.asarray(f.times_s, float) for f in files])
    isl = np.concatenate([np.asarray(f.isl_tokens, np.int64) for f in files])
    osl = np.concatenate([np.asarray(f.osl_tokens, np.int64) for f in files])
    over = np.flatnonzero((isl > MAX_TRACE_TOKENS) | (osl > MAX_TRACE_TOKENS))
    if len(over):
        i = int(over[0])
        raise SystemExit(f"--trace {path}: {len(over)} request(s) with a token count over {MAX_TRACE_TOKENS:,} "
                         f"(a corrupt line), the first the trace's request {i + 1}: input {isl[i]}, output {osl[i]}")
    t = t - t.min() if len(t) else t
    keep = (isl >= 1) & (t >= start_s)
    if duration_s is not None:
        keep &= t < start_s + duration_s
    if not keep.any():
        where = f" in [{start_s:g}, {start_s + duration_s:g}) s" if duration_s is not None else (
            f" from {start_s:g} s" if start_s else "")
        raise SystemExit(f"--trace {path}: no request with a prompt{where} (the trace spans "
                         f"{(t.max() if len(t) else 0.0):.0f} s from its first request)")
    t = t[keep]
    return replicate(t - t.min(), isl[keep], np.maximum(osl[keep], 1), rate_scale, seed)


def replicate(arrival_s, isl, osl, rate_scale: int, seed: int) -> Trace:
    """``rate_scale`` copies of a recorded trace, each arrival moved by a uniform [0, 1) s jitter (seeded;
    none for one copy), merged in arrival order and re-based to start at 0 (see ``--rate-scale``)."""
    t = np.asarray(arrival_s, dtype=float)
    rng = np.random.default_rng(seed)
    k = max(int(rate_scale), 1)
    arr = np.concatenate([t + (rng.uniform(0, 1, len(t)) if k > 1 else 0.0) for _ in range(k)])
    isl_a = np.tile(np.asarray(isl, dtype=np.int64), k)
    osl_a = np.tile(np.asarray(osl, dtype=np.int64), k)
    order = np.argsort(arr, kind="stable")
    return Trace(arr[order] - arr[order][0], isl_a[order], osl_a[order])


def trace_window(a: argparse.Namespace) -> dict:
    """``{"trace_window_s": [start, duration or None]}`` when ``--trace-start-s`` / ``--trace-duration-s``
    replay part of each trace, else nothing (a whole trace)."""
    if a.trace_start_s == 0.0 and a.trace_duration_s is None:
        return {}
    return {"trace_window_s": [a.trace_start_s, a.trace_duration_s]}


def find_model_config(name: str) -> Path:
    hits = sorted(p for p in MODELS_DIR.glob("*_config.json") if name.lower() in p.name.lower())
    if not hits:
        raise SystemExit(f"--model {name!r}: no config in {MODELS_DIR}")
    return hits[0]


def achievable_ttft_s(trace: Trace, profile, ttft_s: float, itl_s: float) -> np.ndarray:
    """Per-request TTFT target for ``slo_attainment_achievable``: the TTFT target, or for a prompt whose
    own prefill (uncontended, from the profile) plus two decode steps at the ITL target exceeds it, that
    time: no fleet serves such a prompt within the target, so it counts as met when it did not wait."""
    own = np.asarray(profile.prefill.prefill_time_s(trace.isl_tokens.astype(float)), float) + 2 * itl_s
    return np.maximum(own, ttft_s)


def summarize(res, ttft_s: float, itl_s: float, achievable_ttft: np.ndarray | None = None) -> dict:
    by_pool = res.gpu_seconds_by_pool
    return {
        "slo_attainment": round(res.slo_attainment(ttft_s, itl_s), 5),
        **({"slo_attainment_achievable": round(res.slo_attainment(achievable_ttft, itl_s), 5)}
           if achievable_ttft is not None else {}),
        "ttft_p90_s": round(res.p90("ttft"), 4),
        "itl_p90_s": round(res.p90("itl"), 5),
        "gpu_hours": round(res.gpu_hours, 3),
        "gpu_hours_prefill": round(by_pool.get("prefill", 0.0) / 3600.0, 3),
        "gpu_hours_decode": round(by_pool.get("decode", 0.0) / 3600.0, 3),
    }


def warm_fleet(plan: list[tuple[int, int]], rule: str, window_s: float, first_ready_s: float) -> tuple[int, int]:
    """The (prefill, decode) fleet every planner starts from. ``oracle_first_window``: the oracle's
    first window. ``oracle_lead``: the oracle plan's maximum over the windows overlapping
    ``[0, first_ready_s]`` (nothing a planner decides is ready before ``interval + worker start``)
    plus one window held, as in the hold reference: the oracle sizes each window from empty, so its
    window-0 decode count cannot carry the sequences of a ramping first minutes (observed: ITL misses
    in minutes 0-3 for every planner)."""
    if rule == "oracle_first_window":
        return plan[0]
    near = plan[: int(first_ready_s // window_s) + 2]
    return max(p for p, _ in near), max(d for _, d in near)


def hold_controller(plan: list[tuple[int, int]], window_s: float, lead_s: float, back_s: float) -> Controller:
    """Perfect-forecast reference: at tick ``t`` ask for the oracle plan's maximum over the windows
    overlapping ``[t - back_s, t + lead_s]`` (a worker launched now serves ``lead_s`` later; one
    released now served until ``t``)."""

    def ctl(tick: TickInput) -> ScalingDecision:
        lo = max(int((tick.now_s - back_s) // window_s), 0)
        hi = max(min(int((tick.now_s + lead_s) // window_s), len(plan) - 1), lo)
        near = plan[min(lo, len(plan) - 1): hi + 1]
        return ScalingDecision(now_s=tick.now_s, prefill_replicas=max(p for p, _ in near),
                               decode_replicas=max(d for _, d in near))

    return ctl


def plan_controller(plan: list[tuple[int, int]], window_s: float) -> Controller:
    """Replays a per-window plan: at tick ``t`` ask for the plan of the window starting at ``t``."""

    def ctl(tick: TickInput) -> ScalingDecision:
        p, d = plan[min(int(round(tick.now_s / window_s)), len(plan) - 1)]
        return ScalingDecision(now_s=tick.now_s, prefill_replicas=p, decode_replicas=d)

    return ctl


def window_counts(timeline: list[dict], window_s: float, num_windows: int) -> list[tuple[float, float]]:
    """Mean (prefill, decode) workers held (launched, not draining) per oracle window, from a
    simulation timeline whose entry at ``t_s`` holds from ``t_s`` to the next entry."""
    acc = [[0.0, 0.0, 0.0] for _ in range(num_windows)]
    prev_t, prev = 0.0, None
    for e in timeline + [{"t_s": float("inf")}]:
        if prev is not None:
            t = prev_t
            while t < min(e["t_s"], num_windows * window_s):
                w = int(t // window_s)
                end = min(e["t_s"], (w + 1) * window_s)
                acc[w][0] += prev["prefill"] * (end - t)
                acc[w][1] += prev["decode"] * (end - t)
                acc[w][2] += end - t
                t = end
        prev_t, prev = e["t_s"], e
    return [(p / n, d / n) if n else (0.0, 0.0) for p, d, n in acc]


def match_attainment(run: Callable[[float], dict], target: float, *, first: float = 0.25, resolution: float = 0.05,
                     max_headroom: float = 4.0, at_zero: dict | None = None) -> dict:
    """Smallest load headroom ``h`` (to ``resolution``) with ``run(h)["slo_attainment"] >= target``.

    ``at_zero``: the result at ``h = 0`` when already known (the ``dynamo_sla`` row); it is returned
    at once when it meets the target (0 is not probed otherwise). Else doubles ``h`` from ``first``
    until the target is met, the last probe at ``max_headroom`` itself, then bisects between the last
    miss and the first hit. Assumes attainment grows with headroom, as it does when more workers are
    provisioned for the same trace. Returns ``{"found", "headroom", "result", "target", "tried":
    [[h, attainment, gpu_hours], ...]}`` (``headroom``/``result`` None when not found). Raises
    ValueError unless ``0 < first <= max_headroom`` and ``resolution > 0``, all finite."""
    if not all(math.isfinite(v) for v in (first, resolution, max_headroom)) or not (
            0.0 < first <= max_headroom and resolution > 0.0):
        raise ValueError(f"match_attainment: need finite 0 < first <= max_headroom and resolution > 0, got "
                         f"first={first}, max_headroom={max_headroom}, resolution={resolution}")
    tried: list[list[float]] = []
    if at_zero is not None and at_zero["slo_attainment"] >= target:
        return {"found": True, "headroom": 0.0, "result": at_zero, "target": target, "tried": tried}

    def probe(h: float) -> dict:
        r = run(h)
        tried.append([round(h, 4), r["slo_attainment"], r["gpu_hours"]])
        return r

    lo, hi, best = 0.0, first, None
    while True:
        r = probe(hi)
        if r["slo_attainment"] >= target:
            best = (hi, r)
            break
        if hi >= max_headroom:
            return {"found": False, "headroom": None, "result": None, "target": target, "tried": tried}
        lo, hi = hi, min(hi * 2.0, max_headroom)
    while best[0] - lo > resolution + 1e-9:
        mid = (lo + best[0]) / 2.0
        r = probe(mid)
        if r["slo_attainment"] >= target:
            best = (mid, r)
        else:
            lo = mid
    return {"found": True, "headroom": round(best[0], 4), "result": best[1], "target": target, "tried": tried}


def match_gpu_hours(run: Callable[[float], dict], budget_gpu_hours: float, *, hi: float,
                    resolution: float = 0.05) -> dict:
    """Largest staffing ``beta`` in ``[0, hi]`` (to ``resolution``) with ``run(beta)["gpu_hours"] <=
    budget_gpu_hours``: ``pdserve_sla`` turned down until it spends no more than a baseline, to compare
    their attainment at equal GPU-hours (the converse of :func:`match_attainment`).

    Probes ``hi`` first (returned at once when within the budget), then 0 (not found when even that is
    over it), then bisects between the last beta within the budget and the first over it. Assumes
    GPU-hours grow with beta, as they do when more prefill headroom is provisioned for the same trace.
    Returns ``{"found", "beta", "result", "budget_gpu_hours", "tried": [[beta, attainment, gpu_hours],
    ...]}`` (``beta``/``result`` None when not found). Raises ValueError unless ``hi >= 0``,
    ``resolution > 0`` and ``budget_gpu_hours > 0``, all finite."""
    if not all(math.isfinite(v) for v in (hi, resolution, budget_gpu_hours)) or not (
            hi >= 0.0 and resolution > 0.0 and budget_gpu_hours > 0.0):
        raise ValueError(f"match_gpu_hours: need finite hi >= 0, resolution > 0 and budget_gpu_hours > 0, got "
                         f"hi={hi}, resolution={resolution}, budget_gpu_hours={budget_gpu_hours}")
    tried: list[list[float]] = []

    def probe(beta: float) -> dict:
        r = run(beta)
        tried.append([round(beta, 4), r["slo_attainment"], r["gpu_hours"]])
        return r

    def done(beta: float | None, r: dict | None) -> dict:
        return {"found": r is not None, "beta": None if beta is None else round(beta, 4), "result": r,
                "budget_gpu_hours": budget_gpu_hours, "tried": tried}

    r = probe(hi)
    if r["gpu_hours"] <= budget_gpu_hours:
        return done(hi, r)
    over = hi
    r = probe(0.0)
    if r["gpu_hours"] > budget_gpu_hours:
        return done(None, None)
    best = (0.0, r)
    while over - best[0] > resolution + 1e-9:
        mid = (best[0] + over) / 2.0
        r = probe(mid)
        if r["gpu_hours"] <= budget_gpu_hours:
            best = (mid, r)
        else:
            over = mid
    return done(*best)


def best_static_fleet(run: Callable[[int, int], dict], gpus: int, prefill_tp: int, decode_tp: int) -> dict | None:
    """The static fleet (``p`` prefill and ``d`` decode workers all hour, at least one each) of highest
    attainment among those using ``gpus`` GPUs or, where TPs leave a remainder, the most below it
    (``d = (gpus - p * prefill_tp) // decode_tp``). ``run(p, d)`` simulates one fleet and returns a
    ``summarize`` row. Ternary search on ``p`` (attainment rises while prefill is the short pool and falls
    once decode is), then every fleet beside the best: about ``2 log2(gpus)`` runs; all of them when
    there are at most 6. Returns ``{"prefill", "decode", "result", "tried": [[p, d, attainment,
    gpu_hours], ...]}``, or None when no fleet fits (``gpus < prefill_tp + decode_tp``)."""
    top = (gpus - decode_tp) // prefill_tp
    if top < 1:
        return None
    seen: dict[int, dict] = {}
    tried: list[list] = []

    def att(p: int) -> float:
        if p not in seen:
            d = (gpus - p * prefill_tp) // decode_tp
            seen[p] = run(p, d)
            tried.append([p, d, seen[p]["slo_attainment"], seen[p]["gpu_hours"]])
        return seen[p]["slo_attainment"]

    lo, hi = 1, top
    while hi - lo > 5:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if att(m1) < att(m2):
            lo = m1 + 1
        else:
            hi = m2 - 1 if att(m1) > att(m2) else m2  # equal: the peak lies between them (unimodal)
    for p in range(lo, hi + 1):
        att(p)
    best = max(seen, key=lambda p: (seen[p]["slo_attainment"], -p))
    for p in (best - 1, best + 1):  # the search's neighbours of the best
        if 1 <= p <= top:
            att(p)
    best = max(seen, key=lambda p: (seen[p]["slo_attainment"], -p))
    return {"prefill": best, "decode": (gpus - best * prefill_tp) // decode_tp, "result": seen[best], "tried": tried}


def excess_breakdown(res: dict, oracle_by_pool: dict, hold: dict) -> dict:
    """Where a planner's GPU-hours above the oracle go, per pool: ``start_lag_and_hold`` is what a
    perfect forecast still costs (oracle plan launched a worker start ahead, held a window after:
    ``oracle_hold_1window``), ``forecast_and_headroom`` the rest (prediction error, burst headroom,
    scale-down delay beyond one window). GPU-hours."""
    out = {}
    for pool in ("prefill", "decode"):
        o, h, r = oracle_by_pool[pool], hold[f"gpu_hours_{pool}"], res[f"gpu_hours_{pool}"]
        out[pool] = {"oracle": round(o, 3), "start_lag_and_hold": round(h - o, 3),
                     "forecast_and_headroom": round(r - h, 3)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, action="append", default=[],
                    help="a recorded trace: Azure-format CSV (TIMESTAMP, ContextTokens, GeneratedTokens), BurstGPT "
                         "CSV (Timestamp, Request tokens, Response tokens), Mooncake JSONL or the runtime's "
                         "--traffic-log, or a folder of one format's files; repeatable with --shape")
    ap.add_argument("--trace-start-s", type=float, default=0.0,
                    help="replay each --trace from this many seconds after its first request (default 0)")
    ap.add_argument("--trace-duration-s", type=float, default=None,
                    help="replay this many seconds of each --trace (default: all of it; an hour, 3600, of a "
                         "week-long trace replays in minutes)")
    ap.add_argument("--shape", action="append", default=[],
                    help="development-set mode: synthetic shapes <arrivals>_<mix> (runtime.sim.shapes; 'dev' for its "
                         "DEFAULT_SHAPES, 'all' for every one), repeatable or a comma list; every --trace joins the "
                         "set; each runs at every --rate-scales and one summary JSON line is printed")
    ap.add_argument("--rate-scales", default=None,
                    help="comma list of rate scales (default 1,5,10 with --shape); given, it selects the "
                         "development-set mode for the --trace files alone too")
    ap.add_argument("--model", default="Llama-3.1-70B",
                    help="model of the simulated engines: a name in the model catalog (runtime/modelfiles), matched "
                         "as a case-insensitive substring of its config file (default Llama-3.1-70B)")
    ap.add_argument("--gpu", default="H100-SXM",
                    help="GPU of the perf model (runtime.perf.gpus; default H100-SXM)")
    ap.add_argument("--rate-scale", type=int, default=10,
                    help="one --trace: replay each request this many times with sub-second jitter, so the hour keeps "
                         "its shape at a larger fleet (default 10)")
    ap.add_argument("--prefill-tp", type=int, default=2, help="tensor parallelism of a prefill worker (default 2)")
    ap.add_argument("--decode-tp", type=int, default=4, help="tensor parallelism of a decode worker (default 4)")
    ap.add_argument("--ttft-s", type=float, default=2.0, help="TTFT target, seconds (default 2)")
    ap.add_argument("--itl-s", type=float, default=0.05, help="ITL target, seconds (default 0.05)")
    ap.add_argument("--worker-start-s", type=float, default=60.0,
                    help="seconds from a scale-up decision until the new worker serves (default 60)")
    ap.add_argument("--interval-s", type=float, default=30.0,
                    help="planner tick, seconds, for the pdserve planners (default 30; Dynamo's rows tick at its own "
                         "defaults)")
    ap.add_argument("--prefill-order", choices=PREFILL_ORDERS, default="length",
                    help="prefill queue order of the simulated cluster, for every planner and the oracles: 'length' "
                         "(prompt-length buckets, what the runtime's default router.prefill_priority=length does) or "
                         "'fcfs' (vLLM's default)")
    ap.add_argument("--gpu-budget", type=int, default=256, help="most GPUs any planner may hold (default 256)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the synthetic shapes and of the --rate-scale jitter (default 0)")
    ap.add_argument("--warm-start", choices=("oracle_lead", "oracle_first_window"), default="oracle_lead",
                    help="initial fleet of every planner: the oracle plan's maximum over the windows up to the first "
                         "scale-up's readiness plus one held window (default), or the oracle's first window only")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line to this file")
    ap.add_argument("--oracle-cache", type=Path, default=None,
                    help="folder that keeps each trace's oracle results between runs (keyed by the trace, profile, "
                         "fleet, SLO and the simulator's sources): a rerun pays only for the planners")
    ap.add_argument("--planners", default="pdserve_sla,pdserve_load,dynamo_sla,dynamo_sla_load,dynamo_planner,static_peak",
                    help="comma list of planners to replay (default all six base planners; also ablation_<name> "
                         "and pdserve_sla_<predictor>)")
    ap.add_argument("--dynamo-venv", type=Path, default=DYNAMO_VENV,
                    help="virtualenv with ai-dynamo==1.0.2 for dynamo_planner (skipped when absent)")
    ap.add_argument("--ablations", action="store_true", help="also run every ABLATIONS variant of pdserve_sla")
    ap.add_argument("--dynamo-matched", action="store_true",
                    help="also search the smallest load headroom on Dynamo's formula (dynamo_sla) that reaches "
                         "--target-attainment, and report it as dynamo_sla_matched (a comparison at equal "
                         "attainment; ~6 more dynamo_sla runs); and the largest staffing beta whose pdserve_sla "
                         "GPU-hours stay within the cheapest Dynamo row's, as pdserve_sla_at_dynamo_gpu_hours (a "
                         "comparison at equal GPU-hours; ~7 more pdserve_sla runs)")
    ap.add_argument("--static-equal-cost", action="store_true",
                    help="also find the static fleet of highest attainment among those of at most pdserve_sla's "
                         "mean GPU count over the hour (prefill and decode fixed all hour), as static_equal_cost: "
                         "a fleet pdserve_sla's point must dominate (~2 log2(GPUs) more simulations)")
    ap.add_argument("--target-attainment", type=float, default=0.99,
                    help="share of requests within both SLOs that --dynamo-matched must reach (default 0.99)")
    ap.add_argument("--sweep-quantiles", default="",
                    help="comma list of SLO quantiles in (0, 1): also run pdserve_sla_q<value>, pdserve_sla with that "
                         "planner.slo_quantile (its one headroom knob: M/M/c and the measured burst headroom of rule "
                         "11 size for it), for an attainment/GPU-hours frontier")
    ap.add_argument("--sweep-window-hold", default="",
                    help="comma list of seconds >= 0: also run pdserve_sla_hold<value>, pdserve_sla with that "
                         "planner.window_hold_s (how long the window pools of rules 11 and 13 remember a burst)")
    ap.add_argument("--extra-predictors", default="",
                    help="comma list (constant,moving_average,arima): also run pdserve_sla_<predictor>")
    a = ap.parse_args(argv)
    set_mode = bool(a.shape) or a.rate_scales is not None
    a.shape = [n for arg in a.shape for n in arg.split(",") if n]
    named = {"dev": tuple(shapes.DEFAULT_SHAPES), "all": tuple(shapes.shape_names())}
    a.shape = list(dict.fromkeys(n for name in a.shape for n in named.get(name, (name,))))
    problems = [f"{name} must be > 0, got {v}" for name, v in (
        ("--interval-s", a.interval_s), ("--gpu-budget", a.gpu_budget), ("--rate-scale", a.rate_scale),
        ("--ttft-s", a.ttft_s), ("--itl-s", a.itl_s)) if not v > 0]
    problems += [f"{name} must be a power of two, got {v}" for name, v in (
        ("--prefill-tp", a.prefill_tp), ("--decode-tp", a.decode_tp)) if v < 1 or v & (v - 1)]
    problems += [f"{name} must be a finite number, got {v}" for name, v in (
        ("--interval-s", a.interval_s), ("--ttft-s", a.ttft_s), ("--itl-s", a.itl_s),
        ("--worker-start-s", a.worker_start_s)) if not np.isfinite(v)]
    if not set_mode and len(a.trace) != 1:
        problems.append("give one --trace, or --shape / --rate-scales (with any number of --trace) for the "
                        "development set")
    if set_mode and not (a.trace or a.shape):
        problems.append("the development set is empty: give --shape and/or --trace")
    bad_shapes = [n for n in a.shape if n not in shapes.shape_names()]
    if bad_shapes:
        problems.append(f"--shape: unknown {bad_shapes} (<arrivals>_<mix>: arrivals {', '.join(shapes.ARRIVALS)}; "
                        f"mix {', '.join(shapes.MIXES)}; or 'dev', 'all')")
    try:
        a.rate_scales = [int(v) for v in (a.rate_scales or "1,5,10").split(",") if v.strip()]
    except ValueError:
        problems.append(f"--rate-scales must be a comma list of whole numbers, got {a.rate_scales!r}")
        a.rate_scales = []
    if set_mode and not (a.rate_scales and all(v > 0 for v in a.rate_scales)):
        problems.append(f"--rate-scales must hold whole numbers > 0, got {a.rate_scales}")
    a.sweep_quantiles = _number_list("--sweep-quantiles", a.sweep_quantiles, problems)
    if not all(0.0 < q < 1.0 for q in a.sweep_quantiles):
        problems.append(f"--sweep-quantiles must lie in (0, 1), got {a.sweep_quantiles}")
    a.sweep_window_hold = _number_list("--sweep-window-hold", a.sweep_window_hold, problems)
    if not all(np.isfinite(h) and h >= 0.0 for h in a.sweep_window_hold):
        problems.append(f"--sweep-window-hold must hold finite seconds >= 0, got {a.sweep_window_hold}")
    if not 0.0 < a.target_attainment < 1.0:
        problems.append(f"--target-attainment must be in (0, 1), got {a.target_attainment}")
    if not (np.isfinite(a.trace_start_s) and a.trace_start_s >= 0):
        problems.append(f"--trace-start-s must be a finite number >= 0, got {a.trace_start_s}")
    if a.trace_duration_s is not None and not (np.isfinite(a.trace_duration_s) and a.trace_duration_s > 0):
        problems.append(f"--trace-duration-s must be a finite number > 0, got {a.trace_duration_s}")
    if not a.worker_start_s >= 0:
        problems.append(f"--worker-start-s must be >= 0, got {a.worker_start_s}")
    bad_pred = sorted(set(filter(None, a.extra_predictors.split(","))) - {"constant", "moving_average", "arima"})
    if bad_pred:
        problems.append(f"--extra-predictors: unknown {bad_pred} (constant, moving_average, arima)")
    base_planners = ("pdserve_sla", "pdserve_load", "dynamo_sla", "dynamo_sla_load", "dynamo_planner", "static_peak")
    known = set(base_planners) | {f"ablation_{k}" for k in ABLATIONS} | {f"pdserve_sla_{p}" for p in PREDICTORS}
    bad_planners = [n for n in a.planners.split(",") if n not in known]
    if bad_planners:
        problems.append(f"--planners: unknown {bad_planners} (choose from {', '.join(base_planners)}, "
                        "ablation_<name>, pdserve_sla_<predictor>)")
    if problems:  # before the minutes of oracle work
        ap.error("; ".join(problems))
    t_start = time.time()

    cfg_path = find_model_config(a.model)
    model = ModelSpec.from_hf_config(json.loads(cfg_path.read_text()), a.model)
    perf = PerfModel(model, get_gpu(a.gpu))
    for tp, what in ((a.prefill_tp, "--prefill-tp"), (a.decode_tp, "--decode-tp")):
        if not perf.fits(tp):
            raise SystemExit(f"{what} {tp}: {a.model} does not fit on {a.gpu}")
    profile = build_profile(perf, a.prefill_tp, a.decode_tp)
    if not set_mode:
        path = a.trace[0]
        trace = load_trace(path, a.rate_scale, a.seed, a.trace_start_s, a.trace_duration_s)
        out = run_trace(a, trace, path.name, a.rate_scale, profile, t_start)
        print_json_line(out, a.out)
        return out
    out = run_shapes(a, profile, t_start)
    print_json_line(out, a.out)
    return out


SET_PLANNER_KEYS = ("slo_attainment", "slo_attainment_achievable", "gpu_hours", "ttft_p90_s", "itl_p90_s")
# the planner's per-shape targets (docs/design/planner.md, "Development set"): attainment at least the
# sequential oracle's less one point, and 99 % wherever the oracle reaches 99.5 %, at no more than 1.3 x its
# GPU-hours
TARGET_POINTS_BELOW_ORACLE, TARGET_FLOOR, TARGET_FLOOR_FROM, TARGET_MAX_VS_ORACLE = 0.01, 0.99, 0.995, 1.3


def shapes_summary(sets: dict) -> dict:
    """Per planner over every shape and rate of a development-set result (``run_shapes``' ``shapes``):
    ``runs``; ``attainment_met`` and ``cost_met`` (the targets above, each alone) and ``met`` (both);
    ``at_least_reacting``: runs attaining at least what the oracle reacting with no foresight attains
    (``oracle_reacting_sim``); ``at_least_static_equal_cost``: runs attaining at least what the best static
    fleet of the planner's GPUs attains (None where that row never ran); ``missed``: the
    ``shape xK`` names of the runs that miss a target. Pure."""
    out: dict[str, dict] = {}
    for shape, by_rate in sets.items():
        for k, run in by_rate.items():
            oracle = run["oracle"]["slo_attainment"]
            need = max(oracle - TARGET_POINTS_BELOW_ORACLE, TARGET_FLOOR if oracle >= TARGET_FLOOR_FROM else 0.0)
            react = run["oracle_reacting_sim"]["slo_attainment"]
            static = run["planners"].get("static_equal_cost")
            for name, p in run["planners"].items():
                if name == "static_equal_cost":
                    continue
                s = out.setdefault(name, {"runs": 0, "attainment_met": 0, "cost_met": 0, "met": 0,
                                          "at_least_reacting": 0, "at_least_static_equal_cost": None, "missed": []})
                # bool(): the figures may be numpy scalars, whose sums json cannot write
                att = bool(p["slo_attainment"] >= need - 1e-9)
                cost = bool(p["vs_oracle"] is not None and p["vs_oracle"] <= TARGET_MAX_VS_ORACLE)
                s["runs"] += 1
                s["attainment_met"] += att
                s["cost_met"] += cost
                s["met"] += att and cost
                s["at_least_reacting"] += bool(p["slo_attainment"] >= react - 1e-9)
                if static is not None:
                    s["at_least_static_equal_cost"] = (s["at_least_static_equal_cost"] or 0) + bool(
                        p["slo_attainment"] >= static["slo_attainment"] - 1e-9)
                if not (att and cost):
                    s["missed"].append(f"{shape} x{k}")
    return out


def run_shapes(a: argparse.Namespace, profile, t_start: float) -> dict:
    """Development-set mode: every ``--trace`` and ``--shape`` at every ``--rate-scales``, the same
    defaults for all; per shape and rate each planner's attainment, GPU-hours and their ratio to the
    sequential oracle's (``vs_oracle``), the oracle's own figures, the oracle launched a worker start
    ahead (``oracle_hold_1window_sim``) and the oracle reacting with no foresight (``oracle_reacting_sim``)."""
    sets: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    jobs = [(p.stem, lambda k, p=p: load_trace(p, k, a.seed, a.trace_start_s, a.trace_duration_s))
             for p in a.trace]
    jobs += [(n, lambda k, n=n: shapes.generate(n, k, a.seed)) for n in a.shape]
    for name, make in jobs:
        for k in a.rate_scales:
            t0 = time.time()
            full = run_trace(a, make(k), name, k, profile, t0)
            oracle_h = full["oracle_gpu_hours"]
            skipped |= full["skipped_planners"]
            planners = {
                pl: {key: r[key] for key in SET_PLANNER_KEYS} | {
                    "vs_oracle": round(r["gpu_hours"] / oracle_h, 3) if oracle_h else None}
                for pl, r in full["planners"].items()
            }
            sets.setdefault(name, {})[str(k)] = {
                "num_requests": full["num_requests"],
                "planners": planners,
                "oracle": {"slo_attainment": full["oracle_slo_attainment"],
                           "slo_attainment_achievable": full["oracle_slo_attainment_achievable"], "gpu_hours": oracle_h,
                           "at_bound": full["oracle_at_bound"]},
                "oracle_hold_1window_sim": {key: full["oracle_hold_1window_sim"][key] for key in SET_PLANNER_KEYS},
                "oracle_reacting_sim": {key: full["oracle_reacting_sim"][key] for key in SET_PLANNER_KEYS},
                "static_peak_gpu_hours": full["static_peak_gpu_hours"],
                # --static-equal-cost: [prefill, decode] workers of the static_equal_cost row
                "static_equal_cost_fleet": [full["static_equal_cost_search"][k] for k in ("prefill", "decode")]
                if full["static_equal_cost_search"] else None,
                "wall_s": full["wall_s"],
            }
    return {
        "bench": "planner_shapes",
        "model": a.model, "gpu": a.gpu, "prefill_tp": a.prefill_tp, "decode_tp": a.decode_tp,
        "slo": {"ttft_s": a.ttft_s, "itl_s": a.itl_s}, "worker_start_s": a.worker_start_s,
        "interval_s": a.interval_s, "prefill_order": a.prefill_order, "seed": a.seed,
        "rate_scales": a.rate_scales, **(trace_window(a) if a.trace else {}), "shapes": sets, "summary": shapes_summary(sets), "skipped_planners": skipped,
        "wall_s": round(time.time() - t_start, 1),
    }


def oracle_cache_path(a: argparse.Namespace, trace: Trace, profile, fleet: FleetConfig) -> Path | None:
    """Where ``--oracle-cache`` keeps one trace's oracle results (None without the option). The key hashes
    everything the oracles depend on: the trace's arrays, the profile, the fleet, the SLO targets and the
    sources of the simulator and the perf model, and the search bound, so an edit to either computes them
    afresh."""
    if a.oracle_cache is None:
        return None
    h = hashlib.sha256()
    for arr in (trace.arrival_s, trace.isl_tokens, trace.osl_tokens):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(repr((profile, fleet, a.ttft_s, a.itl_s, ORACLE_MAX_REPLICAS)).encode())
    for src in sorted([*(ROOT / "runtime" / "sim").glob("*.py"), *(ROOT / "runtime" / "perf").glob("*.py")]):
        h.update(src.read_bytes())
    return a.oracle_cache / f"oracle-{h.hexdigest()[:24]}.pkl"


def run_trace(a: argparse.Namespace, trace: Trace, trace_name: str, rate_scale: int, profile, t_start: float) -> dict:
    """Every planner of ``a.planners`` (and the oracles) on one trace: the single-trace JSON object."""
    fleet = FleetConfig(prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, interval_s=a.interval_s, worker_start_s=a.worker_start_s,
                        prefill_order=a.prefill_order)
    max_rep = max(a.gpu_budget // min(a.prefill_tp, a.decode_tp), 1)

    oracle_window_s = 60.0
    cache = oracle_cache_path(a, trace, profile, fleet)
    if cache is not None and cache.exists():
        oracle_res, plan, lower_s, lower_plan, lower_replay = pickle.loads(cache.read_bytes())
    else:
        # the reference: windows sized in order from the state the previous ones left (its replay meets the SLO)
        oracle_res, plan = sequential_oracle(trace, profile, fleet, ttft_target_s=a.ttft_s, itl_target_s=a.itl_s,
                                             interval_s=oracle_window_s, max_replicas=ORACLE_MAX_REPLICAS)
        # the relaxation that sizes every window from empty: a lower bound whose own replay misses the SLO
        lower_s, lower_plan = oracle_gpu_seconds(trace, profile, fleet, ttft_target_s=a.ttft_s,
                                                 itl_target_s=a.itl_s, interval_s=oracle_window_s,
                                                 max_replicas=ORACLE_MAX_REPLICAS)
        lower_replay = simulate(
            trace, profile,
            replace(fleet, worker_start_s=0.0, interval_s=oracle_window_s, initial_prefill=lower_plan[0][0],
                    initial_decode=lower_plan[0][1]),
            plan_controller(lower_plan, oracle_window_s))
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_bytes(pickle.dumps((oracle_res, plan, lower_s, lower_plan, lower_replay)))
    oracle_s = oracle_res.gpu_seconds
    ach = achievable_ttft_s(trace, profile, a.ttft_s, a.itl_s)
    peak_p, peak_d = max(p for p, _ in plan), max(d for _, d in plan)
    span_s = float(trace.arrival_s[-1])
    hold_s = 0.0
    for i in range(len(plan)):
        near = plan[max(i - 1, 0): i + 2]
        hold_s += (max(p for p, _ in near) * a.prefill_tp + max(d for _, d in near) * a.decode_tp) * min(
            60.0, span_s - 60.0 * i)
    oracle_by_pool = {k: v / 3600.0 for k, v in oracle_res.gpu_seconds_by_pool.items()}
    # every planner starts from the same warm fleet (see --warm-start)
    init_p, init_d = warm_fleet(plan, a.warm_start, oracle_window_s, a.interval_s + a.worker_start_s)
    fleet = replace(fleet, initial_prefill=init_p, initial_decode=init_d)
    # the hold reference simulated: does a perfect forecast with start-up lag meet the SLO?
    hold_ctl = hold_controller(plan, oracle_window_s, a.worker_start_s, oracle_window_s)
    hold_res = simulate(trace, profile, fleet, hold_ctl)
    hold = summarize(hold_res, a.ttft_s, a.itl_s, ach)
    # the no-foresight reference: the window in progress's pools (known in full at its start: a generous
    # reference, up to one window of foresight), launched now, held one window
    react = summarize(simulate(trace, profile, fleet, hold_controller(plan, oracle_window_s, 0.0, oracle_window_s)),
                      a.ttft_s, a.itl_s, ach)

    def pd_cfg(mode: str, predictor: str = "burst_quantile", **overrides: object) -> PlannerConfig:
        kw: dict = dict(
            mode=mode, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, min_prefill=1, max_prefill=max_rep,
            min_decode=1, max_decode=max_rep, gpu_budget=a.gpu_budget, ttft_target_s=a.ttft_s,
            itl_target_s=a.itl_s, interval_s=a.interval_s, predictor=predictor,
            worker_start_s=a.worker_start_s,
        )
        return PlannerConfig(**(kw | overrides))

    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    timelines: dict[str, list] = {}
    wanted = a.planners.split(",") + [f"pdserve_sla_{p}" for p in a.extra_predictors.split(",") if p]
    wanted += [f"ablation_{k}" for k in ABLATIONS] if a.ablations else []
    wanted += [f"pdserve_sla_q{q:g}" for q in getattr(a, "sweep_quantiles", [])]
    wanted += [f"pdserve_sla_hold{h:g}" for h in getattr(a, "sweep_window_hold", [])]
    for name in wanted:
        t0 = time.time()
        if name.startswith("ablation_"):
            ov = ABLATIONS[name.removeprefix("ablation_")]
            sm = PlannerStateMachine(pd_cfg("sla", **ov), profile, initial_prefill=init_p, initial_decode=init_d)
            ab_fleet = replace(fleet, interval_s=ov.get("interval_s", fleet.interval_s))
            res = simulate(trace, profile, ab_fleet, sm.on_tick)
        elif name.startswith("pdserve_sla_q"):
            sm = PlannerStateMachine(pd_cfg("sla", slo_quantile=float(name.removeprefix("pdserve_sla_q"))), profile,
                                     initial_prefill=init_p, initial_decode=init_d)
            res = simulate(trace, profile, fleet, sm.on_tick)
        elif name.startswith("pdserve_sla_hold"):
            sm = PlannerStateMachine(pd_cfg("sla", window_hold_s=float(name.removeprefix("pdserve_sla_hold"))),
                                     profile, initial_prefill=init_p, initial_decode=init_d)
            res = simulate(trace, profile, fleet, sm.on_tick)
        elif name.startswith("pdserve_sla_"):
            sm = PlannerStateMachine(pd_cfg("sla", name.removeprefix("pdserve_sla_")), profile,
                                     initial_prefill=init_p, initial_decode=init_d)
            res = simulate(trace, profile, fleet, sm.on_tick)
        elif name == "pdserve_sla":
            sm = PlannerStateMachine(pd_cfg("sla"), profile, initial_prefill=init_p, initial_decode=init_d)
            res = simulate(trace, profile, fleet, sm.on_tick)
        elif name == "pdserve_load":
            sm = PlannerStateMachine(pd_cfg("load"), None, initial_prefill=init_p, initial_decode=init_d)
            res = simulate(trace, profile, fleet, sm.on_tick)
        elif name == "dynamo_sla":
            dyn = DynamoSlaBaseline(profile, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, ttft_target_s=a.ttft_s,
                                    itl_target_s=a.itl_s, gpu_budget=a.gpu_budget)
            res = simulate(trace, profile, fleet, dyn.on_tick)
        elif name == "dynamo_sla_load":
            dyn = DynamoSlaBaseline(profile, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, ttft_target_s=a.ttft_s,
                                    itl_target_s=a.itl_s, gpu_budget=a.gpu_budget, load_scaling=True)
            res = simulate(trace, profile, replace(fleet, interval_s=DYNAMO_LOAD_TICK_S), dyn.on_tick)
        elif name == "dynamo_planner":
            python = a.dynamo_venv / "bin" / "python"
            if not python.exists():
                skipped[name] = (f"no {python} (set-up: bench/planner_dynamo.py; ai-dynamo==1.0.2 and its planner's "
                                 "imports)")
                continue
            with DynamoPlannerProcess(python, profile, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp,
                                      ttft_s=a.ttft_s, itl_s=a.itl_s, gpu_budget=a.gpu_budget,
                                      tick_s=a.interval_s) as dyn_real:
                res = simulate(trace, profile, fleet, dyn_real)
        elif name == "static_peak":
            res = simulate(trace, profile, replace(fleet, initial_prefill=peak_p, initial_decode=peak_d),
                           static_controller(peak_p, peak_d))
        else:
            raise SystemExit(f"--planners: unknown planner {name!r}")
        results[name] = summarize(res, a.ttft_s, a.itl_s, ach) | {"sim_wall_s": round(time.time() - t0, 1)}
        timelines[name] = res.timeline
    matched = matched_gpu = None
    if a.dynamo_matched:
        t0 = time.time()

        def run_dynamo(headroom: float) -> dict:
            dyn = DynamoSlaBaseline(profile, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, ttft_target_s=a.ttft_s,
                                    itl_target_s=a.itl_s, gpu_budget=a.gpu_budget, load_headroom=headroom)
            return summarize(simulate(trace, profile, fleet, dyn.on_tick), a.ttft_s, a.itl_s)

        matched = match_attainment(run_dynamo, a.target_attainment, at_zero=results.get("dynamo_sla"))
        if matched["found"]:
            results["dynamo_sla_matched"] = matched["result"] | {"load_headroom": matched["headroom"],
                                                                 "sim_wall_s": round(time.time() - t0, 1)}
        # the converse: pdserve_sla's staffing turned down to the cheapest Dynamo row's GPU-hours
        dyn_rows = [results[k] for k in ("dynamo_sla", "dynamo_planner") if k in results]
        if "pdserve_sla" in results and dyn_rows:
            t0 = time.time()
            budget_h = min(r["gpu_hours"] for r in dyn_rows)

            def run_pdserve(beta: float) -> dict:
                # the configured beta (rule 11's measured one off): the knob this search turns
                sm = PlannerStateMachine(pd_cfg("sla", prefill_staffing_beta=beta, measure_burst=False), profile,
                                         initial_prefill=init_p, initial_decode=init_d)
                return summarize(simulate(trace, profile, fleet, sm.on_tick), a.ttft_s, a.itl_s)

            default_beta = pd_cfg("sla").prefill_staffing_beta
            matched_gpu = match_gpu_hours(run_pdserve, budget_h, hi=default_beta if default_beta is not None else 0.0)
            if matched_gpu["found"]:
                results["pdserve_sla_at_dynamo_gpu_hours"] = matched_gpu["result"] | {
                    "prefill_staffing_beta": matched_gpu["beta"], "sim_wall_s": round(time.time() - t0, 1)}
    span_h = float(trace.arrival_s[-1]) / 3600.0
    static_equal = None
    if getattr(a, "static_equal_cost", False) and "pdserve_sla" in results:
        t0 = time.time()

        def run_static(p: int, d: int) -> dict:
            return summarize(simulate(trace, profile, replace(fleet, initial_prefill=p, initial_decode=d),
                                      static_controller(p, d)), a.ttft_s, a.itl_s, ach)

        gpus = int(results["pdserve_sla"]["gpu_hours"] / span_h + 1e-9)
        static_equal = best_static_fleet(run_static, gpus, a.prefill_tp, a.decode_tp)
        if static_equal is not None:
            results["static_equal_cost"] = static_equal["result"] | {"sim_wall_s": round(time.time() - t0, 1)}
    static_h = (peak_p * a.prefill_tp + peak_d * a.decode_tp) * span_h
    out = {
        "bench": "planner",
        "trace": trace_name,
        **trace_window(a),
        "model": a.model,
        "gpu": a.gpu,
        "rate_scale": rate_scale,
        "num_requests": len(trace),
        "span_h": round(span_h, 4),
        "prefill_tp": a.prefill_tp,
        "decode_tp": a.decode_tp,
        "slo": {"ttft_s": a.ttft_s, "itl_s": a.itl_s},
        "worker_start_s": a.worker_start_s,
        "prefill_order": a.prefill_order,
        "planners": results,
        "skipped_planners": skipped,
        "static_peak_gpu_hours": round(static_h, 3),
        "static_peak_replicas": {"prefill": peak_p, "decode": peak_d},
        "oracle_at_bound": max(peak_p, peak_d) >= ORACLE_MAX_REPLICAS,
        "oracle_gpu_hours": round(oracle_s / 3600.0, 3),
        "oracle_slo_attainment": round(oracle_res.slo_attainment(a.ttft_s, a.itl_s), 5),
        # the same against each prompt's achievable TTFT (achievable_ttft_s)
        "oracle_slo_attainment_achievable": round(oracle_res.slo_attainment(ach, a.itl_s), 5),
        # windows sized from empty: a lower bound, and what its plan attains
        # replayed with instant workers (carry-over between windows makes it miss the SLO)
        "oracle_lower_bound_gpu_hours": round(lower_s / 3600.0, 3),
        "oracle_lower_bound_replay_slo_attainment": round(lower_replay.slo_attainment(a.ttft_s, a.itl_s), 5),
        # the oracle's plan held one window either side (perfect forecast, but a worker must be
        # launched a start-time ahead and is kept a window after): a reference for causal planners
        "oracle_hold_1window_gpu_hours": round(hold_s / 3600.0, 3),
        "oracle_gpu_hours_by_pool": {k: round(v, 3) for k, v in oracle_by_pool.items()},
        # the same hold plan replayed on the simulator (start-up lag and carry-over included)
        "oracle_hold_1window_sim": hold,
        # the oracle plan reacting (no foresight beyond the window in progress), replayed
        "oracle_reacting_sim": react,
        # per planner and pool: oracle, + what a perfect forecast still costs, + the planner's own excess
        "excess_vs_oracle_gpu_hours": {name: excess_breakdown(r, oracle_by_pool, hold) for name, r in results.items()},
        # per oracle window: [oracle prefill, oracle decode, pdserve_sla mean prefill, mean decode] workers
        "pdserve_sla_by_window": [
            [p, d, round(pp, 1), round(dd, 1)]
            for (p, d), (pp, dd) in zip(plan, window_counts(timelines["pdserve_sla"], oracle_window_s, len(plan)))
        ] if "pdserve_sla" in timelines else None,
        "pdserve_sla_vs_oracle": round(results["pdserve_sla"]["gpu_hours"] / (oracle_s / 3600.0), 3)
        if "pdserve_sla" in results and oracle_s else None,
        "pdserve_sla_vs_oracle_lower_bound": round(results["pdserve_sla"]["gpu_hours"] / (lower_s / 3600.0), 3)
        if "pdserve_sla" in results and lower_s else None,
        # the same ratio against the oracle that pays the worker start-up lag (simulated hold plan)
        "pdserve_sla_vs_oracle_hold_1window": round(results["pdserve_sla"]["gpu_hours"] / hold["gpu_hours"], 3)
        if "pdserve_sla" in results and hold["gpu_hours"] else None,
        # Dynamo's formula with the smallest load headroom that reaches --target-attainment (every
        # headroom tried, in order): the GPU-hours it needs at pdserve_sla's attainment target
        "dynamo_sla_matched_search": matched,
        # --static-equal-cost: the best static fleet of at most pdserve_sla's mean GPU count (every fleet tried)
        "static_equal_cost_search": static_equal and {k: static_equal[k] for k in ("prefill", "decode", "tried")},
        # pdserve_sla with the largest staffing beta whose GPU-hours stay within the cheapest Dynamo row's
        # (dynamo_sla, dynamo_planner): the attainment it buys at Dynamo's GPU-hours (every beta tried)
        "pdserve_sla_at_dynamo_gpu_hours_search": matched_gpu,
        "pdserve_sla_saving_vs_static_peak": round(1.0 - results["pdserve_sla"]["gpu_hours"] / static_h, 3)
        if "pdserve_sla" in results and static_h else None,
        "profile": {
            "prefill_s_at_mean_isl": round(float(profile.prefill.prefill_time_s(float(np.mean(trace.isl_tokens)))), 4),
            # how long that prefill holds its worker (the queueing service time; the rest is fixed latency)
            "prefill_busy_s_at_mean_isl": round(float(profile.prefill.busy_time_s(float(np.mean(trace.isl_tokens)))), 4),
            "decode_step_s_batch64": round(profile.decode.step_s(64, float(np.mean(trace.isl_tokens))), 5),
            "decode_kv_capacity_tokens": profile.decode.kv_capacity_tokens,
        },
        "initial_replicas": {"prefill": init_p, "decode": init_d},
        "warm_start": a.warm_start,
        "wall_s": round(time.time() - t_start, 1),
    }
    return out


if __name__ == "__main__":
    from runtime.procs import install_sigterm_handler

    install_sigterm_handler()  # SIGTERM stops the servers/subprocesses this run started, like Ctrl-C
    main()
