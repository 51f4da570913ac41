"""What every `pdserve` command face shares: the consoles, the one-line error exit and option-name mapping.

Exit status, the same in every command (`batch` included): 0 success, 1 a failure while running (`RUNTIME`),
2 bad usage or a bad value (`USAGE`). An error is one line, without a Python class name or a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from runtime.paths import state_dir
from runtime.redact import redact_userinfo

RUNTIME, USAGE = 1, 2  # exit statuses: a failure while running, bad usage or a bad value

console = Console()
err = Console(stderr=True)

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


def check_engine_options(max_model_len: int | None, engine_args: list[str]) -> None:
    """`--max-model-len` and `--engine-arg` of `tune` / `promote`: one error line (exit 2) naming every problem
    (runtime.usecases.tune.engine_option_problems)."""
    from runtime.usecases.tune import engine_option_problems

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
