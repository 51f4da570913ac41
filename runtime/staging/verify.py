"""Checking downloaded bytes against what the source says they are.

Order of preference (first available wins):
1. S3 additional checksums, ChecksumSHA256 > ChecksumCRC64NVME > ChecksumCRC32C > ChecksumCRC32:
   FULL_OBJECT (base64 of the digest of the whole object) or COMPOSITE ``<b64>-<N>`` (digest of the
   concatenated binary digests of the N upload parts; CRCs as big-endian bytes, 4 or 8)
   (https://docs.aws.amazon.com/AmazonS3/latest/userguide/checking-object-integrity.html).
   CRC32C and CRC64NVME need `awscrt` (the boto3[crt] extra); without it they fall through to 3./4.
2. Source SHA-256 (Hugging Face LFS pointer) or git blob id (sha1 of ``b"blob <size>\\0" + data``).
3. S3 ETag: MD5 of the bytes for single-part objects; for multipart ``<hex>-<N>`` the MD5 of the
   concatenated binary MD5s of the parts (not for SSE-KMS or DSSE-KMS objects, whose ETag is not an MD5).
4. Otherwise only the self-computed SHA-256 is recorded (``verified_by="sha256"``).

Two ways to compute: `Hasher` takes the bytes of a whole file in order (one pass feeds every digest);
`RangeHasher` takes one byte range and `assemble` joins the ranges afterwards, so the download
threads digest bytes as they arrive, in any order, without reading them back: that works for
composite checksums / multipart ETags (ranges aligned to upload parts) and for full-object CRCs
(CRCs of adjacent ranges combine: awscrt's ``combine_crc*``). The whole-file SHA-256 is computed
only where it is the check itself, or where nothing else exists, or when the caller asks for it
(`StageOptions.record_sha256`): the manifest records the verified checksum instead (`checksum_record`).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from runtime.staging.manifest import HASH_CHUNK_BYTES, ChecksumMismatchError, StagingError
from runtime.staging.sources import SourceObject


CRC_KINDS = ("crc64nvme", "crc32c", "crc32")
CRC_BYTES = {"crc32": 4, "crc32c": 4, "crc64nvme": 8}
"""Width of each CRC's digest as S3 encodes it (big-endian), bytes."""


@functools.cache
def _crc_fn(kind: str) -> Callable[[bytes, int], int] | None:
    """Incremental CRC function (data, previous) -> crc, or None where unavailable.

    CRC32 is ISA-L's (PyPI `isal`, carry-less multiply: 33 GiB/s on this host's CPU) when installed,
    else zlib's (2.6-3.9 GiB/s; awscrt's is 2.5 GiB/s); both release the GIL and take any buffer.
    CRC32C and CRC64NVME are awscrt's (hardware, ~50 GiB/s here).
    """
    if kind == "crc32":
        try:
            from isal.isal_zlib import crc32

            return crc32
        except ImportError:
            return zlib.crc32
    try:
        from awscrt import checksums

        return {"crc32c": checksums.crc32c, "crc64nvme": checksums.crc64nvme}[kind]
    except ImportError:
        return None


@functools.cache
def _combine_fn(kind: str) -> Callable[[int, int, int], int] | None:
    """`(crc_a, crc_b, len_b) -> crc(a || b)` for a CRC kind (awscrt ≥ 0.30), or None."""
    try:
        from awscrt import checksums

        return {"crc32": checksums.combine_crc32, "crc32c": checksums.combine_crc32c,
                "crc64nvme": checksums.combine_crc64nvme}[kind]
    except (ImportError, AttributeError, KeyError):
        return None


class _Crc:
    """hashlib-like wrapper: update(bytes), digest() → big-endian bytes (4, or 8 for CRC64NVME)."""

    def __init__(self, kind: str) -> None:
        fn = _crc_fn(kind)
        assert fn is not None
        self.fn, self.value, self.width = fn, 0, CRC_BYTES[kind]

    def update(self, b: Any) -> None:
        self.value = self.fn(b, self.value)  # zlib and awscrt take any buffer (no copy)

    def digest(self) -> bytes:
        return self.value.to_bytes(self.width, "big")


def new_digest(kind: str) -> Any:
    """A fresh digest object for "sha256", "md5", "crc32", "crc32c" or "crc64nvme"."""
    if kind in ("sha256", "md5"):
        return hashlib.new(kind)
    return _Crc(kind)


