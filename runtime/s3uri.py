"""`s3://` URIs: parsing and the checks every face applies before a URI reaches a client (pure: no I/O).

One home for what an S3 object or folder URI must look like, so the CLI, the KFP steps, the rendered objects and
the runtime refuse the same URIs with the same words.
"""

from __future__ import annotations

import re

# S3 bucket naming rules: 3-63 characters, lower-case letters, digits, '.' and '-', starting and ending with a
# letter or digit (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html)
S3_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def split_s3_object_uri(uri: str, what: str = "uri") -> tuple[str, str]:
    """``s3://bucket/key`` of one object → (bucket, key).

    Raises:
        ValueError: (message naming ``what``) not s3://, a bucket S3 would refuse, no key, or a key ending in '/'
            (a prefix, not an object).
    """
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ValueError(f"{what} {uri!r}: must be an s3://bucket/key URI")
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not S3_BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ValueError(f"{what} {uri!r}: bucket {bucket!r} is not a valid S3 bucket name")
    if not key or key.endswith("/"):
        raise ValueError(f"{what} {uri!r}: needs an object key after the bucket (s3://bucket/key), not a prefix")
    return bucket, key



def check_upload_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix/`` or ``s3://bucket/`` → (bucket, prefix ending in '/' or "").

    Raises:
        ValueError: not s3://, a query string or fragment (a presigned URL; not echoed), no '/' after the bucket (``s3://bucket``: a name appended to it would change the
            bucket), a bucket S3 would refuse, a prefix not ending in '/' (it names a folder), an
            empty, '.' or '..' segment, or a '$' (the kubelet expands ``$(VAR)`` in container args, and the
            runtime's env holds S3 credentials).
    """
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ValueError(f"--traffic-upload {uri!r}: must be an s3://bucket/prefix/ URI")
    if "?" in uri or "#" in uri:  # a presigned URL's query is a credential: never echo it
        cut = min(i for i in (uri.find("?"), uri.find("#")) if i >= 0)
        raise ValueError(f"--traffic-upload {uri[:cut]!r}…: must not carry a query string or fragment (a presigned "
                         "URL's signature is a credential; the runtime signs its own requests)")
    if "$" in uri:
        raise ValueError(f"--traffic-upload {uri!r}: must not contain '$' (Kubernetes expands $(VAR) in args)")
    bucket, slash, prefix = uri[len("s3://"):].partition("/")
    if not S3_BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ValueError(f"--traffic-upload {uri!r}: bucket {bucket!r} is not a valid S3 bucket name")
    if not slash:
        raise ValueError(f"--traffic-upload {uri!r}: must end in '/' (s3://{bucket}/ or s3://{bucket}/prefix/)")
    if prefix and not prefix.endswith("/"):
        raise ValueError(f"--traffic-upload {uri!r}: the prefix must end in '/' (each runtime writes a folder "
                         "of objects under it)")
    if prefix and any(seg in ("", ".", "..") for seg in prefix[:-1].split("/")):
        raise ValueError(f"--traffic-upload {uri!r}: empty, '.' or '..' path segment in the prefix")
    return bucket, prefix
