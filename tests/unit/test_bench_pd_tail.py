"""bench/pd_tail.py helpers: nearest-rank tail quantiles and the vLLM lease-log counters."""

from __future__ import annotations

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/pd_tail.py")


def test_quantiles_are_nearest_rank_and_keep_the_tail(bench):
    xs = [1.0] * 196 + [20.0, 30.0, 40.0, 50.0]  # 200 requests, four slow ones: p99 = the 198th value
    q = bench.quantiles(xs)
    assert q == {"p50": 1.0, "p90": 1.0, "p99": 30.0, "max": 50.0}
    assert bench.quantiles([3.0, 1.0, 2.0]) == {"p50": 2.0, "p90": 3.0, "p99": 3.0, "max": 3.0}


def test_lease_events_are_counted_only_after_the_offset(bench, tmp_path):
    log = tmp_path / "prefill.log"
    old = f"(Worker) WARNING {bench.LEASE_EXPIRED} for request a\n"
    log.write_text(old)
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write(f"(Worker) WARNING {bench.LEASE_EXPIRED} for request b\n")
        f.write(f"(Worker) ERROR {bench.READ_AFTER_EXPIRY} for unrecognized request b were retrieved\n")
        f.write("(APIServer) INFO unrelated\n")
    assert bench.count_lines(log, offset, bench.LEASE_EXPIRED) == 1
    assert bench.count_lines(log, 0, bench.LEASE_EXPIRED) == 2
    assert bench.count_lines(log, offset, bench.READ_AFTER_EXPIRY) == 1
