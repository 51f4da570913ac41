"""`pdserve prepare-model DEST` replaces only an earlier conversion at DEST: a file or a folder of someone's data
there is refused untouched (exit 2), before the conversion runs (runtime.modelfiles.gguf_convert)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.modelfiles.gguf_convert import MARKER_NAME, ForeignDestinationError, _check_replaceable

runner = CliRunner()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_destination_holding_other_data_is_refused_untouched(kind, tmp_path):
    dest = tmp_path / "models"
    if kind == "file":
        dest.write_text("notes\n")
    else:
        dest.mkdir()
        (dest / "llama8").mkdir()
        (dest / "llama8" / "config.json").write_text("{}")
    res = runner.invoke(app, ["prepare-model", str(dest)], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: {dest} exists and is not a model folder this command built"), res.output
    if kind == "file":
        assert dest.read_text() == "notes\n"
    else:
        assert [p.name for p in dest.iterdir()] == ["llama8"] and (dest / "llama8" / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # no temporary folder left beside it


def test_nothing_an_empty_folder_or_an_earlier_build_may_be_replaced(tmp_path):
    _check_replaceable(tmp_path / "absent", "smollm2-from-gguf")
    (tmp_path / "empty").mkdir()
    _check_replaceable(tmp_path / "empty", "smollm2-from-gguf")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / MARKER_NAME).write_text(json.dumps({"kind": "smollm2-from-gguf", "source_size_bytes": 1}))
    (earlier / "model.safetensors").write_bytes(b"old")
    _check_replaceable(earlier, "smollm2-from-gguf")
    with pytest.raises(ForeignDestinationError):  # another builder's output is not this one's to replace
        _check_replaceable(earlier, "tiny-random-llama")
