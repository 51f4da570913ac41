"""`pdserve tune > file` (stdout a pipe or a file: a CI log) prints the candidate table whole: no cell elided
("50.…") at rich's 80 columns, so TTFT, ITL, $/Mtok and the footnote markers can be read from the log
(runtime.faces.common.print_table)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_table_in_a_pipe_keeps_every_number_and_footnote_marker(tmp_path):
    # --parallelism all labels each pool's layout (TP2 / TP4): wider than 80 columns
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    res = subprocess.run([sys.executable, "-m", "runtime.cli", "tune", "llama-3.1-70b", "--parallelism", "all",
                          "--state-dir", str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout, res.stdout
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in res.stdout.splitlines() if line.startswith("│")]
    assert rows and all(len(r) == 9 for r in rows), res.stdout
    feasible = [r for r in rows if r[5] != "-"]
    assert feasible and any(r[0] == "★" for r in feasible)
    for r in feasible:  # TTFT, ITL, goodput, workers P:D, GPUs, $/Mtok: each number whole
        assert re.fullmatch(r"\d+\.\d", r[2]) and re.fullmatch(r"\d+\.\d\d", r[3]), r
        assert re.fullmatch(r"\d+\.\d{3}", r[4]) and re.fullmatch(r"\d+:\d+", r[5]), r
        assert re.fullmatch(r"\d+", r[6]) and re.fullmatch(r"\d+\.\d\d", r[7]), r
    markers = {r[8] for r in rows if r[5] == "-"}
    assert markers and all(re.fullmatch(r"\[\d+\]", m) for m in markers), markers
    for m in markers:  # each marker's reason is listed under the table
        assert any(line.startswith(m + " ") for line in res.stdout.splitlines()), m
