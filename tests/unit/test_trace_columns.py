"""Trace columns (pure) and the one-pass, windowed trace reader.

Specification:
* Azure CSV times parse: ``2023-11-16 18:15:46.6805900`` (7 fractional digits, no zone, read as UTC whatever
  the machine's TZ), ``…+00:00`` / ``Z`` / ``+05:30`` with fractions; anything else fails naming file, line
  and value (never a silent "no arrival times");
* each trace file is read once (lengths and times in one pass);
* the length sample is exactly ``LengthSample.from_pairs`` of the (windowed) requests, without holding them as
  tuples;
* a window keeps the requests that arrived in ``[newest - window, newest]``: counts, rate, span and sample are
  those of the window; a window needs arrival times;
* an object last modified before ``newest seen - window - margin`` cannot hold a request in the window;
* an s3:// trace URI with a query or fragment (a presigned URL) is refused without echoing it.
"""

from __future__ import annotations

import json
import re
from array import array
from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.traces.formats import (TraceColumns, TraceFormatError, may_hold_window, parse_csv, parse_csv_timestamp,
                                    parse_jsonl, reduce_trace)
from runtime.tuner.workload import LengthSample

T0 = datetime(2023, 11, 16, 18, 15, 46, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize("text, expected", [
    ("2023-11-16 18:15:46.6805900", T0 + 0.68059),  # the Azure trace's own format
    ("2023-11-16T18:15:46.6805900+00:00", T0 + 0.68059),
    ("2023-11-16 18:15:46.68+00:00", T0 + 0.68),
    ("2023-11-16T18:15:46Z", T0),
    ("2023-11-16 18:15:46", T0),
    ("2023-11-16 23:45:46.5+05:30", T0 + 0.5),
    ("2023-11-16T10:15:46.123456789-08:00", T0 + 0.123456789),
    ("  2023-11-16 18:15:46,25 ", T0 + 0.25),
])
def test_csv_timestamps_parse_with_zone_fractions_and_naive_as_utc(text, expected):
    assert parse_csv_timestamp(text) == pytest.approx(expected, abs=1e-6)


def test_a_naive_time_does_not_depend_on_the_machines_time_zone(monkeypatch):
    import time

    monkeypatch.setenv("TZ", "America/Los_Angeles")
    time.tzset()
    try:
        assert parse_csv_timestamp("2023-11-16 18:15:46.6805900") == pytest.approx(T0 + 0.68059)
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize("text, needle", [
    ("x", "is not a date-time"), ("", "is not a date-time"), ("1700000000", "is not a date-time"),
    ("2023-13-16 18:15:46", "month must be in 1..12"), ("2023-11-16 24:00:00", "hour must be in 0..23"),
    ("2023-11-16 18:15:46+25:00", "zone offset"), ("2023-11-16 18:15:46.68 PST", "is not a date-time"),
])
def test_a_bad_csv_timestamp_names_file_line_and_value(text, needle):
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens\n", "2023-11-16 18:15:46.6805900,1,1\n", f"{text},2,2\n"]
    with pytest.raises(TraceFormatError, match=rf"^az\.csv:3: TIMESTAMP {re.escape(repr(text))}.*{needle}"):
        parse_csv(lines, "az.csv")


def test_an_azure_format_trace_reads_in_one_pass_with_its_times(azure_trace):
    from runtime.tracking.traces import load_trace_workload
    from tests.conftest import AZURE_ROWS as rows

    with azure_trace.open(encoding="utf-8") as f:
        head = [next(f) for _ in range(3)]
    cols = parse_csv(head, "az.csv")
    assert list(cols.isl_tokens) == [r.isl for r in rows[:2]] and list(cols.osl_tokens) == [r.osl for r in rows[:2]]
    assert cols.times_s[1] - cols.times_s[0] == pytest.approx(rows[1].t_s - rows[0].t_s, abs=1e-6)
    w = load_trace_workload(azure_trace)
    assert w.requests == len(rows) and w.span_s == pytest.approx(rows[-1].t_s - rows[0].t_s, abs=1e-6)
    assert w.request_rate_per_s == pytest.approx((len(rows) - 1) / w.span_s)
    assert w.requests_outside_window == 0


def test_each_trace_file_is_read_once(tmp_path, monkeypatch):
    import runtime.tracking.traces as traces

    opened = []
    real = traces._file_chunks
    monkeypatch.setattr(traces, "_file_chunks", lambda p, *a: opened.append(p.name) or real(p, *a))
    d = tmp_path / "logs"
    d.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (d / name).write_text("".join(json.dumps({"timestamp": 1_764_000_000_000 + 1000 * k, "input_length": 5,
                                                  "output_length": 3}) + "\n" for k in range(100)))
    w = traces.load_trace_workload(d)
    assert sorted(opened) == ["a.jsonl", "b.jsonl"]  # once each: lengths and arrival times in one pass
    assert w.requests == 200 and w.request_rate_per_s == pytest.approx(199 / 99)


def _cols(name, rows):
    c = TraceColumns(name)
    for i, o, t in rows:
        c.isl_tokens.append(i)
        c.osl_tokens.append(o)
        c.times_s.append(t)
    return c


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 50), st.integers(-1, 50)), min_size=1, max_size=700),
       st.integers(1, 300))
