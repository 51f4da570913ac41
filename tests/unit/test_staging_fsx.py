"""Specification of the FSx for Lustre integration, against botocore's Stubber (the real FSx
request/response shapes are validated by botocore; no FSx is reachable here): find-or-create the
data repository association, run and poll the metadata import task, surface failures with AWS's
FailureDetails; and `lfs hsm_restore` preloading driven through an `lfs` executable on PATH."""

from __future__ import annotations

import os
import stat
from datetime import datetime, timezone
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber

from runtime.staging.fsx import ensure_data_repository_association, hsm_restore, import_metadata
from runtime.staging.manifest import StagingError

FS = "fs-0123456789abcdef0"
NOW = datetime(2026, 11, 30, tzinfo=timezone.utc)


@pytest.fixture
def fsx():  # noqa: ANN201
    client = boto3.client("fsx", region_name="us-east-1", aws_access_key_id="a", aws_secret_access_key="b")
    with Stubber(client) as stub:
        yield client, stub
        stub.assert_no_pending_responses()


def _dra(lifecycle: str, path: str = "/models/m", repo: str = "s3://bkt/models/m/", **extra) -> dict:  # noqa: ANN003
    return {"AssociationId": "dra-0a1b2c3d4e5f6a7b8", "FileSystemId": FS, "Lifecycle": lifecycle,
            "FileSystemPath": path, "DataRepositoryPath": repo, "CreationTime": NOW, **extra}


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s

    def __call__(self) -> float:
        return self.t


def test_creates_association_when_missing_and_waits_until_available(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("describe_data_repository_associations", {"Associations": [_dra("AVAILABLE", path="/other", repo="s3://x/")]},
                      {"Filters": [{"Name": "file-system-id", "Values": [FS]}]})
    stub.add_response(
        "create_data_repository_association", {"Association": _dra("CREATING")},
        {"FileSystemId": FS, "FileSystemPath": "/models/m", "DataRepositoryPath": "s3://bkt/models/m/",
         "BatchImportMetaDataOnCreate": False, "ImportedFileChunkSize": 1024,
         "S3": {"AutoImportPolicy": {"Events": ["NEW", "CHANGED", "DELETED"]}}},
    )
    for state in ("CREATING", "AVAILABLE"):
        stub.add_response("describe_data_repository_associations", {"Associations": [_dra(state)]},
                          {"AssociationIds": ["dra-0a1b2c3d4e5f6a7b8"]})
    clock = FakeClock()
    got = ensure_data_repository_association(client, FS, "/models/m", "s3://bkt/models/m", poll_s=7, sleep=clock.sleep, clock=clock)
    assert got == "dra-0a1b2c3d4e5f6a7b8"
    assert clock.sleeps == [7]


def test_existing_association_is_reused(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("describe_data_repository_associations", {"Associations": [_dra("AVAILABLE")]},
                      {"Filters": [{"Name": "file-system-id", "Values": [FS]}]})
    assert ensure_data_repository_association(client, FS, "/models/m/", "s3://bkt/models/m/") == "dra-0a1b2c3d4e5f6a7b8"


def test_path_linked_elsewhere_or_misconfigured_is_an_error(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("describe_data_repository_associations", {"Associations": [_dra("AVAILABLE", repo="s3://other/")]})
    with pytest.raises(StagingError, match="already linked to s3://other/"):
        ensure_data_repository_association(client, FS, "/models/m", "s3://bkt/models/m/")
    stub.add_response("describe_data_repository_associations", {"Associations": [
        _dra("MISCONFIGURED", FailureDetails={"Message": "bucket policy denies fsx"})]})
    with pytest.raises(StagingError, match="MISCONFIGURED: bucket policy denies fsx"):
        ensure_data_repository_association(client, FS, "/models/m", "s3://bkt/models/m/")


def _task(lifecycle: str, **extra) -> dict:  # noqa: ANN003
    return {"TaskId": "task-0123456789abcdef0", "Lifecycle": lifecycle, "Type": "IMPORT_METADATA_FROM_REPOSITORY",
            "CreationTime": NOW, "FileSystemId": FS, **extra}


def test_import_task_is_created_and_polled_to_success(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": _task("PENDING")},
                      {"Type": "IMPORT_METADATA_FROM_REPOSITORY", "FileSystemId": FS,
                       "Paths": ["s3://bkt/models/m/"], "Report": {"Enabled": False}})
    for state in ("PENDING", "EXECUTING", "SUCCEEDED"):
        extra = {"Status": {"TotalCount": 5, "SucceededCount": 5, "FailedCount": 0}} if state == "SUCCEEDED" else {}
        stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [_task(state, **extra)]},
                          {"TaskIds": ["task-0123456789abcdef0"]})
    clock = FakeClock()
    t = import_metadata(client, FS, ["s3://bkt/models/m/"], poll_s=3, sleep=clock.sleep, clock=clock)
    assert t["Status"]["SucceededCount"] == 5
    assert clock.sleeps == [3, 3]


@pytest.mark.parametrize(
    ("final", "message"),
    [
        (_task("FAILED", FailureDetails={"Message": "Access Denied on s3://bkt"}), "FAILED: Access Denied on s3://bkt"),
        (_task("CANCELED"), "CANCELED"),
        (_task("SUCCEEDED", Status={"TotalCount": 5, "SucceededCount": 3, "FailedCount": 2}), "2 files failed"),
    ],
)
def test_import_task_failures_are_reported(fsx, final: dict, message: str) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": _task("PENDING")})
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [final]})
    with pytest.raises(StagingError, match=message):
        import_metadata(client, FS, ["s3://bkt/models/m/"])


