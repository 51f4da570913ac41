"""The layers of docs/architecture.md hold: the import-linter contracts in pyproject.toml are kept, and they do
catch a core module that does I/O or an adapter that reaches into another adapter it must not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the tree under test, not the installed checkout
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_layer_contracts_are_kept():
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_a_core_module_doing_io_or_an_adapter_importing_a_face_or_use_case_breaks_them(tmp_path):
    for name in ("runtime", "components", "pipelines"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with (tmp_path / "runtime" / "planner" / "__init__.py").open("a") as f:
        f.write("\nimport time\n")
    with (tmp_path / "runtime" / "config.py").open("a") as f:
        f.write("\nfrom runtime.usecases import tune\n")
    with (tmp_path / "runtime" / "batch" / "workflows.py").open("a") as f:
        f.write("\nfrom runtime.faces import common\n")
    with (tmp_path / "runtime" / "tracking" / "traces.py").open("a") as f:
        f.write("\nfrom runtime.usecases import tune_model\n")
    res = _lint(tmp_path)
    assert res.returncode == 1
    assert "runtime.planner is not allowed to import time" in res.stdout
    assert "runtime.config is not allowed to import runtime.usecases" in res.stdout
    assert "runtime.batch is not allowed to import runtime.faces" in res.stdout
    assert "runtime.tracking is not allowed to import runtime.usecases" in res.stdout
