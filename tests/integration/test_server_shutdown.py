"""A signal to the runtime stops the workers its local planner started (real processes on 127.0.0.1).

uvicorn handles SIGTERM/SIGINT, shuts down, restores the previous handlers and raises the signal again;
with the default SIGTERM handler the runtime died right there and the planner's workers (which outlive it)
kept running. Stand-ins: tests/integration/standin_worker.TinyWorker for vLLM, a planner that always asks
for 1 prefill + 2 decode workers (the configured decode worker plus one it starts).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.engines.vllm_worker import free_port
from tests.pids import pid_alive as _alive

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

REPO = Path(__file__).resolve().parents[2]

DRIVER = r'''
import sys
from pathlib import Path
from tests.integration.standin_worker import TinyWorker
import runtime.server.actuators as act
import runtime.server.planner_runtime as prt
from runtime.planner.types import ScalingDecision

pidfile = Path(sys.argv[1])


class Machine:  # the planner state machine's interface, always 1 prefill + 2 decode
    class cfg:  # the PlannerConfig fields the loop reads (interval, GPUs against the budget)
        interval_s = 0.5
        prefill_tp = decode_tp = 1
        gpu_budget = 8

    def on_tick(self, tick):
        return ScalingDecision(now_s=tick.now_s, prefill_replicas=1, decode_replicas=2)


def factory(spec, model_dir, log_dir, *, kv_events=False):
    def make(role, index):
        w = TinyWorker(role, index)
        start = w.start

        def recorded():
            out = start()
            with open(pidfile, "a") as f:
                f.write(f"{w.proc.pid}\n")
            return out

        w.start = recorded
        return w
    return make


act.vllm_worker_factory = factory
prt.planner_from_spec = lambda spec, cfg: Machine()
from runtime.server.__main__ import main

main(sys.argv[2:])
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_runtime_stops_its_planner_workers(tmp_path, sig):
    driver, pidfile = tmp_path / "driver.py", tmp_path / "pids"
    driver.write_text(DRIVER)
    pidfile.write_text("")
    args = [sys.executable, str(driver), str(pidfile), "--model-name", "m", "--decode-url", "http://127.0.0.1:9",
            "--http-port", str(free_port()), "--planner", "local", "--planner-interval-s", "0.5",
            "--deployment-spec", '{"model":{"name":"m"},"planner":{"mode":"load"}}', "--model-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PDSERVE_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(pids) < 2 and proc.poll() is None:
            time.sleep(0.2)
            pids = [int(x) for x in pidfile.read_text().split()]
        assert len(pids) == 2, f"the planner did not start its workers: {proc.stderr.read().decode()[-2000:] if proc.poll() is not None else ''}"
        time.sleep(1.0)  # let a tick or two run with the workers up
        proc.send_signal(sig)
        proc.wait(60)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert [p for p in pids if _alive(p)] == [], "planner workers outlived the runtime"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in pids:  # each by its own pid
            if _alive(p):
                os.kill(p, signal.SIGKILL)
