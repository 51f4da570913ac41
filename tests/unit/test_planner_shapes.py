"""runtime.sim.shapes (seeded synthetic traffic) and bench/planner.py's Mooncake reader and set-mode checks."""

import json

import numpy as np
import pytest

from runtime.sim import shapes
from tests.scripts import load_script

bench = load_script("bench/planner.py")


def test_every_name_generates_a_valid_seeded_trace():
    for name in shapes.shape_names():
        a = shapes.generate(name, 1, seed=3, duration_s=600)
        b = shapes.generate(name, 1, seed=3, duration_s=600)
        assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.isl_tokens, b.isl_tokens)
        assert a.arrival_s[0] == 0 and np.all(np.diff(a.arrival_s) >= 0) and a.arrival_s[-1] < 600
        assert a.isl_tokens.min() >= 1 and a.osl_tokens.max() <= shapes.MAX_TOKENS


def test_rate_scale_is_more_of_the_same_traffic():
    n1 = len(shapes.generate("poisson_chat", 1, seed=0))
    n5 = len(shapes.generate("poisson_chat", 5, seed=0))
    expected = shapes.BASE_RATE_PER_S * shapes.DURATION_S
    assert abs(n1 - expected) < 5 * expected ** 0.5 and abs(n5 - 5 * expected) < 5 * (5 * expected) ** 0.5


def _dispersion(t: np.ndarray) -> float:
    counts = np.bincount(t.astype(int))
    return counts.var() / counts.mean()


def test_arrival_families_differ_as_documented():
    poisson = _dispersion(shapes.generate("poisson_chat", 5, seed=1).arrival_s)
    gamma = _dispersion(shapes.generate("gamma_chat", 5, seed=1).arrival_s)
    assert 0.8 < poisson < 1.2 and gamma > 2.5  # Gamma shape 0.25: counts' dispersion tends to SCV 4
    flash = shapes.generate("flash_chat", 5, seed=1).arrival_s
    per_min = np.bincount((flash // 60).astype(int))
    peak_min = int(shapes.FLASH_AT * shapes.DURATION_S // 60) + 1
    assert per_min[peak_min] > 3 * np.median(per_min)
    diurnal = np.bincount((shapes.generate("diurnal_chat", 5, seed=1).arrival_s // 600).astype(int))
    assert diurnal[2] > 3 * diurnal[0] and diurnal[3] > 3 * diurnal[5]


def test_length_mixes_differ_as_documented():
    chat = shapes.generate("poisson_chat", 1, seed=0)
    rag = shapes.generate("poisson_rag", 1, seed=0)
    assert np.median(chat.osl_tokens) > np.median(chat.isl_tokens) / 3 and np.median(rag.osl_tokens) < 50
    assert np.median(rag.isl_tokens) > 10 * np.median(chat.isl_tokens)
    shift = shapes.generate("poisson_shift", 1, seed=0)
    early, late = shift.arrival_s < 0.3 * shapes.DURATION_S, shift.arrival_s > 0.7 * shapes.DURATION_S
    assert np.median(shift.isl_tokens[late]) > 5 * np.median(shift.isl_tokens[early])


@pytest.mark.parametrize("bad", ["poisson", "poisson_video", "burst_chat"])
def test_unknown_shapes_are_named(bad):
    with pytest.raises(ValueError, match="unknown shape"):
        shapes.generate(bad)


def test_mooncake_trace_is_read_in_seconds_and_replicated(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [dict(timestamp=0, input_length=100, output_length=5, hash_ids=[1]),
            dict(timestamp=2500, input_length=7000, output_length=0, hash_ids=[1, 2])]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tr = bench.load_trace(path, 1, 0)
    assert tr.arrival_s.tolist() == pytest.approx([0.0, 2.5])
    assert tr.isl_tokens.tolist() == [100, 7000] and tr.osl_tokens.tolist() == [5, 1]
    assert len(bench.load_trace(path, 3, 0)) == 6
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(SystemExit, match=r"t.jsonl:1: missing key\(s\) input_length, output_length"):
        bench.load_trace(path, 1, 0)


@pytest.mark.parametrize("argv, message", [
    (["--shape", "nope_chat"], "--shape: unknown"),
    (["--rate-scales", "1"], "development set is empty"),
    (["--shape", "poisson_chat", "--rate-scales", "1,x"], "--rate-scales must be"),
    ([], "give one --trace"),
    (["--shape", "poisson_chat", "--sweep-quantiles", "0.9,1"], "--sweep-quantiles must lie in (0, 1)"),
    (["--shape", "poisson_chat", "--sweep-quantiles", "0.9,x"], "--sweep-quantiles must be"),
    (["--shape", "poisson_chat", "--sweep-window-hold", "600,-1"], "--sweep-window-hold must hold finite seconds"),
    (["--shape", "poisson_chat", "--sweep-window-hold", "600,x"], "--sweep-window-hold must be"),
])
def test_set_mode_arguments_are_checked_first(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_achievable_ttft_is_the_target_unless_the_prompt_alone_exceeds_it():
    from runtime.planner.profiles import analytic_profile
    from runtime.sim.fleet import Trace

    prof = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4,
                            kv_capacity_tokens=100_000)
    tr = Trace(np.array([0.0, 1.0, 2.0]), np.array([1000, 19_000, 40_000]), np.array([5, 5, 5]))
    own = np.asarray(prof.prefill.prefill_time_s(tr.isl_tokens.astype(float)))
    got = bench.achievable_ttft_s(tr, prof, 2.0, 0.05)
    # 0.1 s and 1.9 s prompts keep the 2 s target (1.9 + 0.1 = 2.0); a 4 s prompt gets its own 4 s + 2 ITL
    assert got.tolist() == pytest.approx([2.0, 2.0, own[2] + 0.1])
