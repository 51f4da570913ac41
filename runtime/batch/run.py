"""Run a batch file against the pdserve endpoint: bounded concurrency, retries, resume, local or S3 files.

``run_batch(input_uri, output_uri, endpoint=...)`` reads an OpenAI Batch input file (``runtime.batch.requests``),
sends each request to ``endpoint`` + the line's path (``/v1/chat/completions`` …) with at most ``concurrency``
in flight, and writes one output line per request as it completes. Transient failures (connection errors,
timeouts, HTTP 429/500/502/503/504) are retried with exponential back-off and jitter (tenacity), up to
``max_retries`` times. A run that stops part-way (pod evicted, Ctrl-C) leaves the finished lines in the output;
running the same command again keeps its 2xx lines and sends only the rest. Each line records the hash of the
request it answers (``runtime.batch.requests.request_sha256``): a request whose url or body was edited in the input
since it was answered is sent again and its old line dropped, never kept as the answer to the new request.

Files are local paths or ``s3://bucket/key`` (boto3, the same client and credential chain as staging:
``runtime.staging.s3.make_client``). An S3 output is written through a local work file and uploaded every
``checkpoint_s`` seconds and at the end (also after an error or interrupt), so a resumed run loses at most
``checkpoint_s`` of work.

The batch shares the online endpoint: ``concurrency`` bounds how much of it the batch takes (the router and
planner see batch requests like any other). An API key, when the endpoint wants one, is read from the
environment variable the caller names and is never logged or written.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from runtime.batch.requests import (BatchRequest, error_message, kept_answers, not_output_lines, output_line,
                                    parse_input, request_sha256, succeeded_lines, usage_tokens)
from runtime.paths import write_text_atomically

log = logging.getLogger(__name__)

#: HTTP statuses worth another try (throttled, or a server / gateway that may recover).
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_JSON = {"content-type": "application/json"}


class BatchRunError(RuntimeError):
    """The batch cannot run (bad endpoint or file location, unreadable input, output not writable)."""


class BatchS3UnreachableError(BatchRunError):
    """The S3 endpoint of an input or output could not be reached (connection refused or timed out after
    botocore's retries): nothing was sent, and the same command may succeed later: a failure while running,
    not a bad value."""


class BatchInterrupted(Exception):
    """SIGINT (Ctrl-C) or SIGTERM stopped the run while it sent requests: ``summary`` is what was done so far (every
    finished answer is in the output, an S3 output uploaded), ``status`` the exit status the signal asks for (128 +
    its number: 130, 143). Running the same command again sends the rest."""

    def __init__(self, summary: "BatchSummary", status: int) -> None:
        super().__init__(f"interrupted (exit status {status})")
        self.summary, self.status = summary, status


@dataclass
class BatchSummary:
    """What one run did. ``resumed``: requests already answered (2xx) in an earlier output, not sent again;
    ``changed``: requests answered (2xx) in an earlier output for another url or body (the input line was edited
    since), sent again in this run (counted in ``succeeded`` / ``failed`` when answered)."""

    requests: int = 0
    resumed: int = 0
    changed: int = 0
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    not_found: int = 0  # failed with HTTP 404 (a wrong --endpoint base, or a model the server does not serve)
    unknown_model: int = 0  # of those, 404s whose error speaks of the model: a model the server does not serve

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["wall_s"] = round(self.wall_s, 3)
        d["output_tokens_per_s"] = round(self.completion_tokens / self.wall_s, 2) if self.wall_s > 0 else None
        return d


def check_endpoint(endpoint: str) -> str:
    """The endpoint without a trailing '/': an http(s) URL with a host, a valid port if any, no credentials, no
    query or fragment.

    Raises:
        BatchRunError: anything else (the message shows the value, its credentials redacted).
    """
    from runtime.redact import redact_userinfo

    shown = redact_userinfo(endpoint)
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 - raises ValueError for a port outside 0-65535
    except ValueError as e:
        raise BatchRunError(f"--endpoint {shown!r}: not a URL ({e})") from None
    if parts.username is not None or parts.password is not None:
        raise BatchRunError(f"--endpoint {shown!r}: must not carry credentials; give a bearer token with "
                            "--api-key-env (it is never printed or written)")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise BatchRunError(f"--endpoint must be an http(s) URL of the OpenAI base (e.g. "
                            f"http://<isvc>-predictor.<namespace>.svc.cluster.local/openai), got {shown!r}")
    if parts.path.rstrip("/").endswith("/v1"):  # what OpenAI SDK users type; the lines carry /v1/... themselves
        raise BatchRunError(f"--endpoint {shown!r}: drop the trailing /v1 (each batch line's url already starts "
                            "with /v1/, e.g. http://host:8080/openai)")
    return endpoint.rstrip("/")


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``(bucket, key)`` of ``s3://bucket/key`` (``runtime.s3uri.split_s3_object_uri``).

    Raises:
        BatchRunError: not an object URI (no or invalid bucket, no key, a prefix); the message shows the URI.
    """
    from runtime.s3uri import split_s3_object_uri

    try:
        return split_s3_object_uri(uri, "")
    except ValueError as e:
        raise BatchRunError(str(e).lstrip()) from None


@contextmanager
def _open_lines(uri: str, s3: Any, *, missing_ok: bool) -> Iterator[Iterator[str] | None]:
    """The lines of the local or S3 text file ``uri``, read one at a time as the caller iterates (None: absent and
    ``missing_ok``); the file or S3 body is closed when the block ends.

    Read as ``open(encoding="utf-8")`` reads a local file (universal newlines: '\r\n' and a lone '\r' end a line
    and become '\n'; a BOM is kept for the caller), for an S3 object too: not ``str.splitlines``, which also
    breaks at U+2028 / U+0085 inside JSON strings. Never the whole file at once: a batch input may be 200 MB
    and the runner pod has 1 GiB.

    Raises:
        BatchRunError: missing (without ``missing_ok``), unreadable or not UTF-8, on opening or while iterating.
        BatchS3UnreachableError: the S3 endpoint cannot be reached, or the connection drops while reading.
    """
    stream = _open_text(uri, s3, missing_ok=missing_ok)
    if stream is None:
        yield None
        return
    with stream:
        yield _each_line(stream, uri)


def _open_text(uri: str, s3: Any, *, missing_ok: bool) -> io.TextIOWrapper | None:
    if not uri.startswith("s3://"):
        path = Path(uri)
        if missing_ok and not path.exists():
            return None
        try:
            return path.open(encoding="utf-8")
        except OSError as e:
            raise BatchRunError(f"{uri}: {e.strerror or e}") from None
    from botocore.exceptions import ConnectionError as BotoConnectionError, HTTPClientError

    bucket, key = split_s3_uri(uri)
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"]
    except s3.exceptions.NoSuchKey:
        if missing_ok:
            return None
        raise BatchRunError(f"{uri}: no such object") from None
    except (BotoConnectionError, HTTPClientError) as e:  # refused, timed out, dropped
        raise BatchS3UnreachableError(f"{uri}: cannot reach the S3 endpoint: {e}") from None
    except Exception as e:  # noqa: BLE001 - botocore ClientError (NoSuchBucket, AccessDenied)
        raise BatchRunError(f"{uri}: cannot read: {e}") from None
    # the decoding and line splitting of a local text file (io.open is this wrapper over a binary stream)
    return io.TextIOWrapper(body, encoding="utf-8", newline=None)


def _each_line(stream: io.TextIOWrapper, uri: str) -> Iterator[str]:
    """The lines of ``stream``; an error while reading it (never one of the caller's) becomes a BatchRunError."""
    try:
        for line in stream:
            yield line
    except UnicodeDecodeError as e:
        raise BatchRunError(f"{uri}: not UTF-8 text ({e})") from None
    except Exception as e:  # noqa: BLE001 - sorted by _read_error; what it does not know goes up unchanged
        error = _read_error(uri, e)
        if error is None:
            raise
        raise error from None


def _read_error(uri: str, e: Exception) -> BatchRunError | None:
    if uri.startswith("s3://"):
        from botocore.exceptions import BotoCoreError, ConnectionError as BotoConnectionError, HTTPClientError
        from urllib3.exceptions import HTTPError as Urllib3Error

        # before OSError: botocore's read timeout is one too
        if isinstance(e, (BotoConnectionError, HTTPClientError)):  # the connection dropped or timed out mid-body
            return BatchS3UnreachableError(f"{uri}: cannot reach the S3 endpoint: {e}")
        if isinstance(e, (BotoCoreError, Urllib3Error)):  # a body shorter than announced, a failed checksum
            return BatchRunError(f"{uri}: cannot read: {e}")
    if isinstance(e, OSError):
        return BatchRunError(f"{uri}: {e.strerror or e}")
    return None


async def send_all(
    requests: list[BatchRequest],
    write: Callable[[str, BatchRequest, Any], None],
    *,
    endpoint: str,
    concurrency: int = 8,
    max_retries: int = 3,
    timeout_s: float = 600.0,
    headers: dict[str, str] | None = None,
    backoff_s: float = 0.5,
    secrets: tuple[str, ...] = (),
) -> None:
    """Send ``requests`` with at most ``concurrency`` in flight; call ``write(line, request, body)`` for each
    as it completes (``line``: its output line, whose ``error`` is null when it succeeded, with the request's
    hash, ``requests.REQUEST_HASH_KEY``).

    ``endpoint`` must have passed :func:`check_endpoint`; each request goes to ``endpoint + request.url``.
    Retries: transport errors and ``RETRY_STATUSES``, at most ``max_retries`` more tries each, waiting
    ``backoff_s * 2^k`` seconds with jitter (at most 30 s) between them. A request that ends in any httpx
    error (a body that cannot be decoded included), that cannot be sent at all, or a 2xx without a JSON object
    is written as failed; the run goes on. ``secrets`` (e.g. the API key) are masked in the error text.
    """
    import httpx
    from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential, wait_random

    class _Retry(Exception):
        def __init__(self, resp: httpx.Response) -> None:
            self.resp = resp

    queue = iter(requests)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)), limits=limits,
                                 headers=headers or {}) as client:

        async def one(req: BatchRequest) -> None:
            status: int | None = None
            body: Any = None
            request_id, error = "", None
            try:
                async for attempt in AsyncRetrying(
                        retry=retry_if_exception_type((httpx.TransportError, _Retry)),
                        stop=stop_after_attempt(max_retries + 1),
                        wait=wait_exponential(multiplier=backoff_s, max=30.0) + wait_random(0, backoff_s),
                        reraise=True):
                    with attempt:
                        resp = await client.post(endpoint + req.url, content=req.body_json, headers=_JSON)
                        if resp.status_code in RETRY_STATUSES:
                            raise _Retry(resp)
            except _Retry as e:  # retries spent on a retryable status: record the last answer
                resp = e.resp
            except httpx.HTTPError as e:  # transport errors after the retries; an undecodable body (DecodingError)
                resp, error = None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            except (ValueError, TypeError) as e:  # a body or header that cannot be sent: this line fails alone
                resp, error = None, f"the request could not be sent: {type(e).__name__}: {e}"
            if resp is not None:
                status = resp.status_code
                request_id = resp.headers.get("x-request-id", "")
                try:
                    body = resp.json()
                except ValueError:
                    body = resp.text
                if 200 <= status < 300 and not isinstance(body, dict):  # not an OpenAI answer: a failure to retry
                    error = "the endpoint answered 2xx without a JSON object (not an OpenAI response)"
            for secret in secrets:
                if error:
                    error = error.replace(secret, "***")
            line = output_line(req.custom_id, status_code=status, body=body, request_id=request_id, error=error,
                               request_hash=request_sha256(req))
            write(line, req, body)

        async def worker() -> None:
            for req in queue:  # one shared iterator: never more than `concurrency` requests materialised
                await one(req)

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(requests))))))


