"""Adapter: read request lengths (ISL, OSL) from a trace file for the tuner's workload sample.

Formats (../shared/data/traces):
* CSV with ``ContextTokens`` and ``GeneratedTokens`` columns (Azure LLM inference trace 2023, Splitwise);
* JSON lines with ``input_length`` and ``output_length`` (Mooncake FAST'25 trace; the runtime's
  ``--traffic-log``, runtime/server/traffic.py, writes this format with Unix-ms timestamps).

A trace may also be a DIRECTORY of such files, all of one format (``trace_files``): the traffic logs of several
runtime replicas (one file per pod), or an S3 prefix an Argo input artifact downloaded. Its files are read
in name order as one trace; their arrival times are merged.

The format follows the file name's suffix (``READABLE_SUFFIXES``). :func:`load_trace_workload` is the one
reduction of a trace to the tuner's workload, shared by ``pdserve tune --trace`` and the pipeline's tune step.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import NamedTuple

from runtime.tuner.workload import DEFAULT_MAX_POINTS, LengthSample

JSONL_SUFFIXES = (".jsonl", ".json")
CSV_SUFFIXES = (".csv",)
READABLE_SUFFIXES = JSONL_SUFFIXES + CSV_SUFFIXES  # what read_isl_osl reads (case-insensitive)


class TraceFormatError(ValueError):
    """The trace lacks the length columns/keys (named in the message)."""


def trace_files(path: Path) -> list[Path]:
    """The files a trace consists of: ``[path]`` for a file; for a directory, every ``.jsonl`` / ``.json`` /
    ``.csv`` file below it (recursively; hidden files and folders, empty files and second links to a file
    already taken skipped), sorted by relative path.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceFormatError: a directory without trace files, or one mixing CSV and JSON-lines files (their
            timestamps differ in kind: Azure date-times vs milliseconds).
    """
    path = Path(path)
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such trace file or directory")
        return [path]
    files, seen = [], set()
    for f in sorted(path.rglob("*"), key=lambda f: f.relative_to(path).as_posix()):
        if (not f.is_file() or f.suffix.lower() not in READABLE_SUFFIXES
                or any(part.startswith(".") for part in f.relative_to(path).parts)):
            continue
        st = f.stat()
        real = (st.st_dev, st.st_ino)
        if real in seen or st.st_size == 0:  # a file linked twice (sym- or hard link) counts once; empty adds nothing
            continue
        seen.add(real)
        files.append(f)
    if not files:
        raise TraceFormatError(f"{path}: directory holds no trace file (.jsonl, .json or .csv): was any traffic "
                               "recorded?")
    kinds = {f.suffix.lower() in CSV_SUFFIXES for f in files}
    if len(kinds) > 1:
        raise TraceFormatError(f"{path}: mixes .csv and .jsonl trace files; a directory must hold one format")
    return files


def read_isl_osl(path: Path) -> list[tuple[int, int]]:
    """All (isl, osl) pairs of the trace, in file order (a directory: its ``trace_files`` one after another).

    Raises:
        TraceFormatError: unknown format, missing columns/keys, a line that is not a JSON object or a length
            that is not a whole number (the message names ``path:line`` and the key); a directory without
            trace files or mixing formats.
        FileNotFoundError: no such file or directory.
    """
    out: list[tuple[int, int]] = []
    for f in trace_files(path):
        try:
            out += _read_file_isl_osl(f)
        except UnicodeDecodeError as e:  # named by its file (a folder's message would name only the folder)
            raise TraceFormatError(f"{f}: not UTF-8 text ({e.reason})") from None
    return out


def _read_file_isl_osl(path: Path) -> list[tuple[int, int]]:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
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
    if suffix in CSV_SUFFIXES:
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
    Unix ms, so the logs of several runtime replicas, concatenated or as one directory, give the total rate);
    CSV ``TIMESTAMP`` as an ISO date-time (Azure LLM inference trace: ``2023-11-16 18:15:46.6805900``). Lines
    may be in any order. The mean is what the tuner sizes replica counts for; bursts above it are the
    planner's to absorb at run time.

    Raises:
        FileNotFoundError: no such file or directory.
        TraceFormatError: a directory without trace files, mixing formats (``trace_files``), or mixing files
            timed from their own start (Mooncake) with files in Unix time (traffic logs): their times cannot
            be merged. (Format problems inside a file give None: the lengths reader names them.)
    """
    return _mean_rate(_merged_times(path))


def _mean_rate(times: list[float] | None) -> float | None:
    if times is None or len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


PEAK_WINDOW_S = 60.0  # the busiest minute: the time scale the planner reacts on (PlannerSpec interval ~ 10-60 s)
UNIX_TIME_MIN_S = 1e9  # 2001-09-09: earlier JSONL times are offsets from a trace's own start (Mooncake)
TIME_MAX_S = 4.1e9  # 2099: a later time is a unit mix-up (us or ns), not an arrival


