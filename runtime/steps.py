"""The pipeline's steps as plain functions (adapters): each KFP component makes exactly one call here.

Keeping the step bodies in the library means the same code runs in kfp.local, on Kubeflow, from the
`pdserve` CLI and in tests; the components only map KFP artifacts to arguments.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from runtime.config import check_model_name

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from runtime.config import DeploymentSpec, SloSpec, WorkloadSpec
    from runtime.models.spec import ModelSpec
    from runtime.perf.gpus import GpuSpec


class MetricsSink(Protocol):
    """What `tune_step` needs of KFP's Output[Metrics]: a `log_metric(name, value)` method."""

    def log_metric(self, metric: str, value: float) -> None: ...


class TuneOutputs(NamedTuple):
    champion_version: str  # the version alias `champion` names after the step: the winner's, or the kept one's
    prefill_tp: int
    decode_tp: int


class GpuBudgetError(ValueError):
    """The tuned deployment needs more GPUs than its planner.gpu_budget; the message has both numbers."""


def deployment_gpus(spec: "DeploymentSpec") -> int:
    """GPUs a DeploymentSpec runs on: replicas × GPUs per worker (tp × dp × pp) of the prefill pool plus the same
    of the decode pool."""
    return spec.prefill.replicas * spec.prefill.gpus + spec.decode.replicas * spec.decode.gpus


def check_gpu_budget(spec: "DeploymentSpec") -> int:
    """Return `deployment_gpus(spec)` when it fits `spec.planner.gpu_budget`.

    Raises:
        GpuBudgetError: it does not (message: the P:D replicas and TPs, GPUs needed, the budget).
    """
    need = deployment_gpus(spec)
    budget = spec.planner.gpu_budget
    if need > budget:
        raise GpuBudgetError(
            f"the tuned deployment needs {need} GPUs (P:D replicas {spec.prefill.replicas}:{spec.decode.replicas} "
            f"at {spec.prefill.gpus} prefill, {spec.decode.gpus} decode GPUs per worker) but planner.gpu_budget is "
            f"{budget} "
            f"GPU{'' if budget == 1 else 's'}"
        )
    return need


PRECISIONS = ("bf16", "fp8")  # what a DeploymentSpec deploys (runtime/config.py Precision)
AUTO_PRECISION = "auto"


def checkpoint_precision(model: "ModelSpec") -> str:
    """The deployment precision a checkpoint is tuned at when none is chosen: `fp8` when its weights are FP8
    (config.json `quantization_config.quant_method` `fp8` / `fbgemm_fp8`, a TensorRT Model Optimizer
    `quant_algo` `FP8`, also from `hf_quant_config.json`: runtime.modelfiles.load) or it carries FP8 KV-cache
    scales (ModelOpt `kv_cache_quant_algo` `FP8`), else `bf16` (`runtime.models.quant.detect_precision`).

    The deployment precision is the KV-cache dtype (and online FP8 quantisation of a 16-bit checkpoint,
    runtime.deploy.workers.precision_args); a quantised checkpoint's weights keep their own format either way,
    and the tuner sizes them so (`runtime.tuner.search.tune`). One rule for `pdserve tune` (no --precision)
    and the pipeline's tune step (precision `auto`).
    """
    fp8 = model.weight_format in ("fp8", "fp8-block") or model.kv_cache_format == "fp8"
    return "fp8" if fp8 else "bf16"


def check_precision(precision: str) -> str:
    """Return `precision` lower-cased when it is `auto` or one of PRECISIONS.

    Raises:
        ValueError: anything else (message lists the accepted values).
    """
    value = precision.lower() if isinstance(precision, str) else precision
    if value != AUTO_PRECISION and value not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: must be {AUTO_PRECISION} (the checkpoint's own: fp8 for an FP8 "
                         f"checkpoint, else bf16) or one of {', '.join(PRECISIONS)}")
    return value


AUTO_REQUEST_RATE = 0.0  # request_rate_per_s "not chosen": the trace's mean arrival rate, else WorkloadSpec's default


