"""Load a repository script that is not a package module (``bench/*.py``, ``infra/validate.py``) in a test.

Each call executes the file anew into a fresh module (tests that change a script's globals do not
leak into each other), registered in ``sys.modules`` under a name derived from the path, because
dataclasses resolve a module's annotations through ``sys.modules``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relpath: str) -> ModuleType:
    """Execute ``REPO/relpath`` (e.g. ``"bench/planner.py"``) as a module and return it.

    Raises:
        FileNotFoundError: no such file in the repository.
    """
    path = REPO / relpath
    if not path.is_file():
        raise FileNotFoundError(f"no script {relpath} in {REPO}")
    name = "pdserve_script_" + relpath.removesuffix(".py").replace("/", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
