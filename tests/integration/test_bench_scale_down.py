"""bench/scale_down.py's plumbing on the engine stand-in (`--engine standin`): the real runtime model, planner
runtime and TCP gate, stand-in engines, one cycle per actuator, one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.scripts import REPO


def test_scale_down_bench_drains_without_a_cut_request_and_reports_both_actuators(tmp_path):
    out = tmp_path / "scale_down.json"
    r = subprocess.run([sys.executable, "bench/scale_down.py", "--engine", "standin", "--cycles", "1", "--rate",
                        "3", "--hold-s", "3", "--logs", str(tmp_path), "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == line and line["bench"] == "scale_down"
    drain, plain = line["arms"]
    assert (drain["actuator"], plain["actuator"]) == ("drain", "plain")
    assert drain["scale_downs"] == plain["scale_downs"] == 1 and drain["requests"] > 0 and plain["requests"] > 0
    # the drained worker is stopped only once the engine holds nothing, and every request ends well
    assert drain["failed"] == 0 and drain["cut_requests"] == 0 and drain["migrations"] == 0
    assert drain["drain_s_max"] is not None and drain["drain_s_max"] < 60
    assert plain["drain_s_max"] is not None and plain["drain_s_max"] < 1.0  # stopped at once
