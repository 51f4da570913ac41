"""Recorded traffic: one JSON line per finished request, the input of scheduled re-tuning (adapter: file I/O).

Each line is a Mooncake-style trace record (FAST'25 trace format, github.com/kvcache-ai/Mooncake):
``{"timestamp": <Unix epoch ms of the request's ARRIVAL>, "input_length": <prompt tokens>, "output_length":
<completion tokens>, "hash_ids": []}``, written when the request finishes; ``pdserve tune --trace``
(runtime.tracking.traces) and the re-tuning CronWorkflow (runtime.batch.workflows) read it. The lengths come from
the workers' ``usage``; nothing the client sent (no prompt text, no model or user field) is written.
``hash_ids`` is empty: the runtime does not record which prefixes a request shared (a replay that needs prefix
reuse must take it from elsewhere). Timestamps are absolute (epoch ms), so files of several runtimes or restarts
can be concatenated; a replay subtracts the first. Lines are in finishing order, so timestamps are not sorted.

A write that fails (disk full, file removed) is logged once and the request is unaffected.

``TrafficShipper`` copies what the log gained to S3 every few minutes (``--traffic-upload``), so the traffic of
a runtime pod outlives the pod and reaches the re-tuning CronWorkflow: each shipment is one object holding whole
lines, ``<prefix><source>/<segment>-<first byte offset>-<end offset>.jsonl`` (zero-padded, so name order is file
order; ``segment`` names one generation of the log file: the Unix ms at which it started, times 1000, plus a
random 0-999). Every byte is shipped once: the range of a shipment is written to the state file beside the log
(``<log>.shipped``, JSON) BEFORE its PUT, and a failed or interrupted shipment is retried with exactly that range
(the same key) before anything new; a restarted runtime appending to the same file goes on from the recorded
offset. The state also holds a digest of the segment's first line: a log that was replaced, truncated or emptied
behind the shipper's back no longer matches and is shipped from its start as a new segment (never from a stale
offset, which would cut a line). Once everything written is shipped and the log has grown past
``compact_bytes``, the shipper empties it and starts a new segment, so a long-running pod's log stays small (its
emptyDir has a size limit). ``pdserve tune --trace`` on the folder an Argo artifact makes of ``<prefix>`` reads
every pod's objects as one trace.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.s3uri import check_upload_uri

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

    def record(self, input_tokens: int, output_tokens: int, ago_s: float = 0.0) -> None:
        """Write one finished request (token counts; negative values are written as 0) that ARRIVED ``ago_s``
        seconds ago (its latency; the timestamp is the arrival, what a trace's rate and peak are read from)."""
        t = self._clock() - max(0.0, float(ago_s)) if math.isfinite(ago_s) else self._clock()
        line = json.dumps({"timestamp": int(t * 1000), "input_length": max(0, int(input_tokens)),
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

    def reopen_if_replaced(self) -> bool:
        """Reopen ``path`` when the open file is no longer the one at that path (deleted or replaced: lines
        would go to an inode nobody reads); returns whether it did, with a warning."""
        with self._lock:
            try:
                if self._f.closed:
                    return False
                try:
                    same = os.stat(self.path).st_ino == os.fstat(self._f.fileno()).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    return False
                self._f.close()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._f = self.path.open("a", encoding="utf-8")
            except (OSError, ValueError) as e:
                log.warning("traffic log %s: cannot reopen (%s)", self.path, e)
                return False
        log.warning("traffic log %s was removed or replaced; reopened it (lines written in between are lost)",
                    self.path)
        return True

    def truncate_if_size(self, size: int) -> bool:
        """Empty the file if it holds exactly ``size`` bytes (all of them shipped, nothing written since);
        returns whether it did. Holding the writers' lock, so no line is lost or cut."""
        with self._lock:
            try:
                self._f.flush()
                if os.fstat(self._f.fileno()).st_size != size:
                    return False
                self._f.truncate(0)  # append mode: the next write lands at the new end, 0
                return True
            except (OSError, ValueError):
                return False

    def close(self) -> None:
        with self._lock:
            self._f.close()


SEGMENT_DIGITS = 18  # Unix ms x 1000 + a random 0-999: ~1.8e15 today, zero-padded so name order = time order
SHIP_OFFSET_DIGITS = 15  # zero-padded byte offsets in object names: name order = file order (up to ~1 PB)
MAX_SHIPMENT_BYTES = 64 * 2**20  # one PUT; a larger backlog goes out as several objects in one round
DEFAULT_SHIP_INTERVAL_S = 300.0
MAX_SHIP_INTERVAL_S = 86400.0  # a day; beyond threading's wait limits long before, and no one re-tunes on less
DEFAULT_COMPACT_BYTES = 16 * 2**20  # ~160 k requests: empty the shipped log past this (emptyDir limit 1 GiB)
HEAD_BYTES = 4096  # the segment's identity: digest of its first line (at most this many bytes)
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


def check_ship_interval(interval_s: float) -> float:
    """``interval_s`` when it is a finite number of seconds in (0, MAX_SHIP_INTERVAL_S].

    Raises:
        ValueError: anything else (named).
    """
    if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s)
            and 0 < interval_s <= MAX_SHIP_INTERVAL_S):
        raise ValueError(f"traffic upload interval must be in (0, {MAX_SHIP_INTERVAL_S:.0f}] s, got {interval_s!r}")
    return float(interval_s)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


class TrafficShipper:
    """Ship the whole lines a traffic log gained since the last shipment to S3 (see the module docstring).

    Args:
        log_path: the runtime's traffic log (TrafficLog's file).
        upload_uri: ``s3://bucket/prefix/``; objects go to ``<prefix><source>/``.
        client: a boto3 S3 client (None: ``runtime.staging.s3.make_client`` with short timeouts, so a final
            shipment at shutdown fits a pod's grace period: the default credential chain, $AWS_ENDPOINT_URL_S3
            for a non-AWS endpoint).
        source: folder name of this runtime (``traffic_source_name``).
        traffic_log: the TrafficLog writing ``log_path`` in this process; with it the shipped log is emptied
            past ``compact_bytes`` and reopened when someone removed it (without it the file only grows).
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

            client = make_client(max_pool_connections=2, max_attempts=2, connect_timeout_s=3.0, read_timeout_s=10.0)
        self._client = client
        self.segment, self.shipped, self.head, self.pending = self._read_state()
        self.objects = 0
        self._failing = False
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- state ------------------------------------------------------------------------------------------
    def key(self, start: int, end: int) -> str:
        """Object key of the bytes ``[start, end)`` of the log's current segment."""
        d = SHIP_OFFSET_DIGITS
        return f"{self.prefix}{self.source}/{self.segment:0{SEGMENT_DIGITS}d}-{start:0{d}d}-{end:0{d}d}.jsonl"

    def _new_segment(self) -> int:
        seg = int(self._clock() * 1000) * 1000 + random.randrange(1000)  # noqa: S311 - a name, not a secret
        return max(seg, getattr(self, "segment", 0) + 1)  # strictly increasing, also if the clock stepped back

    def _start_segment(self) -> None:
        self.segment, self.shipped, self.head, self.pending = self._new_segment(), 0, None, None

    def _read_state(self) -> tuple[int, int, str | None, tuple[int, int] | None]:
        """(segment, shipped offset, head digest, pending range) from the state file; a new segment at offset
        0 without a usable one (a lost state only risks shipping the log again, never skipping it)."""
        try:
            st = json.loads(self.state_path.read_text())
            segment, shipped = int(st["segment"]), int(st["shipped"])
            head = st.get("head")
            pending = st.get("pending")
            pending = None if pending is None else (int(pending[0]), int(pending[1]))
            if segment > 0 and shipped >= 0 and (head is None or isinstance(head, str)) and (
                    pending is None or 0 <= pending[0] < pending[1]):
                return segment, shipped, head, pending
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            pass
        return self._new_segment(), 0, None, None

    def _save_state(self) -> bool:
        """Persist the state atomically; False (warned once) when it cannot be written."""
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        st = {"segment": self.segment, "shipped": self.shipped, "head": self.head,
              "pending": None if self.pending is None else list(self.pending)}
        try:
            tmp.write_text(json.dumps(st) + "\n")
            os.replace(tmp, self.state_path)
            return True
        except OSError as e:
            self._warn_once("state", "traffic upload: cannot record the shipping state in %s (%s); after a restart "
                            "the log may be shipped again", self.state_path, e)
            return False

    def _warn_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    def _same_file(self, f: Any, size: int) -> bool:
        """Whether the open log is still the file the state describes: at least ``shipped`` bytes, whose first
        line has the recorded digest (no digest yet: nothing shipped, nothing to compare)."""
        if size < self.shipped or (self.pending is not None and size < self.pending[1]):
            return False
        if self.head is None or (self.shipped == 0 and self.pending is None):
            return True
        f.seek(0)
        first = f.read(HEAD_BYTES)
        return _digest(first[:first.find(b"\n") + 1] if b"\n" in first else first) == self.head

    # ---- shipping -----------------------------------------------------------------------------------------
    def ship(self) -> int:
        """Ship every whole line written since the last shipment (a pending, failed range first, unchanged);
        returns the bytes shipped. S3 failures are logged once per failing streak and retried next time; a log
        replaced behind the shipper's back is shipped from its start as a new segment (warned)."""
        with self._lock:
            if self.traffic_log is not None:
                self.traffic_log.reopen_if_replaced()
            sent = 0
            try:
                with self.log_path.open("rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if not self._same_file(f, size):
                        log.warning("traffic log %s is not the file shipped so far (replaced, truncated or "
                                    "emptied): shipping it from its start as a new segment", self.log_path)
                        self._start_segment()
                    while True:
                        if self.pending is None:
                            rng = self._next_range(f, size)
                            if rng is None:
                                break
                            self.pending = rng
                            self._save_state()  # before the PUT: a retry re-sends exactly this range
                        start, end = self.pending
                        f.seek(start)
                        body = f.read(end - start)
                        try:
                            self._client.put_object(Bucket=self.bucket, Key=self.key(start, end), Body=body,
                                                    ContentType="application/x-ndjson")
                        except Exception as e:  # noqa: BLE001 - botocore errors: serving goes on, retry later
                            if not self._failing:
                                self._failing = True
                                log.warning("traffic upload to s3://%s/%s%s/ failed (%s: %s); retrying every "
                                            "interval, the log keeps everything", self.bucket, self.prefix,
                                            self.source, type(e).__name__, e)
                            return sent
                        if start == 0:
                            self.head = _digest(body[:body.find(b"\n") + 1])
                        self.shipped, self.pending = max(self.shipped, end), None
                        self.objects += 1
                        sent += end - start
                        self._save_state()
            except OSError as e:
                self._warn_once("read", "traffic upload: cannot read %s (%s)", self.log_path, e)
                return sent
            if self._failing:
                self._failing = False
                log.info("traffic upload to s3://%s/%s%s/ works again", self.bucket, self.prefix, self.source)
            if (self.traffic_log is not None and self.shipped >= self.compact_bytes
                    and self.traffic_log.truncate_if_size(self.shipped)):
                self._start_segment()  # a crash before this is saved: the emptied file's head no longer matches
                self._save_state()
            return sent

    def _next_range(self, f: Any, size: int) -> tuple[int, int] | None:
        """The next range of whole lines from ``shipped`` (at most MAX_SHIPMENT_BYTES), or None. A line longer
        than MAX_SHIPMENT_BYTES (not one the runtime writes) is skipped with a warning, so it cannot stall
        shipping and compaction for good."""
        while self.shipped < size:
            f.seek(self.shipped)
            chunk = f.read(min(size - self.shipped, MAX_SHIPMENT_BYTES))
            cut = chunk.rfind(b"\n") + 1  # whole lines only: a writer may be mid-line
            if cut:
                return self.shipped, self.shipped + cut
            if len(chunk) < MAX_SHIPMENT_BYTES:
                return None  # the last line is still being written
            end = self._find_newline(f, self.shipped + len(chunk), size)
            if end is None:
                return None
            log.warning("traffic log %s: a line of %d bytes at offset %d is not a trace line; skipped",
                        self.log_path, end - self.shipped, self.shipped)
            self.shipped = end
            self._save_state()
        return None

    @staticmethod
    def _find_newline(f: Any, pos: int, size: int) -> int | None:
        while pos < size:
            f.seek(pos)
            block = f.read(min(size - pos, 1 << 20))
            i = block.find(b"\n")
            if i >= 0:
                return pos + i + 1
            pos += len(block)
        return None

    def start(self, interval_s: float = DEFAULT_SHIP_INTERVAL_S) -> None:
        """Ship every ``interval_s`` seconds in a daemon thread until :meth:`close`.

        Raises:
            ValueError: ``interval_s`` outside (0, MAX_SHIP_INTERVAL_S] (``check_ship_interval``).
        """
        interval_s = check_ship_interval(interval_s)

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