def read_peak_rate(path: Path, window_s: float = PEAK_WINDOW_S) -> float | None:
    """Arrival rate of the busiest ``window_s`` of the trace, requests/s: the most arrivals in any window of
    that length (sliding over the sorted arrival times, so a burst across a minute boundary is seen whole)
    over ``window_s``. None when the trace has no usable times (as ``read_arrival_rate``) or spans less than
    one window (its mean rate is then all there is).

    Raises:
        ValueError: ``window_s`` <= 0.
        FileNotFoundError / TraceFormatError: as ``read_arrival_rate``.
    """
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s!r}")
    return _peak_rate(_merged_times(path), window_s)


def _peak_rate(times: list[float] | None, window_s: float = PEAK_WINDOW_S) -> float | None:
    if times is None or len(times) < 2 or times[-1] - times[0] < window_s:
        return None
    best, lo = 0, 0
    for hi, t in enumerate(times):  # two pointers: times[lo..hi] lie within (t - window_s, t]
        while times[lo] <= t - window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window_s


def _merged_times(path: Path) -> list[float] | None:
    """Sorted arrival times (s) of every file of the trace; None when a file has unusable times.

    Raises:
        TraceFormatError: a folder mixing trace-relative and Unix times (see ``read_arrival_rate``).
    """
    times: list[float] = []
    kinds: dict[bool, Path] = {}
    for f in trace_files(path):
        t = _arrival_times(f)
        if t is None or any(not 0 <= x <= TIME_MAX_S for x in t):
            return None
        if t and (min(t) >= UNIX_TIME_MIN_S) != (max(t) >= UNIX_TIME_MIN_S):
            return None  # one file timed both from its own start and in Unix time: no usable times
        if t:
            kinds.setdefault(min(t) >= UNIX_TIME_MIN_S, f)
        times += t
    if len(kinds) > 1:
        raise TraceFormatError(f"{path}: mixes files timed from their own start ({kinds[False]}) with files in Unix "
                               f"time ({kinds[True]}); their arrival times cannot be merged")
    return sorted(times)


def _arrival_times(path: Path) -> list[float] | None:
    """Arrival times of one trace file, seconds; None when a line has none or a malformed one."""
    from datetime import datetime

    times: list[float] = []
    try:
        if path.suffix.lower() in JSONL_SUFFIXES:
            with path.open(encoding="utf-8-sig") as f:
                for line in f:
                    if line.strip():
                        t = json.loads(line).get("timestamp")
                        if type(t) not in (int, float) or not math.isfinite(t):
                            return None
                        times.append(t / 1000.0)
        elif path.suffix.lower() in CSV_SUFFIXES:
            with path.open(newline="", encoding="utf-8-sig") as f:
                for r in csv.DictReader(f):
                    head, _, frac = (r.get("TIMESTAMP") or "").strip().partition(".")
                    times.append(datetime.fromisoformat(head).timestamp() + (float("0." + frac) if frac else 0.0))
    except (ValueError, AttributeError):  # not JSON, not an object, not a date-time
        return None
    return times


def load_length_sample(path: Path, max_points: int = DEFAULT_MAX_POINTS) -> LengthSample:
    """:func:`read_isl_osl` reduced to a deterministic ``LengthSample`` of at most ``max_points`` pairs (requests
    with a length < 1, e.g. failed ones, are left out).

    Raises:
        TraceFormatError: as :func:`read_isl_osl`, or no request with both lengths >= 1 (an empty trace).
        FileNotFoundError: no such file or directory.
    """
    return _sample(read_isl_osl(path), path, max_points)


def _sample(pairs: list[tuple[int, int]], path: Path, max_points: int = DEFAULT_MAX_POINTS) -> LengthSample:
    try:
        return LengthSample.from_pairs(pairs, max_points=max_points)
    except ValueError:
        raise TraceFormatError(f"{path}: no request with input and output length >= 1 ({len(pairs)} line(s)): "
                               "was any traffic recorded?") from None


class TraceWorkload(NamedTuple):
    """A trace reduced to what the tuner sizes for (:func:`load_trace_workload`)."""

    sample: LengthSample  # up to DEFAULT_MAX_POINTS evenly spaced (isl, osl) pairs, tokens
    isl_tokens: int  # the sample's mean ISL, rounded, >= 1: what the spec's workload records
    osl_tokens: int  # the sample's mean OSL, rounded, >= 1
    request_rate_per_s: float | None  # mean arrival rate (read_arrival_rate); None: unusable or not read
    peak_rate_per_s: float | None = None  # busiest 60 s (read_peak_rate); None: shorter or no times
    requests: int = 0  # lines (requests) in the trace, all files
    span_s: float | None = None  # first to last arrival, s; None: no usable times


