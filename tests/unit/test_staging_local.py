"""Specification of `stage_model` on a local-folder source (same engine as S3, no server needed):
publish with a marker, idempotent re-runs, changed files re-fetched, clear errors that leave the
destination untouched, the per-model lock, and crash recovery between the publish renames."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from runtime.staging.manifest import MARKER_NAME, StagingError, verify_staged
from runtime.staging.publish import StageLock, recover, sibling
from runtime.staging.stage import Stager, StageOptions, stage_model
from runtime.staging.keys import select_paths


@pytest.fixture
def src(tmp_path: Path) -> Path:
    d = tmp_path / "src"
    (d / "original").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (d / "model.safetensors").write_bytes(os.urandom(300_000))
    (d / "pytorch_model.bin").write_bytes(os.urandom(1000))
    (d / "tokenizer.json").write_text("{}")
    (d / "README.md").write_text("hi")
    (d / "original" / "params.json").write_text("{}")
    return d


def _stage(src: Path, dest: Path, **kw) -> object:  # noqa: ANN003
    opts = StageOptions(part_size_bytes=64 * 1024, concurrency=4, **kw)
    return Stager(str(src), dest, options=opts).run()


def test_stages_default_selection_with_marker_and_hashes(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "fsx" / "models" / "m"
    m = stage_model(str(src), dest, progress=False, part_size_bytes=64 * 1024)
    assert [f.path for f in m.files] == ["config.json", "model.safetensors", "tokenizer.json"]
    for f in m.files:
        assert f.sha256 == hashlib.sha256((src / f.path).read_bytes()).hexdigest()
        assert (dest / f.path).read_bytes() == (src / f.path).read_bytes()
    assert verify_staged(dest) == m
    # only the model files and the marker: no journals, partial files or staging folders left
    assert sorted(p.name for p in dest.iterdir()) == sorted([MARKER_NAME, "config.json", "model.safetensors", "tokenizer.json"])
    assert not sibling(dest, "staging").exists()


def test_rerun_on_unchanged_source_does_nothing(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    first = _stage(src, dest)
    inode = (dest / "model.safetensors").stat().st_ino
    again = _stage(src, dest)
    assert again.unchanged and again.transfer.bytes_downloaded == 0
    assert again.manifest == first.manifest
    assert (dest / "model.safetensors").stat().st_ino == inode


def test_changed_file_is_refetched_and_unchanged_files_are_linked(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    _stage(src, dest)
    inode = (dest / "model.safetensors").stat().st_ino
    (src / "config.json").write_text(json.dumps({"hidden_size": 128}))
    res = _stage(src, dest)
    assert not res.unchanged
    assert res.files_linked == 2 and res.transfer.files_fetched == 1
    assert json.loads((dest / "config.json").read_text()) == {"hidden_size": 128}
    assert (dest / "model.safetensors").stat().st_ino == inode  # hard link, not a copy
    verify_staged(dest)
    assert not sibling(dest, "old").exists() and not sibling(dest, "staging").exists()


def test_include_everything_and_exclude(src: Path, tmp_path: Path) -> None:
    res = _stage(src, tmp_path / "m", include=["*"], exclude=["*.md"], prefer_safetensors=False)
    assert [f.path for f in res.manifest.files] == [
        "config.json", "model.safetensors", "original/params.json", "pytorch_model.bin", "tokenizer.json",
    ]


@pytest.mark.parametrize(
    ("setup", "kwargs", "message"),
    [
        (lambda s: [p.unlink() for p in s.rglob("*") if p.is_file()], {}, "holds no files"),
        (lambda s: None, {"include": ["*.gguf"]}, "no file matches include"),
        (lambda s: None, {"free_space_margin_bytes": 1 << 60}, "not enough free space"),
        (lambda s: None, {"concurency": 3}, "stage option 'concurency'"),
        (lambda s: None, {"part_size_bytes": 10}, "stage option 'part_size_bytes'"),
    ],
)
def test_bad_input_gives_a_clear_error_and_writes_nothing(src: Path, tmp_path: Path, setup, kwargs, message) -> None:  # noqa: ANN001
    setup(src)
    dest = tmp_path / "fsx" / "m"
    with pytest.raises(StagingError, match=message):
        stage_model(str(src), dest, progress=False, **kwargs)
    assert not dest.exists()


def test_missing_source_folder(tmp_path: Path) -> None:
    with pytest.raises(StagingError, match="does not exist"):
        stage_model(str(tmp_path / "nope"), tmp_path / "m", progress=False)
    with pytest.raises(StagingError, match="unsupported scheme"):
        stage_model("gs://bucket/x", tmp_path / "m", progress=False)


def test_failed_restage_keeps_the_published_version(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    first = _stage(src, dest)
    (src / "config.json").write_text("{}")
    with pytest.raises(StagingError, match="free space"):
        _stage(src, dest, free_space_margin_bytes=1 << 60)
    assert verify_staged(dest) == first.manifest


def test_second_stager_waits_for_the_lock_then_times_out(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    with StageLock(dest):
        with pytest.raises(StagingError, match="another stager holds the lock"):
            _stage(src, dest, lock_timeout_s=0.3)
    assert not dest.exists()
    assert _stage(src, dest).manifest.files  # lock released: works


def test_crash_between_publish_renames_is_recovered(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    first = _stage(src, dest)
    os.rename(dest, sibling(dest, "old"))  # state after "dest → old" and before "staging → dest"
    recover(dest)
    assert verify_staged(dest) == first.manifest
    assert not sibling(dest, "old").exists()


def test_existing_unmarked_destination_is_never_replaced(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "precious.txt").write_text("user data")
    with pytest.raises(StagingError, match="not a pdserve-staged folder"):
        _stage(src, dest)
    assert (dest / "precious.txt").read_text() == "user data"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert verify_staged(_stage(src, empty).path)


def test_recheck_sha256_refetches_a_rotted_published_file(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    _stage(src, dest)
    p = dest / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    os.unlink(p)  # published files may be hard links shared with nothing else; write a new inode
    p.write_bytes(bytes(data))
    assert _stage(src, dest).unchanged  # size + ETag only: rot unnoticed
    res = _stage(src, dest, recheck_sha256=True)
    assert not res.unchanged and res.transfer.files_fetched == 1 and res.files_linked == 2
    assert p.read_bytes() == (src / "model.safetensors").read_bytes()
    verify_staged(dest)


def test_a_symlinked_destination_is_refused_and_its_target_untouched(src: Path, tmp_path: Path) -> None:
    real = tmp_path / "fsx" / "a"
    first = _stage(src, real)
    link = tmp_path / "fsx" / "link"
    link.symlink_to(real)
    with pytest.raises(StagingError, match="symbolic link"):
        _stage(src, link)
    assert verify_staged(real).files == first.manifest.files and link.is_symlink()
    staging_link = tmp_path / "fsx" / ".b.pdserve-staging"
    staging_link.symlink_to(real)  # a planted staging folder must not redirect the writes either
    with pytest.raises(StagingError, match="symbolic link"):
        _stage(src, tmp_path / "fsx" / "b")
    assert verify_staged(real).files == first.manifest.files


def test_a_destination_below_a_file_is_a_named_error(src: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StagingError, match="is a file, not a folder"):
        _stage(src, tmp_path / "afile" / "sub" / "m")


def test_a_truncated_published_file_is_fetched_again_not_linked_into_the_next_version(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    _stage(src, dest)
    p = dest / "model.safetensors"
    data = p.read_bytes()
    os.unlink(p)
    p.write_bytes(data[:5000])  # truncated in place (a full disk, a copy cut short)
    (src / "config.json").write_text(json.dumps({"hidden_size": 128}))  # and another file changed
    res = _stage(src, dest)
    assert res.transfer.files_fetched == 2 and res.files_linked == 1
    assert p.read_bytes() == (src / "model.safetensors").read_bytes()
    verify_staged(dest)
    os.unlink(p)
    p.write_bytes(data[:5000])  # nothing else changed: the rerun is no "unchanged" either
    res = _stage(src, dest)
    assert not res.unchanged and res.transfer.files_fetched == 1
    verify_staged(dest)


def test_the_clis_offer_the_published_files_recheck():
    from typer.testing import CliRunner

    from runtime.cli import app
    from runtime.staging.__main__ import _options, build_parser

    args = build_parser().parse_args(["SRC", "DEST", "--recheck-sha256"])
    assert _options(args)["recheck_sha256"] is True
    res = CliRunner().invoke(app, ["stage", "--help"], env={"COLUMNS": "200"})
    assert "--recheck-sha256" in res.output


def test_a_folder_without_weights_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """The default selection is a servable model: a folder of config and tokenizer only (or weights in a format
    vLLM does not load) would pass tune and promote and fail only when vLLM starts on the GPU nodes."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.gguf").write_bytes(b"\0" * 16)
    with pytest.raises(StagingError, match=r"no weight file \(\*\.safetensors.*found: config\.json, model\.gguf"):
        stage_model(str(src), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    # an explicit selection is the operator's: staged as asked
    assert stage_model(str(src), tmp_path / "out", progress=False, include=["config.json"]).by_path()


def test_metas_original_checkpoint_beside_safetensors_is_left_out() -> None:
    """Meta's Hub repos hold the weights twice: safetensors at the top and Meta's own format in original/."""
    keys = ["config.json", "model-00001-of-00002.safetensors", "original/consolidated.00.pth",
            "original/params.json", "draft/pytorch_model.bin"]
    chosen = select_paths(keys)
    assert "original/consolidated.00.pth" not in chosen
    assert "draft/pytorch_model.bin" in chosen  # another model's weights (a draft, an adapter) are kept
    assert select_paths(["original/consolidated.00.pth", "config.json"]) == ["config.json",
                                                                              "original/consolidated.00.pth"]
