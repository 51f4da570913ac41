"""Specification of the stager's edge cases found by adversarial testing: local files
told apart by content identity, not size + mtime; a local file rewritten while it is copied is
refused; names the stager cannot write and file/folder clashes are refused before any byte moves;
the safetensors preference is per folder; a staged folder can be a source; a file whose bytes fail
the check is fetched once more; a second stager is told it waits."""

from __future__ import annotations

import base64
import logging
import os
import re
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

import runtime.staging.stage as stage_mod
from runtime.staging.keys import check_paths, select_paths
from runtime.staging.manifest import MARKER_NAME, StagingError, read_marker, verify_staged
from runtime.staging.publish import StageLock, sibling
from runtime.staging.sources import LocalSource, SourceObject
from runtime.staging.stage import Stager, StageOptions, stage_model
from runtime.staging.transfer import TransferEngine


def _folder(root: Path, fill: bytes, mtime_ns: int = 315_532_800 * 10**9) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 64}')
    (root / "model.safetensors").write_bytes(fill * 4096)
    for p in root.iterdir():
        os.utime(p, ns=(mtime_ns, mtime_ns))  # timestamps normalised, as tar / image builds leave them
    return root


def test_same_size_and_mtime_from_another_folder_is_fetched_not_linked(tmp_path: Path) -> None:
    la, lb = _folder(tmp_path / "la", b"A"), _folder(tmp_path / "lb", b"B")
    dest = tmp_path / "m"
    stage_model(str(la), dest, progress=False)
    res = Stager(str(lb), dest).run()
    assert res.files_linked == 0
    assert (dest / "model.safetensors").read_bytes() == b"B" * 4096
    verify_staged(dest, check_digests=True)


def test_rewrite_in_place_with_restored_mtime_is_fetched_again(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src", b"A")
    dest = tmp_path / "m"
    stage_model(str(src), dest, progress=False)
    w = src / "model.safetensors"
    st = w.stat()
    w.write_bytes(b"C" * 4096)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = Stager(str(src), dest).run()
    assert not res.unchanged
    assert (dest / "model.safetensors").read_bytes() == b"C" * 4096


class _ChangingSource(LocalSource):
    """Calls `change(path)` on the weights file after its first chunk was read (a writer still at work, or
    a metadata-only change such as a Lustre HSM restore)."""

    def __init__(self, uri: str, change) -> None:  # noqa: ANN001
        super().__init__(uri)
        self.change = change

    def read_range(self, obj, start, end, chunk_bytes):  # noqa: ANN001, ANN201
        for i, b in enumerate(super().read_range(obj, start, end, chunk_bytes)):
            yield b
            if i == 0 and obj.rel == "model.safetensors":
                self.change(self.root / obj.key)


def _stage_while_changing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change) -> Path:  # noqa: ANN001
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"A" * (1 << 20))
    monkeypatch.setattr(stage_mod, "open_source", lambda uri, *a: _ChangingSource(uri, change))
    dest = tmp_path / "m"
    Stager(str(src), dest, options=StageOptions(read_chunk_bytes=64 << 10, concurrency=1)).run()
    return dest


def test_local_file_rewritten_during_copy_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dest = tmp_path / "src", tmp_path / "m"
    with pytest.raises(StagingError, match="'model.safetensors' changed while staging"):
        _stage_while_changing(tmp_path, monkeypatch, lambda p: p.write_bytes(b"B" * p.stat().st_size))
    assert not dest.exists()
    monkeypatch.undo()
    stage_model(str(src), dest, progress=False)  # the next run stages the new version, whole
    assert (dest / "model.safetensors").read_bytes() == b"B" * (1 << 20)


def test_names_over_name_max_and_file_folder_clashes_fail_before_fetching(tmp_path: Path) -> None:
    check_paths(["a/b", "c", "x" * 242])
    with pytest.raises(StagingError, match=r"is 243 bytes.*limited to 242 bytes"):
        check_paths(["x" * 243])
    with pytest.raises(StagingError, match="'a' is both a file and a folder"):
        check_paths(["a", "a/b"])
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / ("L" * 243 + ".safetensors")).write_bytes(b"x")
    with pytest.raises(StagingError, match="limited to 242 bytes"):
        stage_model(str(src), tmp_path / "m", progress=False)
    assert not sibling(tmp_path / "m", "staging").exists()
    with pytest.raises(StagingError, match="too long"):
        stage_model(str(tmp_path / "src"), tmp_path / ("D" * 240), progress=False)


