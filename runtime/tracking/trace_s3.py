"""Adapter: the objects of an S3 trace prefix — listed, filtered (with the reasons), streamed into columns, and
left unread when a recency window shows they cannot hold one of its requests (``fetch_trace_workload`` in
``runtime.tracking.traces`` is the entry point)."""

from __future__ import annotations

from typing import NamedTuple

from runtime.tracking.trace_columns import TraceColumns, TraceFormatError
from runtime.tracking.traces import CSV_SUFFIXES, READABLE_SUFFIXES, parse_trace_text, text_lines

LAST_MODIFIED_MARGIN_S = 3600.0  # trace_columns.may_hold_window: pod clock vs S3 clock, and LastModified rounding


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
    from runtime.tracking.trace_columns import may_hold_window

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
