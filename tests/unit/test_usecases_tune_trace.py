"""The pipeline's tune step sized for a recorded trace (`traffic_trace_uri`), as `pdserve tune --trace`.

Specification:
* validate-parameters refuses a `traffic_trace_uri` that is neither an s3://bucket/key object URI nor an
  absolute path under fsx_root (or names no .jsonl/.csv trace), all problems named at once, reading nothing;
* with a trace, the spec's workload records the trace's rounded mean ISL/OSL (isl_tokens/osl_tokens are
  ignored) and the tuner gets the trace's length sample: the winner equals `pdserve tune --trace`'s;
* request_rate_per_s 0 means "not chosen": the trace's mean arrival rate (no trace: 10/s); a positive rate wins;
* a trace that cannot be read, holds no valid request, or (with rate 0) has no arrival times fails the step
  naming the URI, before the model is read and with nothing logged;
* the URI reaches log_tuning (the MLflow parent run's `traffic_trace_uri` param).

MLflow is replaced by a recorder of what the tune use case would log; tests/integration/test_usecases_tune_trace_s3.py reads
the trace from a real S3 server and logs to a real MLflow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.config import DeploymentSpec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.usecases.tune import AUTO_REQUEST_RATE, TuneRequest, kfp_tune_outputs, tune
from runtime.usecases.validate import ValidateRequest, validate
from runtime.tracking.traces import TrafficTraceError

LLAMA_8B = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json"
# 60 requests, mean ISL 1000 (600/1000/1400), mean OSL 200, one every 250 ms: 59 gaps in 14.75 s = 4.0/s
PAIRS = [(600, 100), (1000, 200), (1400, 300)] * 20


def _write_trace(path: Path, pairs=PAIRS, gap_ms: float | None = 250.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for k, (i, o) in enumerate(pairs):
        rec = {"input_length": i, "output_length": o}
        if gap_ms is not None:
            rec["timestamp"] = k * gap_ms
        lines.append(json.dumps(rec) + "\n")
    path.write_text("".join(lines))
    return path


@pytest.fixture
def fsx(tmp_path) -> Path:
    """An FSx stand-in holding a staged Llama-3.1-8B config (marker + manifest) under models/m."""
    from tests.usecase_requests import stage_config

    stage_config(LLAMA_8B, tmp_path / "fsx" / "models" / "m", tmp_path)
    return tmp_path / "fsx"


@pytest.fixture
def recorded(monkeypatch):
    """log_tuning replaced by a recorder of its spec and traffic_trace_uri."""
    import runtime.tracking.mlflow_runs as mr

    seen: dict = {}

    def fake_log_tuning(result, *, tracking_uri, experiment, registered_model, spec=None, traffic_trace_uri=None,
                        **kw):
        seen.update(spec=spec, traffic_trace_uri=traffic_trace_uri)
        return "1"
    monkeypatch.setattr(mr, "log_tuning", fake_log_tuning)
    monkeypatch.setattr(mr, "find_champion", lambda uri, name: None)  # no registry: a first version
    monkeypatch.setattr(mr, "champion_version", lambda uri, name: "1")
    return seen


def _tune(fsx: Path, trace: str, rate: float = AUTO_REQUEST_RATE, model_path: Path | None = None, metrics=None,
          **kw):
    """The tune use case as the pipeline's component calls it; returns the component's outputs."""
    return kfp_tune_outputs(tune(TuneRequest(
        model_path=str(model_path or fsx / "models" / "m"), model_name="m", gpu="H100-SXM", precision="bf16",
        ttft_p90_ms=2000.0, itl_p90_ms=50.0, isl_tokens=9999, osl_tokens=7, request_rate_per_s=rate,
        mlflow_tracking_uri="sqlite:///unused.db", registered_model="m-pd", traffic_trace_uri=trace,
        fsx_root=str(fsx), **kw), metrics=metrics))


def _validate(**kw):
    return validate(ValidateRequest(**kw))


VALID = dict(model_name="m", gpu="H100-SXM", precision="auto", ttft_p90_ms=2000.0, itl_p90_ms=50.0,
             isl_tokens=3000, osl_tokens=150, request_rate_per_s=AUTO_REQUEST_RATE, gpu_budget=64,
             registered_model="m-pd", fsx_root="/fsx")


@pytest.mark.parametrize("uri", ["", "s3://traffic/2026/12/log.jsonl", "/fsx/traces/azure.csv", "/fsx/t.JSONL",
                                 "s3://traffic/logs/", "/fsx/traffic/llama8/"])
def test_validate_accepts_no_trace_an_s3_object_or_a_path_under_fsx_root(uri):
    _validate(**VALID, traffic_trace_uri=uri)


@pytest.mark.parametrize(("uri", "needle"), [
    ("traces/t.jsonl", "must be an s3://bucket/key object URI or an absolute path"),
    ("s3://traffic/", "needs an object key"),
    ("s3://traffic/a//b/", "empty, '.' or '..'"),
    ("s3://traffic/./", "empty, '.' or '..'"),
    ("s3://Bad_Bucket/t.jsonl", "not a valid S3 bucket name"),
    ("gs://traffic/t.jsonl", "must be an s3://bucket/key object URI or an absolute path"),
    ("/data/t.jsonl", "must be under fsx_root '/fsx'"),
    ("/fsxother/t.jsonl", "must be under fsx_root '/fsx'"),
    ("/fsx/../etc/t.jsonl", "'..'"),
    ("/fsx/t.parquet", "must name a .jsonl"),
    ("s3://traffic/t.jsonl.gz", "must name a .jsonl"),
])
def test_validate_refuses_a_malformed_trace_uri_naming_it(uri, needle):
    with pytest.raises(ValueError) as e:
        _validate(**VALID, traffic_trace_uri=uri)
    assert "traffic_trace_uri" in str(e.value) and uri in str(e.value) and needle in str(e.value)


def test_validate_names_a_bad_trace_uri_with_the_other_bad_parameters():
    with pytest.raises(ValueError) as e:
        _validate(**(VALID | {"gpu": "H100-SMX", "request_rate_per_s": -1.0}), traffic_trace_uri="t.jsonl")
    msg = str(e.value)
    assert "traffic_trace_uri 't.jsonl'" in msg and "H100-SMX" in msg and "request_rate_per_s" in msg


def test_the_spec_records_the_traces_mean_lengths_and_arrival_rate(fsx, recorded):
    trace = _write_trace(fsx / "traces" / "log.jsonl")
    _tune(fsx, str(trace))
    w = recorded["spec"].workload
    assert (w.isl_tokens, w.osl_tokens) == (1000, 200)  # not the 9999/7 passed as isl_tokens/osl_tokens
    assert w.request_rate_per_s == pytest.approx(4.0)
    assert recorded["traffic_trace_uri"] == str(trace)


def test_a_positive_rate_wins_over_the_traces_and_no_trace_at_rate_0_is_10_per_s(fsx, recorded):
    trace = _write_trace(fsx / "traces" / "log.jsonl")
    _tune(fsx, str(trace), rate=7.0)
    assert recorded["spec"].workload.request_rate_per_s == 7.0
    _tune(fsx, "")
    w = recorded["spec"].workload
    assert (w.isl_tokens, w.osl_tokens, w.request_rate_per_s) == (9999, 7, 10.0)
    assert recorded["traffic_trace_uri"] is None


def test_the_winner_is_the_one_pdserve_tune_trace_picks(fsx, recorded, tmp_path, azure_trace):
    from runtime.cli import app

    trace = fsx / "traces" / "azure_conv.csv"  # an Azure-format trace: a wide length mix, ISO timestamps
    trace.parent.mkdir()
    trace.write_bytes(azure_trace.read_bytes())
    out = tmp_path / "cli-spec.json"
    res = CliRunner().invoke(app, ["tune", str(fsx / "models" / "m"), "--precision", "bf16", "--trace", str(trace),
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    cli = DeploymentSpec.model_validate_json(out.read_text())
    step = _tune(fsx, str(trace))
    spec = recorded["spec"]
    assert spec.workload == cli.workload
    assert (spec.prefill, spec.decode) == (cli.prefill, cli.decode)
    assert (step.prefill_tp, step.decode_tp) == (cli.prefill.tp, cli.decode.tp)


def test_the_step_states_the_traces_workload_in_the_words_of_pdserve_tune(fsx, recorded):
    """Both faces take the workload sentence and the too-few note from runtime.usecases.tune.trace_facts."""
    from runtime.cli import app

    trace = fsx / "traces" / "t.jsonl"
    trace.parent.mkdir()
    trace.write_text("".join(json.dumps({"timestamp": 500 * k, "input_length": 900 + k, "output_length": 60}) + "\n"
                             for k in range(30)))
    res = CliRunner().invoke(app, ["tune", str(fsx / "models" / "m"), "--precision", "bf16", "--trace", str(trace)],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    outcome = tune(TuneRequest(
        model_path=str(fsx / "models" / "m"), model_name="m", gpu="H100-SXM", precision="bf16", ttft_p90_ms=2000.0,
        itl_p90_ms=50.0, isl_tokens=1, osl_tokens=1, request_rate_per_s=AUTO_REQUEST_RATE,
        mlflow_tracking_uri="sqlite:///unused.db", registered_model="m-pd", traffic_trace_uri=str(trace),
        fsx_root=str(fsx)))
    said = next(n for n in outcome.notes if n.startswith("workload: "))
    assert said == f"workload: {trace}: 30 requests over 14.5 s (30 sampled), mean ISL 914, mean OSL 60 tokens, " \
                   "at 2 requests/s"
    assert said in " ".join(res.output.split())
    assert any(n.startswith(f"note: only 30 request(s) in {trace}") for n in outcome.notes)


class _Metrics(dict):
    """What KFP's Output[Metrics] offers the tune use case (runtime.usecases.tune.MetricsSink), kept in a dict."""

    def log_metric(self, metric: str, value: float) -> None:
        self[metric] = value