class TuneParameters(NamedTuple):
    gpu: "GpuSpec"
    precision: str  # `auto` or one of PRECISIONS
    slo: "SloSpec"
    workload: "WorkloadSpec"  # with a trace: its lengths (and, with rate_from_trace, its rate) replace these
    gpu_budget: int
    traffic_trace_uri: str = ""  # "" or a URI check_traffic_trace_uri accepts
    rate_from_trace: bool = False  # request_rate_per_s was AUTO_REQUEST_RATE and a trace is given
    planner_mode: str = "off"  # PlannerSpec.mode of the champion: off, sla or load
    trace_window_s: float | None = None  # only the trace's last seconds (trace_window_h * 3600); None: all of it
    champion_policy: Any = None  # runtime.usecases.champion.ChampionPolicy


def check_tune_parameters(
    gpu: str, precision: str, ttft_p90_ms: float, itl_p90_ms: float, isl_tokens: int, osl_tokens: int,
    request_rate_per_s: float, gpu_budget: int | None, registered_model: str, *, traffic_trace_uri: str = "",
    fsx_root: str | None = None, planner_mode: str = "off", trace_window_h: float = 0.0,
    min_improvement_pct: float | None = None,
) -> TuneParameters:
    """Validate the tune step's parameters without reading the model or the trace; return them parsed.

    `gpu` is a catalog name or an AWS instance type (`runtime.tuner.search.resolve_gpu`, as `pdserve tune`);
    `gpu_budget` None means PlannerSpec's default (the same as `pdserve tune --gpu-budget`).
    `request_rate_per_s` (requests/s) `AUTO_REQUEST_RATE` (0) means "not chosen", like `pdserve tune` without
    --rate: with a `traffic_trace_uri` the trace's mean arrival rate (`rate_from_trace`, read by the tune step),
    else WorkloadSpec's default (10/s); a negative rate is refused. `traffic_trace_uri` ("" for none) is checked
    by `runtime.tracking.traces.check_traffic_trace_uri` (under `fsx_root` when given). `planner_mode` is the
    champion's PlannerSpec.mode (`off`, `sla`, `load`): whether the promoted runtime runs the SLO planner.
    `trace_window_h` (hours; 0: the whole trace) sizes for the requests of the trace's last hours only
    (`runtime.tracking.traces.fetch_trace_workload` window_s, `pdserve tune --trace-window-h`).
    `min_improvement_pct` (percent; None: the default) is the champion rule's threshold
    (`runtime.usecases.champion.ChampionPolicy`, `pdserve tune --min-improvement-pct`).

    Raises:
        ValueError: every bad parameter named in one message (unknown GPU or one no NodePool provisions
            (`runtime.deploy.instances.deployable_problem`), precision, SLO, workload,
            gpu_budget, a registered model name MLflow refuses, a malformed traffic_trace_uri, a planner_mode
            other than off/sla/load, a trace_window_h that is negative, not finite, or given without a trace,
            a min_improvement_pct that is negative or not finite).
    """
    from pydantic import ValidationError

    from runtime.config import PlannerSpec, SloSpec, WorkloadSpec
    from runtime.tracking.mlflow_runs import check_registered_model_name
    from runtime.tuner.search import resolve_gpu

    def pydantic_errors(e: ValidationError) -> str:
        return "; ".join(f"{err['loc'][-1] if err['loc'] else 'value'}: {err['msg']}, got {err.get('input')!r}"
                         for err in e.errors(include_url=False))

    from runtime.tracking.traces import check_traffic_trace_uri

    problems: list[str] = []
    parsed: dict[str, Any] = {}
    try:
        parsed["traffic_trace_uri"] = check_traffic_trace_uri(traffic_trace_uri, fsx_root)
    except ValueError as e:
        problems.append(str(e))
    auto_rate = request_rate_per_s == AUTO_REQUEST_RATE
    parsed["rate_from_trace"] = auto_rate and bool(traffic_trace_uri)
    if auto_rate:  # a placeholder when the trace gives the rate; the tune step replaces it
        request_rate_per_s = WorkloadSpec.model_fields["request_rate_per_s"].default
    try:
        parsed["gpu"] = resolve_gpu(gpu)
    except KeyError as e:
        problems.append(f"gpu: {e.args[0] if e.args else e}")
    else:  # the pipeline promotes what it tunes: refuse a GPU no NodePool provisions before anything is copied
        from runtime.deploy.instances import deployable_problem

        undeployable = deployable_problem(gpu, parsed["gpu"].name)
        if undeployable:
            problems.append(f"gpu: {undeployable}")
    try:
        parsed["precision"] = check_precision(precision)
    except ValueError as e:
        problems.append(str(e))
    try:
        parsed["slo"] = SloSpec(ttft_p90_ms=ttft_p90_ms, itl_p90_ms=itl_p90_ms)
    except ValidationError as e:
        problems.append(pydantic_errors(e))
    try:
        parsed["workload"] = WorkloadSpec(isl_tokens=isl_tokens, osl_tokens=osl_tokens,
                                          request_rate_per_s=request_rate_per_s)
    except ValidationError as e:
        problems.append(pydantic_errors(e))
    try:
        parsed["gpu_budget"] = (PlannerSpec() if gpu_budget is None else PlannerSpec(gpu_budget=gpu_budget)).gpu_budget
    except ValidationError as e:
        problems.append(pydantic_errors(e))
    if not (isinstance(trace_window_h, (int, float)) and math.isfinite(trace_window_h) and trace_window_h >= 0):
        problems.append(f"trace_window_h: must be a number of hours > 0 (0: the whole trace), got {trace_window_h!r}")
    elif trace_window_h > 0 and not traffic_trace_uri:
        problems.append("trace_window_h: only with a traffic_trace_uri (it windows that trace)")
    elif trace_window_h > 0:
        parsed["trace_window_s"] = float(trace_window_h) * 3600.0
    modes = PlannerSpec.model_fields["mode"].annotation.__args__
    if planner_mode in modes:
        parsed["planner_mode"] = planner_mode
    else:
        problems.append(f"planner_mode: must be one of {', '.join(modes)}, got {planner_mode!r}")
    try:
        check_registered_model_name(registered_model)
    except ValueError as e:
        problems.append(str(e))
    from runtime.usecases.champion import ChampionPolicy

    try:
        parsed["champion_policy"] = (ChampionPolicy() if min_improvement_pct is None
                                     else ChampionPolicy(min_improvement_pct=min_improvement_pct))
    except ValidationError as e:
        problems.append(pydantic_errors(e))
    if problems:
        raise ValueError("; ".join(problems))
    return TuneParameters(**parsed)


