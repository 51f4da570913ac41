"""Specification of `make validate-infra` (infra/validate.py): the committed infrastructure passes, and
each kind of breakage is reported as a FAIL naming the file and the problem."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]


def load_validator():
    return load_script("infra/validate.py")


V = load_validator()


def by_name(results):
    return {r.name: r for r in results}


@pytest.fixture
def tree(tmp_path):
    """A copy of infra/ and kserve/ to break."""
    shutil.copytree(REPO / "infra", tmp_path / "infra", ignore=shutil.ignore_patterns(".terraform*", "__pycache__"))
    shutil.copytree(REPO / "kserve", tmp_path / "kserve")
    return tmp_path


def test_committed_infrastructure_passes_every_offline_check():
    res = by_name(V.run_all(REPO, checkov="skip"))
    assert {n: r.status for n, r in res.items() if r.status == "FAIL"} == {}
    for name in ("terraform-hcl", "terraform-pins", "manifests", "kustomizations", "consistency"):
        assert res[name].status == "PASS", res[name]
    assert res["checkov"].status == "SKIP"
    n_objects = int(res["manifests"].detail.split()[0])
    assert n_objects >= 40


def test_hcl_syntax_error_names_the_file(tree):
    (tree / "infra/terraform/broken.tf").write_text('resource "aws_s3_bucket" "x" {\n  bucket = \n')
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["terraform-hcl"].status == "FAIL" and "infra/terraform/broken.tf" in res["terraform-hcl"].detail


def test_module_without_version_is_rejected(tree):
    tf = tree / "infra/terraform/vpc_eks.tf"
    tf.write_text(tf.read_text().replace('  version = "~> 6.0"\n', "", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["terraform-pins"].status == "FAIL" and "module 'vpc'" in res["terraform-pins"].detail


def test_invalid_nodepool_field_is_named(tree):
    f = tree / "infra/k8s/karpenter/nodepools.yaml"
    f.write_text(f.read_text().replace("consolidationPolicy: WhenEmpty", "consolidationPolicy: Sometimes", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    detail = res["manifests"].detail
    assert res["manifests"].status == "FAIL"
    assert "infra/k8s/karpenter/nodepools.yaml: NodePool/gpu-p5: spec.disruption.consolidationPolicy" in detail


def test_unpinned_remote_base_is_rejected(tree):
    f = tree / "infra/k8s/kubeflow-pipelines/kustomization.yaml"
    f.write_text(f.read_text().replace("?ref=2.14.3", "", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["kustomizations"].status == "FAIL" and "not pinned" in res["kustomizations"].detail


def test_missing_nodepool_for_an_instance_type_is_reported(tree):
    f = tree / "infra/k8s/karpenter/nodepools.yaml"
    docs = f.read_text().split("---\n")
    f.write_text("---\n".join(d for d in docs if "name: gpu-g6e" not in d))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "FAIL" and "NodePool gpu-g6e" in res["consistency"].detail


def test_main_prints_a_summary_and_exits_non_zero_on_failure(tree, capsys):
    (tree / "infra/k8s/storage/pvc.yaml").unlink()
    assert V.main(["--root", str(tree), "--checkov", "skip"]) == 1
    out = capsys.readouterr().out
    assert "validate-infra summary" in out and "FAIL  kustomizations" in out
    assert "pdserve/fsx-claim" in out
    assert V.main(["--root", str(tree), "--checkov", "definitely-not-installed", "--require-checkov"]) == 1


@pytest.mark.integration
def test_checkov_reports_no_unjustified_findings():
    exe = V.find_checkov(REPO, "auto")
    if exe is None:
        pytest.skip("checkov not installed (make validate-infra installs it into .venv-infra)")
    res = V.check_checkov(REPO, exe, require=True)
    assert res.status == "PASS", res.detail


def test_namespace_enforce_level_allows_every_capability_the_rendered_workers_add():
    objs = V._yaml_docs(REPO / "infra/k8s/namespaces.yaml")
    workloads = V.rendered_deploy_objects("pdserve")
    added = {cap for o in workloads if o["kind"] == "Deployment"
             for c in o["spec"]["template"]["spec"]["containers"]
             for cap in c["securityContext"]["capabilities"].get("add", [])}
    assert "IPC_LOCK" in added  # EFA workers (p5 by default) pin memory for RDMA
    assert V.pod_security_problems(objs, workloads) == []


def test_baseline_enforce_on_the_deploy_namespace_is_reported(tree):
    f = tree / "infra/k8s/namespaces.yaml"
    text = f.read_text()
    assert "pod-security.kubernetes.io/enforce: privileged" in text
    f.write_text(text.replace("pod-security.kubernetes.io/enforce: privileged",
                              "pod-security.kubernetes.io/enforce: baseline", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    detail = res["consistency"].detail
    assert res["consistency"].status == "FAIL"
    assert ("Deployment pdserve/pss-check-prefill container vllm adds IPC_LOCK, which Pod Security level "
            "'baseline' of namespace pdserve forbids") in detail
    assert detail.count("pss-check-prefill container vllm adds IPC_LOCK") == 1


def test_restricted_namespace_allows_only_net_bind_service():
    ns = [{"kind": "Namespace", "metadata": {"name": "x", "labels": {V.PSS_ENFORCE_LABEL: "restricted"}}}]
    pod = {"kind": "Pod", "metadata": {"name": "p", "namespace": "x"}, "spec": {"containers": [
        {"name": "c", "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE", "CHOWN"]}}}]}}
    assert V.pod_security_problems(ns, [pod]) == [
        "Pod x/p container c adds CHOWN, which Pod Security level 'restricted' of namespace x forbids"]
