"""A new version of a staged folder never silently deletes files the stager did not publish; a source one
level above the model is pointed out."""

from __future__ import annotations

import logging
import os

import pytest

from runtime.staging.manifest import StagingError, read_marker
from runtime.staging.stage import stage_model


def _model(root, extra=b""):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(b"w" * 4096 + extra)
    return root


def test_a_new_version_refuses_while_the_folder_holds_foreign_files_and_loses_nothing(tmp_path):
    src, dest = _model(tmp_path / "src"), tmp_path / "fsx" / "m"
    stage_model(str(src), dest, progress=False)
    (dest / "notes.txt").write_text("mine")
    (dest / "sub").mkdir()
    (dest / "sub" / "ft.safetensors").write_bytes(b"x")
    stage_model(str(src), dest, progress=False)  # unchanged source: nothing is published, nothing is lost
    assert (dest / "notes.txt").read_text() == "mine"

    _model(src, extra=b"v2")  # a changed shard: a new version would replace the folder
    with pytest.raises(StagingError, match=r"holds 2 file\(s\) or folder\(s\) the stager did not publish \(notes.txt, "
                                           r"sub/ft.safetensors\); .*move them out first"):
        stage_model(str(src), dest, progress=False)
    assert (dest / "notes.txt").read_text() == "mine" and (dest / "sub" / "ft.safetensors").exists()
    assert (dest / "model.safetensors").read_bytes() == b"w" * 4096  # the published version is intact

    (dest / "notes.txt").unlink()
    (dest / "sub" / "ft.safetensors").unlink()
    (dest / "sub").rmdir()  # an empty folder of the user's would vanish too: it is named until removed
    stage_model(str(src), dest, progress=False)
    assert (dest / "model.safetensors").read_bytes().endswith(b"v2")
    assert {f.path for f in read_marker(dest).files} == {"config.json", "model.safetensors"}


@pytest.mark.parametrize("kind", ["link_to_folder", "empty_folder", "link_to_file"])
def test_links_and_empty_folders_in_the_destination_are_named_too(tmp_path, kind):
    src, dest = _model(tmp_path / "src"), tmp_path / "fsx" / "m"
    stage_model(str(src), dest, progress=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "adapter.safetensors").write_bytes(b"a")
    if kind == "link_to_folder":
        (dest / "lora").symlink_to(elsewhere, target_is_directory=True)
    elif kind == "empty_folder":
        (dest / "lora").mkdir()
    else:
        (dest / "lora").symlink_to(elsewhere / "adapter.safetensors")
    _model(src, extra=b"v2")
    with pytest.raises(StagingError, match=r"did not publish \(lora/?\)"):
        stage_model(str(src), dest, progress=False)
    assert os.path.lexists(dest / "lora") and (elsewhere / "adapter.safetensors").exists()


def test_a_source_one_level_above_the_model_is_pointed_out(tmp_path, caplog):
    _model(tmp_path / "src" / "m")
    with caplog.at_level(logging.WARNING, logger="runtime.staging.stage"):
        stage_model(str(tmp_path / "src"), tmp_path / "out", progress=False)
    assert "no config.json at the top, but m/config.json" in caplog.text
    assert f"did you mean {tmp_path / 'src'}/m?" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runtime.staging.stage"):
        stage_model(str(tmp_path / "src" / "m"), tmp_path / "out2", progress=False)
    assert "config.json" not in caplog.text
