"""Mooncake-format request traces (pure: parses lines the caller has read).

Format (Mooncake FAST'25 trace, github.com/kvcache-ai/Mooncake ``mooncake_trace.jsonl``): one JSON
object per line with ``timestamp`` (arrival, milliseconds from trace start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids`` (chained prefix-block ids, one per 512-token block of the
prompt, the last block possibly partial). Equal ids at equal positions mean equal prefixes, so the ids
are used directly as KV block hashes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Tokens per ``hash_ids`` block in Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line is malformed; the message names the line number and the key."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. ``arrival_s`` is seconds from trace start."""

    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def parse_mooncake(lines: Iterable[str]) -> list[TraceRequest]:
    """Parse Mooncake JSONL lines (blank lines skipped) into requests sorted by arrival.

    A UTF-8 byte-order mark at the start of the first line is ignored. JSON booleans are not numbers
    here (``true`` is refused where an int is expected), and ``timestamp`` must be finite (Python's
    JSON reader accepts bare ``NaN``/``Infinity``, which would break the sort and the replay clock).

    Raises:
        TraceError: naming the 1-based line number and the missing/invalid key.
    """
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, start=1):
        if lineno == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"line {lineno}: not JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise TraceError(f"line {lineno}: expected a JSON object")
        for key in ("timestamp", "input_length", "output_length", "hash_ids"):
            if key not in obj:
                raise TraceError(f"line {lineno}: missing key {key!r}")
        ts, isl, osl, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
        if not _is_number(ts) or not _finite(ts) or ts < 0:
            raise TraceError(f"line {lineno}: 'timestamp' must be a finite number >= 0 (ms), got {ts!r}")
        if not _is_int(isl) or isl < 1:
            raise TraceError(f"line {lineno}: 'input_length' must be an int >= 1, got {isl!r}")
        if not _is_int(osl) or osl < 0:
            raise TraceError(f"line {lineno}: 'output_length' must be an int >= 0, got {osl!r}")
        if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
            raise TraceError(f"line {lineno}: 'hash_ids' must be a list of ints")
        out.append(TraceRequest(f"r{lineno}", ts / 1000.0, isl, osl, tuple(ids)))
    out.sort(key=lambda r: r.arrival_s)
    return out


def _finite(value: float) -> bool:
    """math.isfinite that answers False for an int beyond float range instead of raising."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_int(value: object) -> bool:
    """True for a JSON integer; ``bool`` is an ``int`` subclass in Python but not a number in a trace."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """True for a JSON number (int or float), not a boolean."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scale_arrivals(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Multiply every arrival time by ``factor`` (> 1 slows the trace down, < 1 speeds it up).

    Raises:
        ValueError: when ``factor`` is not a finite number > 0 (``inf`` would turn arrival 0 into NaN).
    """
    if not _is_number(factor) or not math.isfinite(factor) or not factor > 0:
        raise ValueError(f"arrival scale factor must be a finite number > 0, got {factor!r}")
    return [TraceRequest(r.request_id, r.arrival_s * factor, r.input_tokens, r.output_tokens, r.hash_ids)
            for r in requests]


def oracle_hit_rate(requests: Iterable[TraceRequest]) -> float:
    """Fraction of prompt blocks seen earlier in the trace: the hit rate of one infinite cache."""
    seen: set[int] = set()
    hits = total = 0
    for r in requests:
        for h in r.hash_ids:
            total += 1
            if h in seen:
                hits += 1
            else:
                seen.add(h)
    return hits / total if total else 0.0
