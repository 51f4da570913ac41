"""FSx for Lustre's own S3 integration: data repository association (DRA), metadata import task,
and preloading file contents with `lfs hsm_restore`.

With a DRA, FSx lazily mirrors ``s3://bucket/prefix`` under a file-system path; an
IMPORT_METADATA_FROM_REPOSITORY task makes new/changed objects visible, and `lfs hsm_restore`
pulls their bytes into Lustre ahead of the first vLLM read (otherwise the first load pays the
S3 fetch). Sources: AWS FSx API reference (CreateDataRepositoryAssociation,
CreateDataRepositoryTask — import task paths are S3 URIs), FSx for Lustre user guide
"Preloading files into your file system" (`lfs hsm_restore`, `lfs hsm_action` → NOOP when done).

Clients are injected (boto3 ``fsx`` client; `sleep` and `clock` for polling) so tests run against
botocore's Stubber with the real request/response shapes.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from runtime.staging.manifest import StagingError

DRA_READY = "AVAILABLE"
DRA_BAD = ("MISCONFIGURED", "FAILED", "DELETING")
TASK_DONE = "SUCCEEDED"
TASK_BAD = ("FAILED", "CANCELED", "CANCELING")


def _poll(
    fetch: Callable[[], dict], done: Callable[[dict], bool], what: str, *, poll_s: float, timeout_s: float,
    sleep: Callable[[float], None], clock: Callable[[], float],
) -> dict:
    deadline = clock() + timeout_s
    while True:
        item = fetch()
        if done(item):
            return item
        if clock() >= deadline:
            raise StagingError(f"{what}: not finished after {timeout_s:.0f} s (last state {item.get('Lifecycle')})")
        sleep(poll_s)


def ensure_data_repository_association(
    fsx_client: Any,
    file_system_id: str,
    file_system_path: str,
    data_repository_path: str,
    *,
    imported_file_chunk_size_mib: int = 1024,
    poll_s: float = 10.0,
    timeout_s: float = 1800.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Find the DRA linking `file_system_path` to `data_repository_path` (s3://bucket/prefix/), or
    create it (auto-import of new/changed/deleted objects, no batch import), and wait until AVAILABLE.

    Returns:
        The association id (``dra-…``).

    Raises:
        StagingError: the path is linked to a different S3 location, or the DRA ends MISCONFIGURED /
            FAILED, or does not become AVAILABLE within `timeout_s` (message has FailureDetails).
    """
    want = data_repository_path.rstrip("/") + "/"
    found = None
    kwargs: dict[str, Any] = {"Filters": [{"Name": "file-system-id", "Values": [file_system_id]}]}
    while True:
        page = fsx_client.describe_data_repository_associations(**kwargs)
        for a in page.get("Associations", []):
            if a.get("FileSystemPath", "").rstrip("/") == file_system_path.rstrip("/"):
                if a.get("DataRepositoryPath", "").rstrip("/") + "/" != want:
                    raise StagingError(
                        f"FSx {file_system_id}: path {file_system_path} is already linked to "
                        f"{a.get('DataRepositoryPath')}, not {data_repository_path}"
                    )
                found = a
        if not page.get("NextToken"):
            break
        kwargs["NextToken"] = page["NextToken"]
    if found is None:
        found = fsx_client.create_data_repository_association(
            FileSystemId=file_system_id,
            FileSystemPath=file_system_path,
            DataRepositoryPath=want,
            BatchImportMetaDataOnCreate=False,
            ImportedFileChunkSize=imported_file_chunk_size_mib,
            S3={"AutoImportPolicy": {"Events": ["NEW", "CHANGED", "DELETED"]}},
        )["Association"]
    dra_id = found["AssociationId"]

    def fetch() -> dict:
        return fsx_client.describe_data_repository_associations(AssociationIds=[dra_id])["Associations"][0]

    def done(a: dict) -> bool:
        if a["Lifecycle"] in DRA_BAD:
            msg = a.get("FailureDetails", {}).get("Message", "no details")
            raise StagingError(f"FSx data repository association {dra_id}: {a['Lifecycle']}: {msg}")
        return a["Lifecycle"] == DRA_READY

    if not done(found):
        _poll(fetch, done, f"FSx association {dra_id}", poll_s=poll_s, timeout_s=timeout_s, sleep=sleep, clock=clock)
    return dra_id


