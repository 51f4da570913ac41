"""boto3 S3 client construction, `s3://` URI parsing, folder upload (s3transfer) and the lean signed
GET path used to stage objects (`S3HttpGetter`)."""

from __future__ import annotations

import http.client
import logging
import os
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from runtime.staging.manifest import StagingError

log = logging.getLogger(__name__)

DEFAULT_MAX_ATTEMPTS = 8
"""botocore retry attempts (standard mode: exponential backoff with jitter on throttling, 5xx and
connection errors; https://boto3.amazonaws.com/v1/documentation/api/latest/guide/retries.html)."""


def parse_s3_uri(uri: str, what: str = "source") -> tuple[str, str]:
    """Split a staging folder URI ``s3://bucket/some/prefix`` into ("bucket", "some/prefix/") (prefix ends in "/" or
    is ""): ``runtime.s3uri.split_s3_prefix_uri``.

    Raises:
        StagingError: not an s3:// URI, a bucket S3 would refuse, or a URI that function refuses (the message
            names ``what`` and the URI).
    """
    from runtime.s3uri import split_s3_prefix_uri

    try:
        return split_s3_prefix_uri(uri, what)
    except ValueError as e:
        raise StagingError(str(e)) from None


def make_client(
    endpoint_url: str | None = None,
    *,
    aws_access_key_id: str | None = None,
    aws_secret_access_key: str | None = None,
    region_name: str | None = None,
    max_pool_connections: int = 32,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    connect_timeout_s: float = 10.0,
    read_timeout_s: float = 60.0,
    transfer_methods: bool = True,
) -> Any:
    """A boto3 S3 client with retries, a connection pool sized for concurrent ranged GETs, and
    path-style addressing whenever a custom endpoint is used (SeaweedFS, MinIO, on-prem S3).

    Args:
        endpoint_url: S3 endpoint; None → AWS (or the AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
            environment variables, which boto3 reads itself).
        aws_access_key_id / aws_secret_access_key / region_name: explicit credentials; None → the
            default boto3 chain (env, profile, instance/IRSA role); the region, None → env AWS_REGION, else
            AWS_DEFAULT_REGION, else us-east-1.
        max_pool_connections: HTTP connections kept per client (≥ transfer concurrency).
        max_attempts: total attempts per request, botocore "standard" retry mode.
        transfer_methods: True: made by boto3, with its injected `upload_file`/`download_file`
            (s3transfer). False: the same client made by botocore's session directly, for callers that
            only list, HEAD and GET (staging): importing boto3 and s3transfer costs ~0.1-0.17 s of
            start-up per process, ~5 % of a 2 GB stage (bench/staging.py). Same credential chain,
            region, endpoint and config either way.

    Returns:
        botocore S3 client (thread-safe; share it between threads).

    Raises:
        ValueError: the endpoint URL carries credentials (`user:password@`): requests are signed with the
            credential chain's keys, and the signed GETs would go to a host named after the userinfo.
    """
    from urllib.parse import urlsplit

    from botocore.config import Config

    custom = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if custom and "@" in (urlsplit(custom).netloc or ""):
        raise ValueError("the S3 endpoint URL must not carry credentials (user:password@): S3 requests are signed "
                         "with the AWS credential chain's keys (environment, profile, Pod Identity)")
    config = Config(
        s3={"addressing_style": "path"} if custom else {},
        retries={"max_attempts": max_attempts, "mode": "standard"},
        max_pool_connections=max_pool_connections,
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        signature_version="s3v4",
    )
    if transfer_methods:
        import boto3

        new_client = boto3.client
    else:
        import botocore.session

        new_client = botocore.session.get_session().create_client
    client = new_client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=aws_access_key_id,
        aws_secret_access_key=aws_secret_access_key,
        # AWS_REGION is what EKS Pod Identity / IRSA and the other AWS SDKs set; botocore reads only
        # AWS_DEFAULT_REGION. A bucket's requests signed for another region take a redirect each (or fail
        # where only the regional endpoint is reachable: a VPC endpoint).
        region_name=(region_name or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                     or "us-east-1"),
        config=config,
    )
    # botocore retries quietly (DEBUG log only): an endpoint that accepts connections and never answers
    # would keep a stager silent for max_attempts x read_timeout. Say so at each failed attempt.
    client.meta.events.register_first("needs-retry.s3", _RetryWarning(max_attempts))
    return client


class _RetryWarning:
    """botocore ``needs-retry`` handler that logs a warning for a failed attempt (a connection error,
    a timeout, throttling or a 5xx) and leaves the retry decision to botocore (returns None)."""

    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max_attempts

    def __call__(self, attempts: int = 0, caught_exception: BaseException | None = None, response: Any = None,
                 operation: Any = None, **_: Any) -> None:
        try:
            if caught_exception is not None:
                reason = f"{type(caught_exception).__name__}: {caught_exception}"
            elif response is not None and (response[0].status_code >= 500 or response[0].status_code == 429):
                reason = f"HTTP {response[0].status_code}"
            else:
                return None
            name = getattr(operation, "name", "request")
            if attempts < self.max_attempts:
                log.warning("S3 %s attempt %d of %d failed (%s); retrying", name, attempts, self.max_attempts, reason)
        except Exception:  # noqa: BLE001 - a logging aid must never break botocore's retry chain
            pass
        return None


