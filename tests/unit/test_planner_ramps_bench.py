"""bench/planner_ramps.py: the synthetic ramps it builds, and one scenario end to end."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.scripts import load_script



def load_bench():
    return load_script("bench/planner_ramps.py")


def test_a_poisson_ramp_has_the_rate_it_was_given():
    b = load_bench()
    r = b.Ramp(1, 20, 300, 600, 100, 200, 2, 1)
    t = b.ramp_trace(r, np.array([500, 1000]), seed=0)
    # expected arrivals: the ramp's mean rate over 300 s plus 600 s at the end rate
    expected = sum(1 + 19 * min(s / 300, 1.0) for s in range(900))
    assert abs(len(t.arrival_s) - expected) < 4 * np.sqrt(expected)
    last = t.arrival_s >= 600.0
    assert abs(last.sum() / (t.arrival_s[-1] - 600.0) - 20) < 2  # the held rate
    assert set(np.unique(t.isl_tokens)) <= {500, 1000} and 100 <= t.osl_tokens.min() <= t.osl_tokens.max() <= 200
    again = b.ramp_trace(r, np.array([500, 1000]), seed=0)
    assert np.array_equal(t.arrival_s, again.arrival_s)  # pure given the seed


def test_a_clumped_ramp_replays_each_arrival_within_a_second():
    b = load_bench()
    flat = b.Ramp(10, 10, 1, 600, 100, 200, 2, 1, clumped=True)
    t = b.ramp_trace(flat, np.array([500]), seed=1)
    assert abs(len(t.arrival_s) / 600 - 10) < 1.5
    per_s = np.bincount(t.arrival_s.astype(int), minlength=601)[:600]
    # over-dispersed: clumps of CLUMP arrivals make the per-second counts' variance far above Poisson's mean
    assert per_s.var() > 3 * per_s.mean()


def test_one_scenario_prints_one_json_line(tmp_path, capsys, azure_trace):
    b = load_bench()
    out = tmp_path / "r.json"
    res = b.main(["--trace", str(azure_trace), "--scenarios", "azure_x10_from_min40", "--ablations", "no_decode_band",
                  "--out", str(out)])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert len(lines) == 1 and json.loads(lines[0]) == res == json.loads(out.read_text())
    runs = res["scenarios"]["azure_x10_from_min40"]
    assert set(runs) == {"pdserve_sla", "ablation_no_decode_band"}
    attainment, gpu_h = runs["pdserve_sla"][0]
    assert 0.5 < attainment <= 1.0 and gpu_h > 0
    assert res["summary"]["ablation_no_decode_band"]["runs"] == 1


def test_unknown_names_are_usage_errors(capsys, azure_trace):
    b = load_bench()
    for argv in (["--scenarios", "nope"], ["--ablations", "nope"], ["--seeds", "0"]):
        with pytest.raises(SystemExit) as e:
            b.main(["--trace", str(azure_trace), *argv])
        assert e.value.code == 2
    assert "unknown ['nope']" in capsys.readouterr().err
