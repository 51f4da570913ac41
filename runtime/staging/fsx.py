"""FSx for Lustre's own S3 integration: data repository association (DRA), metadata import task,
and preloading file contents with `lfs hsm_restore`.

With a DRA, FSx lazily mirrors ``s3://bucket/prefix`` under a file-system path; an
IMPORT_METADATA_FROM_REPOSITORY task makes new/changed objects visible, and `lfs hsm_restore`
pulls their bytes into Lustre ahead of the first vLLM read (otherwise the first load pays the
S3 fetch). Sources: AWS FSx API reference (CreateDataRepositoryAssociation — "two data repository
associations cannot have overlapping file system paths", the leading "/" is required;
CreateDataRepositoryTask — import task paths are S3 URIs, DataRepositoryTaskExecuting while another
task runs), FSx for Lustre user guide "Preloading files into your file system" (`lfs hsm_restore`,
`lfs hsm_action` → NOOP when done), Lustre Operations Manual, "Hierarchical Storage Management"
(`lfs hsm_state` prints the file's flags, ``released`` while its data is only in the archive).

Clients are injected (boto3 ``fsx`` client; `sleep` and `clock` for polling) so tests run against
botocore's Stubber with the real request/response shapes. Every error is a `StagingError` naming
the file system, association, task or file.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from botocore.exceptions import BotoCoreError, ClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.exceptions import HTTPClientError

from runtime.staging.manifest import StagingError

DRA_READY = "AVAILABLE"
DRA_BAD = ("MISCONFIGURED", "FAILED", "DELETING")
TASK_DONE = "SUCCEEDED"
TASK_BAD = ("FAILED", "CANCELED", "CANCELING")
# Error codes worth retrying until the deadline (throttling, server side); any 5xx too.
TRANSIENT_CODES = frozenset({
    "ThrottlingException", "Throttling", "TooManyRequestsException", "RequestLimitExceeded",
    "InternalServerError", "ServiceUnavailable", "RequestTimeout", "RequestTimeoutException",
})
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 30.0


def _code(e: ClientError) -> str:
    return e.response.get("Error", {}).get("Code", "")


def _transient(e: Exception) -> bool:
    if isinstance(e, (BotoConnectionError, HTTPClientError)):
        return True
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
        return _code(e) in TRANSIENT_CODES or status >= 500
    return False


def _describe(e: Exception) -> str:
    if isinstance(e, ClientError):
        return f"{_code(e)}: {e.response.get('Error', {}).get('Message', '')}"
    return f"{type(e).__name__}: {e}"


def _call(
    fn: Callable[[], Any], what: str, *, deadline: float, sleep: Callable[[float], None], clock: Callable[[], float],
    retry_codes: frozenset[str] = frozenset(), wait_s: float | None = None,
) -> Any:
    """Call `fn`; retry transient errors (and `retry_codes`) with backoff (`wait_s` fixed, else
    1 s doubling to 30 s) until `deadline`; anything else, or the last error, as a StagingError."""
    backoff = BACKOFF_INITIAL_S
    while True:
        try:
            return fn()
        except (ClientError, BotoCoreError) as e:
            retry = _transient(e) or (isinstance(e, ClientError) and _code(e) in retry_codes)
            left = deadline - clock()
            if not retry:
                raise StagingError(f"{what}: {_describe(e)}") from e
            if left <= 0:
                raise StagingError(f"{what}: still failing when the time ran out: {_describe(e)}") from e
            sleep(min(wait_s if wait_s is not None else backoff, left))
            backoff = min(backoff * 2, BACKOFF_MAX_S)


def _poll(
    fetch: Callable[[], dict], done: Callable[[dict], bool], what: str, *, poll_s: float, deadline: float,
    sleep: Callable[[float], None], clock: Callable[[], float],
) -> dict:
    start = clock()
    while True:
        item = _call(fetch, what, deadline=deadline, sleep=sleep, clock=clock)
        if done(item):
            return item
        now = clock()
        if now >= deadline:
            raise StagingError(f"{what}: not finished after {now - start:.0f} s (last state {item.get('Lifecycle')})")
        sleep(min(poll_s, deadline - now))


def _fs_path(path: str) -> str:
    """The normalised file-system path: leading '/', no trailing '/' (the root stays '/')."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise StagingError(f"FSx file system path {path!r}: must start with '/' (e.g. /models/<name>), "
                           "as CreateDataRepositoryAssociation requires")
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise StagingError(f"FSx file system path {path!r}: '.' and '..' are not allowed")
    return "/" + "/".join(parts)


