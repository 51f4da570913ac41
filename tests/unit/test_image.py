"""The pdserve image reference lives in one place (runtime/image.py) and every face reads it: the CPU build is
derived from it, `pdserve compile --image` sets every pipeline step's image, `make image` builds both builds with
whichever container tool is installed and says so clearly when none is."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from runtime.image import CPU_TAG_SUFFIX, DEFAULT_IMAGE, cpu_image, gpu_image, split_reference

ROOT = Path(__file__).resolve().parents[2]
ECR = "123456789012.dkr.ecr.us-east-1.amazonaws.com/pdserve-runtime"


@pytest.mark.parametrize("ref, parts", [
    ("public.ecr.aws/acme/runtime:0.1.0", ("public.ecr.aws/acme/runtime", "0.1.0", None)),
    ("localhost:5000/x:1", ("localhost:5000/x", "1", None)),
    ("x:1", ("x", "1", None)),
    ("x@sha256:" + "a" * 64, ("x", None, "sha256:" + "a" * 64)),
])
def test_split_reference(ref, parts):
    assert split_reference(ref) == parts


@pytest.mark.parametrize("bad", ["", "Foo/x:1", "x:", "a//b:1", "x y:1", "x@sha256:12", "reg.io:x/y:1"])
def test_malformed_references_are_refused(bad):
    with pytest.raises(ValueError, match="not a container image reference"):
        split_reference(bad)


def test_cpu_and_gpu_builds_are_derived_from_one_tag():
    assert cpu_image(f"{ECR}:0.2.0") == f"{ECR}:0.2.0{CPU_TAG_SUFFIX}"
    assert cpu_image(f"{ECR}:0.2.0-cpu") == f"{ECR}:0.2.0-cpu"
    assert gpu_image(cpu_image(f"{ECR}:0.2.0")) == f"{ECR}:0.2.0"
    assert gpu_image(f"{ECR}:0.2.0") == f"{ECR}:0.2.0"
    with pytest.raises(ValueError, match="derived from a tag"):
        cpu_image(f"{ECR}@sha256:" + "b" * 64)


def test_the_default_image_is_written_in_one_place_only():
    """Generated files (kserve/ templates, docs/cli.md) carry it as rendered from the constant; their own tests
    compare them with what the code renders."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    generated = {"docs/cli.md", "kserve/clusterservingruntime.yaml"}
    holders = {n for n in names if (ROOT / n).is_file() and n not in generated and not n.startswith("kserve/examples/")
               and DEFAULT_IMAGE in (ROOT / n).read_text(errors="replace")}
    assert holders == {"runtime/image.py"}


def test_promote_default_image_is_the_constant():
    import inspect

    from runtime.faces.promote import promote

    assert inspect.signature(promote).parameters["image"].default == DEFAULT_IMAGE


def test_compile_image_sets_every_step_and_the_runtime_default(tmp_path):
    pytest.importorskip("kfp")
    from typer.testing import CliRunner

    from runtime.cli import app

    out = tmp_path / "p.yaml"
    r = CliRunner().invoke(app, ["compile", str(out), "--image", f"{ECR}:0.2.0"])
    assert r.exit_code == 0, r.output
    pipeline = next(yaml.safe_load_all(out.read_text()))
    images = {e["container"]["image"] for e in pipeline["deploymentSpec"]["executors"].values()}
    assert images == {f"{ECR}:0.2.0-cpu"}
    assert pipeline["root"]["inputDefinitions"]["parameters"]["image"]["defaultValue"] == f"{ECR}:0.2.0"
    r = CliRunner().invoke(app, ["compile", str(out), "--image", f"{ECR}@sha256:" + "c" * 64])
    assert r.exit_code == 2 and "--steps-image" in r.output
    r = CliRunner().invoke(app, ["compile", str(out), "--image", "Not An Image"])
    assert r.exit_code == 2 and "--image" in r.output


def _fake_tool(tmp_path: Path, name: str) -> tuple[Path, Path]:
    log = tmp_path / f"{name}.log"
    tool = tmp_path / "bin" / name
    tool.parent.mkdir(exist_ok=True)
    tool.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    tool.chmod(0o755)
    return tool, log


@pytest.mark.parametrize("name, verb", [("docker", "build"), ("podman", "build"), ("buildah", "bud")])
def test_make_image_builds_the_gpu_and_the_cpu_image(tmp_path, name, verb):
    if not shutil.which("make"):
        pytest.skip("make not installed")
    tool, log = _fake_tool(tmp_path, name)
    r = subprocess.run(["make", "-s", "image", f"IMAGE={ECR}:0.2.0", f"CONTAINER_TOOL={tool}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    builds = [line.split() for line in log.read_text().splitlines() if line.split()[0] == verb]
    assert [(b[b.index("-f") + 1], b[b.index("-t") + 1]) for b in builds] == [
        ("kserve/Dockerfile.cpu", f"{ECR}:0.2.0-cpu"), ("kserve/Dockerfile", f"{ECR}:0.2.0")]


def test_make_image_default_reads_the_constant_and_fails_clearly_without_a_tool(tmp_path):
    if not shutil.which("make"):
        pytest.skip("make not installed")
    r = subprocess.run(["make", "-s", "-n", "image", "CONTAINER_TOOL=/bin/true"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert f"-t {DEFAULT_IMAGE}-cpu" in r.stdout and f"-t {DEFAULT_IMAGE} " in r.stdout + " "
    env = {**os.environ, "PATH": str(tmp_path)}  # no docker, podman nor buildah
    r = subprocess.run([shutil.which("make"), "-s", "image"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode != 0 and "no container build tool found" in r.stdout
