"""Shared by the tests of infra/validate.py's check `cluster`: the script loaded as a module (`V`) and
module-scoped fixtures for the parsed Terraform tree (`parsed`) and the in-memory cluster model (`model`).
A test module uses them with ``from tests.infra_cluster import V, model, parsed``."""

from __future__ import annotations

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
