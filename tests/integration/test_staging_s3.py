"""Specification of `stage_model` against a real S3 server (SeaweedFS on 127.0.0.1): verified copy
with the server's ChecksumSHA256 / ETag, clear errors for a missing bucket or empty prefix with
nothing written, idempotent re-runs, changed objects re-fetched, and corruption detected whether it
happens on the server's disk or on the wire (a byte-flipping TCP proxy on loopback)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import boto3
import pytest

from runtime.staging.manifest import StagingError, sha256_file, verify_staged
from runtime.staging.publish import sibling
from runtime.staging.s3 import make_client, upload_folder
from runtime.staging.stage import Stager, StageOptions, stage_model

pytestmark = pytest.mark.integration
MiB = 1 << 20


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2}')
    (d / "model-00001-of-00002.safetensors").write_bytes(os.urandom(11 * MiB))  # multipart upload
    (d / "model-00002-of-00002.safetensors").write_bytes(os.urandom(300_000))
    (d / "model.safetensors.index.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(os.urandom(5000))
    (d / "tokenizer.json").write_text('{"model": {}}')
    return d


def _opts(**kw) -> dict:  # noqa: ANN003
    return {"part_size_bytes": MiB, "concurrency": 4, **kw}


def test_stage_from_s3_verifies_against_server_checksums(s3_client, s3_bucket, model_dir, tmp_path) -> None:  # noqa: ANN001
    keys = upload_folder(model_dir, s3_bucket, "org/m", s3_client, multipart_chunk_bytes=5 * MiB)
    assert "org/m/pytorch_model.bin" in keys
    dest = tmp_path / "fsx" / "models" / "m"
    m = stage_model(f"s3://{s3_bucket}/org/m", dest, s3_client=s3_client, progress=False, **_opts())
    assert [f.path for f in m.files] == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]  # .bin skipped: safetensors exist
    assert {f.verified_by for f in m.files} == {"checksum-sha256"}
    for f in m.files:
        assert sha256_file(dest / f.path) == hashlib.sha256((model_dir / f.path).read_bytes()).hexdigest()
        assert f.checksum.startswith("sha256:")
        head = s3_client.head_object(Bucket=s3_bucket, Key=f.key)
        assert f.etag == head["ETag"].strip('"') and f.size_bytes == head["ContentLength"]
    big = next(f for f in m.files if f.path.startswith("model-00001"))
    assert big.etag.endswith("-3")  # 11 MiB in 5 MiB parts: composite checksum path exercised
    assert verify_staged(dest) == m


@pytest.mark.parametrize(
    ("algorithm", "method"),
    [(None, "checksum-crc32"), ("CRC32C", "checksum-crc32c"), ("CRC64NVME", "checksum-crc64nvme"), ("none", "etag-md5")],
)
def test_objects_without_sha256_are_verified_by_crc_or_etag(s3_server, s3_bucket, tmp_path, algorithm, method) -> None:  # noqa: ANN001
    """None: boto3's default (CRC32, full-object or composite); "none": no checksum at all → ETag."""
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = s3_server.client()
    if algorithm == "none":
        import boto3

        client = boto3.client("s3", endpoint_url=s3_server.endpoint_url, **s3_server.credentials,
                              config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required"))
    extra = {"ChecksumAlgorithm": algorithm} if algorithm not in (None, "none") else {}
    single, multi = os.urandom(200_000), os.urandom(12 * MiB)
    client.put_object(Bucket=s3_bucket, Key="m/config.json", Body=b'{"a": 1}', **extra)
    client.put_object(Bucket=s3_bucket, Key="m/a.safetensors", Body=single, **extra)
    cfg = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    path = tmp_path / "multi"
    path.write_bytes(multi)
    client.upload_file(str(path), s3_bucket, "m/b.safetensors", Config=cfg, ExtraArgs=extra)
    m = stage_model(f"s3://{s3_bucket}/m/", tmp_path / "dest", s3_client=client, progress=False, **_opts())
    by = m.by_path()
    assert by["b.safetensors"].etag.endswith("-3")
    assert {e.verified_by for e in m.files} == {method}
    assert sha256_file(tmp_path / "dest" / "b.safetensors") == hashlib.sha256(multi).hexdigest()
    assert by["b.safetensors"].checksum.split(":")[0] == method.split("-")[-1].replace("etag", "md5")
    assert by["b.safetensors"].sha256 is None  # the verified checksum is the record (no extra SHA-256 pass)
    assert verify_staged(tmp_path / "dest") == m  # deep check recomputes that checksum from the bytes


def test_missing_bucket_is_a_clear_error_and_writes_nothing(s3_client, tmp_path) -> None:  # noqa: ANN001
    dest = tmp_path / "fsx" / "m"
    with pytest.raises(StagingError, match="bucket 'no-such-bucket-x1' does not exist"):
        stage_model("s3://no-such-bucket-x1/m/", dest, s3_client=s3_client, progress=False)
    assert not dest.exists() and not sibling(dest, "staging").exists()


def test_empty_prefix_is_a_clear_error_and_writes_nothing(s3_client, s3_bucket, model_dir, tmp_path) -> None:  # noqa: ANN001
    upload_folder(model_dir, s3_bucket, "real", s3_client)
    dest = tmp_path / "fsx" / "m"
    with pytest.raises(StagingError, match="no objects under prefix 'typo/'"):
        stage_model(f"s3://{s3_bucket}/typo", dest, s3_client=s3_client, progress=False)
    assert not dest.exists() and not sibling(dest, "staging").exists()


def test_unchanged_rerun_is_a_noop_and_a_changed_object_is_refetched(s3_client, s3_bucket, model_dir, tmp_path) -> None:  # noqa: ANN001
    upload_folder(model_dir, s3_bucket, "m", s3_client)
    uri, dest = f"s3://{s3_bucket}/m", tmp_path / "m"
    first = Stager(uri, dest, s3_client=s3_client, options=StageOptions(**_opts())).run()
    assert first.transfer.bytes_downloaded == first.manifest.total_bytes
    again = Stager(uri, dest, s3_client=s3_client, options=StageOptions(**_opts())).run()
    assert again.unchanged and again.transfer.bytes_downloaded == 0

    s3_client.put_object(Bucket=s3_bucket, Key="m/tokenizer.json", Body=b'{"model": {"v": 2}}', ChecksumAlgorithm="SHA256")
    changed = Stager(uri, dest, s3_client=s3_client, options=StageOptions(**_opts())).run()
    assert not changed.unchanged
    assert changed.transfer.files_fetched == 1 and changed.files_linked == 4
    assert (dest / "tokenizer.json").read_bytes() == b'{"model": {"v": 2}}'
    assert verify_staged(dest).by_path()["tokenizer.json"].etag != first.manifest.by_path()["tokenizer.json"].etag


def test_corruption_on_the_server_disk_fails_staging_and_publishes_nothing(s3_server, s3_bucket, tmp_path) -> None:  # noqa: ANN001
    # SeaweedFS's needle CRC catches the flipped byte and never serves it: the GET hangs in its
    # internal retries (~26 s) and then answers 500. A short read timeout keeps the test fast; what
    # is specified is that staging fails naming the key and publishes nothing.
    client = make_client(s3_server.endpoint_url, **s3_server.credentials, max_attempts=1, read_timeout_s=2)
    data = os.urandom(300_000)
    client.put_object(Bucket=s3_bucket, Key="m/config.json", Body=b"{}", ChecksumAlgorithm="SHA256")
    client.put_object(Bucket=s3_bucket, Key="m/w.safetensors", Body=data, ChecksumAlgorithm="SHA256")
    needle = data[100_000:100_064]
    flipped = 0
    for f in (s3_server.data_dir / "data").rglob("*.dat"):
        raw = f.read_bytes()
        i = raw.find(needle)
        if i >= 0:
            with open(f, "r+b") as fh:
                fh.seek(i + 7)
                fh.write(bytes([raw[i + 7] ^ 0xFF]))
            flipped += 1
    assert flipped == 1
    dest = tmp_path / "m"
    with pytest.raises(StagingError, match="w.safetensors"):
        stage_model(f"s3://{s3_bucket}/m", dest, s3_client=client, progress=False, max_attempts=1, **_opts(concurrency=2))
    assert not dest.exists()


def shutdown_sockets(*socks: socket.socket, close: bool = False) -> None:
    """Shut both directions of each socket down (errors on already-dead ones ignored); close them too
    when `close`. The proxies' pipe threads end this way."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if close:
            s.close()


class FlipProxy:
    """TCP proxy on 127.0.0.1 in front of the S3 server that, in the server→client direction,
    flips one byte inside `needle` (mode "flip": every occurrence, or the first `flips`) or drops the
    connection right after the needle for the first `resets` occurrences (mode "reset")."""

    def __init__(self, upstream_port: int, needle: bytes, mode: str, resets: int = 1, flips: int | None = None) -> None:
        self.upstream_port, self.needle, self.mode, self.resets = upstream_port, needle, mode, resets
        self.flips = flips
        self.hits = 0
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closing:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pipe, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        tail = b""
        try:
            while data := src.recv(65536):
                if downstream:
                    buf = tail + data
                    i = buf.find(self.needle)
                    if i >= 0:
                        with self.lock:
                            self.hits += 1
                            limit = self.resets if self.mode == "reset" else self.flips
                            act = limit is None or self.hits <= limit
                        if act and self.mode == "flip":
                            j = i + len(self.needle) // 2
                            buf = buf[:j] + bytes([buf[j] ^ 0x01]) + buf[j + 1 :]
                        elif act:
                            dst.sendall(buf[len(tail) : i])
                            raise ConnectionResetError("proxy drop")
                    dst.sendall(buf[len(tail) :])
                    tail = buf[-(len(self.needle) - 1) :]
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            shutdown_sockets(src, dst, close=True)

    def close(self) -> None:
        self.closing = True
        self.sock.close()


def _proxied_client(s3_server, proxy: FlipProxy):  # noqa: ANN001, ANN202
    # SigV4 signs the Host header: the proxy forwards bytes unchanged, so sign for the proxy's address
    return make_client(f"http://127.0.0.1:{proxy.port}", **s3_server.credentials, max_attempts=2)


def test_bytes_corrupted_on_the_wire_are_detected_by_checksum(s3_server, s3_client, s3_bucket, tmp_path) -> None:  # noqa: ANN001
    data = os.urandom(400_000)
    s3_client.put_object(Bucket=s3_bucket, Key="m/w.safetensors", Body=data, ChecksumAlgorithm="SHA256")
    proxy = FlipProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]), data[200_000:200_032], "flip")
    try:
        dest = tmp_path / "m"
        with pytest.raises(StagingError, match=r"'m/w.safetensors': ChecksumSHA256 mismatch"):
            stage_model(f"s3://{s3_bucket}/m", dest, s3_client=_proxied_client(s3_server, proxy), progress=False, **_opts())
        assert proxy.hits >= 1
        assert not dest.exists()
        staging = sibling(dest, "staging")
        assert not (staging / "w.safetensors").exists()  # bad bytes are not kept for a resume
        # the next run (no proxy) fetches good bytes and publishes
        m = stage_model(f"s3://{s3_bucket}/m", dest, s3_client=s3_client, progress=False, **_opts())
        assert sha256_file(dest / "w.safetensors") == hashlib.sha256(data).hexdigest()
    finally:
        proxy.close()


def test_connection_dropped_mid_body_is_retried_from_the_last_byte(s3_server, s3_client, s3_bucket, tmp_path) -> None:  # noqa: ANN001
    data = os.urandom(3 * MiB)
    s3_client.put_object(Bucket=s3_bucket, Key="m/w.safetensors", Body=data, ChecksumAlgorithm="SHA256")
    proxy = FlipProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]), data[MiB + 4096 : MiB + 4128], "reset", resets=2)
    try:
        m = stage_model(
            f"s3://{s3_bucket}/m", tmp_path / "m", s3_client=_proxied_client(s3_server, proxy), progress=False,
            backoff_initial_s=0.01, **_opts(),
        )
        assert proxy.hits >= 3  # dropped twice, then passed
        assert m.files[0].sha256 == hashlib.sha256(data).hexdigest()
        assert m.files[0].verified_by == "checksum-sha256"
    finally:
        proxy.close()


def test_object_overwritten_between_listing_and_download_is_refused(s3_client, s3_bucket) -> None:  # noqa: ANN001
    from runtime.staging.sources import S3Source

    s3_client.put_object(Bucket=s3_bucket, Key="m/a.safetensors", Body=b"v1" * 1000)
    src = S3Source(f"s3://{s3_bucket}/m", s3_client)
    (obj,) = src.list_objects()
    s3_client.put_object(Bucket=s3_bucket, Key="m/a.safetensors", Body=b"v2" * 1000)
    with pytest.raises(StagingError, match="'m/a.safetensors' changed while staging"):
        src.read_whole(obj, 1024)
    with pytest.raises(StagingError, match="'m/a.safetensors' changed while staging"):
        list(src.read_range(obj, 0, 100, 1024))
    with pytest.raises(StagingError, match="'m/a.safetensors' changed while staging"):
        src.describe(obj)


def test_client_side_errors_are_named_staging_errors(s3_server, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """No credentials, or a bucket name S3 refuses (refused before any call): a StagingError naming the source,
    not a traceback."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # boto3's default session keeps the credentials it found first in this process (another test's)
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    no_creds = make_client(s3_server.endpoint_url)
    with pytest.raises(StagingError, match=r"s3://models/x.*NoCredentialsError"):
        stage_model("s3://models/x", tmp_path / "m", s3_client=no_creds, progress=False)
    with pytest.raises(StagingError, match=r"source 's3://Bad_Bucket!/x': bucket 'Bad_Bucket!' is not a valid S3"):
        stage_model("s3://Bad_Bucket!/x", tmp_path / "m", s3_client=s3_server.client(), progress=False)
    assert not (tmp_path / "m").exists()


def test_record_sha256_on_an_unchanged_source_adds_the_missing_sha256s(s3_client, s3_bucket, model_dir, tmp_path) -> None:  # noqa: ANN001
    upload_folder(model_dir, s3_bucket, "m", s3_client, multipart_chunk_bytes=5 * MiB)
    dest = tmp_path / "m"
    first = stage_model(f"s3://{s3_bucket}/m", dest, s3_client=s3_client, progress=False, **_opts())
    assert any(f.sha256 is None for f in first.files)
    again = stage_model(f"s3://{s3_bucket}/m", dest, s3_client=s3_client, progress=False, record_sha256=True, **_opts())
    assert all(f.sha256 == sha256_file(dest / f.path) for f in again.files)


@pytest.mark.parametrize("sizes_mib", [(5, 7, 1), (5, 5, 7)], ids=["middle-larger", "last-larger"])
@pytest.mark.parametrize("algorithm", ["CRC32", None])
def test_multipart_objects_with_uneven_part_sizes_are_verified(
        s3_client, s3_bucket, tmp_path, algorithm, sizes_mib) -> None:  # noqa: ANN001
    """S3 allows upload parts of different sizes (all but the last ≥ 5 MiB; the last may be the largest,
    e.g. joined by UploadPartCopy): the composite checksum / multipart ETag is checked at the real part
    boundaries (not reported as corruption)."""
    parts = [os.urandom(n * MiB) for n in sizes_mib]
    extra = {"ChecksumAlgorithm": algorithm} if algorithm else {}
    up = s3_client.create_multipart_upload(Bucket=s3_bucket, Key="m/w.safetensors", **extra)
    done = []
    for i, body in enumerate(parts, start=1):
        r = s3_client.upload_part(Bucket=s3_bucket, Key="m/w.safetensors", UploadId=up["UploadId"], PartNumber=i,
                                  Body=body, **extra)
        done.append({"PartNumber": i, "ETag": r["ETag"], **({"ChecksumCRC32": r["ChecksumCRC32"]} if algorithm else {})})
    s3_client.complete_multipart_upload(Bucket=s3_bucket, Key="m/w.safetensors", UploadId=up["UploadId"],
                                        MultipartUpload={"Parts": done})
    dest = tmp_path / "m"
    m = stage_model(f"s3://{s3_bucket}/m", dest, s3_client=s3_client, progress=False, **_opts())
    entry = m.files[0]
    assert entry.etag.endswith("-3")
    assert entry.verified_by == ("checksum-crc32" if algorithm else "etag-md5")
    assert entry.sha256 == hashlib.sha256(b"".join(parts)).hexdigest() == sha256_file(dest / "w.safetensors")
    assert verify_staged(dest) == m


@pytest.mark.parametrize("transport", ["http", "botocore"])
def test_an_empty_multipart_object_is_staged_and_verified(
        s3_client, s3_bucket, tmp_path, transport) -> None:  # noqa: ANN001
    """A zero-byte object uploaded as one empty part has a multipart ETag (``md5(md5(b""))-1``): it is
    checked as one empty part, and the published folder re-verifies."""
    s3_client.put_object(Bucket=s3_bucket, Key="m/config.json", Body=b"{}")
    up = s3_client.create_multipart_upload(Bucket=s3_bucket, Key="m/empty.safetensors")
    r = s3_client.upload_part(Bucket=s3_bucket, Key="m/empty.safetensors", UploadId=up["UploadId"], PartNumber=1,
                              Body=b"")
    s3_client.complete_multipart_upload(Bucket=s3_bucket, Key="m/empty.safetensors", UploadId=up["UploadId"],
                                        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": r["ETag"]}]})
    dest = tmp_path / "m"
    m = stage_model(f"s3://{s3_bucket}/m", dest, s3_client=s3_client, progress=False, s3_transport=transport)
    entry = m.by_path()["empty.safetensors"]
    assert entry.etag == hashlib.md5(hashlib.md5(b"").digest()).hexdigest() + "-1"
    assert entry.verified_by == "etag-md5" and entry.size_bytes == 0
    assert (dest / "empty.safetensors").read_bytes() == b""
    assert verify_staged(dest, check_digests=True) == m


def test_the_local_server_has_volume_slots_for_many_buckets_and_deleted_buckets_free_theirs(s3_server, s3_client) -> None:  # noqa: ANN001
    """SeaweedFS's automatic slot count (free disk / 1 GiB) ran out on a small CI disk: each bucket
    with data pins a volume slot until deleted, and PutObject then fails with InternalError."""
    import httpx

    from tests.conftest_s3 import delete_bucket

    def topology() -> dict:
        url = f"http://127.0.0.1:{s3_server.ports['master.port']}/dir/status"
        return httpx.get(url, timeout=10).json()["Topology"]

    def free() -> int:
        return int(topology()["Free"])

    assert int(topology()["Max"]) == s3_server.max_volumes >= 256
    before = free()
    names = [f"slots-{uuid.uuid4().hex[:12]}" for _ in range(3)]
    for name in names:
        s3_client.create_bucket(Bucket=name)
        s3_client.put_object(Bucket=name, Key="k", Body=b"x")
    assert free() <= before - 3
    for name in names:
        delete_bucket(s3_client, name)
    deadline = time.monotonic() + 15
    while free() < before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free() == before