@dataclass(frozen=True)
class Plan:
    """What to compute for one object and what to compare it with."""

    method: str  # verified_by value: checksum-sha256 | checksum-crc64nvme | checksum-crc32c | checksum-crc32 | source-sha256 |
    #              git-blob-sha1 | etag-md5 | sha256
    kind: str | None = None  # digest kind compared with the source (sha256/md5/crc32/crc32c)
    composite: bool = False  # per-upload-part digests, combined
    expected: str = ""  # source value (base64 checksum, hex ETag, hex sha)

    @property
    def part_kind(self) -> str | None:
        """Digest the download workers compute per upload part (None: none needed)."""
        return self.kind if self.composite else None


def plan(obj: SourceObject) -> Plan:
    """Pick the strongest check the source offers for `obj` (see the module docstring)."""
    for kind, value in (("sha256", obj.checksum_sha256), ("crc64nvme", obj.checksum_crc64nvme),
                        ("crc32c", obj.checksum_crc32c), ("crc32", obj.checksum_crc32)):
        if value and (kind == "sha256" or _crc_fn(kind) is not None):
            return Plan(f"checksum-{kind}", kind, "-" in value, value)
    if obj.sha256_hex:
        return Plan("source-sha256", "sha256", False, obj.sha256_hex)
    if obj.git_blob_sha1:
        return Plan("git-blob-sha1", "git", False, obj.git_blob_sha1)
    head = obj.etag.split("-", 1)[0].lower()
    if not obj.sse_kms and len(head) == 32 and all(c in "0123456789abcdef" for c in head):
        return Plan("etag-md5", "md5", "-" in obj.etag, obj.etag)
    return Plan("sha256")


@dataclass
class FileDigests:
    """Whole-file SHA-256 (hex), the plan's whole-file digest, and per-upload-part digests."""

    sha256_hex: str
    whole: bytes = b""
    parts: list[bytes] = field(default_factory=list)


SLICE_BYTES = 256 << 10
"""Bytes fed to each digest in turn when several digests read the same buffer: small enough to stay
in the CPU's L2 cache between the digests, large enough that hashlib releases the GIL (> 2 KiB)."""


class Hasher:
    """Incremental digests of one object's bytes fed in order (any chunking); bounded memory.

    One pass feeds every digest `check` needs: the whole-file SHA-256 (unless `sha256=False`: the
    caller gets it elsewhere, e.g. from botocore checking a full-object ChecksumSHA256), the plan's
    whole-file digest (MD5 ETag, CRC, git blob sha1) and, for composite checksums / multipart ETags,
    one digest per upload part (split at multiples of the object's `part_size_bytes`, or at the given
    `part_sizes` when the upload parts differ in size, which S3 allows). An empty multipart object has
    one empty upload part (ETag / checksum "-1"), whatever its `part_size_bytes` says.
    """

    def __init__(self, obj: SourceObject, *, sha256: bool = True, part_sizes: list[int] | None = None) -> None:
        self.plan = plan(obj)
        p = self.plan
        self.part = obj.part_size_bytes if (p.composite and obj.part_size_bytes) else None
        self.part_sizes = list(part_sizes) if (p.composite and part_sizes) else None
        if self.part_sizes:
            self.part = self.part_sizes[0]
        self.empty_composite = p.composite and obj.size_bytes == 0
        self.sha = hashlib.sha256() if sha256 else None
        self.extra: Any = None
        if p.kind == "git":
            self.extra = hashlib.sha1(f"blob {obj.size_bytes}\0".encode())
        elif p.kind and p.kind != "sha256" and not p.composite:
            self.extra = new_digest(p.kind)
        self.p_dig = new_digest(p.kind) if self.part else None
        self.in_part = 0
        self.parts: list[bytes] = []
        self._whole = [d for d in (self.sha, self.extra) if d is not None]

    def update(self, b: bytes | bytearray | memoryview) -> None:
        """Feed the next bytes of the file."""
        whole = self._whole
        if self.p_dig is None and len(whole) <= 1:
            if whole:
                whole[0].update(b)
            return
        view = memoryview(b)
        while len(view):
            take = len(view) if len(view) <= SLICE_BYTES else SLICE_BYTES
            if self.p_dig is not None:
                take = min(take, self.part - self.in_part)
            piece = view[:take]
            for d in whole:
                d.update(piece)
            view = view[take:]
            if self.p_dig is not None:
                self.p_dig.update(piece)
                self.in_part += take
                if self.in_part == self.part:
                    self._close_part()

    def _close_part(self) -> None:
        self.parts.append(self.p_dig.digest())
        self.p_dig = new_digest(self.plan.kind)
        self.in_part = 0
        if self.part_sizes and len(self.parts) < len(self.part_sizes):
            self.part = self.part_sizes[len(self.parts)]

    def result(self) -> FileDigests:
        """Digests of everything fed so far (call once, at the end). `sha256_hex` is "" when the
        hasher was made with `sha256=False`."""
        if self.p_dig is not None and self.in_part:
            self._close_part()
        if self.empty_composite and not self.parts:  # no byte ever closes the one (empty) part
            self.parts.append(new_digest(self.plan.kind).digest())
        whole = self.extra.digest() if self.extra is not None else b""
        return FileDigests(sha256_hex=self.sha.hexdigest() if self.sha else "", whole=whole, parts=self.parts)


