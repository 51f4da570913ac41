"""Concurrent, resumable, verified transfer of source objects into a staging folder.

Every file is cut into parts of `part_size_bytes`; parts of all files go to one pool of
`concurrency` threads that each issue a ranged read (S3: ranged GET with If-Match) and stream it in
`read_chunk_bytes` pieces with `os.pwrite` into ``<rel>.pdserve-part``. Memory stays bounded at
about concurrency × read_chunk_bytes, whatever the file sizes.

Resume: when a part's bytes are written its index is appended to a per-file journal
(``.pdserve-journal/<id>.parts``, first line = the object's ETag, size and part size). A run killed at
any point (kill -9) restarts with only the missing parts; a journal whose ETag/size/part size differ
is discarded (changed object → re-fetched). The journal guards against process death; a torn write
after a node crash is caught by the verification below, and a file that fails it (that, or a bit
flipped in transit) is fetched once more from scratch in the same run; a second failure fails the run.

Verification (see `runtime.staging.verify`): single-request files are hashed while they stream
(for an S3 object with a full-object checksum, botocore's own digest is the check: one pass, none
of ours). Multi-part files whose check can be computed by ranges (composite checksums, multipart
ETags, full-object CRCs: `verify.by_range`) are digested by the download threads as the bytes
arrive, each range on its own (ranges aligned to the upload parts for composite checks); the range
digests go into the journal with the part index and are joined when the last range lands
(`verify.assemble`: CRCs combine). No byte is read back on a fresh run; a resumed run re-reads each
journaled part from the staging file and compares its digests with the journal's before trusting it (a
node crash can leave a journal line on disk whose data pages never reached it): a part that differs is
fetched again. Only when the
check needs the bytes in order (full-object SHA-256 or MD5 of a large single-part object, hf
sources) or the caller asks for a whole-file SHA-256 (`record_sha256`), a per-file hash thread follows the
contiguous prefix of finished parts ("frontier"), reading them back from the page cache into a
preallocated buffer while later parts still download; each buffer feeds every digest the check needs
at once (whole-file SHA-256, the per-upload-part digests of a composite checksum / multipart ETag), so
every byte is read once and SHA-256'd at most twice (composite SHA-256: once per part, once whole —
the minimum, the two digests differ). hashlib and awscrt release the GIL on these large buffers, so
hashing runs in parallel with the downloads. Ranged GETs are therefore independent of the upload part
size (fewer, larger requests: botocore costs ~2 ms CPU per request). Then the file is checked,
fsynced (writeback was started per part with sync_file_range) and renamed to its final name by a
separate pool (an fsync never stalls hashing), and its manifest entry is appended to
``.pdserve-journal/verified.jsonl`` so a resumed run skips it.

Writes: chunks that the source hands in page-aligned buffers (S3 over `S3HttpGetter`) at 4 KiB-aligned
offsets go to the file through an O_DIRECT descriptor (`direct_io`): no copy into the page cache and
no writeback work in this process; the final fsync makes them durable like buffered writes. Other
chunks (a file's unaligned tail, other sources) go through the page cache.

Retries: failures while streaming a body (connection reset, read timeout, incomplete read) and S3's
throttling / 5xx answers on the "http" transport are retried here by tenacity with exponential
backoff and jitter, continuing from the last written byte; on the "botocore" transport botocore
also retries each request itself (standard mode).

Why not s3transfer's TransferManager (which also does concurrent ranged GETs): it downloads into a
temporary file that it deletes on failure, so a killed or failed run cannot resume from its
completed parts. Why not the CRT S3 client (awscrt 0.38) as the byte path: measured here with
its `on_body(chunk, offset)` callback doing only CRC32 + pwrite, it used 1.5-2.3 CPU s/GB on 2 cores
(16 KiB socket reads through its event loop; its response buffers: 200-850 MB RSS) against 0.65-0.75
for ranged GETs over http.client (`runtime.staging.s3.S3HttpGetter`) with the same work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import json
import logging
import mmap
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential, wait_random

from runtime.staging.keys import check_utf8
from runtime.staging.manifest import HASH_CHUNK_BYTES, ChecksumMismatchError, ManifestEntry, StagingError
from runtime.staging.sources import Source, SourceObject, VerifiedBody
from runtime.staging.verify import (FileDigests, Hasher, RangeHasher, assemble, by_range, check, checksum_record,
                                    needs_whole_sha256, plan)

JOURNAL_DIR = ".pdserve-journal"
VERIFIED_LOG = "verified.jsonl"
PART_SUFFIX = ".pdserve-part"
MAX_ALIGNED_PART_BYTES = 64 << 20  # GETs are never smaller than an upload part up to this size
FINISH_WORKERS = 8  # fsync + rename threads (I/O waits, no CPU): never stall hashing

log = logging.getLogger(__name__)


# O_DIRECT offsets/lengths: multiples of 4096 (safe for 512 B and 4 KiB block devices, Lustre) and of the
# page size, so a direct write never shares a page with a buffered one (64 KiB pages on some arm64 kernels)
DIRECT_ALIGN = max(4096, mmap.PAGESIZE) - 1
SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages, do not wait


def _load_sync_file_range() -> Callable[[int, int, int], None]:
    """`sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)` via libc, or a no-op where missing.

    Starting writeback as each part lands spreads the disk writes over the transfer, so the final
    per-file fsync has little left to flush (same idea as PostgreSQL's checkpoint_flush_after).
    """
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return lambda fd, off, n: None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]

    def start_writeback(fd: int, off: int, n: int) -> None:
        fn(fd, off, n, SYNC_FILE_RANGE_WRITE)  # best effort: errors (e.g. unsupported fs) ignored

    return start_writeback


_start_writeback = _load_sync_file_range()


@dataclass
class TransferStats:
    """What a transfer did (bytes, files, parts)."""

    bytes_downloaded: int = 0
    bytes_resumed: int = 0
    files_fetched: int = 0
    files_resumed_verified: int = 0
    parts_downloaded: int = 0
    parts_resumed: int = 0
    files_refetched: int = 0  # fetched a second time after their bytes failed the check


@dataclass
class _FileState:
    obj: SourceObject
    data_path: Path
    final_path: Path
    journal_path: Path | None  # None: a single-request file (no journal)
    num_parts: int
    part_size: int
    fd: int = -1
    dfd: int = -1  # the same file opened with O_DIRECT (aligned chunks skip the page cache), or -1
    direct: bool = True  # False once the filesystem refused a direct write (dfd stays open until _finish)
    journal: object = None
    whole: bool = False  # one plain GET, hashed while streaming
    digests: FileDigests | None = None  # set when the whole file is hashed
    hasher: Hasher | None = None  # frontier hasher (multi-part files not digested by ranges)
    by_range: bool = False  # digested range by range in the download threads
    range_digests: dict[int, list[bytes]] = field(default_factory=dict)
    journaled: dict[int, list[bytes]] = field(default_factory=dict)  # resumed by-range parts to re-check
    uneven_parts: bool = False  # verified at the source's real (unequal) upload-part sizes
    done_parts: set[int] = field(default_factory=set)
    frontier: int = 0  # parts [0, frontier) are hashed
    hashing: bool = False


def _describe(e: BaseException | None) -> str:
    return f"{type(e).__name__}: {e}" if e is not None else "failed"


def _journal_id(rel: str) -> str:
    return hashlib.sha256(rel.encode()).hexdigest()[:24]


def load_verified(staging: Path) -> dict[str, ManifestEntry]:
    """Entries already verified in `staging` by an earlier (killed) run, keyed by relative path."""
    log = staging / JOURNAL_DIR / VERIFIED_LOG
    out: dict[str, ManifestEntry] = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                e = ManifestEntry.model_validate_json(line)
            except ValueError:
                continue  # torn last line after a kill
            out[e.path] = e
    return out


class TransferEngine:
    """Fetch objects from one source into `staging` (see module docstring).

    Args:
        source: where bytes come from.
        staging: staging folder on the destination filesystem.
        concurrency: parallel ranged reads (threads).
        part_size_bytes: bytes per ranged read / resume unit (multipart objects: at least their
            upload part size when that is ≤ 64 MiB).
        read_chunk_bytes: bytes per read of a response body (memory per thread).
        max_attempts: attempts per part for streaming errors (tenacity).
        backoff_initial_s / backoff_max_s: exponential backoff bounds, seconds.
        hash_workers: threads hashing/verifying files.
        fsync: fsync each file before it is renamed (and start writeback per part).
        record_sha256: compute every file's whole-file SHA-256 for the manifest even when the
            source's checksum verified the bytes (one more pass: ~0.6 CPU s/GB with SHA-NI).
        direct_io: write page-aligned chunks at block-aligned offsets with O_DIRECT when the source's
            chunks are page-aligned buffers (`aligned_chunks`) and the file is not read back while it
            downloads (digested range by range, or one request): no copy into the page cache and no
            writeback work in this process (on 2 shared cores: 0.73-0.81 vs 1.6-1.7 CPU s/GB for
            GET + CRC + write + fsync). Unaligned pieces (a file's tail) go through the page cache;
            filesystems without O_DIRECT fall back to it entirely.
        on_bytes: progress callback, called with a byte count from worker threads.
    """

    def __init__(
        self,
        source: Source,
        staging: Path,
        *,
        concurrency: int = 16,
        part_size_bytes: int = 32 << 20,
        read_chunk_bytes: int = 1 << 20,
        max_attempts: int = 8,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 10.0,
        hash_workers: int = 4,
        fsync: bool = True,
        record_sha256: bool = False,
        direct_io: bool = True,
        on_bytes: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.source = source
        self.staging = Path(staging)
        self.concurrency = concurrency
        self.part_size = part_size_bytes
        self.chunk = read_chunk_bytes
        self.max_attempts = max_attempts
        self.backoff = (backoff_initial_s, backoff_max_s)
        self.hash_workers = hash_workers
        self.fsync = fsync
        self.record_sha256 = record_sha256
        self.direct_io = direct_io and getattr(source, "aligned_chunks", False) and hasattr(os, "O_DIRECT")
        self.on_bytes = on_bytes
        self.stats = TransferStats()
        self._abort = threading.Event()
        self._done: queue.Queue = queue.Queue()
        self._outstanding = 0
        self._tls = threading.local()
        self._made_dirs: set[Path] = set()

    # ---- worker-thread work ---------------------------------------------------------------------
    def _fetch_part(self, fs: _FileState, idx: int) -> tuple[int, list[bytes] | None]:
        """Fetch part `idx` into the staging file; returns (bytes, its range digests when `by_range`)."""
        start = idx * fs.part_size
        end = min(start + fs.part_size, fs.obj.size_bytes)
        pos = start
        hasher: Hasher | RangeHasher | None = RangeHasher(fs.obj, start, end) if fs.by_range else None
        body: object = None
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(self.max_attempts),
                wait=wait_exponential(multiplier=self.backoff[0], max=self.backoff[1])
                + wait_random(0, self.backoff[0]),
                retry=retry_if_exception_type(self.source.retryable) if self.source.retryable else lambda _: False,
                reraise=True,
                before_sleep=lambda rs, key=fs.obj.key: log.warning(
                    "object '%s' part %d: %s; attempt %d of %d, retrying from byte %d", key, idx,
                    _describe(rs.outcome.exception()), rs.attempt_number, self.max_attempts, pos),
            ):
                with attempt:
                    if fs.whole:  # single-part file: one plain GET (checksum in its headers); a retry restarts it
                        if pos:
                            self.on_bytes(-pos)
                            pos = 0
                        fs.obj, body = self.source.read_whole(fs.obj, self.chunk)
                        hasher = self._whole_hasher(fs.obj, body)
                        chunks = iter(body)
                    else:
                        chunks = self.source.read_range(fs.obj, pos, end, self.chunk)
                    for b in chunks:  # bytes of this part arrive in order, also after a retry
                        if self._abort.is_set():
                            raise StagingError("aborted")
                        n = len(b)
                        if pos + n > end:
                            raise StagingError(f"object '{fs.obj.key}': server sent more bytes than the range")
                        if fs.dfd >= 0 and fs.direct and not (pos | n) & DIRECT_ALIGN:
                            self._write_direct(fs, b, pos)
                        else:
                            os.pwrite(fs.fd, b, pos)
                        if hasher:
                            hasher.update(b)
                        pos += n
                        self.on_bytes(n)
                    if pos != end:
                        raise StagingError(f"object '{fs.obj.key}': short read at byte {pos} of part {idx}")
        except ChecksumMismatchError:
            if fs.whole and pos:  # `fetch` fetches the file again from byte 0: take back its progress
                self.on_bytes(-pos)
            raise
        if fs.whole:
            fs.digests = hasher.result() if hasher else FileDigests(sha256_hex="")
            if isinstance(body, VerifiedBody) and body.kind == plan(fs.obj).kind:
                if body.kind == "sha256":
                    fs.digests.sha256_hex = body.sha256_hex()
                else:
                    fs.digests.whole = body.digest()
            return end - start, None
        if self.fsync and end > start:
            _start_writeback(fs.fd, start, end - start)
        return end - start, (hasher.result() if isinstance(hasher, RangeHasher) else None)

    def _write_direct(self, fs: _FileState, b: bytes | memoryview, pos: int) -> None:
        """pwrite through the O_DIRECT descriptor; a filesystem that refuses it (EINVAL: alignment or
        no O_DIRECT support) turns direct I/O off for this file and the bytes go through the page cache.
        The descriptor stays open until `_finish` (other threads may be writing through it)."""
        try:
            if os.pwrite(fs.dfd, b, pos) == len(b):
                return
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        fs.direct = False
        os.pwrite(fs.fd, b, pos)  # also rewrites a short direct write's bytes (same offsets)

    def _open_direct(self, path: Path) -> int:
        """`path` opened O_WRONLY | O_DIRECT, or -1 where direct I/O is off or unsupported."""
        if not self.direct_io:
            return -1
        try:
            return os.open(path, os.O_WRONLY | os.O_DIRECT)
        except (OSError, AttributeError):  # EINVAL: the filesystem has no O_DIRECT (tmpfs, some FUSE)
            return -1

    def _recheck_part(self, fs: _FileState, idx: int, expected: list[bytes]) -> tuple[int, list[bytes], bool]:
        """A journaled part of a by-range file: hash its bytes in the staging file; (bytes, digests, True)
        when they match the journal, else the part is fetched again: (bytes, new digests, False)."""
        start = idx * fs.part_size
        end = min(start + fs.part_size, fs.obj.size_bytes)
        h = RangeHasher(fs.obj, start, end)
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = memoryview(bytearray(HASH_CHUNK_BYTES))
        pos = start
        while pos < end:
            view = buf[: min(len(buf), end - pos)]
            n = os.preadv(fs.fd, [view], pos)
            if not n:
                break
            h.update(view[:n])
            pos += n
        if pos == end and h.result() == expected:
            return end - start, expected, True
        n, digests = self._fetch_part(fs, idx)
        return n, digests or [], False

    def _whole_hasher(self, obj: SourceObject, body: object) -> Hasher | None:
        """Our digests for a single-request file: none when the transport verified its full-object
        checksum and no extra SHA-256 is wanted; else what `check` (and the manifest) need."""
        p = plan(obj)
        verified = isinstance(body, VerifiedBody) and body.kind == p.kind
        if verified:
            want_sha = self.record_sha256 and body.kind != "sha256"
            return Hasher(obj, sha256=True) if want_sha else None
        return Hasher(obj, sha256=self.record_sha256 or needs_whole_sha256(p))

    def _hash_span(self, fs: _FileState, first: int, stop: int) -> int:
        """Feed parts [first, stop) to the file's frontier hasher (page-cache reads into this thread's
        preallocated buffer: no allocation per chunk); returns stop."""
        assert fs.hasher is not None
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = memoryview(bytearray(HASH_CHUNK_BYTES))
        pos, end = first * fs.part_size, min(stop * fs.part_size, fs.obj.size_bytes)
        while pos < end:
            view = buf[: min(len(buf), end - pos)]
            n = os.preadv(fs.fd, [view], pos)
            if not n:
                raise StagingError(f"object '{fs.obj.key}': staged file shorter than expected at byte {pos}")
            fs.hasher.update(view[:n])
            pos += n
        return stop

    def _finish(self, fs: _FileState) -> ManifestEntry:
        """Check digests against the source, fsync, rename to the final name."""
        if fs.digests is None and fs.by_range:
            sizes = [min(fs.part_size, fs.obj.size_bytes - i * fs.part_size) for i in range(fs.num_parts)]
            fs.digests = assemble(fs.obj, [(sizes[i], fs.range_digests[i]) for i in range(fs.num_parts)])
        if fs.digests is None:
            assert fs.hasher is not None
            fs.digests = fs.hasher.result()
        try:
            try:
                verified_by = check(fs.obj, fs.digests)
            except StagingError:
                verified_by = self._check_uneven_parts(fs)  # re-raises when the parts are uniform
        except StagingError:
            fs.data_path.unlink(missing_ok=True)  # never reuse bad bytes: re-fetch next time
            if fs.journal_path is not None:
                fs.journal_path.unlink(missing_ok=True)
            raise
        if fs.dfd >= 0:
            os.close(fs.dfd)
            fs.dfd = -1
        if self.fsync:
            os.fsync(fs.fd)  # also covers the O_DIRECT writes' metadata and the device's write cache
        os.close(fs.fd)
        fs.fd = -1
        os.replace(fs.data_path, fs.final_path)
        checksum, checksum_part_bytes = (None, None) if fs.uneven_parts else checksum_record(fs.obj, verified_by)
        return ManifestEntry(
            key=fs.obj.key, path=fs.obj.rel, size_bytes=fs.obj.size_bytes, etag=fs.obj.etag,
            sha256=fs.digests.sha256_hex or None, checksum=checksum, checksum_part_bytes=checksum_part_bytes,
            verified_by=verified_by,
        )

    def _check_uneven_parts(self, fs: _FileState) -> str:
        """A composite checksum / multipart ETag failed with equal upload parts assumed: ask the source
        for the real part sizes; when they differ from that split, re-hash the staged file at those
        boundaries (one read) and check again. The file's SHA-256 from that pass becomes its manifest
        record (a deep re-check of the uneven composite would need the sizes too).

        Raises:
            ChecksumMismatchError: the parts are as assumed (the bytes are wrong) or still mismatch.
        """
        obj = fs.obj
        sizes = self.source.part_sizes(obj) if plan(obj).composite and hasattr(self.source, "part_sizes") else []
        # the split the digests were made at: parts of the first part's size, the rest in the last; real
        # parts may differ anywhere, a last part larger than the others included (UploadPartCopy joins)
        up = obj.part_size_bytes or 0
        k = -(-obj.size_bytes // up) if up else 0
        even = [up] * (k - 1) + [obj.size_bytes - up * (k - 1)] if k else []
        if not sizes or sum(sizes) != obj.size_bytes or sizes == even:
            check(obj, fs.digests)  # raises the original mismatch
        h = Hasher(obj, sha256=True, part_sizes=sizes)
        buf = memoryview(bytearray(HASH_CHUNK_BYTES))
        pos = 0
        while pos < obj.size_bytes:
            n = os.preadv(fs.fd, [buf[: min(len(buf), obj.size_bytes - pos)]], pos)
            if not n:
                break
            h.update(buf[:n])
            pos += n
        fs.digests = h.result()
        fs.uneven_parts = True
        return check(obj, fs.digests)

    def _run(self, kind: str, fs: _FileState, idx: int, fn: Callable[[], object]) -> None:
        try:
            res = None if self._abort.is_set() else fn()
            self._done.put((kind, fs, idx, res, None))
        except BaseException as e:  # noqa: BLE001 - forwarded to the main thread
            self._done.put((kind, fs, idx, None, e))

    # ---- main-thread bookkeeping ----------------------------------------------------------------
    def _submit(self, pool: ThreadPoolExecutor, kind: str, fs: _FileState, idx: int, fn: Callable[[], object]) -> None:
        self._outstanding += 1
        pool.submit(self._run, kind, fs, idx, fn)

    def _prepare(self, obj: SourceObject, jdir: Path, whole: bool = False) -> tuple[_FileState, list[int]]:
        final = self.staging / obj.rel
        if final.parent not in self._made_dirs:  # many small files share a few folders: one mkdir each
            final.parent.mkdir(parents=True, exist_ok=True)
            self._made_dirs.add(final.parent)
        data = final.with_name(final.name + PART_SUFFIX)
        if whole:  # one part, no journal: resume unit is the file
            fd = os.open(data, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, obj.size_bytes)
            dfd = self._open_direct(data) if obj.size_bytes > DIRECT_ALIGN else -1
            return _FileState(obj, data, final, None, 1, max(obj.size_bytes, 1), fd=fd, dfd=dfd, whole=True), [0]
        jpath = jdir / (_journal_id(obj.rel) + ".parts")
        # Ranged GETs need not follow the upload parts: the frontier hasher splits the bytes at the
        # upload-part boundaries itself (composite checksum / multipart ETag). A GET smaller than an
        # upload part (≤ 64 MiB) buys nothing but more requests, so it is raised to the upload part.
        up = obj.part_size_bytes
        p = plan(obj)
        stream = by_range(obj) and not self.record_sha256 and not needs_whole_sha256(p)
        if stream and p.composite:  # ranges must hold whole upload parts: a multiple of them
            part_size = up * max(1, self.part_size // up)
        else:
            part_size = max(self.part_size, up) if up and up <= MAX_ALIGNED_PART_BYTES else self.part_size
        num_parts = -(-obj.size_bytes // part_size) if obj.size_bytes else 0
        header = json.dumps({"etag": obj.etag, "size": obj.size_bytes, "part": part_size, "rel": obj.rel,
                             "by_range": stream, "v": 3})
        done: set[int] = set()
        digests: dict[int, list[bytes]] = {}
        if jpath.is_file() and data.is_file():
            lines = jpath.read_text().split("\n")
            if lines[0] == header:
                for line in lines[1:-1]:  # "<idx>[ <hex>,<hex>…]"; a torn last line is skipped
                    idx_s, _, hexes = line.partition(" ")
                    if not idx_s.isdigit() or int(idx_s) >= num_parts:
                        continue
                    i = int(idx_s)
                    if stream:
                        n = min(part_size, obj.size_bytes - i * part_size)
                        want = -(-n // up) if p.composite else 1
                        try:
                            ds = [bytes.fromhex(h) for h in hexes.split(",")] if hexes else []
                        except ValueError:
                            continue
                        if len(ds) != want:
                            continue
                        digests[i] = ds
                    done.add(i)
        fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o644)
        if not done:
            os.ftruncate(fd, obj.size_bytes)
            jpath.write_text(header + "\n")
        journaled: dict[int, list[bytes]] = {}
        if stream:  # re-checked against the bytes on disk before they count (see the module docstring)
            journaled, digests, done = digests, {}, set()
        fs = _FileState(
            obj, data, final, jpath, num_parts, part_size, fd=fd, journal=open(jpath, "a", buffering=1),
            dfd=self._open_direct(data) if stream else -1,  # frontier-hashed files are read back: page cache
            done_parts=done, by_range=stream, range_digests=digests, journaled=journaled,
            hasher=None if stream else Hasher(obj, sha256=self.record_sha256 or needs_whole_sha256(p)),
        )
        resumed = sum(min(part_size, obj.size_bytes - i * part_size) for i in done)
        self.stats.parts_resumed += len(done)
        self.stats.bytes_resumed += resumed
        if resumed:
            self.on_bytes(resumed)
        return fs, [i for i in range(num_parts) if i not in done and i not in journaled]

    @staticmethod
    def _close(fs: _FileState) -> None:
        """Close a file state's descriptors and journal (idempotent)."""
        if fs.fd >= 0:
            os.close(fs.fd)
            fs.fd = -1
        if fs.dfd >= 0:
            os.close(fs.dfd)
            fs.dfd = -1
        if fs.journal and not fs.journal.closed:
            fs.journal.close()

    def _advance(self, fs: _FileState, hash_pool: ThreadPoolExecutor) -> None:
        """Hash the next run of finished parts, or finish the file when all are hashed."""
        if fs.hashing:
            return
        if fs.by_range:  # digests came with the parts: finish when the last one is in
            if len(fs.done_parts) == fs.num_parts:
                fs.hashing = True
                self._submit(self._fin_pool, "finished", fs, -1, lambda: self._finish(fs))
            return
        stop = fs.frontier
        while stop in fs.done_parts:
            stop += 1
        if stop > fs.frontier:
            fs.hashing = True
            first = fs.frontier
            self._submit(hash_pool, "hashed", fs, stop, lambda: self._hash_span(fs, first, stop))
        elif fs.frontier == fs.num_parts:
            fs.hashing = True
            self._submit(self._fin_pool, "finished", fs, -1, lambda: self._finish(fs))

    def fetch(self, objects: list[SourceObject]) -> list[ManifestEntry]:
        """Fetch and verify `objects` into the staging folder; returns their manifest entries.

        Objects already verified by an earlier run (same path, size, ETag) are not fetched again.

        A file whose bytes fail the check is fetched once more from scratch (a flip in transit, a
        resumed part damaged on disk); `stats.files_refetched` counts them.

        Raises:
            StagingError: a checksum/ETag mismatch twice in a row, a changed object, a part failing
                after `max_attempts`, or a path that is not valid UTF-8 (a local file's name; before
                anything is fetched); names the key. Completed parts stay for the next run.
        """
        check_utf8([o.rel for o in objects])  # journal ids and the manifest (JSON) need the names as text
        jdir = self.staging / JOURNAL_DIR
        jdir.mkdir(parents=True, exist_ok=True)
        verified = load_verified(self.staging)
        entries: dict[str, ManifestEntry] = {}
        todo_objs = []
        for obj in objects:
            e = verified.get(obj.rel)
            f = self.staging / obj.rel
            if (e and e.size_bytes == obj.size_bytes and e.etag == obj.etag and f.is_file()
                    and f.stat().st_size == obj.size_bytes and (e.sha256 is not None or not self.record_sha256)):
                entries[obj.rel] = e
                self.stats.files_resumed_verified += 1
                self.on_bytes(obj.size_bytes)
            else:
                todo_objs.append(obj)
        vlog = open(jdir / VERIFIED_LOG, "a", buffering=1)
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="stage-get")
        hash_pool = ThreadPoolExecutor(max_workers=self.hash_workers, thread_name_prefix="stage-hash")
        self._fin_pool = ThreadPoolExecutor(max_workers=FINISH_WORKERS, thread_name_prefix="stage-fsync")
        states: list[_FileState] = []
        refetched: set[str] = set()

        def start(fs: _FileState, parts: list[int]) -> None:
            states.append(fs)
            for i in parts:
                self._submit(pool, "part", fs, i, lambda i=i: self._fetch_part(fs, i))
            for i, expected in fs.journaled.items():
                self._submit(hash_pool, "part", fs, i, lambda i=i, e=expected: self._recheck_part(fs, i, e))
            if not fs.whole:
                self._advance(fs, hash_pool)  # resumed parts (or an empty file) need hashing too

        try:
            for obj in todo_objs:  # big or multipart files need a HEAD first; the rest start at once
                if obj.size_bytes > self.part_size or self.source.needs_describe(obj):
                    stub = _FileState(obj, Path(), Path(), None, 0, 1)
                    self._submit(pool, "described", stub, -1, lambda obj=obj: self.source.describe(obj))
                else:
                    start(*self._prepare(obj, jdir, whole=True))
            while self._outstanding:
                kind, fs, idx, res, err = self._done.get()
                self._outstanding -= 1
                # A single-request file with a full-object checksum is checked while it streams (its
                # mismatch comes with the "part"); the others when their last part is in ("finished").
                failed_check = err is not None and (
                    (kind == "finished" and isinstance(err, StagingError))
                    or (kind == "part" and fs.whole and isinstance(err, ChecksumMismatchError)))
                if failed_check and fs.obj.rel not in refetched and not self._abort.is_set():
                    # the file's bytes failed the check (_finish removed them and its journal; a
                    # single-request file is truncated by _prepare): a bit flipped in transit or a
                    # resumed part damaged on disk. Fetch it afresh once; a second mismatch means the
                    # source itself is bad and fails the run.
                    refetched.add(fs.obj.rel)
                    log.warning("%s; fetching '%s' again", err, fs.obj.rel)
                    self.stats.files_refetched += 1
                    self._close(fs)
                    if kind == "finished":  # a failed single GET took back its own progress (_fetch_part)
                        self.on_bytes(-fs.obj.size_bytes)
                    start(*self._prepare(fs.obj, jdir, whole=fs.whole))
                    continue
                if err is not None:
                    raise err if isinstance(err, StagingError) else StagingError(
                        f"object '{fs.obj.key}': {type(err).__name__}: {err}"
                    ) from err
                if kind == "described":
                    start(*self._prepare(res, jdir))
                elif kind == "part":
                    nbytes, range_digests, *checked = res
                    if checked and checked[0]:  # a journaled part whose bytes on disk still match
                        self.stats.parts_resumed += 1
                        self.stats.bytes_resumed += nbytes
                        self.on_bytes(nbytes)
                        fs.range_digests[idx] = range_digests
                        fs.done_parts.add(idx)
                        self._advance(fs, hash_pool)
                        continue
                    self.stats.parts_downloaded += 1
                    self.stats.bytes_downloaded += nbytes
                    if fs.whole:
                        self._submit(self._fin_pool, "finished", fs, -1, lambda fs=fs: self._finish(fs))
                        continue
                    if fs.by_range:
                        fs.range_digests[idx] = range_digests
                        fs.journal.write(f"{idx} {','.join(d.hex() for d in range_digests)}\n")
                    else:
                        fs.journal.write(f"{idx}\n")
                    fs.done_parts.add(idx)
                    self._advance(fs, hash_pool)
                elif kind == "hashed":
                    fs.hashing = False
                    fs.frontier = res
                    self._advance(fs, hash_pool)
                else:  # finished
                    entries[res.path] = res
                    vlog.write(res.model_dump_json() + "\n")
                    if fs.journal:
                        fs.journal.close()
                    if fs.journal_path is not None:
                        fs.journal_path.unlink(missing_ok=True)
                    self.stats.files_fetched += 1
        finally:
            self._abort.set()
            pool.shutdown(wait=True, cancel_futures=True)
            hash_pool.shutdown(wait=True, cancel_futures=True)
            self._fin_pool.shutdown(wait=True, cancel_futures=True)
            for fs in states:
                self._close(fs)
            vlog.close()
        return [entries[o.rel] for o in objects]
