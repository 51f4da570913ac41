"""Workload samples (ISL/OSL from traces) and M/G/1 queueing in the tuner."""

from __future__ import annotations

import pytest

from runtime.config import SloSpec, WorkloadSpec
from runtime.modelfiles.load import load_model_spec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.tracking.traces import TraceFormatError, load_length_sample, read_isl_osl
from runtime.tuner.queueing import md1_wait_quantile_s, mg1_wait_quantile_s
from runtime.tuner.search import tune
from runtime.tuner.workload import LengthSample, quantile

L8 = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json")


def test_mg1_reduces_to_md1_and_grows_with_variance():
    assert mg1_wait_quantile_s(5.0, 0.1, 0.01) == pytest.approx(md1_wait_quantile_s(5.0, 0.1))
    assert mg1_wait_quantile_s(5.0, 0.1, 0.02) > mg1_wait_quantile_s(5.0, 0.1, 0.01)
    with pytest.raises(ValueError):
        mg1_wait_quantile_s(1.0, 0.1, 0.001)  # E[S^2] < E[S]^2 is impossible


def test_length_sample_stats_and_subsampling():
    s = LengthSample.from_pairs([(100, 10), (200, 20), (0, 5), (300, 30)])
    assert s.isl_tokens == (100, 200, 300)  # the zero-length prompt is dropped
    assert s.mean_isl == 200 and s.mean_osl == 20
    assert s.context_quantile(0.9) == 330
    assert quantile([5, 1, 3], 0.5) == 3
    big = LengthSample.from_pairs([(i + 1, 1) for i in range(1000)], max_points=10)
    assert len(big.isl_tokens) == 10 and big.isl_tokens[0] == 1
    with pytest.raises(ValueError):
        LengthSample.from_pairs([(0, 0)])


def test_both_public_trace_formats_load(azure_trace, mooncake_trace):
    from tests.conftest import AZURE_ROWS as rows

    assert read_isl_osl(azure_trace) == [(r.isl, r.osl) for r in rows]
    moon = load_length_sample(mooncake_trace, max_points=64)
    assert len(moon.isl_tokens) == 64
    whole = sum(r.isl for r in rows) / len(rows)
    assert abs(moon.mean_isl - whole) / whole < 0.25  # 64 evenly spaced requests of 2000


def test_trace_format_errors_name_the_missing_field(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(TraceFormatError, match="GeneratedTokens"):
        read_isl_osl(p)
    q = tmp_path / "t.jsonl"
    q.write_text('{"input_length": 3}\n')
    with pytest.raises(TraceFormatError, match="output_length"):
        read_isl_osl(q)


def test_tuning_on_a_one_point_sample_equals_the_mean_workload():
    w = WorkloadSpec(isl_tokens=2000, osl_tokens=200, request_rate_per_s=5)
    a = tune(L8, "H100-SXM", SloSpec(), w)
    b = tune(L8, "H100-SXM", SloSpec(), w, sample=LengthSample((2000,), (200,)))
    assert a.candidates == b.candidates


def test_length_spread_costs_prefill_goodput():
    """Same mean ISL, but a spread of lengths: more queueing (M/G/1), so prefill goodput cannot rise."""
    w = WorkloadSpec(isl_tokens=2000, osl_tokens=200, request_rate_per_s=5)
    fixed = tune(L8, "H100-SXM", SloSpec(), w, tps=(1,))
    spread = tune(L8, "H100-SXM", SloSpec(), w, tps=(1,),
                  sample=LengthSample((500, 1000, 2500, 4000), (200, 200, 200, 200)))
    assert spread.best.prefill_goodput_rps <= fixed.best.prefill_goodput_rps
    assert spread.best.ttft_unloaded_ms > fixed.best.ttft_unloaded_ms  # p90 prompt is longer
