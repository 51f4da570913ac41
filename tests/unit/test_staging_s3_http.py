"""`S3HttpGetter` (the "http" transport of s3:// sources) without an S3 server: the URL it requests
matches botocore's for any key and bucket name, session tokens are signed, and client settings it
cannot honour (TLS client certificates) send the source to botocore; its TLS trust is botocore's."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import boto3
import certifi
import pytest
from botocore.config import Config

from runtime.staging.s3 import S3HttpGetter
from runtime.staging.sources import S3Source

KEYS = ["m/a b", "m/a+b", "m/a%20b", "m/ünï/çødé", "m/x~y", "m/a=b&c?d#e", "/lead", "m/a//b", "m/*'()!$,;:@"]


@pytest.fixture
def capture() -> Iterator[tuple[int, list]]:
    """An HTTP/1.1 server on 127.0.0.1 answering every GET with 3 bytes; records (path, headers)."""
    seen: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append((self.path, dict(self.headers)))
            self.send_response(206)
            self.send_header("Content-Length", "3")
            self.end_headers()
            self.wfile.write(b"abc")

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_port, seen
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)


def _client(endpoint: str | None, **kw: object):  # noqa: ANN202 - boto3 clients are untyped
    return boto3.client("s3", region_name="eu-west-1", endpoint_url=endpoint, aws_access_key_id="AKIDEXAMPLE",
                        aws_secret_access_key="secret", config=Config(signature_version="s3v4", **kw))


@pytest.mark.parametrize("bucket", ["models", "pdserve-key-sentinel-models", "x-pdserve-key-sentinel"])
def test_requested_path_is_botocores_for_any_key_and_bucket(capture, bucket) -> None:  # noqa: ANN001
    port, seen = capture
    client = _client(f"http://127.0.0.1:{port}", s3={"addressing_style": "path"})
    g = S3HttpGetter(client, bucket)
    for key in KEYS:
        resp = g.get(key, {"Range": "bytes=0-2"})
        assert resp.read() == b"abc"
        want = urlsplit(client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key})).path
        assert seen[-1][0] == want, key


def test_session_token_is_sent_and_signed(capture) -> None:  # noqa: ANN001
    port, seen = capture
    client = boto3.client("s3", region_name="eu-west-1", endpoint_url=f"http://127.0.0.1:{port}",
                          aws_access_key_id="ASIAEXAMPLE", aws_secret_access_key="secret",
                          aws_session_token="the-sts-token", config=Config(s3={"addressing_style": "path"}))
    S3HttpGetter(client, "b").get("k", {}).read()
    headers = {k.lower(): v for k, v in seen[-1][1].items()}
    assert headers["x-amz-security-token"] == "the-sts-token"
    assert "x-amz-security-token" in headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
    assert "/eu-west-1/s3/aws4_request" in headers["authorization"]


def test_a_tls_client_certificate_sends_auto_to_botocore() -> None:
    plain = _client("https://s3.example.invalid")
    mtls = _client("https://s3.example.invalid", client_cert="/nonexistent/client.pem")
    assert S3HttpGetter.usable(plain)
    assert not S3HttpGetter.usable(mtls)
    assert S3Source("s3://bkt/m", mtls).transport == "botocore"


def test_tls_trusts_botocores_ca_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore verifies against certifi's bundle (or AWS_CA_BUNDLE / REQUESTS_CA_BUNDLE / Config), not the
    system store."""
    pem = certifi.contents()
    one = pem[: pem.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")]
    bundle = tmp_path / "bundle.pem"
    bundle.write_text(one[one.index("-----BEGIN CERTIFICATE-----"):] + "\n")
    for var in ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-system-store.pem"))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "no-system-dir"))
    monkeypatch.setattr("botocore.httpsession.where", lambda: str(bundle))
    g = S3HttpGetter(_client("https://s3.example.invalid"), "b")
    conn = g._connection("https", "s3.example.invalid:443", True)
    assert len(conn._context.get_ca_certs()) == 1
    monkeypatch.setenv("AWS_CA_BUNDLE", certifi.where())  # an explicit bundle wins
    g = S3HttpGetter(_client("https://s3.example.invalid"), "b")
    assert len(g._connection("https", "s3.example.invalid:443", True)._context.get_ca_certs()) > 1


def test_s3_express_directory_buckets_are_left_to_botocore_without_a_request(capture) -> None:  # noqa: ANN001
    port, seen = capture
    client = _client(f"http://127.0.0.1:{port}", s3={"addressing_style": "path"})
    assert not S3HttpGetter(client, "models--usw2-az1--x-s3").serves_bucket()  # session auth: botocore only
    assert seen == []  # decided by name, no HeadBucket sent
    with pytest.raises(Exception):  # an ordinary bucket is asked (this capture server answers GET only)
        S3HttpGetter(client, "models").serves_bucket()


def test_direct_writes_never_share_a_page_with_buffered_ones() -> None:
    import mmap

    from runtime.staging.transfer import DIRECT_ALIGN

    assert (DIRECT_ALIGN + 1) % 4096 == 0 and (DIRECT_ALIGN + 1) % mmap.PAGESIZE == 0


@pytest.mark.parametrize(("env", "want"), [
    ({"AWS_REGION": "eu-west-2", "AWS_DEFAULT_REGION": "ap-south-1"}, "eu-west-2"),
    ({"AWS_DEFAULT_REGION": "ap-south-1"}, "ap-south-1"),
    ({}, "us-east-1"),
])
def test_the_client_signs_for_the_region_the_pod_is_given(env, want, monkeypatch: pytest.MonkeyPatch) -> None:
    """EKS Pod Identity / IRSA set AWS_REGION (botocore itself reads only AWS_DEFAULT_REGION)."""
    from runtime.staging.s3 import make_client

    for k in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for transfer_methods in (True, False):
        client = make_client(aws_access_key_id="a", aws_secret_access_key="b", transfer_methods=transfer_methods)
        assert client.meta.region_name == want
    assert make_client(region_name="sa-east-1", aws_access_key_id="a",
                       aws_secret_access_key="b").meta.region_name == "sa-east-1"
