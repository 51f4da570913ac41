"""boto3 S3 client construction, `s3://` URI parsing and folder upload (s3transfer)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from runtime.staging.manifest import StagingError

DEFAULT_MAX_ATTEMPTS = 8
"""botocore retry attempts (standard mode: exponential backoff with jitter on throttling, 5xx and
connection errors; https://boto3.amazonaws.com/v1/documentation/api/latest/guide/retries.html)."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/prefix`` into ("bucket", "some/prefix/") (prefix ends in "/" or is "").

    Raises:
        StagingError: not an s3:// URI or no bucket.
    """
    if not uri.startswith("s3://"):
        raise StagingError(f"source {uri!r}: expected s3://bucket/prefix")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise StagingError(f"source {uri!r}: missing bucket name")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


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
) -> Any:
    """A boto3 S3 client with retries, a connection pool sized for concurrent ranged GETs, and
    path-style addressing whenever a custom endpoint is used (SeaweedFS, MinIO, on-prem S3).

    Args:
        endpoint_url: S3 endpoint; None → AWS (or the AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
            environment variables, which boto3 reads itself).
        aws_access_key_id / aws_secret_access_key / region_name: explicit credentials; None → the
            default boto3 chain (env, profile, instance/IRSA role).
        max_pool_connections: HTTP connections kept per client (≥ transfer concurrency).
        max_attempts: total attempts per request, botocore "standard" retry mode.

    Returns:
        botocore S3 client (thread-safe; share it between threads).
    """
    import boto3
    from botocore.config import Config

    custom = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        s3={"addressing_style": "path"} if custom else {},
        retries={"max_attempts": max_attempts, "mode": "standard"},
        max_pool_connections=max_pool_connections,
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        signature_version="s3v4",
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=aws_access_key_id,
        aws_secret_access_key=aws_secret_access_key,
        region_name=region_name or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        config=config,
    )


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
