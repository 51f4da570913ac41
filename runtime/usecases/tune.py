"""Use case: tune prefill TP × decode TP for a model, write the winner's DeploymentSpec, register it in MLflow.

Every face runs the same rules from here: the pipeline's tune step (`components/tune.py`) calls :func:`tune`
with a :class:`TuneRequest`; `pdserve tune` (runtime/faces/tune.py) reads its model and trace the way a
command line does and then calls the same phases, :func:`resolve_precision`, :func:`deployment_for` and
:func:`register_tuning`, so the precision rule, the spec, the GPU budget check, the champion rule and the
alias decision are one code path. Nothing here prints or exits; problems are raised, facts for people are
returned as ``notes``.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, SloSpec, WorkloadSpec
from runtime.deploy.budget import GpuBudgetError, check_gpu_budget
from runtime.modelfiles.load import AUTO_PRECISION, check_precision, checkpoint_precision
from runtime.models.spec import ModelSpec
from runtime.perf.gpus import GpuSpec
from runtime.tuner.search import TuneResult, perf_precisions
from runtime.tuner.workload import LengthSample
from runtime.usecases.champion import ChampionCheck, ChampionPolicy, check_against_champion

AUTO_REQUEST_RATE = 0.0  # request_rate_per_s "not chosen": the trace's mean arrival rate, else WorkloadSpec's default


def pydantic_problems(e: ValidationError, names: dict[str, str] | None = None) -> str:
    """A pydantic ValidationError as one line, ``name: message, got value`` per problem joined by ``; `` (the
    field name mapped through ``names``, e.g. to a command-line option); no pydantic URL."""
    names = names or {}
    out = []
    for err in e.errors(include_url=False):
        key = str(err["loc"][-1]) if err["loc"] else ""
        out.append(f"{names.get(key, key or 'value')}: {str(err['msg']).removeprefix('Value error, ')}, "
                   f"got {err.get('input')!r}")
    return "; ".join(out)


def engine_option_problems(max_model_len_tokens: int | None, engine_args: list[str] | tuple[str, ...]) -> list[str]:
    """The problems of `--max-model-len` and `--engine-arg` (`tune`, `promote`), named after those options: a
    TOKENS that is not positive, an item the pinned vLLM's parser refuses (runtime.engines.engine_args
    .engine_arg_flags: the message suggests close argument names). vLLM's parser (seconds to build) is built only
    when items are given. Empty: none."""
    problems = []
    if max_model_len_tokens is not None and max_model_len_tokens <= 0:
        problems.append(f"--max-model-len: must be a positive number of tokens, got {max_model_len_tokens}")
    if engine_args:
        from runtime.engines.engine_args import engine_arg_flags

        try:
            engine_arg_flags(list(engine_args))
        except ValueError as e:
            problems.append(str(e))
    return problems


class TuneSettings(BaseModel):
    """The tuning parameters that can be checked without the model, the trace's contents or the network."""

    model_config = ConfigDict(extra="forbid")

    gpu: str = Field(description="GPU catalog name (H100-SXM, L40S, ...) or an AWS instance type (p5.48xlarge), "
                                 "which also bounds TP by its GPU count.")
    precision: str = Field(AUTO_PRECISION, description="Weights and KV-cache precision: auto (the checkpoint's "
                                                       "own: fp8 for an FP8 checkpoint, else bf16), bf16 or fp8.")
    ttft_p90_ms: float = Field(description="TTFT SLO: p90 time to first token, milliseconds.")
    itl_p90_ms: float = Field(description="ITL SLO: p90 inter-token latency, milliseconds.")
    isl_tokens: int = Field(description="Mean input length, tokens; replaced by the trace's with a trace.")
    osl_tokens: int = Field(description="Mean output length, tokens; replaced by the trace's with a trace.")
    request_rate_per_s: float = Field(AUTO_REQUEST_RATE, description="Target load, requests/s; 0: the trace's mean "
                                                                     "arrival rate with a trace, else 10.")
    gpu_budget: Optional[int] = Field(None, description="GPUs the deployment may use (planner.gpu_budget); None: "
                                                        "PlannerSpec's default.")
    registered_model: str = Field(description="MLflow registered model the winner is registered under.")
    traffic_trace_uri: str = Field("", description="Traffic to size for: s3://bucket/key, s3://bucket/prefix/ or an "
                                                   "absolute path under fsx_root; empty: none.")
    fsx_root: Optional[str] = Field(None, description="FSx mount path a local traffic_trace_uri must lie under.")
    planner_mode: str = Field("off", description="The champion's planner.mode: off, sla or load.")
    trace_window_h: float = Field(0.0, description="Size only for the trace's last hours; 0: the whole trace.")
    min_improvement_pct: Optional[float] = Field(None, description="Champion rule threshold, percent "
                                                                   "(ChampionPolicy); None: its default.")
    replace_model: bool = Field(False, description="Register the winner even when the champion serves another "
                                                   "model (ChampionPolicy.replace_model); false: refused.")
    parallelism: str = Field("auto", description="Worker layouts searched: tp (tensor parallelism on one node), all "
                                               "(also expert / data-parallel attention and multi-node workers) or "
                                               "auto (all when plain TP has no feasible candidate); "
                                               "runtime.tuner.layouts.")
    max_model_len_tokens: Optional[int] = Field(None, description="vLLM --max-model-len of the winner, tokens; None: "
                                                                  "derived by the tuner (TuneResult."
                                                                  "to_deployment_spec checks it).")
    engine_args: list[str] = Field(default_factory=list, description="vLLM engine arguments as KEY=VALUE items "
                                                                     "the spec records (engine.extra_args), checked "
                                                                     "against the pinned vLLM's parser.")
    usd_per_gpu_hour: list[str] = Field(default_factory=list, description="GPU=USD items: USD per GPU-hour "
                                                                          "replacing the on-demand price in $/Mtok, "
                                                                          "for the candidates and the champion.")