def test_import_task_timeout(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": _task("PENDING")})
    for _ in range(3):
        stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [_task("EXECUTING")]})
    clock = FakeClock()
    with pytest.raises(StagingError, match="not finished after 20 s"):
        import_metadata(client, FS, ["s3://bkt/"], poll_s=10, timeout_s=20, sleep=clock.sleep, clock=clock)


LFS = """#!/bin/sh
# Stand-in for Lustre's `lfs` on a machine without Lustre: logs its arguments; hsm_action reports
# RESTORE for the first {n} polls, then NOOP (the FSx user guide's completion signal).
echo "$@" >> "{log}"
case "$1" in
  hsm_restore) exit 0 ;;
  hsm_action)
    shift
    n=$(grep -c '^hsm_action' "{log}")
    for f in "$@"; do
      if [ "$n" -le {n} ]; then echo "$f: RESTORE running (from 0 to EOF)"; else echo "$f: NOOP"; fi
    done ;;
  *) echo "unknown" >&2; exit 2 ;;
esac
"""


def test_hsm_restore_preloads_and_waits_for_noop(tmp_path: Path) -> None:
    log = tmp_path / "lfs.log"
    exe = tmp_path / "lfs"
    exe.write_text(LFS.format(log=log, n=2))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    clock = FakeClock()
    assert hsm_restore(files, lfs=str(exe), poll_s=2, sleep=clock.sleep, clock=clock) is True
    calls = log.read_text().splitlines()
    assert calls[0] == f"hsm_restore {files[0]} {files[1]}"
    assert [c.split()[0] for c in calls[1:]] == ["hsm_action"] * 3
    assert clock.sleeps == [2, 2]


def test_hsm_restore_without_lfs_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hsm_restore([tmp_path / "x"]) is False


def test_hsm_restore_failure_is_reported(tmp_path: Path) -> None:
    exe = tmp_path / "lfs"
    exe.write_text("#!/bin/sh\necho 'hsm_restore: Operation not permitted' >&2\nexit 1\n")
    exe.chmod(0o755)
    with pytest.raises(StagingError, match="Operation not permitted"):
        hsm_restore([tmp_path / "x"], lfs=str(exe))


def test_preload_from_s3_links_imports_and_restores(fsx, tmp_path: Path) -> None:  # noqa: ANN001
    from runtime.staging.fsx import preload_from_s3

    client, stub = fsx
    stub.add_response("describe_data_repository_associations", {"Associations": [_dra("AVAILABLE")]})
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": _task("PENDING")},
                      {"Type": "IMPORT_METADATA_FROM_REPOSITORY", "FileSystemId": FS,
                       "Paths": ["s3://bkt/models/m/"], "Report": {"Enabled": False}})
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [_task("SUCCEEDED")]})
    mount = tmp_path / "fsx"
    (mount / "models" / "m").mkdir(parents=True)  # what the import makes visible on the mount
    for name in ("config.json", "model.safetensors"):
        (mount / "models" / "m" / name).write_text("x")
    log = tmp_path / "lfs.log"
    exe = tmp_path / "lfs"
    exe.write_text(LFS.format(log=log, n=0))
    exe.chmod(0o755)
    files = preload_from_s3(client, file_system_id=FS, mount_root=mount, file_system_path="/models/m",
                            s3_uri="s3://bkt/models/m", lfs=str(exe), sleep=lambda s: None)
    assert [f.name for f in files] == ["config.json", "model.safetensors"]
    assert log.read_text().splitlines()[0] == "hsm_restore " + " ".join(map(str, files))


def test_preload_from_s3_with_nothing_imported_is_an_error(fsx, tmp_path: Path) -> None:  # noqa: ANN001
    from runtime.staging.fsx import preload_from_s3

    client, stub = fsx
    stub.add_response("describe_data_repository_associations", {"Associations": [_dra("AVAILABLE")]})
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": _task("PENDING")})
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [_task("SUCCEEDED")]})
    with pytest.raises(StagingError, match="no files under"):
        preload_from_s3(client, file_system_id=FS, mount_root=tmp_path, file_system_path="/models/m",
                        s3_uri="s3://bkt/models/m/", sleep=lambda s: None)
