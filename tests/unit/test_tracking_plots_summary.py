"""Pareto front with NaN points; `pdserve show-summary` on a truncated summary.json; the demo's atomic write."""

from __future__ import annotations

import itertools
import math

from typer.testing import CliRunner

from runtime.cli import app
from runtime.tracking.plots import pareto_front


def test_pareto_front_ignores_non_finite_points_in_any_order():
    pts = [(10.0, 1.0), (math.nan, 5.0), (20.0, 3.0), (15.0, math.nan), (30.0, math.inf), (5.0, 0.5)]
    want = [(5.0, 0.5), (10.0, 1.0), (20.0, 3.0)]
    for perm in itertools.permutations(pts):
        assert pareto_front(list(perm)) == want


def test_show_summary_on_a_truncated_file_is_one_error_line(tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "summary.json").write_text('{"answers": ["Par')
    res = CliRunner().invoke(app, ["show-summary", "--state-dir", str(tmp_path)], env={"COLUMNS": "300"})
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.exception
    assert res.output.startswith("error:") and "is not valid JSON" in res.output and len(res.output.splitlines()) == 1


def test_demo_writes_summary_json_atomically():
    import inspect

    import runtime.demo as demo

    src = inspect.getsource(demo)  # run_demo and the steps it calls
    assert 'write_text_atomically(out_dir / "summary.json"' in src
    assert '(out_dir / "summary.json").write_text(' not in src
