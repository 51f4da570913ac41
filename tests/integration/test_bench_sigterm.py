"""SIGTERM to a bench script stops the servers it started: bench/staging.py runs a real SeaweedFS
(`weed`) child; after SIGTERM the bench exits 143 (128 + SIGTERM) through its `with` blocks and no
`weed` process it started is left running (the default action would re-parent it to PID 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.pids import pid_alive as _alive

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the bench's children through /proc")


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of the live processes whose parent is `pid`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append((int(d.name), name))
    return out


def test_sigterm_to_the_staging_bench_stops_its_s3_server(tmp_path):
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "staging.py"), "--size-mb", "64",
                             "--workdir", str(tmp_path)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    weed = None
    try:
        deadline = time.monotonic() + 120
        while weed is None:
            assert proc.poll() is None, f"bench exited early ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "no weed child within 120 s"
            weed = next((pid for pid, name in _children(proc.pid) if name == "weed"), None)
            time.sleep(0.1)
        time.sleep(1.0)  # into the server's start-up or the upload
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        stderr = proc.stderr.read().decode()
        assert rc == 128 + signal.SIGTERM, stderr[-2000:]
        assert not _alive(weed), "the bench's weed server outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stderr.close()
        if weed is not None and _alive(weed):  # only on failure: the server the bench left behind
            os.kill(weed, signal.SIGKILL)
