"""What every `pdserve` command face shares: the consoles, the one-line error exit and option-name mapping.

Exit status, the same in every command (`batch` included): 0 success, 1 a failure while running (`RUNTIME`),
2 bad usage or a bad value (`USAGE`). An error is one line, without a Python class name or a traceback.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

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


def print_table(table: Table, out: Console | None = None) -> None:
    """Print ``table`` on ``out`` (default: stdout's console) with every cell whole; rich's own fitting elides
    cells ("50.…"), losing the numbers the table is read for.

    Into a file or a pipe (a CI log) the table prints at its natural width. In a terminal narrower than that,
    the layout is the first that fits (:func:`fitted_table`): the table with its cells wrapped between words,
    the same with no padding inside its borders, else one record per row (``header: value`` lines). A word
    (a number, a label such as ``TP8``) is never split while the terminal holds it: a cell wraps only at its
    spaces, so a reader sees each number as printed, never ``150`` / ``2.7`` on two lines."""
    out = console if out is None else out
    if out.is_terminal:
        out.print(fitted_table(table, out))
    else:
        Console(width=PIPE_TABLE_COLUMNS, file=out.file).print(table)


def fitted_table(table: Table, out: Console) -> RenderableType:
    """``table`` laid out for ``out``'s width (columns) with no cell cut, as :func:`print_table` says; the
    table itself is not changed."""
    natural = copy.copy(table)
    natural.expand = False  # rich measures an expanding table as wide as it is let be
    if Measurement.get(out, out.options.update_width(PIPE_TABLE_COLUMNS), natural).maximum <= out.width:
        return table
    paddings = [table.padding]
    if table.box is not None and table.box.mid_vertical.strip() and any(table.padding):
        # only between visible borders: with none, two numbers in adjacent columns would read as one
        paddings.append((0, 0, 0, 0))
    for padding in paddings:
        fitted = _wrapped(table, out, padding)
        if fitted is not None:
            return fitted
    return _records(table, out)


def _wrapped(table: Table, out: Console, padding: tuple[int, int, int, int]) -> Table | None:
    """A copy of ``table`` with ``padding`` whose columns each get at least their longest word, so its cells
    wrap only between words; None when those words alone are wider than ``out``. rich's own narrowing ignores
    a column's longest word (it cuts the widest columns first), hence the widths set here."""
    wide = out.options.update_width(PIPE_TABLE_COLUMNS)
    fitted = copy.copy(table)
    fitted.padding, fitted.expand = padding, False
    fitted.columns = [dataclasses.replace(c, no_wrap=False, overflow="fold") for c in table.columns]
    spans = []  # (longest word, longest line) of each column's cells, header and footer included
    for c in fitted.columns:
        cells = [*([c.header] if table.show_header else []), *c.cells, *([c.footer] if table.show_footer else [])]
        sizes = [Measurement.get(out, wide, cell) for cell in cells] or [Measurement(0, 0)]
        if c.width is not None:
            spans.append((c.width, c.width))
        else:
            spans.append((max(m.minimum for m in sizes), max(m.maximum for m in sizes)))
    # borders and padding: the table's natural width less its columns' contents
    frame = Measurement.get(out, wide, fitted).maximum - sum(most for _, most in spans)
    spare = out.width - frame - sum(least for least, _ in spans)
    if spare < 0:
        return None
    widths = [least for least, _ in spans]
    # the spare width goes first to the columns it makes fit whole: the fewest cells wrap
    for i in sorted(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0]):
        grow = min(spare, spans[i][1] - widths[i])
        widths[i] += grow
        spare -= grow
    fitted.columns = [dataclasses.replace(c, width=w, min_width=None, max_width=None)
                      for c, w in zip(fitted.columns, widths)]
    return fitted


def _records(table: Table, out: Console) -> Group:
    """``table`` as one block per row: its title, then for each row one ``header: value`` line per non-empty
    cell (a header's line breaks read as spaces; the value wraps between words), a blank line between rows."""

    def text(cell: RenderableType) -> Text | None:
        return out.render_str(cell) if isinstance(cell, str) else cell if isinstance(cell, Text) else None

    def label(header: RenderableType) -> str:
        t = text(header)
        return " ".join(t.plain.split()) if t is not None else ""

    parts: list[RenderableType] = []
    if table.title:
        parts.append(text(table.title) or table.title)
    labels = [label(c.header) for c in table.columns]
    for row, cells in zip(table.rows, zip(*(c.cells for c in table.columns))):
        parts.append(Text())
        for name, cell in zip(labels, cells):
            value = text(cell)
            if value is not None and not value.plain.strip():
                continue
            line = Text(overflow="fold")
            line.append(f"{name}: " if name else "", style=table.header_style or "")
            if value is None:  # a renderable that is no text: under its header
                parts.extend([line, cell])
                continue
            line.append_text(value)
            line.stylize(row.style or "")
            parts.append(line)
    if table.caption:
        parts.extend([Text(), text(table.caption) or table.caption])
    return Group(*parts)


StateOpt = Annotated[Path, typer.Option("--state-dir", help="Working state (MLflow sqlite, FSx stand-in, demo output); "
                                        "default: $PDSERVE_HOME, else .pdserve in the checkout.")]
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