def run_batch(
    input_uri: str,
    output_uri: str,
    *,
    endpoint: str,
    model: str | None = None,
    concurrency: int = 8,
    max_retries: int = 3,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    s3_client: Any = None,
    checkpoint_s: float = 60.0,
    progress: bool = True,
    backoff_s: float = 0.5,
) -> BatchSummary:
    """Run the batch file ``input_uri`` against ``endpoint`` and write ``output_uri`` (see the module doc).

    Everything that can be checked is checked before the first request: the options, the input (every line),
    the output (a local output must be a regular file or absent, a symlink is written through; an S3 output is
    uploaded once with the kept lines), and that an existing output belongs to this input (every answered
    custom_id in it is in the input: a resumed output never silently loses answers).

    Resume: an existing output is rewritten with its 2xx lines that still answer their input line (same url and
    body, by the hash each line records; a line without one is kept by custom_id), one per custom_id, then each
    new answer is appended. A request edited since its answer is sent again (``BatchSummary.changed``) and its old
    line is dropped, so the output never holds an answer to a request that is no longer in the input.

    Args:
        input_uri / output_uri: local paths or ``s3://bucket/key``; an existing output is resumed.
        endpoint: OpenAI base URL of the pdserve runtime (KServe: ``http://host/openai``).
        model: served model name for lines whose body names none.
        concurrency: requests in flight (>= 1). max_retries: extra tries per request (>= 0).
        timeout_s: per-request read timeout, seconds. api_key: sent as ``Authorization: Bearer``.
        s3_client: boto3 S3 client (default: ``runtime.staging.s3.make_client()`` when a URI is s3://).
        checkpoint_s: upload an S3 output this often, seconds (a failed checkpoint is retried at the next one).
        progress: rich progress bar on stderr.

    Returns:
        BatchSummary (``failed`` > 0 when some requests got no 2xx answer; their lines say why).

    Raises:
        BatchInterrupted: SIGINT, or SIGTERM with runtime.procs.install_sigterm_handler, while requests were sent:
            the summary so far (the finished answers are kept, an S3 output uploaded first).
        BatchRunError: bad endpoint, API key, concurrency or URIs; unreadable input; an output that is not
            writable, holds another batch's answers or lines that are no batch output (requests.not_output_lines)
            (all before any request is sent).
        BatchUploadError: the final upload of an S3 output failed after requests were sent; the message names
            the local file that keeps the answers.
        runtime.batch.requests.BatchInputError: malformed input lines (nothing sent, output untouched).
    """
    if concurrency < 1 or max_retries < 0 or timeout_s <= 0:
        raise BatchRunError(f"need concurrency >= 1, max_retries >= 0 and timeout_s > 0, got {concurrency}, "
                            f"{max_retries}, {timeout_s}")
    base = check_endpoint(endpoint)
    if api_key is not None and (not api_key or not api_key.isascii()
                                or any(c.isspace() or not c.isprintable() for c in api_key)):
        raise BatchRunError("the API key is empty or contains whitespace, control or non-ASCII characters (an HTTP "
                            "header carries ASCII; a Secret made from a file often ends in a newline)")
    s3_out = output_uri.startswith("s3://")
    for option, uri in (("--input", input_uri), ("--output", output_uri)):
        if not uri.strip():  # a path read as the current folder
            raise BatchRunError(f"{option}: empty; give a local path or s3://bucket/key")
        if uri.startswith("s3://"):
            try:
                split_s3_uri(uri)
            except BatchRunError as e:
                raise BatchRunError(f"{option} {e}") from None
    if _same_location(input_uri, output_uri):
        raise BatchRunError(f"--output {output_uri}: is the input file; choose another output")
    target = None if s3_out else Path(output_uri).resolve()  # a symlinked output is written where it points
    if target is not None and target.exists() and not target.is_file():
        raise BatchRunError(f"--output {output_uri}: not a regular file")
    s3 = s3_client
    if s3 is None and (input_uri.startswith("s3://") or s3_out):
        from runtime.staging.s3 import make_client

        s3 = make_client()
    with _open_lines(input_uri, s3, missing_ok=False) as lines:
        # only the parsed requests are kept (every line is checked before the first is sent), never the text
        requests = parse_input(lines or [], default_model=model)
    with _open_lines(output_uri, s3, missing_ok=True) as lines:
        existing = list(lines or [])
    strangers = not_output_lines(existing)
    if strangers:  # resuming rewrites the output with its answered lines only: everything else would be lost
        raise BatchRunError(f"--output {output_uri}: line {strangers[0]} is not a batch output line (custom_id, "
                            "response, error): not an earlier output of this batch? Choose another output; "
                            "nothing was sent")
    done = succeeded_lines(existing)
    foreign = sorted(set(done) - {r.custom_id for r in requests})
    if foreign:
        raise BatchRunError(f"--output {output_uri}: holds answers to {len(foreign)} request(s) that are not in "
                            f"this input (e.g. custom_id {foreign[0]!r}): another batch's output? Choose another "
                            "output; nothing was sent")
    # an answer to an edited request is dropped here, so the rewrite below leaves it out of the output
    kept, changed = kept_answers(done, requests)
    todo = [r for r in requests if r.custom_id not in kept]
    summary = BatchSummary(requests=len(requests), resumed=len(kept), changed=len(changed))
    if changed:
        log.info("%d request(s) changed since they were answered (e.g. custom_id %r): sent again",
                 len(changed), changed[0])

    tmpdir = tempfile.TemporaryDirectory(prefix="pdserve-batch-") if s3_out else None
    work = Path(tmpdir.name) / "output.jsonl" if tmpdir else target
    sent = False
    stopped = None  # the exit status of SIGINT / SIGTERM when one stopped the sending
    try:
        try:
            mode = stat.S_IMODE(work.stat().st_mode) if work.exists() else None
            # the kept 2xx lines replace the old output atomically (a crash here loses no earlier answer), with
            # the old file's permissions; then each new answer is appended as it comes
            write_text_atomically(work, "".join(kept.values()))
            if mode is not None:
                os.chmod(work, mode)
            out = work.open("a", encoding="utf-8")
        except OSError as e:
            raise BatchRunError(f"{output_uri}: cannot write: {e.strerror or e}") from None
        if tmpdir is not None:
            _upload(work, output_uri, s3)  # can we write there at all? before any request
        sent = True
        try:
            with out:
                _run_loop(todo, out, summary, done=len(kept), base=base, concurrency=concurrency,
                          max_retries=max_retries, timeout_s=timeout_s, api_key=api_key, progress=progress,
                          backoff_s=backoff_s,
                          checkpoint=(lambda: _checkpoint(work, output_uri, s3)) if tmpdir else None,
                          checkpoint_s=checkpoint_s)
        except OSError as e:  # the disk filled up, say: the answers written so far are kept for a resumed run
            raise BatchRunError(f"{output_uri}: cannot write: {e.strerror or e}; the answers written before are "
                                "kept: free space and run the same command again to send the rest") from None
        except KeyboardInterrupt:
            stopped = 128 + signal.SIGINT
        except SystemExit as e:  # runtime.procs' SIGTERM handler: 128 + SIGTERM
            if not (isinstance(e.code, int) and e.code > 128):
                raise
            stopped = e.code
    finally:
        if tmpdir is not None:
            _finish_upload(tmpdir, work, output_uri, s3, sent)
    if stopped is not None:
        raise BatchInterrupted(summary, stopped)
    return summary