def needs_whole_sha256(p: Plan) -> bool:
    """True when the whole-file SHA-256 is itself the check (full-object ChecksumSHA256, source
    SHA-256) or the only thing the manifest could record (nothing to compare with)."""
    return p.method == "sha256" or (p.kind == "sha256" and not p.composite)


def by_range(obj: SourceObject) -> bool:
    """True when `obj`'s check can be computed range by range (`RangeHasher` + `assemble`), in any
    order: a composite checksum / multipart ETag with a known upload part size (ranges must start
    and end on upload-part boundaries), or a full-object CRC whose ranges combine (awscrt)."""
    p = plan(obj)
    if p.composite:
        return bool(obj.part_size_bytes) and p.kind in ("sha256", "md5", *CRC_KINDS)
    return p.kind in CRC_KINDS and _combine_fn(p.kind) is not None and _crc_fn(p.kind) is not None


class RangeHasher:
    """Digests of the bytes [start, end) of `obj`, fed in order (any chunking), for `assemble`.

    Composite: one digest per upload part in the range (`start` must be a multiple of the object's
    upload part size, and `end` too unless it is the object's end). Full-object CRC: one CRC of the
    range. `result()` → list of digests (bytes).

    Raises:
        ValueError: `obj` is not `by_range`, or the range is not aligned to its upload parts.
    """

    def __init__(self, obj: SourceObject, start: int, end: int) -> None:
        if not by_range(obj):
            raise ValueError(f"object '{obj.key}': its check cannot be computed by ranges")
        self.plan = plan(obj)
        self.part = obj.part_size_bytes if self.plan.composite else None
        if self.part and (start % self.part or (end % self.part and end != obj.size_bytes)):
            raise ValueError(f"range [{start}, {end}) of '{obj.key}' is not aligned to its {self.part}-byte upload parts")
        self.digest = new_digest(self.plan.kind)
        self.in_part = 0
        self.out: list[bytes] = []

    def update(self, b: bytes | bytearray | memoryview) -> None:
        """Feed the next bytes of the range."""
        if self.part is None:
            self.digest.update(b)
            return
        view = memoryview(b)
        while len(view):
            take = min(len(view), self.part - self.in_part)
            self.digest.update(view[:take])
            self.in_part += take
            view = view[take:]
            if self.in_part == self.part:
                self.out.append(self.digest.digest())
                self.digest, self.in_part = new_digest(self.plan.kind), 0

    def result(self) -> list[bytes]:
        """The range's digests (call once, after the last byte)."""
        if self.part is None:
            return [self.digest.digest()]
        return self.out + ([self.digest.digest()] if self.in_part else [])


def assemble(obj: SourceObject, ranges: list[tuple[int, list[bytes]]]) -> FileDigests:
    """Join `RangeHasher` results into the file's `FileDigests` (no whole-file SHA-256).

    Args:
        ranges: (length in bytes, digests) of each range, in file order, covering the whole object.

    Raises:
        ValueError: the ranges do not cover `obj` exactly.
    """
    if sum(n for n, _ in ranges) != obj.size_bytes:
        raise ValueError(f"object '{obj.key}': ranges cover {sum(n for n, _ in ranges)} of {obj.size_bytes} bytes")
    p = plan(obj)
    if p.composite:
        return FileDigests(sha256_hex="", parts=[d for _, ds in ranges for d in ds])
    combine, width = _combine_fn(p.kind), CRC_BYTES[p.kind]
    crc = 0
    for i, (n, ds) in enumerate(ranges):
        value = int.from_bytes(ds[0], "big")
        crc = value if i == 0 else combine(crc, value, n)
    return FileDigests(sha256_hex="", whole=crc.to_bytes(width, "big"))


