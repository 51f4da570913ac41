"""The OpenAI Batch file format: parse and check input lines, build and read output lines (pure).

Input (OpenAI Batch API "batch input file", also what ``vllm run-batch`` reads): one JSON object per line,
``{"custom_id": str, "method": "POST", "url": "/v1/chat/completions", "body": {...}}``. ``url`` is only a
PATH from ``ALLOWED_URLS``: the runner joins it to the endpoint it was configured with, so no line of a batch
file can choose which server receives a request (a full URL, another path or ``..`` is refused).

Output (OpenAI "batch output file"): one line per request,
``{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error": {"code", "message"} | null}``;
a request that got an HTTP answer has ``response`` (and ``error`` when the status is not 2xx); one that never got
an answer (connection refused, timeout) has ``response: null`` and ``error``. Each line written by the runner also
carries ``request_sha256`` (``REQUEST_HASH_KEY``), the hash of the url and body it answers (OpenAI clients ignore
a key they do not know). Resuming keeps the 2xx lines of an earlier output whose request is unchanged and sends the
rest again: a line whose hash differs from its input line's request is an answer to another request (the body was
edited since); a line without the key (written by a runner that did not record it) is kept by ``custom_id`` alone.

Pure: parses lines the caller has read, returns lines for the caller to write.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from runtime import strict_json

#: Paths a batch line may name: the OpenAI Batch API endpoints the pdserve runtime serves (it has no embeddings).
ALLOWED_URLS = ("/v1/chat/completions", "/v1/completions")
#: At most this many problems are listed in one BatchInputError.
MAX_LISTED_ERRORS = 20
#: Top-level key of an output line: :func:`request_sha256` of the request the line answers.
REQUEST_HASH_KEY = "request_sha256"


class BatchInputError(ValueError):
    """The batch file has malformed lines; the message lists them as ``line N: problem`` (nothing was sent)."""


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One checked input line: ``url`` is one of ``ALLOWED_URLS``; ``line`` is its 1-based line number;
    ``body_json`` the request body as compact UTF-8 JSON (the model filled in), what is sent.

    The body is held serialised, not parsed: a parsed body of a few fields costs about 1 KiB of Python objects,
    its JSON a few hundred bytes, and a batch keeps every request of its input (an input of a million short
    requests fits a 1 GiB pod only this way)."""

    custom_id: str
    url: str
    body_json: bytes
    line: int

    @property
    def body(self) -> dict[str, Any]:
        """The request body, parsed again (a new dict on each call)."""
        return strict_json.loads(self.body_json)


