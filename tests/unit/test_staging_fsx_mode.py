"""Specification of the stager's opt-in FSx mode (`python -m runtime.staging` and `pdserve stage`
with --fsx-file-system-id/--fsx-path): the S3 prefix is linked into the file system (association
found or created), its metadata imported, the files preloaded with `lfs hsm_restore` when `lfs` is
on PATH, and the linked folder then staged into DEST with a marker. FSx is botocore's Stubber (real
shapes), `lfs` a script on PATH, the mount a temporary folder."""

from __future__ import annotations

import json
import stat
from datetime import datetime, timezone
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from typer.testing import CliRunner

from runtime.staging.__main__ import main
from runtime.staging.manifest import read_marker

FS = "fs-0123456789abcdef0"
NOW = datetime(2026, 11, 30, tzinfo=timezone.utc)
LFS = """#!/bin/sh
echo "$1" >> "{log}"
case "$1" in
  hsm_restore) exit 0 ;;
  hsm_action) shift; for f in "$@"; do echo "$f: NOOP"; done ;;
  hsm_state) shift; for f in "$@"; do echo "$f: (0x00000009) exists archived"; done ;;
esac
"""


@pytest.fixture
def fsx():  # noqa: ANN201
    client = boto3.client("fsx", region_name="us-east-1", aws_access_key_id="a", aws_secret_access_key="b")
    with Stubber(client) as stub:
        yield client, stub
        stub.assert_no_pending_responses()


