"""Value types of the planner: what a tick sees (:class:`TickInput`) and what it decides
(:class:`ScalingDecision`), plus the flat :class:`PlannerConfig` the state machine runs from.

Units are in the names: ``*_s`` seconds, ``*_tokens`` tokens, ``*_per_s`` per second.
Sources: Dynamo planner ``core/types.py`` (TickInput → ScalingDecision as plain values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

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
    the length of the window the counters cover. ``num_requests``, ``mean_isl_tokens`` and the
    prompt fields are of the requests that arrived in the window; ``mean_osl_tokens`` is of those that
    ended in it (a runtime learns a request's output length only when it ends; 0: none ended). ``observed_*``
    are None when no request finished in the window (TTFT: none had its first token in it). ``p90_isl_tokens``
    (optional) is the 90th percentile prompt length of the window's requests; it makes the expected TTFT p90 used for the correction factor comparable.
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


def setting(default: Any, doc: str, **bounds: float) -> Any:
    """A PlannerConfig field users set in the deployment spec's ``planner`` section, declared once here:
    ``doc`` is its description there and ``bounds`` (``gt``/``ge``/``lt``/``le``) the range the spec
    checks. runtime.config.PlannerSpec takes the default, description and bounds from here
    (runtime.config.planner_field) and :meth:`PlannerConfig.from_spec` copies the value back."""
    return field(default=default, metadata={"doc": doc, "bounds": bounds})


@dataclass(frozen=True)
class PlannerConfig:
    """Flat, validated planner settings (build with :meth:`from_spec`). Times in seconds.

    The fields declared with :func:`setting` are the deployment spec's ``planner`` settings; their
    description is the spec's (runtime.config.PlannerSpec, docs/configuration.md). Pool sizes and
    TP degrees come from the spec's pools, the targets from its ``slo``. Here
    ``decode_scale_down_delay_s`` may also be None (the prefill delay), and ``size_on_peak`` needs
    ``TickInput.peak_prefill_tokens_per_s``; the spec's arrival dispersion is an EWMA of the
    ``TickInput.arrival_dispersion`` the ticks report.

    The other fields are not in the spec. ``prior_osl_tokens``: the output length, tokens, to plan for until a
    tick reports the output lengths of requests that ended (``from_spec``: the workload's ``osl_tokens``, what the
    deployment was tuned for; None: 0 until then). ``size_on_tokens`` predicts prompt/output token rates
    instead of request rates. ``backlog_drain_s``: requests queued for prefill or waiting for decode
    admission when a worker launched now is ready are planned to drain within this time. ``correct_by_prefill_time``: when the tick reports ``observed_prefill_time_mean_s`` the prefill
    service-time correction is observed / profiled prefill time (False: observed / expected TTFT
    p90, as when the metric is absent; kept for the benchmark's ablation). ``decode_band``: the
    decode pool holds its size while the load lies between two sizings of it (grows to the count
    needed at the full ITL target, shrinks to the count needed at ``DECODE_ITL_MARGIN`` of it;
    False: always the margin sizing, kept for the benchmark's ablation). ``scale_up_on_level``: the
    square-root staffing term launches prefill workers only up to the count the smoothed offered load
    needs (an EWMA of the per-tick Erlangs whose mean age is the worker start time), not the count one
    tick's transient asks for; scale-down still follows the tick (False: launch to the tick's count;
    kept for the benchmark's ablation). ``queue_floor``: the
    observed prefill queue raises a floor under the prefill pool while its wait stays over the TTFT
    budget (runtime.planner.state_machine rule 12; False: open loop, kept for the benchmark's ablation).
    ``measure_burst``: when ticks report ``prompt_arrivals`` the staffing coefficient is the one that
    would have served all but ``1 - slo_quantile`` of the last predictor window's requests in time,
    measured by replaying them (rule 11; False: ``prefill_staffing_beta`` scaled by the arrival
    dispersion, kept for the benchmark's ablation). ``decode_floor``: the observed decode admission
    queue, ITL and KV usage raise a floor under the decode pool while admission waits over the TTFT
    budget or ITL over its target (rule 13; False: open loop, kept for the benchmark's ablation).
    ``recurrence_hold``: the window pools of rules 11 and 13 are held through the gaps after which a
    released pool was needed again while short (rule 14; False: the window alone, kept for the
    benchmark's ablation).
    """

    mode: Literal["sla", "load"] = "sla"
    prefill_tp: int = 1
    decode_tp: int = 1
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    gpu_budget: int = setting(
        64,
        "Total GPUs the planner may use.",
        ge=1,
    )
    ttft_target_s: float = 2.0
    itl_target_s: float = 0.05
    prior_osl_tokens: float | None = None
    interval_s: float = setting(
        30.0,
        "Planner tick interval, seconds.",
        gt=0,
    )
    predictor: str = setting(
        "burst_quantile",
        "Load predictor name: moving_average, burst_quantile (recommended for SLA mode, what bench/planner.py "
        "runs), residual_quantile, constant or arima (registry runtime.planner.predictors.PREDICTORS).",
    )
    predictor_window_ticks: int = setting(
        10,
        "Ticks of history the predictor looks at (moving average, quantile).",
        ge=1,
    )
    window_hold_s: float = setting(
        600.0,
        "SLA mode: the window pools (the least prefill and decode pools that would have served recent arrivals "
        "within the SLO) also replay the arrivals of this many seconds, so a burst shorter than a worker start "
        "keeps its pool standing this long (at least predictor_window_ticks ticks; the predictor window's own "
        "pool still follows a shift to longer requests within one window; at most an hour: each tick replays "
        "the arrivals of the span).",
        ge=0, le=3600,
    )
    burst_quantile: float = setting(
        0.9,
        "Quantile of recent per-tick rates used by burst_quantile (0-1).",
        gt=0, le=1,
    )
    worker_start_s: float = setting(
        60.0,
        "Lead time for a new worker to become ready, seconds (scale up early).",
        ge=0,
    )
    scale_down_delay_s: float = setting(
        30.0,
        "A lower prefill target must persist this long before scaling down, seconds (decode: "
        "decode_scale_down_delay_s).",
        ge=0,
    )
    cooldown_s: float = setting(
        30.0,
        "Minimum time between two scaling-direction changes of a pool, seconds.",
        ge=0,
    )
    target_utilization: float = setting(
        1.0,
        "Highest planned busy fraction of a prefill worker in the M/M/c sizing (0-1; 1: only the TTFT wait "
        "quantile limits it, square-root staffing adds the headroom).",
        gt=0, le=1,
    )
    reserved_priority_share: float = setting(
        0.0,
        "Share of gpu_budget kept for priority traffic (0-1).",
        ge=0, lt=1,
    )
    burst_headroom: float = setting(
        0.0,
        "Extra capacity fraction added while a burst is detected (0.25 = +25%).",
        ge=0,
    )
    burst_factor: float = setting(
        1.5,
        "A burst is an observed rate above this multiple of the predicted rate.",
        gt=1,
    )
    burst_max_s: float = setting(
        300.0,
        "Longest a burst mode may last, seconds.",
        ge=0,
    )
    allow_aggregated: bool = setting(
        False,
        "At low load, serve aggregated (decode workers also prefill) if it needs fewer GPUs. Off by default: a "
        "pool that both prefills and decodes runs at its ITL limit once the load nears one worker's, which the "
        "model of the interference does not foresee (docs/design/planner.md).",
    )
    load_queue_up_per_worker: float = setting(
        2.0,
        "Load mode: scale prefill up above this many waiting requests per worker.",
        ge=0,
    )
    load_queue_down_per_worker: float = setting(
        0.2,
        "Load mode: scale prefill down below this many waiting requests per worker.",
        ge=0,
    )
    load_kv_up: float = setting(
        0.85,
        "Load mode: scale decode up above this mean KV-cache usage (0-1).",
        gt=0, le=1,
    )
    load_kv_down: float = setting(
        0.4,
        "Load mode: scale decode down below this mean KV-cache usage (0-1).",
        ge=0, lt=1,
    )
    slo_quantile: float = 0.99
    size_on_tokens: bool = False
    ttft_correction_max: float = setting(
        1.0,
        "SLA mode: cap on one observed/expected TTFT sample while peak sizing is active (1.0 = the correction "
        "only ever lowers the prefill service time).",
        gt=0,
    )
    backlog_drain_s: float = 60.0
    size_on_peak: bool = setting(
        False,
        "SLA mode: also size prefill to clear the predicted peak second of prompt tokens within the TTFT budget "
        "(sub-interval bursts).",
    )
    decode_scale_down_delay_s: float | None = setting(
        120.0,
        "A lower decode target must persist this long before scaling down, seconds (a decode worker drains its "
        "sequences and takes worker_start_s to come back).",
        ge=0,
    )
    peak_window_ticks: int | None = setting(
        None,
        "SLA mode: ticks of history of the prefill peak predictor (None: predictor_window_ticks).",
        ge=1,
    )
    peak_quantile: float | None = setting(
        None,
        "SLA mode: quantile (0-1) of recent per-tick prompt-token peaks the prefill peak predictor provisions for"
        " (None: burst_quantile).",
        gt=0, le=1,
    )
    prefill_staffing_beta: float | None = setting(
        1.65,
        "SLA mode: square-root staffing of the prefill pool, at least R + beta * sqrt(R) workers for the offered "
        "load R in Erlangs (dimensionless beta; None: off).",
        ge=0, le=100,
    )
    staffing_dispersion_ref: float | None = setting(
        8.0,
        "SLA mode: index of dispersion of per-second request arrivals (residual variance around the tick's trend "
        "/ mean; 1 for Poisson) prefill_staffing_beta is calibrated for; the runtime measures it each tick and "
        "scales the staffing headroom by sqrt(max(measured, staffing_dispersion_floor) / this) (None: beta as "
        "given).",
        gt=0,
    )
    staffing_dispersion_floor: float = setting(
        1.0,
        "SLA mode: the least arrival dispersion the staffing headroom is scaled for (1: Poisson's; arrivals "
        "smoother than Poisson do not lower it).",
        ge=0,
    )
    prefill_level_window_ticks: int = setting(
        1,
        "SLA mode: ticks whose maximum offered prefill load the square-root staffing plans for.",
        ge=1,
    )
    correct_by_prefill_time: bool = True
    decode_band: bool = True
    scale_up_on_level: bool = True
    queue_floor: bool = True
    measure_burst: bool = True
    decode_floor: bool = True
    recurrence_hold: bool = True

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
                     "window_hold_s", "ttft_correction_max", "load_queue_up_per_worker", "load_queue_down_per_worker"):
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
        prior = self.prior_osl_tokens
        if prior is not None and not (math.isfinite(prior) and prior >= 0):
            raise ValueError(f"prior_osl_tokens must be a finite number >= 0, got {self.prior_osl_tokens}")
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
            ttft_target_s=spec.slo.ttft_p90_ms / 1000.0,
            itl_target_s=spec.slo.itl_p90_ms / 1000.0,
            prior_osl_tokens=float(spec.workload.osl_tokens),
            **{name: getattr(p, name) for name in SPEC_SETTINGS},
        )
        kw.update(overrides)
        return cls(**kw)  # type: ignore[arg-type]


# the PlannerConfig fields the deployment spec's planner section carries (declared with setting())
SPEC_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(PlannerConfig) if "doc" in f.metadata)
