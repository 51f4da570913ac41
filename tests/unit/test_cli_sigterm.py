"""SIGTERM to a `pdserve` command stops what it started, like Ctrl-C does: the command's `finally`/`with`
blocks run (here: a real child process stopped through its Popen handle), a second SIGTERM during that
cleanup does not cut it short, and the command exits 143 (128 + SIGTERM).

The command under test is registered on the real `runtime.cli.app` in a real subprocess, so it runs through
the same app callback that installs the handler for `demo`, `serve` and `tune --measure` (no vLLM here)."""

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

HOLD = '''
import subprocess, sys, time
from pathlib import Path
from runtime.cli import app

marks = Path(sys.argv[1])

@app.command("hold")
def hold() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (marks / "child.pid").write_text(str(child.pid))
        while True:
            time.sleep(0.05)
    finally:
        (marks / "cleaning").write_text("")
        time.sleep(1.0)  # the test sends a second SIGTERM now
        child.terminate()
        (marks / "cleaned").write_text(str(child.wait(timeout=10)))

sys.argv = ["pdserve", "hold"]
app()
'''


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"command exited early with {proc.returncode}"
        assert time.monotonic() < deadline, f"{path.name} not written in {timeout_s} s"
        time.sleep(0.02)


def test_sigterm_runs_the_commands_cleanup_and_stops_its_child_process(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE)
    child_pid = None
    try:
        _wait_for(tmp_path / "child.pid", proc)
        child_pid = int((tmp_path / "child.pid").read_text())
        proc.send_signal(signal.SIGTERM)
        _wait_for(tmp_path / "cleaning", proc)
        proc.send_signal(signal.SIGTERM)  # ignored: the cleanup must finish
        rc = proc.wait(timeout=30)
        stderr = proc.stderr.read().decode()
        assert rc == 128 + signal.SIGTERM, stderr
        assert (tmp_path / "cleaned").read_text() == str(-signal.SIGTERM)  # child stopped by its handle
        assert not _alive(child_pid)
        assert "Traceback" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()
        if child_pid is not None and _alive(child_pid):  # only on failure: the child we caused
            os.kill(child_pid, signal.SIGKILL)


def test_the_handler_is_restored_after_an_in_process_command(tmp_path):
    from typer.testing import CliRunner

    from runtime.cli import app

    before = signal.getsignal(signal.SIGTERM)
    res = CliRunner().invoke(app, ["show-summary", "--state-dir", str(tmp_path)])
    assert res.exit_code == 1  # no summary: the command ran (and failed cleanly)
    assert signal.getsignal(signal.SIGTERM) is before


def test_install_sigterm_handler_turns_the_signal_into_systemexit():
    from runtime.cli import install_sigterm_handler

    previous = install_sigterm_handler()
    try:
        with pytest.raises(SystemExit) as exc:
            signal.raise_signal(signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode boundary
        assert exc.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
