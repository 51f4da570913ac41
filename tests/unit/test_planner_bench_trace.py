"""bench/planner.py: reading Azure-format traces (load_azure_trace) and the up-front argument checks."""

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
    tr = bench.load_azure_trace(path, 1, 0)
    assert tr.arrival_s.tolist() == pytest.approx([0.0, 4.0])
    assert tr.isl_tokens.tolist() == [374, 10] and tr.osl_tokens.tolist() == [44, 5]


def test_a_short_row_is_named_not_an_attribute_error(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("ContextTokens,GeneratedTokens,TIMESTAMP\n10,2\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"t.csv:2: bad row"):
        bench.load_azure_trace(path, 1, 0)


def test_utc_offsets_are_honoured_not_cut_off(tmp_path):
    # 18:15:46 UTC and 23:15:50+05:00 (= 18:15:50 UTC) are 4 s apart, not 5 h
    path = write(tmp_path, ["2023-11-16 18:15:46.680590+00:00,374,44", "2023-11-16 23:15:50.680590+05:00,374,44"])
    assert bench.load_azure_trace(path, 1, 0).arrival_s.tolist() == pytest.approx([0.0, 4.0])


def test_long_fractions_keep_microseconds_and_z_means_utc(tmp_path):
    path = write(tmp_path, ["2023-11-16T18:15:46.000000100Z,1,1", "2023-11-16 18:15:46.2500009,1,1"])
    assert bench.load_azure_trace(path, 1, 0).arrival_s.tolist() == pytest.approx([0.0, 0.25], abs=2e-6)


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
    assert bench.load_azure_trace(path, 1, 0).arrival_s.tolist() == pytest.approx([0.0, 3720.0])


@pytest.mark.parametrize(
    "row, needle",
    [
        ("2023-11-16 18:15:50,99999999999999999999,44", r":3: ContextTokens must be in \[1, 10000000\]"),
        ("2023-11-16 18:15:50,374,10000001", r":3: GeneratedTokens must be in \[1, 10000000\]"),
        ("2023-11-16 18:15:50,0,44", r":3: ContextTokens must be in \[1, "),
        ("2023-11-16 18:15:50,374,0", r":3: GeneratedTokens must be in \[1, "),
        ("2023-11-16 18:15:50,-5,44", r":3: ContextTokens must be in \[1, "),
        ("1700158550.68,374,44", r":3: bad row"),
    ],
)
def test_bad_rows_are_refused_naming_the_line_and_column(tmp_path, row, needle):
    path = write(tmp_path, ["2023-11-16 18:15:46,374,44", row])
    with pytest.raises(SystemExit, match=needle):
        bench.load_azure_trace(path, 1, 0)


def test_an_azure_format_trace_loads_without_clamping(azure_trace):
    from tests.conftest import AZURE_ROWS

    tr = bench.load_azure_trace(azure_trace, 1, 0)
    assert len(tr.arrival_s) == len(AZURE_ROWS) and tr.arrival_s[0] == 0.0 and np.all(np.diff(tr.arrival_s) >= 0)
    assert list(tr.isl_tokens) == [r.isl for r in AZURE_ROWS]
    assert tr.isl_tokens.min() >= 1 and tr.osl_tokens.min() >= 1


@pytest.mark.parametrize(
    "flag, value",
    [("--worker-start-s", "nan"), ("--worker-start-s", "inf"), ("--interval-s", "inf"),
     ("--ttft-s", "inf"), ("--itl-s", "inf")],
)
def test_non_finite_numbers_are_refused_before_any_work(tmp_path, capsys, flag, value):
    path = write(tmp_path, ["2023-11-16 18:15:46,374,44", "2023-11-16 18:15:50,374,44"])
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        bench.main(["--trace", str(path), flag, value, "--planners", "static_peak"])
    assert exc.value.code == 2
    assert f"{flag} must be a finite number, got {value}" in capsys.readouterr().err
    assert time.monotonic() - t0 < 5
