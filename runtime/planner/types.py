"""Value types of the planner: what a tick sees (:class:`TickInput`) and what it decides
(:class:`ScalingDecision`), plus the flat :class:`PlannerConfig` the state machine runs from.

Units are in the names: ``*_s`` seconds, ``*_tokens`` tokens, ``*_per_s`` per second.
Sources: Dynamo planner ``core/types.py`` (TickInput → ScalingDecision as plain values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # pragma: no cover
    from runtime.config import DeploymentSpec

ServingMode = Literal["disaggregated", "aggregated"]


@dataclass(frozen=True)
class PoolObservation:
    """Per-pool metrics averaged over the last interval (as read from the workers' /metrics).

    ``num_ready`` workers serving; ``num_starting`` launched but not ready;
    ``queue_per_worker`` mean waiting requests per ready worker (``vllm:num_requests_waiting``);
    ``running_per_worker`` mean running sequences per ready worker (``vllm:num_requests_running``);
    ``kv_usage`` mean KV-cache usage 0-1 (``vllm:kv_cache_usage_perc``).
    """

    num_ready: int = 0
    num_starting: int = 0
    queue_per_worker: float = 0.0
    running_per_worker: float = 0.0
    kv_usage: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_ready", "num_starting", "queue_per_worker", "running_per_worker", "kv_usage"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"PoolObservation.{name} must be finite and >= 0, got {v}")


@dataclass(frozen=True)
class TickInput:
    """Everything one planner tick sees. ``now_s`` is the tick time (any epoch), ``interval_s``
    the length of the window the counters cover. ``observed_*`` are None when no request
    finished in the window. ``p90_isl_tokens`` (optional) is the 90th percentile prompt length of the
    window's requests; it makes the expected TTFT p90 used for the correction factor comparable.
    ``peak_prefill_tokens_per_s`` (optional) is a high quantile (the adapter's choice; the simulator
    uses the 90th) of the prompt tokens arriving per 1-s bin within the window: sub-tick bursts.
    ``observed_ttft_mean_s`` / ``observed_itl_mean_s`` / ``mean_request_duration_s`` (optional): means
    over the window (Dynamo's planner corrects on means, ``observe_traffic_stats``).
    ``observed_prefill_time_mean_s`` (optional): mean prefill time of the requests whose prefill
    finished in the window (vLLM ``vllm:request_prefill_time_seconds`` sum/count); queueing does
    not enter it, so SLA mode corrects the prefill service time by it instead of by TTFT.
    ``arrival_dispersion`` (optional): the index of dispersion of the requests arriving per ~1-s bin
    within the window, around its linear trend (:func:`runtime.planner.sla.arrival_dispersion`); 1 for
    Poisson arrivals, more when they come in clumps.
    ``prompt_arrivals`` (optional): ``(arrival_s, prompt_tokens)`` of every request that arrived in the
    window, arrival times on any clock (the runtime's receipt times, the simulator's trace times);
    SLA mode replays them on candidate prefill pools to measure the headroom bursts need
    (:func:`runtime.planner.sla.burst_misses`)."""

    now_s: float
    interval_s: float
    num_requests: int
    mean_isl_tokens: float
    mean_osl_tokens: float
    prefill: PoolObservation = field(default_factory=PoolObservation)
    decode: PoolObservation = field(default_factory=PoolObservation)
    observed_ttft_p90_s: float | None = None
    observed_itl_p90_s: float | None = None
    num_priority_requests: int = 0
    p90_isl_tokens: float | None = None
    peak_prefill_tokens_per_s: float | None = None
    observed_ttft_mean_s: float | None = None
    observed_itl_mean_s: float | None = None
    mean_request_duration_s: float | None = None
    observed_prefill_time_mean_s: float | None = None
    arrival_dispersion: float | None = None
    prompt_arrivals: tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        if self.prompt_arrivals is not None and not all(
                len(e) == 2 and math.isfinite(e[0]) and math.isfinite(e[1]) and e[1] >= 0 for e in self.prompt_arrivals):
            raise ValueError("TickInput.prompt_arrivals must hold (finite arrival_s, finite prompt_tokens >= 0) pairs")
        if not math.isfinite(self.now_s):
            raise ValueError(f"TickInput.now_s must be finite, got {self.now_s}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"TickInput.interval_s must be finite and > 0, got {self.interval_s}")
        if not (math.isfinite(self.mean_isl_tokens) and math.isfinite(self.mean_osl_tokens)):
            raise ValueError("TickInput.mean_isl_tokens/mean_osl_tokens must be finite")
        for name in ("observed_ttft_p90_s", "observed_itl_p90_s", "p90_isl_tokens", "peak_prefill_tokens_per_s",
                     "observed_ttft_mean_s", "observed_itl_mean_s", "mean_request_duration_s",
                     "observed_prefill_time_mean_s", "arrival_dispersion"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"TickInput.{name} must be finite and >= 0 (or None), got {v}")
        if self.num_requests < 0 or self.num_priority_requests < 0:
            raise ValueError("TickInput.num_requests and num_priority_requests must be >= 0")
        if self.num_priority_requests > self.num_requests:
            raise ValueError("TickInput.num_priority_requests must be <= num_requests")
        if self.mean_isl_tokens < 0 or self.mean_osl_tokens < 0:
            raise ValueError("TickInput.mean_isl_tokens/mean_osl_tokens must be >= 0")
        if self.observed_prefill_time_mean_s is not None and self.observed_prefill_time_mean_s < 0:
            raise ValueError("TickInput.observed_prefill_time_mean_s must be >= 0")

    @property
    def rate_per_s(self) -> float:
        return self.num_requests / self.interval_s


@dataclass(frozen=True)
class ScalingDecision:
    """Target replicas per pool. In ``aggregated`` mode ``prefill_replicas`` is 0 and the decode
    workers also prefill (the router prefills locally)."""

    now_s: float
    prefill_replicas: int
    decode_replicas: int
    serving_mode: ServingMode = "disaggregated"
    predicted_rate_per_s: float = 0.0
    predicted_isl_tokens: float = 0.0
    predicted_osl_tokens: float = 0.0
    burst: bool = False
    ttft_correction: float = 1.0
    itl_correction: float = 1.0
    reason: str = ""

    def num_gpus(self, prefill_tp: int, decode_tp: int) -> int:
        return self.prefill_replicas * prefill_tp + self.decode_replicas * decode_tp


@dataclass(frozen=True)
class PlannerConfig:
    """Flat, validated planner settings (build with :meth:`from_spec`). Times in seconds.

    ``scale_down_delay_s`` holds prefill scale-downs, ``decode_scale_down_delay_s`` decode ones
    (None: the same). ``size_on_peak`` adds the sub-tick burst term for prefill (needs
    ``TickInput.peak_prefill_tokens_per_s``); while it is active one TTFT correction sample is
    capped at ``ttft_correction_max``. ``size_on_tokens`` predicts prompt/output token rates
    instead of request rates. ``backlog_drain_s``: queued prefill requests are planned to drain
    within this time. ``peak_window_ticks`` / ``peak_quantile``: history and quantile of the
    prefill peak predictor (per-pool predictors; None: ``predictor_window_ticks`` /
    ``burst_quantile``, the request-rate predictor's). ``prefill_staffing_beta``: square-root
    staffing of prefill, ``ceil(R + beta * sqrt(R))`` for the offered load ``R`` (Erlangs) forecast
    as the maximum of the last ``prefill_level_window_ticks`` ticks (None: off).
    ``correct_by_prefill_time``: when the tick reports ``observed_prefill_time_mean_s`` the prefill
    service-time correction is observed / profiled prefill time (False: observed / expected TTFT
    p90, as when the metric is absent; kept for the benchmark's ablation). ``decode_band``: the
    decode pool holds its size while the load lies between two sizings of it (grows to the count
    needed at the full ITL target, shrinks to the count needed at ``DECODE_ITL_MARGIN`` of it;
    False: always the margin sizing, kept for the benchmark's ablation). ``scale_up_on_level``: the
    square-root staffing term launches prefill workers only up to the count the smoothed offered load
    needs (an EWMA of the per-tick Erlangs whose mean age is the worker start time), not the count one
    tick's transient asks for; scale-down still follows the tick (False: launch to the tick's count;
    kept for the benchmark's ablation). ``prefill_queue_on_trend``: the M/M/c prefill
    term sizes for the rate predictor's level-and-trend forecast, not the window quantile that holds a
    burst for ``predictor_window_ticks`` (False: the quantile too, kept for the benchmark's ablation;
    only ``burst_quantile`` has both). ``staffing_dispersion_ref``: the arrival dispersion
    ``prefill_staffing_beta`` is calibrated for; when ticks report ``arrival_dispersion`` the staffing
    headroom is ``beta * sqrt(max(z, staffing_dispersion_floor) / staffing_dispersion_ref)``, ``z`` an
    EWMA of the reported dispersions (None: beta as given, whatever the arrivals). ``queue_floor``: the
    observed prefill queue raises a floor under the prefill pool while its wait stays over the TTFT
    budget (runtime.planner.state_machine rule 12; False: open loop, kept for the benchmark's ablation).
    ``measure_burst``: when ticks report ``prompt_arrivals`` the staffing coefficient is the one that
    would have served all but ``1 - slo_quantile`` of the last predictor window's requests in time,
    measured by replaying them (rule 11; False: ``prefill_staffing_beta`` scaled by the arrival
    dispersion, kept for the benchmark's ablation). ``decode_floor``: the observed decode admission
    queue, ITL and KV usage raise a floor under the decode pool while admission waits over the TTFT
    budget or ITL over its target (rule 13; False: open loop, kept for the benchmark's ablation).
    """

    mode: Literal["sla", "load"] = "sla"
    prefill_tp: int = 1
    decode_tp: int = 1
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    gpu_budget: int = 64
    ttft_target_s: float = 2.0
    itl_target_s: float = 0.05
    interval_s: float = 30.0
    predictor: str = "burst_quantile"
    predictor_window_ticks: int = 10
    burst_quantile: float = 0.9
    worker_start_s: float = 60.0
    scale_down_delay_s: float = 30.0
    cooldown_s: float = 30.0
    target_utilization: float = 1.0
    reserved_priority_share: float = 0.0
    burst_headroom: float = 0.0
    burst_factor: float = 1.5
    burst_max_s: float = 300.0
    allow_aggregated: bool = False
    load_queue_up_per_worker: float = 2.0
    load_queue_down_per_worker: float = 0.2
    load_kv_up: float = 0.85
    load_kv_down: float = 0.4
    slo_quantile: float = 0.99
    size_on_tokens: bool = False
    ttft_correction_max: float = 1.0
    backlog_drain_s: float = 60.0
    size_on_peak: bool = False
    decode_scale_down_delay_s: float | None = 120.0
    peak_window_ticks: int | None = None
    peak_quantile: float | None = None
    prefill_staffing_beta: float | None = 1.65
    staffing_dispersion_ref: float | None = 8.0
    staffing_dispersion_floor: float = 1.0
    prefill_level_window_ticks: int = 1
    correct_by_prefill_time: bool = True
    decode_band: bool = True
    scale_up_on_level: bool = True
    prefill_queue_on_trend: bool = True
    queue_floor: bool = True
    measure_burst: bool = True
    decode_floor: bool = True

    def __post_init__(self) -> None:
        for name in ("prefill_tp", "decode_tp", "min_prefill", "max_prefill", "min_decode", "max_decode",
                     "gpu_budget", "predictor_window_ticks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"planner.{name} must be a whole number, got {v!r}")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"planner prefill_tp/decode_tp must be >= 1, got {self.prefill_tp}/{self.decode_tp}")
        if self.min_prefill < 0:
            raise ValueError(f"planner.min_prefill must be >= 0, got {self.min_prefill}")
        if self.min_prefill == 0 and not self.allow_aggregated:
            raise ValueError("planner.min_prefill 0 lets the prefill pool reach 0 workers, which is aggregated serving "
                             "(decode workers prefill), but allow_aggregated is False: set min_prefill >= 1 or "
                             "allow_aggregated True")
        if self.mode not in ("sla", "load"):
            raise ValueError(f"planner.mode must be 'sla' or 'load', got {self.mode!r}")
        for name in ("interval_s", "ttft_target_s", "itl_target_s", "backlog_drain_s", "burst_factor"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"planner.{name} must be finite and > 0, got {v}")
        for name in ("worker_start_s", "scale_down_delay_s", "cooldown_s", "burst_headroom", "burst_max_s",
                     "ttft_correction_max", "load_queue_up_per_worker", "load_queue_down_per_worker"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"planner.{name} must be finite and >= 0, got {v}")
        if self.decode_scale_down_delay_s is not None and not (
                math.isfinite(self.decode_scale_down_delay_s) and self.decode_scale_down_delay_s >= 0):
            raise ValueError(f"planner.decode_scale_down_delay_s must be finite and >= 0, got "
                             f"{self.decode_scale_down_delay_s}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"planner.target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 < self.slo_quantile < 1:
            raise ValueError(f"planner.slo_quantile must be in (0, 1), got {self.slo_quantile}")
        if not 0 <= self.reserved_priority_share < 1:
            raise ValueError(f"planner.reserved_priority_share must be in [0, 1), got {self.reserved_priority_share}")
        if not 0 <= self.load_kv_down <= self.load_kv_up <= 1:
            raise ValueError(f"planner KV thresholds need 0 <= load_kv_down ({self.load_kv_down}) <= load_kv_up "
                             f"({self.load_kv_up}) <= 1")
        if self.load_queue_down_per_worker > self.load_queue_up_per_worker:
            raise ValueError("planner.load_queue_down_per_worker must be <= load_queue_up_per_worker")
        if self.min_prefill > self.max_prefill or self.min_decode > self.max_decode:
            raise ValueError("planner min replicas must be <= max replicas for prefill and decode")
        floor_gpus = self.min_prefill * self.prefill_tp + self.min_decode * self.decode_tp
        if floor_gpus > self.gpu_budget:
            raise ValueError(
                f"planner.gpu_budget {self.gpu_budget} is below the GPUs the minimum replicas need ({floor_gpus})"
            )
        if self.min_decode < 1:
            raise ValueError("planner: decode min_replicas must be >= 1 (someone has to decode)")
        if self.prefill_staffing_beta is not None and not (
                math.isfinite(self.prefill_staffing_beta) and 0 <= self.prefill_staffing_beta <= 100):
            raise ValueError(f"planner.prefill_staffing_beta must be in [0, 100], got {self.prefill_staffing_beta}")
        if self.staffing_dispersion_ref is not None and not (
                math.isfinite(self.staffing_dispersion_ref) and self.staffing_dispersion_ref > 0):
            raise ValueError(f"planner.staffing_dispersion_ref must be finite and > 0 (or None), got "
                             f"{self.staffing_dispersion_ref}")
        if not (math.isfinite(self.staffing_dispersion_floor) and self.staffing_dispersion_floor >= 0):
            raise ValueError(f"planner.staffing_dispersion_floor must be finite and >= 0, got "
                             f"{self.staffing_dispersion_floor}")
        if self.prefill_level_window_ticks < 1:
            raise ValueError(f"planner.prefill_level_window_ticks must be >= 1, got {self.prefill_level_window_ticks}")
        if self.peak_window_ticks is not None and self.peak_window_ticks < 1:
            raise ValueError(f"planner.peak_window_ticks must be >= 1, got {self.peak_window_ticks}")
        if self.peak_quantile is not None and not 0 < self.peak_quantile <= 1:
            raise ValueError(f"planner.peak_quantile must be in (0, 1], got {self.peak_quantile}")

    @classmethod
    def from_spec(cls, spec: "DeploymentSpec", **overrides: object) -> "PlannerConfig":
        """Flatten a DeploymentSpec (slo, pools, planner); ``mode='off'`` maps to 'sla'."""
        p = spec.planner
        kw: dict[str, object] = dict(
            mode="load" if p.mode == "load" else "sla",
            prefill_tp=spec.prefill.tp,
            decode_tp=spec.decode.tp,
            min_prefill=spec.prefill.min_replicas,
            max_prefill=spec.prefill.max_replicas,
            min_decode=spec.decode.min_replicas,
            max_decode=spec.decode.max_replicas,
            gpu_budget=p.gpu_budget,
            ttft_target_s=spec.slo.ttft_p90_ms / 1000.0,
            itl_target_s=spec.slo.itl_p90_ms / 1000.0,
            interval_s=p.interval_s,
            predictor=p.predictor,
            predictor_window_ticks=p.predictor_window_ticks,
            burst_quantile=p.burst_quantile,
            worker_start_s=p.worker_start_s,
            scale_down_delay_s=p.scale_down_delay_s,
            decode_scale_down_delay_s=p.decode_scale_down_delay_s,
            size_on_peak=p.size_on_peak,
            peak_window_ticks=p.peak_window_ticks,
            peak_quantile=p.peak_quantile,
            prefill_staffing_beta=p.prefill_staffing_beta,
            staffing_dispersion_ref=p.staffing_dispersion_ref,
            staffing_dispersion_floor=p.staffing_dispersion_floor,
            prefill_level_window_ticks=p.prefill_level_window_ticks,
            ttft_correction_max=p.ttft_correction_max,
            cooldown_s=p.cooldown_s,
            target_utilization=p.target_utilization,
            reserved_priority_share=p.reserved_priority_share,
            burst_headroom=p.burst_headroom,
            burst_factor=p.burst_factor,
            burst_max_s=p.burst_max_s,
            allow_aggregated=p.allow_aggregated,
            load_queue_up_per_worker=p.load_queue_up_per_worker,
            load_queue_down_per_worker=p.load_queue_down_per_worker,
            load_kv_up=p.load_kv_up,
            load_kv_down=p.load_kv_down,
        )
        kw.update(overrides)
        return cls(**kw)  # type: ignore[arg-type]
