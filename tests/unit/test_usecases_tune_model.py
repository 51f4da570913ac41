"""The tune-any-model use case (runtime/usecases/tune_model.py) without a command line: what it tells its report,
in which order, and what it raises.

* a trace sizes the workload and the report hears about it before the candidates;
* bad values are all named at once (TuneUsageError) before the model is read;
* a winner over the GPU budget is a run-time failure (TuneFailure) after the candidates were shown, and nothing
  is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.usecases.tune_model import ModelTuneRequest, TuneFailure, TuneUsageError, tune_model

LLAMA_8B = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json"


class Recorder:
    """A TuneReport that keeps every call as (method, first argument)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def line(self, text):
        self.calls.append(("line", text))

    def progress(self, text):
        self.calls.append(("progress", text))

    def measured(self, rows):
        self.calls.append(("measured", rows))

    def candidates(self, result, workload, precision, slo):
        self.calls.append(("candidates", (result, workload, precision, slo)))

    def registered(self, registration, result, tracking_uri, registered_model):
        self.calls.append(("registered", registration))


def _trace(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 500 + i, "output_length": 100})
                            + "\n" for i in range(n)))
    return path


def test_a_trace_sizes_the_workload_and_is_reported_before_the_candidates(tmp_path):
    report = Recorder()
    out = tmp_path / "spec.json"
    outcome = tune_model(ModelTuneRequest(model=LLAMA_8B, trace_path=_trace(tmp_path / "t.jsonl", 50),
                                          out_path=out, state_dir=tmp_path), report)
    kinds = [k for k, _ in report.calls]
    workload_at = next(i for i, (k, v) in enumerate(report.calls) if k == "line" and str(v).startswith("workload:"))
    assert workload_at < kinds.index("candidates") < kinds.index("progress")
    assert any(k == "line" and "only 50 request(s)" in str(v) for k, v in report.calls)  # too few: said
    assert outcome.workload.isl_tokens == 524 and abs(outcome.workload.request_rate_per_s - 1.0) < 0.05
    assert json.loads(out.read_text())["workload"]["isl_tokens"] == 524
    assert outcome.registration is None  # no MLflow asked for


def test_bad_values_are_named_together_before_the_model_is_read(tmp_path):
    report = Recorder()
    with pytest.raises(TuneUsageError) as ei:
        tune_model(ModelTuneRequest(model=tmp_path / "absent", ttft_p90_ms=-1, request_rate_per_s=0,
                                    min_improvement_pct=3, state_dir=tmp_path), report)
    msg = str(ei.value)
    assert "--ttft-ms" in msg and "--rate" in msg and "--min-improvement-pct" in msg
    assert report.calls == []


def test_a_winner_over_the_budget_fails_after_the_table_and_writes_nothing(tmp_path):
    report = Recorder()
    out = tmp_path / "spec.json"
    with pytest.raises(TuneFailure) as ei:
        tune_model(ModelTuneRequest(model=LLAMA_8B, request_rate_per_s=200, gpu_budget=1, out_path=out,
                                    state_dir=tmp_path), report)
    assert "--gpu-budget" in str(ei.value)
    assert [k for k, _ in report.calls].count("candidates") == 1 and not out.exists()
