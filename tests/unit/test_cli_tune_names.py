"""`pdserve tune` on a staged folder names the model as the pipeline does: a folder under
`<fsx_root>/models/` is named by its path there (`org/llama8`), so the workers rendered from the CLI's spec
load `<fsx_mount>/models/org/llama8`, the folder that was staged; any other folder keeps its own name."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec
from runtime.deploy.render import render_all
from runtime.modelfiles.catalog import CATALOG_DIR
from tests.usecase_requests import stage_config

runner = CliRunner()
LLAMA_8B = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json"


def _stage(tmp_path: Path, dest: Path) -> Path:
    return stage_config(LLAMA_8B, dest, tmp_path)


def _tune(tmp_path: Path, config: Path, *options: str) -> DeploymentSpec:
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(config), "--out", str(out), "--rate", "1", *options])
    assert res.exit_code == 0, res.output
    return DeploymentSpec.model_validate_json(out.read_text())


def _worker_model_args(spec: DeploymentSpec) -> list[str]:
    objs = render_all(spec, name="llama8-pd", namespace="pdserve", image="img", pvc_name="fsx-claim", revision="v1")
    args = [a for o in objs if o["kind"] == "Deployment"
            for c in o["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])]
    return [args[i + 1] for i, a in enumerate(args) if a == "--model"]


@pytest.mark.parametrize("as_config_file", [False, True])
def test_nested_folder_under_fsx_root_is_named_by_its_path_below_models(tmp_path, as_config_file):
    staged = _stage(tmp_path, tmp_path / "fsx" / "models" / "org" / "llama8")
    config = staged / "config.json" if as_config_file else staged
    spec = _tune(tmp_path, config, "--fsx-root", str(tmp_path / "fsx"))
    assert spec.model.name == "org/llama8"
    assert spec.model.path == str(staged)
    model_args = _worker_model_args(spec)
    assert model_args and all(m.endswith("/models/org/llama8") for m in model_args), model_args


def test_default_fsx_root_is_the_local_stand_in_under_the_state_dir(tmp_path):
    state = tmp_path / "state"
    staged = _stage(tmp_path, state / "fsx" / "models" / "org" / "llama8")
    assert _tune(tmp_path, staged, "--state-dir", str(state)).model.name == "org/llama8"


def test_folder_outside_fsx_root_keeps_its_own_name(tmp_path):
    staged = _stage(tmp_path, tmp_path / "elsewhere" / "org" / "llama8")
    spec = _tune(tmp_path, staged, "--fsx-root", str(tmp_path / "fsx"), "--state-dir", str(tmp_path / "state"))
    assert spec.model.name == "llama8"


def test_flat_staged_folder_keeps_its_name(tmp_path):
    staged = _stage(tmp_path, tmp_path / "fsx" / "models" / "llama8")
    assert _tune(tmp_path, staged, "--fsx-root", str(tmp_path / "fsx")).model.name == "llama8"


def test_a_root_or_folder_reached_through_a_symlink_is_still_named_by_its_path(tmp_path):
    fsx = tmp_path / "real-fsx"
    folder = _stage(tmp_path, fsx / "models" / "org" / "llama8")
    (tmp_path / "fsx-link").symlink_to(fsx)  # --fsx-root is a link to the mount
    assert _tune(tmp_path, folder, "--fsx-root", str(tmp_path / "fsx-link")).model.name == "org/llama8"
    (tmp_path / "shortcut").symlink_to(folder)  # the folder is given through a link
    assert _tune(tmp_path, tmp_path / "shortcut", "--fsx-root", str(fsx)).model.name == "org/llama8"


def test_a_folder_name_that_cannot_be_a_model_name_fails_before_tuning(tmp_path):
    folder = tmp_path / "we\\ird"
    folder.mkdir()
    (folder / "config.json").write_text(LLAMA_8B.read_text())
    res = runner.invoke(app, ["tune", str(folder), "--out", str(tmp_path / "s.json")], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "rename the folder" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "s.json").exists()