@pytest.fixture
def mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An FSx mount whose /s3/m folder holds what the import makes visible, and `lfs` on PATH."""
    root = tmp_path / "fsx"
    (root / "s3" / "m").mkdir(parents=True)
    (root / "s3" / "m" / "config.json").write_text('{"hidden_size": 64}')
    (root / "s3" / "m" / "model.safetensors").write_bytes(b"w" * 5000)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "lfs").write_text(LFS.format(log=tmp_path / "lfs.log"))
    (bin_dir / "lfs").chmod(0o755 | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return root


def _script_fsx(stub: Stubber) -> None:
    stub.add_response("describe_data_repository_associations", {"Associations": []},
                      {"Filters": [{"Name": "file-system-id", "Values": [FS]}]})
    stub.add_response("create_data_repository_association", {"Association": {
        "AssociationId": "dra-0a1b2c3d4e5f6a7b8", "FileSystemId": FS, "Lifecycle": "AVAILABLE",
        "FileSystemPath": "/s3/m", "DataRepositoryPath": "s3://bkt/models/m/", "CreationTime": NOW}},
        {"FileSystemId": FS, "FileSystemPath": "/s3/m", "DataRepositoryPath": "s3://bkt/models/m/",
         "BatchImportMetaDataOnCreate": False, "ImportedFileChunkSize": 1024,
         "S3": {"AutoImportPolicy": {"Events": ["NEW", "CHANGED", "DELETED"]}}})
    task = {"TaskId": "task-0123456789abcdef0", "Type": "IMPORT_METADATA_FROM_REPOSITORY", "CreationTime": NOW,
            "FileSystemId": FS}
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": {**task, "Lifecycle": "PENDING"}},
                      {"Type": "IMPORT_METADATA_FROM_REPOSITORY", "FileSystemId": FS, "Paths": ["s3://bkt/models/m/"],
                       "Report": {"Enabled": False}})
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [{**task, "Lifecycle": "SUCCEEDED"}]},
                      {"TaskIds": ["task-0123456789abcdef0"]})


def test_python_m_staging_links_imports_preloads_then_stages_the_linked_folder(
        fsx, mount: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    client, stub = fsx
    _script_fsx(stub)
    dest = mount / "models" / "m"
    rc = main(["s3://bkt/models/m", str(dest), "--fsx-file-system-id", FS, "--fsx-path", "/s3/m",
               "--fsx-mount", str(mount), "--no-fsync"], fsx_client=client)
    out, errs = capsys.readouterr()
    assert rc == 0, errs
    assert json.loads(out)["files"] == 2
    assert (tmp_path / "lfs.log").read_text().split() == ["hsm_restore", "hsm_action", "hsm_state"]
    m = read_marker(dest)
    assert m.source == str(mount / "s3" / "m")
    assert (dest / "model.safetensors").read_bytes() == b"w" * 5000


@pytest.mark.parametrize(("args", "message"), [
    (["s3://bkt/m", "D", "--fsx-file-system-id", FS], "--fsx-file-system-id and --fsx-path go together"),
    (["s3://bkt/m", "D", "--fsx-path", "/s3/m"], "--fsx-file-system-id and --fsx-path go together"),
    (["/local/folder", "D", "--fsx-file-system-id", FS, "--fsx-path", "/s3/m"], "SOURCE must be s3://"),
    (["s3://bkt/m", "D", "--fsx-file-system-id", FS, "--fsx-path", "s3/m"], "--fsx-path: .*must start with '/'"),
    (["s3://bkt/m", "D", "--fsx-file-system-id", "0123", "--fsx-path", "/s3/m"], "expected an FSx file system id"),
])
def test_bad_fsx_options_exit_2_naming_the_option(args: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.staging.fsx as fsx_mod

    monkeypatch.setattr(fsx_mod, "make_fsx_client", lambda *a: pytest.fail("no client for bad options"))
    assert main(args) == 2
    import re

    assert re.search(message, capsys.readouterr().err)


def test_an_association_path_overlapping_dest_is_refused_before_any_fsx_call(
        fsx, mount: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    client, _ = fsx
    rc = main(["s3://bkt/models/m", str(mount / "models" / "m"), "--fsx-file-system-id", FS, "--fsx-path", "/models",
               "--fsx-mount", str(mount)], fsx_client=client)
    assert rc == 1 and "overlaps the destination" in capsys.readouterr().err


def test_an_fsx_failure_exits_1_and_leaves_dest_absent(fsx, mount: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    client, stub = fsx
    stub.add_client_error("describe_data_repository_associations", service_error_code="FileSystemNotFound",
                          service_message="no such file system", http_status_code=400)
    dest = mount / "models" / "m"
    rc = main(["s3://bkt/models/m", str(dest), "--fsx-file-system-id", FS, "--fsx-path", "/s3/m",
               "--fsx-mount", str(mount)], fsx_client=client)
    assert rc == 1 and "FileSystemNotFound: no such file system" in capsys.readouterr().err
    assert not dest.exists()


def test_without_fsx_options_no_fsx_client_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.staging.fsx as fsx_mod

    monkeypatch.setattr(fsx_mod, "make_fsx_client", lambda *a: pytest.fail("FSx client made without --fsx-*"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"\0" * 16)
    assert main([str(src), str(tmp_path / "out"), "--no-fsync"]) == 0


def test_pdserve_stage_fsx_mode(fsx, mount: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    import runtime.staging.fsx as fsx_mod
    from runtime.cli import app

    client, stub = fsx
    _script_fsx(stub)
    monkeypatch.setattr(fsx_mod, "make_fsx_client", lambda *a: client)
    dest = mount / "models" / "m"
    res = CliRunner().invoke(app, ["stage", "s3://bkt/models/m", str(dest), "--fsx-file-system-id", FS,
                                   "--fsx-path", "/s3/m", "--fsx-mount", str(mount)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert read_marker(dest).source == str(mount / "s3" / "m")
    assert (tmp_path / "lfs.log").read_text().split()[0] == "hsm_restore"
    bad = CliRunner().invoke(app, ["stage", "/local", str(dest), "--fsx-path", "/s3/m"], env={"COLUMNS": "300"})
    assert bad.exit_code == 2 and "--fsx-file-system-id and --fsx-path go together" in bad.output


def test_only_the_files_the_stage_selects_are_preloaded(
        fsx, mount: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """A duplicate PyTorch checkpoint beside the safetensors is not pulled from S3 by hsm_restore."""
    client, stub = fsx
    _script_fsx(stub)
    (mount / "s3" / "m" / "pytorch_model.bin").write_bytes(b"b" * 7000)
    log = tmp_path / "lfs-args.log"
    (tmp_path / "bin" / "lfs").write_text(LFS.replace('echo "$1" >> "{log}"', 'echo "$@" >> "{log}"').format(log=log))
    dest = mount / "models" / "m"
    rc = main(["s3://bkt/models/m", str(dest), "--fsx-file-system-id", FS, "--fsx-path", "/s3/m",
               "--fsx-mount", str(mount), "--no-fsync"], fsx_client=client)
    assert rc == 0, capsys.readouterr().err
    restore = next(line for line in log.read_text().splitlines() if line.startswith("hsm_restore"))
    assert "model.safetensors" in restore and "config.json" in restore and "pytorch_model.bin" not in restore
    assert not (dest / "pytorch_model.bin").exists()


def test_a_dest_reaching_the_linked_folder_through_a_symlink_or_dotdot_is_refused(
        fsx, mount: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    client, _ = fsx  # no FSx call may happen: the stub has no responses
    (mount / "alias").symlink_to(mount / "s3")
    for dest in (mount / "alias" / "m" / "published", mount / "models" / ".." / "s3" / "m" / "x"):
        rc = main(["s3://bkt/models/m", str(dest), "--fsx-file-system-id", FS, "--fsx-path", "/s3/m",
                   "--fsx-mount", str(mount)], fsx_client=client)
        assert rc == 1 and "overlaps the destination" in capsys.readouterr().err


def test_a_non_finite_fsx_timeout_is_refused(fsx, mount: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    client, _ = fsx
    with pytest.raises(SystemExit) as exited:  # argparse's usage error
        main(["s3://bkt/models/m", str(mount / "models" / "m"), "--fsx-file-system-id", FS, "--fsx-path", "/s3/m",
              "--fsx-mount", str(mount), "--fsx-timeout-s", "inf"], fsx_client=client)
    assert exited.value.code == 2 and "finite" in capsys.readouterr().err
    from runtime.staging.fsx import preload_source
    from runtime.staging.manifest import StagingError

    with pytest.raises(StagingError, match="finite"):
        preload_source(client, file_system_id=FS, file_system_path="/s3/m", s3_uri="s3://bkt/models/m",
                       dest=mount / "models" / "m", mount_root=mount, timeout_s=float("inf"))

