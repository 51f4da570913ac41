"""The planner as a pure state machine: ``on_tick(TickInput) -> ScalingDecision``.

No clock and no I/O: time arrives in ``TickInput.now_s``; the caller (runtime/server/planner_loop.py
or the fleet simulator) reads metrics and applies decisions through an actuator.

Per tick (SLA mode):
1. Observe rate, ISL, OSL; predict the rate ``1 + ceil(worker_start_s / interval_s)`` ticks ahead
   (scale up early: a worker started now is ready when that load arrives) and never plan below the
   rate just observed, nor below the tick's mean ISL and OSL (the predicted lengths are a mean over the
   predictor window, which trails a shift toward longer prompts or outputs by half a window). Backlog:
   the queues as they will stand when a worker launched now is ready
   (:meth:`PlannerStateMachine.backlog_at_launch`: the tick's queues grown by the arrivals the ready
   pools do not serve over ``worker_start_s``) are planned to drain within ``backlog_drain_s``: the
   prefill queue adds ``queue / backlog_drain_s`` to the prefill rate, the prefill queue and the requests
   waiting for decode admission add theirs to the decode rate (prefill hands its backlog to decode). Why:
   a phase of long prompts that finds a small fleet queues for prefill, then for decode admission once
   prefill drains; a decode pool sized for the arrivals alone becomes the bottleneck of the recovery, and
   a launch sized for the queue of the tick meets the larger queue of a start time later.
2. Burst mode: an observed rate above ``burst_factor`` x the rate predicted for this tick adds
   ``burst_headroom`` and lifts the reserved-priority cap (never the total budget) for at most
   ``burst_max_s``.
3. Correction factors (EWMA, clamped), applied to prefill service time and to the ITL target
   (Dynamo SLA planner). Prefill: when the tick reports ``observed_prefill_time_mean_s`` (vLLM
   ``vllm:request_prefill_time_seconds``, engine-side), observed / profiled prefill occupancy at the tick's mean ISL;
   queueing behind a burst does not enter it, so a burst's TTFT misses do not inflate the service
   time for minutes after it (``correct_by_prefill_time``). Without that metric: observed TTFT p90 / model TTFT p90.
   While observed TTFT p90 is under half the target the TTFT factor may only fall (bursty
   arrivals queue more than M/M/c predicts, but slack that large needs no extra workers).
   While peak sizing (6) is active one sample is capped at ``ttft_correction_max`` (default 1:
   the peak term, not the correction, pays for sub-tick bursts); while square-root staffing (7) is
   active, too, unless the observed TTFT p90 misses the target (then the engines are slower than
   the profile, or the staffing too thin, and the correction may rise to ``CORRECTION_MAX``).
   Decode: observed ITL p90 / model step time at the observed batch.
4. Size pools with runtime.planner.sla (decode at ``DECODE_ITL_MARGIN`` of the ITL target); at low
   load pick aggregated serving when it needs fewer GPUs for a whole scale-down window
   (conditional disaggregation at pool level; ``allow_aggregated``, off by default: the interference
   model plans one aggregated worker up to its ITL limit, where chat load at a few requests a second
   misses ITL for minutes). Decode band (``decode_band``, default on): the
   disaggregated decode pool grows only to the workers the predicted load needs at the *full* ITL
   target and shrinks only to those it needs at ``DECODE_ITL_MARGIN`` of it; between the two it
   keeps its size (:meth:`PlannerStateMachine.decode_band_replicas`); not while the fleet has no
   prefill workers (its decode workers still prefill). Why: a decode worker is a large step (TP4: a
   third of a 3-worker pool), so sizing both ways at the margin launches a worker for rate bursts the
   pool absorbs; the margin still keeps a pool from shrinking to a size that misses the ITL target.
5. Per pool: min/max, GPU budget minus the unused priority reserve (on the desired sizes),
   sliding-window scale-down (prefill ``scale_down_delay_s``, decode ``decode_scale_down_delay_s``)
   and direction cooldown (runtime.planner.stability), then the hard total budget by trimming
   growth only.
6. Peak sizing (``size_on_peak``, off by default: square-root staffing (7) covers sub-tick bursts;
   when on and the tick reports ``peak_prefill_tokens_per_s``): prefill is
   at least the workers that clear the predicted peak second of prompt tokens plus ``B - 1`` s of
   the planned mean load within the TTFT budget ``B`` (:meth:`PlannerStateMachine.peak_prefill_replicas`).
   Long-prompt clusters shorter than a tick drive TTFT misses; a tick's mean hides them.
7. Square-root staffing (``prefill_staffing_beta``, default on): prefill is at least
   ``ceil(R + beta * sqrt(R))`` workers, ``R`` the offered prefill load in Erlangs (requests/s x
   prefill occupancy at the tick's mean ISL x TTFT correction) forecast as the maximum of the last
   ``prefill_level_window_ticks`` ticks (:meth:`PlannerStateMachine.staffing_prefill_replicas`).
   Headroom grows with the square root of the load, not in proportion to it (Halfin & Whitt 1981,
   "Heavy-traffic limits for queues with many exponential servers", Oper. Res. 29(3); the QED
   staffing rule of Borst, Mandelbaum & Reiman 2004, Oper. Res. 52(1)); a short memory lets the
   stateless prefill pool follow the load down instead of holding a burst for a whole window.
   ``beta`` (1.65 at the reference dispersion of rule 11) is the smallest that keeps 99 % of the
   Azure conversation trace's requests within both SLOs (docs/design/planner.md, "Constants").
   The M/M/c term of (4) plans prefill up to ``target_utilization`` (default 1: the wait-quantile
   bound, not a utilisation cap, limits it; the staffing term carries the headroom).
8. Launch on the level, release on the tick (``scale_up_on_level``, default on): the staffing term
   of (7) may *launch* prefill workers only up to ``ceil(L + beta * sqrt(L))``, ``L`` an EWMA of the
   per-tick Erlangs with weight ``1 / lead_ticks`` (its mean age, ``lead_ticks - 1`` ticks, is the
   worker start time) or, when higher, the least load of the last ``lead_ticks`` ticks (a load that
   has lasted a whole start time is launched for in full: a sustained step reaches the full count
   in ``lead_ticks`` ticks, where the EWMA alone takes ~3x as long); scale-down still follows the
   tick's count through the delay of (5). Why: a worker launched now serves only after
   ``worker_start_s``; the part of one tick's load that does not persist that long is over before
   it is ready (a clump of long prompts), and the standing headroom absorbs it. A tick whose prefill queue wait
   is over budget (rule 12) is no such transient: then the tick's count launches at once. With
   ``worker_start_s = 0`` the weight is 1 and, with the default one-tick
   level window, the rule is (7) unchanged; with a longer window the cap also keeps (7)'s window
   maximum and upward trend from launching (they still hold workers through a scale-down).
   The M/M/c term of (4) still launches on the rate predictor (quantile + trend through the lead
   time).
9. The M/M/c term of (4) sizes prefill on the rate predictor's forecast (the window quantile with
   ``burst_quantile``, never below the tick's rate), the same forecast decode is sized on; the
   staffing term (7) follows a fall within its level window, and the scale-down delay of (5) releases
   what the quantile holds.
10. Release on evidence (with ``measure_burst``, once ticks report ``prompt_arrivals``): until the ticks
   have reported arrivals for a whole predictor window neither pool shrinks nor does a fleet with prefill
   workers turn to aggregated serving (the window pools of 11 and 13 are what a release rests on, and they
   need a window to measure), and aggregated serving (4) is kept only while rule 11's window pool is one
   prefill worker (the aggregated pool, the minimum decode pool that also decodes, prefills less than one
   prefill worker).
11. Staffing for measured bursts (``measure_burst``, default on, when ticks report
   ``prompt_arrivals``): the headroom coefficient of (7) is the larger of the configured one (below) and
   a measured one, so the arrivals raise the headroom where they need more. Each tick's
   arrivals are replayed, first come first served from idle, on pools of ``ceil(R_t)`` workers and up
   (``R_t`` the Erlangs of those very requests at the corrected occupancy; runtime.planner.sla.burst_misses;
   a tick's replay covers the arrivals of the last ``lead_ticks`` ticks, the time a launch takes to act),
   counting the requests whose wait exceeds their TTFT budget less their own prefill latency (prompts
   whose prefill alone exceeds the budget are not counted: no pool serves them in time). ``beta`` is the
   least (to ``BURST_BETA_STEP``, at most ``BURST_BETA_MAX``) with which ``ceil(R_t + beta sqrt(R_t))``
   workers leave at most ``1 - slo_quantile`` of the counted requests of the last
   ``predictor_window_ticks`` ticks late (:meth:`PlannerStateMachine.measured_beta`). Why: the headroom a
   pool needs depends on how the arrivals clump at every time scale shorter than a tick and on the spread
   of the service times (long prompts); a replay of what actually arrived measures both at the SLO
   quantile, with no reference trace or constant per traffic shape. The square-root law carries the
   measured coefficient to the forecast load (Halfin & Whitt 1981; for non-Poisson arrivals the
   coefficient grows with their peakedness, Whitt 1992, "Understanding the efficiency of multi-server
   service systems", Management Science 38(5)). The prefill pool is also at least the least pool on
   which the arrivals of the last ``predictor_window_ticks`` ticks, replayed together, leave at most
   ``1 - slo_quantile`` of them late, and at least the same for the arrivals of the last
   ``window_hold_s`` (``window_pool``, runtime.planner.sla.least_pool): bursts shorter than a worker
   start (a Markov-modulated high phase) are over before a launch for them is ready, so the pool must
   stand at what the recent bursts needed, through the gaps between them; it follows a fall within
   ``window_hold_s``. The predictor window's own pool sees a shift to longer prompts within one window
   (over the longer span the new prompts are a smaller share, and the quantile lets more of them be late).
   The configured coefficient is ``prefill_staffing_beta`` scaled by the square root of the smoothed
   arrival dispersion over ``staffing_dispersion_ref`` (floored at ``staffing_dispersion_floor``):
   :meth:`PlannerStateMachine.staffing_beta`; it alone applies before the first tick with arrivals or
   with the rule off. Why the configured coefficient stays under the measured one: the replay starts each
   span from idle and sees no forecast error, so it misses a shift in the prompt mix that a worker start
   cannot follow (a step of +60 % prompt tokens within a tick on the Azure trace); the floor of the
   dispersion, Poisson's 1 by default, keeps arrivals smoother than Poisson from lowering it.
12. Closed-loop prefill floor (``queue_floor``, default on): the observed prefill queue bounds the
   pool from below, so an under-sizing model (service-time variance, arrivals, prompt mixes it does
   not describe) cannot persist. The tick's queue wait is estimated as ``Q * s / c`` (``Q`` requests
   waiting for prefill, ``s`` the corrected occupancy at the tick's mean ISL, ``c`` ready prefill
   workers; with ``Q > 0`` at least the observed TTFT p90 less the p90 prompt's own prefill latency, unless
   requests wait for decode admission: that part of the TTFT is the decode pool's, rule 13)
   and compared with the wait budget ``ttft_target - 2 itl_target - latency``. After
   ``QUEUE_PRESSURE_TICKS`` ticks in a row above it, and once the floor's workers are all ready (a
   raise still starting has not yet acted on the queue), the floor rises to the ready workers plus what
   they lack to serve the tick's load and clear the backlog within one tick, ``ceil(rate * s + Q * s /
   interval - c)``, at least one and at most doubling them (workers a sizing raise is still starting count
   toward the backlog, and the ready workers' spare capacity drains it too); it is capped by
   ``max_prefill`` and what the GPU budget leaves after the minimum decode pool. While the wait stays
   under ``TTFT_SLACK_SHARE`` of the budget the floor halves each tick (a floor raised for a crowd of a
   hundred workers falls back within minutes, not an hour; the window pool of 11 still holds what the
   recent arrivals needed).
   :meth:`PlannerStateMachine.queue_floor` is the floor now.
13. Closed-loop decode floor (``decode_floor``, default on): the same loop for the decode pool, on what its
   workers report. Pressure is an admission wait over the wait budget of (12), estimated by Little's law
   as ``Q * OSL * ITL / running`` (``Q`` requests waiting for decode admission, ``running`` requests in
   the batches: they free KV at ``running / (OSL * ITL)`` a second), or an observed ITL p90 over the ITL
   target. After ``QUEUE_PRESSURE_TICKS`` such ticks, once the floor's workers are ready, the floor rises
   to the ready workers plus those whose KV admits the waiting requests within ``backlog_drain_s`` (each
   holds context ``ISL + OSL/2`` for ``OSL * ITL``: ``Q * ctx * OSL * ITL / (backlog_drain_s * KV *
   DECODE_KV_HEADROOM)``, Little's law; a backlog the ready pool admits within seconds is over before a new
   worker is ready) or that bring the batch back under the ITL target (``c * (ITL p90 / target - 1)``), at
   least one and at most doubling them, within ``max_decode`` and the GPU budget after the minimum
   prefill pool. It halves each tick while the wait is under ``TTFT_SLACK_SHARE`` of the budget, ITL p90 under
   ``DECODE_ITL_MARGIN`` of the target and one worker fewer would still hold the KV in use within
   ``sla.DECODE_KV_HEADROOM``. Why: the decode sizing of (4) plans for a forecast rate at mean lengths;
   admission that waits for KV (long prompts in a burst) or batches that miss ITL show the pool is short,
   whatever the model says. :meth:`PlannerStateMachine.decode_floor` is the floor now. The decode pool is
   also at least the least pool whose KV held the requests of the last predictor window, and of the last
   ``window_hold_s`` (``decode_window_pool``, runtime.planner.sla.kv_pool: each request holds ISL + OSL/2
   tokens for OSL steps at the observed ITL, at all but ``1 - slo_quantile`` of their arrivals), as rule 11
   holds prefill: a burst shorter than a worker start is over before a decode worker launched for it is ready.
14. Hold what recurs (``recurrence_hold``, default on): the window pools of 11 and 13 are held through the
   gaps after which, within the last ``HOLD_HISTORY_S``, a pool they had released was needed again while
   the pool was short (rule 12's or 13's pressure), up to the level that came back
   (runtime.planner.stability.RecurrenceHold). Why: bursts shorter than a worker start that recur after
   gaps longer than ``window_hold_s`` (a Markov-modulated high phase after a long low one) find the
   pool released each time; how long the gaps last is the traffic's, measured from the recurrences that
   found the pool short. A crowd that does not come back is held no longer than ``window_hold_s`` (only levels
   the pool had stood at before it are recorded).

Measured effect of each rule, the constants' derivation and the alternatives measured against them
(decode trend, Little's-law decode growth): docs/design/planner.md.

Load mode replaces 1 + 3 + 4 by ±1 steps from queue depth, KV usage and observed latency.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from runtime.planner import sla
from runtime.planner.predictors import BurstQuantilePredictor, LoadPredictor, MovingAveragePredictor, make_predictor
from runtime.planner.profiles import ServiceProfile
from runtime.planner.stability import PoolStabilizer, RecurrenceHold, fit_budget
from runtime.planner.types import PlannerConfig, ScalingDecision, ServingMode, TickInput

CORRECTION_MIN, CORRECTION_MAX, CORRECTION_EWMA = 0.8, 2.0, 0.3
MIN_REQUESTS_FOR_CORRECTION = 20
DECODE_ITL_MARGIN = 0.9  # decode is sized for this share of the ITL target (p90 over batch swings)
TTFT_SLACK_SHARE = 0.5  # observed TTFT p90 below this share of the target never raises the correction
DISPERSION_EWMA = 0.3  # rule 11: weight of a tick's arrival dispersion in the smoothed one (as CORRECTION_EWMA)
DISPERSION_SAMPLE_MAX = 4.0  # rule 11: a tick's dispersion enters the EWMA capped at this x staffing_dispersion_ref
DISPERSION_SCALE_MAX = 100.0  # rule 11: beta is scaled by at most sqrt(this) (a tiny reference or a huge floor)
# rule 12: one tick whose queue wait exceeds the budget can be a burst the standing headroom absorbs
# within the SLO quantile; the same at the next tick end, a whole interval (>> the TTFT budget) later,
# means the pool did not drain the backlog: the model under-sizes it, whatever the cause
QUEUE_PRESSURE_TICKS = 2
#: rule 14: how far back a recurrence gap counts (an hour: the span over which traffic is taken as one regime)
HOLD_HISTORY_S = 3600.0
# rule 11: the measured staffing coefficient is searched on [0, BURST_BETA_MAX] in steps of BURST_BETA_STEP
# (a resolution of 0.05 sqrt(R) workers; the top is far above what clumps of the traces ask for, ~3)
BURST_BETA_STEP, BURST_BETA_MAX = 0.05, 8.0


@dataclass(frozen=True)
class _Forecast:
    """One tick's forecast (stage 2): predicted request rate (requests/s), burst mode, the rates prefill and
    decode are sized for (requests/s), predicted mean ISL and OSL (tokens)."""

    pred: float
    burst: bool
    plan_rate: float
    plan_rate_d: float
    isl: float
    osl: float


@dataclass(frozen=True)
class Sizing:
    """Raw (unstabilised) pool sizes for one load; ``feasible`` is False when the SLO cannot be met."""

    mode: ServingMode
    prefill: int
    decode: int
    feasible: bool = True


class PlannerStateMachine:
    """SLA or load planner for one prefill pool and one decode pool.

    ``profile`` is required in SLA mode (ValueError otherwise). State: predictors, correction
    factors, burst timer, stabilisers and the last targets. Start targets: ``initial_*`` (the
    running fleet) or the pool minimums.
    """

    def __init__(
        self,
        cfg: PlannerConfig,
        profile: ServiceProfile | None = None,
        *,
        initial_prefill: int | None = None,
        initial_decode: int | None = None,
    ) -> None:
        if cfg.mode == "sla" and profile is None:
            raise ValueError("planner mode 'sla' needs a ServiceProfile (profile=None given)")
        self.cfg = cfg
        self.profile = profile
        w = cfg.predictor_window_ticks
        self._rate: LoadPredictor = make_predictor(cfg.predictor, window=w, quantile=cfg.burst_quantile)
        self._prio: LoadPredictor = make_predictor(cfg.predictor, window=w, quantile=cfg.burst_quantile)
        # token-rate predictors: prefill work is rate x ISL, decode work rate x OSL (see on_tick)
        self._ptok: LoadPredictor = make_predictor(cfg.predictor, window=w, quantile=cfg.burst_quantile)
        self._dtok: LoadPredictor = make_predictor(cfg.predictor, window=w, quantile=cfg.burst_quantile)
        self._peak: LoadPredictor = make_predictor(
            cfg.predictor,
            window=w if cfg.peak_window_ticks is None else cfg.peak_window_ticks,
            quantile=cfg.burst_quantile if cfg.peak_quantile is None else cfg.peak_quantile,
        )
        self._has_peak = False
        # offered prefill load (Erlangs) per tick: the square-root staffing level (rule 7)
        self._erlangs: LoadPredictor = BurstQuantilePredictor(window=cfg.prefill_level_window_ticks, quantile=1.0)
        self._has_erlangs = False
        # the offered prefill load staffing may launch for (rule 8): an EWMA of the per-tick Erlangs
        # (weight 1 / lead_ticks), or the least of the last lead_ticks ticks when that is higher
        self._erlang_ewma: float | None = None
        # rule 11: EWMA of the ticks' arrival dispersion (None until a tick reports one)
        self.arrival_dispersion: float | None = None
        # per-tick Erlangs, newest last: rule 8 reads the last lead_ticks
        self._erlang_recent: deque[float] = deque(maxlen=self.lead_ticks)
        self._isl = MovingAveragePredictor(window=w)
        self._osl = MovingAveragePredictor(window=w)
        self._p_stab = PoolStabilizer(cfg.scale_down_delay_s, cfg.cooldown_s)
        d_delay = cfg.scale_down_delay_s if cfg.decode_scale_down_delay_s is None else cfg.decode_scale_down_delay_s
        self._d_stab = PoolStabilizer(d_delay, max(cfg.cooldown_s, d_delay))
        self._mode_votes: list[tuple[float, bool]] = []
        self.mode: ServingMode = "disaggregated"
        # the running fleet, held within the pool bounds from the first decision on (a fleet above
        # max_* is brought down at once; prefill 0 = aggregated serving is kept)
        self.prefill = cfg.min_prefill if initial_prefill is None else min(max(initial_prefill, 0), cfg.max_prefill)
        self.decode = cfg.min_decode if initial_decode is None else min(max(initial_decode, cfg.min_decode),
                                                                        cfg.max_decode)
        if self.prefill * cfg.prefill_tp + self.decode * cfg.decode_tp > cfg.gpu_budget:
            self.prefill, self.decode = fit_budget(
                self.prefill, self.decode, prefill_tp=cfg.prefill_tp, decode_tp=cfg.decode_tp,
                min_prefill=min(self.prefill, cfg.min_prefill), min_decode=cfg.min_decode, budget_gpus=cfg.gpu_budget)
        self.ttft_correction = 1.0
        self.itl_correction = 1.0
        self._predicted_for_next: float | None = None
        self._burst_since: float | None = None
        self._last_now: float | None = None
        self._last_decision: ScalingDecision | None = None  # returned again for a tick at the same now_s
        self._has_isl = False
        self._last_osl: float | None = None  # the last tick's mean output length with a request ended
        self._queue_floor = 0  # rule 12: prefill workers the observed queue asks for (0: none)
        self._decode_floor = 0  # rule 13: decode workers the observed admission queue and ITL ask for (0: none)
        # rules 11 and 13: the window pools replay the arrivals of the last predictor window and of the last
        # window_hold_s (at least the predictor window)
        hold_ticks = max(cfg.predictor_window_ticks, math.ceil(cfg.window_hold_s / cfg.interval_s - 1e-9))
        # rule 13: (arrival_s, context tokens, lifetime s) of the requests of the last hold_ticks ticks
        self._decode_window: deque[tuple[np.ndarray, np.ndarray, float]] = deque(maxlen=hold_ticks)
        self.decode_window_pool = 0
        self._decode_pressure_ticks = 0
        # rule 14: the window pools held through the recurrence gaps of the last HOLD_HISTORY_S
        history = max(math.ceil(HOLD_HISTORY_S / cfg.interval_s), 1)
        self._p_hold, self._d_hold = RecurrenceHold(history), RecurrenceHold(history)
        # rule 11: per tick with arrivals, (offered Erlangs R, requests that can meet the TTFT, first pool
        # size replayed, late requests at that size and each size after it), the last predictor window
        self._bursts: deque[tuple[float, int, int, list[int]]] = deque(maxlen=cfg.predictor_window_ticks)
        # rule 11: (interval_s, prompt_arrivals) of the last lead_ticks ticks, the span one replay covers
        self._burst_ticks: deque[tuple[float, tuple]] = deque(maxlen=self.lead_ticks)
        # rule 11: prompt_arrivals of the last hold_ticks ticks, and the least pool that served them
        self._window_ticks: deque[tuple] = deque(maxlen=hold_ticks)
        self.window_pool = 0
        self._measured_ticks = 0  # rule 11: ticks since the first that reported prompt_arrivals
        self._pressure_ticks = 0

    # ----------------------------------------------------------------------------- sizing
    @property
    def lead_ticks(self) -> int:
        """Ticks ahead the rate is predicted: this one plus a worker start."""
        return 1 + math.ceil(self.cfg.worker_start_s / self.cfg.interval_s)

    def size_for_load(
        self,
        rate_per_s: float,
        isl_tokens: float,
        osl_tokens: float,
        *,
        with_agg: bool = True,
        decode_rate_per_s: float | None = None,
    ) -> Sizing:
        """Pool sizes for a load before min/max, budget and stability (pure; uses current corrections).

        Aggregated serving is considered only at low load (disaggregated sizing at its minimum: one
        prefill and ``min_decode`` decode workers) and chosen when it needs fewer GPUs."""
        cfg, prof = self.cfg, self.profile
        assert prof is not None
        budget_s = max(cfg.ttft_target_s - 2 * cfg.itl_target_s, 1e-3)
        p = sla.prefill_replicas(
            rate_per_s,
            isl_tokens,
            prof.prefill,
            ttft_budget_s=budget_s,
            ttft_correction=self.ttft_correction,
            target_utilization=cfg.target_utilization,
            quantile=cfg.slo_quantile,
        )
        _, latency_s = sla.prefill_service_s(prof.prefill, isl_tokens, self.ttft_correction)
        d_rate = rate_per_s if decode_rate_per_s is None else decode_rate_per_s
        d = sla.decode_replicas(
            d_rate, isl_tokens, osl_tokens, prof.decode, itl_target_s=cfg.itl_target_s * DECODE_ITL_MARGIN,
            itl_correction=self.itl_correction,
        )
        feasible = d is not None and latency_s <= budget_s
        p = max(p, cfg.min_prefill)
        d = max(cfg.max_decode if d is None else d, cfg.min_decode)
        disagg = Sizing("disaggregated", p, d, feasible)
        at_minimum = p <= max(cfg.min_prefill, 1) and d <= cfg.min_decode
        if not (with_agg and cfg.allow_aggregated and at_minimum):
            return disagg
        n = sla.aggregated_replicas(
            max(rate_per_s, d_rate),
            isl_tokens,
            osl_tokens,
            prof.agg_prefill,
            prof.decode,
            ttft_budget_s=budget_s,
            itl_target_s=cfg.itl_target_s / self.itl_correction,
            max_workers=cfg.max_decode,
            quantile=cfg.slo_quantile,
        )
        if n is not None and max(n, cfg.min_decode) * cfg.decode_tp < p * cfg.prefill_tp + d * cfg.decode_tp:
            return Sizing("aggregated", 0, max(n, cfg.min_decode), True)
        return disagg

    def peak_prefill_replicas(self, rate_per_s: float, isl_tokens: float) -> int:
        """Prefill workers that clear a sub-tick burst within the TTFT budget ``B``: the predicted
        peak second of prompt tokens plus ``B - 1`` seconds at the planned mean rate, in
        worker-seconds, divided by ``B``. Pure; uses the peak predictor's forecast."""
        cfg, prof = self.cfg, self.profile
        assert prof is not None
        budget_s = max(cfg.ttft_target_s - 2 * cfg.itl_target_s, 1.0)
        isl = max(isl_tokens, 1.0)
        s_per_token = float(prof.prefill.busy_time_s(isl)) * self.ttft_correction / isl  # worker-seconds
        peak_tok = max(self._peak.predict(1), self._peak.predict(self.lead_ticks))
        work_s = (peak_tok * 1.0 + rate_per_s * isl * (budget_s - 1.0)) * s_per_token
        return max(math.ceil(work_s / budget_s - 1e-9), 1)

    def decode_band_replicas(self, margin_sized: int, rate_per_s: float, isl_tokens: float, osl_tokens: float) -> int:
        """The decode band (module doc, rule 4): the current decode count clamped to
        ``[needed at the full ITL target, margin_sized]``, ``margin_sized`` being the count sized at
        ``DECODE_ITL_MARGIN`` of the target for the same load (requests/s, mean ISL/OSL tokens).
        Monotone in the load (both bounds are); ``margin_sized`` when no batch meets the full
        target. Pure."""
        cfg, prof = self.cfg, self.profile
        assert prof is not None
        at_target = sla.decode_replicas(rate_per_s, isl_tokens, osl_tokens, prof.decode, itl_target_s=cfg.itl_target_s,
                                        itl_correction=self.itl_correction)
        if at_target is None:
            return margin_sized
        return min(max(self.decode, at_target), margin_sized)

    def staffing_prefill_replicas(self) -> int:
        """Square-root staffing ``ceil(R + beta * sqrt(R))`` for the offered load ``R`` (Erlangs: the
        maximum over the last ``prefill_level_window_ticks`` ticks, plus the predictor's upward trend
        through the lead time when the window holds 3 or more); 0 before any load was observed or
        when ``prefill_staffing_beta`` is None. Rule 8 caps what this may launch. Pure."""
        beta = self.cfg.prefill_staffing_beta
        if beta is None or not self._has_erlangs:
            return 0
        r = max(self._erlangs.predict(1), self._erlangs.predict(self.lead_ticks))
        return self._staff(r)

    def staffing_beta(self) -> float | None:
        """Rule 11's square-root staffing coefficient: ``prefill_staffing_beta`` scaled by
        ``sqrt(max(z, staffing_dispersion_floor) / staffing_dispersion_ref)`` (the ratio capped at
        ``DISPERSION_SCALE_MAX``), ``z`` the smoothed arrival dispersion (an EWMA, weight
        ``DISPERSION_EWMA``, of the ticks' values capped at ``DISPERSION_SAMPLE_MAX`` x the reference);
        ``prefill_staffing_beta`` itself before any tick reported a dispersion or with
        ``staffing_dispersion_ref`` None; None with staffing off. Pure."""
        beta, ref, z = self.cfg.prefill_staffing_beta, self.cfg.staffing_dispersion_ref, self.arrival_dispersion
        if beta is None or ref is None or z is None:
            return beta
        return beta * math.sqrt(min(max(z, self.cfg.staffing_dispersion_floor) / ref, DISPERSION_SCALE_MAX))

    def _replay_inputs(self, reqs: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(arrival_s, occupancy_s, slack_s)`` of ``(arrival_s, prompt_tokens)`` pairs for a replay:
        the corrected prefill occupancy, and the TTFT budget less the request's own prefill latency."""
        prof, cfg = self.profile, self.cfg
        assert prof is not None
        isl = np.maximum(np.array([n for _, n in reqs], float), 1.0)
        busy = np.asarray(prof.prefill.busy_time_s(isl), float)
        fixed = np.maximum(np.asarray(prof.prefill.prefill_time_s(isl), float) - busy, 0.0)
        occ = busy * self.ttft_correction
        slack = max(cfg.ttft_target_s - 2 * cfg.itl_target_s, 0.0) - (fixed + occ)
        return np.array([t for t, _ in reqs], float), occ, slack

    def _observe_burst(self, tick: TickInput) -> None:
        """Rule 11, one tick: the least pool for the last predictor window's arrivals replayed together
        (``window_pool``, sla.least_pool), and the late counts of the last ``lead_ticks`` ticks' arrivals
        replayed on pools from ``ceil(R)`` workers up (R the Erlangs of those very requests over that
        span; sla.burst_misses)."""
        self._burst_ticks.append((tick.interval_s, tick.prompt_arrivals or ()))
        if self._measured_ticks or tick.prompt_arrivals:
            self._measured_ticks += 1
        self._window_ticks.append(tick.prompt_arrivals or ())
        if not tick.prompt_arrivals:
            return
        pool = 0
        for span in _windows(self._window_ticks, self.cfg.predictor_window_ticks):
            arr, occ, slack = self._replay_inputs([e for arrivals in span for e in arrivals])
            pool = sla.least_pool(arr, occ, slack, 1.0 - self.cfg.slo_quantile, at_least=pool)
        self.window_pool = pool
        arr, occ, slack = self._replay_inputs([e for _, arrivals in self._burst_ticks for e in arrivals])
        r = float(occ.sum()) / sum(dt for dt, _ in self._burst_ticks)
        first = max(math.ceil(r - 1e-9), 1)
        late = sla.burst_misses(arr, occ, slack, first, first + math.ceil(BURST_BETA_MAX * math.sqrt(r)) + 1)
        self._bursts.append((r, int(np.sum(slack >= 0.0)), first, late))

    def measured_beta(self) -> float | None:
        """Rule 11's staffing coefficient: the least ``beta`` (a multiple of ``BURST_BETA_STEP`` up to
        ``BURST_BETA_MAX``) with which ``ceil(R_t + beta sqrt(R_t))`` workers would have served all but
        ``1 - slo_quantile`` of the requests that can meet the TTFT target in time, over the replays of
        the last predictor window's ticks together (tick ``t``'s replay covers the last ``lead_ticks``
        ticks at their offered load ``R_t``).
        None before any tick reported ``prompt_arrivals`` or with ``measure_burst`` off. Pure."""
        if not (self.cfg.measure_burst and self._bursts):
            return None
        allowed = (1.0 - self.cfg.slo_quantile) * sum(n for _, n, _, _ in self._bursts)
        steps = int(round(BURST_BETA_MAX / BURST_BETA_STEP))
        for i in range(steps + 1):
            beta = i * BURST_BETA_STEP
            late = 0
            for r, _, first, counts in self._bursts:
                c = max(math.ceil(r + beta * math.sqrt(r) - 1e-9), first)
                late += counts[min(c - first, len(counts) - 1)]
            if late <= allowed:
                return beta
        return BURST_BETA_MAX

    def _staff(self, r: float) -> int:
        """``ceil(r + beta * sqrt(r))`` workers for ``r`` Erlangs (staffing on; beta of rule 11)."""
        beta = self.staffing_beta()
        assert beta is not None
        measured = self.measured_beta()
        if measured is not None:  # rule 11: the replay raises the headroom where the arrivals need more
            beta = max(beta, measured)
        return max(math.ceil(r + beta * math.sqrt(r) - 1e-9), 0)

    def _observe_level(self, erlangs: float) -> None:
        """Rule 8's launch level, updated with this tick's offered load ``erlangs``: one EWMA step with
        weight ``1 / lead_ticks`` (mean age ``lead_ticks - 1`` ticks, the worker start time), raised
        to the least of the last ``lead_ticks`` ticks, so a load that has lasted a whole start time
        is launched for in full (the EWMA alone needs ~3x as long to reach a step)."""
        a = 1.0 / self.lead_ticks
        ewma = self._erlang_ewma
        self._erlang_ewma = erlangs if ewma is None else (1.0 - a) * ewma + a * erlangs
        self._erlang_recent.append(erlangs)

    @property
    def _erlang_level(self) -> float | None:
        """Rule 8's launch level (Erlangs; None before any load was observed): see `_observe_level`."""
        if self._erlang_ewma is None:
            return None
        n = self.lead_ticks
        lasted = min(list(self._erlang_recent)[-n:]) if len(self._erlang_recent) >= n else 0.0
        return max(self._erlang_ewma, lasted)

    def backlog_at_launch(self, tick: TickInput) -> tuple[float, float]:
        """``(prefill, decode)`` requests the tick's queues will hold when a worker launched now is ready
        (``worker_start_s`` on): the requests queued for prefill, and those waiting for decode admission
        (the sum of both is what decode must still admit), each grown by the tick's arrival rate beyond
        what the ready pool serves while a queue stands (a standing queue shows the pool serves less than
        arrives; the launch does not act before it is ready). The prefill pool serves ``c / s`` a second
        (``s`` the corrected occupancy at the tick's mean ISL), the decode pool ``running / (OSL x ITL)``
        (Little's law: a full batch frees a slot per finished request). Pure."""
        prof, cfg = self.profile, self.cfg
        assert prof is not None
        lead_s = cfg.worker_start_s
        p_obs, d_obs = tick.prefill, tick.decode
        q_p = p_obs.queue_per_worker * max(p_obs.num_ready, 1)
        q_d = d_obs.queue_per_worker * max(d_obs.num_ready, 1)
        if not (q_p > 0 or q_d > 0) or not tick.num_requests:
            return q_p, q_d
        lam = tick.rate_per_s
        s = sla.prefill_service_s(prof.prefill, max(tick.mean_isl_tokens, 1.0), self.ttft_correction)[0]
        serve_p = p_obs.num_ready / s if s > 0 else math.inf
        grow_p = max(lam - serve_p, 0.0) * lead_s if q_p > 0 else 0.0
        running = d_obs.running_per_worker * d_obs.num_ready
        life = max(tick.mean_osl_tokens, 1.0) * (tick.observed_itl_mean_s or cfg.itl_target_s)
        serve_d = running / life if running > 0 else 0.0
        # decode admits what prefill hands over: at most the prefill pool's rate while prefill queues
        grow_d = max(min(lam, serve_p) - serve_d, 0.0) * lead_s if q_d > 0 else 0.0
        return q_p + grow_p, q_d + grow_d

    def queue_floor(self) -> int:
        """Rule 12's closed-loop prefill floor, workers (0 while the queue never stayed over budget)."""
        return self._queue_floor

    def _update_queue_floor(self, tick: TickInput) -> None:
        """Rule 12 (module doc): one step of the closed-loop prefill floor from this tick's queue."""
        cfg, prof = self.cfg, self.profile
        assert prof is not None
        c = tick.prefill.num_ready
        q = tick.prefill.queue_per_worker * max(c, 1)
        isl = max(tick.mean_isl_tokens if tick.num_requests else self._isl.predict(), 1.0)
        s, latency = sla.prefill_service_s(prof.prefill, isl, self.ttft_correction)
        budget = max(cfg.ttft_target_s - 2 * cfg.itl_target_s - latency, 0.0)
        wait = (q * s / c if c else math.inf) if q > 0 else 0.0
        if q > 0 and tick.observed_ttft_p90_s is not None and tick.decode.queue_per_worker == 0:
            own = sla.prefill_service_s(prof.prefill, tick.p90_isl_tokens or isl, self.ttft_correction)[1]
            wait = max(wait, tick.observed_ttft_p90_s - own)
        self._pressure_ticks = self._pressure_ticks + 1 if wait > budget else 0
        cap = min(cfg.max_prefill, max((cfg.gpu_budget - cfg.min_decode * cfg.decode_tp) // cfg.prefill_tp, 0))
        # the workers that serve the tick's offered load and clear the backlog within one tick, beyond those
        # ready: the ready pool's spare capacity drains the backlog too
        need = tick.rate_per_s * s + q * s / cfg.interval_s
        self._queue_floor = _closed_loop_floor(
            self._queue_floor, self._pressure_ticks, ready=c, current=self.prefill,
            step=math.ceil(need - c - 1e-9), cap=cap, relaxed=wait <= TTFT_SLACK_SHARE * budget)

    def decode_floor(self) -> int:
        """Rule 13's closed-loop decode floor, workers (0 while decode never stayed overloaded)."""
        return self._decode_floor

    def _observe_decode_window(self, tick: TickInput) -> None:
        """Rule 13, one tick: the least decode pool whose KV held the last predictor window's requests
        (``decode_window_pool``, sla.kv_pool), each holding ISL + OSL/2 tokens for OSL steps at the tick's
        observed mean ITL (without one, the ITL of a batch that fills the KV headroom), at most the ITL
        target: a slower batch is the ITL sizing's case."""
        cfg, prof = self.cfg, self.profile
        assert prof is not None
        if tick.prompt_arrivals:
            osl = max(tick.mean_osl_tokens, 1.0)
            arr = np.array([t for t, _ in tick.prompt_arrivals], float)
            ctx = np.array([n for _, n in tick.prompt_arrivals], float) + osl / 2.0
            itl = tick.observed_itl_mean_s
            if itl is None:  # no request finished: the ITL of a batch that fills the KV headroom
                mean_ctx = float(ctx.mean())
                batch = prof.decode.kv_capacity_tokens * sla.DECODE_KV_HEADROOM / mean_ctx
                itl = prof.decode.step_s(batch, mean_ctx) * self.itl_correction
            itl = min(itl, cfg.itl_target_s)
            self._decode_window.append((arr, ctx, osl * itl))
        else:
            self._decode_window.append((np.empty(0), np.empty(0), 0.0))
        pools = [0]
        for window in _windows(self._decode_window, cfg.predictor_window_ticks):
            spans = [w for w in window if len(w[0])]
            if not spans:
                continue
            # one lifetime for the window (the longest of its ticks): a request's KV is held its whole decode
            life = max(lt for _, _, lt in spans)
            pools.append(sla.kv_pool(np.concatenate([a for a, _, _ in spans]), np.concatenate([c for _, c, _ in spans]),
                                     life, prof.decode.kv_capacity_tokens, cfg.slo_quantile))
        self.decode_window_pool = max(pools)

    def _update_decode_floor(self, tick: TickInput) -> None:
        """Rule 13 (module doc): one step of the closed-loop decode floor from this tick's decode pool."""
        cfg, prof = self.cfg, self.profile
        assert prof is not None
        obs = tick.decode
        c = obs.num_ready
        q = obs.queue_per_worker * max(c, 1)
        running = obs.running_per_worker * c
        isl = max(tick.mean_isl_tokens if tick.num_requests else self._isl.predict(), 1.0)
        osl = max(tick.mean_osl_tokens if tick.num_requests else self._osl.predict(), 1.0)
        ctx = isl + osl / 2.0
        itl = tick.observed_itl_mean_s or (
            prof.decode.step_s(max(obs.running_per_worker, 1.0), ctx) * self.itl_correction)
        # admission wait by Little's law: the queue drains as running requests finish, running / (OSL x ITL) a second
        wait = (q * osl * itl / running if running > 0 else math.inf) if q > 0 else 0.0
        budget = max(cfg.ttft_target_s - 2 * cfg.itl_target_s
                     - sla.prefill_service_s(prof.prefill, isl, self.ttft_correction)[1], 0.0)
        itl_p90 = tick.observed_itl_p90_s
        itl_over = itl_p90 is not None and itl_p90 > cfg.itl_target_s
        self._decode_pressure_ticks = self._decode_pressure_ticks + 1 if (wait > budget or itl_over) else 0
        # workers whose KV admits the waiting requests within the backlog drain time (each holds its context
        # for OSL x ITL: Little's law), and those that bring the batch (ITL ~ batch at a memory-bound step)
        # back under the target
        kv_s = q * ctx * osl * itl / max(cfg.backlog_drain_s, cfg.interval_s)
        step = math.ceil(kv_s / max(prof.decode.kv_capacity_tokens * sla.DECODE_KV_HEADROOM, 1.0) - 1e-9)
        if itl_over:
            step = max(step, math.ceil(c * (itl_p90 / cfg.itl_target_s - 1.0) - 1e-9))
        # one worker fewer must still hold the KV in use within the headroom decode sizing plans for
        kv_fits = c <= 1 or obs.kv_usage * c / (c - 1) <= sla.DECODE_KV_HEADROOM
        relaxed = (wait <= TTFT_SLACK_SHARE * budget and kv_fits
                   and (itl_p90 is None or itl_p90 <= DECODE_ITL_MARGIN * cfg.itl_target_s))
        cap = min(cfg.max_decode, max((cfg.gpu_budget - cfg.min_prefill * cfg.prefill_tp) // cfg.decode_tp, 0))
        self._decode_floor = _closed_loop_floor(self._decode_floor, self._decode_pressure_ticks, ready=c,
                                                current=self.decode, step=step, cap=cap, relaxed=relaxed)

    def _measuring_first_window(self) -> bool:
        """Rule 10: ticks have reported arrivals, but not yet for a whole predictor window."""
        return 0 < self._measured_ticks < self.cfg.predictor_window_ticks

    def _staffing_active(self) -> bool:
        return self.cfg.mode == "sla" and self.cfg.prefill_staffing_beta is not None and self._has_erlangs

    def _gpus(self, s: Sizing) -> int:
        return s.prefill * self.cfg.prefill_tp + s.decode * self.cfg.decode_tp

    # ----------------------------------------------------------------------------- tick
    def on_tick(self, tick: TickInput) -> ScalingDecision:
        """Advance one tick; returns the target replicas.

        A tick at the same ``now_s`` as the previous one (a caller retrying after an error, two loops sharing
        one clock reading) is a duplicate: it returns the previous decision and observes nothing, so the
        predictors, corrections and cooldowns never count one window twice.

        Raises:
            ValueError: ``now_s`` went backwards.
        """
        if self._last_now is not None and tick.now_s < self._last_now:
            raise ValueError(f"TickInput.now_s went backwards ({tick.now_s} < {self._last_now})")
        if self._last_decision is not None and tick.now_s == self._last_decision.now_s:
            return self._last_decision
        self._last_now = tick.now_s
        decision = self._advance(tick)  # a tick that raised is not a decision a retry may repeat
        self._last_decision = decision
        return decision

    def _advance(self, tick: TickInput) -> ScalingDecision:
        """One tick in stages: observe, forecast, size (SLA rules or load steps), decode terms, stabilise.

        The output lengths are those of the requests that ended in the window: a tick in which none ended
        (a first burst, decodes longer than the interval) is sized on the last ones seen, or before any on
        ``prior_osl_tokens``."""
        self._observe(tick)
        if tick.mean_osl_tokens > 0:
            self._last_osl = tick.mean_osl_tokens
        else:
            held = self._last_osl if self._last_osl is not None else self.cfg.prior_osl_tokens
            if held:
                tick = dataclasses.replace(tick, mean_osl_tokens=held)
        f = self._forecast(tick)
        if self.cfg.mode == "load":
            mode: ServingMode = "disaggregated"
            p_des, d_des = self._load_step(tick)
            reason = "load"
        else:
            mode, p_des, d_des, reason = self._size_sla(tick, f)
        p_des = min(max(p_des, 0 if mode == "aggregated" else self.cfg.min_prefill), self.cfg.max_prefill)
        if self.cfg.mode == "sla":
            d_des = self._decode_terms(tick, f, mode, d_des)
        p_tgt, d_tgt, mode = self._stabilise(tick, f, mode, p_des, d_des)
        return ScalingDecision(
            now_s=tick.now_s,
            prefill_replicas=p_tgt,
            decode_replicas=d_tgt,
            serving_mode=mode,
            predicted_rate_per_s=f.pred,
            predicted_isl_tokens=f.isl,
            predicted_osl_tokens=f.osl,
            burst=f.burst,
            ttft_correction=self.ttft_correction,
            itl_correction=self.itl_correction,
            reason=reason + ("+burst" if f.burst else ""),
        )

    def _observe(self, tick: TickInput) -> None:
        """Stage 1: feed the tick to the predictors, the dispersion EWMA, rule 11's replays and the
        offered prefill load of rules 7 and 8."""
        cfg = self.cfg
        rate = tick.rate_per_s
        self._rate.observe(rate)
        self._prio.observe(tick.num_priority_requests / tick.interval_s)
        if tick.num_requests > 0:
            self._isl.observe(tick.mean_isl_tokens)
            self._has_isl = True
        if tick.mean_osl_tokens > 0:  # 0: no request ended in the window, its output lengths are unknown
            self._osl.observe(tick.mean_osl_tokens)
        if tick.arrival_dispersion is not None and tick.num_requests >= 2:
            # a flash crowd in one tick moves the EWMA by at most 0.3 x 4 x the reference
            z, ref, prev = tick.arrival_dispersion, cfg.staffing_dispersion_ref, self.arrival_dispersion
            if ref is not None:
                z = min(z, DISPERSION_SAMPLE_MAX * ref)
            self.arrival_dispersion = z if prev is None else (1.0 - DISPERSION_EWMA) * prev + DISPERSION_EWMA * z
        if tick.peak_prefill_tokens_per_s is not None:
            self._peak.observe(tick.peak_prefill_tokens_per_s)
            self._has_peak = True
        if cfg.mode == "sla" and self.profile is not None:
            isl_now = max(tick.mean_isl_tokens, 1.0)
            service_s = float(self.profile.prefill.busy_time_s(isl_now)) if tick.num_requests else 0.0
            erlangs = rate * service_s * self.ttft_correction
            if cfg.measure_burst:
                self._observe_burst(tick)
            self._erlangs.observe(erlangs)
            if tick.num_requests or self._erlang_ewma is not None:
                self._observe_level(erlangs)
            self._has_erlangs = self._has_erlangs or tick.num_requests > 0

    def _forecast(self, tick: TickInput) -> _Forecast:
        """Stage 2 (rules 1, 2): the rates to plan prefill and decode for, burst mode, predicted ISL/OSL."""
        cfg = self.cfg
        rate = tick.rate_per_s
        isl, osl = self._isl.predict(), self._osl.predict()
        if tick.num_requests > 0:  # rule 1: the window mean trails a shift to longer requests
            isl, osl = max(isl, tick.mean_isl_tokens), max(osl, tick.mean_osl_tokens)
        pred = max(self._rate.predict(1), self._rate.predict(self.lead_ticks))
        burst = self._update_burst(tick.now_s, rate)
        self._predicted_for_next = self._rate.predict(1)
        plan_rate = max(pred, rate)
        plan_rate_d = plan_rate
        if cfg.size_on_tokens and self._has_isl:
            # prefill work is tokens/s (rate x ISL), decode work tokens/s (rate x OSL): predict the
            # products, so a burst of long prompts at a steady request rate still scales prefill
            self._ptok.observe(rate * tick.mean_isl_tokens)
            self._dtok.observe(rate * tick.mean_osl_tokens)
            ptok = max(self._ptok.predict(1), self._ptok.predict(self.lead_ticks), rate * tick.mean_isl_tokens)
            dtok = max(self._dtok.predict(1), self._dtok.predict(self.lead_ticks), rate * tick.mean_osl_tokens)
            plan_rate = ptok / max(isl, 1.0)
            plan_rate_d = dtok / max(osl, 1.0)
        if burst:
            plan_rate *= 1.0 + cfg.burst_headroom
            plan_rate_d *= 1.0 + cfg.burst_headroom
        # every request queued for prefill, or prefilled and waiting for decode admission, when a worker
        # launched now is ready, reaches decode within the backlog drain time (stage 3 sizes prefill to
        # drain its queue within it)
        if cfg.mode == "sla":
            plan_rate_d += sum(self.backlog_at_launch(tick)) / max(cfg.backlog_drain_s, cfg.interval_s)
        return _Forecast(pred, burst, plan_rate, plan_rate_d, isl, osl)

    def _size_sla(self, tick: TickInput, f: _Forecast) -> tuple[ServingMode, int, int, str]:
        """Stage 3 (rules 3-12): corrections, serving mode, and the pool sizes the SLA rules ask for:
        ``(mode, prefill, decode, reason)`` before bounds, budget and stabilisation."""
        cfg = self.cfg
        isl, osl, plan_rate, plan_rate_d = f.isl, f.osl, f.plan_rate, f.plan_rate_d
        self._update_corrections(tick)
        # backlog (stage 1): the prefill queue a launch will meet drains within backlog_drain_s on top
        backlog_rate = self.backlog_at_launch(tick)[0] / max(cfg.backlog_drain_s, cfg.interval_s)
        if not self._has_isl:
            sizing = Sizing("disaggregated", cfg.min_prefill, cfg.min_decode)
        else:
            sizing = self.size_for_load(plan_rate + backlog_rate, isl, osl, decode_rate_per_s=plan_rate_d)
            if sizing.mode == "aggregated" and (self._measuring_first_window() and self.prefill > 0 or (
                    cfg.measure_burst and self.window_pool > max(cfg.min_prefill, 1))):
                # rule 10: releasing the prefill pool waits for a measured window, and the last window's
                # arrivals needed more than one prefill worker: the aggregated pool (the minimum decode pool,
                # also decoding) serves less than that
                sizing = self.size_for_load(plan_rate + backlog_rate, isl, osl, with_agg=False,
                                            decode_rate_per_s=plan_rate_d)
        mode = self._choose_mode(tick.now_s, sizing)
        if mode != sizing.mode:  # hysteresis kept the other mode: size for it
            sizing = (
                self.size_for_load(plan_rate, isl, osl, with_agg=False, decode_rate_per_s=plan_rate_d)
                if mode == "disaggregated"
                else sizing
            )
        p_des, d_des = (sizing.prefill, sizing.decode)
        if mode == "aggregated":
            p_des = 0
        else:
            if cfg.size_on_peak and self._has_peak and self._has_isl:
                p_des = max(p_des, self.peak_prefill_replicas(plan_rate, isl))
            staffed = self.staffing_prefill_replicas()
            level = self._erlang_level
            if cfg.queue_floor:
                self._update_queue_floor(tick)
            # a queue already waiting over budget is no transient: the tick's count launches at once
            if cfg.scale_up_on_level and staffed > self.prefill and level is not None and not self._pressure_ticks:
                # rule 8: launch only for the launch level; a one-tick transient has passed before
                # the worker is ready, the staffing headroom absorbs it
                staffed = max(self.prefill, min(staffed, self._staff(level)))
            p_des = max(p_des, staffed)
            if cfg.measure_burst:
                p_des = max(p_des, self._held(self._p_hold, self.window_pool, tick.prefill.num_ready,
                                              self._pressure_ticks > 0))
            if cfg.queue_floor:
                p_des = max(p_des, self._queue_floor)
        if self._measuring_first_window() and mode == "disaggregated":
            # rule 10: the window pools measure what bursts need over a whole predictor window; until one
            # has been observed a release rests on less evidence than the pools it releases
            p_des = max(p_des, self.prefill)
            d_des = max(d_des, self.decode)
        return mode, p_des, d_des, "sla" if sizing.feasible else "sla_infeasible"

    def _held(self, hold: RecurrenceHold, need: int, ready: int, short: bool) -> int:
        """Rule 14: ``need`` held through the recurrence gaps ``hold`` measured (``recurrence_hold`` on)."""
        held = hold.update(need, ready, short)
        return held if self.cfg.recurrence_hold else need

    def _decode_terms(self, tick: TickInput, f: _Forecast, mode: ServingMode, d_des: int) -> int:
        """Stage 4 (rules 4 and 13): the decode band and the decode floors on the sized decode pool."""
        cfg = self.cfg
        if cfg.decode_band and mode == "disaggregated" and self.prefill > 0 and self._has_isl:
            # not while the fleet has no prefill workers yet: its decode workers still prefill (the
            # cooldown may hold prefill at 0 for several ticks), so they keep the margin sizing
            d_des = self.decode_band_replicas(d_des, f.plan_rate_d, f.isl, f.osl)
        if cfg.decode_floor:
            self._update_decode_floor(tick)
            self._observe_decode_window(tick)
            d_des = max(d_des, self._decode_floor, self._held(self._d_hold, self.decode_window_pool,
                                                              tick.decode.num_ready, self._decode_pressure_ticks > 0))
        return d_des

    def _stabilise(self, tick: TickInput, f: _Forecast, mode: ServingMode, p_des: int,
                   d_des: int) -> tuple[int, int, ServingMode]:
        """Stage 5 (rule 5): pool bounds, the GPU budget less the priority reserve, scale-down delays and
        cooldowns, growth trimmed to the total budget; commits and returns ``(prefill, decode, mode)``."""
        cfg = self.cfg
        min_p = 0 if mode == "aggregated" else cfg.min_prefill
        d_des = min(max(d_des, cfg.min_decode), cfg.max_decode)
        cap = self._budget_cap(f.burst, f.isl, f.osl)
        # rules 12 and 13 are observed pressure: when the budget forces a trim, a pool whose queue keeps its
        # floor raised keeps the workers it has (up to that floor); the trim comes from sized shares
        keep_p = max(min_p, min(self.prefill, self._queue_floor)) if mode != "aggregated" else min_p
        keep_d = max(cfg.min_decode, min(self.decode, self._decode_floor))
        if keep_p * cfg.prefill_tp + keep_d * cfg.decode_tp > cap:
            keep_p, keep_d = min_p, cfg.min_decode
        p_des, d_des = fit_budget(
            max(p_des, keep_p), max(d_des, keep_d), prefill_tp=cfg.prefill_tp, decode_tp=cfg.decode_tp,
            min_prefill=keep_p, min_decode=keep_d, budget_gpus=cap, refill=True,
        )
        d_tgt = self._d_stab.propose(tick.now_s, self.decode, d_des)
        if mode == "aggregated":
            # release prefill only once the decode workers that take over prefill are ready
            ready = tick.decode.num_ready >= d_tgt and self._p_stab.may_move(tick.now_s, self.prefill, 0)
            p_tgt = 0 if ready else self.prefill
        else:
            p_tgt = self._p_stab.propose(tick.now_s, self.prefill, p_des)
        p_tgt, d_tgt = self._fit_growth(p_tgt, d_tgt)
        if 0 < p_tgt < min_p:
            # a fleet below min_prefill (started there) whose growth the budget trimmed because the
            # decode scale-down is held: the minimum is a bound, not a wish; decode gives way at once
            # (past its scale-down delay, never within its direction cooldown)
            p_fit, d_fit = fit_budget(min_p, d_tgt, prefill_tp=cfg.prefill_tp, decode_tp=cfg.decode_tp,
                                      min_prefill=min_p, min_decode=cfg.min_decode, budget_gpus=cfg.gpu_budget)
            if d_fit == d_tgt or self._d_stab.may_move(tick.now_s, self.decode, d_fit):
                p_tgt, d_tgt = p_fit, d_fit
            elif self.prefill == 0:  # back from aggregated: stay there until decode may give way
                p_tgt = 0
        if p_tgt == 0:  # back from aggregated but the cooldown holds prefill at 0: decode still prefills
            mode = "aggregated"
        self._p_stab.commit(tick.now_s, self.prefill, p_tgt)
        self._d_stab.commit(tick.now_s, self.decode, d_tgt)
        self.prefill, self.decode, self.mode = p_tgt, d_tgt, mode
        return p_tgt, d_tgt, mode

    # ----------------------------------------------------------------------------- parts
    def _fit_growth(self, p: int, d: int) -> tuple[int, int]:
        """Keep the total budget by trimming only the pools that grow, back toward their current
        size (the current fleet is within budget). Never forces a scale-down, so the cooldown
        holds; the priority reserve is reclaimed through the normal (late) scale-down path."""
        cfg = self.cfg
        while p * cfg.prefill_tp + d * cfg.decode_tp > cfg.gpu_budget:
            if p > self.prefill and (d <= self.decode or p * cfg.prefill_tp >= d * cfg.decode_tp):
                p -= 1
            elif d > self.decode:
                d -= 1
            else:  # pragma: no cover - current fleet over budget (budget lowered at run time)
                return fit_budget(p, d, prefill_tp=cfg.prefill_tp, decode_tp=cfg.decode_tp,
                                  min_prefill=0 if p == 0 else cfg.min_prefill, min_decode=cfg.min_decode,
                                  budget_gpus=cfg.gpu_budget)
        return p, d

    def _update_burst(self, now_s: float, rate: float) -> bool:
        expected = self._predicted_for_next
        cfg = self.cfg
        if self._burst_since is not None:
            if now_s - self._burst_since >= cfg.burst_max_s or (expected is not None and rate <= expected):
                self._burst_since = None
        elif expected is not None and expected > 0 and rate > cfg.burst_factor * expected:
            self._burst_since = now_s
        return self._burst_since is not None and cfg.burst_max_s > 0

    def _budget_cap(self, burst: bool, isl: float, osl: float) -> int:
        cfg = self.cfg
        reserved = math.floor(cfg.reserved_priority_share * cfg.gpu_budget)
        if burst or reserved == 0:
            return cfg.gpu_budget
        prio_rate = self._prio.predict(self.lead_ticks)
        prio_gpus = 0
        if prio_rate > 0 and cfg.mode == "sla" and self._has_isl:
            prio_gpus = self._gpus(self.size_for_load(prio_rate, isl, osl, with_agg=False))
        floor_gpus = cfg.min_prefill * cfg.prefill_tp + cfg.min_decode * cfg.decode_tp
        return max(cfg.gpu_budget - reserved + min(reserved, prio_gpus), floor_gpus)

    def _update_corrections(self, tick: TickInput) -> None:
        prof, cfg = self.profile, self.cfg
        assert prof is not None
        if tick.num_requests < MIN_REQUESTS_FOR_CORRECTION or self.mode != "disaggregated":
            return
        if cfg.correct_by_prefill_time and tick.observed_prefill_time_mean_s is not None and tick.prefill.num_ready > 0:
            # the engines' own prefill time (engine-side, so against the profile's occupancy): slower
            # engines raise it, queueing behind a burst does not
            exp = float(prof.prefill.busy_time_s(max(tick.mean_isl_tokens, 1.0)))
            if exp > 0:
                self.ttft_correction = _ewma(self.ttft_correction, tick.observed_prefill_time_mean_s / exp)
        elif tick.observed_ttft_p90_s is not None and tick.prefill.num_ready > 0:
            exp = sla.expected_ttft_s(tick.rate_per_s, tick.mean_isl_tokens, tick.prefill.num_ready, prof.prefill, 0.9)
            if tick.p90_isl_tokens is not None:  # p90 TTFT is set by long prompts, not the mean one
                exp += float(prof.prefill.prefill_time_s(tick.p90_isl_tokens)) - float(
                    prof.prefill.prefill_time_s(max(tick.mean_isl_tokens, 1.0))
                )
            exp += cfg.itl_target_s  # first decode step
            # the correction scales the engine's prefill time only (sla.prefill_service_s): take the fixed
            # API-side latency out of both sides so a whole-TTFT ratio does not over- or under-correct it
            isl_m = max(tick.mean_isl_tokens, 1.0)
            fixed = max(float(prof.prefill.prefill_time_s(isl_m)) - float(prof.prefill.busy_time_s(isl_m)), 0.0)
            exp -= fixed
            if math.isfinite(exp) and exp > 0:
                sample = max(tick.observed_ttft_p90_s - fixed, 0.0) / exp
                if tick.observed_ttft_p90_s < TTFT_SLACK_SHARE * cfg.ttft_target_s:
                    sample = min(sample, 1.0)  # ample slack: only ever correct downwards
                if cfg.size_on_peak and self._has_peak:  # the peak term sizes for sub-tick bursts
                    sample = min(sample, cfg.ttft_correction_max)
                elif self._staffing_active() and tick.observed_ttft_p90_s <= cfg.ttft_target_s:
                    # square-root staffing sizes for bursts; raise the service time only on a missed SLO
                    sample = min(sample, cfg.ttft_correction_max)
                self.ttft_correction = _ewma(self.ttft_correction, sample)
        if tick.observed_itl_p90_s is not None and tick.decode.num_ready > 0 and tick.decode.running_per_worker > 0:
            ctx = tick.mean_isl_tokens + tick.mean_osl_tokens / 2.0
            exp = prof.decode.step_s(tick.decode.running_per_worker, ctx)
            if exp > 0:
                self.itl_correction = _ewma(self.itl_correction, tick.observed_itl_p90_s / exp)

    def _choose_mode(self, now_s: float, sizing: Sizing) -> ServingMode:
        """Aggregated only after it was the cheaper choice on every tick of a scale-down window;
        back to disaggregated at once."""
        votes = self._mode_votes
        if votes and votes[-1][0] == now_s:  # same instant again: aggregated only if every ask said so
            votes[-1] = (now_s, votes[-1][1] and sizing.mode == "aggregated")
        else:
            votes.append((now_s, sizing.mode == "aggregated"))
        while votes and votes[0][0] < now_s - self.cfg.scale_down_delay_s:
            votes.pop(0)
        if sizing.mode == "disaggregated":
            return "disaggregated"
        if self.mode == "aggregated":
            return "aggregated"
        spans = votes[0][0] <= now_s - self.cfg.scale_down_delay_s or self.cfg.scale_down_delay_s == 0
        return "aggregated" if spans and all(v for _, v in votes) else "disaggregated"

    def _load_step(self, tick: TickInput) -> tuple[int, int]:
        cfg = self.cfg
        p, d = self.prefill, self.decode
        ttft, itl = tick.observed_ttft_p90_s, tick.observed_itl_p90_s
        q = tick.prefill.queue_per_worker
        if q > cfg.load_queue_up_per_worker or (ttft is not None and ttft > 0.9 * cfg.ttft_target_s):
            p += 1
        elif q < cfg.load_queue_down_per_worker and (ttft is None or ttft < 0.5 * cfg.ttft_target_s):
            p -= 1
        kv = tick.decode.kv_usage
        if kv > cfg.load_kv_up or (itl is not None and itl > 0.9 * cfg.itl_target_s):
            d += 1
        elif kv < cfg.load_kv_down and (itl is None or itl < 0.6 * cfg.itl_target_s):
            d -= 1
        return p, d


def _closed_loop_floor(floor: int, pressure_ticks: int, *, ready: int, current: int, step: int, cap: int,
                       relaxed: bool) -> int:
    """Rules 12 and 13: the next floor (workers) under a pool whose observed wait or latency stayed over
    budget for ``pressure_ticks`` ticks in a row. Raised after ``QUEUE_PRESSURE_TICKS`` such ticks, once
    the pool has its floor's workers ready (a raise still starting has not yet acted), to the larger of the
    floor and the pool (``current``) plus ``step`` workers, at least one and at most doubling it, within
    ``cap``; halved while ``relaxed`` (the pool's other terms, the window pools among them, hold what the
    recent load needs; falling one worker a tick, a floor raised for a flash crowd would hold it for an hour). Pure."""
    if pressure_ticks >= QUEUE_PRESSURE_TICKS and ready >= floor:
        base = max(floor, ready)
        return min(base + min(max(step, 1), max(base, 1)), cap)
    if relaxed:
        return floor // 2
    return floor


def _windows(ticks: deque, short: int) -> list[list]:
    """Rules 11 and 13: the per-tick entries of the last ``short`` ticks (the predictor window) and, when
    ``ticks`` holds more (the ``window_hold_s`` span), all of them; each window pool is the larger of
    their pools."""
    recent = list(ticks)[-short:]
    return [recent, list(ticks)] if len(ticks) > short else [recent]


def _ewma(old: float, sample: float) -> float:
    if not math.isfinite(sample):  # a NaN would stick (max/min pass it through); an inf hits the clamp
        return old if math.isnan(sample) else _ewma(old, CORRECTION_MAX if sample > 0 else CORRECTION_MIN)
    sample = min(max(sample, CORRECTION_MIN), CORRECTION_MAX)
    return (1 - CORRECTION_EWMA) * old + CORRECTION_EWMA * sample


__all__ = ["PlannerStateMachine", "Sizing"]
