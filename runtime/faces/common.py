"""What every `pdserve` command face shares: the consoles, the one-line error exit and option-name mapping.

Exit status, the same in every command (`batch` included): 0 success, 1 a failure while running (`RUNTIME`),
2 bad usage or a bad value (`USAGE`). An error is one line, without a Python class name or a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from runtime.paths import json_object_with, state_dir
from runtime.redact import redact_userinfo

RUNTIME, USAGE = 1, 2  # exit statuses: a failure while running, bad usage or a bad value



def make_console(stderr: bool = False) -> Console:
    """A console that wraps text at a terminal's width and, writing to a file or a pipe (a CI log), not at all:
    rich would cut lines at 80 columns there, paths and error messages mid-word."""
    c = Console(stderr=stderr)
    c.soft_wrap = not c.is_terminal
    return c


console = make_console()
err = make_console(stderr=True)
# a table's width in a file or a pipe: wider than any table a command prints, so rich never elides a cell
PIPE_TABLE_COLUMNS = 1000


def print_table(table: Table) -> None:
    """Print ``table`` on stdout: fitted to a terminal's width, and into a file or a pipe (a CI log) whole, at
    its natural width with no cell cut: rich would otherwise fit it into 80 columns there and elide numbers
    ("50.…") that the log is read for."""
    if console.is_terminal:
        console.print(table)
    else:
        Console(width=PIPE_TABLE_COLUMNS).print(table)


StateOpt = Annotated[Path, typer.Option("--state-dir", help="Working state (MLflow sqlite, FSx stand-in, demo output).")]
DEFAULT_STATE = state_dir()


def fail(msg: str, code: int = RUNTIME) -> None:
    """Print `msg` (plain text: brackets are escaped, never read as rich markup; the `user:password@` of any
    URI in it replaced by `***@`; its lines joined into one, as a library's message may span several, e.g.
    SQLAlchemy's `[SQL: ...]` line) on stderr and exit with `code` (RUNTIME or USAGE)."""
    msg = " ".join(line.strip() for line in msg.splitlines() if line.strip())
    err.print(f"[bold red]error:[/] {escape(redact_userinfo(msg))}")
    raise typer.Exit(code)


def usage(msg: str) -> None:
    """:func:`fail` with exit status 2: a bad option or option value."""
    fail(msg, USAGE)


def option_errors(exc, options: dict[str, str]) -> str:
    """A pydantic ValidationError as `--option: message` lines, the field names mapped to the CLI options
    that set them (`options`: field → option); no pydantic URL."""
    from runtime.usecases.tune import pydantic_problems

    return pydantic_problems(exc, options)


VLLM_LEVEL_ENV = "VLLM_LOGGING_LEVEL"  # the level vLLM gives its `vllm` logger and handler when first imported


def verbose_given(ctx: typer.Context) -> bool:
    """Whether `pdserve -v` (the root command's --verbose) was given to the command of ``ctx``."""
    return bool(ctx.find_root().params.get("verbose"))


@contextlib.contextmanager
def vllm_logs_quiet(verbose: bool) -> Iterator[None]:
    """Within it, vLLM logs errors only, unless ``verbose`` (`pdserve -v`) or VLLM_LOGGING_LEVEL is set: reading
    vLLM's argument parser (`--engine-arg`) imports vLLM, which logs INFO and WARNING lines about its own
    platform (Triton, the CPU backend) that say nothing about the command. vLLM configures its logger once,
    from VLLM_LOGGING_LEVEL, when first imported, so both the variable and the `vllm` logger's level are set;
    on exit both are as vLLM's defaults would have left them (INFO for a logger configured within). Only for
    in-process work: a process started within would inherit the variable."""
    if verbose or VLLM_LEVEL_ENV in os.environ:
        yield
        return
    vllm_log = logging.getLogger("vllm")
    configured, level = "vllm.logger" in sys.modules, vllm_log.level
    os.environ[VLLM_LEVEL_ENV] = "ERROR"
    vllm_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        del os.environ[VLLM_LEVEL_ENV]
        if configured or "vllm.logger" not in sys.modules:
            vllm_log.setLevel(level)
        else:  # configured within, at ERROR: as vLLM's default would have
            for target in (vllm_log, *vllm_log.handlers):
                target.setLevel(logging.INFO)


def check_engine_options(max_model_len: int | None, engine_args: list[str], verbose: bool = False) -> None:
    """`--max-model-len` and `--engine-arg` of `tune` / `promote`: one error line (exit 2) naming every problem
    (runtime.usecases.tune.engine_option_problems); vLLM's own log lines while its parser loads are hidden
    unless ``verbose`` (:func:`vllm_logs_quiet`)."""
    from runtime.usecases.tune import engine_option_problems

    with vllm_logs_quiet(verbose):
        problems = engine_option_problems(max_model_len, engine_args)
    if problems:
        usage("; ".join(problems))


def price_options(usd_per_gpu_hour: list[str], price_file: Path | None) -> dict[str, float] | None:
    """`--price-file PATH` then `--usd-per-gpu-hour GPU=USD` items (an item wins over the file for its GPU) as
    {GPU catalog name: USD per GPU-hour} (runtime.perf.instances); None when neither is given. One error line
    (exit 2) for an unreadable file or a bad price."""
    from runtime.perf.instances import parse_price_file, parse_price_overrides

    prices: dict[str, float] = {}
    try:
        if price_file is not None:
            try:
                text = price_file.read_text()
            except (OSError, UnicodeDecodeError) as e:
                usage(f"--price-file {price_file}: {getattr(e, 'strerror', None) or e}")
            prices |= parse_price_file(text, f"--price-file {price_file}")
        prices |= parse_price_overrides(usd_per_gpu_hour)
    except ValueError as e:
        usage(str(e))
    return prices or None


def _yaml_objects(every, some=lambda d: True):
    """Recognises YAML documents that are all objects passing ``every``, at least one passing ``some``."""
    def ours(text: str) -> bool:
        import yaml

        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        return bool(docs) and all(isinstance(d, dict) and every(d) for d in docs) and any(some(d) for d in docs)
    return ours


def _label(doc: dict, key: str) -> object:
    return ((doc.get("metadata") or {}).get("labels") or {}).get(key)


def _pipeline_package(text: str) -> bool:
    import yaml

    from pipelines.stage_tune_promote import PIPELINE_NAME

    first = next(yaml.safe_load_all(text), None)
    return isinstance(first, dict) and (first.get("pipelineInfo") or {}).get("name") == PIPELINE_NAME


# what each command writes -> (how its message names it, how an earlier output of it is recognised); `tune --out`:
# runtime.usecases.tune_model.SPEC_FILE, checked there after what --out must never replace
OUTPUT_FILES = {
    "decision": ("a champion decision written by `pdserve tune --decision-out`",
                 json_object_with("registered_model", "registered_version", "champion_version", "replaced")),
    "manifests": ("manifests written by `pdserve promote`",
                  _yaml_objects(lambda d: "kind" in d and "apiVersion" in d,
                                lambda d: _label(d, "app.kubernetes.io/name") == "pdserve")),
    "workflow": ("an Argo workflow written by `pdserve batch`",
                 _yaml_objects(lambda d: str(d.get("apiVersion", "")).startswith("argoproj.io/")
                               and _label(d, "app.kubernetes.io/part-of") == "pdserve")),
    "pipeline": ("the stage-tune-promote pipeline package", _pipeline_package),
}


def check_output_file(option: str, path: Path | None, kind: str, force: bool) -> None:
    """Exit 2 (naming ``option``) when writing ``path`` would replace a file that is not an earlier output of
    this command (``kind``: a key of ``OUTPUT_FILES``) and ``force`` is not given: the one rule of every command
    that writes a file (runtime.paths.replace_problem). None: nothing is written."""
    from runtime.paths import replace_problem

    if path is None:
        return
    what, ours = OUTPUT_FILES[kind]
    problem = replace_problem(path, ours, what, force=force)
    if problem:
        usage(f"{option} {path}: {problem}" if option else f"{path}: {problem}")


_LIST_ITEM = re.compile(r"\s|[-*•]\s|\d+[.)]\s|\x08")  # an indented line, a list item, typer's \b: kept


def reflow_help(text: str | None) -> str | None:
    """A command's help (its docstring) with the line breaks inside each paragraph removed, so the terminal
    wraps it at its own width: typer keeps a docstring's single line breaks after the first paragraph, which
    leaves fragments of lines at 80 or 100 columns. Paragraphs (blank lines between) stay apart, and a line
    that is indented or starts a list item (``- ``, ``* ``, ``1. ``) keeps its own line."""
    if not text:
        return text
    import inspect

    paragraphs = []
    for para in re.split(r"\n\s*\n", inspect.cleandoc(text)):
        lines: list[str] = []
        for line in para.splitlines():
            if lines and not _LIST_ITEM.match(line):
                lines[-1] = f"{lines[-1].rstrip()} {line.strip()}"
            else:
                lines.append(line.rstrip())
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def plain_flags(params: list) -> list:
    """``params`` (click parameters, changed in place and returned) with every on/off flag given an empty
    metavar: typer's rich help prints each option's type, so a flag (``--force``, ``--apply/--no-apply``,
    ``--help``) would read ``--force <bool>`` as if it took a value; click and argparse show a flag bare. A
    counting option (``-vvv``) and an option whose metavar is set keep theirs."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and not param.count and param.metavar is None:
            param.metavar = ""
    return params


class FlagCommand(TyperCommand):
    """A `pdserve` command (pass ``cls=FlagCommand`` to ``app.command``): its help shows flags bare
    (:func:`plain_flags`), ``--help`` included, which click adds only when the parameters are read."""

    def get_params(self, ctx):
        return plain_flags(super().get_params(ctx))


class ReflowGroup(TyperGroup):
    """The typer group of `pdserve` and its sub-groups: every command's help is :func:`reflow_help`'d, and the
    group's own flags show bare (:func:`plain_flags`; its commands need ``cls=FlagCommand``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.help = reflow_help(self.help)
        for command in self.commands.values():
            if not isinstance(command, ReflowGroup):  # a sub-group reflows its own
                command.help = reflow_help(command.help)

    def get_params(self, ctx):
        return plain_flags(super().get_params(ctx))
