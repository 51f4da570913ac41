"""The one home of trace formats: bytes → lines → compact columns → the tuner's workload, in ONE pass over each
file (pure: no file, socket, clock or env; the adapter ``runtime.tracking.traces`` reads files and S3 objects and
feeds them here as byte chunks and names).

Formats (docs/benchmarks.md names the public traces in each), chosen by the file name's suffix
(``READABLE_SUFFIXES``):
* CSV with ``ContextTokens`` and ``GeneratedTokens`` columns (Azure LLM inference traces 2023 and 2024, Splitwise),
  or with ``Request tokens`` and ``Response tokens`` (BurstGPT, Wang et al. 2024: ChatGPT and GPT-4 traffic of a
  university's Azure OpenAI service; a failed request has 0 response tokens);
* JSON lines with ``input_length`` and ``output_length`` (Mooncake FAST'25 trace; the runtime's
  ``--traffic-log``, runtime/server/traffic.py, writes this format with Unix-ms timestamps). The router simulator
  reads Mooncake traces with their ``hash_ids`` prefix blocks (:func:`mooncake_records`); both JSON readers decode
  lines with :func:`json_records`.

A file becomes a :class:`TraceColumns`: its requests' input and output lengths (tokens) and arrival times (s) as
``array`` columns (8 bytes a value, not a tuple and two objects per request), so a trace of millions of
requests fits in tens of MB. :func:`reduce_trace` merges the files of a trace, optionally keeps only the
requests that arrived in the last ``window_s`` before the newest one, and reduces them to the length sample
(``LengthSample``: at most ``DEFAULT_MAX_POINTS`` evenly spaced requests, the stride of
``LengthSample.from_pairs``), the mean and peak arrival rates and the span.

Times: JSON lines ``timestamp`` in milliseconds (Mooncake: from the trace's start; the runtime's traffic log,
runtime/server/traffic.py: Unix ms); CSV ``TIMESTAMP`` as an ISO 8601 date-time (:func:`parse_csv_timestamp`);
BurstGPT's ``Timestamp`` in seconds from the trace's start.
"""

from __future__ import annotations

import codecs
import csv
import json
import math
import re
from array import array
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Iterable, Iterator, NamedTuple

from runtime.tuner.workload import DEFAULT_MAX_POINTS, LengthSample

JSONL_SUFFIXES = (".jsonl", ".json")
CSV_SUFFIXES = (".csv",)
READABLE_SUFFIXES = JSONL_SUFFIXES + CSV_SUFFIXES  # what read_isl_osl reads (case-insensitive)
SKIPPED_SHOWN = 5  # names a "skipped" warning lists (the count is always given)


PEAK_WINDOW_S = 60.0  # the busiest minute: the time scale the planner reacts on (PlannerSpec interval ~ 10-60 s)
UNIX_TIME_MIN_S = 1e9  # 2001-09-09: earlier JSONL times are offsets from a trace's own start (Mooncake)
TIME_MAX_S = 4.1e9  # 2099: a later time is a unit mix-up (us or ns), not an arrival


class TraceFormatError(ValueError):
    """The trace lacks the length columns/keys, or a line is malformed (the message names file, line and key)."""


@dataclass
class TraceColumns:
    """One trace file's requests, in file order. ``times_s`` is None when the file has no usable arrival times
    (a JSON line without a numeric ``timestamp``, a CSV without a ``TIMESTAMP`` column, a time outside
    [0, TIME_MAX_S] or a file timed both from its own start and in Unix time)."""

    name: str  # what messages call the file (a path or an s3:// URI)
    isl_tokens: array = field(default_factory=lambda: array("q"))
    osl_tokens: array = field(default_factory=lambda: array("q"))
    times_s: array | None = field(default_factory=lambda: array("d"))

    @property
    def requests(self) -> int:
        return len(self.isl_tokens)

    def unix_time(self) -> bool | None:
        """True: Unix times; False: times from the trace's own start; None: no times (or none usable)."""
        if not self.times_s:
            return None
        return min(self.times_s) >= UNIX_TIME_MIN_S

    def newest_s(self) -> float | None:
        """The latest arrival time, s; None without usable times."""
        return max(self.times_s) if self.times_s else None

    def _check_times(self) -> None:
        t = self.times_s
        if t and (min(t) < 0 or max(t) > TIME_MAX_S or (min(t) >= UNIX_TIME_MIN_S) != (max(t) >= UNIX_TIME_MIN_S)):
            self.times_s = None  # a unit mix-up, or one file timed from its own start AND in Unix time