class BatchUploadError(BatchRunError):
    """The answers could not be uploaded to the S3 output at the end; they are kept in a local file (named)."""


def _same_location(a: str, b: str) -> bool:
    if a.startswith("s3://") or b.startswith("s3://"):
        return a.startswith("s3://") and b.startswith("s3://") and split_s3_uri(a) == split_s3_uri(b)
    pa, pb = Path(a), Path(b)
    try:
        if pa.exists() and pb.exists():
            return os.path.samefile(pa, pb)
    except OSError:
        pass
    return pa.resolve() == pb.resolve()


def _checkpoint(work: Path, output_uri: str, s3: Any) -> None:
    try:
        _upload(work, output_uri, s3)
    except BatchRunError as e:  # the next checkpoint or the final upload tries again
        log.warning("checkpoint upload failed (the run goes on; the next one retries): %s", e)


def _finish_upload(tmpdir: Any, work: Path, output_uri: str, s3: Any, sent: bool) -> None:
    """Upload the S3 output a last time; on failure keep the answers in a local file and say where."""
    try:
        if sent and work.exists():
            _upload(work, output_uri, s3)
    except BatchRunError as e:
        keep = Path.cwd() / f"pdserve-batch-{split_s3_uri(output_uri)[1].replace('/', '_')}"
        try:
            shutil.copyfile(work, keep)
            where = f"the answers are kept in {keep}"
        except OSError:
            where = "the answers could not be kept either"
        tmpdir.cleanup()
        raise BatchUploadError(f"{e}; {where}; upload it yourself, or rerun to resume from it with "
                               f"--output {keep}") from None
    tmpdir.cleanup()


