"""Recorded traffic: one JSON line per finished request, the input of scheduled re-tuning (adapter: file I/O).

Each line is a Mooncake-style trace record (FAST'25 trace format, github.com/kvcache-ai/Mooncake):
``{"timestamp": <Unix epoch ms>, "input_length": <prompt tokens>, "output_length": <completion tokens>,
"hash_ids": []}``; ``pdserve tune --trace`` (runtime.tracking.traces) and the re-tuning CronWorkflow
(runtime.batch.workflows) read it. The lengths come from the workers' ``usage``; nothing the client sent
(no prompt text, no model or user field) is written. ``hash_ids`` is empty: the runtime does not record
which prefixes a request shared (a replay that needs prefix reuse must take it from elsewhere). Timestamps are
absolute (epoch ms), so files of several runtimes or restarts can be concatenated; a replay subtracts the first.

A write that fails (disk full, file removed) is logged once and the request is unaffected.

``TrafficShipper`` copies what the log gained to S3 every few minutes (``--traffic-upload``), so the traffic of
a runtime pod outlives the pod and reaches the re-tuning CronWorkflow: each shipment is one object holding whole
lines, ``<prefix><source>/<segment>-<first byte offset>-<end offset>.jsonl`` (all zero-padded to 15 digits, so
name order is file order; ``segment`` is the Unix ms at which the shipper started the current file). A shipment
is an idempotent PUT of a byte range: a retry after a failure writes the same key again. The segment and the
offset shipped so far are kept beside the log (``<log>.shipped``), so a restarted runtime that appends to the
same file ships only what is new. Once everything written is shipped and the log has grown past
``compact_bytes``, the shipper empties it and starts a new segment, so a long-running pod's log stays small (its
emptyDir has a size limit). ``pdserve tune --trace`` on the folder an Argo artifact makes of ``<prefix>`` reads
every pod's objects as one trace.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class TrafficLog:
    """Append one trace line per finished request to ``path`` (parent folders created; an existing file is
    appended to, never truncated).

    Args:
        path: the JSONL file.
        wall_clock: seconds since the Unix epoch (injected for tests).

    Raises:
        OSError: the file cannot be opened for appending (at construction, so a bad path fails start-up).
    """

    def __init__(self, path: Path, wall_clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        self._clock = wall_clock
        self._lock = threading.Lock()
        self._warned = False
        self.lines = 0

    def record(self, input_tokens: int, output_tokens: int) -> None:
        """Write one finished request (token counts; negative values are written as 0)."""
        line = json.dumps({"timestamp": int(self._clock() * 1000), "input_length": max(0, int(input_tokens)),
                           "output_length": max(0, int(output_tokens)), "hash_ids": []}, separators=(",", ":"))
        with self._lock:
            try:
                self._f.write(line + "\n")
                self._f.flush()
                self.lines += 1
            except (OSError, ValueError) as e:  # ValueError: the file was closed
                if not self._warned:
                    self._warned = True
                    log.warning("traffic log %s: cannot write (%s); requests are served but not recorded",
                                self.path, e)

    def truncate_if_size(self, size: int) -> bool:
        """Empty the file if it holds exactly ``size`` bytes (all of them shipped, nothing written since);
        returns whether it did. Holding the writers' lock, so no line is lost or cut."""
        with self._lock:
            try:
                self._f.flush()
                if self.path.stat().st_size != size:
                    return False
                self._f.truncate(0)  # append mode: the next write lands at the new end, 0
                return True
            except (OSError, ValueError):
                return False

    def close(self) -> None:
        with self._lock:
            self._f.close()


SHIP_OFFSET_DIGITS = 15  # zero-padded numbers in object names: name order = file order (offsets up to ~1 PB)
MAX_SHIPMENT_BYTES = 64 * 2**20  # one PUT; a larger backlog goes out as several objects in one round
DEFAULT_SHIP_INTERVAL_S = 300.0
DEFAULT_COMPACT_BYTES = 16 * 2**20  # ~160 k requests: empty the shipped log past this (emptyDir limit 1 GiB)
_SOURCE_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def traffic_source_name(name: str | None = None) -> str:
    """The per-runtime folder name under the upload prefix: ``name``, else $HOSTNAME (a pod's name in
    Kubernetes), else the host name; characters outside ``[A-Za-z0-9._-]`` become '-'.

    Raises:
        ValueError: the result is empty, '.' or '..'.
    """
    raw = name or os.environ.get("HOSTNAME") or socket.gethostname()
    safe = _SOURCE_SAFE.sub("-", raw.strip())[:128]
    if safe in ("", ".", ".."):
        raise ValueError(f"traffic source name {raw!r}: no usable characters")
    return safe


