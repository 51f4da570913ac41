"""Local worker supervision (runtime.server.launch.WorkerSupervisor, WorkerProcess.stop, runtime.procs.stop_group)
with real processes: a stand-in API server (a small HTTP server answering /health) that, like vLLM's, starts an
engine child in its process group.

Specification: when a worker's API server is killed, its engine child (still running, re-parented) is stopped
with its whole process group, and the worker is started again on the same port and answers /health; after
`max_restarts` restarts, the next death is a `failure` naming the worker and its log, and nothing of its group
is left running; a child that ignores SIGTERM is killed after the grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.config import EngineSpec
from runtime.engines.vllm_worker import WorkerProcess
from runtime.procs import _group_members, stop_group
from runtime.server.launch import WorkerSupervisor

API_SERVER = '''
import http.server, subprocess, sys
port, pidfile = int(sys.argv[1]), sys.argv[2]
engine = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(1)"])
open(pidfile, "w").write(str(engine.pid))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


def _worker(tmp_path: Path) -> tuple[WorkerProcess, Path]:
    script, pidfile = tmp_path / "api_server.py", tmp_path / "engine.pid"
    script.write_text(API_SERVER)
    w = WorkerProcess(EngineSpec(), tmp_path, served_model_name="m", role="decode", log_path=tmp_path / "w.log")
    w.args = [sys.executable, str(script), str(w.port), str(pidfile)]
    return w, pidfile


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _engine_pid(pidfile: Path, old: int | None = None) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if pidfile.exists() and pidfile.read_text() and int(pidfile.read_text()) != old:
            return int(pidfile.read_text())
        time.sleep(0.05)
    raise AssertionError("the stand-in API server did not start its engine")


def test_a_killed_api_server_has_its_group_stopped_and_is_restarted_then_gives_up(tmp_path):
    w, pidfile = _worker(tmp_path)
    restarted = []
    sup = WorkerSupervisor([w], max_restarts=1, startup_timeout_s=30, on_restart=restarted.append)
    try:
        w.start().wait_ready(30, poll_interval_s=0.05)
        engine, pgid = _engine_pid(pidfile), w.pid
        sup.check()
        assert restarted == [] and sup.failure is None  # alive: nothing to do

        os.kill(w.pid, signal.SIGKILL)  # the API server dies; its engine keeps running, re-parented
        while w.exit_code() is None:
            time.sleep(0.05)
        assert _running(engine)
        sup.check()
        assert not _running(engine) and _group_members(pgid) == []
        assert restarted == [w] and sup.restarts[id(w)] == 1 and sup.failure is None
        assert w.exit_code() is None and w.pid != pgid
        w.wait_ready(5, poll_interval_s=0.05)  # the same port answers again

        engine, pgid = _engine_pid(pidfile, engine), w.pid
        os.kill(w.pid, signal.SIGKILL)
        while w.exit_code() is None:
            time.sleep(0.05)
        sup.check()
        assert sup.failure is not None and "decode worker" in sup.failure and str(w.log_path) in sup.failure
        assert not _running(engine) and _group_members(pgid) == [] and w.pid is None
    finally:
        sup.stop()
        w.stop()


def test_the_supervising_thread_restarts_a_dead_worker(tmp_path):
    w, pidfile = _worker(tmp_path)
    sup = WorkerSupervisor([w], max_restarts=2, startup_timeout_s=30, interval_s=0.1)
    try:
        w.start().wait_ready(30, poll_interval_s=0.05)
        first = w.pid
        sup.start()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (sup.restarts[id(w)] == 1 and w.pid not in (None, first) and w.alive()):
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.05)
        w.wait_ready(10, poll_interval_s=0.05)
    finally:
        sup.stop()
        w.stop()
    assert sup.failure is None


def test_stop_group_kills_a_member_that_ignores_sigterm():
    p = subprocess.Popen([sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                          "print('ready', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        assert stop_group(p.pid, 0.5)
        assert time.monotonic() - t0 >= 0.5  # the grace period was given
        p.wait(5)
        assert p.returncode == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_stop_group_of_an_empty_group_is_true_at_once():
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    p.wait()
    assert stop_group(p.pid, 5.0)


@pytest.mark.parametrize("bad", [-1])
def test_negative_restart_budget_is_rejected(bad):
    with pytest.raises(ValueError, match="max_restarts"):
        WorkerSupervisor([], max_restarts=bad)
