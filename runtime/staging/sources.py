"""Where model files come from: S3 prefix, local folder, or Hugging Face Hub (`hf://`).

Each source lists its objects (`SourceObject`: key, relative path, size, ETag, checksums) and
reads byte ranges, so one transfer engine (`runtime.staging.transfer`) serves all three with
concurrent ranged reads and part-level resume.
"""

from __future__ import annotations

import base64
import mmap
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Protocol

from runtime.staging.keys import UnsafeKeyError, is_source_marker, relative_path
from runtime.staging.manifest import ChecksumMismatchError, SourceSelectionError, StagingError


@dataclass(frozen=True)
class SourceObject:
    """One source file.

    Attributes:
        key: source key (S3 key, repo path, or local relative path).
        rel: destination path relative to the model folder (safety-checked).
        size_bytes: object size, bytes.
        etag: S3 ETag without quotes; hf: LFS sha256 or git blob id; local: "<size>-<mtime_ns>".
        checksum_sha256: S3 ChecksumSHA256 (base64; composite objects end in "-<parts>") or None.
        checksum_crc64nvme / checksum_crc32c / checksum_crc32: S3 ChecksumCRC64NVME /
            ChecksumCRC32C / ChecksumCRC32, same format, or None.
        part_size_bytes: upload part size of a multipart S3 object (ETag/checksum "-N"), else None.
        sha256_hex: the source's own SHA-256 of the content (hf LFS files) or None.
        git_blob_sha1: git blob id of a non-LFS hf file (sha1 of "blob <size>\\0" + content) or None.
        sse_kms: the object is encrypted with a KMS key, SSE-KMS or DSSE-KMS (its ETag is not an MD5).
        unsafe: why its key cannot be a destination path (runtime.staging.keys.relative_path), or None; `rel`
            is then the key after the prefix as it stands, for the selection only: staging refuses the
            object if it is selected, and leaves it out otherwise.
    """

    key: str
    rel: str
    size_bytes: int
    etag: str
    checksum_sha256: str | None = None
    checksum_crc32c: str | None = None
    checksum_crc32: str | None = None
    checksum_crc64nvme: str | None = None
    part_size_bytes: int | None = None
    sha256_hex: str | None = None
    git_blob_sha1: str | None = None
    sse_kms: bool = False
    unsafe: str | None = None


class Source(Protocol):
    """A readable collection of model files.

    * `list_objects()` → every object under the source (keys safety-checked), or StagingError
      (missing bucket/folder, empty prefix).
    * `needs_describe(obj)` / `describe(obj)` → whether / how to fetch extra metadata (S3: HEAD for
      ChecksumSHA256, SSE and the multipart part size) before a multi-range download.
    * `read_whole(obj, chunk)` → (described obj, chunks) for one-request files (S3: the checksum
      comes back in the GET's headers). The chunks may be a `VerifiedBody`: then the transport
      itself computes the object's full-object checksum over the bytes and checks it (no second
      pass needed).
    * `read_range(obj, start, end, chunk)` → the bytes [start, end) in chunks of ≤ `chunk` bytes.
      Chunks may be views into one reused buffer (S3): each is valid until the next is requested.
    * `retryable` → exception types worth retrying mid-stream (connection resets, timeouts).
    * `revision` → after `list_objects()`, the immutable version every file was listed and is read at (hf://:
      the Hub commit the branch or tag resolved to); "" where the source has none (S3, a local folder).
    """

    uri: str
    retryable: tuple[type[BaseException], ...]
    revision: str

    def list_objects(self) -> list[SourceObject]: ...

    def needs_describe(self, obj: SourceObject) -> bool: ...

    def describe(self, obj: SourceObject) -> SourceObject: ...

    def read_whole(self, obj: SourceObject, chunk_bytes: int) -> tuple[SourceObject, Iterator[bytes]]: ...

    def read_range(self, obj: SourceObject, start: int, end: int, chunk_bytes: int) -> Iterator[bytes]: ...