def _s3_path(uri: str) -> str:
    """The normalised S3 data repository path: ``s3://bucket/prefix/`` (one trailing '/';
    ``runtime.s3uri.split_s3_prefix_uri``)."""
    from runtime.staging.s3 import parse_s3_uri

    bucket, prefix = parse_s3_uri(uri, "FSx data repository path")
    return f"s3://{bucket}/{prefix}"


def _relation(have: str, want: str) -> str | None:
    """'same', 'parent' (`have` contains `want`), 'child' (`want` contains `have`) or None."""
    if have == want:
        return "same"
    if have == "/" or want.startswith(have + "/"):
        return "parent"
    if want == "/" or have.startswith(want + "/"):
        return "child"
    return None


def _find_association(fsx_client: Any, file_system_id: str, fs_path: str, repo: str, **retry: Any) -> dict | None:
    """Page through the file system's associations; return the one serving `fs_path` from `repo`
    (the same path, or a parent whose S3 path + subpath equals `repo`), None if none overlaps.
    Raises StagingError on an overlapping association that maps elsewhere."""
    kwargs: dict[str, Any] = {"Filters": [{"Name": "file-system-id", "Values": [file_system_id]}]}
    found = None
    while True:
        page = _call(lambda: fsx_client.describe_data_repository_associations(**kwargs),
                     f"FSx {file_system_id}: DescribeDataRepositoryAssociations", **retry)
        for a in page.get("Associations", []):
            have = a.get("FileSystemPath", "")
            rel = _relation(_fs_path(have), fs_path) if have.startswith("/") else None
            if rel is None:
                continue
            a_repo = a.get("DataRepositoryPath", "")
            label = f"association {a.get('AssociationId')} ({have} → {a_repo})"
            if rel == "same":
                if a_repo.rstrip("/") + "/" != repo:
                    raise StagingError(f"FSx {file_system_id}: path {fs_path} is already linked to {a_repo}, "
                                       f"not {repo} ({label})")
                found = a
            elif rel == "parent":
                sub = fs_path[len(_fs_path(have)):].strip("/")
                maps_to = a_repo.rstrip("/") + "/" + sub + "/"
                if maps_to != repo:
                    raise StagingError(
                        f"FSx {file_system_id}: path {fs_path} lies under {label}, which maps it to {maps_to}, not "
                        f"{repo}; FSx forbids overlapping associations: use another file system path or that S3 path")
                found = a
            else:
                raise StagingError(
                    f"FSx {file_system_id}: {label} is inside {fs_path}; FSx forbids overlapping associations: "
                    "use another file system path or delete that association")
        if not page.get("NextToken"):
            return found
        kwargs["NextToken"] = page["NextToken"]


