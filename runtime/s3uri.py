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


def without_query(uri: str) -> str:
    """``uri`` cut before its first '?' or '#', with ``?…`` marking the cut: safe to show (a presigned URL's
    query carries X-Amz-Credential, X-Amz-Signature, X-Amz-Security-Token)."""
    cut = min((i for i in (uri.find("?"), uri.find("#")) if i >= 0), default=-1)
    return uri if cut < 0 else uri[:cut] + "?…"


def _refuse_query_and_dollar(uri: str, what: str) -> None:
    """Refuse what no s3:// URI a face accepts may hold: a query string or fragment (a presigned URL's
    X-Amz-Signature is a credential, so the message shows the URI cut before it) and a '$' (the kubelet expands
    ``$(VAR)`` in container args, and a pod's env holds S3 credentials).

    Raises:
        ValueError: either, naming ``what``.
    """
    if "?" in uri or "#" in uri:
        raise ValueError(f"{what} {without_query(uri)!r}: must not carry a query string or fragment ('?…' / '#…', "
                         "e.g. a presigned URL's X-Amz-Signature): name the object or folder as s3://bucket/key or "
                         "s3://bucket/prefix/; credentials come from the environment")
    if "$" in uri:
        raise ValueError(f"{what} {uri!r}: must not contain '$' (Kubernetes expands $(VAR) in container args)")


def split_s3_trace_uri(uri: str, what: str = "traffic_trace_uri") -> tuple[str, str, bool]:
    """A recorded-traffic URI → ``(bucket, key, is_prefix)``: ``s3://bucket/key.jsonl`` / ``.json`` / ``.csv`` (one
    object; runtime.traces.formats.READABLE_SUFFIXES) or ``s3://bucket/prefix/`` (every object under it; ``key``
    is then returned WITHOUT the trailing '/', so a zero-byte "folder" object that S3 consoles create under that
    name is not taken for the trace). Reads nothing.

    Raises:
        ValueError: (message naming ``what`` and the URI as given) a query string or fragment (a presigned URL;
            the message shows the URI without it), a '$' (the kubelet expands ``$(VAR)`` in container args, and
            the step's env holds secrets), not s3://, a bad bucket, no key, an empty, '.' or '..' path segment,
            or an object whose suffix the trace reader does not know.
    """
    from runtime.traces.formats import READABLE_SUFFIXES

    if isinstance(uri, str):
        _refuse_query_and_dollar(uri, what)
    folder = isinstance(uri, str) and uri.endswith("/")
    try:
        bucket, key = split_s3_object_uri(uri.rstrip("/") if folder else uri, what)
    except ValueError as e:  # named with the URI as given, trailing '/' included
        raise ValueError(str(e).replace(repr(uri.rstrip("/")), repr(uri), 1) if folder else str(e)) from None
    if _bad_segment(key):
        raise ValueError(f"{what} {uri!r}: empty, '.' or '..' path segment in the {'prefix' if folder else 'key'}")
    if not folder and not key.lower().endswith(READABLE_SUFFIXES):
        raise ValueError(f"{what} {uri!r}: must name a .jsonl / .json (Mooncake, pdserve --traffic-log) or .csv "
                         "(Azure) trace, or a folder of them ending in '/'; the reader picks the format by the suffix")
    return bucket, key, folder


def _bad_segment(path: str) -> bool:
    """Whether a '/'-separated key or prefix (without its trailing '/') has an empty, '.' or '..' segment."""
    return any(seg in ("", ".", "..") for seg in path.split("/"))


def split_s3_prefix_uri(uri: str, what: str = "uri", *, folder: bool = False) -> tuple[str, str]:
    """``s3://bucket``, ``s3://bucket/`` or ``s3://bucket/prefix[/]`` naming a folder → ``(bucket, prefix)``, the
    prefix ending in '/' or "" (the whole bucket). Reads nothing.

    Args:
        uri: the URI as the user gave it.
        what: what messages call it (an option or field name).
        folder: the URI must itself end in '/' (``s3://bucket/`` or ``s3://bucket/prefix/``), as where a name is
            appended to it (``s3://bucket`` + name would change the bucket); False: a missing '/' is added.

    Raises:
        ValueError: (message naming ``what``) not s3://; a query string or fragment (a presigned URL's signature
            is a credential: the message shows the URI cut before it); a '$' (the kubelet expands ``$(VAR)`` in
            container args, and a pod's env holds S3 credentials); a bucket S3 would refuse; with ``folder`` a
            URI not ending in '/'; an empty, '.' or '..' segment in the prefix.
    """
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ValueError(f"{what} {uri!r}: must be an s3://bucket/prefix/ URI")
    _refuse_query_and_dollar(uri, what)
    bucket, slash, prefix = uri[len("s3://"):].partition("/")
    if not S3_BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ValueError(f"{what} {uri!r}: bucket {bucket!r} is not a valid S3 bucket name")
    if folder and not slash:
        raise ValueError(f"{what} {uri!r}: must end in '/' (s3://{bucket}/ or s3://{bucket}/prefix/)")
    if folder and prefix and not prefix.endswith("/"):
        raise ValueError(f"{what} {uri!r}: the prefix must end in '/' (it names a folder of objects)")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    if prefix and _bad_segment(prefix[:-1]):
        raise ValueError(f"{what} {uri!r}: empty, '.' or '..' path segment in the prefix")
    return bucket, prefix


def check_upload_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix/`` or ``s3://bucket/`` of ``--traffic-upload`` → (bucket, prefix ending in '/' or
    ""): `split_s3_prefix_uri` with ``folder=True`` (each runtime writes a folder of objects under it).

    Raises:
        ValueError: as `split_s3_prefix_uri`.
    """
    return split_s3_prefix_uri(uri, "--traffic-upload", folder=True)