class TuneParameters(NamedTuple):
    """:class:`TuneSettings` parsed by :func:`check_tune_settings`."""

    gpu: GpuSpec
    precision: str  # `auto` or one of runtime.modelfiles.load.PRECISIONS
    slo: SloSpec
    workload: WorkloadSpec  # with a trace: its lengths (and, with rate_from_trace, its rate) replace these
    gpu_budget: int
    traffic_trace_uri: str = ""  # "" or a URI check_traffic_trace_uri accepts
    rate_from_trace: bool = False  # request_rate_per_s was AUTO_REQUEST_RATE and a trace is given
    planner_mode: str = "off"  # PlannerSpec.mode of the champion: off, sla or load
    trace_window_s: float | None = None  # only the trace's last seconds (trace_window_h * 3600); None: all of it
    champion_policy: ChampionPolicy = ChampionPolicy()
    parallelism: str = "auto"  # runtime.tuner.layouts.PARALLELISMS
    prices: dict[str, float] | None = None  # {GPU catalog name: USD per GPU-hour}; None: on-demand prices
    max_model_len_tokens: int | None = None  # the winner's vLLM --max-model-len; None: derived
    engine_args: tuple[str, ...] = ()  # vLLM KEY=VALUE items, already checked against the pinned vLLM


def check_tune_settings(s: TuneSettings) -> TuneParameters:
    """Validate ``s`` without reading the model or the trace; return it parsed.

    ``request_rate_per_s`` ``AUTO_REQUEST_RATE`` (0) means "not chosen": with a ``traffic_trace_uri`` the
    trace's mean arrival rate (``rate_from_trace``), else WorkloadSpec's default (10/s).

    Raises:
        ValueError: every bad parameter named in one message (unknown GPU or one no NodePool provisions
            (`runtime.deploy.instances.deployable_problem`), precision, SLO, workload, gpu_budget, a registered
            model name MLflow refuses, a malformed traffic_trace_uri, a planner_mode other than off/sla/load, a
            trace_window_h that is negative, not finite or given without a trace, a min_improvement_pct that is
            negative or not finite, a parallelism other than tp/auto/all, a max_model_len_tokens that is not a
            positive integer, an engine_args item the pinned vLLM refuses (its parser is built only when items
            are given), a usd_per_gpu_hour item that is malformed or names an unknown GPU).
    """
    from runtime.deploy.instances import deployable_problem
    from runtime.tracking.mlflow_runs import check_registered_model_name
    from runtime.tracking.traces import check_traffic_trace_uri
    from runtime.perf.instances import parse_price_overrides
    from runtime.tuner.layouts import check_parallelism
    from runtime.tuner.search import resolve_gpu

    problems: list[str] = []
    parsed: dict[str, Any] = {}
    try:
        parsed["traffic_trace_uri"] = check_traffic_trace_uri(s.traffic_trace_uri, s.fsx_root)
    except ValueError as e:
        problems.append(str(e))
    rate = s.request_rate_per_s
    auto_rate = rate == AUTO_REQUEST_RATE
    parsed["rate_from_trace"] = auto_rate and bool(s.traffic_trace_uri)
    if auto_rate:  # a placeholder when the trace gives the rate; the tune use case replaces it
        rate = WorkloadSpec.model_fields["request_rate_per_s"].default
    try:
        parsed["gpu"] = resolve_gpu(s.gpu)
    except KeyError as e:
        problems.append(f"gpu: {e.args[0] if e.args else e}")
    else:  # the pipeline promotes what it tunes: refuse a GPU no NodePool provisions before anything is copied
        undeployable = deployable_problem(s.gpu, parsed["gpu"].name)
        if undeployable:
            problems.append(f"gpu: {undeployable}")
    try:
        parsed["precision"] = check_precision(s.precision)
    except ValueError as e:
        problems.append(str(e))
    try:
        parsed["slo"] = SloSpec(ttft_p90_ms=s.ttft_p90_ms, itl_p90_ms=s.itl_p90_ms)
    except ValidationError as e:
        problems.append(pydantic_problems(e))
    try:
        parsed["workload"] = WorkloadSpec(isl_tokens=s.isl_tokens, osl_tokens=s.osl_tokens, request_rate_per_s=rate)
    except ValidationError as e:
        problems.append(pydantic_problems(e))
    try:
        parsed["gpu_budget"] = (PlannerSpec() if s.gpu_budget is None else PlannerSpec(gpu_budget=s.gpu_budget)
                                ).gpu_budget
    except ValidationError as e:
        problems.append(pydantic_problems(e))
    window_h = s.trace_window_h
    if not (math.isfinite(window_h) and window_h >= 0):
        problems.append(f"trace_window_h: must be a number of hours > 0 (0: the whole trace), got {window_h!r}")
    elif window_h > 0 and not s.traffic_trace_uri:
        problems.append("trace_window_h: only with a traffic_trace_uri (it windows that trace)")
    elif window_h > 0:
        parsed["trace_window_s"] = float(window_h) * 3600.0
    modes = PlannerSpec.model_fields["mode"].annotation.__args__
    if s.planner_mode in modes:
        parsed["planner_mode"] = s.planner_mode
    else:
        problems.append(f"planner_mode: must be one of {', '.join(modes)}, got {s.planner_mode!r}")
    try:
        check_registered_model_name(s.registered_model)
    except ValueError as e:
        problems.append(str(e))
    try:
        parsed["champion_policy"] = ChampionPolicy(replace_model=s.replace_model, **(
            {} if s.min_improvement_pct is None else {"min_improvement_pct": s.min_improvement_pct}))
    except ValidationError as e:
        problems.append(pydantic_problems(e))
    try:
        parsed["parallelism"] = check_parallelism(s.parallelism)
    except ValueError as e:
        problems.append(str(e))
    mml = s.max_model_len_tokens
    if mml is not None and (isinstance(mml, bool) or not isinstance(mml, int) or mml <= 0):
        problems.append(f"max_model_len_tokens: must be a positive number of tokens, got {mml!r}")
    else:
        parsed["max_model_len_tokens"] = mml
    if s.engine_args:  # building vLLM's parser takes seconds: only when items are given
        from runtime.engines.engine_args import engine_arg_flags

        try:
            engine_arg_flags(s.engine_args)
            parsed["engine_args"] = tuple(s.engine_args)
        except ValueError as e:
            problems.append(str(e))
    try:
        parsed["prices"] = parse_price_overrides(s.usd_per_gpu_hour) or None
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ValueError("; ".join(problems))
    return TuneParameters(**parsed)