def ensure_bucket(s3_client: Any, bucket: str) -> None:
    """Create `bucket` unless it exists (HeadBucket first; BucketAlreadyOwnedByYou is fine)."""
    from botocore.exceptions import ClientError

    try:
        s3_client.head_bucket(Bucket=bucket)
        return
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
    try:
        s3_client.create_bucket(Bucket=bucket)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def upload_folder(
    folder: Path,
    bucket: str,
    prefix: str,
    s3_client: Any,
    *,
    create_bucket: bool = True,
    concurrency: int = 8,
    multipart_chunk_bytes: int = 8 << 20,
    checksum_algorithm: str = "SHA256",
) -> list[str]:
    """Upload every file under `folder` to ``s3://bucket/prefix/<relative path>``.

    Uses s3transfer (boto3 `upload_file`, multipart above `multipart_chunk_bytes`) with
    ``ChecksumAlgorithm=checksum_algorithm`` (SHA256 default; CRC32, CRC32C need no extra
    hashing pass when staging) so each object carries an S3 checksum (full-object, or composite
    ``<b64>-<parts>`` for multipart) that `stage_model` verifies against.

    Args:
        folder: local folder (recursively uploaded; symlinks followed).
        bucket: bucket name (created when missing and `create_bucket`).
        prefix: key prefix; "" or "a/b" or "a/b/" (a trailing "/" is added).
        s3_client: boto3 S3 client (`make_client`).
        concurrency: files uploaded in parallel.

    Returns:
        The uploaded keys, sorted.

    Raises:
        StagingError: `folder` is not a directory or holds no files.
        botocore.exceptions.ClientError: S3 refused a request.
    """
    from boto3.s3.transfer import TransferConfig

    folder = Path(folder)
    if not folder.is_dir():
        raise StagingError(f"upload_folder: {folder} is not a directory")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise StagingError(f"upload_folder: {folder} holds no files")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    if create_bucket:
        ensure_bucket(s3_client, bucket)
    cfg = TransferConfig(
        multipart_threshold=multipart_chunk_bytes,
        multipart_chunksize=multipart_chunk_bytes,
        max_concurrency=4,
    )

    def put(p: Path) -> str:
        key = prefix + p.relative_to(folder).as_posix()
        s3_client.upload_file(str(p), bucket, key, ExtraArgs={"ChecksumAlgorithm": checksum_algorithm}, Config=cfg)
        return key

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        keys = list(pool.map(put, files))
    return sorted(keys)


class S3TransientError(ConnectionError):
    """An S3 answer worth retrying (HTTP 5xx, 429 / SlowDown throttling): the transfer engine's
    backoff retries it like a dropped connection."""


_KEY_SENTINEL = "pdserve-key-sentinel"
_S3_ERROR_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")


