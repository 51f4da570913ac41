"""Specification of the one-pass `Hasher`: however the bytes are chunked (slices larger than its
internal slice, chunks crossing upload-part boundaries, memoryviews), it yields exactly the digests
computed directly with hashlib / zlib / awscrt over the whole object and over each upload part; with
`sha256=False` it skips only the whole-file SHA-256 (the transport supplies it)."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import zlib

import pytest

from runtime.staging.sources import SourceObject
from runtime.staging.verify import SLICE_BYTES, Hasher, check

PART = 5 * 64 * 1024 + 3  # not a multiple of the hasher's slice on purpose
DATA = os.urandom(3 * PART + SLICE_BYTES + 12_345)
PARTS = [DATA[i : i + PART] for i in range(0, len(DATA), PART)]


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _feed(h: Hasher, seed: int) -> None:
    """Feed DATA in random chunk sizes (1 byte … 2.5 slices), alternating bytes and memoryviews."""
    rng, pos = random.Random(seed), 0
    while pos < len(DATA):
        n = rng.choice([1, 17, 4096, SLICE_BYTES - 1, SLICE_BYTES + 1, 5 * SLICE_BYTES // 2])
        piece = DATA[pos : pos + n]
        h.update(memoryview(bytearray(piece)) if rng.random() < 0.5 else piece)
        pos += len(piece)


@pytest.mark.parametrize("seed", range(5))
def test_composite_sha256_and_whole_sha256_from_one_pass_for_any_chunking(seed: int) -> None:
    combined = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in PARTS)).digest()
    obj = SourceObject(key="k", rel="k", size_bytes=len(DATA), etag=f"{'0' * 32}-{len(PARTS)}",
                       checksum_sha256=f"{_b64(combined)}-{len(PARTS)}", part_size_bytes=PART)
    h = Hasher(obj)
    _feed(h, seed)
    d = h.result()
    assert d.sha256_hex == hashlib.sha256(DATA).hexdigest()
    assert d.parts == [hashlib.sha256(p).digest() for p in PARTS]
    assert check(obj, d) == "checksum-sha256"


@pytest.mark.parametrize("seed", range(3))
def test_composite_crc32_and_multipart_md5_etag_split_at_upload_parts(seed: int) -> None:
    crcs = [zlib.crc32(p).to_bytes(4, "big") for p in PARTS]
    obj = SourceObject(key="k", rel="k", size_bytes=len(DATA), etag="x",
                       checksum_crc32=f"{_b64(zlib.crc32(b''.join(crcs)).to_bytes(4, 'big'))}-{len(PARTS)}",
                       part_size_bytes=PART)
    h = Hasher(obj)
    _feed(h, seed)
    d = h.result()
    assert d.parts == crcs and d.sha256_hex == hashlib.sha256(DATA).hexdigest()
    assert check(obj, d) == "checksum-crc32"

    md5s = [hashlib.md5(p).digest() for p in PARTS]
    etag = f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(PARTS)}"
    obj = SourceObject(key="k", rel="k", size_bytes=len(DATA), etag=etag, part_size_bytes=PART)
    h = Hasher(obj)
    _feed(h, seed + 10)
    assert check(obj, h.result()) == "etag-md5"


def test_full_object_crc32c_and_sha256_in_one_pass() -> None:
    from awscrt.checksums import crc32c

    obj = SourceObject(key="k", rel="k", size_bytes=len(DATA), etag="x",
                       checksum_crc32c=_b64(crc32c(DATA).to_bytes(4, "big")))
    h = Hasher(obj)
    _feed(h, 7)
    d = h.result()
    assert d.sha256_hex == hashlib.sha256(DATA).hexdigest()
    assert check(obj, d) == "checksum-crc32c"


def test_sha256_false_skips_only_the_whole_file_sha256() -> None:
    obj = SourceObject(key="k", rel="k", size_bytes=len(DATA), etag=hashlib.md5(DATA).hexdigest())
    h = Hasher(obj, sha256=False)
    _feed(h, 3)
    d = h.result()
    assert d.sha256_hex == ""
    assert d.whole == hashlib.md5(DATA).digest()  # the ETag check still has its MD5


def test_uneven_upload_parts_split_at_the_given_sizes() -> None:
    sizes = [PART + 1000, PART - 7, len(DATA) - 2 * PART - 993]
    cuts = [0, sizes[0], sizes[0] + sizes[1], len(DATA)]
    pieces = [DATA[a:b] for a, b in zip(cuts, cuts[1:])]
    crcs = [zlib.crc32(p).to_bytes(4, "big") for p in pieces]
    obj = SourceObject(key="k", rel="k", size_bytes=len(DATA), etag="x", part_size_bytes=PART,
                       checksum_crc32=f"{_b64(zlib.crc32(b''.join(crcs)).to_bytes(4, 'big'))}-3")
    h = Hasher(obj, part_sizes=sizes)
    _feed(h, 4)
    d = h.result()
    assert d.parts == crcs and check(obj, d) == "checksum-crc32"
    h = Hasher(obj)  # uniform parts assumed: the same bytes do not match
    _feed(h, 4)
    with pytest.raises(Exception, match="mismatch"):
        check(obj, h.result())