def test_the_sample_is_length_sample_from_pairs_of_all_requests(pairs, max_points):
    """Invariant: reduce_trace's sample == LengthSample.from_pairs(every pair, in trace order)."""
    half = len(pairs) // 2
    files = [_cols("a", [(i, o, 1e9 + k) for k, (i, o) in enumerate(pairs[:half])]),
             _cols("b", [(i, o, 1e9 + k) for k, (i, o) in enumerate(pairs[half:])])]
    if not any(i >= 1 and o >= 1 for i, o in pairs):
        with pytest.raises(TraceFormatError, match="no request with input and output length >= 1"):
            reduce_trace(files, "t", max_points=max_points)
        return
    assert reduce_trace(files, "t", max_points=max_points).sample == LengthSample.from_pairs(pairs, max_points)


def test_a_window_keeps_the_last_hours_before_the_newest_request():
    hour = 3600.0
    start = 1_764_000_000.0
    old = [(100, 10, start + k) for k in range(0, 7200, 10)]  # 2 h at 0.1/s, short prompts
    new = [(1000, 20, start + 7200 + k) for k in range(0, 3601, 2)]  # then 1 h at 0.5/s, long ones
    files = [_cols("old", old), _cols("new", new[::-1])]  # a file in finishing order: times unsorted
    whole = reduce_trace(files, "t")
    last = reduce_trace(files, "t", window_s=hour)
    assert whole.requests == 720 + 1801 and whole.requests_outside_window == 0
    assert (whole.isl_tokens, whole.osl_tokens) != (1000, 20)
    # [newest - 1 h, newest], both ends kept: every new request (the first one on the bound), no old one
    assert last.requests == 1801 and last.requests_outside_window == 720
    assert (last.isl_tokens, last.osl_tokens) == (1000, 20) and last.sample == LengthSample.from_pairs(
        [(1000, 20)] * 1801)
    assert last.request_rate_per_s == pytest.approx(0.5) and last.span_s == pytest.approx(hour)
    assert last.peak_rate_per_s == pytest.approx(0.5)
    assert reduce_trace(files, "t", window_s=hour - 0.5).requests == 1800  # the bound moved past the first
    assert reduce_trace(files, "t", window_s=100 * hour) == whole


def test_a_window_needs_times_and_a_request_inside_it():
    no_times = parse_jsonl(['{"input_length": 5, "output_length": 5}\n'] * 3, "n.jsonl")
    with pytest.raises(TraceFormatError, match="n.jsonl: a trace window needs arrival times"):
        reduce_trace([no_times], "n.jsonl", window_s=60)
    failed_lately = _cols("f", [(5, 5, 1e9), (0, 0, 1e9 + 7200)])  # only failed requests in the last hour
    with pytest.raises(TraceFormatError, match=r"no request .* in the last 1 h of the trace \(1 line"):
        reduce_trace([failed_lately], "f", window_s=3600)
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="trace window must be a finite number of seconds > 0"):
            reduce_trace([failed_lately], "f", window_s=bad)


