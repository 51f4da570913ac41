"""`pdserve batch`: batch inference against the pdserve endpoint, and the Argo workflows that run it (and
scheduled re-tuning) on the cluster. The work itself is runtime/batch's (runner, workflow specs and builders)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from runtime.batch.workflow_specs import BATCH_SERVICE_ACCOUNT, FSX_PVC, MLFLOW_URI
from runtime.faces.common import FlagCommand, ReflowGroup, make_console

app = typer.Typer(
    cls=ReflowGroup,  # help text reflows at the terminal's width
    help="Batch work beside the online endpoint: run an OpenAI Batch file against pdserve, or render the Argo "
         "workflows (batch inference, scheduled re-tuning) that do it on the cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
err = make_console(stderr=True)


@app.callback()
def _group(ctx: typer.Context) -> None:
    """Batch work beside the online endpoint (subcommands below)."""
    import signal

    from runtime.procs import install_sigterm_handler

    # SIGTERM (pod eviction, activeDeadlineSeconds) ends a run like Ctrl-C: the `finally` blocks upload an S3
    # output and remove the work folder, so a resumed run loses nothing
    previous = install_sigterm_handler()
    if previous is not None:  # restore it when the command ends (matters when the app runs in-process)
        ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, previous))


def _fail(msg: str, code: int = 2) -> None:
    """One error line and exit `code` as every `pdserve` command (runtime/faces/common.py): 2 by default here,
    where most errors are a bad option or input."""
    from runtime.faces.common import fail

    fail(msg, code)


@app.command("run", cls=FlagCommand)
def run_cmd(
    input_uri: Annotated[str, typer.Option(
        "--input", "-i", help="OpenAI Batch input file, a local path or s3://bucket/key; one JSON per line: "
                              '{"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": '
                              '{"messages": [...], "max_tokens": 64}} (url: /v1/chat/completions or '
                              "/v1/completions).")],
    output_uri: Annotated[str, typer.Option(
        "--output", "-o", help="Output JSONL (OpenAI batch output lines: custom_id, response, error): a local path "
                               "or s3://bucket/key. If it exists, its successful lines are kept and only the rest "
                               "are sent (resume); a line whose request was edited in the input since it was "
                               "answered is sent again and its old answer dropped.")],
    endpoint: Annotated[str, typer.Option(
        help="OpenAI base of the pdserve runtime, WITHOUT /v1: each line's url (/v1/...) is appended to it, so a "
             "line cannot pick another server. Local `pdserve serve`: http://127.0.0.1:8080/openai; in the "
             "cluster: http://<isvc>-predictor.<namespace>.svc.cluster.local/openai.")],
    model: Annotated[Optional[str], typer.Option(help="Served model name for lines whose body has no model.")] = None,
    concurrency: Annotated[int, typer.Option(
        min=1, help="Requests in flight: how much of the shared online endpoint the batch may take.")] = 8,
    max_retries: Annotated[int, typer.Option(
        min=0, help="Extra tries per request after a connection error, timeout or HTTP 429/5xx (exponential "
                    "back-off with jitter).")] = 3,
    timeout_s: Annotated[float, typer.Option("--timeout-s", min=0.001, help="Per-request timeout, seconds.")] = 600.0,
    api_key_env: Annotated[Optional[str], typer.Option(
        help="Name of an environment variable holding a bearer token for the endpoint (the value is never "
             "printed).")] = None,
    checkpoint_s: Annotated[float, typer.Option(
        "--checkpoint-s", min=1.0, help="Upload an s3:// output this often while running, seconds.")] = 60.0,
    progress: Annotated[bool, typer.Option(help="Progress bar on stderr.")] = True,
) -> None:
    """Send every request of a batch file to the endpoint and write one output line per request.

    Prints a JSON summary line on stdout: requests, resumed (answered by an earlier run, not sent again), changed
    (answered by an earlier run, but the input line's url or body was edited since: sent again, the old answer
    dropped), succeeded, failed, prompt_tokens, completion_tokens, not_found (404s: a wrong --endpoint base or
    model), unknown_model (of those, the model unknown), wall_s, output_tokens_per_s, and "interrupted" (SIGINT
    or SIGTERM) when a signal stopped the run.

    Exit status: 0 when every request got a 2xx answer; 1 when some did not (their output lines carry the error),
    an s3:// output could not be uploaded at the end (the answers are kept in a local file, named) or the S3
    endpoint could not be reached (nothing sent); 2 for bad options, a malformed input file or an output that is
    not writable, holds another batch's answers or lines that are no batch output (then nothing is sent and the
    output is untouched); 130 (Ctrl-C, SIGINT) or 143 (SIGTERM) when a signal stopped the sending: every finished
    answer is kept in the output (an s3:// one uploaded), the summary line counts what was done, and the same
    command sends the rest."""
    from runtime.batch.requests import BatchInputError
    from runtime.batch.run import (BatchInterrupted, BatchRunError, BatchS3UnreachableError, BatchUploadError,
                                   api_key_from_env, run_batch)

    try:
        summary = run_batch(input_uri, output_uri, endpoint=endpoint, model=model, concurrency=concurrency,
                            max_retries=max_retries, timeout_s=timeout_s, api_key=api_key_from_env(api_key_env),
                            checkpoint_s=checkpoint_s, progress=progress)
    except BatchUploadError as e:  # requests were sent: not the "nothing sent" status
        _fail(str(e), 1)
    except BatchS3UnreachableError as e:  # nothing sent; a failure while running, as in `tune` and `stage`
        _fail(str(e), 1)
    except (BatchInputError, BatchRunError) as e:
        _fail(f"{input_uri}: {e}" if isinstance(e, BatchInputError) else str(e))
    except BatchInterrupted as e:
        _interrupted(e, output_uri)
    print(json.dumps(summary.as_dict()))
    if summary.changed:
        err.print(escape(f"{summary.changed} request(s) had been edited in the input since {output_uri} answered "
                         "them: sent again, their old answers dropped"))
    if summary.failed:
        err.print(escape(f"{summary.failed} of {summary.requests} request(s) failed; their lines in {output_uri} say "
                         "why. The same command retries only those (a 4xx answer fails again until its line is "
                         "fixed)."))
        if summary.succeeded == 0 and summary.not_found == summary.failed:
            if summary.unknown_model == summary.not_found:
                err.print(escape(f"every request got 404 from the server itself: it does not serve that model; check "
                                 f"--model or the lines' body.model (GET {endpoint.rstrip('/')}/v1/models lists "
                                 "the names it serves)"))
            elif not endpoint.rstrip("/").endswith("/openai"):
                err.print(escape(f"every request got 404: is --endpoint the OpenAI base, e.g. "
                                 f"{endpoint.rstrip('/')}/openai?"))
            else:
                err.print(escape("every request got 404: is --endpoint the OpenAI base of the server (the path "
                                 "before /v1)?"))
        raise typer.Exit(1)


def _interrupted(e, output_uri: str) -> None:
    """`batch run` stopped by a signal (runtime.batch.run.BatchInterrupted): the summary line so far on stdout, what
    is left and how to resume on stderr; exit 128 + the signal's number."""
    import signal

    s = e.summary
    name = signal.Signals(e.status - 128).name if 128 < e.status < 128 + signal.NSIG else f"status {e.status}"
    print(json.dumps({**s.as_dict(), "interrupted": name}), flush=True)
    left = s.requests - s.resumed - s.succeeded - s.failed
    err.print(escape(f"interrupted by {name}: {s.succeeded + s.failed} answer(s) written to {output_uri} in this run "
                     f"({s.failed} failed), {left} request(s) not answered; the finished answers are kept: run the "
                     "same command again to send the rest"))
    raise typer.Exit(e.status)


def _emit(build, spec_cls, fields: dict, out: Optional[Path], force: bool) -> None:
    """Validate ``fields`` as ``spec_cls``, build the object, check it against the Argo schema, write YAML."""
    from pydantic import ValidationError

    from runtime.batch.workflow_validation import validate_workflow_objects
    from runtime.batch.workflows import to_yaml
    from runtime.paths import output_file_problem

    problem = None if out is None else output_file_problem(out)
    if problem:
        _fail(f"--out {out}: {problem}")
    try:
        # an option not given (None) leaves the spec's default; the two 'none'-able ones arrive resolved
        spec = spec_cls(**{k: v for k, v in fields.items() if v is not None or k in ("priority_class_name",
                                                                                      "s3_secret")})
    except ValidationError as e:
        def option(loc: tuple) -> str:
            field = str(loc[0]) if loc else ""
            return OPTION_OF.get(field, "--" + field.replace("_", "-")) if field else "options"

        def message(x: dict) -> str:
            msg = x["msg"].removeprefix("Value error, ")
            field, colon, rest = msg.partition(": ")  # a whole-spec check names its field first
            if not x["loc"] and colon and field in spec_cls.model_fields:
                return f"{option((field,))}: {rest}"
            return f"{option(x['loc'])}: {msg}"

        _fail("; ".join(message(x) for x in e.errors(include_url=False)))
    obj = build(spec)
    problems = validate_workflow_objects([obj])
    if problems:  # a builder bug, not the user's input: say so plainly
        _fail("the rendered object does not validate against the Argo Workflow schema: " + "; ".join(problems), 1)
    text = to_yaml([obj])
    if out is None:
        print(text, end="")
        return
    from runtime.faces.common import check_output_file
    from runtime.paths import write_text_atomically

    check_output_file("--out", out, "workflow", force)  # after the options: a bad one is named first
    try:
        write_text_atomically(out, text)
    except OSError as e:
        _fail(f"--out {out}: {e.strerror or e}", 1)
    ns = obj["metadata"].get("namespace", "pdserve")
    iid = (obj["metadata"].get("labels") or {}).get("workflows.argoproj.io/controller-instanceid")
    argo = f"argo {'cron create' if obj['kind'] == 'CronWorkflow' else 'submit'} -n {ns}" + (
        f" --instanceid {iid}" if iid else "")
    how = f"{argo} {out} (or kubectl {'apply' if obj['kind'] == 'CronWorkflow' else 'create'} -f {out})"
    err.print(escape(f"wrote {out} ({obj['kind']}); submit it with {how}"))


#: spec field -> the option that sets it, where the names differ
OPTION_OF = {"input_uri": "--input", "output_uri": "--output", "traffic_uri": "--traffic", "pvc_name": "--pvc",
             "priority_class_name": "--priority-class"}

Common = {
    "namespace": typer.Option(help="Namespace the workflow and its pods run in."),
    "image": typer.Option(help="Container image the steps run, pdserve installed (default: the CPU build of the pdserve "
                                "image, runtime/image.py)."),
    "service_account": typer.Option(help="The pods' service account (Argo executor permissions; IRSA role)."),
    "priority_class": typer.Option(help="PriorityClass for the pods, lower than the online endpoint's so batch "
                                        "pods are preempted first (default pdserve-batch, from infra/k8s/batch; "
                                        "'none' for the cluster default)."),
    "s3_secret": typer.Option(help="Secret holding AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (referenced, never "
                                   "copied; default pdserve-s3, used when it exists, else the pod's IAM role); "
                                   "'none' for the pod's IAM role (IRSA / Pod Identity) only."),
    "s3_endpoint_url": typer.Option(help="S3-compatible endpoint (http(s)://host[:port]); default AWS S3."),
    "out": typer.Option("--out", help="Write the YAML here instead of stdout; an existing file is replaced only "
                                      "when it holds a workflow `pdserve batch` wrote (or with --force)."),
    "force": typer.Option("--force", help="Replace an existing --out file that is not an earlier output of "
                                          "`pdserve batch`."),
}


def _secret(value: Optional[str], default: str) -> Optional[str]:
    return None if value is not None and value.lower() == "none" else (value or default)


@app.command("workflow", cls=FlagCommand)
def workflow_cmd(
    input_uri: Annotated[str, typer.Option("--input", help="OpenAI Batch input file, s3://bucket/key.")],
    output_uri: Annotated[str, typer.Option("--output", help="Output JSONL, s3://bucket/key (resumed if present).")],
    endpoint: Annotated[str, typer.Option(
        help="In-cluster OpenAI base URL of the InferenceService: "
             "http://<isvc>-predictor.<namespace>.svc.cluster.local/openai.")],
    name: Annotated[str, typer.Option(help="Workflow name prefix (the controller appends a suffix).")] = "batch",
    model: Annotated[Optional[str], typer.Option(help="Served model name for lines whose body has none.")] = None,
    concurrency: Annotated[int, typer.Option(help="Requests in flight (the batch's share of the endpoint).")] = 8,
    max_retries: Annotated[int, typer.Option(help="Extra tries per request after 429/5xx/connection errors.")] = 3,
    namespace: Annotated[str, Common["namespace"]] = "pdserve",
    image: Annotated[Optional[str], Common["image"]] = None,
    service_account: Annotated[str, Common["service_account"]] = BATCH_SERVICE_ACCOUNT,
    priority_class: Annotated[Optional[str], Common["priority_class"]] = None,
    s3_secret: Annotated[Optional[str], Common["s3_secret"]] = None,
    s3_endpoint_url: Annotated[Optional[str], Common["s3_endpoint_url"]] = None,
    out: Annotated[Optional[Path], Common["out"]] = None,
    force: Annotated[bool, Common["force"]] = False,
) -> None:
    """Render the Argo Workflow that runs one batch file against the online endpoint (`batch run` in a pod).

    Checked against the vendored Argo Workflow CRD schema before it is written. Exit 2: a bad option (named)."""
    from runtime.batch.workflow_specs import BATCH_PRIORITY_CLASS, S3_SECRET, BatchInferenceWorkflowSpec
    from runtime.batch.workflows import batch_inference_workflow

    _emit(batch_inference_workflow, BatchInferenceWorkflowSpec, dict(
        name=name, input_uri=input_uri, output_uri=output_uri, endpoint=endpoint, model=model,
        concurrency=concurrency, max_retries=max_retries, namespace=namespace, image=image,
        service_account=service_account, priority_class_name=_secret(priority_class, BATCH_PRIORITY_CLASS),
        s3_secret=_secret(s3_secret, S3_SECRET), s3_endpoint_url=s3_endpoint_url), out, force)


@app.command("retune-schedule", cls=FlagCommand)
def retune_cmd(
    model_name: Annotated[str, typer.Option(help="Served model name = its folder under /fsx/models (org/llama8).")],
    traffic: Annotated[str, typer.Option(
        help="Recorded traffic, s3://bucket/key.jsonl (the runtime's --traffic-log, Mooncake) or .csv (Azure, BurstGPT), or "
             "s3://bucket/prefix/ for every such file under it (one traffic log per runtime replica).")],
    registered_model: Annotated[str, typer.Option(
        help="MLflow registered model whose champion each run re-tunes (`pdserve tune --like`); the winner is "
             "registered under it and takes alias champion only when it beats the champion's deployment.")],
    name: Annotated[Optional[str], typer.Option(help="CronWorkflow name (default: retune-<model>).")] = None,
    schedule: Annotated[str, typer.Option(help="5-field cron schedule (default: Sundays 03:00).")] = "0 3 * * 0",
    timezone: Annotated[str, typer.Option(help="IANA time zone of the schedule.")] = "UTC",
    gpu: Annotated[Optional[str], typer.Option(
        help="GPU catalog name or AWS instance type (as `pdserve tune --gpu`). Default: the champion's.")] = None,
    ttft_ms: Annotated[Optional[float], typer.Option(
        "--ttft-ms", help="TTFT p90 SLO, ms. Default: the champion's.")] = None,
    itl_ms: Annotated[Optional[float], typer.Option("--itl-ms", help="ITL p90 SLO, ms. Default: the champion's.")
                      ] = None,
    rate: Annotated[Optional[float], typer.Option(
        help="Target request rate, requests/s (default: each run sizes for the recorded traffic's mean arrival "
             "rate).")] = None,
    precision: Annotated[Optional[str], typer.Option(
        help="bf16, fp8 or auto (as `pdserve tune --precision`). Default: the champion's.")] = None,
    gpu_budget: Annotated[Optional[int], typer.Option(
        help="GPUs the deployment may use. Default: the champion's.")] = None,
    trace_window_h: Annotated[Optional[float], typer.Option(
        "--trace-window-h", help="Size for the traffic's last HOURS only (before its newest request); each run "
             "then reads S3 itself (pdserve tune --trace-uri … --trace-window-h) instead of downloading the whole "
             "prefix as an artifact, and skips objects last modified before the window.")] = None,
    planner: Annotated[Optional[str], typer.Option(
        help="SLO planner of the re-tuned deployment: off, sla or load (as `pdserve tune --planner`). Default: "
             "the champion's.")] = None,
    min_improvement_pct: Annotated[Optional[float], typer.Option(
        "--min-improvement-pct",
        help="How much less (percent) the winner must cost than the champion's deployment to take alias "
             "champion (as `pdserve tune --min-improvement-pct`; default: tune's, 5).")] = None,
    mlflow_uri: Annotated[str, typer.Option(help="MLflow tracking server (in-cluster http URL).")] = MLFLOW_URI,
    pvc: Annotated[str, typer.Option(
        help="FSx for Lustre PVC holding /fsx/models (with --promote also the promoted workers').")] = FSX_PVC,
    promote: Annotated[bool, typer.Option(
        "--promote", help="Add a promote step: `pdserve promote <registered-model> --apply --skip-if-live "
                          "--expect-version V` for the version V alias champion names after the tune step: a "
                          "canary beside the serving revision, probed against the SLO and rolled back when it "
                          "misses; nothing applied when V already serves (the champion stayed).")] = False,
    promote_namespace: Annotated[Optional[str], typer.Option(
        help="With --promote: namespace of the InferenceService (default: --namespace). --promote-service-account "
             "must be allowed to manage it there and the --pvc claim must exist there: kserve/promoter-rbac.yaml "
             "and infra/k8s set both up in pdserve only.")] = None,
    promote_image: Annotated[Optional[str], typer.Option(
        help="With --promote: runtime image of the promoted InferenceService (`pdserve promote --image`; default: "
             "the GPU build of --image: its tag without -cpu).")] = None,
    promote_service_account: Annotated[Optional[str], typer.Option(
        help="With --promote: service account of the promote step only (default pdserve-promoter, "
             "kserve/promoter-rbac.yaml; the tune step keeps --service-account).")] = None,
    promote_traffic_upload: Annotated[Optional[str], typer.Option(
        metavar="s3://BUCKET/PREFIX/",
        help="With --promote: `pdserve promote --traffic-upload` of the new revision, so it keeps recording traffic "
             "for the next runs ('none': record nothing). Default: derived from --traffic when that is "
             "PREFIX<InferenceService>/, what the endpoint ships; otherwise required.")] = None,
    namespace: Annotated[str, Common["namespace"]] = "pdserve",
    image: Annotated[Optional[str], Common["image"]] = None,
    service_account: Annotated[str, Common["service_account"]] = BATCH_SERVICE_ACCOUNT,
    priority_class: Annotated[Optional[str], Common["priority_class"]] = None,
    s3_secret: Annotated[Optional[str], typer.Option(
        help="Secret holding AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for reading the traffic (referenced, never "
             "copied). Default: none, the pod's IAM role (infra/terraform gives pdserve-batch one through EKS Pod "
             "Identity); name a Secret (e.g. pdserve-s3) for static keys, e.g. with MinIO.")] = None,
    s3_endpoint_url: Annotated[Optional[str], Common["s3_endpoint_url"]] = None,
    out: Annotated[Optional[Path], Common["out"]] = None,
    force: Annotated[bool, Common["force"]] = False,
) -> None:
    """Render the Argo CronWorkflow that re-tunes a staged model for its recorded traffic on a schedule.

    Each run: `pdserve tune /fsx/models/<model>/config.json --like <name> --trace <traffic> --register <name>`:
    the champion's GPU, precision, SLO, GPU budget and planner mode unless given here; the winner takes alias
    champion only when it beats the champion's deployment on that traffic. Promoting it stays a separate,
    reviewed step unless --promote adds it to the workflow (then only a new champion is promoted). The
    registered model needs a champion before the first run. Exit 2: a bad option (named)."""
    from runtime.batch.workflow_specs import BATCH_PRIORITY_CLASS, RetuneCronWorkflowSpec
    from runtime.batch.workflows import retune_cron_workflow

    if name is not None and not name.strip():  # `batch workflow` refuses it too: never the default in its place
        _fail("--name: empty; give a CronWorkflow name or leave the option out for retune-<model>")
    slug = "".join(c if c.isascii() and c.isalnum() else "-" for c in model_name.lower())
    default_name = ("retune-" + slug.strip("-"))[:52].rstrip("-")  # CronWorkflow names: <= 52 characters
    _emit(retune_cron_workflow, RetuneCronWorkflowSpec, dict(
        name=default_name if name is None else name, schedule=schedule, timezone=timezone, model_name=model_name,
        gpu=gpu,
        ttft_ms=ttft_ms, itl_ms=itl_ms, rate=rate, gpu_budget=gpu_budget, planner=planner, precision=precision,
        min_improvement_pct=min_improvement_pct, traffic_uri=traffic, trace_window_h=trace_window_h,
        registered_model=registered_model, mlflow_uri=mlflow_uri, pvc_name=pvc, promote=promote,
        promote_namespace=promote_namespace, promote_image=promote_image,
        promote_service_account=promote_service_account, promote_traffic_upload=promote_traffic_upload,
        namespace=namespace, image=image,
        service_account=service_account, priority_class_name=_secret(priority_class, BATCH_PRIORITY_CLASS),
        s3_secret=_secret(s3_secret, None), s3_endpoint_url=s3_endpoint_url), out, force)