def test_the_sample_not_only_the_means_sizes_prefill(fsx, recorded):
    # same mean ISL (1000), OSL and rate, but one trace mixes 100- and 1900-token prompts: prefill's M/G/1
    # waiting time grows with the prompts' second moment, so the winner's predicted TTFT p90 is longer
    even = _write_trace(fsx / "even.jsonl", [(1000, 200)] * 60, gap_ms=10.0)
    mixed = _write_trace(fsx / "mixed.jsonl", [(100, 200), (1900, 200)] * 30, gap_ms=10.0)
    m_even, m_mixed = _Metrics(), _Metrics()
    _tune(fsx, str(even), metrics=m_even)
    a = recorded["spec"]
    _tune(fsx, str(mixed), metrics=m_mixed)
    b = recorded["spec"]
    assert a.workload == b.workload  # identical means and rate (100/s): only the sample differs
    assert a.workload.request_rate_per_s == pytest.approx(100.0)
    assert m_mixed["ttft_p90_ms"] > 2 * m_even["ttft_p90_ms"]  # 1563 vs 335 ms for Llama-3.1-8B at TP 1


@pytest.mark.parametrize(("content", "needle"), [
    ('{"timestamp": 0, "input_length": 0, "output_length": 5}\n', "no request with input and output length >= 1"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5}\nnot json\n', ":2: not JSON"),
    ('{"timestamp": 0, "prompt": "hi"}\n', ":1: missing key(s) input_length, output_length"),
    ("", "no request with input and output length >= 1"),
])
def test_bad_trace_contents_fail_naming_the_uri_before_the_model_is_read(fsx, recorded, tmp_path, content, needle):
    trace = fsx / "traces" / "bad.jsonl"
    trace.parent.mkdir()
    trace.write_text(content)
    with pytest.raises(TrafficTraceError) as e:  # tmp_path is no staged model: the trace fails first
        _tune(fsx, str(trace), model_path=tmp_path)
    assert str(e.value).startswith(f"traffic_trace_uri: {trace}") and needle in str(e.value)
    assert recorded == {}


