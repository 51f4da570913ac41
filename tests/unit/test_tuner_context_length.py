"""The tuner refuses a workload longer than the model's context (max_position_embeddings): vLLM would refuse
to start with the written --max-model-len. The error names both numbers."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import SloSpec, WorkloadSpec
from runtime.modelfiles.load import load_model_spec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.tuner.search import ContextTooLongError, TuningError, check_context_length, tune
from runtime.tuner.workload import LengthSample

QWEN06_PATH = CATALOG_DIR / "Qwen--Qwen3-0.6B_config.json"
QWEN06 = load_model_spec(QWEN06_PATH)  # max_position_embeddings 40960
SLO = SloSpec(ttft_p90_ms=5000, itl_p90_ms=100)


def test_the_fixture_has_a_context_limit():
    assert QWEN06.max_position_embeddings == 40960


def test_isl_plus_osl_beyond_the_context_is_refused_with_both_numbers():
    with pytest.raises(ContextTooLongError) as e:
        tune(QWEN06, "H100-SXM", SLO, WorkloadSpec(isl_tokens=50000, osl_tokens=150))
    msg = str(e.value)
    assert "50150" in msg and "40960" in msg and "max_position_embeddings" in msg
    assert isinstance(e.value, TuningError) and isinstance(e.value, ValueError)


def test_one_token_over_is_refused_and_exactly_the_context_is_tuned():
    with pytest.raises(ContextTooLongError):
        check_context_length(QWEN06, WorkloadSpec(isl_tokens=40000, osl_tokens=961))
    r = tune(QWEN06, "H100-SXM", SLO, WorkloadSpec(isl_tokens=40000, osl_tokens=960))
    assert r.max_model_len_tokens() == 40960  # capped by the context, never above it


def test_sample_p90_beyond_the_context_is_refused():
    # mean request (ISL 20000 + OSL 100) fits, but 9 in 10 sampled requests do not
    sample = LengthSample.from_pairs([(500, 100)] + [(45000, 100)] * 9)
    with pytest.raises(ContextTooLongError, match=r"p90 ISL \+ OSL is 45100 tokens.*40960"):
        tune(QWEN06, "H100-SXM", SLO, WorkloadSpec(isl_tokens=20000, osl_tokens=100), sample=sample)


def test_model_without_max_position_embeddings_is_not_limited():
    c = json.loads(QWEN06_PATH.read_text())
    del c["max_position_embeddings"]
    m = type(QWEN06).from_hf_config(c, "no-limit")
    check_context_length(m, WorkloadSpec(isl_tokens=50000, osl_tokens=150))  # no error


def test_cli_tune_beyond_the_context_exits_2_naming_the_options_and_writes_nothing(tmp_path):
    out = tmp_path / "spec.json"
    res = CliRunner().invoke(app, ["tune", str(QWEN06_PATH), "--isl", "50000", "--osl", "150", "--rate", "1",
                                   "--gpu", "H100-SXM", "--out", str(out), "--state-dir", str(tmp_path / "s")],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 2  # a workload the model cannot serve is a bad value, like any other
    assert res.output.startswith("error: --isl/--osl: ") and "40960" in res.output and "50150" in res.output
    assert not out.exists()
