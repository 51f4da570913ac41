"""How the batch runner reads its input (runtime.batch.run): a line at a time, local file or S3 body alike.

Specification: reading holds the line being read and the parsed requests, never the file's text (the runner
pod has 1 GiB for inputs of up to 200 MB); an S3 object is split and decoded exactly as a local text file
(universal newlines, a BOM kept for the parser, U+2028 / U+0085 inside a line do not end it), wherever the
chunks it arrives in are cut; a byte that is not UTF-8 anywhere refuses the whole input; an S3 body that breaks
off is a read error of the input, and nothing is sent.
"""

from __future__ import annotations

import io
import json
import tracemalloc

import pytest
from botocore.response import StreamingBody
from urllib3.exceptions import ProtocolError

from runtime.batch.requests import BatchInputError
from runtime.batch.run import BatchRunError, BatchS3UnreachableError, _open_lines, run_batch

NOWHERE = "http://127.0.0.1:9"  # every case here fails before a request is sent


class _S3:
    """An S3 client serving one object through botocore's own streaming body."""

    class exceptions:  # noqa: N801 - the attribute boto3 clients carry
        NoSuchKey = type("NoSuchKey", (Exception,), {})

    def __init__(self, data: bytes, raw: io.RawIOBase | None = None, length: int | None = None) -> None:
        self.data, self.raw, self.length = data, raw, length

    def get_object(self, Bucket: str, Key: str) -> dict:  # noqa: N803 - boto3's names
        raw = self.raw or io.BytesIO(self.data)
        return {"Body": StreamingBody(raw, len(self.data) if self.length is None else self.length)}


def _request(cid: str) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "p"}})


@pytest.mark.parametrize("where", ["local", "s3"])
def test_reading_an_input_holds_a_line_at_a_time_not_the_file(where, tmp_path):
    line_mib, lines = 1, 24
    # lines of 1 MiB whose requests are tiny (JSON allows the trailing blanks), the last one malformed: run_batch
    # reads and checks all of them, then stops before sending; what it held is what reading took
    data = "".join(_request(f"r{i}").ljust(line_mib << 20) + "\n" for i in range(lines)).encode() + b"{oops\n"
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(data)
    uri, s3 = (str(inp), None) if where == "local" else ("s3://batch-input/in.jsonl", _S3(data))
    tracemalloc.start()
    try:
        with pytest.raises(BatchInputError, match=f"line {lines + 1}: not JSON"):
            run_batch(uri, str(tmp_path / "out.jsonl"), endpoint=NOWHERE, s3_client=s3, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * (line_mib << 20), f"read a {len(data) >> 20} MiB input holding {peak >> 20} MiB"


def test_an_s3_input_splits_and_decodes_lines_like_a_local_file(tmp_path):
    # every kind of line end and multi-byte character, repeated with an odd length so that the 8 KiB chunks of
    # the body cut each of them (a '\r\n', a 4-byte emoji) somewhere
    unit = "ab\u20ac\U0001f600\u2028x\x85y\r\nc\rd\ne\r\n"
    text = "\ufeff" + unit * 3000 + "tail without a newline \U0001f600"
    data = text.encode("utf-8")
    assert len(unit.encode()) % 2 == 1 and len(data) > 8 * 8192
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(data)
    expected = io.StringIO(text, newline=None).readlines()
    assert expected[0].startswith("\ufeffab") and "\r" not in "".join(expected) and "\u2028x\x85y\n" in expected[0]
    with _open_lines(str(inp), None, missing_ok=False) as local:
        assert list(local) == expected
    with _open_lines("s3://batch-input/in.jsonl", _S3(data), missing_ok=False) as remote:
        assert list(remote) == expected


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("bad", [b"\xff\n", b"\xed\xa0\x80\n", "\u20ac".encode()[:2]],
                         ids=["invalid-byte", "encoded-surrogate", "cut-at-the-end"])
def test_a_byte_that_is_not_utf8_anywhere_refuses_the_whole_input(where, bad, tmp_path):
    data = "".join(_request(f"r{i}") + "\n" for i in range(2000)).encode() + bad  # far past the first chunk
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(data)
    uri, s3 = (str(inp), None) if where == "local" else ("s3://batch-input/in.jsonl", _S3(data))
    with pytest.raises(BatchRunError, match="in.jsonl: not UTF-8 text"):
        run_batch(uri, str(tmp_path / "out.jsonl"), endpoint=NOWHERE, s3_client=s3, progress=False)
    assert not (tmp_path / "out.jsonl").exists()


class _Dropping(io.RawIOBase):
    """A connection that delivers ``data`` and then breaks."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        chunk = self._data.read(n)
        if not chunk:
            raise ProtocolError("Connection broken: connection reset by peer")
        return chunk


def test_an_s3_body_that_breaks_off_is_a_read_error_and_nothing_is_sent(tmp_path):
    data = "".join(_request(f"r{i}") + "\n" for i in range(2000)).encode()
    out = str(tmp_path / "out.jsonl")
    with pytest.raises(BatchS3UnreachableError, match="cannot reach the S3 endpoint"):
        run_batch("s3://batch-input/in.jsonl", out, endpoint=NOWHERE, s3_client=_S3(data, raw=_Dropping(data),
                                                                          length=len(data) + 10), progress=False)
    # a body that ends before its announced length
    with pytest.raises(BatchRunError, match="cannot read: .* but total bytes expected"):
        run_batch("s3://batch-input/in.jsonl", out, endpoint=NOWHERE, s3_client=_S3(data, length=len(data) + 10),
                  progress=False)
    assert not (tmp_path / "out.jsonl").exists()