def length(value: object, name: str, line: int, key: str) -> int:
    """A token count from a trace field (int, a whole float such as 512.0, or a CSV cell of digits), >= 0 (a
    failed request records 0; a negative count is a corrupt line).

    Raises:
        TraceFormatError: anything else, naming ``name:line`` and ``key``.
    """
    n = None
    if type(value) is int:
        n = value
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():  # CSV cells
        n = int(value)
    elif type(value) is float and math.isfinite(value) and value.is_integer():  # 512.0
        n = int(value)
    if n is None or n < 0:
        raise TraceFormatError(f"{name}:{line}: {key} must be a whole number of tokens >= 0, got {value!r}")
    return n


def _line_at(name: str, n: int) -> str:
    """Where a message points: ``name:n``, or ``line n`` for a caller that has no file name."""
    return f"{name}:{n}" if name else f"line {n}"


def json_records(lines: Iterable[str], name: str, keys: tuple[str, ...]) -> Iterator[tuple[int, dict]]:
    """``(line number from 1, object)`` of each non-blank line of a JSON-lines trace that holds every key in
    ``keys``; a UTF-8 byte-order mark before the first line is dropped. Values are not checked here.

    Raises:
        TraceFormatError: a line that is not JSON, not a JSON object or lacks a key in ``keys`` (the message
            names ``name:line``, or ``line N`` when ``name`` is empty, and the keys).
    """
    for n, line in enumerate(lines, 1):
        at = _line_at(name, n)
        if n == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise TraceFormatError(f"{at}: not JSON: {e}") from None
        if not isinstance(rec, dict):
            raise TraceFormatError(f"{at}: expected a JSON object, got {type(rec).__name__}")
        missing = [k for k in keys if k not in rec]
        if missing:
            raise TraceFormatError(f"{at}: missing key(s) {', '.join(missing)}")
        yield n, rec


def parse_jsonl(lines: Iterable[str], name: str) -> TraceColumns:
    """Columns of a JSON-lines trace (``input_length``, ``output_length``, optional ``timestamp`` in ms);
    blank lines are skipped, line numbers count from 1.

    Raises:
        TraceFormatError: a line that is not a JSON object, lacks a length key or has a length that is not a
            whole number (``name:line`` and the key in the message). A missing or non-numeric ``timestamp``
            is not an error: the file then has no usable times (``times_s`` None; a rate must be given).
    """
    out = TraceColumns(name)
    isl, osl, times = out.isl_tokens, out.osl_tokens, out.times_s
    for n, rec in json_records(lines, name, ("input_length", "output_length")):
        try:
            isl.append(length(rec["input_length"], name, n, "input_length"))
            osl.append(length(rec["output_length"], name, n, "output_length"))
        except OverflowError:  # a length beyond 64 bits
            raise TraceFormatError(f"{name}:{n}: a length beyond 2**63 tokens") from None
        if times is not None:
            t = rec.get("timestamp")
            if type(t) in (int, float) and math.isfinite(t):
                times.append(t / 1000.0)
            else:
                times = out.times_s = None
    out._check_times()
    return out


MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash_ids block in the Mooncake trace (its README, FAST'25 artifact)


class MooncakeRecord(NamedTuple):
    """One line of a Mooncake trace with its prefix blocks (:func:`mooncake_records`)."""

    line: int  # 1-based line number in the file
    arrival_s: float  # ``timestamp`` / 1000: seconds from the trace's start
    input_tokens: int  # >= 1
    output_tokens: int  # >= 0
    hash_ids: tuple[int, ...]  # chained prefix-block ids, one per MOONCAKE_BLOCK_TOKENS of the prompt


def mooncake_records(lines: Iterable[str], name: str) -> Iterator[MooncakeRecord]:
    """The requests of a Mooncake trace that keeps its prefix blocks (github.com/kvcache-ai/Mooncake
    ``mooncake_trace.jsonl``: ``timestamp`` ms from the trace's start, ``input_length`` and ``output_length``
    tokens, ``hash_ids``), in file order; every key required and checked strictly: JSON booleans are not
    numbers, and ``timestamp`` must be finite (Python's JSON reader accepts bare ``NaN``/``Infinity``).

    Raises:
        TraceFormatError: as :func:`json_records`, or a value outside its range (``timestamp`` a finite number
            >= 0, ``input_length`` an int >= 1, ``output_length`` an int >= 0, ``hash_ids`` a list of ints),
            naming ``name:line`` (``line N`` when ``name`` is empty) and the key.
    """
    for n, rec in json_records(lines, name, MOONCAKE_KEYS):
        at = _line_at(name, n)
        ts, isl, osl, ids = (rec[k] for k in MOONCAKE_KEYS)
        if not is_number(ts) or not _finite(ts) or ts < 0:
            raise TraceFormatError(f"{at}: 'timestamp' must be a finite number >= 0 (ms), got {ts!r}")
        if not _is_int(isl) or isl < 1:
            raise TraceFormatError(f"{at}: 'input_length' must be an int >= 1, got {isl!r}")
        if not _is_int(osl) or osl < 0:
            raise TraceFormatError(f"{at}: 'output_length' must be an int >= 0, got {osl!r}")
        if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
            raise TraceFormatError(f"{at}: 'hash_ids' must be a list of ints")
        yield MooncakeRecord(n, ts / 1000.0, isl, osl, tuple(ids))


def _finite(value: float) -> bool:
    """math.isfinite that answers False for an int beyond float range instead of raising."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_int(value: object) -> bool:
    """True for a JSON integer; ``bool`` is an ``int`` subclass in Python but not a number in a trace."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """True for a JSON number (int or float), not a boolean."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


CSV_TIME_COLUMN = "TIMESTAMP"
# the CSV formats, tried in order on the header: (input length, output length, arrival time) column names and
# whether the time is an ISO date-time (Azure) or seconds from the trace's start (BurstGPT's Timestamp)
CSV_FORMATS = (("Azure", "ContextTokens", "GeneratedTokens", CSV_TIME_COLUMN, True),
               ("BurstGPT", "Request tokens", "Response tokens", "Timestamp", False))


def parse_csv(lines: Iterable[str], name: str) -> TraceColumns:
    """Columns of a CSV trace; line 1 is the header, which picks the format (``CSV_FORMATS``): Azure
    (``ContextTokens``, ``GeneratedTokens``, optional ``TIMESTAMP``) or BurstGPT (``Request tokens``,
    ``Response tokens``, optional ``Timestamp`` in seconds from the trace's start).

    Raises:
        TraceFormatError: no format's length columns in the header; a length that is not a whole number (or
            beyond 2**63), a ``TIMESTAMP`` :func:`parse_csv_timestamp` refuses or a ``Timestamp`` that is not a
            finite number of seconds (``name:line`` and the column in the message). Without the time column the
            file has no usable times (``times_s`` None). A file whose TIMESTAMPs mix zone-less and zoned times
            is refused at the first that differs from the first (zone-less is read as UTC, which would shift the
            others' arrivals). Anything the csv module refuses (csv.Error: a field over its size limit, ...) is
            a TraceFormatError naming ``name:line`` too.
    """
    reader = csv.reader(lines)
    try:
        return _parse_csv_rows(reader, name)
    except csv.Error as e:  # a field over csv.field_size_limit(), a NUL, ...: named like every other bad line
        raise TraceFormatError(f"{name}:{reader.line_num}: not CSV: {e}") from None


def _parse_csv_rows(reader, name: str) -> TraceColumns:  # noqa: ANN001 - a csv.reader
    out = TraceColumns(name)
    header = next(reader, None) or []
    fmt = next((f for f in CSV_FORMATS if f[1] in header and f[2] in header), None)
    if fmt is None:
        wanted = " or ".join(f"{f[1]!r} and {f[2]!r} ({f[0]})" for f in CSV_FORMATS)
        raise TraceFormatError(f"{name}: missing column(s): a CSV trace needs {wanted}; the header has {header[:8]}")
    _, i_name, o_name, t_name, iso = fmt
    i_col, o_col = header.index(i_name), header.index(o_name)
    t_col = header.index(t_name) if t_name in header else None
    if t_col is None:
        out.times_s = None
    width = len(header)
    cache: dict[str, float] = {}  # the Azure trace repeats whole seconds; parse each distinct prefix once
    first_time: tuple[str, bool] | None = None  # the first TIMESTAMP and whether it carries a zone
    for row in reader:
        n = reader.line_num  # the physical line the row ended on (a quoted cell may span lines)
        if not row:
            continue
        row += [""] * (width - len(row))
        try:
            out.isl_tokens.append(length(row[i_col], name, n, i_name))
            out.osl_tokens.append(length(row[o_col], name, n, o_name))
        except OverflowError:  # a length beyond 64 bits
            raise TraceFormatError(f"{name}:{n}: a length beyond 2**63 tokens") from None
        if t_col is None:
            continue
        cell = row[t_col]
        if not iso:
            out.times_s.append(_seconds(cell, name, n, t_name))
            continue
        out.times_s.append(parse_csv_timestamp(cell, name, n, cache))
        zoned = _ZONE_AT_END.search(cell) is not None
        if first_time is None:
            first_time = (cell.strip(), zoned)
        elif zoned != first_time[1]:  # a zone-less time is read as UTC: beside zoned ones it would be shifted
            raise TraceFormatError(
                f"{name}:{n}: {CSV_TIME_COLUMN} {cell.strip()!r} {'has' if zoned else 'has no'} time zone, but "
                f"{first_time[0]!r} (the file's first) {'has' if first_time[1] else 'has none'}: zone-less times "
                "are read as UTC, so mixing them with zoned ones would shift arrivals; write every time one way")
    out._check_times()
    return out


def _seconds(cell: str, name: str, line: int, column: str) -> float:
    """A CSV cell of seconds (BurstGPT's ``Timestamp``: ``5``, ``12.25``).

    Raises:
        TraceFormatError: not a finite number, naming ``name:line`` and ``column``.
    """
    try:
        t = float(cell)
    except ValueError:
        t = math.nan
    if not math.isfinite(t):
        raise TraceFormatError(f"{name}:{line}: {column} must be a number of seconds, got {cell!r}")
    return t


_ZONE_AT_END = re.compile(r"(?:Z|[+-]\d{2}:?\d{2})\s*$", re.IGNORECASE)  # a TIMESTAMP's zone (see _ISO)
_ISO = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:[.,](\d+))?\s*(Z|[+-]\d{2}:?\d{2})?",
                  re.IGNORECASE)


