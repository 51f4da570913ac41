"""Every GPU spelling in the published spec table (tests/fixtures/gpu_specs.csv) resolves to the catalog entry with that row's
numbers (the ALIASES comment promises the CSV's spellings are covered)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from runtime.perf.gpus import get_gpu

ROWS = list(csv.DictReader((Path(__file__).resolve().parents[1] / "fixtures" / "gpu_specs.csv").open()))


def test_the_csv_has_rows():
    assert len(ROWS) >= 15


@pytest.mark.parametrize("row", ROWS, ids=[r["gpu"] for r in ROWS])
def test_gpu_specs_csv_name_resolves_to_its_row(row):
    g = get_gpu(row["gpu"])
    # "7700 (NVIDIA: 8000)": the first number is the one the catalog uses
    assert g.mem_bw_bytes_per_s == pytest.approx(float(row["hbm_or_gddr_GBps"].split()[0]) * 1e9)


@pytest.mark.parametrize("name", ["A10G-24GB (AWS g5)", "GH200-96GB (GH200 480GB superchip GPU)"])
def test_parenthesised_csv_spellings_resolve_case_insensitively(name):
    assert get_gpu(name.upper()) is get_gpu(name) is get_gpu(f"  {name.lower()} ")
