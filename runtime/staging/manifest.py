"""Staged-model manifest, marker file and the reader-side check `verify_staged`.

A staged model folder is *valid* only when it holds the marker file `MARKER_NAME` whose JSON is a
`Manifest` and every file the manifest lists exists with the recorded size (and, for a deep check,
its recorded digest: the SHA-256 when recorded, else the source checksum it was verified against). The stager writes the marker last, after every file is fsynced, and publishes the folder
with a rename (see `runtime.staging.publish`), so a reader that checks the marker never sees a
half-written model. Readers (the runtime, the `promote` step) call `verify_staged` and refuse the
folder when it raises.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MARKER_NAME = ".pdserve-staged.json"
"""Marker file at the root of a published model folder; holds the `Manifest` as JSON."""

MANIFEST_VERSION = 2
"""2: `sha256` optional, `checksum` / `checksum_part_bytes` added (version-1 manifests still read)."""
HASH_CHUNK_BYTES = 8 << 20


class StagingError(RuntimeError):
    """Staging failed or a staged folder is invalid; the message names the key, file or field."""


class ChecksumMismatchError(StagingError):
    """Downloaded bytes differ from the source's checksum or ETag (flipped in transit, damaged on disk, or a
    bad source); the message names the key and both values."""


class SourceSelectionError(StagingError):
    """The source, or its files as selected (``include`` / ``exclude``, else the default model-folder
    selection), is no model to stage: a missing bucket, an empty prefix, folder or repo, no file that the
    selection takes, or none that holds weights. A bad value (the source or the globs), found before anything is
    copied."""


class DestinationError(StagingError):
    """The destination cannot be staged into as given (a filesystem root, a name too long, inside the source,
    a symbolic link, below a file, or a folder of other files): a bad value, found before anything is copied."""


class ManifestEntry(BaseModel):
    """One staged file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(description="Source object key (S3 key, hf:// path or local relative path).")
    path: str = Field(description="POSIX path of the file relative to the model folder.")
    size_bytes: int = Field(ge=0, description="File size, bytes.")
    etag: str = Field(description="Source ETag without quotes (S3), or `sources.local_tag` (size, mtime, ctime, inode) for local files.")
    sha256: str | None = Field(
        default=None,
        description="Hex SHA-256 of the whole staged file (64 lowercase hex chars); recorded when it was the "
        "check itself, when nothing else was available, or when asked for (StageOptions.record_sha256).",
    )
    checksum: str | None = Field(
        default=None,
        description="'<algorithm>:<value>' the bytes were verified against at staging, value as the source "
        "gives it: sha256|crc64nvme|crc32c|crc32 (S3 additional checksum, base64, composite '<b64>-<N>'), "
        "md5 (S3 ETag) or git-sha1 (git blob id). Re-checked by a deep `verify_staged`.",
    )
    checksum_part_bytes: int | None = Field(
        default=None, ge=1, description="Upload part size of a composite checksum / multipart ETag, bytes."
    )
    verified_by: str = Field(
        default="sha256",
        description="What the bytes were checked against at staging: checksum-sha256, checksum-crc32c, "
        "checksum-crc32 (S3 additional checksums), source-sha256 (hf LFS), git-blob-sha1 (hf), etag-md5, "
        "or sha256 (nothing to compare with: self-computed only, e.g. local folders).",
    )

    @field_validator("sha256")
    @classmethod
    def _hex64(cls, v: str | None) -> str | None:
        if v is not None and (len(v) != 64 or any(c not in "0123456789abcdef" for c in v)):
            raise ValueError(f"sha256 must be 64 lowercase hex characters, got {v!r}")
        return v

    @model_validator(mode="after")
    def _has_digest(self) -> "ManifestEntry":
        if self.sha256 is None and self.checksum is None:
            raise ValueError(f"entry '{self.path}' records neither sha256 nor checksum")
        return self

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        p = PurePosixPath(v)
        if not v or p.is_absolute() or ".." in p.parts or "\\" in v or "\x00" in v:
            raise ValueError(f"path must be a relative POSIX path inside the folder, got {v!r}")
        return v


