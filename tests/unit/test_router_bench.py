"""bench/router.py on a small hand-made trace: one JSON line with every policy and the timing fields."""

import json
from pathlib import Path

import pytest

from tests.scripts import load_script

bench_router = load_script("bench/router.py")


def _trace(path: Path) -> Path:
    lines = []
    for i in range(60):
        shared = [0, 1, 2] if i % 2 else [100, 101]
        ids = shared + [1000 + 10 * i + k for k in range(3)]
        lines.append(json.dumps({"timestamp": 500 * i, "input_length": 512 * len(ids) - 100,
                                 "output_length": 20, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prints_one_json_line_with_every_policy(tmp_path, capsys):
    pytest.importorskip("runtime.perf.model")
    out = tmp_path / "router.json"
    rc = bench_router.main(["--trace", str(_trace(tmp_path / "t.jsonl")), "--workers", "4", "--no-dynamo",
                            "--seeds", "1", "--timing-repeats", "1", "--decision-queries", "50",
                            "--out", str(out)])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert d == json.loads(out.read_text())
    assert set(d["policies"]) == {"kv_aware", "kv_aware_approx", "dynamo_cost", "least_loaded", "round_robin",
                                "random"}
    for m in d["policies"].values():
        assert 0 <= m["hit_rate"] <= m["oracle_hit_rate"] <= 1
        assert m["ttft_mean_s"] > 0 and m["imbalance"] >= 1
    # 30 requests share a 3-block prefix (6 blocks each), 30 a 2-block prefix (5 blocks each)
    assert d["policies"]["kv_aware"]["oracle_hit_rate"] == pytest.approx((29 * 3 + 29 * 2) / (30 * 6 + 30 * 5), abs=1e-4)
    assert d["decision_us_p99"] >= d["decision_us_p50"] > 0 and d["index_us_p50"] > 0
    assert d["dynamo"] is None


def test_tiers_replay_reports_hit_rate_per_tier_and_ttft(tmp_path, capsys):
    pytest.importorskip("runtime.perf.model")
    # three 3-block prefixes in turn, each with a fresh block, on one worker whose GPU holds 6 blocks: the
    # two prompts in between evict a prefix from the GPU; a CPU tier keeps it
    lines = [json.dumps({"timestamp": 1000 * i, "input_length": 512 * 4 - 10, "output_length": 1,
                         "hash_ids": [10 * (i % 3) + k for k in range(3)] + [1000 + i]}) for i in range(30)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    rc = bench_router.main(["--trace", str(trace), "--workers", "1", "--no-dynamo",
                            "--seeds", "1", "--timing-repeats", "1", "--decision-queries", "10",
                            "--policies", "kv_aware", "--kv-blocks-per-worker", "6", "--cpu-tier-gib", "64"])
    assert rc == 0
    t = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tiers"]
    assert t["cpu_tier_blocks"] > 0 and t["cpu_load_s_per_token"] > 0
    assert t["none"]["cpu_hit_rate"] == 0
    for run in ("none", "cpu", "cpu_blind"):
        m = t[run]
        assert m["hit_rate"] == pytest.approx(m["gpu_hit_rate"] + m["cpu_hit_rate"], abs=2e-4)
        assert 0 <= m["hit_rate"] <= m["oracle_hit_rate"] and m["ttft_mean_s"] > 0
    # 27 of 30 prompts reuse their 3-block prefix (the first of each is cold): 81 / 120 blocks
    assert t["cpu"]["hit_rate"] == pytest.approx(81 / 120, abs=1e-4)
    assert t["cpu"]["hit_rate"] > t["none"]["hit_rate"] and t["cpu"]["cpu_hit_rate"] > 0
    assert t["cpu"]["ttft_mean_s"] < t["none"]["ttft_mean_s"]
    with pytest.raises(SystemExit):
        bench_router.parse_args(["--trace", "x", "--cpu-tier-gib", "-1"])


def test_a_missing_trace_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        bench_router.main(["--trace", str(tmp_path / "nope.jsonl")])


@pytest.mark.parametrize(
    "content, needle",
    [
        ("", "the trace has no requests"),
        ("\n\n", "the trace has no requests"),
        ('{"timestamp": NaN, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n',
         "line 1: 'timestamp'"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n', "spans zero time"),
    ],
)
def test_an_unusable_trace_is_a_clear_error_naming_the_file(tmp_path, content, needle):
    pytest.importorskip("runtime.perf.model")
    trace = tmp_path / "bad.jsonl"
    trace.write_text(content)
    with pytest.raises(SystemExit, match=f"--trace .*bad.jsonl: .*{needle}"):
        bench_router.main(["--trace", str(trace), "--workers", "2", "--no-dynamo", "--seeds", "1",
                           "--timing-repeats", "1", "--decision-queries", "10"])
