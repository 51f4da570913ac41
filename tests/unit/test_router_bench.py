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