def checksum_record(obj: SourceObject, verified_by: str) -> tuple[str | None, int | None]:
    """What the manifest records for a file checked by `verified_by` (see `check`):
    ``("<algorithm>:<value as the source gives it>", upload part size or None)``, or (None, None)
    when only the SHA-256 is recorded. Algorithms: sha256, crc64nvme, crc32c, crc32 (S3 format,
    composite ``<b64>-<N>``), md5 (the ETag), git-sha1 (git blob id)."""
    p = plan(obj)
    if p.method != verified_by or p.method in ("sha256", "source-sha256"):
        return None, None
    algo = "git-sha1" if p.kind == "git" else p.kind
    # an empty object's one upload part is 0 bytes: not a part size (a manifest's is ≥ 1), and `check`
    # needs none to re-check it
    return f"{algo}:{p.expected}", (obj.part_size_bytes or None) if p.composite else None


def object_for_record(path: str, size_bytes: int, checksum: str, part_size_bytes: int | None) -> SourceObject:
    """A `SourceObject` whose `plan` re-checks a manifest's `checksum_record` (deep verification).

    Raises:
        ValueError: unknown algorithm in `checksum`.
    """
    algo, _, value = checksum.partition(":")
    base = dict(key=path, rel=path, size_bytes=size_bytes, part_size_bytes=part_size_bytes)
    if algo in ("sha256", *CRC_KINDS):
        return SourceObject(**base, etag="", **{f"checksum_{algo}": value})
    if algo == "md5":
        return SourceObject(**base, etag=value)
    if algo == "git-sha1":
        return SourceObject(**base, etag=value, git_blob_sha1=value)
    raise ValueError(f"unknown checksum algorithm {algo!r} in manifest entry '{path}'")


def hash_file(path: Path, obj: SourceObject, chunk_bytes: int = HASH_CHUNK_BYTES, *, sha256: bool = True) -> FileDigests:
    """Read `path` once and compute what `check` needs for `obj` (bounded memory: one chunk);
    `sha256=False` skips the whole-file SHA-256 unless the check itself is that SHA-256.

    Raises:
        OSError: unreadable file.
    """
    h = Hasher(obj, sha256=sha256 or needs_whole_sha256(plan(obj)))
    with open(path, "rb", buffering=0) as f:
        while b := f.read(chunk_bytes):
            h.update(b)
    return h.result()


def check(obj: SourceObject, d: FileDigests) -> str:
    """Compare digests with the source's checksum/ETag; return what was used (`verified_by`).

    Raises:
        ChecksumMismatchError: naming the key and both values on a mismatch (corrupted or wrong bytes).
    """
    p = plan(obj)
    # a composite check needs the part size to be recomputed, except an empty object's (one empty part)
    if p.kind is None or (p.composite and obj.part_size_bytes is None and obj.size_bytes):
        return "sha256"  # nothing to compare with, or not recomputable
    b64 = p.method.startswith("checksum-")
    if p.composite:
        want, _, n = p.expected.partition("-")
        combined = new_digest(p.kind)
        combined.update(b"".join(d.parts))
        got_raw = combined.digest()
        got = base64.b64encode(got_raw).decode() if b64 else got_raw.hex()
        ok = got == want and len(d.parts) == int(n)
        got = f"{got}-{len(d.parts)}"
    else:
        raw = bytes.fromhex(d.sha256_hex) if p.kind == "sha256" else d.whole
        got = base64.b64encode(raw).decode() if b64 else raw.hex()
        ok = got == p.expected
    if not ok:
        what = {"checksum-sha256": "ChecksumSHA256", "checksum-crc64nvme": "ChecksumCRC64NVME",
                "checksum-crc32c": "ChecksumCRC32C", "checksum-crc32": "ChecksumCRC32",
                "source-sha256": "SHA-256", "git-blob-sha1": "git blob sha1", "etag-md5": "ETag (MD5)"}[p.method]
        raise ChecksumMismatchError(
            f"object '{obj.key}': {what} mismatch: downloaded {got}, source says {p.expected} (corrupted)"
        )
    return p.method
