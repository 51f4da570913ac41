"""Tracking adapters that write files: planner profiles (JSON) and Pareto plots (PNG/HTML)."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.config import SloSpec, WorkloadSpec
from runtime.modelfiles.load import load_model_spec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.perf.gpus import get_gpu
from runtime.perf.model import PerfModel
from runtime.tracking.plots import pareto_front, pareto_html, pareto_png
from runtime.tracking.profiles_io import read_profiles, write_profiles
from runtime.tuner.profiles import build_profiles
from runtime.tuner.search import tune

L70 = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json")


def test_profiles_written_per_tp_and_read_back(tmp_path: Path):
    prof = build_profiles(PerfModel(L70, get_gpu("H100-SXM")), (2, 4, 8), (2, 4, 8))
    paths = write_profiles(prof, tmp_path / "profiles")
    names = {p.name for p in paths}
    assert {"profiles.json", "prefill_tp2.json", "prefill_tp8.json", "decode_tp4.json"} <= names
    assert not list((tmp_path / "profiles").glob(".*"))  # no temp files left behind
    assert read_profiles(tmp_path / "profiles") == prof
    d = json.loads((tmp_path / "profiles" / "decode_tp4.json").read_text())
    assert d["tp"] == 4 and d["points"][0]["itl_ms"] > 0


def test_pareto_front_and_plot(tmp_path: Path):
    assert pareto_front([(1, 1), (2, 3), (3, 2), (4, 5)]) == [(1, 1), (2, 3), (4, 5)]
    r = tune(L70, "H100-SXM", SloSpec(), WorkloadSpec())
    png = pareto_png(r, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = pareto_html(r, png)
    assert html.count("<tr>") == 1 + len(r.candidates) and "data:image/png;base64," in html