def _run_loop(todo: list[BatchRequest], out: Any, summary: BatchSummary, *, done: int, base: str,
              concurrency: int, max_retries: int, timeout_s: float, api_key: str | None, progress: bool,
              backoff_s: float, checkpoint: Callable[[], None] | None, checkpoint_s: float) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]} failed"),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not progress)
    # the bar counts the whole batch, the answers kept from an earlier run completed from the start (tqdm's
    # `initial`, a resumed download's bar): a resumed run reads 3/10 rising to 10/10, and one with nothing left
    # to send 10/10, where counting only the requests sent would restart at 0/7 or read 0/0
    task = bar.add_task("batch", total=done + len(todo), completed=done, failed=0)
    last = [time.monotonic()]
    started = time.monotonic()

    def write(line: str, req: BatchRequest, body: Any) -> None:
        out.write(line)
        out.flush()
        rec = json.loads(line)  # the line's own verdict (a NaN body, say, fails there)
        if rec["error"] is None:
            summary.succeeded += 1
            p, c = usage_tokens(body)
            summary.prompt_tokens += p
            summary.completion_tokens += c
        else:
            summary.failed += 1
            not_found = (rec["response"] or {}).get("status_code") == 404
            summary.not_found += not_found
            summary.unknown_model += not_found and _names_a_model(body)
        bar.update(task, advance=1, failed=summary.failed)
        if checkpoint is not None and time.monotonic() - last[0] >= checkpoint_s:
            last[0] = time.monotonic()
            checkpoint()  # blocks the loop for one upload: in-flight requests keep running on the server

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        with bar:
            if todo:
                asyncio.run(send_all(todo, write, endpoint=base, concurrency=concurrency, max_retries=max_retries,
                                     timeout_s=timeout_s, headers=headers, backoff_s=backoff_s,
                                     secrets=(api_key,) if api_key else ()))
    finally:
        summary.wall_s = time.monotonic() - started