def ensure_data_repository_association(
    fsx_client: Any,
    file_system_id: str,
    file_system_path: str,
    data_repository_path: str,
    *,
    imported_file_chunk_size_mib: int = 1024,
    poll_s: float = 10.0,
    timeout_s: float = 1800.0,
    deadline: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Find the DRA that serves `file_system_path` (``/models/<name>``; leading '/' required, trailing
    '/' ignored) from `data_repository_path` (``s3://bucket/prefix``), or create it (auto-import of
    new/changed/deleted objects, no batch import), and wait until AVAILABLE.

    An association of a parent path is reused when its S3 path plus the relative subpath is
    `data_repository_path` (``/models`` → ``s3://bkt/models/`` serves ``/models/m`` from
    ``s3://bkt/models/m/``). Losing a create race to another stager re-lists and reuses the winner's.
    Throttling and 5xx errors are retried with backoff until the deadline.

    Args:
        timeout_s: seconds for the whole call (listing, creating, waiting).
        deadline: absolute `clock()` time to finish by instead of `timeout_s` (a caller's shared budget).

    Returns:
        The association id (``dra-…``).

    Raises:
        StagingError: a malformed path; the path, a parent or a child of it is linked to a different
            S3 location (message names the association's id and paths); the DRA ends MISCONFIGURED /
            FAILED (message has FailureDetails) or is not AVAILABLE in time; an FSx API error.
    """
    fs_path = _fs_path(file_system_path)
    repo = _s3_path(data_repository_path)
    end = clock() + timeout_s if deadline is None else deadline
    retry = dict(deadline=end, sleep=sleep, clock=clock)
    found = _find_association(fsx_client, file_system_id, fs_path, repo, **retry)
    if found is None:
        try:
            found = _call(lambda: fsx_client.create_data_repository_association(
                FileSystemId=file_system_id,
                FileSystemPath=fs_path,
                DataRepositoryPath=repo,
                BatchImportMetaDataOnCreate=False,
                ImportedFileChunkSize=imported_file_chunk_size_mib,
                S3={"AutoImportPolicy": {"Events": ["NEW", "CHANGED", "DELETED"]}},
            )["Association"], f"FSx {file_system_id}: CreateDataRepositoryAssociation {fs_path} → {repo}", **retry)
        except StagingError as e:  # another stager may have created it in the meantime
            found = _find_association(fsx_client, file_system_id, fs_path, repo, **retry)
            if found is None:
                raise e from e.__cause__
    dra_id = found["AssociationId"]

    def fetch() -> dict:
        return fsx_client.describe_data_repository_associations(AssociationIds=[dra_id])["Associations"][0]

    def done(a: dict) -> bool:
        if a["Lifecycle"] in DRA_BAD:
            msg = a.get("FailureDetails", {}).get("Message", "no details")
            raise StagingError(f"FSx data repository association {dra_id}: {a['Lifecycle']}: {msg}")
        return a["Lifecycle"] == DRA_READY

    if not done(found):
        _poll(fetch, done, f"FSx association {dra_id}", poll_s=poll_s, deadline=end, sleep=sleep, clock=clock)
    return dra_id


def _running_tasks(fsx_client: Any, file_system_id: str) -> str:
    """'task-… (TYPE, LIFECYCLE)' of the file system's pending/executing tasks, best effort."""
    try:
        tasks = fsx_client.describe_data_repository_tasks(Filters=[
            {"Name": "file-system-id", "Values": [file_system_id]},
            {"Name": "task-lifecycle", "Values": ["PENDING", "EXECUTING"]},
        ]).get("DataRepositoryTasks", [])
    except (ClientError, BotoCoreError):
        return "its id could not be listed"
    return ", ".join(f"{t['TaskId']} ({t.get('Type')}, {t.get('Lifecycle')})" for t in tasks) or "none listed now"


def import_metadata(
    fsx_client: Any,
    file_system_id: str,
    s3_paths: Sequence[str],
    *,
    poll_s: float = 10.0,
    timeout_s: float = 3600.0,
    deadline: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict:
    """Run an IMPORT_METADATA_FROM_REPOSITORY task for `s3_paths` (s3://bucket/prefix) and wait.

    While another data repository task runs on the file system (DataRepositoryTaskExecuting) the
    create is retried every `poll_s` seconds; throttling and 5xx errors are retried with backoff.

    Args:
        timeout_s: seconds for the whole call (waiting to start plus the task itself).
        deadline: absolute `clock()` time to finish by instead of `timeout_s`.

    Returns:
        The finished task (``DataRepositoryTask`` dict; ``Status`` has Total/Succeeded/FailedCount).

    Raises:
        StagingError: the task FAILED / was CANCELED (message has FailureDetails), some files
            failed, another task kept running until the deadline (its id named), the time ran out,
            or an FSx API error.
    """
    paths = [_s3_path(p) for p in s3_paths]
    end = clock() + timeout_s if deadline is None else deadline
    what = f"FSx {file_system_id}: CreateDataRepositoryTask IMPORT_METADATA_FROM_REPOSITORY {paths}"
    try:
        task = _call(lambda: fsx_client.create_data_repository_task(
            Type="IMPORT_METADATA_FROM_REPOSITORY",
            FileSystemId=file_system_id,
            Paths=paths,
            Report={"Enabled": False},
        )["DataRepositoryTask"], what, deadline=end, sleep=sleep, clock=clock,
            retry_codes=frozenset({"DataRepositoryTaskExecuting"}), wait_s=poll_s)
    except StagingError as e:
        if isinstance(e.__cause__, ClientError) and _code(e.__cause__) == "DataRepositoryTaskExecuting":
            raise StagingError(
                f"FSx {file_system_id}: another data repository task is running "
                f"({_running_tasks(fsx_client, file_system_id)}) and did not finish in time; wait for it or "
                "cancel it (aws fsx cancel-data-repository-task --task-id …), then stage again") from e.__cause__
        raise
    task_id = task["TaskId"]

    def fetch() -> dict:
        return fsx_client.describe_data_repository_tasks(TaskIds=[task_id])["DataRepositoryTasks"][0]

    def done(t: dict) -> bool:
        if t["Lifecycle"] in TASK_BAD:
            msg = t.get("FailureDetails", {}).get("Message", "no details")
            raise StagingError(f"FSx import task {task_id}: {t['Lifecycle']}: {msg}")
        return t["Lifecycle"] == TASK_DONE

    final = _poll(fetch, done, f"FSx import task {task_id}", poll_s=poll_s, deadline=end, sleep=sleep, clock=clock)
    failed = final.get("Status", {}).get("FailedCount", 0)
    if failed:
        raise StagingError(f"FSx import task {task_id}: {failed} files failed to import")
    return final


def _lfs(exe: str, args: list[str], deadline: float, clock: Callable[[], float]) -> str:
    """Run ``lfs ARGS`` with the time left until `deadline`; its stdout. A hung `lfs` (and anything
    it started: it runs in its own process group) is killed at the deadline."""
    left = deadline - clock()
    if left <= 0:
        raise StagingError(f"lfs {args[0]}: no time left (timeout reached)")
    try:
        p = subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        raise StagingError(f"lfs {exe}: cannot run it: {e.strerror or e}") from e
    try:
        out, err = p.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        p.communicate()
        raise StagingError(f"lfs {args[0]}: no answer within {left:.0f} s (a hung Lustre client?); killed it") from None
    if p.returncode != 0:
        raise StagingError(f"lfs {args[0]} failed ({p.returncode}): {err.decode(errors='replace').strip()[:500]}")
    return out.decode("utf-8", errors="surrogateescape")


def _per_file(out: str, files: list[str], cmd: str) -> list[str]:
    """Split `lfs hsm_action` / `hsm_state` output (``PATH: TEXT\\n`` per file, in argument order, as
    lfs prints it) by position: a file name may itself hold ': ' or newlines."""
    texts, pos = [], 0
    for f in files:
        head = f + ":"
        if not out.startswith(head, pos):
            raise StagingError(f"lfs {cmd}: unexpected output for {f!r}: {out[pos:pos + 200]!r}")
        pos += len(head)
        nl = out.find("\n", pos)
        nl = len(out) if nl < 0 else nl
        texts.append(out[pos:nl].strip())
        pos = nl + 1
    return texts


def hsm_restore(
    paths: Sequence[Path],
    *,
    lfs: str | None = None,
    poll_s: float = 5.0,
    timeout_s: float = 3600.0,
    deadline: float | None = None,
    batch: int = 256,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Preload file contents from S3 into Lustre: `lfs hsm_restore`, poll `lfs hsm_action` until every
    file reports NOOP, then check `lfs hsm_state`: a file still ``released`` had its restore fail.

    Paths are passed absolute (none starts with '-', so lfs never reads one as an option); output
    is matched to files by argument position, so names may hold newlines.

    Args:
        paths: files on the Lustre mount.
        lfs: the `lfs` binary (None → look it up on PATH).
        timeout_s: seconds for the whole call; each `lfs` run gets the time left.
        deadline: absolute `clock()` time to finish by instead of `timeout_s`.

    Returns:
        False when `lfs` is not available (nothing done), True when all files are restored.

    Raises:
        StagingError: `lfs` cannot run, failed (stderr quoted) or did not answer in time; a restore
            is still running at the deadline; files are still released after it ended (named).
    """
    exe = lfs or shutil.which("lfs")
    if not exe:
        return False
    end = clock() + timeout_s if deadline is None else deadline
    files = [os.path.abspath(p) for p in paths]
    chunks = [files[i : i + batch] for i in range(0, len(files), batch)]
    for chunk in chunks:
        _lfs(exe, ["hsm_restore", *chunk], end, clock)
    pending = files
    while pending:
        still = []
        for i in range(0, len(pending), batch):
            chunk = pending[i : i + batch]
            actions = _per_file(_lfs(exe, ["hsm_action", *chunk], end, clock), chunk, "hsm_action")
            still += [f for f, a in zip(chunk, actions) if not a.startswith("NOOP")]
        pending = still
        if pending:
            now = clock()
            if now >= end:
                raise StagingError(f"lfs hsm_restore: {len(pending)} files still restoring when the time ran out "
                                   f"(first: {pending[0]!r})")
            sleep(min(poll_s, end - now))
    released = []
    for chunk in chunks:
        states = _per_file(_lfs(exe, ["hsm_state", *chunk], end, clock), chunk, "hsm_state")
        released += [f for f, s in zip(chunk, states) if "released" in s.split()]
    if released:
        raise StagingError(f"lfs hsm_restore: {len(released)} files are still released after their restore ended "
                           f"(the restore failed; see the FSx event logs): {', '.join(map(repr, released[:5]))}")
    return True


def preload_from_s3(
    fsx_client: Any,
    *,
    file_system_id: str,
    mount_root: Path,
    file_system_path: str,
    s3_uri: str,
    lfs: str | None = None,
    poll_s: float = 10.0,
    timeout_s: float = 3600.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    select: Callable[[list[str]], list[str]] | None = None,
) -> list[Path]:
    """FSx-native staging: link `s3_uri` at `file_system_path` (DRA), import its metadata, then
    preload the files under ``mount_root/file_system_path`` with `lfs hsm_restore` (when `lfs` is
    available). The folder can then be published with a marker by
    ``stage_model(str(folder), dest)`` (a local-folder source on the same Lustre file system).

    Args:
        mount_root: where the FSx file system is mounted (``/fsx``).
        timeout_s: seconds for all three phases together (one deadline; each gets the time left).
        select: keeps the paths (relative to the linked folder, ``/``-separated) to preload, e.g. the
            stager's include/exclude selection (`runtime.staging.keys.select_paths`), so duplicate
            ``.bin`` weights the stage will skip are not pulled from S3; None preloads every file.

    Returns:
        The files preloaded (all files under the linked folder when ``select`` is None), sorted.

    Raises:
        StagingError: a malformed path; from the association, the import task or `lfs`; the time
            ran out; or the folder is missing / empty on the mount after the import.
    """
    fs_path = _fs_path(file_system_path)
    repo = _s3_path(s3_uri)
    kw = dict(poll_s=poll_s, sleep=sleep, clock=clock, deadline=clock() + timeout_s)
    ensure_data_repository_association(fsx_client, file_system_id, fs_path, repo, **kw)
    import_metadata(fsx_client, file_system_id, [repo], **kw)
    folder = Path(mount_root) / fs_path.lstrip("/")
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    if not files:
        raise StagingError(f"FSx: no files under {folder} after importing {s3_uri}")
    if select is not None:
        by_rel = {p.relative_to(folder).as_posix(): p for p in files}
        files = sorted(by_rel[r] for r in select(list(by_rel)))
        if not files:
            raise StagingError(f"FSx: none of the {len(by_rel)} files under {folder} is selected "
                               "(--include/--exclude)")
    hsm_restore(files, lfs=lfs, **kw)
    return files


# ---- the stager's FSx mode (`python -m runtime.staging` / `pdserve stage` --fsx-file-system-id) --------
def make_fsx_client(endpoint_url: str | None = None) -> Any:
    """A boto3 ``fsx`` client from the default AWS chain (only the FSx mode makes one)."""
    import boto3

    return boto3.client("fsx", endpoint_url=endpoint_url)


def fsx_options_error(file_system_id: str | None, file_system_path: str | None, source: str) -> str | None:
    """Why the FSx options cannot be used (a message naming the option), or None when they can."""
    if (file_system_id is None) != (file_system_path is None):
        return "--fsx-file-system-id and --fsx-path go together: give both or neither"
    if file_system_id is None:
        return None
    if not file_system_id.startswith("fs-") or len(file_system_id) < 11:
        return f"--fsx-file-system-id: expected an FSx file system id like fs-0123456789abcdef0, got {file_system_id!r}"
    if not source.startswith("s3://"):
        return f"--fsx-file-system-id: the FSx mode links an S3 prefix, so SOURCE must be s3://…, got {source!r}"
    try:
        _fs_path(file_system_path)  # type: ignore[arg-type]
    except StagingError as e:
        return f"--fsx-path: {e}"
    return None


def mount_point(path: Path) -> Path:
    """The mount point holding `path` (its nearest existing ancestor walked up to a mount)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    while not os.path.ismount(p):
        p = p.parent
    return p


def preload_source(
    fsx_client: Any, *, file_system_id: str, file_system_path: str, s3_uri: str, dest: Path,
    mount_root: Path | None = None, timeout_s: float = 3600.0, lfs: str | None = None,
    select: Callable[[list[str]], list[str]] | None = None,
) -> Path:
    """The FSx mode of the stager: link `s3_uri` at `file_system_path`, import, preload (lfs when on
    PATH), and return the linked folder on the mount, to stage into `dest` as a local folder.

    Args:
        mount_root: where the file system is mounted (None → the mount point holding `dest`).
        timeout_s: seconds for association, import and preload together (finite, > 0).
        select: what to preload (see `preload_from_s3`): the stage's own selection.

    Raises:
        StagingError: a timeout that is not a finite positive number; the linked folder is `dest`, inside it
            or holds it, compared with symlinks and ``..`` resolved (FSx would write into the published
            model); anything `preload_from_s3` raises.
    """
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise StagingError(f"--fsx-timeout-s must be a finite number of seconds above 0, got {timeout_s!r}")
    root = Path(mount_root) if mount_root is not None else mount_point(dest)
    folder = (root / _fs_path(file_system_path).lstrip("/")).resolve()
    d = Path(dest).resolve()  # strict=False: resolves the existing part, keeps the rest as written
    if folder == d or folder in d.parents or d in folder.parents:
        raise StagingError(f"--fsx-path {file_system_path} is {folder} on the mount {root}, which overlaps the "
                           f"destination {d}; link S3 elsewhere (e.g. /s3/<name>) and stage into {d}")
    preload_from_s3(fsx_client, file_system_id=file_system_id, mount_root=root, file_system_path=file_system_path,
                    s3_uri=s3_uri, lfs=lfs, timeout_s=timeout_s, select=select)
    return folder
