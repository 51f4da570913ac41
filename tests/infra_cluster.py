"""Shared by the tests of infra/validate.py: the script loaded as a module (`V`), module-scoped fixtures for the
parsed Terraform tree (`parsed`) and the in-memory cluster model (`model`) of its check `cluster`, and `tree`, a
copy of what the checks read for a test to break. A test module uses them with
``from tests.infra_cluster import V, model, parsed`` (or ``tree``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
V = load_script("infra/validate.py")


@pytest.fixture(scope="module")
def parsed():
    return V.check_terraform_hcl(REPO)[1]


@pytest.fixture(scope="module")
def model(parsed):
    pytest.importorskip("kfp")
    from runtime.image import DEFAULT_IMAGE

    return V.cluster_model(REPO, parsed, DEFAULT_IMAGE)


@pytest.fixture
def tree(tmp_path):
    """A copy of infra/ and kserve/ (and the version pins: pyproject.toml, the vendored CRD schemas) to break."""
    shutil.copytree(REPO / "infra", tmp_path / "infra", ignore=shutil.ignore_patterns(".terraform*", "__pycache__"))
    shutil.copytree(REPO / "kserve", tmp_path / "kserve")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(REPO / "runtime/deploy/schemas", tmp_path / "runtime/deploy/schemas")
    return tmp_path
