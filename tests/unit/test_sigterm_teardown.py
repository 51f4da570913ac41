"""A pytest run stopped with SIGTERM stops what its fixtures started (tests/sigterm.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.pids import pid_alive as _alive

REPO = Path(__file__).resolve().parents[2]

SUITE = '''
import subprocess, sys, time
from pathlib import Path

import pytest

OUT = Path(__file__).parent


@pytest.fixture(scope="session")
def server():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    (OUT / "child.pid").write_text(str(p.pid))
    yield p
    p.terminate()
    p.wait(10)
    (OUT / "torn_down").write_text("yes")


def test_waits(server):
    (OUT / "started").write_text("yes")
    time.sleep(300)
'''


def test_a_run_stopped_with_sigterm_tears_its_fixtures_down(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.sigterm",
                            str(tmp_path / "test_suite.py")], cwd=REPO, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists():
            assert run.poll() is None and time.monotonic() < deadline, "the inner run never reached its test"
            time.sleep(0.1)
        child = int((tmp_path / "child.pid").read_text())
        run.send_signal(signal.SIGTERM)
        run.wait(60)
        assert (tmp_path / "torn_down").exists()
        assert not _alive(child)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