def parse_csv_timestamp(text: str, name: str = "trace", line: int = 0, cache: dict | None = None) -> float:
    """An ISO 8601 date-time → Unix seconds (float): ``2023-11-16 18:15:46.6805900`` (the Azure LLM inference
    trace 2023: seven fractional digits, no zone), ``2023-11-16T18:15:46.68+00:00``, ``...Z``, ``...+0530``.
    Any number of fractional digits is kept (to float precision). A time WITHOUT a zone is read as UTC, not
    as the reader's local time: only differences between arrivals matter, and they must not change with the
    machine's TZ or jump at a daylight-saving change.

    Raises:
        TraceFormatError: not such a date-time, or an impossible date or time (month 13, hour 24), naming
            ``name:line`` and the value.
    """
    s = text.strip()
    m = _ISO.fullmatch(s)
    if m is None:
        raise TraceFormatError(f"{name}:{line}: {CSV_TIME_COLUMN} {text!r} is not a date-time like "
                               "'2023-11-16 18:15:46.6805900' or '2023-11-16T18:15:46.68+00:00'")
    y, mo, d, h, mi, sec, frac, zone = m.groups()
    key = s[:m.start(7) - 1] + (zone or "") if frac else s
    base = cache.get(key) if cache is not None else None
    if base is None:
        tz = timezone.utc
        if zone and zone.upper() != "Z":
            hh, mm = int(zone[1:3]), int(zone[-2:])
            if hh > 23 or mm > 59:
                raise TraceFormatError(f"{name}:{line}: {CSV_TIME_COLUMN} {text!r}: zone offset {zone} out of range")
            tz = timezone((-1 if zone[0] == "-" else 1) * timedelta(hours=hh, minutes=mm))
        try:
            base = datetime(int(y), int(mo), int(d), int(h), int(mi), int(sec), tzinfo=tz).timestamp()
        except ValueError as e:  # month 13, Feb 30, hour 24
            raise TraceFormatError(f"{name}:{line}: {CSV_TIME_COLUMN} {text!r}: {e}") from None
        if cache is not None and len(cache) < 100_000:
            cache[key] = base
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