class S3HttpGetter:
    """Signed S3 GETs over `http.client`, one keep-alive connection per thread: the byte path of
    `runtime.staging.sources.S3Source` (transport "http").

    Why: on a 2-core host a botocore `get_object` costs ~1.2 ms CPU per request and its body is
    copied once more by urllib3's `readinto`; the AWS CRT S3 client spent 1.5-2.3 CPU s/GB here (16 KiB
    socket reads through its event loop). `http.client`'s `readinto` receives straight into the
    caller's buffer: 0.67 CPU s/GB for ranged GETs + CRC32 + pwrite vs 1.4-1.6 with botocore
    (bench/staging.py, 2 GB, SeaweedFS on loopback).

    Everything but the bytes comes from the boto3 client: the URL (botocore resolves endpoint and
    addressing style once, for a placeholder key), the region, the credentials (refreshed by botocore
    when they expire: IRSA, instance roles), timeouts and the TLS CA bundle. Requests are signed with
    botocore's own SigV4 signer (`S3SigV4Auth`).

    Args:
        client: boto3 S3 client.
        bucket: bucket name.

    Raises (from `get`):
        StagingError: HTTP 4xx (403 denied, 404 missing, 412 changed: `status` attribute set).
        S3TransientError: HTTP 5xx / 429 (retry with backoff).
        ConnectionError, TimeoutError, http.client.HTTPException: network failures (retryable).
    """

    RETRYABLE: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, http.client.HTTPException,
                                                    socket.gaierror)

    def __init__(self, client: Any, bucket: str) -> None:
        self.client, self.bucket = client, bucket
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._url: tuple[str, str, str, str] | None = None  # scheme, netloc, path prefix, path suffix
        self.region = client.meta.region_name or "us-east-1"
        self.timeout_s = client.meta.config.read_timeout or 60  # http.client: connect and each socket read

    @staticmethod
    def usable(client: Any) -> bool:
        """Whether `client`'s settings can be honoured without botocore's HTTP stack: SigV4 (or default)
        signing, no proxy configured (client config or HTTP(S)_PROXY environment), no TLS client
        certificate (`Config(client_cert=...)`)."""
        import urllib.request

        cfg = client.meta.config
        if cfg.signature_version not in (None, "s3v4", "v4") or cfg.proxies or getattr(cfg, "client_cert", None):
            return False  # client_cert: mutual TLS, which only botocore's HTTP session presents
        host = urlsplit(client.meta.endpoint_url).hostname or ""
        proxies = urllib.request.getproxies()
        return not ((proxies.get("https") or proxies.get("http")) and not urllib.request.proxy_bypass(host))

    def serves_bucket(self) -> bool:
        """False when the bucket lives in another region than the client's (HeadBucket's
        x-amz-bucket-region): botocore follows S3's redirects for its own requests, this getter does
        not, so such a bucket is read through botocore. S3 Express directory buckets (``--x-s3``) need
        session-based signing (CreateSession), which only botocore does: False without a request.
        Raises what HeadBucket raises."""
        if self.bucket.endswith("--x-s3"):
            return False
        head = self.client.head_bucket(Bucket=self.bucket)
        region = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
        return not region or region == self.region

    def _resolve(self) -> tuple[str, str, str, str]:
        with self._lock:
            if self._url is None:
                url = self.client.generate_presigned_url(
                    "get_object", Params={"Bucket": self.bucket, "Key": _KEY_SENTINEL}, ExpiresIn=60)
                parts = urlsplit(url)
                # the key is the path's last component: rpartition (a path-style bucket name may hold the sentinel)
                prefix, found, suffix = parts.path.rpartition(_KEY_SENTINEL)
                if not found:
                    raise StagingError(f"s3://{self.bucket}: cannot derive the object URL from {parts.netloc}")
                self._url = (parts.scheme, parts.netloc, prefix, suffix)
            return self._url

    def _connection(self, scheme: str, netloc: str, fresh: bool) -> http.client.HTTPConnection:
        conn = getattr(self._tls, "conn", None)
        if conn is not None and not fresh:
            return conn
        if conn is not None:
            conn.close()
        if scheme == "https":
            import ssl

            from botocore.httpsession import get_cert_path

            verify = getattr(getattr(getattr(self.client, "_endpoint", None), "http_session", None), "_verify", True)
            # the CA bundle botocore itself trusts: the configured one, else certifi's (not the system store)
            ctx = ssl.create_default_context(cafile=get_cert_path(verify) if verify else None)
            if verify is False:
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            conn = http.client.HTTPSConnection(netloc, timeout=self.timeout_s, context=ctx)
        else:
            conn = http.client.HTTPConnection(netloc, timeout=self.timeout_s)
        self._tls.conn = conn
        return conn

    def get(self, key: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """Send a signed GET for `key`; returns the 200/206 response, whose body the caller reads to
        its end (the connection is then reused) or hands to `discard` otherwise."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        scheme, netloc, prefix, suffix = self._resolve()
        path = prefix + quote(key, safe="/~") + suffix
        req = AWSRequest(method="GET", url=f"{scheme}://{netloc}{path}", headers=headers)
        creds = self.client._get_credentials()  # botocore's (refreshing) credentials; boto3.crt does the same
        if creds is not None:
            S3SigV4Auth(creds.get_frozen_credentials(), "s3", self.region).add_auth(req)
        sent = dict(req.headers.items())
        reused = getattr(self._tls, "conn", None) is not None
        for fresh in ((False, True) if reused else (True,)):
            conn = self._connection(scheme, netloc, fresh)
            try:
                conn.request("GET", path, headers=sent)
                resp = conn.getresponse()
                break
            except BaseException as e:
                conn.close()  # never reuse a connection left mid-request
                self._tls.conn = None
                if fresh or not isinstance(e, (ConnectionError, http.client.BadStatusLine,
                                               http.client.ImproperConnectionState)):
                    raise
                # else: a kept-alive connection the server had closed, or one whose last body was left
                # unread (an abandoned reader; closing it ends that body); try once more on a new one
        resp.pdserve_conn = conn  # type: ignore[attr-defined]  # for `discard(resp)`
        if resp.status in (200, 206):
            return resp
        body = resp.read(64 << 10)
        self.discard(resp)
        m = _S3_ERROR_CODE.search(body)
        code = m.group(1).decode() if m else resp.reason
        if resp.status >= 500 or resp.status == 429:
            raise S3TransientError(f"HTTP {resp.status} {code}")
        err = StagingError(f"HTTP {resp.status} {code}")
        err.status = resp.status  # type: ignore[attr-defined]
        raise err

    def discard(self, resp: http.client.HTTPResponse) -> None:
        """Close the connection that carried `resp` (after an error, or a body not read to its end: its
        unread bytes would desynchronise the next request); the thread opens a new one next time."""
        conn = getattr(resp, "pdserve_conn", None)
        if conn is not None:
            conn.close()
            if getattr(self._tls, "conn", None) is conn:
                self._tls.conn = None