class TuneRequest(TuneSettings):
    """One tuning of a staged model, as the pipeline's tune step runs it."""

    model_path: str = Field(description="The staged model folder (with config.json and a valid staging marker).")
    model_name: str = Field(description="Served model name (the ModelRef name the spec records).")
    mlflow_tracking_uri: str = Field(description="MLflow tracking URI every candidate is logged to.")
    s3_endpoint_url: str = Field("", description="S3 endpoint for an s3:// traffic_trace_uri; empty: AWS S3.")


class MetricsSink(Protocol):
    """What :func:`tune` needs of KFP's Output[Metrics]: a `log_metric(name, value)` method."""

    def log_metric(self, metric: str, value: float) -> None: ...


@dataclass(frozen=True)
class TuneDecision:
    """What became of alias ``champion`` after a registration (`pdserve tune --decision-out`, the tune step)."""

    registered_model: str
    registered_version: str
    previous_champion_version: str | None  # None: there was no champion
    champion_version: str | None  # the alias after this run (re-read from the registry)
    replaced: bool  # the alias names registered_version
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"registered_model": self.registered_model, "registered_version": self.registered_version,
                "previous_champion_version": self.previous_champion_version,
                "champion_version": self.champion_version, "replaced": self.replaced, "reason": self.reason}