class Manifest(BaseModel):
    """What was staged, from where, with per-file size, ETag and SHA-256."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(default=MANIFEST_VERSION, description="Manifest schema version.")
    source: str = Field(description="Source URI, e.g. s3://bucket/prefix/, hf://org/repo, /local/dir.")
    source_revision: str = Field(
        default="",
        description="The commit the source resolved to (hf://: the Hub commit every file was listed and "
        "downloaded at); empty for S3 and local sources.",
    )
    created_at: str = Field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"),
        description="UTC time the model was published (ISO 8601).",
    )
    files: list[ManifestEntry] = Field(description="Staged files, sorted by path.")

    @property
    def total_bytes(self) -> int:
        """Sum of file sizes, bytes."""
        return sum(f.size_bytes for f in self.files)

    def by_path(self) -> dict[str, ManifestEntry]:
        """Entries keyed by relative path."""
        return {f.path: f for f in self.files}


def sha256_file(path: Path, chunk_bytes: int = HASH_CHUNK_BYTES) -> str:
    """Hex SHA-256 of a file, read in `chunk_bytes` pieces (bounded memory).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (directories: makes renames/creations inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(folder: Path, manifest: Manifest) -> Path:
    """Write the marker (manifest JSON) into `folder` via temp file + fsync + rename; returns its path."""
    tmp = folder / (MARKER_NAME + ".tmp")
    data = manifest.model_dump_json(indent=2).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    final = folder / MARKER_NAME
    os.replace(tmp, final)
    fsync_path(folder)
    return final


def read_marker(folder: Path) -> Manifest:
    """Parse the marker of `folder`.

    Raises:
        StagingError: no marker, unreadable JSON, or a manifest field failing validation (named).
    """
    marker = Path(folder) / MARKER_NAME
    if not marker.is_file():
        raise StagingError(f"{folder}: not a staged model folder (no {MARKER_NAME} marker)")
    try:
        raw = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise StagingError(f"{marker}: unreadable marker: {e}") from e
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise StagingError(f"{marker}: invalid manifest field '{field}': {first['msg']}") from e


def digest_mismatch(folder: Path, entry: ManifestEntry) -> str | None:
    """Re-read one staged file and compare it with its recorded digest (the SHA-256 when recorded,
    else its `checksum`); returns a message naming the file and both values, or None when it matches.

    Raises:
        OSError: unreadable file.
    """
    from runtime.staging.verify import check, hash_file, object_for_record

    f = folder / entry.path
    if entry.sha256 is not None:
        digest = sha256_file(f)
        return None if digest == entry.sha256 else f"file '{entry.path}' SHA-256 {digest} != manifest {entry.sha256}"
    obj = object_for_record(entry.path, entry.size_bytes, entry.checksum or "", entry.checksum_part_bytes)
    try:
        check(obj, hash_file(f, obj, sha256=False))
    except StagingError as e:
        detail = str(e).removesuffix(" (corrupted)")
        return f"file '{entry.path}' does not match its manifest checksum {entry.checksum}: {detail}"
    return None


VERIFY_REPUBLISHED_RETRIES = 3


def _folder_identity(folder: Path) -> tuple[int, int] | None:
    try:
        st = folder.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def verify_staged(path: Path, *, check_digests: bool = True) -> Manifest:
    """Check that `path` is a complete, published model folder and return its manifest.

    Checks: the marker exists and validates; every listed file exists with the recorded size; with
    `check_digests` (default) also its recorded digest (`digest_mismatch`: reads every byte; ~1.5
    GB/s per core for SHA-256 with SHA-NI, ~4-25 GB/s for the CRCs).

    A stager may publish a new version while this runs (the folder is swapped whole, see
    `runtime.staging.publish`), so one pass can read the old marker and the new files. When the
    folder at `path` is no longer the one the pass started on, the check runs again on the new one
    (up to ``VERIFY_REPUBLISHED_RETRIES`` passes): the result is always one version's.

    Raises:
        StagingError: naming the folder and the first missing/mismatching file or manifest field.
    """
    folder = Path(path)
    for attempt in range(VERIFY_REPUBLISHED_RETRIES):
        before = _folder_identity(folder)
        try:
            manifest = _verify_once(folder, check_digests)
        except StagingError:
            if _folder_identity(folder) == before or attempt == VERIFY_REPUBLISHED_RETRIES - 1:
                raise
            continue  # republished during the pass: check the new version
        if _folder_identity(folder) == before:
            return manifest
    raise StagingError(f"{folder}: republished {VERIFY_REPUBLISHED_RETRIES} times while being checked; try again")


def _verify_once(folder: Path, check_digests: bool) -> Manifest:
    if not folder.is_dir():
        raise StagingError(f"{folder}: staged model folder does not exist")
    manifest = read_marker(folder)
    if not manifest.files:
        raise StagingError(f"{folder}: manifest lists no files")
    for entry in manifest.files:
        f = folder / entry.path
        if not f.is_file():
            raise StagingError(f"{folder}: file '{entry.path}' (key '{entry.key}') is missing")
        size = f.stat().st_size
        if size != entry.size_bytes:
            raise StagingError(
                f"{folder}: file '{entry.path}' has {size} bytes, manifest says {entry.size_bytes}"
            )
        if check_digests:
            problem = digest_mismatch(folder, entry)
            if problem:
                raise StagingError(f"{folder}: {problem} (corrupted)")
    return manifest
