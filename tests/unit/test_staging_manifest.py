"""Specification: a staged folder is valid only with a marker whose manifest matches the files;
`verify_staged` names the broken field or file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from runtime.staging.manifest import (
    MARKER_NAME,
    Manifest,
    ManifestEntry,
    StagingError,
    read_marker,
    verify_staged,
    write_marker,
)


def _folder(tmp_path: Path) -> tuple[Path, Manifest]:
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    files = {"config.json": b'{"hidden_size": 8}', "sub/model.safetensors": bytes(range(256)) * 40}
    entries = []
    for rel, data in files.items():
        (folder / rel).write_bytes(data)
        entries.append(
            ManifestEntry(key=f"p/{rel}", path=rel, size_bytes=len(data), etag="e", sha256=hashlib.sha256(data).hexdigest())
        )
    m = Manifest(source="s3://b/p/", files=entries)
    write_marker(folder, m)
    return folder, m


def test_valid_folder_round_trips(tmp_path: Path) -> None:
    folder, m = _folder(tmp_path)
    got = verify_staged(folder)
    assert got.files == m.files
    assert got.total_bytes == len(b'{"hidden_size": 8}') + 256 * 40
    assert not (folder / (MARKER_NAME + ".tmp")).exists()


def test_folder_without_marker_is_refused(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path)
    (folder / MARKER_NAME).unlink()
    with pytest.raises(StagingError, match="no .pdserve-staged.json marker"):
        verify_staged(folder)


def test_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StagingError, match="does not exist"):
        verify_staged(tmp_path / "nope")


def test_corrupted_byte_is_detected_naming_the_file(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path)
    p = folder / "sub/model.safetensors"
    data = bytearray(p.read_bytes())
    data[1234] ^= 0xFF
    p.write_bytes(bytes(data))
    assert verify_staged(folder, check_digests=False)  # same size: the quick check passes
    with pytest.raises(StagingError, match="sub/model.safetensors.*corrupted"):
        verify_staged(folder)


def test_truncated_and_missing_files_are_detected(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path)
    (folder / "config.json").write_bytes(b"{}")
    with pytest.raises(StagingError, match="'config.json' has 2 bytes"):
        verify_staged(folder, check_digests=False)
    (folder / "config.json").unlink()
    with pytest.raises(StagingError, match="'config.json'.*missing"):
        verify_staged(folder)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["files"][0].update(sha256="xyz"), "files.0.sha256"),
        (lambda d: d["files"][1].update(size_bytes=-1), "files.1.size_bytes"),
        (lambda d: d["files"][0].update(path="../x"), "files.0.path"),
        (lambda d: d["files"][0].pop("etag"), "files.0.etag"),
        (lambda d: d.pop("source"), "source"),
        (lambda d: d.update(extra=1), "extra"),
    ],
)
def test_broken_manifest_names_the_failing_field(tmp_path: Path, mutate, field: str) -> None:  # noqa: ANN001
    folder, _ = _folder(tmp_path)
    raw = json.loads((folder / MARKER_NAME).read_text())
    mutate(raw)
    (folder / MARKER_NAME).write_text(json.dumps(raw))
    with pytest.raises(StagingError, match=f"invalid manifest field '{field}'"):
        read_marker(folder)


def test_unparseable_marker_is_refused(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path)
    (folder / MARKER_NAME).write_text('{"version": 1, "files": [')
    with pytest.raises(StagingError, match="unreadable marker"):
        verify_staged(folder)
