"""Seeded synthetic traffic traces in the formats pdserve reads, for tests.

Two public formats (docs/benchmarks.md names the real traces they follow):

* Azure LLM inference trace CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens``, TIMESTAMP a date-time
  (``2023-11-16 18:15:46.6805900``: 7 fractional digits, no zone), optionally with a zone (``+00:00``, ``Z``).
* Mooncake JSONL: one object a line, ``timestamp`` in ms from the trace's start, ``input_length``,
  ``output_length`` and ``hash_ids`` (one id per 512-token block; shared ids are shared prefixes).

Each generator returns the rows it wrote, so a test computes what a reader must find from the same rows
rather than from remembered constants.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from dataclasses import dataclass
from pathlib import Path

AZURE_EPOCH = dt.datetime(2023, 11, 16, 18, 15, 46, 680590)


@dataclass(frozen=True)
class Row:
    """One request: arrival ``t_s`` (seconds from the first request), prompt and output lengths (tokens)."""

    t_s: float
    isl: int
    osl: int


def poisson_rows(n: int, seed: int, rate_per_s: float, isl_median: float = 1000.0, osl_median: float = 150.0,
                 sigma: float = 0.9) -> list[Row]:
    """``n`` requests with exponential gaps at ``rate_per_s`` and log-normal lengths (``sigma`` the log-space
    standard deviation, so a few prompts are ~10× the median, as in production chat traces). The first request
    arrives at 0 s."""
    rng = random.Random(seed)
    t, rows = 0.0, []
    for k in range(n):
        if k:
            t += rng.expovariate(rate_per_s)
        isl = max(1, round(rng.lognormvariate(_ln(isl_median), sigma)))
        osl = max(1, round(rng.lognormvariate(_ln(osl_median), sigma)))
        rows.append(Row(t, isl, osl))
    return rows


def write_azure_csv(path: Path, rows: list[Row], *, zone: str = "", frac_digits: int = 7,
                    newline: str = "\n") -> Path:
    """Write ``rows`` as an Azure-trace CSV at ``path`` (parents created); times from ``AZURE_EPOCH``, with
    ``frac_digits`` fractional digits (0-9: truncated, like the trace's 7) and ``zone`` appended."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for r in rows:
        lines.append(f"{azure_time(r.t_s, frac_digits)}{zone},{r.isl},{r.osl}")
    path.write_bytes((newline.join(lines) + newline).encode())
    return path


def azure_time(t_s: float, frac_digits: int = 7) -> str:
    """The TIMESTAMP of a request ``t_s`` seconds after ``AZURE_EPOCH``, with ``frac_digits`` digits."""
    ns = round(t_s * 1e9) + AZURE_EPOCH.microsecond * 1000
    base = AZURE_EPOCH.replace(microsecond=0) + dt.timedelta(seconds=ns // 1_000_000_000)
    frac = f"{ns % 1_000_000_000:09d}"[:frac_digits]
    return base.strftime("%Y-%m-%d %H:%M:%S") + (f".{frac}" if frac_digits else "")


def write_mooncake_jsonl(path: Path, rows: list[Row], *, block_tokens: int = 512, shared_prefix_blocks: int = 0,
                         timestamps: bool = True) -> Path:
    """Write ``rows`` as Mooncake JSONL at ``path`` (parents created): ``timestamp`` in integer ms (left out
    when ``timestamps`` is false), ``hash_ids`` one per ``block_tokens`` prompt block, the first
    ``shared_prefix_blocks`` of them common to every request (a shared system prompt)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    next_id, out = shared_prefix_blocks, []
    for r in rows:
        blocks = -(-r.isl // block_tokens)
        shared = list(range(min(shared_prefix_blocks, blocks)))
        own = list(range(next_id, next_id + blocks - len(shared)))
        next_id += len(own)
        rec = {"input_length": r.isl, "output_length": r.osl, "hash_ids": shared + own}
        if timestamps:
            rec = {"timestamp": round(r.t_s * 1000), **rec}
        out.append(json.dumps(rec) + "\n")
    path.write_text("".join(out))
    return path


def _ln(x: float) -> float:
    import math

    return math.log(x)