def load_trace_workload(path: Path, *, read_rate: bool = True) -> TraceWorkload:
    """The workload a trace stands for: its length sample (:func:`load_length_sample`), the sample's mean ISL and
    OSL rounded to whole tokens (at least 1; the tuner sizes with the sample, the spec records these means) and,
    with ``read_rate``, its mean arrival rate (:func:`read_arrival_rate`, requests/s; None when the trace has no
    usable arrival times, which the caller reports with its own way to give a rate); always its busiest
    minute's rate (:func:`read_peak_rate`: the planner ceiling, ``TuneResult.to_deployment_spec``).

    Raises:
        TraceFormatError: as :func:`load_length_sample` (unknown format, missing keys/columns, a bad line, no
            request with both lengths >= 1); the message names ``path``.
        OSError: the file cannot be read (FileNotFoundError, IsADirectoryError, ...).
    """
    pairs = read_isl_osl(path)
    sample = _sample(pairs, path)
    times = _merged_times(path)
    span = times[-1] - times[0] if times and len(times) >= 2 else None
    return TraceWorkload(sample, max(1, round(sample.mean_isl)), max(1, round(sample.mean_osl)),
                         _mean_rate(times) if read_rate else None, _peak_rate(times), len(pairs), span)


class TrafficTraceError(ValueError):
    """A traffic trace named by URI could not be read or holds no usable requests; the message starts with
    ``traffic_trace_uri: <uri>`` and never carries credentials."""


def check_traffic_trace_uri(uri: str, fsx_root: str | None = None) -> str:
    """Return ``uri`` when it names a trace the pipeline's tune step can read: empty (no trace), an
    ``s3://bucket/key`` object URI, or an absolute path (under ``fsx_root`` when given: the only volume the tune
    step mounts), with a name ending in one of READABLE_SUFFIXES; or a FOLDER of such files, written with a
    trailing '/': ``s3://bucket/prefix/`` (every object under it, e.g. what ``pdserve promote --traffic-upload``
    ships: one folder per runtime pod) or ``/fsx/…/``. Reads nothing.

    Raises:
        ValueError: anything else (the message names ``traffic_trace_uri`` and the value): a bad bucket, an
            empty object key or prefix (``split_s3_object_uri``), a relative path, a NUL, an empty, '.' or '..'
            component, a path outside ``fsx_root``, or a file suffix the trace reader does not know.
    """
    import posixpath
    from pathlib import PurePosixPath

    from runtime.staging.s3 import split_s3_object_uri

    if uri == "":
        return uri
    if not isinstance(uri, str):
        raise ValueError(f"traffic_trace_uri {uri!r}: must be a string (s3://bucket/key or an absolute path)")
    if "$" in uri:  # the kubelet expands $(VAR) in container args, and the tune pod's env holds secrets
        raise ValueError(f"traffic_trace_uri {uri!r}: must not contain '$'")
    folder = uri.endswith("/")
    if uri.startswith("s3://"):
        try:
            _, name = split_s3_object_uri(uri.rstrip("/") if folder else uri, "traffic_trace_uri")
        except ValueError as e:  # named with the URI as given, trailing '/' included
            raise ValueError(str(e).replace(repr(uri.rstrip("/")), repr(uri), 1)) from None
        if any(seg in ("", ".", "..") for seg in name.split("/")):
            raise ValueError(f"traffic_trace_uri {uri!r}: empty, '.' or '..' component in the key")
    else:
        if "\0" in uri or not uri.startswith("/"):
            raise ValueError(f"traffic_trace_uri {uri!r}: must be an s3://bucket/key object URI or an absolute path "
                             f"under fsx_root{f' ({fsx_root})' if fsx_root else ''}")
        if ".." in uri.split("/"):
            raise ValueError(f"traffic_trace_uri {uri!r}: must not contain a '..' component")
        if fsx_root:
            root = PurePosixPath(posixpath.abspath(fsx_root))  # a relative root (kfp.local): from the cwd
            if not PurePosixPath(posixpath.normpath(uri)).is_relative_to(root):
                raise ValueError(f"traffic_trace_uri {uri!r}: a path must be under fsx_root {fsx_root!r} (the "
                                 "FSx mount, the only volume the tune step reads)")
        name = uri
    if not folder and not name.lower().endswith(READABLE_SUFFIXES):
        raise ValueError(f"traffic_trace_uri {uri!r}: must name a .jsonl / .json (Mooncake, pdserve --traffic-log) "
                         "or .csv (Azure) trace, or a folder of them ending in '/'; the reader picks the format by "
                         "the suffix")
    return uri


