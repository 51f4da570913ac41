"""bench/wide_ep.py: each published row is predicted with both MoE traffic models, its error is computed
against the published figure, and the JSON line is what --out writes."""

import json
from pathlib import Path

import pytest

from tests.scripts import load_script


def test_wide_ep_bench_predicts_every_row_and_writes_the_line(tmp_path: Path, capsys) -> None:
    bench = load_script("bench/wide_ep.py")
    out = bench.main(["--out", str(tmp_path / "w.json")])
    line = capsys.readouterr().out.strip()
    assert json.loads(line) == out == json.loads((tmp_path / "w.json").read_text())
    assert len(out["rows"]) == len(bench.ROWS) >= 2
    for row in out["rows"]:
        pub = row["published_tokens_per_s_per_node"]
        assert "lmsys.org" in row["source"] and row["assumption"]
        for a, pred in row["predicted_tokens_per_s_per_node"].items():
            assert pred > 0 and row["error_pct"][a] == pytest.approx(100 * (pred - pub) / pub, abs=0.1)
        # dispatch / combine moves only the rows each rank's experts need: less traffic than all-gather
        assert row["predicted_tokens_per_s_per_node"]["dispatch_combine"] > \
            row["predicted_tokens_per_s_per_node"]["allgather_reducescatter"]
