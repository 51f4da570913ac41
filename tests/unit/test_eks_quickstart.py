"""docs/eks-quickstart.md: it ends in a curl, README links it, and every command in it that can run without an
AWS account runs here (compile, make's image targets as a dry run, the local kustomizations, the cluster model
with the image the guide builds); the flags it passes exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/eks-quickstart.md"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/pdserve-runtime:0.1.0"


def _blocks() -> list[str]:
    text = DOC.read_text().replace("ACCOUNT", "123456789012")
    return [b.replace("\\\n", " ") for b in re.findall(r"```sh\n(.*?)```", text, re.S)]


def _commands(prefix: str) -> list[list[str]]:
    return [line.split() for b in _blocks() for line in b.splitlines() if line.strip().startswith(prefix)]


def test_the_guide_ends_in_a_curl_and_readme_links_it():
    assert _blocks()[-1].lstrip().startswith("curl ")
    assert "/openai/v1/chat/completions" in _blocks()[-1]
    assert "](docs/eks-quickstart.md)" in (ROOT / "README.md").read_text()
    assert "not run on a real cluster" in DOC.read_text().lower()


def test_compile_command_runs(tmp_path, monkeypatch):
    pytest.importorskip("kfp")
    import yaml
    from typer.testing import CliRunner

    from runtime.cli import app

    (cmd,) = _commands("pdserve compile")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, cmd[1:])
    assert r.exit_code == 0, r.output
    pipeline = next(yaml.safe_load_all((tmp_path / cmd[2]).read_text()))
    assert {e["container"]["image"] for e in pipeline["deploymentSpec"]["executors"].values()} == {IMAGE + "-cpu"}


def test_promote_flags_exist():
    import inspect

    from runtime.faces.promote import promote

    (cmd,) = _commands("pdserve promote")
    flags = {a.split("=")[0] for a in cmd if a.startswith("--")}
    known = {"--" + n.replace("_", "-") for n in inspect.signature(promote).parameters}
    assert flags and flags <= known, flags - known


def test_make_image_push_dry_run_builds_and_pushes_both_images():
    if not shutil.which("make"):
        pytest.skip("make not installed")
    (cmd,) = _commands("make image-push")
    r = subprocess.run([*cmd, "-n", "CONTAINER_TOOL=docker"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"docker push {IMAGE}-cpu" in r.stdout and f"docker push {IMAGE}\n" in r.stdout


def test_the_files_it_writes_and_edits_exist():
    text = DOC.read_text()
    for rel in ("infra/k8s/values/cluster.env", "infra/k8s/kserve/knative-config.yaml", "infra/k8s/kubeflow-profile"):
        assert (ROOT / rel).exists() and rel.split("/", 1)[1] in text


def test_local_kustomizations_of_the_apply_step_build():
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed")
    for d in ("infra/k8s/storage", "infra/k8s/kubeflow-pdserve", "infra/k8s/kubeflow-profile", "kserve"):
        r = subprocess.run([kubectl, "kustomize", str(ROOT / d)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (d, r.stderr)


def test_validate_infra_with_the_guides_image_passes_the_cluster_check():
    pytest.importorskip("kfp")
    from tests.scripts import load_script

    V = load_script("infra/validate.py")
    (cmd,) = _commands("make validate-infra")
    image = next(a.split("=", 1)[1] for a in cmd if a.startswith("IMAGE="))
    _, parsed = V.check_terraform_hcl(ROOT)
    res = V.check_cluster(ROOT, parsed, image)
    assert res.status == "PASS" and image in res.detail, res.detail
