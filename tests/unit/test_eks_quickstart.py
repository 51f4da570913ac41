"""docs/eks-quickstart.md: it ends in a curl, README links it, and every command in it that can run without an
AWS account runs here (compile, make's image targets as a dry run, the local kustomizations, the cluster model
with the image the guide builds); the flags it passes exist; the region is the REGION placeholder, never a
hard-coded one; the label selectors, columns and container names of its troubleshooting commands are those of the
objects promote renders."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/eks-quickstart.md"
# Not Terraform's default region, so that a command that hard-codes the default instead of REGION fails here.
ACCOUNT_ID, REGION = "123456789012", "eu-west-2"
IMAGE = f"{ACCOUNT_ID}.dkr.ecr.{REGION}.amazonaws.com/pdserve-runtime:0.1.0"
AWS_REGION_NAME = re.compile(  # us-east-1, eu-west-2, ap-southeast-1, us-gov-west-1 ...
    r"\b(?:af|ap|ca|cn|eu|il|me|mx|sa|us)-(?:gov-)?(?:north|south|east|west|central)(?:east|west)?-[0-9]\b")


def _raw_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S)


def _blocks() -> list[str]:
    """The guide's shell blocks with the placeholders filled in and continuation lines joined."""
    return [b.replace("ACCOUNT", ACCOUNT_ID).replace("REGION", REGION).replace("\\\n", " ") for b in _raw_blocks()]


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


def test_the_region_is_the_placeholder_region_everywhere():
    text = DOC.read_text()
    assert "`REGION`" in text  # the fill-in list names it
    assert not [m.group() for b in _raw_blocks() for m in AWS_REGION_NAME.finditer(b)]
    hosts = re.findall(r"dkr\.ecr\.([^.\s`]+)\.amazonaws\.com", text) + re.findall(r"arn:aws:eks:([^:\s`]+):", text)
    assert hosts and set(hosts) == {"REGION"}, hosts
    flags = [c[c.index("--region") + 1] for b in _raw_blocks() for c in (line.split() for line in b.splitlines())
             if "--region" in c]
    assert flags and set(flags) == {"REGION"}, flags
    (apply,) = _commands("terraform apply")
    tf_vars = {a.split("=", 1)[0] for a, prev in zip(apply[1:], apply) if prev == "-var"}
    assert "region" in tf_vars
    declared = set(re.findall(r'^variable "([^"]+)"', (ROOT / "infra/terraform/variables.tf").read_text(), re.M))
    assert {v.strip("'") for v in tf_vars} <= declared, {v.strip("'") for v in tf_vars} - declared


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """kubectl's `-l` for the two forms the guide uses: `key=value` and `key in (a,b)`, comma-separated."""
    terms = re.findall(r"([\w./-]+)\s+in\s+\(([^)]*)\)|([\w./-]+)=([\w.-]+)", selector)
    assert terms, selector
    return all(labels.get(k) in [v.strip() for v in vs.split(",")] if k else labels.get(k2) == v2
               for k, vs, k2, v2 in terms)


def test_the_troubleshooting_commands_name_what_promote_renders():
    from runtime.deploy.render import find, render_all
    from runtime.deploy.templates import EXAMPLES

    name, revision = "m-pd", "v1"  # the guide's NAME-pd, version N
    objs = render_all(EXAMPLES["llama-3-1-8b-h100"][1], name=name, namespace="pdserve", image=IMAGE,
                      pvc_name="fsx-claim", revision=revision)
    workloads = [o for o in objs if o["kind"] in ("Deployment", "LeaderWorkerSet")]
    templates = [o["spec"]["template"] for o in workloads]
    runtime_pods = find(objs, "PodMonitor")["spec"]["selector"]["matchLabels"]  # KServe's label on them
    containers = {"vllm": [c["name"] for t in templates for c in t["spec"]["containers"]],
                  "kserve-container": [c["name"] for c in find(objs, "ClusterServingRuntime")["spec"]["containers"]]}
    checked = set()
    for b in _blocks():
        for line in b.splitlines():
            cmd = shlex.split(line.replace("NAME-pd", name), comments=True)
            if cmd[:3] != ["kubectl", "-n", "pdserve"]:
                continue
            for flag, value in zip(cmd, cmd[1:]):
                if flag == "-l" and "serving.kserve.io/inferenceservice" in value:
                    assert _selector_matches(value, runtime_pods), value
                elif flag == "-l":
                    assert all(_selector_matches(value, o["metadata"]["labels"]) for o in workloads + templates), value
                elif flag == "-L":
                    assert all(value in t["metadata"]["labels"] for t in templates), value
                elif flag == "-c":
                    assert value in containers.get(value, []), value
                else:
                    continue
                checked.add(flag)
    assert checked >= {"-l", "-L", "-c"}, checked
    text, names = DOC.read_text(), {o["metadata"]["name"] for o in workloads}
    for role in ("prefill", "decode"):
        assert f"`NAME-pd-vN-{role}`" in text and f"{name}-{revision}-{role}" in names, role
