"""Specification: an S3 listing that contains a key escaping the destination is refused before any
byte is written, naming the key. Real S3 stores such keys verbatim; SeaweedFS normalises them on
upload, so the listing comes from botocore's Stubber with the real ListObjectsV2 response shape."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import pytest
from botocore.stub import Stubber

from runtime.staging.keys import UnsafeKeyError
from runtime.staging.s3 import make_client, parse_s3_uri
from runtime.staging.stage import stage_model


def _listing(keys: list[str]) -> dict:
    return {
        "IsTruncated": False,
        "Name": "models",
        "Prefix": "m/",
        "KeyCount": len(keys),
        "MaxKeys": 1000,
        "Contents": [
            {"Key": k, "Size": 10, "ETag": '"0123456789abcdef0123456789abcdef"',
             "LastModified": datetime(2026, 1, 1, tzinfo=timezone.utc), "StorageClass": "STANDARD"}
            for k in keys
        ],
    }


@pytest.mark.parametrize(
    "bad",
    ["m/../../../etc/cron.d/x", "m//etc/passwd", "m/sub\\..\\..\\x", "m/a\x00.safetensors", "m/./config.json"],
)
def test_unsafe_key_in_listing_is_rejected_naming_it(tmp_path: Path, bad: str) -> None:
    client = make_client("http://127.0.0.1:9", aws_access_key_id="a", aws_secret_access_key="b")
    with Stubber(client) as stub:
        stub.add_response("list_objects_v2", _listing(["m/config.json", bad]), {"Bucket": "models", "Prefix": "m/"})
        dest = tmp_path / "fsx" / "m"
        with pytest.raises(UnsafeKeyError) as exc:  # selected (everything is): refused before any byte
            stage_model("s3://models/m", dest, s3_client=client, progress=False, include=["*"])
        assert repr(bad) in str(exc.value)
    assert not dest.exists()
    assert list((tmp_path / "fsx").iterdir()) == [tmp_path / "fsx" / ".m.pdserve-lock"]


@pytest.mark.parametrize(
    ("uri", "expected"),
    [("s3://bkt/p", ("bkt", "p/")), ("s3://bkt/p/q/", ("bkt", "p/q/")), ("s3://bkt", ("bkt", "")),
     ("s3://bkt/", ("bkt", ""))],
)
def test_parse_s3_uri(uri: str, expected: tuple[str, str]) -> None:
    assert parse_s3_uri(uri) == expected


@pytest.mark.parametrize(("uri", "why"), [("s3://", "not a valid S3 bucket name"),
                                         ("s3:///p", "not a valid S3 bucket name"),
                                         ("http://bkt/p", "must be an s3://bucket/prefix/ URI"),
                                         ("s3://b/p", "not a valid S3 bucket name"),
                                         ("s3://bkt/a/../p", "'..' path segment")])
def test_parse_s3_uri_rejects_malformed(uri: str, why: str) -> None:
    from runtime.staging.manifest import StagingError

    with pytest.raises(StagingError, match=f"^source {re.escape(repr(uri))}: .*{re.escape(why)}"):
        parse_s3_uri(uri)


@pytest.mark.parametrize(("bucket_region", "transport"), [("eu-west-1", "botocore"), ("us-east-1", "http"), (None, "http")])
def test_a_bucket_in_another_region_is_read_through_botocore(bucket_region: str | None, transport: str) -> None:
    """botocore follows S3's region redirects, the lean "http" GETs do not: HeadBucket's
    x-amz-bucket-region decides after the listing."""
    from runtime.staging.sources import S3Source

    client = make_client("http://127.0.0.1:9", aws_access_key_id="a", aws_secret_access_key="b", region_name="us-east-1")
    headers = {"x-amz-bucket-region": bucket_region} if bucket_region else {}
    with Stubber(client) as stub:
        stub.add_response("list_objects_v2", _listing(["m/config.json"]), {"Bucket": "models", "Prefix": "m/"})
        stub.add_response("head_bucket", {"ResponseMetadata": {"HTTPStatusCode": 200, "HTTPHeaders": headers}},
                          {"Bucket": "models"})
        src = S3Source("s3://models/m", client)
        assert src.transport == "http"
        assert [o.rel for o in src.list_objects()] == ["config.json"]
        stub.assert_no_pending_responses()
    assert src.transport == transport and src.aligned_chunks == (transport == "http")


def test_an_endpoint_url_with_credentials_is_refused_without_showing_them():
    from runtime.staging.s3 import make_client

    with pytest.raises(ValueError, match="must not carry credentials") as e:
        make_client("http://user:hunter2@127.0.0.1:8333", transfer_methods=False)
    assert "hunter2" not in str(e.value)


def test_an_unsafe_key_the_selection_leaves_out_does_not_stop_the_model(tmp_path: Path, caplog) -> None:
    """AWS S3 keeps `m/runs//events.txt` as written: a stray log key beside the model is no reason to refuse
    the model's own files, and it is never written."""
    import logging

    from runtime.staging.sources import S3Source
    from runtime.staging.stage import StageOptions, _select

    client = make_client("http://127.0.0.1:9", aws_access_key_id="a", aws_secret_access_key="b")
    with Stubber(client) as stub:
        keys = ["m/config.json", "m/model.safetensors", "m/runs//events.txt"]
        stub.add_response("list_objects_v2", _listing(keys), {"Bucket": "models", "Prefix": "m/"})
        objs = S3Source("s3://models/m", client, transport="botocore").list_objects()
    with caplog.at_level(logging.WARNING, logger="runtime.staging.stage"):
        chosen = _select(objs, StageOptions(), "s3://models/m")
    assert [o.rel for o in chosen] == ["config.json", "model.safetensors"]
    assert "'m/runs//events.txt'" in caplog.text and "left out" in caplog.text
    with pytest.raises(UnsafeKeyError, match="empty path segment"):
        _select(objs, StageOptions(include=["runs/*", "config.json"]), "s3://models/m")