@dataclass(frozen=True)
class Registration:
    """What :func:`register_tuning` did: the registered ``version`` (None: logged only), the ``decision``
    (None without a registered model), the champion ``check`` and ``notes`` for people."""

    version: str | None
    decision: TuneDecision | None
    check: ChampionCheck | None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TuneOutcome:
    """What :func:`tune` produced: the search ``result``, the registered ``spec``, the ``workload`` it was sized
    for, the ``precision`` tuned at, the alias ``decision`` and ``notes`` for people."""

    result: TuneResult
    spec: DeploymentSpec
    workload: WorkloadSpec
    precision: str
    decision: TuneDecision
    notes: list[str] = field(default_factory=list)

    @property
    def champion_version(self) -> str:
        """The version alias ``champion`` names after the run: the winner's, or the kept one's."""
        d = self.decision
        return d.champion_version if d.champion_version is not None else d.registered_version


def resolve_precision(model: ModelSpec, precision: str | None) -> tuple[str, list[str]]:
    """The precision to tune at: ``precision`` (bf16 or fp8), or with None / ``auto`` the checkpoint's own
    (:func:`runtime.modelfiles.load.checkpoint_precision`); notes say when the checkpoint is quantized to a
    format a DeploymentSpec does not name (e.g. MXFP4): vLLM loads it as stored and the search costs its weights
    in that format (``runtime.tuner.search.perf_precisions``), the precision setting the KV cache; a format the
    performance model does not know is sized at the precision, wider than it is (conservative)."""
    if precision is not None and precision != AUTO_PRECISION:
        return precision, []
    chosen = checkpoint_precision(model)
    q = model.quant_method
    if q and chosen == "bf16" and model.weight_format not in ("bf16", "unknown"):  # e.g. mxfp4 (gpt-oss)
        weights, _ = perf_precisions(model, chosen)
        return chosen, [f"the checkpoint is quantized as {q!r} (config.json quantization_config), a format a "
                        f"deployment does not name: it deploys at {chosen}, which sets the KV cache ({chosen}); "
                        f"vLLM loads the weights as they are stored and the search costs them in their format "
                        f"({weights}); choose fp8 for an fp8 KV cache"]
    if q and chosen == "bf16":
        return chosen, [f"the checkpoint is quantized as {q!r} (config.json quantization_config), "
                        f"which pdserve does not tune for; tuning at {chosen} sizes its weights wider than they are "
                        "(conservative: possibly more TP and less KV capacity than needed); choose the precision "
                        "(bf16 or fp8) to override"]
    if model.quant_method:
        return chosen, [f"the checkpoint is quantized as {model.quant_method!r} (config.json quantization_config); "
                        f"tuning at {chosen}"]
    return chosen, []


