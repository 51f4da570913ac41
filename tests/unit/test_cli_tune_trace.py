"""`pdserve tune --trace`: size the deployment for recorded traffic (the re-tuning CronWorkflow's input).

Specification: the trace's ISL/OSL pairs are sized for (the spec records their means), and --isl/--osl given
with a trace are refused rather than ignored; a trace of long
prompts needs at least as much prefill as a short one at the same rate; a malformed trace fails before the model
is read, naming the file, the line and the key; a missing trace names the option.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec
from runtime.modelfiles.catalog import CATALOG_DIR

runner = CliRunner()
LLAMA_8B = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json"


def _tune(tmp_path: Path, *options: str) -> DeploymentSpec:
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--out", str(out), "--rate", "20", *options])
    assert res.exit_code == 0, res.output
    return DeploymentSpec.model_validate_json(out.read_text())


def _write_trace(path: Path, pairs: list[tuple[int, int]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": a, "output_length": b}) + "\n"
                            for i, (a, b) in enumerate(pairs)))
    return path


def test_the_spec_records_the_traces_mean_lengths(tmp_path, azure_trace):
    import csv

    rows = list(csv.DictReader(azure_trace.open()))
    spec = _tune(tmp_path, "--trace", str(azure_trace))
    # the CLI samples up to 256 evenly spaced requests; the recorded means are those of that sample, which for
    # this trace lie close to the whole trace's
    mean_isl = sum(int(r["ContextTokens"]) for r in rows) / len(rows)
    mean_osl = sum(int(r["GeneratedTokens"]) for r in rows) / len(rows)
    assert abs(spec.workload.isl_tokens - mean_isl) / mean_isl < 0.25
    assert abs(spec.workload.osl_tokens - mean_osl) / mean_osl < 0.25
    assert (spec.workload.isl_tokens, spec.workload.osl_tokens) != (3000, 150)  # not tune's defaults


@pytest.mark.parametrize("given,named", [(["--isl", "100", "--osl", "5"], "--isl and --osl"),
                                         (["--osl", "150"], "--osl")])
@pytest.mark.parametrize("trace_option", ["--trace", "--trace-uri"])
def test_isl_or_osl_with_a_trace_is_refused_not_ignored(tmp_path, azure_trace, given, named, trace_option):
    out = tmp_path / "spec.json"
    trace = str(azure_trace) if trace_option == "--trace" else "s3://bkt1/traffic.jsonl"
    res = runner.invoke(app, ["tune", str(LLAMA_8B), trace_option, trace, *given, "--out", str(out)],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: {named}: not with {trace_option}: the trace's recorded lengths are what "
                                 f"is sized for; drop {named}")
    assert not out.exists()


def test_a_trace_of_long_prompts_gets_at_least_the_prefill_of_a_short_one(tmp_path):
    short = _write_trace(tmp_path / "short.jsonl", [(200, 100), (300, 100), (250, 100)] * 20)
    long = _write_trace(tmp_path / "long.jsonl", [(6000, 100), (7000, 100), (8000, 100)] * 20)
    a = _tune(tmp_path, "--trace", str(short))
    b = _tune(tmp_path, "--trace", str(long))
    gpus = lambda s: s.prefill.tp * s.prefill.replicas  # noqa: E731
    assert gpus(b) > gpus(a)
    assert b.workload.isl_tokens == 7000 and a.workload.isl_tokens == 250


def test_a_malformed_trace_fails_before_the_model_is_read_naming_line_and_key(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 10, "output_length": 5}\n{"input_length": "ten", "output_length": 5}\n')
    res = runner.invoke(app, ["tune", str(tmp_path / "no-such-config.json"), "--trace", str(bad)])
    assert res.exit_code == 2
    assert f"--trace: {bad}:2: input_length must be a whole number" in " ".join(res.output.split())
    notjson = tmp_path / "x.jsonl"
    notjson.write_text("{oops\n")
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(notjson)])
    assert res.exit_code == 2 and f"{notjson}:1: not JSON" in " ".join(res.output.split())


def test_a_missing_or_unknown_trace_names_the_option(tmp_path):
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(tmp_path / "gone.jsonl")])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "--trace" in out and "gone.jsonl" in out
    other = tmp_path / "t.parquet"
    other.write_bytes(b"x")
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(other)])
    assert res.exit_code == 2 and "unknown trace format" in " ".join(res.output.split())


def test_lengths_must_be_whole_finite_numbers_and_bom_csv_and_upper_case_suffixes_read(tmp_path):
    from runtime.tracking.traces import TraceFormatError, read_isl_osl

    for bad, key in [('{"input_length": Infinity, "output_length": 5}', "input_length"),
                     ('{"input_length": 10, "output_length": 100.7}', "output_length"),
                     ('{"input_length": true, "output_length": 5}', "input_length")]:
        p = tmp_path / "t.jsonl"
        p.write_text(bad + "\n")
        with pytest.raises(TraceFormatError, match=f"t.jsonl:1: {key} must be a whole number"):
            read_isl_osl(p)
    csv_bom = tmp_path / "T.CSV"
    csv_bom.write_text("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,12,3\n",
                       encoding="utf-8")
    upper = tmp_path / "T.JSONL"
    upper.write_text('{"input_length": 512.0, "output_length": 3}\n')
    assert read_isl_osl(csv_bom) == [(12, 3)] and read_isl_osl(upper) == [(512, 3)]
    csv_bom.write_text("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\nx,12,3\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=r"T\.CSV:2: TIMESTAMP 'x' is not a date-time"):  # not a silent "no rate"
        read_isl_osl(csv_bom)
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(tmp_path / "t.jsonl")])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_an_empty_trace_says_so(tmp_path):
    empty = tmp_path / "traffic.jsonl"
    empty.write_text('{"timestamp": 1, "input_length": 0, "output_length": 0, "hash_ids": []}\n')
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(empty)])
    assert res.exit_code == 2 and "was any traffic recorded?" in " ".join(res.output.split())



def test_without_rate_the_traces_mean_arrival_rate_is_the_load(tmp_path, azure_trace):
    trace = tmp_path / "traffic.jsonl"  # the runtime's traffic log: Unix ms, in any order (several replicas)
    t0 = 1_764_000_000_000
    trace.write_text("".join(json.dumps({"timestamp": t0 + ms, "input_length": 500, "output_length": 50,
                                         "hash_ids": []}) + "\n" for ms in (0, 4000, 2000, 1000, 3000)))
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(trace), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert DeploymentSpec.model_validate_json(out.read_text()).workload.request_rate_per_s == 1.0  # 4 gaps in 4 s
    assert "at 1 requests/s" in " ".join(res.output.split())
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(trace), "--rate", "7", "--out", str(out)])
    assert DeploymentSpec.model_validate_json(out.read_text()).workload.request_rate_per_s == 7.0
    from runtime.tracking.traces import read_arrival_rate

    from tests.conftest import AZURE_ROWS

    # an Azure-format CSV (date-times, 7 fractional digits): (n - 1) gaps over the first-to-last span
    want = (len(AZURE_ROWS) - 1) / (AZURE_ROWS[-1].t_s - AZURE_ROWS[0].t_s)
    assert read_arrival_rate(azure_trace) == pytest.approx(want, rel=1e-6)
    untimed = tmp_path / "untimed.jsonl"
    untimed.write_text('{"input_length": 5, "output_length": 5}\n{"input_length": 6, "output_length": 5}\n')
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(untimed)])
    assert res.exit_code == 2 and "no usable arrival times" in " ".join(res.output.split())


def test_a_directory_of_replica_logs_is_one_trace_with_their_merged_rate(tmp_path):
    """Two runtime replicas each wrote their own traffic log (one file per pod, as the InferenceService does);
    an Argo artifact of the S3 prefix puts them in one folder, hidden files and other suffixes beside them."""
    t0 = 1_764_000_000_000
    logs = tmp_path / "traffic"
    (logs / "sub").mkdir(parents=True)
    (logs / "pod-a.jsonl").write_text("".join(
        json.dumps({"timestamp": t0 + ms, "input_length": 1000, "output_length": 10}) + "\n" for ms in (0, 2000, 4000)))
    (logs / "sub" / "pod-b.jsonl").write_text("".join(
        json.dumps({"timestamp": t0 + ms, "input_length": 3000, "output_length": 30}) + "\n" for ms in (1000, 3000)))
    (logs / ".pod-c.jsonl.swp").write_text("not a trace\n")
    (logs / "README.txt").write_text("not a trace\n")
    from runtime.tracking.traces import read_arrival_rate, read_isl_osl, trace_files

    assert [f.name for f in trace_files(logs)] == ["pod-a.jsonl", "pod-b.jsonl"]
    assert sorted(read_isl_osl(logs)) == [(1000, 10)] * 3 + [(3000, 30)] * 2
    assert read_arrival_rate(logs) == 1.0  # 5 arrivals over 4 s together; each pod alone sees 0.5 req/s
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(logs), "--out", str(out)])
    assert res.exit_code == 0, res.output
    w = DeploymentSpec.model_validate_json(out.read_text()).workload
    assert (w.isl_tokens, w.osl_tokens, w.request_rate_per_s) == (1800, 18, 1.0)
    assert f"{logs} (2 files)" in " ".join(res.output.split())


def test_an_empty_or_mixed_trace_directory_is_refused_by_name(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x\n")
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(empty)])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and f"--trace: {empty}: directory holds no trace file" in out
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _write_trace(mixed / "a.jsonl", [(100, 10)])
    (mixed / "b.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12,3\n")
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(mixed), "--rate", "1"])
    assert res.exit_code == 2 and "mixes .csv and .jsonl" in " ".join(res.output.split())
    bad = tmp_path / "bad"
    bad.mkdir()
    _write_trace(bad / "a.jsonl", [(100, 10)])
    (bad / "b.jsonl").write_text('{"input_length": 5}\n')
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(bad), "--rate", "1"])
    assert res.exit_code == 2 and f"{bad / 'b.jsonl'}:1: missing key(s) output_length" in " ".join(res.output.split())


def _bursty(path: Path) -> Path:
    """3.5 minutes of traffic: 30 requests in minute 0, 1800 in minute 1 (a 30/s burst), 30 in minute 2, then
    a partial half-minute of 300 more (not a whole window: left out of the peak)."""
    t0 = 1_764_000_000_000
    stamps = ([t0 + 2000 * i for i in range(30)] + [t0 + 60_000 + 100 * i // 3 for i in range(1800)]
              + [t0 + 120_000 + 2000 * i for i in range(30)] + [t0 + 180_000 + 100 * i for i in range(300)])
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 4000, "output_length": 300}) + "\n"
                            for t in stamps))
    return path


def test_the_peak_rate_is_the_busiest_whole_minute(tmp_path):
    from runtime.tracking.traces import read_arrival_rate, read_peak_rate

    trace = _bursty(tmp_path / "t.jsonl")
    assert read_peak_rate(trace) == pytest.approx(30.0, abs=0.02)  # the burst, plus at most one neighbour
    assert read_peak_rate(trace, window_s=30) == pytest.approx(30.0, abs=0.04)
    assert read_arrival_rate(trace) < 11  # the mean hides the burst
    short = _write_trace(tmp_path / "short.jsonl", [(10, 1)] * 5)  # 5 ms of timestamps: no whole minute
    assert read_peak_rate(short) is None
    with pytest.raises(ValueError, match="window_s must be > 0"):
        read_peak_rate(trace, window_s=0)


def test_a_bursty_trace_raises_the_planner_ceiling_to_what_its_peak_needs(tmp_path):
    from runtime.tracking.traces import read_peak_rate

    llama_70b = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json"
    trace = _bursty(tmp_path / "t.jsonl")
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(llama_70b), "--trace", str(trace), "--out", str(out)])
    assert res.exit_code == 0, res.output
    bursty = DeploymentSpec.model_validate_json(out.read_text())
    out_text = " ".join(res.output.split())
    assert "planner ceiling: the trace's busiest 60 s, 30" in out_text
    assert "2160 requests over 3.5 min" in out_text
    from runtime.modelfiles.load import load_model_spec
    from runtime.tuner.search import resolve_gpu, tune

    result = tune(load_model_spec(llama_70b), resolve_gpu("H100-SXM"), bursty.slo, bursty.workload)
    assert (bursty.prefill.replicas, bursty.decode.replicas) == (result.best.prefill_replicas,
                                                                 result.best.decode_replicas)  # start: the mean
    need_p, need_d = result.peak_replicas(read_peak_rate(trace))
    assert need_p > max(8, 2 * bursty.prefill.replicas)  # the default ceiling would cap the planner below the peak
    assert bursty.prefill.max_replicas == need_p
    assert bursty.decode.max_replicas == max(8, 2 * bursty.decode.replicas, need_d)
    assert result.peak_replicas(300.0)[1] > need_d  # ten times the peak needs more decode workers
    assert result.to_deployment_spec(__import__("runtime.config", fromlist=["ModelRef"]).ModelRef(name="m")
                                     ).prefill.max_replicas == max(8, 2 * bursty.prefill.replicas)
    with pytest.raises(ValueError, match="positive finite"):
        result.peak_replicas(float("nan"))


def test_the_peak_window_slides_so_a_burst_across_a_minute_boundary_is_seen_whole(tmp_path):
    """120 requests between 50 s and 70 s: a fixed grid of minutes splits them 60/60; the busiest 60 s holds all."""
    from runtime.tracking.traces import read_peak_rate

    t0 = 1_764_000_000_000
    stamps = [t0, t0 + 180_000] + [t0 + 50_000 + 500 * i // 3 for i in range(120)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 5, "output_length": 5}) + "\n"
                             for t in stamps))
    assert read_peak_rate(trace) == 2.0


def test_times_that_cannot_be_merged_or_are_not_arrivals_are_refused(tmp_path):
    from runtime.tracking.traces import TraceFormatError, read_arrival_rate, read_peak_rate

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _write_trace(mixed / "mooncake.jsonl", [(10, 1)] * 3)  # ms from the trace's start
    (mixed / "pod.jsonl").write_text("".join(json.dumps({"timestamp": 1_764_000_000_000 + i, "input_length": 5,
                                                         "output_length": 5}) + "\n" for i in range(3)))
    with pytest.raises(TraceFormatError, match="timed from their own start"):
        read_arrival_rate(mixed)
    micro = tmp_path / "us.jsonl"  # one line in microseconds among milliseconds: a unit mix-up, not a time
    micro.write_text("".join(json.dumps({"timestamp": t, "input_length": 5, "output_length": 5}) + "\n"
                             for t in (1_764_000_000_000, 1_764_000_060_000, 1_764_000_120_000_000)))
    assert read_peak_rate(micro) is None and read_arrival_rate(micro) is None


def test_a_folder_skips_empty_files_and_counts_a_linked_file_once(tmp_path):
    from runtime.tracking.traces import read_isl_osl

    logs = tmp_path / "logs"
    logs.mkdir()
    _write_trace(logs / "a.jsonl", [(10, 1), (20, 2)])
    (logs / "b.jsonl").symlink_to(logs / "a.jsonl")
    (logs / "empty.csv").write_text("")
    assert read_isl_osl(logs) == [(10, 1), (20, 2)]


def test_a_tiny_trace_is_called_noise_and_a_peak_over_the_budget_is_named(tmp_path):
    tiny = _write_trace(tmp_path / "tiny.jsonl", [(100, 10)] * 3)
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(tiny), "--rate", "1"])
    assert res.exit_code == 0 and "only 3 request(s)" in " ".join(res.output.split())
    llama_70b = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json"
    res = runner.invoke(app, ["tune", str(llama_70b), "--trace", str(_bursty(tmp_path / "b.jsonl")),
                              "--gpu-budget", "24"])
    assert res.exit_code == 0, res.output
    assert "over --gpu-budget 24: the planner stops at the budget" in " ".join(res.output.split())


def test_the_planner_option_sets_the_specs_planner_mode_and_a_bad_one_is_named(tmp_path):
    spec = _tune(tmp_path, "--planner", "sla")
    assert spec.planner.mode == "sla"
    assert _tune(tmp_path).planner.mode == "off"  # the default: fixed replicas
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--planner", "auto"])
    assert res.exit_code == 2 and "--planner" in " ".join(res.output.split())


def test_steady_traffic_has_no_peak_above_its_mean_and_one_file_cannot_mix_time_kinds(tmp_path):
    from runtime.tracking.traces import (TraceFormatError, check_traffic_trace_uri, read_arrival_rate,
                                         read_isl_osl, read_peak_rate)

    steady = tmp_path / "steady.jsonl"  # one request a second for 10 minutes
    steady.write_text("".join(json.dumps({"timestamp": 1_764_000_000_000 + 1000 * i, "input_length": 5,
                                          "output_length": 5}) + "\n" for i in range(600)))
    assert read_peak_rate(steady) == 1.0 == read_arrival_rate(steady)  # a window is (t - 60 s, t]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(steady.read_text() + json.dumps({"timestamp": 0, "input_length": 5, "output_length": 5}) + "\n")
    assert read_arrival_rate(mixed) is None and read_peak_rate(mixed) is None
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.jsonl").write_text(steady.read_text())
    (logs / "b.jsonl").hardlink_to(logs / "a.jsonl")
    assert len(read_isl_osl(logs)) == 600  # a hard link counts once
    (logs / "c.jsonl").write_bytes(b'{"input_length": 5, "output_length": 5}\n\xff\xfe\n')
    with pytest.raises(TraceFormatError, match="c.jsonl: not UTF-8"):
        read_isl_osl(logs)
    with pytest.raises(ValueError, match="must not contain"):
        check_traffic_trace_uri("s3://b-1/$(MLFLOW_TRACKING_PASSWORD)/t.jsonl")


def test_a_trace_window_keeps_the_last_hours_and_says_what_it_left_out(tmp_path):
    trace = tmp_path / "t.jsonl"
    t0 = 1_764_000_000_000
    trace.write_text("".join(json.dumps({"timestamp": t0 + k * 10_000, "input_length": 100, "output_length": 10})
                             + "\n" for k in range(360))  # one hour, short prompts
                     + "".join(json.dumps({"timestamp": t0 + 7_200_000 + k * 10_000, "input_length": 4000,
                                           "output_length": 40}) + "\n" for k in range(360)))  # an hour later
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(trace), "--trace-window-h", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    spec = DeploymentSpec.model_validate_json(out.read_text())
    assert (spec.workload.isl_tokens, spec.workload.osl_tokens) == (4000, 40)
    assert "360 requests over 59.8 min in the last 1 h (360 older request(s) read and left out)" in " ".join(
        res.output.split())
    for value, needle in [("0", "--trace-window-h: must be a number of hours > 0"), ("inf", "> 0, got inf")]:
        res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(trace), "--trace-window-h", value])
        assert res.exit_code == 2 and needle in " ".join(res.output.split())
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace-window-h", "2"])
    assert res.exit_code == 2 and "only with --trace or --trace-uri" in " ".join(res.output.split())
    no_times = _write_trace(tmp_path / "n.jsonl", [(5, 5)] * 3)
    no_times.write_text(no_times.read_text().replace('"timestamp": 1, ', ""))
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(no_times), "--trace-window-h", "2", "--rate", "1"])
    assert res.exit_code == 2 and "a trace window needs arrival times" in " ".join(res.output.split())


def test_a_presigned_trace_uri_is_refused_without_echoing_its_query(tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl", [(10, 1)] * 3)
    for uri in ("https://b.s3.amazonaws.com/t.jsonl?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=feedface99",
                "s3://b/t.jsonl#X-Amz-Signature=feedface99"):
        for args in (["--trace", str(trace), "--trace-uri", uri], ["--trace-uri", uri]):
            res = runner.invoke(app, ["tune", str(LLAMA_8B), "--rate", "1", *args])
            text = " ".join(res.output.split())
            assert res.exit_code == 2 and "must not carry a query string or fragment" in text
            assert "feedface99" not in text and "AKIAEXAMPLE" not in text
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace-uri", "/data/t.jsonl"])
    assert res.exit_code == 2 and "without --trace it must be an s3:// object or prefix" in " ".join(res.output.split())


def test_a_folder_names_the_files_it_does_not_read(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    _write_trace(logs / "a.jsonl", [(100, 10)] * 3)
    (logs / "README.txt").write_text("notes")
    (logs / "b.jsonl.gz").write_bytes(b"\x1f\x8b")
    res = runner.invoke(app, ["tune", str(LLAMA_8B), "--trace", str(logs), "--rate", "1"])
    text = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "warning: 2 file(s) under" in text and "README.txt (not .jsonl, .json or .csv)" in text
    assert "b.jsonl.gz" in text
