"""What the dashboards and alerts read is collected in the cluster infra/k8s builds: the DCGM exporter runs on
every GPU node (the GPU dashboard, runbooks), and Prometheus scrapes both Argo workflow-controllers (the alert
PdservePipelineFailed) and selects the monitors of every namespace."""

from __future__ import annotations

from pathlib import Path

import yaml

from runtime.observability.alerts import alerts
from runtime.server.metrics import catalog

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _chart(kustomization: Path, name: str) -> dict:
    charts = {c["name"]: c for c in _docs(kustomization)[0].get("helmCharts", [])}
    assert name in charts, f"{kustomization.relative_to(REPO)} installs no {name} chart"
    return charts[name]


def _tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Kubernetes' toleration match (key, effect, operator Exists or Equal on the value)."""
    for t in tolerations:
        if t.get("key") not in (None, taint["key"]) or t.get("effect") not in (None, taint["effect"]):
            continue
        if t.get("operator", "Equal") == "Exists" or t.get("value") == taint.get("value"):
            return True
    return False


def _node_matches(affinity: dict, labels: dict) -> bool:
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    ops = {"Exists": lambda k, v: k in labels, "In": lambda k, v: labels.get(k) in v,
           "NotIn": lambda k, v: labels.get(k) not in v, "DoesNotExist": lambda k, v: k not in labels}
    return any(all(ops[e["operator"]](e["key"], e.get("values")) for e in t["matchExpressions"]) for t in terms)


def _runs_on_every_gpu_pool(tolerations: list[dict], affinity: dict) -> tuple[list[dict], list[dict]]:
    """Assert a DaemonSet with these tolerations and node affinity lands on every Karpenter GPU NodePool's nodes
    (those tainted nvidia.com/gpu); returns (every NodePool, the GPU ones)."""
    pools = [d for d in _docs(K8S / "karpenter" / "nodepools.yaml") if d["kind"] == "NodePool"]
    gpu_pools = [p for p in pools if any(t["key"] == "nvidia.com/gpu" for t in p["spec"]["template"]["spec"].get(
        "taints", []))]
    assert gpu_pools
    for pool in gpu_pools:
        tmpl = pool["spec"]["template"]
        for taint in tmpl["spec"]["taints"]:
            assert _tolerates(tolerations, taint), (pool["metadata"]["name"], taint)
        assert _node_matches(affinity, tmpl["metadata"]["labels"]), pool["metadata"]["name"]
    return pools, gpu_pools


def test_the_dcgm_exporter_runs_on_every_gpu_node_and_is_scraped():
    assert any(m.source == "DCGM exporter" for m in catalog())  # what the GPU dashboard reads
    values = _chart(K8S / "gpu" / "kustomization.yaml", "dcgm-exporter")["valuesInline"]
    assert values["serviceMonitor"]["enabled"] is True
    pools, gpu_pools = _runs_on_every_gpu_pool(values["tolerations"], values["affinity"])
    for pool in pools:
        if pool not in gpu_pools:  # a CPU node has no GPU for the exporter to read: it must not land there
            assert not _node_matches(values["affinity"], pool["spec"]["template"].get("metadata", {}).get(
                "labels", {})), pool["metadata"]["name"]


def test_both_argo_controllers_are_scraped_for_the_pipeline_alert():
    assert any("argo_workflows_" in a.expr for a in alerts())
    monitors = {m["metadata"]["namespace"]: m for m in _docs(K8S / "prometheus" / "argo-podmonitors.yaml")
                if m["kind"] == "PodMonitor"}
    assert set(monitors) == {"kubeflow", "pdserve"}
    assert monitors["kubeflow"]["spec"]["selector"]["matchLabels"] == {"app": "workflow-controller"}  # upstream Argo
    deploy = next(d for d in _docs(K8S / "argo" / "deployment.yaml") if d["kind"] == "Deployment")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    mon = monitors["pdserve"]["spec"]
    assert mon["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for c in deploy["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}
    policy = next(d for d in _docs(K8S / "argo" / "networkpolicy.yaml") if d["kind"] == "NetworkPolicy")
    for ep in mon["podMetricsEndpoints"]:
        assert ep["port"] in ports
        admitted = [p["port"] for rule in policy["spec"]["ingress"] if any(
            f.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name") == "monitoring"
            for f in rule.get("from", [])) for p in rule.get("ports", [])]
        assert ports[ep["port"]] in admitted
        assert ep["scheme"] == "https"  # Argo >= 3.6 serves metrics over TLS unless metricsConfig.secure is false
    config = next(d for d in _docs(K8S / "argo" / "configmap.yaml") if d["kind"] == "ConfigMap")
    assert "secure: false" not in config["data"].get("metricsConfig", "")
    # the alert groups by the workflow's namespace, a label of the metric itself: without honorLabels Prometheus
    # moves it to exported_namespace and every failure reads as the controller's namespace
    assert any("by (namespace)" in a.expr and "argo_workflows_" in a.expr for a in alerts())
    for m in monitors.values():
        assert all(ep.get("honorLabels") is True for ep in m["spec"]["podMetricsEndpoints"])


def test_prometheus_selects_the_monitors_of_every_namespace():
    kust = K8S / "prometheus" / "kustomization.yaml"
    assert "argo-podmonitors.yaml" in _docs(kust)[0]["resources"]
    spec = _chart(kust, "kube-prometheus-stack")["valuesInline"]["prometheus"]["prometheusSpec"]
    for kind in ("serviceMonitor", "podMonitor"):
        assert spec[f"{kind}SelectorNilUsesHelmValues"] is False and spec[f"{kind}NamespaceSelector"] == {}


# the affinity of the nvidia-device-plugin chart's values.yaml (NVIDIA/k8s-device-plugin,
# deployments/helm/nvidia-device-plugin, 0.17.x): labels that Node Feature Discovery or the GPU operator set
NVIDIA_DEVICE_PLUGIN_CHART_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [
        {"matchExpressions": [{"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In",
                               "values": ["true"]}]},
        {"matchExpressions": [{"key": "feature.node.kubernetes.io/cpu-model.vendor_id", "operator": "In",
                               "values": ["NVIDIA"]}]},
        {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]}]}}}


def test_the_nvidia_device_plugin_runs_on_every_gpu_node():
    """Without the plugin on a node its GPUs are never advertised: every worker pod stays Pending."""
    values = _chart(K8S / "gpu" / "kustomization.yaml", "nvidia-device-plugin")["valuesInline"]
    affinity = values.get("affinity", NVIDIA_DEVICE_PLUGIN_CHART_AFFINITY)  # helm replaces the terms list whole
    _runs_on_every_gpu_pool(values["tolerations"], affinity)
