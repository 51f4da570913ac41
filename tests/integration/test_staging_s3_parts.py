"""Specification against a real S3 server (SeaweedFS on 127.0.0.1): ranged GETs need not follow the
objects' upload parts — with GETs larger than, or not a multiple of, the 5 MiB upload parts, the
composite ChecksumSHA256 is still recomputed per upload part (by the download threads, range by
range) and the staged bytes are right; the manifest records the verified checksum, and the whole-file
SHA-256 only on request; a single-request object's SHA-256 comes from botocore's own ChecksumSHA256
check (one pass), and a
dropped connection restarts such a GET rather than continuing a digest it cannot resume."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from runtime.staging.manifest import sha256_file, verify_staged
from runtime.staging.s3 import upload_folder
from runtime.staging.sources import S3Source, VerifiedBody
from runtime.staging.stage import stage_model

pytestmark = pytest.mark.integration
MiB = 1 << 20


@pytest.fixture
def uploaded(s3_client, s3_bucket, tmp_path) -> tuple[str, dict[str, str]]:  # noqa: ANN001
    d = tmp_path / "src"
    d.mkdir()
    files = {"model-00001-of-00002.safetensors": os.urandom(23 * MiB + 17),  # 5 upload parts of 5 MiB
             "model-00002-of-00002.safetensors": os.urandom(700_000), "config.json": b'{"a": 1}'}
    for name, data in files.items():
        (d / name).write_bytes(data)
    upload_folder(d, s3_bucket, "m", s3_client, multipart_chunk_bytes=5 * MiB)
    return f"s3://{s3_bucket}/m", {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}


@pytest.mark.parametrize("part_size_bytes", [8 * MiB, 7 * MiB + 4096, 32 * MiB])
def test_gets_larger_than_upload_parts_verify_the_composite_checksum(s3_client, uploaded, tmp_path, part_size_bytes) -> None:  # noqa: ANN001
    uri, digests = uploaded
    m = stage_model(uri, tmp_path / "m", s3_client=s3_client, progress=False, part_size_bytes=part_size_bytes,
                    concurrency=3)
    assert {f.path: sha256_file(tmp_path / "m" / f.path) for f in m.files} == digests
    assert {f.verified_by for f in m.files} == {"checksum-sha256"}
    big = m.by_path()["model-00001-of-00002.safetensors"]
    assert big.etag.endswith("-5")  # the composite path was exercised
    assert big.checksum.startswith("sha256:") and big.checksum.endswith("-5") and big.checksum_part_bytes == 5 * MiB
    assert big.sha256 is None  # not asked for: the composite checksum is the record
    small = m.by_path()["model-00002-of-00002.safetensors"]
    assert small.sha256 == digests[small.path]  # a full-object ChecksumSHA256 IS the file's SHA-256
    assert verify_staged(tmp_path / "m") == m


def test_record_sha256_adds_the_whole_file_sha256_to_every_entry(s3_client, uploaded, tmp_path) -> None:  # noqa: ANN001
    uri, digests = uploaded
    m = stage_model(uri, tmp_path / "m", s3_client=s3_client, progress=False, record_sha256=True, concurrency=3)
    assert {f.path: f.sha256 for f in m.files} == digests
    assert {f.verified_by for f in m.files} == {"checksum-sha256"}
    assert verify_staged(tmp_path / "m") == m


def test_single_request_sha256_comes_from_botocores_check(s3_client, uploaded) -> None:  # noqa: ANN001
    uri, digests = uploaded
    src = S3Source(uri, s3_client)
    obj = next(o for o in src.list_objects() if o.rel == "model-00002-of-00002.safetensors")
    described, body = src.read_whole(obj, MiB)
    assert isinstance(body, VerifiedBody) and described.checksum_sha256
    data = b"".join(body)
    assert len(data) == obj.size_bytes
    assert body.sha256_hex() == digests[obj.rel] == hashlib.sha256(data).hexdigest()


def test_connection_dropped_mid_single_request_body_restarts_that_get(s3_server, s3_client, s3_bucket, tmp_path) -> None:  # noqa: ANN001
    """A one-request file hashed by botocore cannot continue mid-body: its GET restarts from byte 0,
    and the recorded SHA-256 is still that of the whole object."""
    from tests.integration.test_staging_s3 import FlipProxy, _proxied_client

    data = os.urandom(600_000)
    s3_client.put_object(Bucket=s3_bucket, Key="r/w.safetensors", Body=data, ChecksumAlgorithm="SHA256")
    proxy = FlipProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]), data[300_000:300_032], "reset", resets=1)
    try:
        m = stage_model(f"s3://{s3_bucket}/r", tmp_path / "m", s3_client=_proxied_client(s3_server, proxy),
                        progress=False, backoff_initial_s=0.01, part_size_bytes=MiB)
        assert proxy.hits >= 2  # dropped once, then passed
        assert m.files[0].sha256 == hashlib.sha256(data).hexdigest()
        assert m.files[0].verified_by == "checksum-sha256"
    finally:
        proxy.close()
