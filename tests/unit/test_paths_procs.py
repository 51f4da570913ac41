"""Paths handed to child processes are absolute; stop_process keeps its contract for any grace period.

Invariants: state_dir() is absolute whatever PDSERVE_HOME holds (unset/empty: the repo's .pdserve);
LocalDeployment passes the runtime subprocess (cwd = repo root) the same model folder its workers load;
stop_process raises only for a process that survives SIGKILL.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.config import DeploymentSpec, ModelRef
from runtime.paths import REPO_ROOT, state_dir
from runtime.procs import stop_process


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_pdserve_home_is_the_repo_state_folder(monkeypatch, tmp_path, value):
    monkeypatch.chdir(tmp_path)
    if value is None:
        monkeypatch.delenv("PDSERVE_HOME", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_HOME", value)
    assert state_dir() == REPO_ROOT / ".pdserve"


def test_relative_pdserve_home_is_taken_from_the_current_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PDSERVE_HOME", "rel-state")
    assert state_dir() == tmp_path / "rel-state"


def test_pdserve_home_expands_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PDSERVE_HOME", "~/pd")
    assert state_dir() == tmp_path / "pd"


def test_a_relative_model_dir_names_the_same_folder_for_runtime_and_workers(monkeypatch, tmp_path):
    from runtime.server.launch import LocalDeployment

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    dep = LocalDeployment(DeploymentSpec(model=ModelRef(name="m", path="m")), Path("m"), router="kv",
                          planner="local", log_dir=tmp_path / "logs")
    args = dep.runtime.args
    for flag in ("--tokenizer-dir", "--model-dir"):
        assert Path(args[args.index(flag) + 1]) == tmp_path / "m", flag  # absolute: the runtime runs in REPO_ROOT
    assert all(w.model_dir == tmp_path / "m" for w in dep.workers)


def _sigterm_ignoring_child():
    p = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"  # the handler is installed before we signal it
    return p


@pytest.mark.parametrize("timeout_s", [0, -1, 0.2])
def test_stop_process_kills_a_sigterm_ignoring_child_for_any_grace_period(timeout_s):
    p = _sigterm_ignoring_child()
    try:
        t0 = time.monotonic()
        assert stop_process(p, timeout_s) == -signal.SIGKILL
        assert time.monotonic() - t0 < 5
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()


def test_stop_process_returns_the_exit_code_of_a_cooperative_child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert stop_process(p, 5) == -signal.SIGTERM
        assert stop_process(p, 0) == -signal.SIGTERM  # already exited: same code, no signal
        assert stop_process(None, 0) is None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_temp_folder_too_long_for_a_socket_path_is_left_as_it_is(tmp_path, monkeypatch):
    import os
    import tempfile

    from runtime.procs import temp_folder

    wanted = tmp_path / ("x" * 90) / "tmp"
    wanted.mkdir(parents=True)
    (wanted / "keep").write_text("a user's file")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with temp_folder(wanted, prefix="pdserve-t-") as used:
        assert used != wanted and used.name.startswith("pdserve-t-") and os.environ["TMPDIR"] == str(used)
    assert (wanted / "keep").read_text() == "a user's file" and not used.exists()