def test_columns_are_compact_arrays():
    cols = parse_jsonl([json.dumps({"timestamp": 1, "input_length": 2, "output_length": 3})], "t")
    assert all(isinstance(a, array) for a in (cols.isl_tokens, cols.osl_tokens, cols.times_s))
    with pytest.raises(TraceFormatError, match="t:1: a length beyond"):
        parse_jsonl([json.dumps({"input_length": 2 ** 70, "output_length": 3})], "t")


def test_an_object_modified_before_the_window_minus_the_margin_cannot_hold_it():
    newest, window, margin = 10_000.0, 3600.0, 60.0
    assert may_hold_window(newest - window - margin, newest, window, margin)  # on the bound: kept
    assert not may_hold_window(newest - window - margin - 0.001, newest, window, margin)
    assert may_hold_window(newest, newest, window, margin)


@pytest.mark.parametrize("uri", [
    "s3://bucket/traffic/t.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=deadbeef0123",
    "s3://bucket/traffic/?X-Amz-Security-Token=secrettoken0123",
    "s3://bucket/traffic/t.jsonl#X-Amz-Signature=deadbeef0123",
])
def test_a_trace_uri_with_a_query_or_fragment_is_refused_without_echoing_it(uri):
    from runtime.tracking.traces import check_traffic_trace_uri, fetch_trace_workload

    for call in (check_traffic_trace_uri, fetch_trace_workload):
        with pytest.raises(ValueError, match="must not carry a query string or fragment") as e:
            call(uri)
        assert "deadbeef" not in str(e.value) and "secrettoken" not in str(e.value)
        assert "s3://bucket/traffic/" in str(e.value)


@pytest.mark.parametrize("eol", ["\r", "\r\n", "\n"])
def test_csv_and_jsonl_read_with_any_line_ending(tmp_path, eol):
    """A CSV saved with old-Mac CR line endings read as before the one-pass reader (``open(newline="")``), not as
    one line that the csv module refuses with an untyped ``_csv.Error``; a CR split across read chunks is one
    line ending."""
    from runtime.tracking.traces import load_trace_workload, text_lines

    csv_file = tmp_path / "t.csv"
    csv_file.write_bytes(eol.join(["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.1,100,10",
                                   "2023-11-16 18:16:46.1,300,30", ""]).encode())
    w = load_trace_workload(csv_file)
    assert (w.requests, w.isl_tokens, w.osl_tokens) == (2, 200, 20)
    assert w.request_rate_per_s == pytest.approx(1 / 60)
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_bytes(eol.join(json.dumps({"timestamp": t, "input_length": 7, "output_length": 3})
                               for t in (0, 1000)).encode())
    assert load_trace_workload(jsonl).requests == 2
    assert list(text_lines([b"a\r", b"\nb\r", b"c"], "n")) == ["a\r\n", "b\r", "c"]


def test_a_csv_the_csv_module_refuses_is_a_trace_format_error_naming_the_line(tmp_path):
    """Any csv.Error (a field over the csv module's size limit, ...) names file and line as a TraceFormatError (a
    ValueError the CLI and the tune step report), never an untyped ``_csv.Error`` traceback."""
    from runtime.tracking.traces import load_trace_workload

    f = tmp_path / "big.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n"
                 f"2023-11-16 18:15:47,\"{'9' * 200_000}\",1\n")
    with pytest.raises(TraceFormatError, match=re.escape(f"{f}:3")):
        load_trace_workload(f)