def request_sha256(req: BatchRequest) -> str:
    """SHA-256 (64 lowercase hex digits) of what is asked by ``req``: its url, a newline, then its body as canonical
    JSON (keys sorted at every level, compact, UTF-8), the model filled in by ``--model`` included.

    Any change to what the server is asked (prompt, ``max_tokens``, model, url) changes the hash; the order of the
    body's keys does not, so an input rewritten by another JSON writer does not send every request again."""
    canonical = json.dumps(json.loads(req.body_json), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    h = hashlib.sha256(req.url.encode())
    h.update(b"\n")
    h.update(canonical.encode())
    return h.hexdigest()


def parse_input(lines: Iterable[str], default_model: str | None = None) -> list[BatchRequest]:
    """Check every line of a batch input file and return its requests in file order.

    Blank lines are skipped. A line without ``body.model`` gets ``default_model`` when one is given.

    Args:
        lines: the file's lines (text, with or without newlines).
        default_model: served model name for lines whose body names none.

    Raises:
        BatchInputError: any line is not a JSON object (not JSON, a number JSON cannot carry such as ``NaN``
            or ``1e400``, nesting beyond Python's recursion limit), lacks or repeats ``custom_id``, has a method
            other than POST, a ``url`` outside ``ALLOWED_URLS``, a body that is not an object, no model (and no
            default), or asks to stream; also an input with no request. All problems (up to
            ``MAX_LISTED_ERRORS``) are listed at once.
    """
    out: list[BatchRequest] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(lines, 1):
        text = raw.lstrip("\ufeff") if n == 1 else raw
        if not text.strip():
            continue
        try:
            rec = strict_json.loads(text)
        except ValueError as e:
            problems.append(f"line {n}: not JSON ({e})")
            continue
        except RecursionError:  # Python's json recurses once per level of nesting
            problems.append(f"line {n}: nested too deeply to read")
            continue
        if not isinstance(rec, dict):
            problems.append(f"line {n}: expected a JSON object, got {type(rec).__name__}")
            continue
        req, errs = _check(rec, n, default_model, seen)
        problems.extend(errs)
        if req is not None:
            out.append(req)
    if problems:
        more = len(problems) - MAX_LISTED_ERRORS
        listed = "; ".join(problems[:MAX_LISTED_ERRORS]) + (f"; and {more} more" if more > 0 else "")
        raise BatchInputError(f"{len(problems)} problem(s) in the batch input, nothing sent: {listed}")
    if not out:
        raise BatchInputError("the batch input has no request (every line is blank)")
    return out


def _check(rec: dict, n: int, default_model: str | None, seen: dict[str, int]) -> tuple[BatchRequest | None, list[str]]:
    errs = []
    cid = rec.get("custom_id")
    if not isinstance(cid, str) or not cid:
        errs.append(f"line {n}: custom_id must be a non-empty string")
    elif cid in seen:
        errs.append(f"line {n}: custom_id {cid!r} repeats line {seen[cid]}")
    if isinstance(cid, str) and cid and cid not in seen:
        seen[cid] = n  # an invalid line's id is taken too: its duplicate is listed with the other problems
    method = rec.get("method", "POST")
    if method != "POST":
        errs.append(f"line {n}: method must be POST, got {method!r}")
    url = rec.get("url")
    if url not in ALLOWED_URLS:
        errs.append(f"line {n}: url must be one of {', '.join(ALLOWED_URLS)} (a path on the configured endpoint), "
                    f"got {url!r}")
    body = rec.get("body")
    if not isinstance(body, dict):
        errs.append(f"line {n}: body must be a JSON object")
    else:
        model = body.get("model") if body.get("model") is not None else default_model
        if not isinstance(model, str) or not model:
            errs.append(f"line {n}: body.model is missing (or pass --model, the served model name)")
        if body.get("stream"):
            errs.append(f"line {n}: body.stream must be false or absent (a batch stores whole responses)")
    if errs:
        return None, errs
    if body.get("model") is None:
        body = {**body, "model": default_model}
    # floats are written as repr (round-trips exactly), non-ASCII as UTF-8
    try:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except UnicodeEncodeError:  # JSON's "\ud800" escape reads as a lone surrogate, which no UTF-8 body carries
        return None, [f"line {n}: body holds a string with a lone UTF-16 surrogate (not encodable as UTF-8)"]
    except RecursionError:
        return None, [f"line {n}: nested too deeply to read"]
    return BatchRequest(custom_id=cid, url=url, body_json=data, line=n), []


def output_line(custom_id: str, *, status_code: int | None, body: Any = None, request_id: str = "",
                error: str | None = None, request_hash: str | None = None) -> str:
    """One output line (JSON, newline-terminated) for ``custom_id``.

    ``status_code`` None means no HTTP answer (``error`` says why). A non-2xx status also gets an ``error``
    (``error`` or, failing that, the OpenAI error message in ``body``), and so does a 2xx with an ``error`` (an
    answer that is not an OpenAI response). A body JSON cannot hold (NaN, Infinity) is dropped and said so.
    ``request_hash`` (:func:`request_sha256` of the request answered) is written under ``REQUEST_HASH_KEY``
    when given, so a resumed run can tell an answer to an edited request from a current one.
    """
    response = None if status_code is None else {"status_code": status_code, "request_id": request_id, "body": body}
    err = None
    if status_code is None or not 200 <= status_code < 300 or error:
        message = error or error_message(body) or f"HTTP {status_code}"
        code = "request_failed" if status_code is None else ("invalid_response" if 200 <= status_code < 300
                                                             else f"http_{status_code}")
        err = {"code": code, "message": message}
    rec = {"id": f"batch_req_{request_id or custom_id}", "custom_id": custom_id, "response": response, "error": err}
    if request_hash is not None:
        rec[REQUEST_HASH_KEY] = request_hash
    try:
        return json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n"
    except ValueError:  # NaN / Infinity in the answer: not JSON; keep the line valid, count it as failed
        return output_line(custom_id, status_code=status_code, body=None, request_id=request_id,
                           error="the answer holds NaN or Infinity (not JSON); its body was dropped",
                           request_hash=request_hash)


def error_message(body: Any) -> str | None:
    """The message of an OpenAI error object (`{"error": {"message": ...}}`); None for any other body."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        msg = body["error"].get("message")
        return msg if isinstance(msg, str) else None
    return None


@dataclass(frozen=True, slots=True)
class Answered:
    """A 2xx output line of an earlier run: ``line`` (newline-terminated) and ``request_hash``, the line's
    ``REQUEST_HASH_KEY`` (None when the line has none, written without it; "" when it is not a string, which
    matches no request)."""

    line: str
    request_hash: str | None


def succeeded_lines(lines: Iterable[str]) -> dict[str, Answered]:
    """``{custom_id: Answered}`` of the output lines whose request succeeded (2xx, an OpenAI body, no error), last
    one winning.

    Lines that are not output records (a truncated last line after a crash, a failed request) are left out, so a
    resumed run sends those requests again. Whether an answer still answers its input line is
    :func:`kept_answers`' question.
    """
    done: dict[str, Answered] = {}
    for raw in lines:
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("custom_id"), str):
            continue
        resp = rec.get("response")
        code = resp.get("status_code") if isinstance(resp, dict) else None
        if (type(code) is int and 200 <= code < 300 and rec.get("error") is None
                and isinstance(resp.get("body"), dict)):
            digest = rec.get(REQUEST_HASH_KEY)
            digest = digest if digest is None or isinstance(digest, str) else ""
            done[rec["custom_id"]] = Answered(raw if raw.endswith("\n") else raw + "\n", digest)
    return done


def kept_answers(done: dict[str, Answered], requests: Iterable[BatchRequest]) -> tuple[dict[str, str], list[str]]:
    """Split earlier answers (:func:`succeeded_lines`) by whether they still answer ``requests``.

    Returns:
        ``(kept, changed)``: ``kept`` maps the custom_id of each request whose answer is current to its line, in
        input order (a line with a hash equal to :func:`request_sha256` of the request, or with no hash at all:
        such a line is trusted by custom_id alone); ``changed`` lists, in input order, the custom_ids whose line
        answers another url or body (the input was edited since), to be sent again. Answers whose custom_id is
        in no request are in neither (the caller refuses such an output).
    """
    kept: dict[str, str] = {}
    changed: list[str] = []
    for req in requests:
        ans = done.get(req.custom_id)
        if ans is None:
            continue
        if ans.request_hash is None or ans.request_hash == request_sha256(req):
            kept[req.custom_id] = ans.line
        else:
            changed.append(req.custom_id)
    return kept, changed


def not_output_lines(lines: Iterable[str]) -> list[int]:
    """1-based numbers of the lines that are not batch output records (a JSON object with a string
    ``custom_id`` and the keys ``response`` and ``error``), blank lines skipped. A last line that is not JSON is
    not counted: it is what a crash while appending leaves (:func:`succeeded_lines` drops it and a resumed run
    sends its request again). Any other such line means the file is no batch output (a file named by mistake),
    which a resumed run must not overwrite.
    """
    numbered = [(n, raw) for n, raw in enumerate(lines, 1) if raw.strip()]
    bad: list[int] = []
    for i, (n, raw) in enumerate(numbered):
        try:
            rec = json.loads(raw)
        except ValueError:
            if i < len(numbered) - 1:
                bad.append(n)
            continue
        if not (isinstance(rec, dict) and isinstance(rec.get("custom_id"), str) and "response" in rec
                and "error" in rec):
            bad.append(n)
    return bad


def usage_tokens(body: Any) -> tuple[int, int]:
    """``(prompt_tokens, completion_tokens)`` from an OpenAI response body's ``usage`` (0, 0 when absent)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (p if type(p) is int and p >= 0 else 0), (c if type(c) is int and c >= 0 else 0)  # not bools
