"""Cluster settings that no manifest object shows, checked by `make validate-infra` (check consistency): Knative
routes through Kourier and KServe runs without Istio, Knative's progress deadline covers a first GPU rollout, the
FSx data repository association stays out of the staging folder /models, the monitoring namespace exists with the
Pod Security level node-exporter needs, the EKS node security group allows EFA and the VPC CNI enforces
NetworkPolicies, and the KFP backend is the release of the SDK that compiles the pipeline. The committed tree
passes; each setting is broken once and the break is reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.infra_cluster import REPO, V, tree  # noqa: F401 - the fixture is used by name


def _edit(tree: Path, rel: str, old: str, new: str) -> None:
    f = tree / rel
    text = f.read_text()
    assert old in text, f"{old!r} not in {rel}"
    f.write_text(text.replace(old, new, 1))


def _drop_doc(tree: Path, rel: str, marker: str) -> None:
    """Remove the YAML document of `rel` that contains `marker`."""
    f = tree / rel
    docs = f.read_text().split("\n---\n")
    kept = [d for d in docs if marker not in d]
    assert len(kept) == len(docs) - 1, f"{marker!r} not in exactly one document of {rel}"
    f.write_text("\n---\n".join(kept))


def _parsed(root: Path) -> dict:
    return V.check_terraform_hcl(root)[1]


def _all(root: Path) -> list[str]:
    parsed = _parsed(root)
    return (V.serving_config_problems(root) + V.fsx_association_problems(parsed) + V.namespace_problems(root)
            + V.node_network_problems(parsed) + V.version_pin_problems(root))


def test_committed_tree_has_every_setting():
    assert _all(REPO) == []
    res = {r.name: r for r in V.run_all(REPO, checkov="skip", tools=False)}
    assert res["consistency"].status == "PASS", res["consistency"].detail


# --- Knative with Kourier, KServe without Istio ---------------------------------------------------------------

KNATIVE = "infra/k8s/kserve/knative-config.yaml"
KSERVE_KUST = "infra/k8s/kserve/kustomization.yaml"
KSERVE_CFG = "infra/k8s/kserve/kserve-config.yaml"


def test_knative_without_the_kourier_ingress_class_is_reported(tree):
    _drop_doc(tree, KNATIVE, "name: config-network")
    assert any("config-network ingress-class is None" in p for p in V.serving_config_problems(tree))


def test_knative_with_the_istio_ingress_class_is_reported(tree):
    _edit(tree, KNATIVE, "ingress-class: kourier.ingress.networking.knative.dev",
          "ingress-class: istio.ingress.networking.knative.dev")
    assert any("ingress-class is 'istio.ingress.networking.knative.dev'" in p
               for p in V.serving_config_problems(tree))


def test_kserve_expecting_istio_is_reported(tree):
    _edit(tree, KSERVE_KUST, "  - path: kserve-config.yaml", "")
    assert any("does not set disableIstioVirtualHost true" in p for p in V.serving_config_problems(tree))


def test_kserve_ingress_config_without_ingress_gateway_is_reported(tree):
    _edit(tree, KSERVE_CFG, '"ingressGateway": "knative-serving/knative-ingress-gateway",\n', "")
    assert any("has no ingressGateway" in p for p in V.serving_config_problems(tree))


def test_kserve_ingress_config_that_is_not_json_is_reported(tree):
    _edit(tree, KSERVE_CFG, '"disableIstioVirtualHost": true,', '"disableIstioVirtualHost": true,,')
    assert any("`ingress` is not JSON" in p for p in V.serving_config_problems(tree))


# --- Knative's progress deadline -------------------------------------------------------------------------------

def test_default_progress_deadline_is_reported(tree):
    _drop_doc(tree, KNATIVE, "name: config-deployment")
    problems = V.serving_config_problems(tree)
    assert any("progress-deadline '600s' is below a first rollout's 3000 s" in p for p in problems), problems


@pytest.mark.parametrize("value,ok", [("30m", False), ("2999s", False), ("50m", True), ("1h", True),
                                      ("3600s", True), ("an hour", False)])
def test_progress_deadline_must_cover_the_worker_startup_budget(tree, value, ok):
    _edit(tree, KNATIVE, 'progress-deadline: "3600s"', f'progress-deadline: "{value}"')
    assert (V.serving_config_problems(tree) == []) is ok


def test_go_durations_are_read_like_knative():
    assert V.go_duration_s("3600s") == 3600 and V.go_duration_s("1h30m") == 5400 and V.go_duration_s("10m") == 600
    assert V.go_duration_s("600") is None and V.go_duration_s("") is None and V.go_duration_s("1 h") is None


# --- FSx data repository association ---------------------------------------------------------------------------

STORAGE_TF = "infra/terraform/storage.tf"


@pytest.mark.parametrize("path", ["/models", "/models/", "/models/org", "/"])
def test_fsx_link_into_the_staging_folder_is_reported(tree, path):
    _edit(tree, STORAGE_TF, 'file_system_path                 = "/s3"',
          f'file_system_path                 = "{path}"')
    problems = V.fsx_association_problems(_parsed(tree))
    assert any("overlaps /models, where staging publishes model folders" in p for p in problems), problems


@pytest.mark.parametrize("path", ["/s3", "/s3/models", "/modelsets"])
def test_fsx_link_beside_the_staging_folder_passes(tree, path):
    _edit(tree, STORAGE_TF, 'file_system_path                 = "/s3"',
          f'file_system_path                 = "{path}"')
    assert V.fsx_association_problems(_parsed(tree)) == []


# --- namespaces of Helm charts ---------------------------------------------------------------------------------

NAMESPACES = "infra/k8s/namespaces.yaml"


def test_missing_monitoring_namespace_is_reported(tree):
    _drop_doc(tree, NAMESPACES, "name: monitoring")
    problems = V.namespace_problems(tree)
    assert any("infra/k8s/prometheus: Helm chart kube-prometheus-stack goes into namespace monitoring, which no "
               "manifest creates" in p for p in problems), problems


def test_monitoring_namespace_too_strict_for_node_exporter_is_reported(tree):
    f = tree / NAMESPACES
    docs = f.read_text().split("\n---\n")
    docs = [d.replace("pod-security.kubernetes.io/enforce: privileged", "pod-security.kubernetes.io/enforce: baseline")
            if "name: monitoring" in d else d for d in docs]
    f.write_text("\n---\n".join(docs))
    problems = V.namespace_problems(tree)
    assert any("Namespace monitoring enforces Pod Security baseline, but kube-prometheus-stack's node-exporter"
               in p for p in problems), problems


# --- EFA security group rules, NetworkPolicy enforcement ------------------------------------------------------

VPC_EKS_TF = "infra/terraform/vpc_eks.tf"


@pytest.mark.parametrize("rule,direction", [("ingress_self_all_efa", "ingress"), ("egress_self_all_efa", "egress")])
def test_node_security_group_without_efa_self_rule_is_reported(tree, rule, direction):
    text = (tree / VPC_EKS_TF).read_text()
    start = text.index(f"    {rule} = {{")
    end = text.index("    }\n", start) + len("    }\n")
    (tree / VPC_EKS_TF).write_text(text[:start] + text[end:])
    problems = V.node_network_problems(_parsed(tree))
    assert problems == [f'module "eks": node_security_group_additional_rules has no all-protocol self {direction} '
                        "rule: EFA traffic between GPU nodes (NIXL over LIBFABRIC) would be dropped"]


def test_efa_rule_limited_to_tcp_is_reported(tree):
    _edit(tree, VPC_EKS_TF, '      protocol    = "-1"\n      from_port   = 0\n      to_port     = 0\n      type        = '
                            '"ingress"', '      protocol    = "tcp"\n      from_port   = 0\n      to_port     = 65535\n'
                            '      type        = "ingress"')
    assert any("no all-protocol self ingress rule" in p for p in V.node_network_problems(_parsed(tree)))


def test_vpc_cni_without_network_policy_enforcement_is_reported(tree):
    _edit(tree, VPC_EKS_TF, '      configuration_values = jsonencode({ enableNetworkPolicy = "true" })\n', "")
    problems = V.node_network_problems(_parsed(tree))
    assert any("does not set configuration_values enableNetworkPolicy" in p for p in problems), problems


# --- KFP SDK and backend of one release ------------------------------------------------------------------------

KFP_KUST = "infra/k8s/kubeflow-pipelines/kustomization.yaml"


def test_kfp_backend_older_than_the_sdk_is_reported(tree):
    (tree / KFP_KUST).write_text((tree / KFP_KUST).read_text().replace("?ref=2.17.3", "?ref=2.14.3"))
    problems = V.version_pin_problems(tree)
    assert any("installs the backend ['2.14.3']" in p and "kfp/kfp-kubernetes ['2.17.3', '2.17.3']" in p
               for p in problems), problems


def test_unpinned_kfp_kubernetes_is_reported(tree):
    _edit(tree, "pyproject.toml", '"kfp-kubernetes==2.17.3"', '"kfp-kubernetes"')
    assert any(p.startswith("KFP: pyproject pins kfp/kfp-kubernetes ['2.17.3']") for p in V.version_pin_problems(tree))


def test_the_installed_kfp_packages_are_the_pinned_release():
    from importlib.metadata import version

    assert version("kfp") == version("kfp-kubernetes") == "2.17.3"
