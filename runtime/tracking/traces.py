"""Adapter: the one reader of traces, from files and S3, for the tuner's workload sample. The formats and the
reduction to a workload are pure and live in ``runtime.traces.formats``.

A trace may also be a DIRECTORY of such files, all of one format (``trace_files``): the traffic logs of several
runtime replicas (one file per pod), or an S3 prefix an Argo input artifact downloaded. Its files are read
in name order as one trace; their arrival times are merged.

The format follows the file name's suffix (``READABLE_SUFFIXES``). :func:`load_trace_workload` is the one
reduction of a trace to the tuner's workload, shared by ``pdserve tune --trace`` and the pipeline's tune step
(:func:`fetch_trace_workload`, which also streams an S3 object or prefix). Each file is read ONCE into compact
columns (lengths and arrival times together, ``runtime.traces.formats``); a recency window (``window_s``)
keeps the requests of the trace's last hours, and on an S3 prefix leaves unread the objects that cannot hold one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, NamedTuple

from runtime.traces.formats import (CSV_SUFFIXES, PEAK_WINDOW_S, READABLE_SUFFIXES, TraceColumns, TraceFormatError,
                                    TraceWorkload, mean_rate, merged_times, parse_trace_text, peak_rate,
                                    may_hold_window, reduce_trace, skipped_note, text_lines)
from runtime.tuner.workload import DEFAULT_MAX_POINTS, LengthSample


def trace_files(path: Path) -> list[Path]:
    """The files a trace consists of: ``[path]`` for a file; for a directory, every ``.jsonl`` / ``.json`` /
    ``.csv`` file below it (recursively; hidden files and folders, empty files and second links to a file
    already taken skipped), sorted by relative path.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceFormatError: a directory without trace files, or one mixing CSV and JSON-lines files (their
            timestamps differ in kind: Azure date-times vs milliseconds).
    """
    return _trace_listing(Path(path))[0]


def _trace_listing(path: Path) -> tuple[list[Path], tuple[str, ...]]:
    """``trace_files`` and the files under a directory it leaves out for not being trace files (name and
    reason; hidden files, empty files and second links are left out silently: they hold nothing of the trace)."""
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such trace file or directory")
        return [path], ()
    files, seen, skipped = [], set(), []
    for f in sorted(path.rglob("*"), key=lambda f: f.relative_to(path).as_posix()):
        rel = f.relative_to(path)
        if not f.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        if f.suffix.lower() not in READABLE_SUFFIXES:
            skipped.append(f"{rel.as_posix()} (not .jsonl, .json or .csv)")
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
    return files, tuple(skipped)


def _file_chunks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(size):
            yield chunk


def read_columns(path: Path) -> TraceColumns:
    """One trace file read ONCE into its columns (lengths and arrival times; ``runtime.traces.formats``).

    Raises:
        TraceFormatError: unknown format, missing columns/keys, a malformed line (``path:line`` and the key),
            not UTF-8.
        OSError: the file cannot be read.
    """
    path = Path(path)
    if not path.name.lower().endswith(READABLE_SUFFIXES):  # before opening: the message names the format
        raise TraceFormatError(f"{path}: unknown trace format (expected .csv or .jsonl)")
    return parse_trace_text(text_lines(_file_chunks(path), str(path)), str(path), path.name)


def read_trace(path: Path) -> tuple[list[TraceColumns], tuple[str, ...]]:
    """Every file of a trace (a file, or a directory: :func:`trace_files`) read once into its columns, in
    ``trace_files`` order, and the directory's files left out for not being trace files (name and reason).

    Raises:
        FileNotFoundError: no such file or directory.
        TraceFormatError: as :func:`read_isl_osl`.
    """
    files, skipped = _trace_listing(Path(path))
    return [read_columns(f) for f in files], skipped


def read_isl_osl(path: Path) -> list[tuple[int, int]]:
    """All (isl, osl) pairs of the trace, in file order (a directory: its ``trace_files`` one after another).

    Raises:
        TraceFormatError: unknown format, missing columns/keys, a line that is not a JSON object, a length
            that is not a whole number or a CSV TIMESTAMP that is not a date-time (the message names
            ``path:line`` and the key); a file that is not UTF-8; a directory without trace files or mixing
            formats.
        FileNotFoundError: no such file or directory.
    """
    return [p for c in read_trace(path)[0] for p in zip(c.isl_tokens, c.osl_tokens)]


def read_arrival_rate(path: Path) -> float | None:
    """Mean arrival rate of the trace, requests/s: ``(n - 1) / (last - first arrival)``, or None when it has no
    usable times (fewer than two, equal, or missing on any line, or outside [0, TIME_MAX_S]).

    Times: JSONL ``timestamp`` in milliseconds (Mooncake: from the trace's start; the runtime's traffic log:
    Unix ms, so the logs of several runtime replicas, concatenated or as one directory, give the total rate);
    CSV ``TIMESTAMP`` as an ISO date-time (Azure LLM inference trace: ``2023-11-16 18:15:46.6805900``, read as
    UTC: ``runtime.traces.formats.parse_csv_timestamp``); BurstGPT's CSV ``Timestamp`` in seconds from its start.
    Lines may be in any order. The mean is what the tuner sizes
    replica counts for; bursts above it are the planner's to absorb at run time.

    Raises:
        FileNotFoundError: no such file or directory.
        TraceFormatError: as :func:`read_isl_osl` (the file is read once, lengths and times together), or
            files timed from their own start (Mooncake) mixed with files in Unix time (traffic logs).
    """
    return mean_rate(merged_times(read_trace(path)[0], str(path)))


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
    return peak_rate(merged_times(read_trace(path)[0], str(path)), window_s)


def load_length_sample(path: Path, max_points: int = DEFAULT_MAX_POINTS) -> LengthSample:
    """The trace's deterministic ``LengthSample`` of at most ``max_points`` evenly spaced pairs (requests with a
    length < 1, e.g. failed ones, are left out).

    Raises:
        TraceFormatError: as :func:`read_isl_osl`, or no request with both lengths >= 1 (an empty trace).
        FileNotFoundError: no such file or directory.
    """
    files, _ = read_trace(path)
    return reduce_trace(files, str(path), read_rate=False, max_points=max_points).sample


def load_trace_workload(path: Path, *, read_rate: bool = True, window_s: float | None = None) -> TraceWorkload:
    """The workload a trace stands for, every file read once (``runtime.traces.formats.reduce_trace``): its length sample
    (up to 256 evenly spaced requests), the sample's mean ISL and OSL rounded to whole tokens (at least 1; the
    tuner sizes with the sample, the spec records these means) and, with ``read_rate``, its mean arrival rate
    (requests/s; None when the trace has no usable arrival times, which the caller reports with its own way to
    give a rate); always its busiest minute's rate (the planner ceiling, ``TuneResult.to_deployment_spec``).
    With ``window_s`` (seconds, > 0) only the requests that arrived in the last ``window_s`` before the newest
    one count. ``skipped`` lists a directory's files that are not trace files (name and reason).

    Raises:
        ValueError: ``window_s`` not a finite number > 0.
        TraceFormatError: as :func:`read_isl_osl`, or no request with both lengths >= 1 (in the window), or a
            window over a trace without usable arrival times; the message names ``path``.
        OSError: the file cannot be read (FileNotFoundError, IsADirectoryError, ...).
    """
    files, skipped = read_trace(path)
    return reduce_trace(files, str(path), read_rate=read_rate, window_s=window_s, skipped=skipped)


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
        ValueError: anything else (the message names ``traffic_trace_uri`` and the value): an s3:// URI with a
            query string or fragment, a bad bucket, an empty object key or prefix, an empty, '.' or '..' segment
            (runtime.s3uri.split_s3_trace_uri); a path that is relative, holds a NUL, a '$' or a '..' component or
            lies outside ``fsx_root``; or a file suffix the trace reader does not know.
    """
    import posixpath
    from pathlib import PurePosixPath

    from runtime.s3uri import split_s3_trace_uri

    if uri == "":
        return uri
    if not isinstance(uri, str):
        raise ValueError(f"traffic_trace_uri {uri!r}: must be a string (s3://bucket/key or an absolute path)")
    if uri.startswith("s3://"):
        split_s3_trace_uri(uri, "traffic_trace_uri")
        return uri
    if "$" in uri:  # the kubelet expands $(VAR) in container args, and the tune pod's env holds secrets
        raise ValueError(f"traffic_trace_uri {uri!r}: must not contain '$'")
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
    if not uri.endswith("/") and not uri.lower().endswith(READABLE_SUFFIXES):
        raise ValueError(f"traffic_trace_uri {uri!r}: must name a .jsonl / .json (Mooncake, pdserve --traffic-log) "
                         "or .csv (Azure, BurstGPT) trace, or a folder of them ending in '/'; the reader picks the "
                         "format by the suffix")
    return uri