def test_a_long_line_is_assembled_in_linear_time(monkeypatch):
    """A line spanning many chunks (a whole-file JSON array saved as .json, a CSV without line ends) is joined
    once, not re-copied with every chunk (quadratic: 64 MiB took seconds, a GB-sized file hours). Counted: the
    characters handed to the line splitter stay within a small multiple of the input."""
    import runtime.traces.formats as formats

    copied = []
    real = formats._split_lines
    monkeypatch.setattr(formats, "_split_lines", lambda text: copied.append(len(text)) or real(text))
    lines = list(formats.text_lines(iter([b"x" * 1024] * 2000 + [b"\n"]), "n"))
    assert lines == ["x" * 1024 * 2000 + "\n"]
    assert sum(copied) <= 4 * 1024 * 2000


def test_a_csv_mixing_zoned_and_zone_less_times_is_refused_naming_the_line():
    """A zone-less time is read as UTC; in a file that also has zoned times that silently shifts some arrivals by
    the zone's offset (here 2 h: a 60 s trace would span 2 h, its rate 120x too low). Such a file is refused at
    the first line whose kind differs, naming it and both values; files of one kind read as before."""
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    mixed = head + "2023-11-16 18:15:00+02:00,100,10\n2023-11-16 16:16:00,100,10\n"
    with pytest.raises(TraceFormatError, match=r"t\.csv:3: .*'2023-11-16 16:16:00' has no time zone.*'2023-11-16 18:15:00\+02:00'"):
        parse_csv(mixed.splitlines(keepends=True), "t.csv")
    for rows in (["2023-11-16 18:15:00+02:00", "2023-11-16 16:16:00Z"], ["2023-11-16 18:15:00", "2023-11-16 18:16:00"]):
        c = parse_csv([head] + [f"{r},100,10\n" for r in rows], "t.csv")
        assert c.times_s[1] - c.times_s[0] == pytest.approx(60.0)


def test_a_burstgpt_csv_is_read_by_its_header_and_feeds_the_tuners_workload(tmp_path):
    from runtime.tracking.traces import load_trace_workload

    text = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,472,18,490,Conversation log\n"
            "35,GPT-4,1087,0,1087,API log\n"  # a failed request: 0 response tokens
            "65.5,ChatGPT,30,230,260,Conversation log\n")
    cols = parse_csv(text.splitlines(keepends=True), "burst.csv")
    assert list(cols.isl_tokens) == [472, 1087, 30] and list(cols.osl_tokens) == [18, 0, 230]
    assert list(cols.times_s) == [5.0, 35.0, 65.5] and cols.unix_time() is False
    (tmp_path / "burst.csv").write_text(text)
    w = load_trace_workload(tmp_path / "burst.csv")
    assert (w.isl_tokens, w.osl_tokens) == (251, 124)  # the failed request is left out of the length sample
    assert w.request_rate_per_s == pytest.approx(2 / 60.5)


@pytest.mark.parametrize("text, needle", [
    ("Timestamp,Request tokens,Response tokens\n5,10,-1\n", r"burst.csv:2: Response tokens must be a whole number "
                                                          r"of tokens >= 0, got '-1'"),
    ("Timestamp,Request tokens,Response tokens\nnan,10,1\n", r"burst.csv:2: Timestamp must be a number of seconds"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,99999999999999999999,1\n",
     r"burst.csv:2: a length beyond 2\*\*63"),
    ("Time,Prompt,Output\n1,2,3\n", r"needs 'ContextTokens' and 'GeneratedTokens' \(Azure\) or 'Request tokens' and "
                                  r"'Response tokens' \(BurstGPT\); the header has \['Time', 'Prompt', 'Output'\]"),
])
def test_bad_csv_lines_are_refused_naming_the_line_and_column(text, needle):
    with pytest.raises(TraceFormatError, match=needle):
        parse_csv(text.splitlines(keepends=True), "burst.csv")


def test_a_negative_json_length_is_refused():
    with pytest.raises(TraceFormatError, match=r"t.jsonl:1: input_length must be a whole number of tokens >= 0"):
        parse_jsonl(['{"timestamp": 0, "input_length": -3, "output_length": 1}\n'], "t.jsonl")
