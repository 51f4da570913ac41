"""docs/cli.md and docs/configuration.md are generated from the code (runtime.docs_gen): the committed files
must equal what the code generates now, on any machine and from any checkout location."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime import docs_gen


@pytest.mark.parametrize("name", sorted(docs_gen.GENERATED))
def test_committed_doc_is_current(name):
    committed = (docs_gen.DOCS / name).read_text(encoding="utf-8")
    assert committed == docs_gen.GENERATED[name](), (
        f"docs/{name} is stale: run `python -m runtime.docs_gen` and commit the result")


def test_stale_names_a_changed_file(tmp_path):
    for name, make in docs_gen.GENERATED.items():
        (tmp_path / name).write_text(make(), encoding="utf-8")
    assert docs_gen.stale(tmp_path) == []
    (tmp_path / "cli.md").write_text("# old\n", encoding="utf-8")
    (tmp_path / "configuration.md").unlink()
    assert docs_gen.stale(tmp_path) == ["cli.md", "configuration.md"]
    assert docs_gen.main(["--check", "--docs", str(tmp_path)]) == 1


def test_generated_text_does_not_depend_on_the_machine(tmp_path):
    """Another state folder (PDSERVE_HOME) changes the CLI's path defaults, never the generated text."""
    env = {**os.environ, "PDSERVE_HOME": str(tmp_path / "elsewhere")}
    r = subprocess.run([sys.executable, "-m", "runtime.docs_gen", "--check"], cwd=docs_gen.ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name, make in docs_gen.GENERATED.items():
        text = make()
        assert str(docs_gen.ROOT) not in text and os.path.expanduser("~") not in text, name