class TraceWorkload(NamedTuple):
    """A trace reduced to what the tuner sizes for (:func:`reduce_trace`)."""

    sample: LengthSample  # up to DEFAULT_MAX_POINTS evenly spaced (isl, osl) pairs, tokens
    isl_tokens: int  # the sample's mean ISL, rounded, >= 1: what the spec's workload records
    osl_tokens: int  # the sample's mean OSL, rounded, >= 1
    request_rate_per_s: float | None  # mean arrival rate; None: unusable or not read
    peak_rate_per_s: float | None = None  # busiest 60 s; None: shorter or no times
    requests: int = 0  # lines (requests) in the trace, all files (inside the window when one is given)
    span_s: float | None = None  # first to last arrival, s (inside the window); None: no usable times
    requests_outside_window: int = 0  # requests READ but left out by the window (0 without; not those unread)
    skipped: tuple[str, ...] = ()  # files or objects under a folder/prefix that were not read, with the reason
    objects_not_read: int = 0  # S3 objects a window made unnecessary (LastModified before it; not an error)


def merged_times(files: list[TraceColumns], name: str) -> list[float] | None:
    """Sorted arrival times (s) of all ``files``; None when any file has no usable times.

    Raises:
        TraceFormatError: files timed from their own start (Mooncake) mixed with files in Unix time (traffic
            logs): their times cannot be merged (the message names ``name`` and one file of each kind).
    """
    kinds: dict[bool, str] = {}
    for f in files:
        if f.times_s is None:
            return None
        kind = f.unix_time()
        if kind is not None:
            kinds.setdefault(kind, f.name)
    if len(kinds) > 1:
        raise TraceFormatError(f"{name}: mixes files timed from their own start ({kinds[False]}) with files in Unix "
                               f"time ({kinds[True]}); their arrival times cannot be merged")
    times: list[float] = []
    for f in files:
        times.extend(f.times_s)
    times.sort()
    return times


def mean_rate(times: list[float] | None) -> float | None:
    """``(n - 1) / (last - first)`` of sorted times, requests/s; None for fewer than two or a zero span."""
    if times is None or len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def peak_rate(times: list[float] | None, window_s: float = PEAK_WINDOW_S) -> float | None:
    """Most arrivals in any ``window_s`` (a window is ``(t - window_s, t]``, sliding over the sorted times) over
    ``window_s``, requests/s; None when the times span less than one window."""
    if times is None or len(times) < 2 or times[-1] - times[0] < window_s:
        return None
    best, lo = 0, 0
    for hi, t in enumerate(times):  # two pointers: times[lo..hi] lie within (t - window_s, t]
        while times[lo] <= t - window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window_s