def deployment_for(result: TuneResult, model_ref: ModelRef, *, gpu_budget: int, planner_mode: str,
                   peak_rate_per_s: float | None = None, max_model_len_tokens: int | None = None,
                   engine_args: tuple[str, ...] | list[str] = ()) -> DeploymentSpec:
    """The winner's DeploymentSpec as every face registers it: ``result.to_deployment_spec`` with the
    planner's ceiling raised to what ``peak_rate_per_s`` (requests/s, a trace's busiest 60 s; ignored when not
    above the workload's rate) needs, ``planner.gpu_budget`` = ``gpu_budget`` and ``planner.mode`` =
    ``planner_mode``; ``max_model_len_tokens`` (vLLM ``--max-model-len``, checked by ``to_deployment_spec``)
    and ``engine_args`` (vLLM ``KEY=VALUE`` items, ``runtime.engines.engine_args.with_engine_overrides``) are
    the operator's engine settings, recorded in the spec.

    Raises:
        runtime.deploy.budget.GpuBudgetError: the winner needs more GPUs than ``gpu_budget``.
        ValueError: a ``max_model_len_tokens`` the model or the KV capacity refuses, an ``engine_args`` item the
            pinned vLLM refuses.
    """
    peak = peak_rate_per_s if peak_rate_per_s is not None and peak_rate_per_s > result.workload.request_rate_per_s \
        else None
    spec = result.to_deployment_spec(model_ref, peak_rate_per_s=peak, max_model_len_tokens=max_model_len_tokens)
    if engine_args:
        from runtime.engines.engine_args import with_engine_overrides

        spec = with_engine_overrides(spec, engine_args=engine_args)
    spec.planner.gpu_budget = gpu_budget
    spec.planner.mode = planner_mode
    check_gpu_budget(spec)
    return spec


