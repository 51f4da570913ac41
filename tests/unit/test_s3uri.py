"""Specification: runtime.s3uri is the one place that says what an s3:// object, trace or folder URI must look like;
each splitter returns the parts S3 is asked for, or refuses with a message naming the field and the URI (never a
presigned URL's signature)."""

from __future__ import annotations

import re

import pytest

from runtime.s3uri import check_upload_uri, split_s3_object_uri, split_s3_prefix_uri, split_s3_trace_uri


@pytest.mark.parametrize(("uri", "parts"), [
    ("s3://bkt/k", ("bkt", "k")),
    ("s3://my.bucket-1/a/b/c.jsonl", ("my.bucket-1", "a/b/c.jsonl")),
    ("s3://bkt/a b", ("bkt", "a b")),  # S3 keys may hold spaces: kept as given
])
def test_an_object_uri_splits_into_bucket_and_key(uri: str, parts: tuple[str, str]) -> None:
    assert split_s3_object_uri(uri) == parts


@pytest.mark.parametrize(("uri", "why"), [
    ("", "must be an s3://bucket/key URI"),
    ("https://bkt/k", "must be an s3://bucket/key URI"),
    ("S3://bkt/k", "must be an s3://bucket/key URI"),
    (" s3://bkt/k", "must be an s3://bucket/key URI"),
    ("s3:///k", "bucket '' is not a valid S3 bucket name"),
    ("s3://bk t/k", "bucket 'bk t' is not a valid S3 bucket name"),
    ("s3://Bad_Bucket/k", "is not a valid S3 bucket name"),
    ("s3://ab/k", "is not a valid S3 bucket name"),  # under 3 characters
    ("s3://a..b/k", "is not a valid S3 bucket name"),
    ("s3://bkt", "needs an object key"),
    ("s3://bkt/", "needs an object key"),
    ("s3://bkt/folder/", "not a prefix"),
])
def test_an_object_uri_without_a_bucket_or_key_is_refused_naming_the_field(uri: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"^--input {re.escape(repr(uri))}: .*{re.escape(why)}"):
        split_s3_object_uri(uri, "--input")


def test_an_object_uri_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ValueError, match="must be an s3://bucket/key URI"):
        split_s3_object_uri(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("uri", "parts"), [
    ("s3://bkt", ("bkt", "")),
    ("s3://bkt/", ("bkt", "")),
    ("s3://bkt/m", ("bkt", "m/")),
    ("s3://bkt/models/m/", ("bkt", "models/m/")),
])
def test_a_prefix_uri_splits_into_bucket_and_a_prefix_ending_in_a_slash(uri: str, parts: tuple[str, str]) -> None:
    assert split_s3_prefix_uri(uri) == parts


@pytest.mark.parametrize(("uri", "why"), [
    ("hf://org/m", "must be an s3://bucket/prefix/ URI"),
    ("s3://", "bucket '' is not a valid S3 bucket name"),
    ("s3:///m/", "bucket '' is not a valid S3 bucket name"),
    ("s3://bkt/a//b/", "empty, '.' or '..' path segment"),
    ("s3://bkt/./", "empty, '.' or '..' path segment"),
    ("s3://bkt/a/../b", "empty, '.' or '..' path segment"),
    ("s3://bkt//", "empty, '.' or '..' path segment"),
    ("s3://bkt/$(AWS_SECRET_ACCESS_KEY)/", "must not contain '$'"),
])
def test_a_bad_prefix_uri_is_refused_naming_the_field(uri: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"^source {re.escape(repr(uri))}: .*{re.escape(why)}"):
        split_s3_prefix_uri(uri, "source")


@pytest.mark.parametrize("uri", ["s3://bkt/m/?X-Amz-Signature=SECRET", "s3://bkt/m#SECRET"])
def test_a_query_string_or_fragment_is_refused_without_echoing_it(uri: str) -> None:
    for split in (lambda u: split_s3_prefix_uri(u, "source"), check_upload_uri,
                  lambda u: split_s3_trace_uri(u, "traffic_uri")):
        with pytest.raises(ValueError, match="must not carry a query string or fragment") as e:
            split(uri)
        assert "SECRET" not in str(e.value) and "s3://bkt/m" in str(e.value)


@pytest.mark.parametrize(("uri", "why"), [("s3://bkt", "must end in '/'"), ("s3://bkt/m", "must end in '/'")])
def test_a_folder_uri_must_end_in_a_slash(uri: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"^--traffic-upload {re.escape(repr(uri))}: .*{re.escape(why)}"):
        check_upload_uri(uri)
    assert split_s3_prefix_uri(uri + "/", folder=True) == check_upload_uri(uri + "/")


@pytest.mark.parametrize(("uri", "parts"), [
    ("s3://bkt/t.jsonl", ("bkt", "t.jsonl", False)),
    ("s3://bkt/day1/T.CSV", ("bkt", "day1/T.CSV", False)),
    ("s3://bkt/traffic/llama8/", ("bkt", "traffic/llama8", True)),  # the prefix without its '/'
])
def test_a_trace_uri_is_an_object_with_a_trace_suffix_or_a_folder(uri: str, parts: tuple[str, str, bool]) -> None:
    assert split_s3_trace_uri(uri) == parts


@pytest.mark.parametrize(("uri", "why"), [
    ("s3://bkt/", "needs an object key"),
    ("s3://bkt/t.parquet", "must name a .jsonl / .json"),
    ("s3://bkt/t.jsonl ", "must name a .jsonl / .json"),
    ("s3://bkt/a//t.jsonl", "empty, '.' or '..' path segment in the key"),
    ("s3://bkt/a/../b/", "empty, '.' or '..' path segment in the prefix"),
    ("s3://Bad/t/", "bucket 'Bad' is not a valid S3 bucket name"),
    ("/data/t.jsonl", "must be an s3://bucket/key URI"),
])
def test_a_bad_trace_uri_is_refused_naming_the_uri_as_given(uri: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"^traffic_uri {re.escape(repr(uri))}: .*{re.escape(why)}"):
        split_s3_trace_uri(uri, "traffic_uri")