def window_start_s(files: list[TraceColumns], window_s: float, name: str) -> float:
    """``newest arrival - window_s`` over ``files``, s: requests at or after it are in the window.

    Raises:
        TraceFormatError: no usable arrival times (a window needs them), naming ``name``.
    """
    newest = [f.newest_s() for f in files]
    if not files or any(f.times_s is None for f in files) or all(t is None for t in newest):
        raise TraceFormatError(f"{name}: a trace window needs arrival times (timestamp / TIMESTAMP on every line), "
                               "and this trace has none usable")
    return max(t for t in newest if t is not None) - window_s


def reduce_trace(files: list[TraceColumns], name: str, *, read_rate: bool = True, window_s: float | None = None,
                 max_points: int = DEFAULT_MAX_POINTS, skipped: tuple[str, ...] = (),
                 objects_not_read: int = 0) -> TraceWorkload:
    """The workload ``files`` (in trace order) stand for: with ``window_s`` (s, > 0) only the requests that
    arrived in ``[newest - window_s, newest]``; their length sample (requests with a length < 1 left out, at
    most ``max_points`` evenly spaced), its mean ISL/OSL rounded (>= 1), with ``read_rate`` the mean arrival
    rate, always the busiest minute's rate and the span.

    Raises:
        ValueError: ``window_s`` not a finite number > 0.
        TraceFormatError: no request with both lengths >= 1 (in the window); a window without usable times;
            files that mix time kinds (:func:`merged_times`). Messages name ``name``.
    """
    lo = None
    if window_s is not None:
        if not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"trace window must be a finite number of seconds > 0, got {window_s!r}")
        merged_times(files, name)  # a mix of time kinds is refused before a window is laid over it
        lo = window_start_s(files, window_s, name)
    total = sum(f.requests for f in files)

    def kept():  # (isl, osl, time or None) of the requests in the window, trace order
        for f in files:
            t = f.times_s
            for k in range(f.requests):
                if lo is None or t[k] >= lo:
                    yield f.isl_tokens[k], f.osl_tokens[k], (t[k] if t is not None else None)

    n_valid = n_kept = 0
    times: list[float] | None = [] if lo is not None else merged_times(files, name)
    for i, o, t in kept():
        n_kept += 1
        n_valid += i >= 1 and o >= 1
        if lo is not None:
            times.append(t)
    if n_valid == 0:
        where = f" in the last {window_s / 3600:g} h of the trace" if lo is not None else ""
        raise TraceFormatError(f"{name}: no request with input and output length >= 1{where} ({n_kept} line(s)): "
                               "was any traffic recorded?")
    if lo is not None:
        times.sort()
    step = n_valid / max_points if n_valid > max_points else 1.0
    want = 0
    pairs = []
    k = 0
    for i, o, _ in kept():  # the k-th valid pair is taken when k == int(j * step): LengthSample.from_pairs' stride
        if i >= 1 and o >= 1:
            if k == int(want * step) and len(pairs) < max_points:
                pairs.append((i, o))
                want += 1
            k += 1
    sample = LengthSample.from_pairs(pairs, max_points=max_points)
    span = times[-1] - times[0] if times and len(times) >= 2 else None
    return TraceWorkload(sample, max(1, round(sample.mean_isl)), max(1, round(sample.mean_osl)),
                         mean_rate(times) if read_rate else None, peak_rate(times), n_kept, span,
                         total - n_kept, skipped, objects_not_read)