def check_upload_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix/`` → (bucket, prefix ending in '/' or "").

    Raises:
        ValueError: not s3://, a bucket S3 would refuse, or a prefix not ending in '/' (it names a folder).
    """
    from runtime.staging.s3 import S3_BUCKET_NAME

    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ValueError(f"--traffic-upload {uri!r}: must be an s3://bucket/prefix/ URI")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not S3_BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ValueError(f"--traffic-upload {uri!r}: bucket {bucket!r} is not a valid S3 bucket name")
    if prefix and not prefix.endswith("/"):
        raise ValueError(f"--traffic-upload {uri!r}: the prefix must end in '/' (each runtime writes a folder "
                         "of objects under it)")
    if "//" in prefix or prefix.startswith("/") or ".." in prefix.split("/"):
        raise ValueError(f"--traffic-upload {uri!r}: empty or '..' path segment in the prefix")
    return bucket, prefix


class TrafficShipper:
    """Ship the whole lines a traffic log gained since the last shipment to S3 (see the module docstring).

    Args:
        log_path: the runtime's traffic log (TrafficLog's file).
        upload_uri: ``s3://bucket/prefix/``; objects go to ``<prefix><source>/``.
        client: a boto3 S3 client (None: ``runtime.staging.s3.make_client()``: the default credential chain,
            $AWS_ENDPOINT_URL_S3 for a non-AWS endpoint).
        source: folder name of this runtime (``traffic_source_name``).
        traffic_log: the TrafficLog writing ``log_path`` in this process; with it the shipped log is emptied
            past ``compact_bytes`` (without it the file only grows).
        compact_bytes: see ``traffic_log``.
        wall_clock: seconds since the Unix epoch (segment names; injected for tests).

    Raises:
        ValueError: a bad ``upload_uri`` or ``source``.
    """

    def __init__(self, log_path: Path, upload_uri: str, *, client: Any = None, source: str | None = None,
                 traffic_log: TrafficLog | None = None, compact_bytes: int = DEFAULT_COMPACT_BYTES,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.bucket, self.prefix = check_upload_uri(upload_uri)
        self.source = traffic_source_name(source)
        self.log_path = Path(log_path)
        self.traffic_log = traffic_log
        self.compact_bytes = compact_bytes
        self._clock = wall_clock
        self.state_path = self.log_path.with_name(self.log_path.name + ".shipped")
        if client is None:
            from runtime.staging.s3 import make_client

            client = make_client(max_pool_connections=2, max_attempts=3)
        self._client = client
        self.segment, self.shipped = self._read_state()
        self.objects = 0
        self._failing = False
        self._state_warned = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def key(self, start: int, end: int) -> str:
        """Object key of the bytes ``[start, end)`` of the log's current segment."""
        d = SHIP_OFFSET_DIGITS
        return f"{self.prefix}{self.source}/{self.segment:0{d}d}-{start:0{d}d}-{end:0{d}d}.jsonl"

    def _new_segment(self) -> int:
        return max(int(self._clock() * 1000), getattr(self, "segment", 0) + 1)  # strictly increasing

    def _read_state(self) -> tuple[int, int]:
        """(segment, shipped offset) from the state file; a new segment at offset 0 without a usable one."""
        try:
            segment, offset = (int(x) for x in self.state_path.read_text().split())
            if segment > 0 and offset >= 0:
                return segment, offset
        except (OSError, ValueError):
            pass
        return self._new_segment(), 0

    def _save_state(self) -> None:
        """Persist segment and shipped offset (atomically); a failure only means a restart may ship a range again."""
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        try:
            tmp.write_text(f"{self.segment} {self.shipped}\n")
            os.replace(tmp, self.state_path)
        except OSError as e:
            if not self._state_warned:
                self._state_warned = True
                log.warning("traffic upload: cannot record the shipped offset in %s (%s); after a restart the "
                            "log would be shipped again from its start", self.state_path, e)

    def ship(self) -> int:
        """Ship every whole line written since the last shipment; returns the bytes shipped (0 when there was
        nothing new, or when S3 refused: that is logged once per failing streak and retried next time, the
        offset unchanged). A log shorter than the shipped offset (replaced or truncated by someone else) is
        shipped again from its start."""
        with self._lock:
            try:
                size = self.log_path.stat().st_size
            except OSError:
                return 0
            if size < self.shipped:
                log.warning("traffic log %s is shorter (%d bytes) than what was shipped (%d): shipping it from the "
                            "start as a new segment", self.log_path, size, self.shipped)
                self.segment, self.shipped = self._new_segment(), 0
            sent = 0
            try:
                with self.log_path.open("rb") as f:
                    while self.shipped < size:
                        f.seek(self.shipped)
                        chunk = f.read(min(size - self.shipped, MAX_SHIPMENT_BYTES))
                        cut = chunk.rfind(b"\n") + 1  # whole lines only: the writer may be mid-line
                        if cut == 0:
                            break
                        start, end = self.shipped, self.shipped + cut
                        self._client.put_object(Bucket=self.bucket, Key=self.key(start, end), Body=chunk[:cut],
                                                ContentType="application/x-ndjson")
                        self.shipped = end
                        self.objects += 1
                        self._save_state()
                        sent += cut
            except Exception as e:  # noqa: BLE001 - botocore/OS errors alike: serving goes on, retry later
                if not self._failing:
                    self._failing = True
                    log.warning("traffic upload to s3://%s/%s%s/ failed (%s: %s); retrying every interval, the "
                                "log keeps everything", self.bucket, self.prefix, self.source, type(e).__name__, e)
                return sent
            if self._failing:
                self._failing = False
                log.info("traffic upload to s3://%s/%s%s/ works again", self.bucket, self.prefix, self.source)
            if (self.traffic_log is not None and self.shipped >= self.compact_bytes
                    and self.traffic_log.truncate_if_size(self.shipped)):
                self.segment, self.shipped = self._new_segment(), 0
                self._save_state()
            return sent

    def start(self, interval_s: float = DEFAULT_SHIP_INTERVAL_S) -> None:
        """Ship every ``interval_s`` seconds in a daemon thread until :meth:`close`.

        Raises:
            ValueError: ``interval_s`` <= 0.
        """
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.ship()

        self._thread = threading.Thread(target=loop, name="traffic-shipper", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 20.0) -> None:
        """Stop the thread and ship what is left (once; a failure is logged, the log keeps it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.ship()