def staged_model_dir(fsx_root: str | Path, model_name: str) -> Path:
    """Where a model is published on the FSx mount: `<fsx_root>/models/<model_name>`.

    Raises:
        ValueError: `model_name` is not a clean relative path (`check_model_name`).
    """
    return Path(fsx_root) / "models" / check_model_name(model_name)


def validate_step(
    model_name: str, gpu: str, precision: str, ttft_p90_ms: float, itl_p90_ms: float, isl_tokens: int,
    osl_tokens: int, request_rate_per_s: float, gpu_budget: int, registered_model: str, *,
    traffic_trace_uri: str = "", fsx_root: str | None = None, traffic_upload_uri: str = "",
    planner_mode: str = "off", trace_window_h: float = 0.0, min_improvement_pct: float | None = None,
) -> None:
    """Check every parameter that needs no model and no network, so a pipeline fails before staging copies
    the weights (tens of GB) when tune would refuse them anyway: `model_name` (`check_model_name`) and the
    tune parameters (`check_tune_parameters`), including the form of `traffic_trace_uri` (an s3:// object URI
    or an absolute path under `fsx_root`, a .jsonl/.csv name; its contents are read by the tune step), and
    promote's `traffic_upload_uri` ("" or ``s3://bucket/prefix/``, runtime.s3uri.check_upload_uri).

    Raises:
        ValueError: every bad parameter named in one message.
    """
    problems = []
    try:
        check_model_name(model_name)
    except ValueError as e:
        problems.append(str(e))
    try:
        check_tune_parameters(gpu, precision, ttft_p90_ms, itl_p90_ms, isl_tokens, osl_tokens, request_rate_per_s,
                              gpu_budget, registered_model, traffic_trace_uri=traffic_trace_uri, fsx_root=fsx_root,
                              planner_mode=planner_mode, trace_window_h=trace_window_h,
                              min_improvement_pct=min_improvement_pct)
    except ValueError as e:
        problems.append(str(e))
    if traffic_upload_uri:
        from runtime.s3uri import check_upload_uri

        try:
            check_upload_uri(traffic_upload_uri)
        except ValueError as e:
            problems.append(str(e).replace("--traffic-upload", "traffic_upload_uri", 1))
    if problems:
        raise ValueError("; ".join(problems))