def fetch_trace_workload(uri: str, *, read_rate: bool = True, s3_client=None,  # noqa: ANN001 - boto3 is untyped
                         s3_endpoint_url: str = "", window_s: float | None = None) -> TraceWorkload:
    """:func:`load_trace_workload` of a trace named by ``uri`` (:func:`check_traffic_trace_uri`): a local path
    (file or folder) is read in place; an ``s3://bucket/key`` object, or every object under an
    ``s3://bucket/prefix/`` with a trace suffix (one trace, in key order), is streamed from S3 and read once,
    with ``s3_client`` (default: ``runtime.staging.s3.make_client(s3_endpoint_url or None)``, the staging
    step's client: credentials from the environment only). Nothing is written to disk.

    With ``window_s`` (seconds, > 0) only requests that arrived in the last ``window_s`` before the newest one
    count, and a prefix of JSON-lines objects is read newest LastModified first, leaving unread the objects
    last modified before ``newest arrival read so far - window_s - LAST_MODIFIED_MARGIN_S`` (1 h): they
    cannot hold a request inside the window (``runtime.traces.formats.may_hold_window`` says why). The count is the
    result's ``objects_not_read``. Should an object hold an arrival later than its own LastModified plus the
    margin (not a traffic log of this runtime, or a clock far off), no object is left unread. CSV prefixes are
    read whole (Azure date-times carry no zone, so they cannot be compared with LastModified).

    Objects under a prefix that are not read as trace (a name with an empty, '.' or '..' segment, a hidden
    name, a suffix other than .jsonl / .json / .csv, a key under another trace object) are listed in the
    result's ``skipped`` for the caller to warn about (``skipped_note``: their count and the first names);
    empty objects (folder markers, empty shipments) hold nothing and are passed over silently.

    Raises:
        ValueError: ``uri`` is malformed (:func:`check_traffic_trace_uri`), ``window_s`` not finite and > 0.
        TrafficTraceError: the object or file cannot be read (missing, denied, endpoint down) or its contents are
            not a trace (:class:`TraceFormatError`'s reason, naming the object's URI and the line). The message
            names the URI and never the credentials (AWS secret env values are masked, URI userinfo redacted).
    """
    import math
    import os

    from runtime.redact import redact_userinfo

    check_traffic_trace_uri(uri)
    if window_s is not None and not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"trace window must be a finite number of seconds > 0, got {window_s!r}")

    def fail(detail: str) -> TrafficTraceError:
        if uri not in detail:
            detail = f"{uri}: {detail}"
        for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            secret = os.environ.get(name)
            if secret and len(secret) >= 8:
                detail = detail.replace(secret, "***")
        return TrafficTraceError(f"traffic_trace_uri: {redact_userinfo(detail)}")

    if not uri.startswith("s3://"):
        try:
            return load_trace_workload(Path(uri), read_rate=read_rate, window_s=window_s)
        except OSError as e:
            raise fail(f"{uri}: cannot read: {e.strerror or e}") from None
        except ValueError as e:  # TraceFormatError
            raise fail(str(e)) from None
    from runtime.s3uri import split_s3_trace_uri
    from runtime.staging.s3 import make_client

    bucket, key, folder = split_s3_trace_uri(uri, "traffic_trace_uri")
    failure, columns, skipped, not_read = None, [], (), 0
    try:
        client = s3_client if s3_client is not None else make_client(s3_endpoint_url or None,
                                                                       transfer_methods=False)
        if folder:
            objects, skipped = list_trace_objects(client, bucket, key + "/")
            if not objects:
                failure = ("no .jsonl / .json / .csv object under the prefix: was any traffic recorded "
                           "(pdserve promote --traffic-upload) or has it expired?"
                           + (f" ({skipped_note(skipped, uri)})" if skipped else ""))
            else:
                columns, not_read = read_prefix(client, bucket, objects, window_s)
        else:
            columns = [read_object(client, bucket, key)]
    except TraceFormatError as e:
        failure = str(e)
    except Exception as e:  # noqa: BLE001 - botocore: NoSuchKey/NoSuchBucket/AccessDenied, endpoint, credentials
        failure = f"cannot read the {'objects' if folder else 'object'} from S3: {type(e).__name__}: {e}"
    if failure is not None:
        raise fail(failure)  # outside the handler: no __context__ carrying botocore's original
    try:
        return reduce_trace(columns, uri, read_rate=read_rate, window_s=window_s, skipped=skipped,
                            objects_not_read=not_read)
    except TraceFormatError as e:
        failure = str(e)
    raise fail(failure)