def register_tuning(result: TuneResult, spec: DeploymentSpec, *, tracking_uri: str, registered_model: str | None,
                    policy: ChampionPolicy = ChampionPolicy(), sample: LengthSample | None = None,
                    champion: "tuple[str, DeploymentSpec] | None" = None, traffic_trace_uri: str | None = None,
                    gpu_option: str | None = None, inherited_from: str | None = None,
                    prices: "dict[str, float] | None" = None) -> Registration:
    """Log ``result`` to MLflow (experiment ``pdserve-tune-<model>``) and, with ``registered_model``, register
    ``spec``: it takes alias ``champion`` by ``policy`` (runtime/usecases/champion.py; ``champion`` is the
    (version, spec) the caller already read, else the registry is asked; ``prices`` ({GPU: USD per GPU-hour})
    price the champion's deployment as the tuning priced the candidates). The decision re-reads the alias after
    registering, so a move by another tuning meanwhile is reported, not hidden.

    Raises:
        runtime.tracking.mlflow_runs.TrackingError: the champion cannot be read (nothing is registered: a
            champion is never replaced blindly), or MLflow refused the logging; every message has each
            ``user:password@`` replaced by ``***@`` and carries no exception chain.
        ValueError: the champion's spec names a GPU the catalog does not know.
    """
    from runtime.redact import redact_userinfo
    from runtime.tracking.mlflow_runs import TrackingError, champion_version, find_champion, log_tuning

    check = None
    if registered_model:
        failure = None
        try:
            check = check_against_champion(result, spec, registered_model, policy,
                                           lambda name: find_champion(tracking_uri, name), sample, champion,
                                           prices=prices)
        except TrackingError as e:
            failure = (f"the current champion of {registered_model} cannot be read, so the winner is not "
                       f"registered: {redact_userinfo(str(e))}")
        if failure is not None:
            raise TrackingError(failure)
    notes = list(check.notes) if check is not None else []
    comparison = None if check is None else check.comparison
    compared = None if check is None else check.compared_version
    failure = None
    try:
        version = log_tuning(result, tracking_uri=tracking_uri, experiment=f"pdserve-tune-{result.model.name}",
                             registered_model=registered_model or None, spec=spec,
                             traffic_trace_uri=traffic_trace_uri or None, comparison=comparison,
                             compared_version=compared, inherited_from=inherited_from, gpu_option=gpu_option)
    except Exception as e:  # noqa: BLE001 - MLflow repeats the request URL: never let a URI's password through
        detail = redact_userinfo(str(e))
        if isinstance(e, ValueError) and detail == str(e):
            raise  # our own checks (name, renderability): as raised
        failure = f"MLflow at {redact_userinfo(tracking_uri)}: logging the tuning failed: {detail or type(e).__name__}"
    if failure is not None:  # raised outside the handler: no __context__ carrying the unredacted original
        raise TrackingError(failure)
    if not (registered_model and version is not None):
        return Registration(version, None, check, notes)
    takes = check is None or check.replaces  # the rule's answer; log_tuning moved the alias when it takes
    try:
        now = champion_version(tracking_uri, registered_model)
    except TrackingError as e:
        now = version if takes else compared
        notes.append(f"could not re-read the champion alias: {e}")
    kept = None if takes else comparison.reason
    if takes and now != version:
        kept = f"the alias moved to version {now} while this tuning ran"
    if kept is None:
        reason = comparison.reason if comparison is not None else f"first version of {registered_model}"
    else:
        reason = kept
    decision = TuneDecision(registered_model, str(version), None if compared is None else str(compared),
                            None if now is None else str(now), kept is None, reason)
    return Registration(str(version), decision, check, notes)


TRACE_FEW_REQUESTS = 100  # a trace of fewer requests than this is noted as too few to size for