def test_a_missing_trace_names_the_uri(fsx, recorded):
    with pytest.raises(TrafficTraceError, match=r"traffic_trace_uri: .*/fsx/traces/none\.jsonl: cannot read"):
        _tune(fsx, str(fsx / "traces" / "none.jsonl"))
    assert recorded == {}


def test_no_arrival_times_need_a_rate(fsx, recorded):
    trace = _write_trace(fsx / "traces" / "untimed.jsonl", gap_ms=None)
    with pytest.raises(TrafficTraceError, match="no usable arrival times.*set request_rate_per_s > 0"):
        _tune(fsx, str(trace))
    assert recorded == {}
    _tune(fsx, str(trace), rate=2.0)
    assert recorded["spec"].workload.request_rate_per_s == 2.0


def test_the_tune_step_checks_the_uri_itself(fsx, recorded):
    with pytest.raises(ValueError, match="must be under fsx_root"):
        _tune(fsx, "/etc/passwd.csv")
    assert recorded == {}


def test_a_bursty_traces_peak_raises_the_planner_ceiling_as_the_cli_does(tmp_path, recorded):
    """The tune step, like `pdserve tune --trace`, lets the planner scale up to what the trace's busiest minute
    needs (tests/unit/test_cli_tune_trace.py checks the arithmetic): same spec from both."""
    from runtime.cli import app
    from tests.unit.test_cli_tune_trace import _bursty
    from tests.usecase_requests import stage_config

    fsx = tmp_path / "fsx"
    stage_config(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json", fsx / "models" / "m", tmp_path)
    (fsx / "traces").mkdir()
    trace = _bursty(fsx / "traces" / "bursty.jsonl")
    out = tmp_path / "cli-spec.json"
    res = CliRunner().invoke(app, ["tune", str(fsx / "models" / "m"), "--precision", "bf16", "--trace", str(trace),
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    cli = DeploymentSpec.model_validate_json(out.read_text())
    _tune(fsx, str(trace))
    spec = recorded["spec"]
    assert (spec.prefill, spec.decode) == (cli.prefill, cli.decode)
    assert spec.prefill.max_replicas > max(8, 2 * spec.prefill.replicas)  # raised by the 30/s minute


def test_planner_mode_becomes_the_champions_planner_and_promote_renders_it(fsx, recorded):
    from runtime.deploy.render import find, render_all

    _tune(fsx, "", planner_mode="sla")
    spec = recorded["spec"]
    assert spec.planner.mode == "sla"
    objs = render_all(spec, name="m", namespace="pdserve", image="img:1", pvc_name="fsx-claim", revision="v1")
    assert "--planner=kubernetes" in find(objs, "InferenceService", "m")["spec"]["predictor"]["model"]["args"]
    _tune(fsx, "")
    assert recorded["spec"].planner.mode == "off"


def test_a_trace_window_sizes_for_the_last_hours_and_a_bad_one_fails_validation(fsx, recorded):
    """trace_window_h (pdserve tune --trace-window-h): an old hour of short prompts at 1/s, then a recent hour
    of long ones at 2/s; the one-hour window sizes for the recent hour alone."""
    trace = fsx / "traces" / "log.jsonl"
    trace.parent.mkdir(parents=True, exist_ok=True)
    t0 = 1_764_000_000_000
    trace.write_text("".join(json.dumps({"timestamp": t0 + k * 1000, "input_length": 100, "output_length": 10}) + "\n"
                             for k in range(3600))
                     + "".join(json.dumps({"timestamp": t0 + 3_600_000 + k * 500, "input_length": 3000,
                                           "output_length": 30}) + "\n" for k in range(1, 7201)))
    _tune(fsx, str(trace), trace_window_h=1.0)
    w = recorded["spec"].workload
    assert (w.isl_tokens, w.osl_tokens) == (3000, 30) and w.request_rate_per_s == pytest.approx(2.0, rel=1e-3)
    _tune(fsx, str(trace))  # without: both hours
    assert recorded["spec"].workload.isl_tokens < 3000
    for bad, needle in [(-1.0, "trace_window_h: must be a number of hours > 0"), (float("nan"), "got nan"),
                        (2.0, "trace_window_h: only with a traffic_trace_uri")]:
        with pytest.raises(ValueError, match=needle):
            _validate(**VALID, traffic_trace_uri="" if bad == 2.0 else "s3://traffic/logs/", trace_window_h=bad)


def test_a_presigned_trace_uri_fails_validation_without_its_signature():
    with pytest.raises(ValueError) as e:
        _validate(**VALID, traffic_trace_uri="s3://traffic/t.jsonl?X-Amz-Signature=0123456789abcdef")
    assert "must not carry a query string" in str(e.value) and "0123456789abcdef" not in str(e.value)