# ---------------------------------------------------------------------------------------- an S3 prefix

LAST_MODIFIED_MARGIN_S = 3600.0  # runtime.traces.formats.may_hold_window: pod clock vs S3 clock, and LastModified rounding


class S3TraceObject(NamedTuple):
    """One object under a trace prefix, as listed."""

    key: str
    rel: str  # the key after the prefix
    size_bytes: int
    last_modified_s: float  # S3 LastModified, Unix s


def list_trace_objects(client, bucket: str, prefix: str  # noqa: ANN001 - boto3 is untyped
                       ) -> tuple[list[S3TraceObject], tuple[str, ...]]:
    """The trace objects under ``prefix`` in key order, and the keys left out with the reason (relative to the
    prefix): an empty, '.' or '..' segment or a hidden ('.') segment (as ``trace_files``), a suffix that is not
    .jsonl / .json / .csv, or a key under another trace object (``a.jsonl/b.jsonl`` beside ``a.jsonl``: a
    folder of the objects, what an Argo artifact makes of the prefix, cannot hold both). Empty objects are
    left out silently. Lists only (no object is read).

    Raises:
        TraceFormatError: the trace objects mix .csv and .jsonl (their times differ in kind).
        Exception: botocore's, when listing fails.
    """
    listed = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            listed.append(S3TraceObject(obj["Key"], obj["Key"][len(prefix):], int(obj.get("Size", 1)),
                                        obj["LastModified"].timestamp()))
    listed.sort(key=lambda o: o.rel)
    objects, skipped, taken = [], [], set()
    for o in listed:
        parts = o.rel.split("/")
        if o.size_bytes == 0:
            continue  # a "folder" marker (key ending in '/') or an empty shipment: nothing to read
        if any(p in ("", ".", "..") for p in parts):
            skipped.append(f"{o.rel} (empty, '.' or '..' path segment)")
        elif any(p.startswith(".") for p in parts):
            skipped.append(f"{o.rel} (hidden name)")
        elif not o.rel.lower().endswith(READABLE_SUFFIXES):
            skipped.append(f"{o.rel} (not .jsonl, .json or .csv)")
        elif above := next((a for a in ("/".join(parts[:k]) for k in range(1, len(parts))) if a in taken), None):
            skipped.append(f"{o.rel} (under the object {above})")
        else:
            objects.append(o)
            taken.add(o.rel)
    if len({o.rel.lower().endswith(CSV_SUFFIXES) for o in objects}) > 1:
        raise TraceFormatError(f"s3://{bucket}/{prefix}: mixes .csv and .jsonl trace objects; a prefix must hold "
                               "one format")
    return objects, tuple(skipped)