def import_metadata(
    fsx_client: Any,
    file_system_id: str,
    s3_paths: Sequence[str],
    *,
    poll_s: float = 10.0,
    timeout_s: float = 3600.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict:
    """Run an IMPORT_METADATA_FROM_REPOSITORY task for `s3_paths` (s3://bucket/prefix) and wait.

    Returns:
        The finished task (``DataRepositoryTask`` dict; ``Status`` has Total/Succeeded/FailedCount).

    Raises:
        StagingError: the task FAILED / was CANCELED (message has FailureDetails), some files
            failed, or it ran past `timeout_s`.
    """
    task = fsx_client.create_data_repository_task(
        Type="IMPORT_METADATA_FROM_REPOSITORY",
        FileSystemId=file_system_id,
        Paths=list(s3_paths),
        Report={"Enabled": False},
    )["DataRepositoryTask"]
    task_id = task["TaskId"]

    def fetch() -> dict:
        return fsx_client.describe_data_repository_tasks(TaskIds=[task_id])["DataRepositoryTasks"][0]

    def done(t: dict) -> bool:
        if t["Lifecycle"] in TASK_BAD:
            msg = t.get("FailureDetails", {}).get("Message", "no details")
            raise StagingError(f"FSx import task {task_id}: {t['Lifecycle']}: {msg}")
        return t["Lifecycle"] == TASK_DONE

    final = _poll(fetch, done, f"FSx import task {task_id}", poll_s=poll_s, timeout_s=timeout_s, sleep=sleep, clock=clock)
    failed = final.get("Status", {}).get("FailedCount", 0)
    if failed:
        raise StagingError(f"FSx import task {task_id}: {failed} files failed to import")
    return final


def hsm_restore(
    paths: Sequence[Path],
    *,
    lfs: str | None = None,
    poll_s: float = 5.0,
    timeout_s: float = 3600.0,
    batch: int = 256,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Preload file contents from S3 into Lustre: `lfs hsm_restore`, then poll `lfs hsm_action`
    until every file reports NOOP.

    Args:
        paths: files on the Lustre mount.
        lfs: the `lfs` binary (None → look it up on PATH).

    Returns:
        False when `lfs` is not available (nothing done), True when all files are restored.

    Raises:
        StagingError: `lfs` failed (stderr quoted) or a restore is still running after `timeout_s`.
    """
    exe = lfs or shutil.which("lfs")
    if not exe:
        return False
    files = [str(p) for p in paths]
    for i in range(0, len(files), batch):
        r = subprocess.run([exe, "hsm_restore", *files[i : i + batch]], capture_output=True, text=True)
        if r.returncode != 0:
            raise StagingError(f"lfs hsm_restore failed ({r.returncode}): {r.stderr.strip()[:500]}")
    deadline = clock() + timeout_s
    pending = files
    while pending:
        still = []
        for i in range(0, len(pending), batch):
            r = subprocess.run([exe, "hsm_action", *pending[i : i + batch]], capture_output=True, text=True)
            if r.returncode != 0:
                raise StagingError(f"lfs hsm_action failed ({r.returncode}): {r.stderr.strip()[:500]}")
            for line in r.stdout.splitlines():
                name, _, action = line.rpartition(": ")
                if name and not action.startswith("NOOP"):
                    still.append(name)
        pending = still
        if pending:
            if clock() >= deadline:
                raise StagingError(f"lfs hsm_restore: {len(pending)} files still restoring after {timeout_s:.0f} s")
            sleep(poll_s)
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
) -> list[Path]:
    """FSx-native staging: link `s3_uri` at `file_system_path` (DRA), import its metadata, then
    preload every file under ``mount_root/file_system_path`` with `lfs hsm_restore` (when `lfs` is
    available). The folder can then be published with a marker by
    ``stage_model(str(folder), dest)`` (a local-folder source on the same Lustre file system).

    Returns:
        The files found under the linked folder, sorted.

    Raises:
        StagingError: from the association, the import task or `lfs`; or the folder is missing /
            empty on the mount after the import.
    """
    kw = dict(poll_s=poll_s, sleep=sleep, clock=clock)
    ensure_data_repository_association(fsx_client, file_system_id, file_system_path, s3_uri, timeout_s=timeout_s, **kw)
    import_metadata(fsx_client, file_system_id, [s3_uri.rstrip("/") + "/"], timeout_s=timeout_s, **kw)
    folder = Path(mount_root) / file_system_path.lstrip("/")
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    if not files:
        raise StagingError(f"FSx: no files under {folder} after importing {s3_uri}")
    hsm_restore(files, lfs=lfs, timeout_s=timeout_s, **kw)
    return files