class VerifiedBody:
    """Chunks of a response body whose full-object checksum (`kind`: sha256, crc64nvme, crc32c or
    crc32) the transport computes while they are read and checks against the object's S3 checksum
    at the end (raising `ChecksumMismatchError` on a mismatch). Iterate it once; then `digest()` is that
    checksum of exactly the bytes yielded (raw bytes), `sha256_hex()` the SHA-256 when kind is sha256."""

    def __init__(self, chunks: Iterator[bytes], digest: Any, kind: str = "sha256") -> None:
        self._chunks, self._digest, self.kind = chunks, digest, kind

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks

    def digest(self) -> bytes:
        """Raw digest of the bytes read (call after the iteration ended)."""
        return self._digest()

    def sha256_hex(self) -> str:
        """Hex SHA-256 of the bytes read (kind sha256 only; call after the iteration ended)."""
        assert self.kind == "sha256"
        return self._digest().hex()


def _read_into(body: Any, chunk_bytes: int, buf: memoryview | None = None) -> Iterator[memoryview]:
    """Stream a response body through one reused buffer (`readinto`: no allocation per chunk, which
    costs ~0.15 CPU s/GB with `read`); yields views valid until the next item. `buf`: the buffer to
    use (its first `chunk_bytes`), else a new one."""
    buf = memoryview(bytearray(chunk_bytes)) if buf is None else buf[:chunk_bytes]
    while n := body.readinto(buf):
        yield buf[:n]


class _WholeByRange:
    """`needs_describe`/`read_whole` for sources whose listing already carries all metadata."""

    def needs_describe(self, obj: SourceObject) -> bool:
        return False

    def read_whole(self, obj: SourceObject, chunk_bytes: int) -> tuple[SourceObject, Iterator[bytes]]:
        return obj, self.read_range(obj, 0, obj.size_bytes, chunk_bytes)  # type: ignore[attr-defined]


