"""Specification of range-by-range verification (`RangeHasher` + `assemble`): however a multipart
object is cut into download ranges (aligned to its upload parts for composite checks, anywhere for
full-object CRCs) and in whatever order the ranges finish, the joined digests equal the ones
computed directly over the object (hashlib / zlib / awscrt), so `check` passes on the right bytes
and fails on one flipped byte; a manifest that records only the verified checksum is re-checked by
a deep `verify_staged`."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import zlib
from pathlib import Path

import pytest
from awscrt.checksums import crc32c, crc64nvme

from runtime.staging.manifest import Manifest, ManifestEntry, StagingError, verify_staged, write_marker
from runtime.staging.sources import SourceObject
from runtime.staging.verify import RangeHasher, assemble, by_range, check, checksum_record

PART = 64 * 1024 + 5
DATA = os.urandom(5 * PART + 999)
UP_PARTS = [DATA[i : i + PART] for i in range(0, len(DATA), PART)]
N = len(UP_PARTS)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _crc(kind: str, b: bytes) -> bytes:
    if kind == "crc32":
        return zlib.crc32(b).to_bytes(4, "big")
    if kind == "crc32c":
        return crc32c(b).to_bytes(4, "big")
    return crc64nvme(b).to_bytes(8, "big")


def _objects() -> dict[str, SourceObject]:
    base = dict(key="p/w.safetensors", rel="w.safetensors", size_bytes=len(DATA))
    mp = dict(base, part_size_bytes=PART)
    out = {f"{k}-full": SourceObject(**base, etag="x", **{f"checksum_{k}": _b64(_crc(k, DATA))})
           for k in ("crc32", "crc32c", "crc64nvme")}
    for k in ("crc32", "crc32c"):
        out[f"{k}-composite"] = SourceObject(**mp, etag=f"{'0' * 32}-{N}", **{
            f"checksum_{k}": _b64(_crc(k, b"".join(_crc(k, p) for p in UP_PARTS))) + f"-{N}"})
    out["sha256-composite"] = SourceObject(**mp, etag=f"{'0' * 32}-{N}", checksum_sha256=_b64(
        hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in UP_PARTS)).digest()) + f"-{N}")
    out["etag-multipart"] = SourceObject(**mp, etag=hashlib.md5(b"".join(hashlib.md5(p).digest() for p in UP_PARTS)).hexdigest() + f"-{N}")
    return out


def _ranges(obj: SourceObject, seed: int) -> list[tuple[int, int]]:
    """Random cut points: multiples of the upload part for composite checks, anywhere for CRCs."""
    rng = random.Random(seed)
    step = obj.part_size_bytes if "-" in obj.etag else 1
    cuts = sorted({rng.randrange(1, len(DATA) // step) * step for _ in range(4)})
    edges = [0, *cuts, len(DATA)]
    return list(zip(edges, edges[1:]))


def _digest_ranges(obj: SourceObject, data: bytes, seed: int) -> list[tuple[int, list[bytes]]]:
    rng = random.Random(seed)
    spans = _ranges(obj, seed)
    results: dict[int, list[bytes]] = {}
    for i in rng.sample(range(len(spans)), len(spans)):  # ranges finish in any order
        start, end = spans[i]
        h = RangeHasher(obj, start, end)
        pos = start
        while pos < end:  # odd chunk sizes, crossing upload-part edges
            n = min(rng.choice([1, 333, 4096, 70_000]), end - pos)
            h.update(memoryview(data)[pos : pos + n])
            pos += n
        results[i] = h.result()
    return [(end - start, results[i]) for i, (start, end) in enumerate(spans)]


@pytest.mark.parametrize("name", list(_objects()))
@pytest.mark.parametrize("seed", range(3))
def test_joined_range_digests_verify_the_object_and_catch_a_flipped_byte(name: str, seed: int) -> None:
    obj = _objects()[name]
    assert by_range(obj)
    assert check(obj, assemble(obj, _digest_ranges(obj, DATA, seed))).startswith(("checksum-", "etag-md5"))
    bad = bytearray(DATA)
    bad[3 * PART + 17] ^= 0x40
    with pytest.raises(StagingError, match="mismatch"):
        check(obj, assemble(obj, _digest_ranges(obj, bytes(bad), seed)))


def test_a_composite_range_off_the_upload_part_grid_is_refused() -> None:
    obj = _objects()["sha256-composite"]
    with pytest.raises(ValueError, match="not aligned"):
        RangeHasher(obj, PART + 1, 2 * PART)


def test_checks_that_need_the_bytes_in_order_are_not_by_range() -> None:
    full_sha = SourceObject(key="k", rel="k", size_bytes=len(DATA), etag="x",
                            checksum_sha256=_b64(hashlib.sha256(DATA).digest()))
    single_md5 = SourceObject(key="k", rel="k", size_bytes=len(DATA), etag=hashlib.md5(DATA).hexdigest())
    assert not by_range(full_sha) and not by_range(single_md5)
    with pytest.raises(ValueError):
        RangeHasher(full_sha, 0, len(DATA))


def test_ranges_must_cover_the_object() -> None:
    obj = _objects()["crc32c-full"]
    with pytest.raises(ValueError, match="cover"):
        assemble(obj, [(len(DATA) - 1, [b"\0" * 4])])


@pytest.mark.parametrize("name", ["crc64nvme-full", "crc32-composite", "sha256-composite", "etag-multipart"])
def test_manifest_with_only_the_verified_checksum_is_deep_checked(tmp_path: Path, name: str) -> None:
    obj = _objects()[name]
    method = check(obj, assemble(obj, _digest_ranges(obj, DATA, 0)))
    checksum, part_bytes = checksum_record(obj, method)
    assert checksum and checksum.split(":", 1)[1] in (obj.etag, obj.checksum_crc64nvme, obj.checksum_crc32,
                                                      obj.checksum_sha256)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / obj.rel).write_bytes(DATA)
    m = Manifest(source="s3://b/p/", files=[ManifestEntry(key=obj.key, path=obj.rel, size_bytes=len(DATA), etag=obj.etag,
                                                          checksum=checksum, checksum_part_bytes=part_bytes,
                                                          verified_by=method)])
    write_marker(folder, m)
    assert verify_staged(folder) == m
    bad = bytearray(DATA)
    bad[7] ^= 1
    (folder / obj.rel).write_bytes(bytes(bad))
    assert verify_staged(folder, check_digests=False) == m  # same size: the quick check passes
    with pytest.raises(StagingError, match=r"w.safetensors.*corrupted"):
        verify_staged(folder)


def test_an_entry_without_any_digest_is_invalid() -> None:
    with pytest.raises(ValueError, match="neither sha256 nor checksum"):
        ManifestEntry(key="k", path="k", size_bytes=1, etag="e")