def duration_text(seconds: float) -> str:
    """``95`` → ``1.6 min``: a trace's span for people (s, min, h or days)."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def trace_facts(traced: Any, source: str, workload: WorkloadSpec, window_h: float | None, *, files: str = "",
                instead: str) -> list[str]:
    """What a trace gave, for people, as every face says it: ``workload: <source>: N requests over <span> [in
    the last H h (...)] (n sampled), mean ISL, mean OSL, at R requests/s``, then a note when it holds fewer than
    ``TRACE_FEW_REQUESTS`` requests (``instead``: how this face sizes without a trace). ``traced`` is a
    runtime.traces.formats.TraceWorkload, ``files`` e.g. `` (3 files)`` for a folder."""
    span = "" if traced.span_s is None else f" over {duration_text(traced.span_s)}"
    window = "" if window_h is None else (
        f" in the last {window_h:g} h ({traced.requests_outside_window} older request(s) read and left "
        f"out" + (f", {traced.objects_not_read} older object(s) not downloaded" if traced.objects_not_read
                  else "") + ")")
    lines = [f"workload: {source}{files}: {traced.requests} requests{span}{window} "
             f"({len(traced.sample.isl_tokens)} sampled), mean ISL {workload.isl_tokens}, mean OSL "
             f"{workload.osl_tokens} tokens, at {workload.request_rate_per_s:.4g} requests/s"]
    if traced.requests < TRACE_FEW_REQUESTS:
        lines.append(f"note: only {traced.requests} request(s) in {source}: lengths and rate from so few are "
                     f"noise; record more traffic or {instead}")
    return lines


@dataclass(frozen=True)
class TraceWorkloadFound:
    """A trace reduced for tuning: the ``workload`` to size for, its length ``sample``, its busiest-60 s
    ``peak_rate_per_s`` (None: unknown) and ``notes``."""

    workload: WorkloadSpec
    sample: LengthSample
    peak_rate_per_s: float | None
    notes: list[str]


def trace_workload(params: TuneParameters, *, s3_client: Any = None, s3_endpoint_url: str = "") -> TraceWorkloadFound:
    """The workload of ``params.traffic_trace_uri`` as `pdserve tune --trace` builds it: the trace's rounded mean
    ISL/OSL and, when ``params.rate_from_trace``, its mean arrival rate (else the given rate).

    Raises:
        runtime.tracking.traces.TrafficTraceError: unreadable or not a trace, or no usable arrival times when
            the rate is to come from the trace (message names the URI).
    """
    from runtime.tracking.traces import TrafficTraceError, fetch_trace_workload, skipped_note

    uri = params.traffic_trace_uri
    traced = fetch_trace_workload(uri, read_rate=params.rate_from_trace, s3_client=s3_client,
                                  s3_endpoint_url=s3_endpoint_url, window_s=params.trace_window_s)
    notes = []
    if traced.skipped:  # not silently: a shipment under an odd name would otherwise just be missing
        notes.append(f"traffic_trace_uri: {skipped_note(traced.skipped, uri)}")
    rate = traced.request_rate_per_s if params.rate_from_trace else params.workload.request_rate_per_s
    if rate is None:
        raise TrafficTraceError(f"traffic_trace_uri: {uri} has no usable arrival times (timestamp / TIMESTAMP on "
                                "every line, at least two distinct): set request_rate_per_s > 0")
    workload = WorkloadSpec(isl_tokens=traced.isl_tokens, osl_tokens=traced.osl_tokens, request_rate_per_s=rate)
    window_h = None if params.trace_window_s is None else params.trace_window_s / 3600
    notes += trace_facts(traced, uri, workload, window_h,
                         instead="set isl_tokens/osl_tokens/request_rate_per_s without traffic_trace_uri")
    return TraceWorkloadFound(workload, traced.sample, traced.peak_rate_per_s, notes)


def tune(request: TuneRequest, *, metrics: MetricsSink | None = None, table_path: str | None = None,
         plot_path: str | None = None, s3_client: Any = None) -> TuneOutcome:
    """Tune prefill TP × decode TP for the staged model of ``request``; log every candidate to MLflow; register
    the winner, which takes alias ``champion`` by the rule of `pdserve tune --register` (:func:`register_tuning`).

    Workload: without ``traffic_trace_uri``, ``isl_tokens``/``osl_tokens`` at ``request_rate_per_s``; with one
    (an s3:// object or prefix read with ``s3_client`` or a client for ``s3_endpoint_url`` and environment
    credentials, or a path under ``fsx_root``), the trace's length sample sizes the pools and the spec records its
    mean lengths (:func:`trace_workload`). ``metrics`` gets the winner's figures, ``table_path`` the candidate
    table (Markdown), ``plot_path`` the Pareto plot (HTML). Nothing is logged or registered when the winner does
    not fit the GPU budget or the champion cannot be read.

    Raises:
        ValueError: a bad parameter (:func:`check_tune_settings`, checked first), or a spec promote cannot render.
        runtime.tracking.traces.TrafficTraceError: the trace cannot be read or sized for (before the model is
            read).
        runtime.staging.manifest.StagingError: ``model_path`` is not a verified staged model.
        runtime.models.spec.ModelConfigError: config.json lacks a field the model needs (named).
        runtime.tuner.search.InfeasibleSLOError: no candidate meets the SLO (message has the best TTFT/ITL).
        runtime.deploy.budget.GpuBudgetError: the winner needs more GPUs than the budget.
        runtime.tracking.mlflow_runs.TrackingError: MLflow failed (message redacted).
    """
    from runtime.modelfiles.load import load_model_spec
    from runtime.staging.manifest import verify_staged
    from runtime.tuner.search import tp_choices
    from runtime.tuner.search import tune as search

    params = check_tune_settings(request)  # before reading, tuning or logging anything
    notes: list[str] = []
    workload, sample, peak = params.workload, None, None
    if params.traffic_trace_uri:
        found = trace_workload(params, s3_client=s3_client, s3_endpoint_url=request.s3_endpoint_url)
        workload, sample, peak, notes = found.workload, found.sample, found.peak_rate_per_s, found.notes
    verify_staged(Path(request.model_path))
    model = load_model_spec(Path(request.model_path) / "config.json")
    precision, precision_notes = resolve_precision(model, params.precision)
    notes += precision_notes
    result = search(model, params.gpu, params.slo, workload, precision=precision,
                    tps=tp_choices(request.gpu), sample=sample,  # an instance type bounds TP by its GPU count
                    parallelism=params.parallelism, prices=params.prices)
    notes += result.notes
    model_ref = ModelRef(name=request.model_name, path=os.path.abspath(request.model_path))  # promote runs elsewhere
    try:
        spec = deployment_for(result, model_ref, gpu_budget=params.gpu_budget, planner_mode=params.planner_mode,
                              peak_rate_per_s=peak, max_model_len_tokens=params.max_model_len_tokens,
                              engine_args=params.engine_args)
    except GpuBudgetError as e:
        source = " (the trace's mean arrival rate)" if params.rate_from_trace else ""
        raise GpuBudgetError(f"{e}; lower request_rate_per_s ({workload.request_rate_per_s:g}/s{source}) "
                             "or raise the budget (gpu_budget)") from None
    reg = register_tuning(result, spec, tracking_uri=request.mlflow_tracking_uri,
                          registered_model=request.registered_model, policy=params.champion_policy, sample=sample,
                          traffic_trace_uri=params.traffic_trace_uri or None,
                          gpu_option=request.gpu,  # an instance type: recorded so `tune --like` keeps its TP bound
                          prices=params.prices)
    notes += reg.notes
    assert reg.decision is not None  # a registered model name is required
    if table_path:
        Path(table_path).write_text(result.markdown_table())
    if plot_path:
        from runtime.tracking.plots import pareto_html, pareto_png

        with tempfile.TemporaryDirectory(prefix="pdserve-tune-") as tmp:
            png = pareto_png(result, Path(tmp) / "pareto.png")
            Path(plot_path).write_text(pareto_html(result, png))
    best = result.best
    if metrics is not None:
        metrics.log_metric("prefill_tp", best.prefill.tp)
        metrics.log_metric("decode_tp", best.decode.tp)
        metrics.log_metric("prefill_worker_gpus", best.prefill.gpus)
        metrics.log_metric("decode_worker_gpus", best.decode.gpus)
        metrics.log_metric("ttft_p90_ms", best.ttft_ms)
        metrics.log_metric("itl_p90_ms", best.itl_ms)
        metrics.log_metric("goodput_per_gpu", best.goodput_per_gpu)
        metrics.log_metric("num_candidates", len(result.candidates))
    return TuneOutcome(result, spec, workload, precision, reg.decision, notes)


class TuneOutputs(NamedTuple):
    """The pipeline tune step's outputs (KFP reads a NamedTuple's fields as output parameters)."""

    champion_version: str  # the version alias `champion` names after the step: the winner's, or the kept one's
    prefill_tp: int  # vLLM --tensor-parallel-size of a prefill worker (its GPUs: tp x dp x pp)
    decode_tp: int


def kfp_tune_outputs(outcome: TuneOutcome) -> TuneOutputs:
    """``outcome`` as the tune step's outputs; its notes go to the step's log (stderr), the KFP face's output."""
    import logging

    log = logging.getLogger("pdserve.tune")
    for note in outcome.notes:
        log.warning("%s", note)
    d = outcome.decision
    log.info("registered %s version %s; alias champion names version %s (%s)", d.registered_model,
             d.registered_version, d.champion_version, d.reason)
    best = outcome.result.best
    return TuneOutputs(outcome.champion_version, int(best.prefill.tp), int(best.decode.tp))
