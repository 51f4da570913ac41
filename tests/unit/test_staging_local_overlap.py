"""A local-folder source and its destination must not overlap: the published copy and its marker would
land in what is copied (and the source could never be staged again: its marker is a reserved name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.staging.__main__ import main


def test_a_local_destination_inside_or_around_the_source_is_refused(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    for dest in (src / "out", src, tmp_path):
        assert main([str(src), str(dest), "--no-fsync"]) == 2  # a bad DEST: a usage error, as in `pdserve stage`
        assert "overlaps the source folder" in capsys.readouterr().err
    assert sorted(p.name for p in src.iterdir()) == ["config.json"]  # nothing written into the source
