"""Specification of the two byte paths of an s3:// source against a real S3 server (SeaweedFS on
127.0.0.1): "http" (`S3HttpGetter`: botocore's SigV4 signer, http.client, O_DIRECT writes) and
"botocore" (`get_object`) stage the same verified bytes; "http" turns S3's answers into clear errors
(403 denied, 404 gone, 412 changed), retries throttling (503 SlowDown) with backoff, detects bytes
corrupted on the wire in one-request files and in ranges, and signs keys with any characters; "auto"
falls back to botocore behind a proxy."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from pathlib import Path

import pytest

from runtime.staging.manifest import StagingError, sha256_file, verify_staged
from runtime.staging.s3 import S3HttpGetter, make_client, upload_folder
from runtime.staging.sources import S3Source
from runtime.staging.stage import stage_model
from runtime.staging.transfer import TransferEngine
from tests.integration.test_staging_s3 import FlipProxy, _proxied_client, shutdown_sockets

pytestmark = pytest.mark.integration
MiB = 1 << 20
TRANSPORTS = ["http", "botocore"]


@pytest.fixture
def mixed_model(s3_client, s3_bucket, tmp_path) -> tuple[str, dict[str, str]]:  # noqa: ANN001
    """A composite-CRC32 multipart shard (3 × 5 MiB parts, uneven tail), a full-object CRC32 file, a
    full-object SHA-256 file and a tiny config: every check the stager uses."""
    d = tmp_path / "src"
    d.mkdir()
    files = {"model-00001-of-00002.safetensors": os.urandom(12 * MiB + 4097),
             "model-00002-of-00002.safetensors": os.urandom(MiB + 333), "config.json": b'{"a": 1}'}
    for name, data in files.items():
        (d / name).write_bytes(data)
    upload_folder(d, s3_bucket, "m", s3_client, multipart_chunk_bytes=5 * MiB, checksum_algorithm="CRC32")
    s3_client.put_object(Bucket=s3_bucket, Key="m/tokenizer.json", Body=b'{"t": 2}' * 50_000, ChecksumAlgorithm="SHA256")
    files["tokenizer.json"] = b'{"t": 2}' * 50_000
    return f"s3://{s3_bucket}/m", {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("part_size_bytes", [MiB, 32 * MiB])
def test_both_transports_stage_the_same_verified_bytes(s3_client, mixed_model, tmp_path, transport, part_size_bytes) -> None:  # noqa: ANN001
    uri, digests = mixed_model
    m = stage_model(uri, tmp_path / "m", s3_client=s3_client, progress=False, s3_transport=transport,
                    part_size_bytes=part_size_bytes, concurrency=3)
    assert {f.path: sha256_file(tmp_path / "m" / f.path) for f in m.files} == digests
    by = m.by_path()
    assert by["model-00001-of-00002.safetensors"].checksum.startswith("crc32:")
    assert by["model-00001-of-00002.safetensors"].checksum.endswith("-3")  # composite, per upload part
    assert by["model-00002-of-00002.safetensors"].verified_by == "checksum-crc32"
    assert by["tokenizer.json"].verified_by == "checksum-sha256"
    assert by["tokenizer.json"].sha256 == digests["tokenizer.json"]  # the full-object SHA-256 check's digest
    assert verify_staged(tmp_path / "m", check_digests=True) == m


def test_auto_uses_http_unless_a_proxy_is_configured(s3_client, s3_bucket, monkeypatch) -> None:  # noqa: ANN001
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert S3Source(f"s3://{s3_bucket}/m", s3_client).transport == "http"
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert S3Source(f"s3://{s3_bucket}/m", s3_client).transport == "botocore"
    with pytest.raises(StagingError, match="s3 transport 'curl'"):
        S3Source(f"s3://{s3_bucket}/m", s3_client, "curl")


def test_keys_with_any_characters_are_signed_and_fetched(s3_client, s3_bucket, tmp_path) -> None:  # noqa: ANN001
    data = {k: os.urandom(3000) for k in ("m/a b+c=d.json", "m/ünï/çødé.safetensors", "m/x~y!$&'()*,;@.json",
                                           "m/q%20z.json")}
    for k, v in data.items():
        s3_client.put_object(Bucket=s3_bucket, Key=k, Body=v)
    stage_model(f"s3://{s3_bucket}/m", tmp_path / "m", s3_client=s3_client, progress=False, include=["*"],
                s3_transport="http")
    for k, v in data.items():
        assert (tmp_path / "m" / k[2:]).read_bytes() == v


def test_http_errors_are_named_staging_errors(s3_server, s3_client, s3_bucket, tmp_path) -> None:  # noqa: ANN001
    s3_client.put_object(Bucket=s3_bucket, Key="m/a.safetensors", Body=b"x" * 5000)
    src = S3Source(f"s3://{s3_bucket}/m", s3_client, "http")
    (obj,) = src.list_objects()
    denied = S3Source(f"s3://{s3_bucket}/m", make_client(s3_server.endpoint_url, aws_access_key_id=s3_server.access_key_id,
                                                        aws_secret_access_key="wrong-secret", max_attempts=1), "http")
    with pytest.raises(StagingError, match=r"'m/a.safetensors': access denied \(HTTP 403"):
        list(denied.read_range(obj, 0, 100, 1024))
    s3_client.delete_object(Bucket=s3_bucket, Key="m/a.safetensors")
    with pytest.raises(StagingError, match=r"'m/a.safetensors' no longer exists .*HTTP 404"):
        src.read_whole(obj, 1024)


class ThrottleProxy:
    """TCP proxy on 127.0.0.1 that answers the first `throttle` requests with HTTP 503 SlowDown (as S3
    does under load) and pipes the rest to the S3 server."""

    def __init__(self, upstream_port: int, throttle: int) -> None:
        self.upstream_port, self.left, self.throttled = upstream_port, throttle, 0
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        with self.lock:
            throttle = self.left > 0
            self.left -= throttle
            self.throttled += throttle
        try:
            if throttle:
                head = b""
                while b"\r\n\r\n" not in head and (chunk := c.recv(65536)):
                    head += chunk
                body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                c.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                return
            u = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pipe, args=(u, c), daemon=True).start()
            self._pipe(c, u)
        except OSError:
            pass
        finally:
            if throttle:
                c.close()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            shutdown_sockets(src, dst)

    def close(self) -> None:
        self.sock.close()


def test_throttling_is_retried_with_backoff(s3_server, s3_client, s3_bucket, tmp_path) -> None:  # noqa: ANN001
    data = os.urandom(3 * MiB)
    s3_client.put_object(Bucket=s3_bucket, Key="m/w.safetensors", Body=data, ChecksumAlgorithm="CRC32")
    src = S3Source(f"s3://{s3_bucket}/m", s3_client, "http")
    (obj,) = src.list_objects()
    proxy = ThrottleProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]), throttle=3)
    try:
        through = S3Source(f"s3://{s3_bucket}/m", make_client(f"http://127.0.0.1:{proxy.port}", **s3_server.credentials), "http")
        # one request per file (no HEAD through botocore, which retries throttling itself)
        eng = TransferEngine(through, tmp_path / "staging", part_size_bytes=4 * MiB, backoff_initial_s=0.01, fsync=False)
        (entry,) = eng.fetch([obj])
        assert proxy.throttled == 3
        assert entry.verified_by == "checksum-crc32"
        assert sha256_file(tmp_path / "staging" / "w.safetensors") == hashlib.sha256(data).hexdigest()
        one_try = TransferEngine(through, tmp_path / "s2", max_attempts=1, part_size_bytes=4 * MiB, fsync=False)
        proxy.left = 1
        with pytest.raises(StagingError, match=r"'m/w.safetensors'.*HTTP 503 SlowDown"):
            one_try.fetch([obj])
    finally:
        proxy.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("size", "checksum"), [(400_000, "SHA256"), (400_000, "CRC32"), (3 * MiB, "CRC32")])
def test_bytes_corrupted_on_the_wire_are_detected(s3_server, s3_client, s3_bucket, tmp_path, transport, size, checksum) -> None:  # noqa: ANN001
    """One-request files (400 kB: full-object check while streaming) and ranged ones (3 MiB in 1 MiB
    GETs: range CRCs combined) — on both transports."""
    data = os.urandom(size)
    s3_client.put_object(Bucket=s3_bucket, Key="m/w.safetensors", Body=data, ChecksumAlgorithm=checksum)
    proxy = FlipProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]), data[size // 2 : size // 2 + 32], "flip")
    try:
        with pytest.raises(StagingError, match=rf"'m/w.safetensors'.*Checksum{checksum} mismatch"):
            stage_model(f"s3://{s3_bucket}/m", tmp_path / "m", s3_client=_proxied_client(s3_server, proxy),
                        progress=False, s3_transport=transport, part_size_bytes=MiB, max_attempts=1)
        assert proxy.hits >= 1 and not (tmp_path / "m").exists()
    finally:
        proxy.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("size", "checksum"), [(400_000, "SHA256"), (400_000, "CRC32"), (3 * MiB, "CRC32")])
def test_a_file_corrupted_once_on_the_wire_is_fetched_again_in_the_same_run(
        s3_server, s3_client, s3_bucket, tmp_path, transport, size, checksum) -> None:  # noqa: ANN001
    """One flip in transit, then clean bytes: the file is fetched once more from scratch and published,
    whether its full-object checksum is checked while it streams (one request) or after its ranges."""
    data = os.urandom(size)
    s3_client.put_object(Bucket=s3_bucket, Key="m/w.safetensors", Body=data, ChecksumAlgorithm=checksum)
    proxy = FlipProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]), data[size // 2 : size // 2 + 32], "flip", flips=1)
    progress: list[int] = []
    try:
        src = S3Source(f"s3://{s3_bucket}/m", _proxied_client(s3_server, proxy), transport)
        eng = TransferEngine(src, tmp_path / "s", part_size_bytes=MiB, max_attempts=1, on_bytes=progress.append)
        (entry,) = eng.fetch(src.list_objects())
        assert proxy.hits == 2 and eng.stats.files_refetched == 1
        assert sha256_file(tmp_path / "s" / "w.safetensors") == hashlib.sha256(data).hexdigest()
        assert entry.verified_by == f"checksum-{checksum.lower()}"
        assert sum(progress) == size  # the failed fetch's bytes were taken back
    finally:
        proxy.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_connection_dropped_mid_range_resumes_from_the_last_byte(s3_server, s3_client, s3_bucket, tmp_path, transport) -> None:  # noqa: ANN001
    data = os.urandom(3 * MiB)
    s3_client.put_object(Bucket=s3_bucket, Key="m/w.safetensors", Body=data, ChecksumAlgorithm="CRC32")
    proxy = FlipProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]), data[MiB + 4096 : MiB + 4128], "reset", resets=2)
    try:
        m = stage_model(f"s3://{s3_bucket}/m", tmp_path / "m", s3_client=_proxied_client(s3_server, proxy),
                        progress=False, s3_transport=transport, part_size_bytes=MiB, backoff_initial_s=0.01)
        assert proxy.hits >= 3
        assert sha256_file(tmp_path / "m" / "w.safetensors") == hashlib.sha256(data).hexdigest()
        assert m.files[0].verified_by == "checksum-crc32"
    finally:
        proxy.close()


def _supports_o_direct(folder: Path) -> bool:
    try:
        os.close(os.open(folder / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        (folder / ".probe").unlink(missing_ok=True)


@pytest.mark.parametrize("folder", ["tmp", "/dev/shm"])
def test_direct_io_writes_aligned_chunks_and_falls_back_where_unsupported(s3_client, mixed_model, tmp_path, folder, monkeypatch) -> None:  # noqa: ANN001
    """On a filesystem with O_DIRECT (ext4, xfs, Lustre) the aligned chunks bypass the page cache; tmpfs
    refuses O_DIRECT and everything goes through the page cache. The bytes are right either way, also
    with GETs that are not a multiple of 4 KiB (their chunks go through the page cache)."""
    base = tmp_path if folder == "tmp" else Path(folder)
    if not base.is_dir():
        pytest.skip(f"{folder} missing")
    direct = _supports_o_direct(base)
    writes = {"direct": 0}
    real = TransferEngine._write_direct

    def spy(self, fs, b, pos):  # noqa: ANN001, ANN202
        writes["direct"] += 1
        return real(self, fs, b, pos)

    monkeypatch.setattr(TransferEngine, "_write_direct", spy)
    uri, digests = mixed_model
    for part in (8 * MiB, MiB - 1000):  # MiB - 1000: the 1 MiB full-CRC32 file's ranges are not 4 KiB-aligned
        dest = base / f"pdserve-direct-{os.getpid()}-{part}" / "m"
        try:
            m = stage_model(uri, dest, s3_client=s3_client, progress=False, part_size_bytes=part, concurrency=2)
            assert {f.path: sha256_file(dest / f.path) for f in m.files} == digests
        finally:
            import shutil

            shutil.rmtree(dest.parent, ignore_errors=True)
    assert (writes["direct"] > 0) == direct


def test_a_get_after_an_abandoned_body_on_the_same_thread_uses_a_new_connection(s3_client, s3_bucket) -> None:  # noqa: ANN001
    """A reader left mid-body (an exception in the consumer) must not make the thread's next GET fail:
    the kept-alive connection is replaced; the abandoned reader ends with a retryable error, never
    with another body's bytes."""
    import http.client

    d1, d2 = os.urandom(3 * MiB), os.urandom(MiB)
    s3_client.put_object(Bucket=s3_bucket, Key="m/1", Body=d1)
    s3_client.put_object(Bucket=s3_bucket, Key="m/2", Body=d2)
    src = S3Source(f"s3://{s3_bucket}/m", s3_client, "http")
    o1, o2 = sorted(src.list_objects(), key=lambda o: o.key)
    abandoned = src.read_range(o1, 0, o1.size_bytes, 64 << 10)
    assert bytes(next(abandoned)) == d1[: 64 << 10]
    assert b"".join(bytes(b) for b in src.read_range(o2, 0, o2.size_bytes, 64 << 10)) == d2
    with pytest.raises(http.client.IncompleteRead):
        list(abandoned)
    assert isinstance(http.client.IncompleteRead(b""), src.retryable)


def test_staging_from_the_environment_never_imports_boto3(s3_server, mixed_model, tmp_path) -> None:  # noqa: ANN001
    """The stager's own client comes from botocore's session (`make_client(transfer_methods=False)`):
    importing boto3 + s3transfer would add ~0.1 s to every stage's start-up."""
    import json
    import subprocess
    import sys

    uri, digests = mixed_model
    code = ("import json, sys; from pathlib import Path; from runtime.staging.stage import stage_model; "
            "m = stage_model(sys.argv[1], Path(sys.argv[2]), progress=False); "
            "print(json.dumps({'files': len(m.files), 'boto3': 'boto3' in sys.modules, "
            "'s3transfer': 's3transfer' in sys.modules}))")
    env = {**os.environ, **s3_server.env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code, uri, str(tmp_path / "m")], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {"files": len(digests), "boto3": False, "s3transfer": False}
    assert verify_staged(tmp_path / "m", check_digests=True).total_bytes > 0