def _s3_retryable() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import (
        ConnectionClosedError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from urllib3.exceptions import ProtocolError

    return (
        ConnectionClosedError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
        ProtocolError,
        ConnectionError,
    )


def _with_checksums(obj: SourceObject, response: dict) -> SourceObject:
    """Copy S3's additional checksums and SSE mode from a HEAD/GET response onto `obj`."""
    return replace(
        obj,
        checksum_sha256=response.get("ChecksumSHA256"),
        checksum_crc32c=response.get("ChecksumCRC32C"),
        checksum_crc32=response.get("ChecksumCRC32"),
        checksum_crc64nvme=response.get("ChecksumCRC64NVME"),
        # "aws:kms" (SSE-KMS) and "aws:kms:dsse" (DSSE-KMS): S3 gives neither an MD5 ETag
        sse_kms=(response.get("ServerSideEncryption") or "").startswith("aws:kms"),
    )


S3_TRANSPORTS = ("auto", "http", "botocore")
S3_CHECKSUM_NAMES = {"sha256": "ChecksumSHA256", "crc64nvme": "ChecksumCRC64NVME", "crc32c": "ChecksumCRC32C",
                     "crc32": "ChecksumCRC32"}


class S3Source:
    """Objects under ``s3://bucket/prefix/`` read with ranged GETs (If-Match on the listed ETag).

    Listing and HEADs go through the boto3 client. The GETs (the bytes) go through `transport`:
    "http" — `runtime.staging.s3.S3HttpGetter` (signed by botocore's SigV4 signer, received by
    `http.client` straight into the reader's buffer: about half the CPU per byte of "botocore"; the
    full-object checksum of a one-request file is computed here while streaming, see `read_whole`);
    "botocore" — the client's `get_object` (botocore checks full-object checksums itself); "auto" —
    "http" unless the client uses a proxy or a non-SigV4 signer (`S3HttpGetter.usable`).
    """

    def __init__(self, uri: str, s3_client: Any, transport: str = "auto") -> None:
        from runtime.staging.s3 import S3HttpGetter, parse_s3_uri

        if transport not in S3_TRANSPORTS:
            raise StagingError(f"s3 transport {transport!r}: expected one of {', '.join(S3_TRANSPORTS)}")
        self.uri = uri
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.client = s3_client
        if transport == "auto":
            transport = "http" if S3HttpGetter.usable(s3_client) else "botocore"
        self.transport = transport
        self._http = S3HttpGetter(s3_client, self.bucket) if transport == "http" else None
        self.aligned_chunks = self._http is not None  # chunks are views of page-aligned (mmap) buffers
        self._tls = threading.local()
        self.retryable = _s3_retryable() + (S3HttpGetter.RETRYABLE if self._http else ())
        self.revision = ""  # each object is read at the ETag it was listed with (If-Match)

    def list_objects(self) -> list[SourceObject]:
        """List the prefix (paginated). Raises StagingError: missing bucket, denied, or empty prefix."""
        from botocore.exceptions import BotoCoreError, ClientError

        out: list[SourceObject] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
            for page in pages:
                for o in page.get("Contents", []):
                    key = o["Key"]
                    if key.endswith("/") and o["Size"] == 0:
                        continue  # "folder" marker objects
                    if is_source_marker(key, self.prefix):
                        continue  # a staged folder copied to S3: its marker is metadata, written anew
                    try:
                        rel, unsafe = relative_path(key, self.prefix), None
                    except UnsafeKeyError as e:  # refused only if selected: a stray log key must not stop a model
                        rel, unsafe = key[len(self.prefix):], str(e)
                    out.append(SourceObject(key=key, rel=rel, size_bytes=o["Size"], etag=o["ETag"].strip('"'),
                                            unsafe=unsafe))
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchBucket", "404"):
                raise SourceSelectionError(f"source {self.uri}: bucket '{self.bucket}' does not exist") from e
            raise StagingError(f"source {self.uri}: cannot list objects ({code}): {e}") from e
        except BotoCoreError as e:  # no credentials, invalid bucket name, endpoint unreachable, ...
            raise StagingError(f"source {self.uri}: cannot list objects: {type(e).__name__}: {e}") from e
        if not out:
            raise SourceSelectionError(f"source {self.uri}: no objects under prefix '{self.prefix}' (empty prefix)")
        if self._http is not None:
            try:
                serves = self._http.serves_bucket()
            except Exception:  # noqa: BLE001 - HeadBucket refused or failed: botocore's path still works
                serves = False
            if not serves:
                self._use_botocore()
        return out

    def _use_botocore(self) -> None:
        self._http, self.transport, self.aligned_chunks = None, "botocore", False

    def describe(self, obj: SourceObject) -> SourceObject:
        """HEAD the object for ChecksumSHA256 / SSE and, for multipart objects, the part size."""
        h = self.client.head_object(Bucket=self.bucket, Key=obj.key, ChecksumMode="ENABLED")
        etag = h["ETag"].strip('"')
        if etag != obj.etag or h["ContentLength"] != obj.size_bytes:
            raise StagingError(f"object '{obj.key}' changed while staging (ETag/size differ from listing)")
        described = _with_checksums(obj, h)
        part_size = None
        sums = (described.checksum_sha256, described.checksum_crc32c, described.checksum_crc32, described.checksum_crc64nvme)
        if obj.size_bytes == 0 and ("-" in etag or any(c and "-" in c for c in sums)):
            # an empty multipart object has exactly one empty part (every part but the last is at least
            # 5 MiB): no HEAD needed, and some S3-compatible servers (SeaweedFS) fail HEAD ?partNumber on it
            part_size = 0
        elif "-" in etag or any(c and "-" in c for c in sums):
            p1 = self.client.head_object(Bucket=self.bucket, Key=obj.key, PartNumber=1)
            part_size = int(p1["ContentLength"])
        return replace(described, part_size_bytes=part_size)

    def part_sizes(self, obj: SourceObject) -> list[int]:
        """Size of every upload part of a multipart object (HEAD with PartNumber = 1..N, N from the
        ETag's "-N"), for objects whose parts differ in size (S3 allows any part ≥ 5 MiB); [] when the
        object is not multipart."""
        n = int(obj.etag.rsplit("-", 1)[1]) if "-" in obj.etag and obj.etag.rsplit("-", 1)[1].isdigit() else 0
        return [int(self.client.head_object(Bucket=self.bucket, Key=obj.key, PartNumber=i)["ContentLength"])
                for i in range(1, n + 1)]

    def needs_describe(self, obj: SourceObject) -> bool:
        """Multipart objects: their part size is needed to check a composite checksum / the ETag."""
        return "-" in obj.etag

    def read_whole(self, obj: SourceObject, chunk_bytes: int) -> tuple[SourceObject, Iterator[bytes]]:
        """One GET of a single-part object; its checksum comes back in the response headers (no HEAD
        needed). A full-object checksum is validated while streaming (transport "http": here;
        "botocore": by botocore), so then the chunks come as a `VerifiedBody` carrying that digest (no
        second pass over the bytes)."""
        if self._http is not None:
            return self._http_read_whole(obj, chunk_bytes)
        from botocore import httpchecksum
        from botocore.exceptions import ClientError, FlexibleChecksumError

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=obj.key, IfMatch=f'"{obj.etag}"', ChecksumMode="ENABLED")
        except ClientError as e:
            if e.response.get("Error", {}).get("Code", "") in ("PreconditionFailed", "412"):
                raise StagingError(f"object '{obj.key}' changed while staging (ETag no longer {obj.etag})") from e
            raise
        described = _with_checksums(obj, r)
        digest = getattr(r["Body"], "checksum", None)  # botocore's StreamingChecksumBody
        verified_kind = None
        for kind, cls_name in (("sha256", "Sha256Checksum"), ("crc64nvme", "CrtCrc64NvmeChecksum"),
                               ("crc32c", "CrtCrc32cChecksum"), ("crc32", "CrtCrc32Checksum"), ("crc32", "Crc32Checksum")):
            cls = getattr(httpchecksum, cls_name, None)
            value = getattr(described, f"checksum_{kind}")
            if cls is not None and isinstance(digest, cls) and value and "-" not in value:
                verified_kind = kind
                break
        s3_name = S3_CHECKSUM_NAMES.get(verified_kind, "checksum")

        def chunks() -> Iterator[memoryview]:
            body = r["Body"]
            try:
                yield from _read_into(body, chunk_bytes)
            except FlexibleChecksumError as e:
                raise ChecksumMismatchError(
                    f"object '{obj.key}': {s3_name} mismatch detected by botocore while streaming (corrupted): {e}"
                ) from e
            finally:
                body.close()

        if verified_kind:
            return described, VerifiedBody(chunks(), digest.digest, verified_kind)
        return described, chunks()

    def read_range(self, obj: SourceObject, start: int, end: int, chunk_bytes: int) -> Iterator[bytes]:
        """Bytes [start, end) of the object; fails (PreconditionFailed) if its ETag changed."""
        if self._http is not None:
            resp = self._http_get(obj, {"Range": f"bytes={start}-{end - 1}", "If-Match": f'"{obj.etag}"'})
            if resp.status == 200 and (start, end) != (0, obj.size_bytes):
                self._http.discard(resp)
                raise StagingError(f"object '{obj.key}': the server ignored the Range header (HTTP 200)")
            yield from self._http_body(resp, chunk_bytes)
            return
        from botocore.exceptions import ClientError

        try:
            r = self.client.get_object(
                Bucket=self.bucket, Key=obj.key, Range=f"bytes={start}-{end - 1}", IfMatch=f'"{obj.etag}"'
            )
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "412"):
                raise StagingError(f"object '{obj.key}' changed while staging (ETag no longer {obj.etag})") from e
            raise
        body = r["Body"]
        try:
            yield from _read_into(body, chunk_bytes)
        finally:
            body.close()

    # ---- transport "http" (S3HttpGetter) ---------------------------------------------------------
    def _http_get(self, obj: SourceObject, headers: dict[str, str]) -> Any:
        """Signed GET; S3 errors become StagingErrors naming the key (5xx/429 stay retryable)."""
        assert self._http is not None
        try:
            return self._http.get(obj.key, headers)
        except StagingError as e:
            status = getattr(e, "status", None)
            if status == 412:
                raise StagingError(f"object '{obj.key}' changed while staging (ETag no longer {obj.etag})") from e
            if status == 404:
                raise StagingError(f"object '{obj.key}' no longer exists in {self.uri} ({e})") from e
            if status == 403:
                raise StagingError(f"object '{obj.key}': access denied ({e}); check the credentials' s3:GetObject "
                                   f"permission on {self.uri}") from e
            raise StagingError(f"object '{obj.key}': {e}") from e

    def _http_body(self, resp: Any, chunk_bytes: int) -> Iterator[memoryview]:
        """The response body through one reused buffer; a body not read to its end (error, abort)
        closes the connection instead of returning it to reuse."""
        import http.client

        assert self._http is not None
        done = False
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < chunk_bytes:  # one per thread: a thread reads one body at a time
            buf = self._tls.buf = memoryview(mmap.mmap(-1, chunk_bytes))  # page-aligned: O_DIRECT writes
        try:
            yield from _read_into(resp, chunk_bytes, buf)
            if resp.length:  # http.client's readinto ends quietly when the server closes mid-body
                raise http.client.IncompleteRead(b"", resp.length)
            done = True
        finally:
            if not done:
                self._http.discard(resp)

    def _http_read_whole(self, obj: SourceObject, chunk_bytes: int) -> tuple[SourceObject, Iterator[bytes]]:
        """`read_whole` over S3HttpGetter: the object's checksum comes from the GET's headers
        (x-amz-checksum-mode: ENABLED); a full-object checksum is computed here while the chunks stream
        and checked after the last one (a `VerifiedBody`, like botocore's own check)."""
        from runtime.staging.verify import new_digest, plan  # verify imports this module

        resp = self._http_get(obj, {"If-Match": f'"{obj.etag}"', "x-amz-checksum-mode": "ENABLED"})
        h = {k.lower(): v for k, v in resp.getheaders()}
        length = h.get("content-length")
        if length is not None and int(length) != obj.size_bytes:
            self._http.discard(resp)  # type: ignore[union-attr]
            raise StagingError(f"object '{obj.key}' changed while staging (size {length}, listed {obj.size_bytes})")
        described = _with_checksums(obj, {
            "ChecksumSHA256": h.get("x-amz-checksum-sha256"), "ChecksumCRC32C": h.get("x-amz-checksum-crc32c"),
            "ChecksumCRC32": h.get("x-amz-checksum-crc32"), "ChecksumCRC64NVME": h.get("x-amz-checksum-crc64nvme"),
            "ServerSideEncryption": h.get("x-amz-server-side-encryption"),
        })
        p = plan(described)
        if not p.method.startswith("checksum-") or p.composite:
            return described, self._http_body(resp, chunk_bytes)  # the engine's Hasher checks it
        kind, s3_name = p.kind, S3_CHECKSUM_NAMES[p.kind]
        digest = new_digest(kind)

        def chunks() -> Iterator[memoryview]:
            for b in self._http_body(resp, chunk_bytes):
                digest.update(b)
                yield b
            got = base64.b64encode(digest.digest()).decode()
            if got != p.expected:
                raise ChecksumMismatchError(f"object '{obj.key}': {s3_name} mismatch: downloaded {got}, "
                                            f"source says {p.expected} (corrupted)")

        return described, VerifiedBody(chunks(), digest.digest, kind)


