"""``python -m runtime.batch`` (also ``pdserve batch``): batch inference against the pdserve endpoint, and the
Argo workflows that run it (and scheduled re-tuning) on the cluster."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    help="Batch work beside the online endpoint: run an OpenAI Batch file against pdserve, or render the Argo "
         "workflows (batch inference, scheduled re-tuning) that do it on the cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
err = Console(stderr=True)


@app.callback()
def _group() -> None:
    """Batch work beside the online endpoint (subcommands below)."""


def _fail(msg: str, code: int = 2) -> None:
    err.print(f"[red]error:[/red] {escape(msg)}")
    raise typer.Exit(code)


@app.command("run")
def run_cmd(
    input_uri: Annotated[str, typer.Option(
        "--input", "-i", help="OpenAI Batch input file (JSONL: custom_id, method POST, url /v1/chat/completions | "
                              "/v1/completions | /v1/embeddings, body): a local path or s3://bucket/key.")],
    output_uri: Annotated[str, typer.Option(
        "--output", "-o", help="Output JSONL (OpenAI batch output lines: custom_id, response, error): a local path "
                               "or s3://bucket/key. If it exists, its successful lines are kept and only the rest "
                               "are sent (resume).")],
    endpoint: Annotated[str, typer.Option(
        help="OpenAI base URL of the pdserve runtime; each line's url path is appended to it (a line cannot pick "
             "another server). KServe: http://<isvc>-predictor.<namespace>.svc.cluster.local/openai.")],
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

    Exit status: 0 when every request got a 2xx answer; 1 when some did not (their output lines carry the error);
    2 for bad options or a malformed input file (then nothing is sent and the output is untouched). Prints a
    JSON summary line on stdout."""
    from runtime.batch.requests import BatchInputError
    from runtime.batch.run import BatchRunError, api_key_from_env, run_batch

    try:
        summary = run_batch(input_uri, output_uri, endpoint=endpoint, model=model, concurrency=concurrency,
                            max_retries=max_retries, timeout_s=timeout_s, api_key=api_key_from_env(api_key_env),
                            checkpoint_s=checkpoint_s, progress=progress)
    except (BatchInputError, BatchRunError) as e:
        _fail(f"{input_uri}: {e}" if isinstance(e, BatchInputError) else str(e))
    print(json.dumps(summary.as_dict()))
    if summary.failed:
        err.print(escape(f"{summary.failed} of {summary.requests} request(s) failed; their lines in {output_uri} say "
                         "why; run the same command again to retry only those"))
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