def read_object(client, bucket: str, key: str) -> TraceColumns:  # noqa: ANN001 - boto3 is untyped
    """One object streamed into its columns (1 MiB at a time, read once)."""
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    name = f"s3://{bucket}/{key}"
    try:
        return parse_trace_text(text_lines(body.iter_chunks(1 << 20), name), name, key)
    finally:
        body.close()


def read_prefix(client, bucket: str, objects: list[S3TraceObject],  # noqa: ANN001 - boto3 is untyped
                window_s: float | None, margin_s: float | None = None) -> tuple[list[TraceColumns], int]:
    """The columns of ``objects`` (in their order) and how many a window left unread (``fetch_trace_workload``;
    ``margin_s`` None: LAST_MODIFIED_MARGIN_S)."""
    margin_s = LAST_MODIFIED_MARGIN_S if margin_s is None else margin_s  # read now: tests may change it

    skipping = window_s is not None and not any(o.rel.lower().endswith(CSV_SUFFIXES) for o in objects)
    order = sorted(objects, key=lambda o: (-o.last_modified_s, o.rel)) if skipping else objects
    read: dict[str, TraceColumns] = {}
    newest_seen, not_read = None, 0
    for o in order:
        if skipping and newest_seen is not None and not may_hold_window(o.last_modified_s, newest_seen, window_s,
                                                                        margin_s):
            not_read += 1  # newest first: every later object is older still
            continue
        c = read[o.rel] = read_object(client, bucket, o.key)
        if skipping and c.unix_time():  # times from a trace's own start cannot be compared with LastModified
            newest = c.newest_s()
            if newest > o.last_modified_s + margin_s:
                skipping = False  # not written before its upload (or clocks far apart): read everything
            newest_seen = newest if newest_seen is None else max(newest_seen, newest)
    return [read[o.rel] for o in objects if o.rel in read], not_read