def stage_step(source_uri: str, fsx_root: str, model_name: str, s3_endpoint_url: str = "") -> dict[str, Any]:
    """Stage `source_uri` into `<fsx_root>/models/<model_name>`, verified; return Model artifact metadata.

    Credentials come from the environment (AWS_ACCESS_KEY_ID/…, Pod Identity, IRSA), never from arguments.

    Returns:
        {"name", "path", "num_files", "total_bytes", "source"} for the KFP Model artifact.

    Raises:
        ValueError: `model_name` is not a clean relative path under models/ (checked before anything is
            written or an S3 client made).
        runtime.staging.manifest.StagingError: missing bucket, empty prefix, checksum mismatch, unsafe key.
    """
    from runtime.staging.s3 import make_client
    from runtime.staging.stage import stage_model

    dest = staged_model_dir(fsx_root, model_name)
    client = make_client(s3_endpoint_url or None, transfer_methods=False) if source_uri.startswith("s3://") else None
    manifest = stage_model(source_uri, dest, s3_client=client, progress=False)
    return {
        "name": model_name,
        "path": str(dest),
        "num_files": len(manifest.files),
        "total_bytes": manifest.total_bytes,
        "source": source_uri,
    }


def tune_step(
    model_path: str,
    model_name: str,
    gpu: str,
    precision: str,
    ttft_p90_ms: float,
    itl_p90_ms: float,
    isl_tokens: int,
    osl_tokens: int,
    request_rate_per_s: float,
    mlflow_tracking_uri: str,
    registered_model: str,
    *,
    gpu_budget: int | None = None,
    metrics: MetricsSink | None = None,
    table_path: str | None = None,
    plot_path: str | None = None,
    traffic_trace_uri: str = "",
    s3_endpoint_url: str = "",
    fsx_root: str | None = None,
    s3_client: Any = None,
    planner_mode: str = "off",
    trace_window_h: float = 0.0,
    min_improvement_pct: float | None = None,
) -> TuneOutputs:
    """Tune prefill TP × decode TP for the staged model; log every candidate to MLflow; register the winner,
    which takes the `champion` alias by the same rule as `pdserve tune --register`: always when there is no
    champion yet, else when its deployment costs at least `min_improvement_pct` percent (None: the default,
    `ChampionPolicy`) less than the champion's on the same workload, or the champion cannot serve it
    (runtime/usecases/champion.py); otherwise the version is registered without the alias and the champion stays.

    Workload: without `traffic_trace_uri`, `isl_tokens`/`osl_tokens` (mean lengths, tokens) at
    `request_rate_per_s` (requests/s; `AUTO_REQUEST_RATE` 0: WorkloadSpec's default, 10/s). With one (an
    `s3://bucket/key` object, read with `s3_client` or `runtime.staging.s3.make_client(s3_endpoint_url)` and
    credentials from the environment only, or an absolute path under `fsx_root`), exactly as `pdserve tune
    --trace` (`runtime.tracking.traces.load_trace_workload`): the trace's length sample sizes the pools, the
    spec records its mean ISL/OSL (`isl_tokens`/`osl_tokens` are ignored) and the rate is `request_rate_per_s`
    when > 0, else the trace's mean arrival rate. `trace_window_h` > 0 (hours) keeps only the requests of the
    trace's last hours, and an S3 prefix's older objects are not downloaded (`pdserve tune --trace-window-h`).
    The URI is logged as the MLflow parent run's param `traffic_trace_uri`; objects under a prefix that are not
    read as trace are logged as a warning (logger `runtime.steps`).

    Reads `<model_path>/config.json` (the staged copy; a folder without a valid staging marker is refused).
    `gpu` is a GPU catalog name or an AWS instance type (p5.48xlarge), as in `pdserve tune --gpu`.
    `precision` `auto` tunes at the checkpoint's own precision (`checkpoint_precision`: fp8 for an FP8
    checkpoint, else bf16), as `pdserve tune` without --precision. `gpu_budget` (GPUs; None: PlannerSpec's
    default, the same as `pdserve tune --gpu-budget`) is written as the spec's planner.gpu_budget,
    `planner_mode` (off, sla, load; `pdserve tune --planner`) as its planner.mode: whether the promoted
    runtime runs the SLO planner within [min_replicas, max_replicas] and the budget.
    Nothing is logged or registered when the winner does not fit the GPU budget, or when the current champion
    cannot be read (a champion is never replaced blindly). Returns the version the alias names afterwards.

    Raises:
        runtime.staging.manifest.StagingError: `model_path` is not a verified staged model.
        runtime.models.spec.ModelConfigError: config.json lacks a field the model needs (named).
        runtime.tuner.search.InfeasibleSLOError: no candidate meets the SLO (message has the best TTFT/ITL).
        GpuBudgetError: the winner needs more GPUs than DeploymentSpec's planner.gpu_budget.
        runtime.tuner.search.NotDeployableError: (a ValueError) the winner's layout is one a DeploymentSpec
            pool refuses; the message names it.
        ValueError: a bad parameter (`check_tune_parameters`: unknown GPU, precision, SLO, workload, gpu_budget,
            a registered model name MLflow refuses, a malformed traffic_trace_uri; checked first), or the spec
            cannot be rendered by promote (runtime.deploy.errors.ManifestError, before anything is logged).
        runtime.tracking.traces.TrafficTraceError: (a ValueError) the trace cannot be read (missing object or
            file, access denied), is not a trace, holds no request with both lengths >= 1, or has no usable
            arrival times while the rate is to come from it; the message names the URI, never credentials.
            Raised after the parameter checks, before the model is read.
        runtime.tracking.mlflow_runs.TrackingError: logging or registering in MLflow failed; the message
            names the URI and the cause with every `user:password@` replaced by `***@` (runtime/redact.py).
    """
    from runtime.config import ModelRef
    from runtime.modelfiles.load import load_model_spec
    from runtime.staging.manifest import verify_staged
    from runtime.tracking.mlflow_runs import log_tuning
    from runtime.tracking.plots import pareto_html, pareto_png
    from runtime.tuner.search import tp_choices, tune

    from runtime.redact import redact_userinfo
    from runtime.tracking.mlflow_runs import TrackingError, champion_version, find_champion
    from runtime.usecases.champion import check_against_champion

    params = check_tune_parameters(  # before reading, tuning or logging anything
        gpu, precision, ttft_p90_ms, itl_p90_ms, isl_tokens, osl_tokens, request_rate_per_s, gpu_budget,
        registered_model, traffic_trace_uri=traffic_trace_uri, fsx_root=fsx_root, planner_mode=planner_mode,
        trace_window_h=trace_window_h, min_improvement_pct=min_improvement_pct)
    workload, sample, peak = params.workload, None, None
    if params.traffic_trace_uri:
        workload, sample, peak = _trace_workload(params, s3_client=s3_client, s3_endpoint_url=s3_endpoint_url)
    verify_staged(Path(model_path))
    model = load_model_spec(Path(model_path) / "config.json")
    precision = checkpoint_precision(model) if params.precision == AUTO_PRECISION else params.precision
    result = tune(model, params.gpu, params.slo, workload, precision=precision,
                  tps=tp_choices(gpu), sample=sample)  # an instance type bounds TP by its GPU count
    model_ref = ModelRef(name=model_name, path=os.path.abspath(model_path))  # promote runs elsewhere
    # as `pdserve tune --trace`: the planner may scale up to what the trace's busiest 60 s needs
    spec = result.to_deployment_spec(
        model_ref, peak_rate_per_s=peak if peak is not None and peak > workload.request_rate_per_s else None)
    spec.planner.gpu_budget = params.gpu_budget  # as `pdserve tune --gpu-budget`, before the check
    spec.planner.mode = params.planner_mode  # as `pdserve tune --planner`
    try:
        check_gpu_budget(spec)
    except GpuBudgetError as e:
        source = " (the trace's mean arrival rate)" if params.rate_from_trace else ""
        raise GpuBudgetError(f"{e}; lower request_rate_per_s ({workload.request_rate_per_s:g}/s{source}) "
                             "or raise the budget (gpu_budget)") from None
    failure = None
    try:
        check = check_against_champion(result, spec, registered_model, params.champion_policy,
                                       lambda name: find_champion(mlflow_tracking_uri, name), sample)
        for note in check.notes:
            log.warning("%s", note)
        version = log_tuning(
            result, tracking_uri=mlflow_tracking_uri, experiment=f"pdserve-tune-{model_name}",
            registered_model=registered_model, spec=spec, traffic_trace_uri=params.traffic_trace_uri or None,
            gpu_option=gpu,  # an instance type: recorded so `pdserve tune --like` keeps its TP bound
            comparison=check.comparison, compared_version=check.compared_version,
        )
        now = champion_version(mlflow_tracking_uri, registered_model)
    except Exception as e:  # MLflow errors repeat the request URL: never let a URI's password reach the task log
        detail = redact_userinfo(str(e))
        if isinstance(e, ValueError) and detail == str(e):  # our own checks (name, renderability): as raised
            raise
        failure = (f"logging the tuning to MLflow at {redact_userinfo(mlflow_tracking_uri)} failed: "
                   f"{type(e).__name__}: {detail}")
    if failure is not None:  # raised outside the handler: no __context__ carrying the unredacted original
        raise TrackingError(failure)
    if table_path:
        Path(table_path).write_text(result.markdown_table())
    if plot_path:
        with tempfile.TemporaryDirectory(prefix="pdserve-tune-") as tmp:
            png = pareto_png(result, Path(tmp) / "pareto.png")
            Path(plot_path).write_text(pareto_html(result, png))
    best = result.best
    if metrics is not None:
        metrics.log_metric("prefill_tp", best.prefill_tp)
        metrics.log_metric("decode_tp", best.decode_tp)
        metrics.log_metric("ttft_p90_ms", best.ttft_ms)
        metrics.log_metric("itl_p90_ms", best.itl_ms)
        metrics.log_metric("goodput_per_gpu", best.goodput_per_gpu)
        metrics.log_metric("num_candidates", len(result.candidates))
    if check.comparison is not None:
        log.info("registered %s version %s; the champion is version %s: %s", registered_model, version, now,
                 check.comparison.reason)
    return TuneOutputs(str(now if now is not None else version), int(best.prefill_tp), int(best.decode_tp))


