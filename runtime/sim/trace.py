"""Mooncake-format request traces for the router simulator (pure: parses lines the caller has read).

The format and its line decoding live in ``runtime.traces.formats`` (:func:`~runtime.traces.formats.mooncake_records`:
one JSON object per line with ``timestamp`` (arrival, milliseconds from trace start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids`` (chained prefix-block ids, one per 512-token block of the
prompt, the last block possibly partial)). Equal ids at equal positions mean equal prefixes, so the ids
are used directly as KV block hashes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from runtime.traces.formats import MOONCAKE_BLOCK_TOKENS, TraceFormatError, is_number, mooncake_records

__all__ = ["MOONCAKE_BLOCK_TOKENS", "TraceError", "TraceRequest", "oracle_hit_rate", "parse_mooncake",
           "scale_arrivals"]

TraceError = TraceFormatError  # what the simulator's callers catch: a malformed line, named by file:line and key


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. ``arrival_s`` is seconds from trace start."""

    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def parse_mooncake(lines: Iterable[str], name: str = "") -> list[TraceRequest]:
    """Parse Mooncake JSONL lines (blank lines skipped) into requests sorted by arrival; request ids are
    ``r<line number>``. Lines are decoded and checked by ``runtime.traces.formats.mooncake_records`` (a BOM
    before the first line dropped; booleans and non-finite timestamps refused).

    Raises:
        TraceError: naming the 1-based line number (``name:N``, or ``line N`` without a ``name``) and the
            missing/invalid key.
    """
    out = [TraceRequest(f"r{r.line}", r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids)
           for r in mooncake_records(lines, name)]
    out.sort(key=lambda r: r.arrival_s)
    return out


def scale_arrivals(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Multiply every arrival time by ``factor`` (> 1 slows the trace down, < 1 speeds it up).

    Raises:
        ValueError: when ``factor`` is not a finite number > 0 (``inf`` would turn arrival 0 into NaN).
    """
    if not is_number(factor) or not math.isfinite(factor) or not factor > 0:
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