def test_a_local_file_name_that_is_not_utf8_is_a_named_error(tmp_path: Path) -> None:
    """Linux names are bytes: one that is not UTF-8 (here 0xff) cannot go into the manifest; the error names
    it (repr-escaped) before anything is written, for the stager and for the transfer engine alone."""
    src = _folder(tmp_path / "src", b"A")
    with open(os.path.join(os.fsencode(src), b"tokenizer\xff.json"), "wb") as f:
        f.write(b"{}")
    name = repr("tokenizer\udcff.json")
    with pytest.raises(StagingError, match=re.escape(f"file name {name} is not valid UTF-8")):
        stage_model(str(src), tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists() and not sibling(tmp_path / "m", "staging").exists()
    with pytest.raises(StagingError, match=re.escape(name)):
        check_paths(["config.json", "tokenizer\udcff.json"])
    source = LocalSource(str(src))
    with pytest.raises(StagingError, match=re.escape(name)):
        TransferEngine(source, tmp_path / "t").fetch(source.list_objects())
    assert stage_model(str(src), tmp_path / "m", progress=False, exclude=["tokenizer*"]).files  # left out: fine


def test_filesystem_root_is_not_a_destination(tmp_path: Path) -> None:
    with pytest.raises(StagingError, match="not a filesystem root"):
        Stager(str(tmp_path), Path("/")).run()


def test_prefer_safetensors_drops_pytorch_weights_only_beside_safetensors() -> None:
    paths = ["model.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json", "config.json",
             "eagle/pytorch_model.bin", "eagle/config.json"]
    assert select_paths(paths) == ["config.json", "eagle/config.json", "eagle/pytorch_model.bin",
                                   "model.safetensors"]
    assert "pytorch_model.bin" in select_paths(paths, prefer_safetensors=False)


def test_a_staged_folder_can_be_the_source(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src", b"A")
    first = tmp_path / "m1"
    stage_model(str(src), first, progress=False)
    second = tmp_path / "m2"
    m = stage_model(str(first), second, progress=False, include=["*"])
    assert sorted(f.path for f in m.files) == ["config.json", "model.safetensors"]  # not the old marker
    assert read_marker(second).source == str(first)
    assert (second / MARKER_NAME).is_file()


class _FlakySource(LocalSource):
    """Objects carry their true CRC32; the first `bad_reads` reads of the weights come back with one
    byte flipped (a flip in transit)."""

    def __init__(self, uri: str, bad_reads: int) -> None:
        super().__init__(uri)
        self.bad_reads = bad_reads
        self.reads = 0

    def list_objects(self) -> list[SourceObject]:
        out = []
        for o in super().list_objects():
            crc = zlib.crc32((self.root / o.key).read_bytes()).to_bytes(4, "big")
            out.append(replace(o, checksum_crc32=base64.b64encode(crc).decode()))
        return out

    def read_range(self, obj, start, end, chunk_bytes):  # noqa: ANN001, ANN201
        flip = obj.rel == "model.safetensors" and self.reads < self.bad_reads
        if obj.rel == "model.safetensors":
            self.reads += 1
        for i, b in enumerate(super().read_range(obj, start, end, chunk_bytes)):
            if flip and i == 0:
                b = bytes([b[0] ^ 1]) + bytes(b[1:])
            yield b


@pytest.mark.parametrize("bad_reads", [1, 2])
def test_a_file_failing_its_check_is_fetched_once_more(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture, bad_reads: int) -> None:
    src = _folder(tmp_path / "src", b"A")
    flaky = _FlakySource(str(src), bad_reads)
    monkeypatch.setattr(stage_mod, "open_source", lambda uri, *a: flaky)
    dest = tmp_path / "m"
    with caplog.at_level(logging.WARNING, logger="runtime.staging.transfer"):
        if bad_reads == 1:
            res = Stager(str(src), dest).run()
            assert res.transfer.files_refetched == 1
            assert (dest / "model.safetensors").read_bytes() == b"A" * 4096
            assert read_marker(dest).by_path()["model.safetensors"].verified_by == "checksum-crc32"
        else:  # wrong twice: the source itself is bad
            with pytest.raises(StagingError, match="mismatch"):
                Stager(str(src), dest).run()
            assert not dest.exists()
    assert flaky.reads == 2
    assert "fetching 'model.safetensors' again" in caplog.text


def test_a_second_stager_is_told_it_waits(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dest = tmp_path / "m"
    with StageLock(dest), caplog.at_level(logging.WARNING, logger="runtime.staging.publish"):
        with pytest.raises(StagingError, match="another stager holds the lock"):
            with StageLock(dest, timeout_s=0.3):
                pass
    assert "another stager is writing" in caplog.text and str(dest) in caplog.text


def test_verify_during_a_publish_reports_one_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.staging.manifest as manifest_mod

    v1, v2 = _folder(tmp_path / "v1", b"A"), tmp_path / "v2"
    v2.mkdir()
    (v2 / "config.json").write_text('{"hidden_size": 128, "num_layers": 2}')  # other sizes than v1
    (v2 / "model.safetensors").write_bytes(b"B" * 8192)
    dest = tmp_path / "m"
    stage_model(str(v1), dest, progress=False)
    real = manifest_mod.read_marker
    calls = []

    def marker_then_republish(folder: Path):  # noqa: ANN202 - a stager publishes v2 right after the marker is read
        m = real(folder)
        calls.append(m.source)
        if len(calls) == 1:
            stage_model(str(v2), dest, progress=False)
        return m

    monkeypatch.setattr(manifest_mod, "read_marker", marker_then_republish)
    m = verify_staged(dest, check_digests=True)
    assert calls == [str(v1), str(v2)] and m.source == str(v2)


def test_a_metadata_only_change_during_the_copy_is_not_a_rewrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = _stage_while_changing(tmp_path, monkeypatch, lambda p: os.chmod(p, 0o600))  # ctime only
    assert (dest / "model.safetensors").read_bytes() == b"A" * (1 << 20)