def _names_a_model(body: Any) -> bool:
    """Whether a 404's body speaks of a model: the server's own answer for a model it does not serve (vLLM:
    `{"error": {"message": "The model ... does not exist."}}`; KServe: `{"error": "Model with name ... does not
    exist."}`), where a wrong path gets the framework's page (`{"detail": "Not Found"}`).
    """
    err = body.get("error") if isinstance(body, dict) else None
    text = error_message(body) or (err if isinstance(err, str) else "")
    return "model" in text.lower()


def _upload(work: Path, output_uri: str, s3: Any) -> None:
    bucket, key = split_s3_uri(output_uri)
    try:
        s3.upload_file(str(work), bucket, key)
    except Exception as e:  # noqa: BLE001 - boto3 raises several unrelated types; the message says which
        raise BatchRunError(f"{output_uri}: upload failed: {e}") from None


def api_key_from_env(name: str | None) -> str | None:
    """The value of environment variable ``name`` (None when ``name`` is None).

    Raises:
        BatchRunError: ``name`` is given but unset or empty (the message names the variable, never a value).
        Leading and trailing whitespace (a file's newline) is dropped.
    """
    if not name:
        return None
    value = (os.environ.get(name) or "").strip()  # a Secret made --from-file often ends in a newline
    if not value:
        raise BatchRunError(f"--api-key-env {name}: the environment variable is not set")
    return value
