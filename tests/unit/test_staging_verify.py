"""Specification: downloaded bytes are checked against the strongest thing the source offers
(ChecksumSHA256 > ChecksumCRC32C > ChecksumCRC32, each full-object or composite; source SHA-256 /
git blob id; MD5 ETag single or multipart); one flipped byte is always caught, naming the key.
Expected values follow the AWS definitions (checking-object-integrity docs), computed here directly
with hashlib / zlib / awscrt."""

from __future__ import annotations

import base64
import hashlib
import os
import zlib
from pathlib import Path

import pytest

from runtime.staging.manifest import StagingError
from runtime.staging.sources import SourceObject
from runtime.staging.verify import check, hash_file, plan

PART = 64 * 1024
DATA = os.urandom(3 * PART + 777)
PARTS = [DATA[i : i + PART] for i in range(0, len(DATA), PART)]
N = len(PARTS)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _crc32(b: bytes) -> bytes:
    return zlib.crc32(b).to_bytes(4, "big")


def _crc32c(b: bytes) -> bytes:
    from awscrt.checksums import crc32c

    return crc32c(b).to_bytes(4, "big")


def _objects() -> dict[str, tuple[SourceObject, str]]:
    base = dict(key="p/w.safetensors", rel="w.safetensors", size_bytes=len(DATA))
    mp = dict(base, etag=f"{'0' * 32}-{N}", part_size_bytes=PART)
    cases = {
        "sha256-full": (SourceObject(**base, etag="x", checksum_sha256=_b64(hashlib.sha256(DATA).digest())), "checksum-sha256"),
        "sha256-composite": (SourceObject(**mp, checksum_sha256=_b64(hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in PARTS)).digest()) + f"-{N}"), "checksum-sha256"),
        "crc32-full": (SourceObject(**base, etag="x", checksum_crc32=_b64(_crc32(DATA))), "checksum-crc32"),
        "crc32-composite": (SourceObject(**mp, checksum_crc32=_b64(_crc32(b"".join(_crc32(p) for p in PARTS))) + f"-{N}"), "checksum-crc32"),
        "etag-md5": (SourceObject(**base, etag=hashlib.md5(DATA).hexdigest()), "etag-md5"),
        "etag-multipart": (SourceObject(**dict(mp, etag=hashlib.md5(b"".join(hashlib.md5(p).digest() for p in PARTS)).hexdigest() + f"-{N}")), "etag-md5"),
        "source-sha256": (SourceObject(**base, etag="lfs", sha256_hex=hashlib.sha256(DATA).hexdigest()), "source-sha256"),
        "git-blob-sha1": (SourceObject(**base, etag="blob", git_blob_sha1=hashlib.sha1(f"blob {len(DATA)}\0".encode() + DATA).hexdigest()), "git-blob-sha1"),
    }
    try:
        cases["crc32c-full"] = (SourceObject(**base, etag="x", checksum_crc32c=_b64(_crc32c(DATA))), "checksum-crc32c")
        cases["crc32c-composite"] = (SourceObject(**mp, checksum_crc32c=_b64(_crc32c(b"".join(_crc32c(p) for p in PARTS))) + f"-{N}"), "checksum-crc32c")
    except ImportError:
        pass
    return cases


@pytest.mark.parametrize("mode", list(_objects()))
def test_correct_bytes_pass_and_a_flipped_byte_fails(tmp_path: Path, mode: str) -> None:
    obj, method = _objects()[mode]
    f = tmp_path / "w"
    f.write_bytes(DATA)
    d = hash_file(f, obj, chunk_bytes=10_000)  # chunk not aligned with parts on purpose
    assert d.sha256_hex == hashlib.sha256(DATA).hexdigest()
    assert check(obj, d) == method

    bad = bytearray(DATA)
    bad[2 * PART + 5] ^= 0x01
    f.write_bytes(bytes(bad))
    with pytest.raises(StagingError, match=r"'p/w.safetensors'.*mismatch.*corrupted"):
        check(obj, hash_file(f, obj))


def test_sha256_checksum_wins_over_crc_and_etag() -> None:
    obj = SourceObject(key="k", rel="k", size_bytes=1, etag="0" * 32, checksum_sha256="a", checksum_crc32="b", checksum_crc32c="c")
    assert plan(obj).method == "checksum-sha256"


def test_sse_kms_etag_is_not_treated_as_md5(tmp_path: Path) -> None:
    obj = SourceObject(key="k", rel="k", size_bytes=len(DATA), etag="0" * 32, sse_kms=True)
    f = tmp_path / "w"
    f.write_bytes(DATA)
    assert check(obj, hash_file(f, obj)) == "sha256"


@pytest.mark.parametrize("sse", ["aws:kms", "aws:kms:dsse"])
def test_kms_and_dsse_kms_objects_are_not_checked_against_their_etag(sse: str) -> None:
    """S3 gives objects encrypted with a KMS key (SSE-KMS, DSSE-KMS) an ETag that is not an MD5 of the bytes."""
    from runtime.staging.sources import _with_checksums

    obj = SourceObject(key="k", rel="k", size_bytes=len(DATA), etag=hashlib.md5(b"other").hexdigest())
    assert plan(_with_checksums(obj, {"ServerSideEncryption": "AES256"})).method == "etag-md5"  # SSE-S3: MD5
    kms = _with_checksums(obj, {"ServerSideEncryption": sse})
    assert kms.sse_kms and plan(kms).method == "sha256"


def _empty_md5(n: int = 1) -> str:
    return hashlib.md5(hashlib.md5(b"").digest() * n).hexdigest() + f"-{n}"


@pytest.mark.parametrize("part_size_bytes", [0, None])
@pytest.mark.parametrize("mode", ["etag-md5", "checksum-crc32"])
def test_an_empty_multipart_object_verifies_as_one_empty_part(
        tmp_path: Path, part_size_bytes: int | None, mode: str) -> None:
    """A zero-byte object uploaded as one empty part: ETag ``md5(md5(b""))-1`` (composite CRC likewise);
    the recorded checksum re-checks without a part size (a manifest's part size is ≥ 1)."""
    from runtime.staging.verify import checksum_record, object_for_record

    extra = {"checksum_crc32": _b64(_crc32(_crc32(b""))) + "-1"} if mode == "checksum-crc32" else {}
    obj = SourceObject(key="k", rel="k", size_bytes=0, etag=_empty_md5(), part_size_bytes=part_size_bytes, **extra)
    f = tmp_path / "empty"
    f.write_bytes(b"")
    assert check(obj, hash_file(f, obj)) == mode
    record, part = checksum_record(obj, mode)
    assert part is None
    again = object_for_record("k", 0, record, part)
    assert check(again, hash_file(f, again)) == mode
    two = SourceObject(key="k", rel="k", size_bytes=0, etag=_empty_md5(2), part_size_bytes=part_size_bytes)
    with pytest.raises(StagingError, match="mismatch"):  # one empty part, never two
        check(two, hash_file(f, two))
