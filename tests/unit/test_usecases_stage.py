"""The stage use case publishes only under <fsx_root>/models: a bad model_name is refused before anything is written."""

from __future__ import annotations

import pytest

from runtime.staging.layout import staged_model_dir
from runtime.usecases.stage import StageRequest, stage


@pytest.mark.parametrize("name", ["../escape", "/abs/x", "", "a/../b", "a//b", ".", "a\\b", "a\x00b", "org/.."])
def test_stage_refuses_an_unsafe_model_name_before_writing(tmp_path, name):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    fsx = tmp_path / "fsx"
    fsx.mkdir()
    with pytest.raises(ValueError, match="model_name"):
        stage(StageRequest(source_uri=str(src), fsx_root=str(fsx), model_name=name))
    assert list(fsx.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["fsx", "src"]


def test_staged_model_dir_keeps_clean_relative_names(tmp_path):
    assert staged_model_dir(tmp_path, "llama8") == tmp_path / "models" / "llama8"
    assert staged_model_dir(tmp_path, "org/llama8") == tmp_path / "models" / "org" / "llama8"
