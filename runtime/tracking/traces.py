"""Adapter: read request lengths (ISL, OSL) from a trace file for the tuner's workload sample.

Formats (../shared/data/traces):
* CSV with ``ContextTokens`` and ``GeneratedTokens`` columns (Azure LLM inference trace 2023, Splitwise);
* JSON lines with ``input_length`` and ``output_length`` (Mooncake FAST'25 trace).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from runtime.tuner.workload import DEFAULT_MAX_POINTS, LengthSample


class TraceFormatError(ValueError):
    """The trace lacks the length columns/keys (named in the message)."""


def read_isl_osl(path: Path) -> list[tuple[int, int]]:
    """All (isl, osl) pairs of the trace, in file order.

    Raises:
        TraceFormatError: unknown format or missing columns/keys (named).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if path.suffix in (".jsonl", ".json"):
        out = []
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = json.loads(line)
                missing = [k for k in ("input_length", "output_length") if k not in rec]
                if missing:
                    raise TraceFormatError(f"{path}:{n}: missing key(s) {', '.join(missing)}")
                out.append((int(rec["input_length"]), int(rec["output_length"])))
        return out
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [k for k in ("ContextTokens", "GeneratedTokens") if k not in (reader.fieldnames or [])]
            if missing:
                raise TraceFormatError(f"{path}: missing column(s) {', '.join(missing)}")
            return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in reader]
    raise TraceFormatError(f"{path}: unknown trace format (expected .csv or .jsonl)")


def load_length_sample(path: Path, max_points: int = DEFAULT_MAX_POINTS) -> LengthSample:
    """:func:`read_isl_osl` reduced to a deterministic ``LengthSample`` of at most ``max_points`` pairs."""
    return LengthSample.from_pairs(read_isl_osl(path), max_points=max_points)