def _trace_workload(params: TuneParameters, *, s3_client: Any, s3_endpoint_url: str):
    """(WorkloadSpec, LengthSample, peak rate or None) of `params.traffic_trace_uri`, as `pdserve tune --trace`
    builds them: the trace's rounded mean ISL/OSL and, when `params.rate_from_trace`, its mean arrival rate (else
    the given rate); the peak is its busiest 60 s rate (requests/s).

    Raises:
        runtime.tracking.traces.TrafficTraceError: unreadable or not a trace, or no usable arrival times when
            the rate is to come from the trace (message names the URI).
    """
    from runtime.config import WorkloadSpec
    from runtime.tracking.traces import TrafficTraceError, fetch_trace_workload, skipped_note

    uri = params.traffic_trace_uri
    traced = fetch_trace_workload(uri, read_rate=params.rate_from_trace, s3_client=s3_client,
                                  s3_endpoint_url=s3_endpoint_url, window_s=params.trace_window_s)
    if traced.skipped:  # not silently: a shipment under an odd name would otherwise just be missing
        logging.getLogger(__name__).warning("traffic_trace_uri: %s", skipped_note(traced.skipped, uri))
    if params.trace_window_s is not None:
        logging.getLogger(__name__).info(
            "traffic_trace_uri: %s: %d request(s) in the last %g h; %d older read and left out, %d older object(s) "
            "not downloaded", uri, traced.requests, params.trace_window_s / 3600, traced.requests_outside_window,
            traced.objects_not_read)
    rate = traced.request_rate_per_s if params.rate_from_trace else params.workload.request_rate_per_s
    if rate is None:
        raise TrafficTraceError(f"traffic_trace_uri: {uri} has no usable arrival times (timestamp / TIMESTAMP on "
                                "every line, at least two distinct): set request_rate_per_s > 0")
    workload = WorkloadSpec(isl_tokens=traced.isl_tokens, osl_tokens=traced.osl_tokens, request_rate_per_s=rate)
    return workload, traced.sample, traced.peak_rate_per_s


