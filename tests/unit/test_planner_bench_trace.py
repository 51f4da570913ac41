"""bench/planner.py: reading recorded traces (load_trace: Azure, BurstGPT, Mooncake, folders, a time window) and the
up-front argument checks."""

import time
from pathlib import Path

import numpy as np
import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    return load_script("bench/planner.py")


bench = load_bench()
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def write(tmp_path: Path, rows: list[str], prefix: str = "") -> Path:
    path = tmp_path / "t.csv"
    path.write_text(prefix + "\n".join([HEADER, *rows]) + "\n", encoding="utf-8")
    return path


def test_a_byte_order_mark_does_not_hide_the_timestamp_column(tmp_path):
    path = write(tmp_path, ["2023-11-16 18:15:46.6805900,374,44", "2023-11-16 18:15:50.6805900,10,5"],
                 prefix="\ufeff")
    tr = bench.load_trace(path, 1, 0)
    assert tr.arrival_s.tolist() == pytest.approx([0.0, 4.0])
    assert tr.isl_tokens.tolist() == [374, 10] and tr.osl_tokens.tolist() == [44, 5]


def test_a_short_row_is_named_not_an_attribute_error(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("ContextTokens,GeneratedTokens,TIMESTAMP\n10,2\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"t.csv:2: TIMESTAMP ''"):
        bench.load_trace(path, 1, 0)


def test_utc_offsets_are_honoured_not_cut_off(tmp_path):
    # 18:15:46 UTC and 23:15:50+05:00 (= 18:15:50 UTC) are 4 s apart, not 5 h
    path = write(tmp_path, ["2023-11-16 18:15:46.680590+00:00,374,44", "2023-11-16 23:15:50.680590+05:00,374,44"])
    assert bench.load_trace(path, 1, 0).arrival_s.tolist() == pytest.approx([0.0, 4.0])


def test_long_fractions_keep_microseconds_and_z_means_utc(tmp_path):
    path = write(tmp_path, ["2023-11-16T18:15:46.000000100Z,1,1", "2023-11-16 18:15:46.2500009Z,1,1"])
    assert bench.load_trace(path, 1, 0).arrival_s.tolist() == pytest.approx([0.0, 0.25], abs=2e-6)


@pytest.fixture
def new_york_time():
    if not hasattr(time, "tzset"):
        pytest.skip("time.tzset is POSIX only")
    mp = pytest.MonkeyPatch()
    mp.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    mp.undo()
    time.tzset()


def test_naive_timestamps_are_utc_whatever_the_host_time_zone(tmp_path, new_york_time):
    # 2024-03-10 02:00 is a DST jump in New York: read as local time these rows would be 2 min apart
    path = write(tmp_path, ["2024-03-10 01:59:00,100,10", "2024-03-10 03:01:00,100,10"])
    assert bench.load_trace(path, 1, 0).arrival_s.tolist() == pytest.approx([0.0, 3720.0])


@pytest.mark.parametrize(
    "row, needle",
    [
        ("2023-11-16 18:15:50,99999999999999999999,44", r":3: a length beyond 2\*\*63"),
        ("2023-11-16 18:15:50,10000001,44", r"over 10,000,000 .* request 2: input 10000001"),
        ("2023-11-16 18:15:50,374,10000001", r"over 10,000,000 .* request 2: input 374, output 10000001"),
        ("2023-11-16 18:15:50,-5,44", r":3: ContextTokens must be a whole number of tokens >= 0, got '-5'"),
        ("2023-11-16 18:15:50,374,1.5", r":3: GeneratedTokens must be a whole number"),
        ("1700158550.68,374,44", r":3: TIMESTAMP '1700158550.68' is not a date-time"),
    ],
)
def test_bad_rows_are_refused_naming_the_line_and_column(tmp_path, row, needle):
    path = write(tmp_path, ["2023-11-16 18:15:46,374,44", row])
    with pytest.raises(SystemExit, match=needle):
        bench.load_trace(path, 1, 0)


def test_a_request_without_a_prompt_is_left_out_and_one_without_output_decodes_once(tmp_path):
    path = write(tmp_path, ["2023-11-16 18:15:46,374,44", "2023-11-16 18:15:47,0,44", "2023-11-16 18:15:48,20,0"])
    tr = bench.load_trace(path, 1, 0)
    assert tr.isl_tokens.tolist() == [374, 20] and tr.osl_tokens.tolist() == [44, 1]
    assert tr.arrival_s.tolist() == pytest.approx([0.0, 2.0])


def test_a_burstgpt_trace_is_read_in_seconds(tmp_path):
    # BurstGPT's columns; a failed request has 0 response tokens; rows need not be in time order
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,472,18,490,Conversation log\n"
                    "45.5,GPT-4,1087,0,1087,API log\n"
                    "12,ChatGPT,30,230,260,Conversation log\n", encoding="utf-8")
    tr = bench.load_trace(path, 1, 0)
    assert tr.arrival_s.tolist() == pytest.approx([0.0, 7.0, 40.5])
    assert tr.isl_tokens.tolist() == [472, 30, 1087] and tr.osl_tokens.tolist() == [18, 230, 1]
    path.write_text("Timestamp,Request tokens,Response tokens\n5,1,1\nsoon,1,1\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"burst.csv:3: Timestamp must be a number of seconds, got 'soon'"):
        bench.load_trace(path, 1, 0)


def test_a_window_replays_that_span_of_a_long_trace(tmp_path):
    path = tmp_path / "burst.csv"
    rows = [f"{t},{100 + t},10" for t in range(0, 7200, 600)]  # one request every 10 min for 2 h
    path.write_text("Timestamp,Request tokens,Response tokens\n" + "\n".join(rows) + "\n", encoding="utf-8")
    tr = bench.load_trace(path, 1, 0, start_s=3600.0, duration_s=1800.0)
    assert tr.isl_tokens.tolist() == [3700, 4300, 4900] and tr.arrival_s.tolist() == pytest.approx([0, 600, 1200])
    assert len(bench.load_trace(path, 1, 0, start_s=3600.0)) == 6
    with pytest.raises(SystemExit, match=r"no request with a prompt in \[8000, 9000\) s \(the trace spans 6600 s"):
        bench.load_trace(path, 1, 0, start_s=8000.0, duration_s=1000.0)


def test_the_json_line_names_the_window_it_replayed(tmp_path, capsys):
    path = tmp_path / "burst.csv"
    rows = [f"{t},{200 + t % 7},20" for t in range(0, 1800, 2)]
    path.write_text("Timestamp,Request tokens,Response tokens\n" + "\n".join(rows) + "\n", encoding="utf-8")
    argv = ["--trace", str(path), "--rate-scale", "1", "--planners", "static_peak", "--model", "Llama-3.1-8B",
            "--prefill-tp", "1", "--decode-tp", "1"]
    whole = bench.main(argv)
    part = bench.main(argv + ["--trace-start-s", "600", "--trace-duration-s", "600"])
    capsys.readouterr()
    assert "trace_window_s" not in whole and part["trace_window_s"] == [600.0, 600.0]
    assert (whole["num_requests"], part["num_requests"]) == (900, 300)


def test_a_folder_of_traffic_logs_is_one_trace_and_a_trace_without_times_is_refused(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    t0 = 1_765_000_000_000  # Unix ms, as the runtime's --traffic-log writes them (one file per replica)
    (logs / "a.jsonl").write_text(f'{{"timestamp": {t0}, "input_length": 10, "output_length": 2}}\n'
                                  f'{{"timestamp": {t0 + 3000}, "input_length": 30, "output_length": 2}}\n')
    (logs / "b.jsonl").write_text(f'{{"timestamp": {t0 + 1500}, "input_length": 20, "output_length": 2}}\n')
    tr = bench.load_trace(logs, 1, 0)
    assert tr.isl_tokens.tolist() == [10, 20, 30] and tr.arrival_s.tolist() == pytest.approx([0.0, 1.5, 3.0])
    untimed = tmp_path / "u.jsonl"
    untimed.write_text('{"input_length": 10, "output_length": 2}\n')
    with pytest.raises(SystemExit, match="no usable arrival times"):
        bench.load_trace(untimed, 1, 0)
    with pytest.raises(SystemExit, match="no such trace file"):
        bench.load_trace(tmp_path / "missing.csv", 1, 0)


def test_an_azure_format_trace_loads_without_clamping(azure_trace):
    from tests.conftest import AZURE_ROWS

    tr = bench.load_trace(azure_trace, 1, 0)
    assert len(tr.arrival_s) == len(AZURE_ROWS) and tr.arrival_s[0] == 0.0 and np.all(np.diff(tr.arrival_s) >= 0)
    assert list(tr.isl_tokens) == [r.isl for r in AZURE_ROWS]
    assert tr.isl_tokens.min() >= 1 and tr.osl_tokens.min() >= 1


@pytest.mark.parametrize(
    "flag, value",
    [("--worker-start-s", "nan"), ("--worker-start-s", "inf"), ("--interval-s", "inf"),
     ("--ttft-s", "inf"), ("--itl-s", "inf"), ("--trace-start-s", "inf"), ("--trace-start-s", "-1"),
     ("--trace-duration-s", "nan"), ("--trace-duration-s", "0")],
)
def test_non_finite_numbers_are_refused_before_any_work(tmp_path, capsys, flag, value):
    path = write(tmp_path, ["2023-11-16 18:15:46,374,44", "2023-11-16 18:15:50,374,44"])
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        bench.main(["--trace", str(path), flag, value, "--planners", "static_peak"])
    assert exc.value.code == 2
    assert f"{flag} must be a finite number" in capsys.readouterr().err
    assert time.monotonic() - t0 < 5
