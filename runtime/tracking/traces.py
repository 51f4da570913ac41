"""Adapter: read request lengths (ISL, OSL) from a trace file for the tuner's workload sample.

Formats (../shared/data/traces):
* CSV with ``ContextTokens`` and ``GeneratedTokens`` columns (Azure LLM inference trace 2023, Splitwise);
* JSON lines with ``input_length`` and ``output_length`` (Mooncake FAST'25 trace).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from runtime.tuner.workload import DEFAULT_MAX_POINTS, LengthSample


class TraceFormatError(ValueError):
    """The trace lacks the length columns/keys (named in the message)."""


def read_isl_osl(path: Path) -> list[tuple[int, int]]:
    """All (isl, osl) pairs of the trace, in file order.

    Raises:
        TraceFormatError: unknown format, missing columns/keys, a line that is not a JSON object or a length
            that is not a whole number (the message names ``path:line`` and the key).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        out = []
        with path.open(encoding="utf-8-sig") as f:  # a BOM before the first object is not JSON
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise TraceFormatError(f"{path}:{n}: not JSON: {e}") from None
                if not isinstance(rec, dict):
                    raise TraceFormatError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
                missing = [k for k in ("input_length", "output_length") if k not in rec]
                if missing:
                    raise TraceFormatError(f"{path}:{n}: missing key(s) {', '.join(missing)}")
                out.append((_length(rec["input_length"], path, n, "input_length"),
                            _length(rec["output_length"], path, n, "output_length")))
        return out
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8-sig") as f:  # a BOM would glue itself to the first column
            reader = csv.DictReader(f)
            missing = [k for k in ("ContextTokens", "GeneratedTokens") if k not in (reader.fieldnames or [])]
            if missing:
                raise TraceFormatError(f"{path}: missing column(s) {', '.join(missing)}")
            return [(_length(r["ContextTokens"], path, n, "ContextTokens"),
                     _length(r["GeneratedTokens"], path, n, "GeneratedTokens"))
                    for n, r in enumerate(reader, 2)]  # line 1 is the header
    raise TraceFormatError(f"{path}: unknown trace format (expected .csv or .jsonl)")


def _length(value: object, path: Path, line: int, key: str) -> int:
    """A token count from a trace field; TraceFormatError naming ``path:line`` and ``key`` otherwise."""
    if type(value) is int:
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():  # CSV cells
        return int(value)
    if type(value) is float and math.isfinite(value) and value.is_integer():  # 512.0
        return int(value)
    raise TraceFormatError(f"{path}:{line}: {key} must be a whole number of tokens, got {value!r}")


def read_arrival_rate(path: Path) -> float | None:
    """Mean arrival rate of the trace, requests/s: ``(n - 1) / (last - first arrival)``, or None when it has no
    usable times (fewer than two, equal, or missing / malformed on any line).

    Times: JSONL ``timestamp`` in milliseconds (Mooncake: from the trace's start; the runtime's traffic log:
    Unix ms, so logs of several runtime replicas can be concatenated and still give the total rate); CSV
    ``TIMESTAMP`` as an ISO date-time (Azure LLM inference trace: ``2023-11-16 18:15:46.6805900``). Lines may be
    in any order. The mean is what the tuner sizes replica counts for; bursts above it are the planner's to
    absorb at run time.

    Raises:
        FileNotFoundError: no such file. (Format problems give None: the lengths reader names them.)
    """
    from datetime import datetime

    path = Path(path)
    times: list[float] = []
    try:
        if path.suffix.lower() in (".jsonl", ".json"):
            with path.open(encoding="utf-8-sig") as f:
                for line in f:
                    if line.strip():
                        t = json.loads(line).get("timestamp")
                        if type(t) not in (int, float) or not math.isfinite(t):
                            return None
                        times.append(t / 1000.0)
        elif path.suffix.lower() == ".csv":
            with path.open(newline="", encoding="utf-8-sig") as f:
                for r in csv.DictReader(f):
                    head, _, frac = (r.get("TIMESTAMP") or "").strip().partition(".")
                    times.append(datetime.fromisoformat(head).timestamp() + (float("0." + frac) if frac else 0.0))
    except (ValueError, AttributeError):  # not JSON, not an object, not a date-time
        return None
    if len(times) < 2 or max(times) <= min(times):
        return None
    return (len(times) - 1) / (max(times) - min(times))


def load_length_sample(path: Path, max_points: int = DEFAULT_MAX_POINTS) -> LengthSample:
    """:func:`read_isl_osl` reduced to a deterministic ``LengthSample`` of at most ``max_points`` pairs (requests
    with a length < 1, e.g. failed ones, are left out).

    Raises:
        TraceFormatError: as :func:`read_isl_osl`, or no request with both lengths >= 1 (an empty trace).
    """
    pairs = read_isl_osl(path)
    try:
        return LengthSample.from_pairs(pairs, max_points=max_points)
    except ValueError:
        raise TraceFormatError(f"{path}: no request with input and output length >= 1 ({len(pairs)} line(s)): "
                               "was any traffic recorded?") from None