def promote_step(
    champion_version: str,
    registered_model: str,
    mlflow_tracking_uri: str,
    namespace: str,
    image: str,
    pvc_name: str,
    apply: bool,
    kube_context: str,
    out_path: str,
    *,
    require_staged: bool = True,
    traffic_upload_uri: str = "",
    skip_if_live: bool = False,
) -> dict[str, Any]:
    """Render the champion's KServe + Kubernetes objects, validate them, write YAML; apply when asked.

    With `apply` and `skip_if_live`, nothing is applied when the InferenceService already serves the champion's
    revision (`v<version>`) with the same `image` (returned `already_live` True): a scheduled re-tune whose
    champion stayed, or a retried one whose earlier attempt moved the alias, promotes only what is not yet live
    instead of re-running a canary of the serving revision.

    `traffic_upload_uri` (``s3://bucket/prefix/``; empty: off) makes the runtime record its traffic and ship
    it under ``<prefix><InferenceService name>/`` (runtime.deploy.target.ClusterTarget.traffic_upload_uri),
    the input of the re-tuning CronWorkflow (`pdserve batch retune-schedule --traffic`).

    With `require_staged` (default; the pipeline's promote runs with the FSx PVC mounted) the champion's
    model path (`spec.model.path`, the staged copy the tune step read) must be a staged folder with a valid
    marker (`verify_staged(..., check_digests=False)`: marker, every listed file with its size), checked
    before anything is written.

    Raises:
        runtime.staging.manifest.StagingError: `require_staged` and the champion's model path is empty or not
            a verified staged folder (folder and missing file/marker named).
        ValueError: the registry's `champion` is not `champion_version` (a newer tuning raced this one), or a
            bad `traffic_upload_uri` (checked before anything else).
        runtime.deploy.validate.ManifestError: an object fails its schema (object and field named).
        RuntimeError: `apply` without a `kube_context` outside a Kubernetes pod (checked before anything else).
        runtime.deploy.errors.ApplyError: the cluster refused an object or a PVC is missing (nothing applied).
        runtime.deploy.errors.RolledBackError: `apply` and the canary was rolled back (SLO missed or a step
            failed; the previous champion serves again), so a KFP run fails like `pdserve promote --apply`.

    The InferenceService is named `dns_label(registered_model)` (runtime/deploy/target.py): the registered
    model name when it already is a DNS-1035 label of at most 45 characters, else its normalised form plus
    a short hash of the original name, so different registered models never share an InferenceService.

    With `apply`, `kube_context` names a kubeconfig context; empty means the in-cluster service-account
    config of the pod this runs in (the KFP promote step).
    """
    from runtime.deploy.mlflow_recorder import revision_for
    from runtime.deploy.render import render_all, write_yaml
    from runtime.deploy.target import dns_label
    from runtime.deploy.validate import validate_objects
    from runtime.tracking.mlflow_runs import load_champion

    from pydantic import ValidationError

    from runtime.deploy.target import ClusterTarget

    try:
        target = ClusterTarget(traffic_upload_uri=traffic_upload_uri or None)
    except ValidationError as e:
        raise ValueError("; ".join(str(x["msg"]).removeprefix("Value error, ") for x in e.errors())) from None
    if apply and not kube_context:
        from runtime.deploy.kube import CREDENTIAL_OPTIONS, in_cluster_available

        if not in_cluster_available():
            raise RuntimeError(f"promote: apply=True without kube_context and not inside a Kubernetes pod: "
                               f"{CREDENTIAL_OPTIONS}")
    version, spec = load_champion(mlflow_tracking_uri, registered_model)
    if champion_version and str(version) != str(champion_version):
        raise ValueError(
            f"registered model {registered_model!r}: alias champion is version {version}, "
            f"but this run tuned version {champion_version}; refusing to promote a different version"
        )
    if require_staged:
        from runtime.staging.manifest import StagingError, verify_staged

        if not spec.model.path:
            raise StagingError(f"registered model {registered_model!r} version {version}: the champion records no "
                               "model path, so its staged copy cannot be verified")
        try:
            verify_staged(Path(spec.model.path), check_digests=False)
        except StagingError as e:
            raise StagingError(f"registered model {registered_model!r} version {version}: refusing to promote a "
                               f"model folder that is not a verified staged copy: {e}") from e
    # Named after the registered model (what is promoted), not the served model: revisions are `v<version>`,
    # numbered per registered model, so two registered models must never share an InferenceService.
    name = dns_label(registered_model)
    revision = revision_for(version)
    objs = render_all(spec, name=name, namespace=namespace, image=image, pvc_name=pvc_name, revision=revision,
                      target=target)
    validate_objects(objs)
    write_yaml(objs, Path(out_path))
    applied = False
    if apply:
        from runtime.deploy.errors import RolledBackError
        from runtime.deploy.kube import Kube
        from runtime.deploy.promote import promote_version

        # No context: the pod's own service account, never whatever kubeconfig happens to be current.
        kube = Kube.from_context(kube_context) if kube_context else Kube.in_cluster()
        if skip_if_live:
            from runtime.deploy.rollout import current_champion

            live = current_champion(kube, name=name, namespace=namespace)
            if live is not None and live.revision == revision and live.image == image:
                return {"path": out_path, "num_objects": len(objs), "version": str(version), "applied": False,
                        "already_live": True, "kinds": json.dumps(sorted({o["kind"] for o in objs}))}
        # Canary beside the current champion, SLO probe, automatic rollback; every step tagged in MLflow.
        result = promote_version(spec, str(version), name=name, namespace=namespace, image=image,
                                 pvc_name=pvc_name, kube_context=kube_context or None, kube=kube,
                                 tracking_uri=mlflow_tracking_uri, registered_model=registered_model,
                                 target=target)
        if result.outcome != "promoted":
            raise RolledBackError(
                f"registered model {registered_model!r} version {version} was not promoted: rolled back to "
                f"revision {result.previous_revision}: {result.reason} (see the MLflow version's pdserve.deploy.* tags)")
        applied = True
    return {"path": out_path, "num_objects": len(objs), "version": str(version), "applied": applied,
            "already_live": False, "kinds": json.dumps(sorted({o["kind"] for o in objs}))}

