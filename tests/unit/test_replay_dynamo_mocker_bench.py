"""bench/replay_dynamo_mocker.py: the pdserve replay's JSON line at a tiny size, the timing table it hands Dynamo's
mocker, and what it reports when Dynamo's interpreter is absent or fails. With Dynamo's venv at the repository's
``.venv-bench-dynamo`` the last test runs the real mocker replay on the same requests."""

import json

import numpy as np
import pytest

from runtime.sim.timing import PerfTiming
from tests.scripts import load_script

pytest.importorskip("runtime.perf.model")


@pytest.fixture()
def bench():
    return load_script("bench/replay_dynamo_mocker.py")


def _refused(main, argv, capsys, *words):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    for w in words:
        assert w in err, err


def test_prints_one_json_line_of_the_pdserve_replay(bench, tmp_path, capsys):
    out = tmp_path / "r.json"
    d = bench.main(["--requests", "300", "--workers", "4", "--no-dynamo", "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == d == json.loads(out.read_text())
    p = d["pdserve"]
    assert d["dynamo"] is None and "wall_ratio_dynamo_over_pdserve" not in d
    assert p["completed"] == d["requests"] > 200  # about --requests Poisson draws, every one served
    assert 0 < p["hit_rate"] <= d["oracle_hit_rate"] + 1e-9  # agentic sessions share their prefixes
    assert d["fixed_latency_ms"] < p["ttft_ms_p50"] <= p["ttft_ms_p90"] <= p["ttft_ms_p99"]
    assert 0 < p["tpot_ms_mean"] and p["sim_s"] > 0 and p["imbalance"] >= 1 and p["wall_s"] > 0


@pytest.mark.parametrize("args, words", [(["--workers", "0"], ["--workers"]), (["--load", "0"], ["--load"]),
                                         (["--requests", "0"], ["--requests"])])
def test_bad_arguments_are_refused_at_parse_time(bench, capsys, args, words):
    _refused(bench.main, args + ["--no-dynamo"], capsys, *words)


class StepPerf:
    """prefill: 1 ms per token; decode step: 1 ms per sequence + 1 µs per context token."""

    def prefill_time_s(self, isl_tokens, tp, batch=1):
        return 0.001 * isl_tokens * batch

    def decode_step_time_s(self, batch, context_tokens, tp):
        return 0.001 * batch + 1e-6 * context_tokens


def test_timing_table_is_the_performance_model_on_the_mockers_grid(bench, tmp_path):
    path = tmp_path / "t.npz"
    bench.timing_table(PerfTiming(StepPerf(), 8), 10_000, 80_000, 4_000, path)
    t = np.load(path)
    isl, ttft = t["prefill_isl"], t["prefill_ttft_ms"]
    assert isl[0] == 1 and isl[-1] == 10_000 and np.all(np.diff(isl) > 0)
    assert ttft == pytest.approx(np.rint(isl) * 1.0)  # 1 ms per prompt token
    kv, ctx, itl = t["decode_active_kv_tokens"], t["decode_context_length"], t["decode_itl"]
    assert itl.shape == (len(kv), len(ctx)) and kv[-1] == 80_000 and ctx[-1] == 4_000
    i, j = len(kv) - 1, len(ctx) - 1  # 80k active tokens at 4k context: a batch of 20
    assert itl[i, j] == pytest.approx((0.001 * 20 + 1e-6 * 4_000) * 1e3)
    assert itl[0, j] == pytest.approx((0.001 * 1 + 1e-6 * 4_000) * 1e3)  # an empty batch steps as one sequence


def test_dynamo_absent_is_null_and_a_failing_interpreter_is_an_error(bench, capsys, tmp_path):
    d = bench.main(["--requests", "50", "--workers", "2", "--dynamo-python", str(tmp_path / "none")])
    assert d["dynamo"] is None
    capsys.readouterr()
    d = bench.main(["--requests", "50", "--workers", "2", "--dynamo-python", "/bin/false"])
    assert "dynamo child failed (rc 1)" in d["dynamo"]["error"]


def test_dynamos_mocker_replays_the_same_requests(bench, capsys):
    if not bench.DEFAULT_DYNAMO_PY.exists():
        pytest.skip("no .venv-bench-dynamo with ai-dynamo here (see bench/replay_dynamo_mocker.py)")
    d = bench.main(["--requests", "300", "--workers", "4"])
    dyn, p = d["dynamo"], d["pdserve"]
    assert "error" not in dyn, dyn
    assert dyn["completed"] == p["completed"] == d["requests"]
    assert dyn["version"] and dyn["engine"]["timing_model"]["provider"] == "dynamo_profile"
    assert 0 < dyn["hit_rate"] <= 1 and dyn["ttft_ms_p50"] > 0 and dyn["tpot_ms_mean"] > 0
    # the same requests on the same hardware model: simulated spans agree within a few percent
    assert dyn["sim_s"] == pytest.approx(p["sim_s"], rel=0.1)
    assert d["wall_ratio_dynamo_over_pdserve"] > 0


@pytest.mark.parametrize("value, words", [("{bad", ["--dynamo-engine", "not JSON"]),
                                          ("[1]", ["--dynamo-engine", "JSON object"])])
def test_dynamo_engine_settings_must_be_a_json_object(bench, capsys, value, words):
    _refused(bench.main, ["--dynamo-engine", value, "--no-dynamo"], capsys, *words)