def fetch_trace_workload(uri: str, *, read_rate: bool = True, s3_client=None,  # noqa: ANN001 - boto3 is untyped
                         s3_endpoint_url: str = "") -> TraceWorkload:
    """:func:`load_trace_workload` of a trace named by ``uri`` (:func:`check_traffic_trace_uri`): a local path
    (file or folder) is read in place; an ``s3://bucket/key`` object is downloaded to a temporary file (same
    suffix, removed afterwards), an ``s3://bucket/prefix/`` to a temporary folder (every object under it with a
    trace suffix, keeping the key's sub-folders) with ``s3_client`` (default:
    ``runtime.staging.s3.make_client(s3_endpoint_url or None)``, the staging step's client: credentials from the
    environment only).

    Raises:
        ValueError: ``uri`` is malformed (:func:`check_traffic_trace_uri`).
        TrafficTraceError: the object or file cannot be read (missing, denied, endpoint down) or its contents are
            not a trace (:class:`TraceFormatError`'s reason, naming ``uri`` and the line, not the temporary file).
            The message names the URI and never the credentials (AWS secret env values are masked, URI userinfo
            redacted).
    """
    import os
    import shutil
    import tempfile

    from runtime.redact import redact_userinfo

    check_traffic_trace_uri(uri)

    def fail(detail: str, local: str | None = None) -> TrafficTraceError:
        if local:  # the temporary file or folder is named as the URI it came from (a folder with or without '/')
            detail = detail.replace(local, uri)
            if local.endswith("/"):
                detail = detail.replace(local.rstrip("/"), uri)
        if uri not in detail:
            detail = f"{uri}: {detail}"
        for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            secret = os.environ.get(name)
            if secret and len(secret) >= 8:
                detail = detail.replace(secret, "***")
        return TrafficTraceError(f"traffic_trace_uri: {redact_userinfo(detail)}")

    def load(path: Path, local: str | None = None) -> TraceWorkload:
        try:
            return load_trace_workload(path, read_rate=read_rate)
        except OSError as e:
            raise fail(f"{uri}: cannot read: {e.strerror or e}", local) from None
        except UnicodeDecodeError as e:
            raise fail(f"{uri}: not UTF-8 text ({e.reason} at byte {e.start})", local) from None
        except ValueError as e:  # TraceFormatError
            raise fail(str(e), local) from None

    if not uri.startswith("s3://"):
        return load(Path(uri))
    from runtime.staging.s3 import make_client, split_s3_object_uri

    folder = uri.endswith("/")
    bucket, key = split_s3_object_uri(uri.rstrip("/") if folder else uri, "traffic_trace_uri")
    failure = None
    with tempfile.TemporaryDirectory(prefix="pdserve-trace-") as tmp:
        local = Path(tmp) / ("trace" + Path(key).suffix.lower()) if not folder else Path(tmp) / "trace"
        try:
            client = s3_client if s3_client is not None else make_client(s3_endpoint_url or None,
                                                                           transfer_methods=False)
            if folder:
                n = _download_prefix(client, bucket, key + "/", local)
                if n == 0:
                    failure = ("no .jsonl / .json / .csv object under the prefix: was any traffic recorded "
                               "(pdserve promote --traffic-upload) or has it expired?")
            else:
                body = client.get_object(Bucket=bucket, Key=key)["Body"]
                with local.open("wb") as f:
                    shutil.copyfileobj(body, f, 1 << 20)
        except Exception as e:  # noqa: BLE001 - botocore: NoSuchKey/NoSuchBucket/AccessDenied, endpoint, credentials
            failure = f"cannot read the {'objects' if folder else 'object'} from S3: {type(e).__name__}: {e}"
        if failure is None:
            return load(local, str(local) + "/" if folder else str(local))
    raise fail(failure)  # outside the handler: no __context__ carrying botocore's original


def _download_prefix(client, bucket: str, prefix: str, dest: Path) -> int:  # noqa: ANN001 - boto3 is untyped
    """Download every object under ``prefix`` whose name has a trace suffix to ``dest/<key after prefix>``
    (keys with an empty, '.' or '..' component are skipped: they could leave ``dest``); the number downloaded."""
    import shutil

    n = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            parts = rel.split("/")
            if (not rel.lower().endswith(READABLE_SUFFIXES) or obj.get("Size", 1) == 0
                    or any(p in ("", ".", "..") or p.startswith(".") for p in parts)):
                continue  # as trace_files: hidden and empty files are not part of the trace
            target = dest.joinpath(*parts)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                f = target.open("xb")
            except OSError:  # 'a.jsonl' and 'a.jsonl/b.jsonl' (S3 allows both): the second cannot be a file here
                continue
            with f:
                shutil.copyfileobj(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"], f, 1 << 20)
            n += 1
    return n
