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
# RESTORE for the first {n} polls, then NOOP (the FSx user guide's completion signal); hsm_state
# prints the flags the Lustre manual documents ("exists archived", no "released" once restored).
echo "$@" >> "{log}"
case "$1" in
  hsm_restore) exit 0 ;;
  hsm_state)
    shift
    for f in "$@"; do echo "$f: (0x00000009) exists archived, archive_id:1"; done ;;
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
    assert [c.split()[0] for c in calls[1:]] == ["hsm_action"] * 3 + ["hsm_state"]
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


# ---- overlapping associations, path validation, races ------------------------------------------------
LIST = {"Filters": [{"Name": "file-system-id", "Values": [FS]}]}


@pytest.mark.parametrize(("parent_path", "parent_repo"), [("/", "s3://bkt/"), ("/models", "s3://bkt/models"),
                                                          ("/models/", "s3://bkt/models/")])
def test_a_parent_association_that_maps_the_wanted_s3_path_is_reused(fsx, parent_path: str, parent_repo: str) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("describe_data_repository_associations",
                      {"Associations": [_dra("AVAILABLE", path=parent_path, repo=parent_repo, AssociationId="dra-0000000000000000p")]}, LIST)
    got = ensure_data_repository_association(client, FS, "/models/m", "s3://bkt/models/m")
    assert got == "dra-0000000000000000p"  # no create call is queued: the Stubber would fail on one


