"""The YAML in kserve/ is exactly what the renderer produces (no hand-edited copies) and is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.deploy.render import read_yaml
from runtime.deploy.templates import generate
from runtime.deploy.validate import validate_objects

KSERVE_DIR = Path(__file__).resolve().parents[2] / "kserve"


def test_committed_templates_match_the_renderer(tmp_path):
    fresh = generate(tmp_path)
    assert len(fresh) >= 4
    for f in fresh:
        committed = KSERVE_DIR / f.relative_to(tmp_path)
        assert committed.exists(), f"{committed} missing: run python -m runtime.deploy.templates"
        assert committed.read_text() == f.read_text(), f"{committed} is stale: run python -m runtime.deploy.templates"


def test_templates_validate_and_carry_the_pvc_storage_uri():
    objs = read_yaml(KSERVE_DIR / "examples" / "llama-3-1-8b-h100.yaml")
    assert validate_objects(objs) == len(objs)
    isvc = next(o for o in objs if o["kind"] == "InferenceService")
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == "pvc://fsx-claim/models/meta-llama--Meta-Llama-3.1-8B"
    csr = read_yaml(KSERVE_DIR / "clusterservingruntime.yaml")
    assert [o["kind"] for o in csr] == ["ClusterServingRuntime"]
    assert csr[0]["spec"]["containers"][0]["securityContext"]["runAsNonRoot"] is True


def test_the_maintenance_command_explains_itself_and_writes_where_it_is_told(tmp_path, capsys, monkeypatch):
    from runtime.deploy.templates import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "OUT_DIR" in capsys.readouterr().out.upper()
    assert not (tmp_path / "--help").exists()  # --help is not an output folder
    written = main([str(tmp_path / "out")])
    assert (tmp_path / "out" / "clusterservingruntime.yaml") in written