def may_hold_window(last_modified_s: float, newest_seen_s: float, window_s: float, margin_s: float) -> bool:
    """Whether an object last modified at ``last_modified_s`` (S3 LastModified, Unix s) can hold a request that
    arrived at or after ``newest_seen_s - window_s`` (``newest_seen_s``: the newest arrival read so far, Unix s).

    Why LastModified bounds the arrivals: the runtime writes a line when its request FINISHES (after it
    arrived) and ships only lines already written (``TrafficShipper``: a PUT of a byte range of the log), so
    every line's arrival is before the object's LastModified by the clock of the pod that recorded it. The
    pod's clock and S3's may disagree (NTP keeps them within well under a second; LastModified is rounded to
    whole seconds), so ``margin_s`` widens the bound. ``newest_seen_s`` is at most the trace's newest arrival,
    so the window start it gives is at or before the real one: skipping on it never drops a request inside
    the real window. Objects read in LastModified order, newest first, can stop at the first this refuses.
    """
    return last_modified_s + margin_s >= newest_seen_s - window_s


def skipped_note(skipped: Iterable[str], where: str) -> str:
    """One warning line for files or objects under ``where`` that were not read: their count and the first
    ``SKIPPED_SHOWN`` names with the reason."""
    skipped = list(skipped)
    shown = ", ".join(skipped[:SKIPPED_SHOWN]) + (", ..." if len(skipped) > SKIPPED_SHOWN else "")
    return f"{len(skipped)} file(s) under {where} not read as trace: {shown}"


_EOL = re.compile(r"(\r\n|\r|\n)")


def _split_lines(text: str) -> tuple[list[str], str]:
    """The complete lines of ``text`` (ending kept) and the incomplete rest. A line ends at '\n', '\r\n' or a lone
    '\r' (old-Mac CSV exports; what ``open(newline="")`` gave the csv module): a '\r' at the very end is kept in
    the rest, as it may be the first half of a '\r\n' split across chunks."""
    held = ""
    if text.endswith("\r"):
        text, held = text[:-1], "\r"
    if "\r" not in text:  # the common case, at str.split speed
        lines = text.split("\n")
        rest = lines.pop()
        return [line + "\n" for line in lines], rest + held
    parts = _EOL.split(text)  # [line, ending, line, ending, ..., rest]
    rest = parts.pop()
    return [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)], rest + held


def text_lines(chunks: Iterable[bytes], name: str) -> Iterator[str]:
    """The lines (ending kept: '\n', '\r\n' or a lone '\r') of UTF-8 text arriving as byte ``chunks`` (a BOM
    before the first is dropped: it is not JSON, and would glue itself to a CSV's first column); reads one chunk
    at a time.

    Raises:
        TraceFormatError: not UTF-8, naming ``name`` and the byte offset.
    """
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    partial: list[str] = []  # the line not ended yet, in pieces: joined once it ends (not re-copied per chunk)
    offset = 0
    for chunk in chunks:
        try:
            piece = decoder.decode(chunk)
        except UnicodeDecodeError as e:
            raise TraceFormatError(f"{name}: not UTF-8 text ({e.reason} at byte {offset + e.start})") from None
        offset += len(chunk)
        if "\n" not in piece and "\r" not in piece and not (partial and partial[-1].endswith("\r")):
            partial.append(piece)
            continue
        lines, rest = _split_lines("".join(partial) + piece)
        partial = [rest]
        yield from lines
    try:
        partial.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{name}: not UTF-8 text ({e.reason} at the end)") from None
    rest = "".join(partial)
    if rest:
        yield rest


def parse_trace_text(lines: Iterable[str], name: str, suffix_of: str) -> TraceColumns:
    """Columns of one trace file's lines; the format follows the suffix of ``suffix_of`` (a path or key).

    Raises:
        TraceFormatError: unknown suffix, or as ``parse_jsonl`` / ``parse_csv``.
    """
    suffix = suffix_of.lower()
    if suffix.endswith(JSONL_SUFFIXES):
        return parse_jsonl(lines, name)
    if suffix.endswith(CSV_SUFFIXES):
        return parse_csv(lines, name)
    raise TraceFormatError(f"{name}: unknown trace format (expected .csv or .jsonl)")