def test_a_parent_association_mapping_elsewhere_is_named(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("describe_data_repository_associations",
                      {"Associations": [_dra("AVAILABLE", path="/models", repo="s3://other/", AssociationId="dra-0000000000000000p")]})
    with pytest.raises(StagingError, match=r"lies under association dra-0000000000000000p \(/models → s3://other/\)"
                                           r", which maps it to s3://other/m/, not s3://bkt/models/m/"):
        ensure_data_repository_association(client, FS, "/models/m", "s3://bkt/models/m/")


def test_a_child_association_is_named(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("describe_data_repository_associations", {"Associations": [
        _dra("AVAILABLE", path="/models/m/sub", repo="s3://bkt/models/m/sub/", AssociationId="dra-000000000000000c1")]})
    with pytest.raises(StagingError, match=r"dra-000000000000000c1 \(/models/m/sub → s3://bkt/models/m/sub/\) is inside /models/m"):
        ensure_data_repository_association(client, FS, "/models/m", "s3://bkt/models/m/")


def test_sibling_with_a_common_name_prefix_does_not_overlap(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("describe_data_repository_associations",
                      {"Associations": [_dra("AVAILABLE", path="/models/m2", repo="s3://x/", AssociationId="dra-00000000000000sib")]})
    stub.add_response("create_data_repository_association", {"Association": _dra("AVAILABLE")})
    assert ensure_data_repository_association(client, FS, "/models/m", "s3://bkt/models/m/") == "dra-0a1b2c3d4e5f6a7b8"


@pytest.mark.parametrize(("fs_path", "repo", "message"), [
    ("models/m", "s3://bkt/models/m/", "must start with '/'"),
    ("/models/../etc", "s3://bkt/models/m/", "'..' are not allowed"),
    ("/models/m", "bkt/models/m", "FSx data repository path 'bkt/models/m': must be an s3://bucket/prefix/"),
    ("/models/m", "s3:///models", "FSx data repository path 's3:///models': bucket '' is not a valid S3 bucket"),
])
def test_malformed_paths_are_refused_before_any_call(fsx, fs_path: str, repo: str, message: str) -> None:  # noqa: ANN001
    client, _ = fsx
    with pytest.raises(StagingError, match=message):
        ensure_data_repository_association(client, FS, fs_path, repo)


def test_losing_the_create_race_reuses_the_winners_association(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("describe_data_repository_associations", {"Associations": []}, LIST)
    stub.add_client_error("create_data_repository_association", service_error_code="BadRequest",
                          service_message="overlaps with an existing data repository association", http_status_code=400)
    stub.add_response("describe_data_repository_associations", {"Associations": [_dra("AVAILABLE")]}, LIST)
    assert ensure_data_repository_association(client, FS, "/models/m", "s3://bkt/models/m/") == "dra-0a1b2c3d4e5f6a7b8"


def test_a_refused_create_with_nothing_to_reuse_is_a_staging_error(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    for _ in range(2):
        stub.add_response("describe_data_repository_associations", {"Associations": []}, LIST)
        if _ == 0:
            stub.add_client_error("create_data_repository_association", service_error_code="ServiceLimitExceeded",
                                  service_message="too many associations", http_status_code=400)
    with pytest.raises(StagingError, match="CreateDataRepositoryAssociation /models/m → s3://bkt/models/m/: "
                                           "ServiceLimitExceeded: too many associations"):
        ensure_data_repository_association(client, FS, "/models/m", "s3://bkt/models/m/")


# ---- another task running, throttling, one deadline ---------------------------------------------------
def _succeeded() -> dict:
    return {"DataRepositoryTasks": [_task("SUCCEEDED", Status={"TotalCount": 1, "SucceededCount": 1, "FailedCount": 0})]}


def test_import_waits_while_another_task_is_executing(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    for _ in range(2):
        stub.add_client_error("create_data_repository_task", service_error_code="DataRepositoryTaskExecuting",
                              service_message="An existing data repository task is currently executing", http_status_code=400)
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": _task("PENDING")})
    stub.add_response("describe_data_repository_tasks", _succeeded())
    clock = FakeClock()
    t = import_metadata(client, FS, ["s3://bkt/models/m/"], poll_s=4, sleep=clock.sleep, clock=clock)
    assert t["Lifecycle"] == "SUCCEEDED" and clock.sleeps == [4, 4]


def test_import_names_the_task_that_kept_running_past_the_deadline(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    for _ in range(3):  # t = 0, 10, 20
        stub.add_client_error("create_data_repository_task", service_error_code="DataRepositoryTaskExecuting",
                              service_message="An existing data repository task is currently executing", http_status_code=400)
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [
        _task("EXECUTING", TaskId="task-0fedcba987654321f", Type="EXPORT_TO_REPOSITORY")]},
        {"Filters": [{"Name": "file-system-id", "Values": [FS]}, {"Name": "task-lifecycle", "Values": ["PENDING", "EXECUTING"]}]})
    clock = FakeClock()
    with pytest.raises(StagingError, match=r"another data repository task is running \(task-0fedcba987654321f "
                                           r"\(EXPORT_TO_REPOSITORY, EXECUTING\)\)"):
        import_metadata(client, FS, ["s3://bkt/"], poll_s=10, timeout_s=20, sleep=clock.sleep, clock=clock)
    assert clock.t == 20


def test_throttling_while_polling_is_retried(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": _task("PENDING")})
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [_task("EXECUTING")]})
    stub.add_client_error("describe_data_repository_tasks", service_error_code="ThrottlingException",
                          service_message="Rate exceeded", http_status_code=400)
    stub.add_client_error("describe_data_repository_tasks", service_error_code="InternalServerError",
                          service_message="oops", http_status_code=500)
    stub.add_response("describe_data_repository_tasks", _succeeded())
    clock = FakeClock()
    t = import_metadata(client, FS, ["s3://bkt/models/m/"], poll_s=10, sleep=clock.sleep, clock=clock)
    assert t["Lifecycle"] == "SUCCEEDED"
    assert clock.sleeps == [10, 1.0, 2.0]  # the poll, then backoff 1 s, 2 s


def test_throttling_until_the_deadline_and_other_errors_are_staging_errors(fsx) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": _task("PENDING")})
    for _ in range(3):  # t = 0, 1, 3 (deadline 3)
        stub.add_client_error("describe_data_repository_tasks", service_error_code="ThrottlingException",
                              service_message="Rate exceeded", http_status_code=400)
    clock = FakeClock()
    with pytest.raises(StagingError, match="still failing when the time ran out: ThrottlingException: Rate exceeded"):
        import_metadata(client, FS, ["s3://bkt/"], timeout_s=3, sleep=clock.sleep, clock=clock)
    stub.add_client_error("create_data_repository_task", service_error_code="FileSystemNotFound",
                          service_message="no such file system", http_status_code=400)
    with pytest.raises(StagingError, match=f"FSx {FS}: .*FileSystemNotFound: no such file system"):
        import_metadata(client, FS, ["s3://bkt/"])


def test_preload_shares_one_deadline_across_its_phases(fsx, tmp_path: Path) -> None:  # noqa: ANN001
    from runtime.staging.fsx import preload_from_s3

    client, stub = fsx
    stub.add_response("describe_data_repository_associations", {"Associations": [_dra("CREATING")]})
    for st in ["CREATING"] * 8 + ["AVAILABLE"]:  # AVAILABLE at t = 80
        stub.add_response("describe_data_repository_associations", {"Associations": [_dra(st)]})
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": _task("PENDING")})
    for _ in range(3):  # t = 80, 90, 100: the budget is spent
        stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [_task("EXECUTING")]})
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    clock = FakeClock()
    with pytest.raises(StagingError, match="import task .* not finished after 20 s"):
        preload_from_s3(client, file_system_id=FS, mount_root=tmp_path, file_system_path="/models/m",
                        s3_uri="s3://bkt/models/m/", lfs=None, poll_s=10, timeout_s=100, sleep=clock.sleep, clock=clock)
    assert clock.t == 100


# ---- lfs: hung, unusable, odd names, failed restores -------------------------------------------------
PY_LFS = r'''#!{py}
# `lfs` stand-in printing the real formats (lfs.c): "PATH: ACTION" per file for hsm_action and
# "PATH: (0xFLAGS) flags" for hsm_state, in argument order.
import sys
cmd, files = sys.argv[1], sys.argv[2:]
with open({log!r}, "a") as f:
    f.write(repr(sys.argv[1:]) + "\n")
if cmd == "hsm_action":
    for p in files:
        print(p + ": NOOP")
elif cmd == "hsm_state":
    for p in files:
        print(p + (": (0x0000000d) released exists archived" if "bad" in p else ": (0x00000009) exists archived"))
'''


def _py_lfs(tmp_path: Path) -> tuple[str, Path]:
    import sys

    exe, log = tmp_path / "lfs", tmp_path / "lfs.log"
    exe.write_text(PY_LFS.format(py=sys.executable, log=str(log)))
    exe.chmod(0o755)
    return str(exe), log


def test_names_with_newlines_and_separators_are_tracked_by_position(tmp_path: Path) -> None:
    import ast

    exe, log = _py_lfs(tmp_path)
    odd = [tmp_path / "shard\n1.safetensors", tmp_path / "a: NOOP\nb", tmp_path / "plain"]
    assert hsm_restore(odd, lfs=exe, sleep=lambda s: None) is True
    calls = [ast.literal_eval(line) for line in log.read_text().splitlines()]
    assert [c[0] for c in calls] == ["hsm_restore", "hsm_action", "hsm_state"]
    assert all(c[1:] == [str(p) for p in odd] for c in calls)


def test_relative_paths_are_passed_absolute_so_none_reads_as_an_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ast

    exe, log = _py_lfs(tmp_path)
    monkeypatch.chdir(tmp_path)
    hsm_restore([Path("-rf")], lfs=exe, sleep=lambda s: None)
    assert ast.literal_eval(log.read_text().splitlines()[0]) == ["hsm_restore", str(tmp_path / "-rf")]


def test_a_file_still_released_after_noop_is_a_failed_restore(tmp_path: Path) -> None:
    exe, _ = _py_lfs(tmp_path)
    with pytest.raises(StagingError, match=r"1 files are still released .*bad\.safetensors"):
        hsm_restore([tmp_path / "ok.safetensors", tmp_path / "bad.safetensors"], lfs=exe, sleep=lambda s: None)


def test_a_hung_lfs_is_killed_at_the_deadline(tmp_path: Path) -> None:
    import time

    exe = tmp_path / "lfs"
    exe.write_text("#!/bin/sh\nsleep 30 &\nwait\n")  # a child holding the pipes, as a blocked client would
    exe.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(StagingError, match="lfs hsm_restore: no answer within 1 s"):
        hsm_restore([tmp_path / "x"], lfs=str(exe), timeout_s=1.0)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("make", ["not executable", "missing"])
def test_an_unusable_lfs_is_a_staging_error(tmp_path: Path, make: str) -> None:
    exe = tmp_path / "lfs"
    if make == "not executable":
        exe.write_text("#!/bin/sh\nexit 0\n")
    with pytest.raises(StagingError, match=f"lfs {exe}: cannot run it"):
        hsm_restore([tmp_path / "x"], lfs=str(exe))
