"""bench/perf_model.py: the comparison against a published throughput table, on a few real rows."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from runtime.modelfiles.catalog import CATALOG_DIR
from tests.scripts import load_script

TABLE = Path(__file__).resolve().parents[1] / "fixtures" / "trtllm_throughput_llama31.csv"


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/perf_model.py")


@pytest.fixture(scope="module")
def small_table(tmp_path_factory) -> Path:
    """Real rows (8B on H100/H200 FP8, 70B FP16 on A100) plus one row whose model has no config."""
    with TABLE.open() as f:
        reader = csv.DictReader(f)
        rows = [r for r in reader if r["model"] in ("LLaMA v3.1 8B", "LLaMA v3.1 70B")
                and r["gpu"] in ("H100-SXM-80GB", "A100-SXM4-80GB")][:12]
        fields = reader.fieldnames
    rows.append({**rows[0], "model": "Some Unknown Model"})
    p = tmp_path_factory.mktemp("bench") / "table.csv"
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return p


def test_table_rows_are_compared_and_unknown_models_skipped(bench, small_table):
    out, details = bench.evaluate_table(small_table)
    assert out["skipped"] == 1 and out["rows"] + out["not_fit"] == 12
    assert out["rows"] > 0 and 0 <= out["median_abs_pct_error"] <= out["p90_abs_pct_error"]
    for d in details:
        if d["predicted"] is not None:
            assert d["abs_pct_error"] == pytest.approx(abs(d["predicted"] - d["measured"]) / d["measured"] * 100,
                                                       abs=0.2)
    assert sum(v["rows"] for v in out["by_gpu"].values()) == out["rows"]


def test_aiconfigurator_side_by_side_is_optional(bench, small_table, tmp_path, monkeypatch):
    _, details = bench.evaluate_table(small_table)
    assert bench.aiconfigurator_side_by_side(small_table, details, "off") is None
    monkeypatch.setattr(bench, "AIC_RESULTS", tmp_path / "absent.json")
    assert bench.aiconfigurator_side_by_side(small_table, details, "cached") is None
    monkeypatch.setattr(bench, "AIC_VENV_PYTHON", tmp_path / "no-venv" / "python")
    assert "skipped" in bench.aiconfigurator_side_by_side(small_table, details, "run")["note"]
    # a cached run on the same table: errors on the rows both cover
    d = next(x for x in details if x["predicted"])
    aic = {"tool": "t", "rows": 2, "covered": 1, "table": small_table.name, "wall_s": 1.0,
           "details": [{**{k: d[k] for k in bench.KEY_FIELDS}, "measured": d["measured"],
                        "predicted": d["measured"] * 1.1}, {**{k: d[k] for k in bench.KEY_FIELDS},
                                                           "measured": 1.0, "predicted": None}]}
    (tmp_path / "aic.json").write_text(json.dumps(aic))
    monkeypatch.setattr(bench, "AIC_RESULTS", tmp_path / "aic.json")
    side = bench.aiconfigurator_side_by_side(small_table, details, "cached")
    assert side["median_abs_pct_error"] == pytest.approx(10.0) and side["coverage_pct"] == 50.0
    assert side["ours_on_same_rows"]["median_abs_pct_error"] == d["abs_pct_error"]


def test_moe_mapping_applies_to_the_multi_gpu_moe_rows_of_the_1_0_page_only(bench):
    from runtime.modelfiles.load import load_model_spec

    moe = load_model_spec(CATALOG_DIR / "Qwen--Qwen3-235B-A22B_config.json")
    dense = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json")
    v1 = {"source": "NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md @ 00f37686aa85", "tp": "8"}
    v014 = {"source": "TensorRT-LLM perf-overview.md (data generated with v0.14.0)", "tp": "8"}
    assert bench.row_mapping(v1, moe, "dep") == (True, True)
    assert bench.row_mapping(v1, moe, "adp") == (False, True)
    assert bench.row_mapping(v1, moe, "tp") == (False, False)
    assert bench.row_mapping({**v1, "tp": "1"}, moe, "dep") == (False, False)
    assert bench.row_mapping(v1, dense, "dep") == (False, False)
    assert bench.row_mapping(v014, moe, "dep") == (False, False)


@pytest.mark.parametrize("version,pytorch", [
    ("0.14.0", False), ("v0.18.0", False), ("v0.11.0", False), ("", False),
    ("1.0-era", True), ("v0.19.0", True), ("0.19rc1", True), ("release/0.19", True), ("v0.21.0", True),
])
def test_pytorch_backend_rows_by_release(bench, version, pytorch):
    # TensorRT-LLM's perf pages ran the PyTorch backend from v0.19 on (its per-request host work bounds the step)
    assert bench.pytorch_backend({"trtllm_version": version}) is pytorch