def local_tag(st: os.stat_result) -> str:
    """The ETag stand-in of a local file: ``<size>-<mtime_ns>-<ctime_ns>-<inode>``.

    Size and mtime alone let a different file pass for an unchanged one when timestamps are
    normalised (tar, image builds, SOURCE_DATE_EPOCH, ``touch -d``): the kernel sets ctime on every
    write or metadata change and no tool can set it back, and the inode tells two files apart.
    A copy of the same bytes elsewhere therefore counts as changed (fetched again, never wrong)."""
    return f"{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}-{st.st_ino}"


class LocalSource(_WholeByRange):
    """Files under a local folder (plain path or file:// URI)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.root = Path(uri[7:] if uri.startswith("file://") else uri).expanduser()
        self.retryable: tuple[type[BaseException], ...] = ()
        self.revision = ""

    def check_folder(self) -> None:
        """Raises StagingError: the root is not a folder (a file, or nothing)."""
        if not self.root.is_dir():
            raise StagingError(f"source {self.uri}: " + ("is a file, not a folder (give the model folder)"
                                                         if self.root.exists() else "local folder does not exist"))

    def list_objects(self) -> list[SourceObject]:
        """Recursive listing. Raises StagingError: not a folder, or no files."""
        self.check_folder()
        out = []
        for p in sorted(self.root.rglob("*")):
            if not p.is_file():
                continue
            key = p.relative_to(self.root).as_posix()
            if is_source_marker(key, ""):
                continue  # a staged folder as the source: its marker is metadata, written anew
            st = p.stat()
            out.append(SourceObject(key=key, rel=relative_path(key, ""), size_bytes=st.st_size, etag=local_tag(st)))
        if not out:
            raise SourceSelectionError(f"source {self.uri}: folder holds no files")
        return out

    def describe(self, obj: SourceObject) -> SourceObject:
        return obj

    def read_range(self, obj: SourceObject, start: int, end: int, chunk_bytes: int) -> Iterator[bytes]:
        """Bytes [start, end) of the file. Raises StagingError when the file is not the one listed (its
        size, mtime or inode differ) before or after the read: the local If-Match, so a file rewritten
        while it is copied (an FSx auto-import, a writer still at work) is never published torn."""
        fd = os.open(self.root / obj.key, os.O_RDONLY)
        try:
            self._same_file(obj, fd)
            pos = start
            while pos < end:
                b = os.pread(fd, min(chunk_bytes, end - pos), pos)
                if not b:
                    raise StagingError(f"local file '{obj.key}' shrank while staging")
                pos += len(b)
                yield b
            self._same_file(obj, fd)
        finally:
            os.close(fd)

    def _same_file(self, obj: SourceObject, fd: int) -> None:
        # size, mtime and inode, not ctime: a Lustre HSM restore triggered by this very read (an FSx file
        # imported lazily from S3) changes ctime but not the bytes; any write changes mtime
        size, mtime, _ctime, ino = obj.etag.split("-")
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns, st.st_ino) != (int(size), int(mtime), int(ino)):
            raise StagingError(f"local file '{obj.key}' changed while staging (size, mtime or inode differ "
                               "from the listing); run again to stage the new version")


class HfSource(_WholeByRange):
    """A Hugging Face Hub repo: ``hf://org/name[@revision][/subfolder]`` (huggingface_hub + httpx ranges).

    The revision (a branch, a tag, or main) is resolved to its commit once, when listing, and every file is
    listed and downloaded at that commit (`revision`): a push to the branch while staging (or between a run
    and its resume) cannot mix files of two commits, and the marker records which commit was staged. LFS
    files are verified against the Hub's sha256, others against their git blob id. Needs the Hub to be
    reachable (HF_ENDPOINT and HF_TOKEN are honoured by huggingface_hub).
    """

    def __init__(self, uri: str) -> None:
        import httpx

        self.uri = uri
        self.repo_id, self.ref, self.prefix = _split_hf_uri(uri)
        self.revision = ""
        self.retryable = (httpx.TransportError,)
        self._http = httpx.Client(follow_redirects=True, timeout=httpx.Timeout(60.0, connect=10.0))

    def list_objects(self) -> list[SourceObject]:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
        try:
            commit = api.model_info(self.repo_id, revision=self.ref).sha
            if not commit:
                raise ValueError(f"the Hub named no commit for revision {self.ref!r}")
            tree = list(api.list_repo_tree(self.repo_id, revision=commit, recursive=True,
                                           path_in_repo=self.prefix or None))
        except Exception as e:  # noqa: BLE001 - offline, 401, 404: one clear error
            raise StagingError(f"source {self.uri}: cannot list the Hub repo: {type(e).__name__}: {e}") from e
        self.revision = commit
        out = []
        for f in tree:
            if not isinstance(f, RepoFile):
                continue
            lfs_sha = f.lfs.sha256 if f.lfs else None
            out.append(
                SourceObject(
                    key=f.path,
                    rel=relative_path(f.path, self.prefix),
                    size_bytes=f.size,
                    etag=lfs_sha or f.blob_id,
                    sha256_hex=lfs_sha,
                    git_blob_sha1=None if lfs_sha else f.blob_id,
                )
            )
        if not out:
            raise SourceSelectionError(f"source {self.uri}: no files")
        return out

    def describe(self, obj: SourceObject) -> SourceObject:
        return obj

    def read_range(self, obj: SourceObject, start: int, end: int, chunk_bytes: int) -> Iterator[bytes]:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        url = hf_hub_url(self.repo_id, obj.key, revision=self.revision, endpoint=os.environ.get("HF_ENDPOINT") or None)
        headers = build_hf_headers()
        headers["Range"] = f"bytes={start}-{end - 1}"
        with self._http.stream("GET", url, headers=headers) as r:
            if r.status_code not in (200, 206) or (r.status_code == 200 and start > 0):
                raise StagingError(f"hf file '{obj.key}': HTTP {r.status_code} for a range request")
            yield from r.iter_bytes(chunk_bytes)


def _split_hf_uri(uri: str) -> tuple[str, str, str]:
    """``hf://org/name[@revision][/subfolder]`` → (repo id, revision (default main), subfolder + '/' or "").
    Raises StagingError: not that form."""
    parts = uri[5:].split("/")
    name, _, rev = parts[1].partition("@") if len(parts) >= 2 else ("", "", "")
    if not parts[0] or not name:
        raise StagingError(f"source {uri!r}: expected hf://org/name[@revision][/subfolder]")
    sub = "/".join(parts[2:]).strip("/")
    return f"{parts[0]}/{name}", rev or "main", sub + "/" if sub else ""


def check_source(source: str) -> None:
    """Refuse a ``source`` that names no model folder, before anything is listed or fetched: empty (a path
    read as the current folder), an unsupported scheme, an ``s3://`` or ``hf://`` URI of the wrong form, or a
    local path (or ``file://`` URI) that is not a folder. Reads nothing remote.

    Raises:
        StagingError: the message names the source and what is wrong.
    """
    if not source.strip():
        raise StagingError(f"source {source!r}: empty; give s3://bucket/prefix/, hf://org/name or a model folder")
    if source.startswith("s3://"):
        from runtime.staging.s3 import parse_s3_uri

        parse_s3_uri(source)
    elif source.startswith("hf://"):
        _split_hf_uri(source)
    elif "://" in source and not source.startswith("file://"):
        raise StagingError(f"source {source!r}: unsupported scheme (use s3://, hf://, file:// or a path)")
    else:
        LocalSource(source).check_folder()


def open_source(source: str, s3_client: Any = None, s3_transport: str = "auto") -> Source:
    """Source for a URI: ``s3://`` (client: `s3_client` or `make_client()`; GETs over `s3_transport`,
    see `S3Source`), ``hf://``, else a local folder.

    Raises:
        StagingError: malformed URI.
    """
    check_source(source)
    if source.startswith("s3://"):
        if s3_client is None:
            from runtime.staging.s3 import make_client

            s3_client = make_client(transfer_methods=False)  # list/HEAD/GET only: no boto3 import
        return S3Source(source, s3_client, s3_transport)
    if source.startswith("hf://"):
        return HfSource(source)
    return LocalSource(source)
