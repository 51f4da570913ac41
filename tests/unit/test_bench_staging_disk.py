"""bench/staging.py's destination-disk probe: a real write, measured, cleaned up, also where O_DIRECT is refused."""

from __future__ import annotations

import os

import pytest

from tests.scripts import load_script


def test_durable_write_rate_is_measured_and_leaves_no_file(tmp_path):
    bench = load_script("bench/staging.py")
    rate = bench.durable_write_mb_s(tmp_path, size_mb=8, block_mib=1)
    assert rate > 0 and rate == rate  # a real, finite rate
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_durable_write_falls_back_to_buffered_writes_where_o_direct_is_refused(tmp_path, monkeypatch):
    bench = load_script("bench/staging.py")
    real_open, seen = os.open, []

    def open_refusing_direct(path, flags, *a):
        seen.append(flags)
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")  # what tmpfs answers
        return real_open(path, flags, *a)

    monkeypatch.setattr(bench.os, "open", open_refusing_direct)
    assert bench.durable_write_mb_s(tmp_path, size_mb=2, block_mib=1) > 0
    if hasattr(os, "O_DIRECT"):
        assert len(seen) == 2 and not seen[1] & os.O_DIRECT
    assert list(tmp_path.iterdir()) == []


def test_durable_write_probe_removes_its_file_when_a_write_fails(tmp_path, monkeypatch):
    bench = load_script("bench/staging.py")

    def failing_write(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench.os, "write", failing_write)
    with pytest.raises(OSError, match="No space"):
        bench.durable_write_mb_s(tmp_path, size_mb=2, block_mib=1)
    assert list(tmp_path.iterdir()) == []
