"""Specification of the transfer engine's O_DIRECT writes: a direct write the filesystem refuses
(EINVAL: here an unaligned buffer address) lands through the page cache instead and turns direct I/O
off for that file; the bytes on disk are right either way."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from runtime.staging.sources import SourceObject
from runtime.staging.transfer import TransferEngine, _FileState


class _AlignedSource:
    uri, retryable, aligned_chunks = "test://", (), True


def _direct_fd(path: Path) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        pytest.skip(f"{path.parent}: no O_DIRECT on this filesystem")


def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "f.pdserve-part"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 3 * 4096)
    eng = TransferEngine(_AlignedSource(), tmp_path, fsync=False)  # type: ignore[arg-type]
    assert eng.direct_io
    fs = _FileState(SourceObject(key="f", rel="f", size_bytes=3 * 4096, etag="e"), path, tmp_path / "f", None, 1,
                    3 * 4096, fd=fd, dfd=_direct_fd(path))
    buf = memoryview(mmap.mmap(-1, 3 * 4096 + 4096))
    buf[: 3 * 4096] = os.urandom(3 * 4096)
    eng._write_direct(fs, buf[:4096], 0)  # page-aligned buffer and offset: written directly
    assert fs.direct
    unaligned = buf[1 : 4096 + 1]  # an address O_DIRECT refuses
    eng._write_direct(fs, unaligned, 4096)
    assert not fs.direct and fs.dfd >= 0  # off for this file; the descriptor is closed by _finish
    os.close(fs.dfd)
    os.close(fd)
    assert path.read_bytes()[: 2 * 4096] == bytes(buf[:4096]) + bytes(unaligned)


def test_direct_io_is_off_for_sources_without_aligned_buffers(tmp_path: Path) -> None:
    class Plain(_AlignedSource):
        aligned_chunks = False

    assert not TransferEngine(Plain(), tmp_path).direct_io  # type: ignore[arg-type]
    assert not TransferEngine(_AlignedSource(), tmp_path, direct_io=False).direct_io  # type: ignore[arg-type]
