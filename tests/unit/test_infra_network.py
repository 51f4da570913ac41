"""NetworkPolicies admit exactly the flows the product needs (infra/validate.py `product_flows`, part of check
`cluster`): runtime -> worker HTTP and KV events, worker <-> worker NIXL, Prometheus -> worker metrics, SLO probe
-> runtime, pipeline steps -> MLflow; another namespace or endpoint cannot reach the workers or MLflow, and NIXL
is open to the workers only. Each rule is broken once and the break is reported."""

from __future__ import annotations

import copy
import shutil

import pytest

from tests.infra_cluster import REPO, V, model, parsed  # noqa: F401 - fixtures used by name


def _mutated(model, edit):
    m = copy.deepcopy(model)
    edit(m.objects)
    return m


def _worker_policy(objs):
    return next(o for o in objs if o.get("kind") == "NetworkPolicy" and o["metadata"]["name"].endswith("-workers"))


def _problems(m, parsed):
    return V.network_problems(m, parsed)


def test_committed_policies_admit_the_needed_flows_and_deny_the_rest(model, parsed):
    flows = V.product_flows(model, parsed)
    assert _problems(model, parsed) == []
    assert sum(f.admit for f in flows) >= 10 and sum(not f.admit for f in flows) >= 10
    assert {(f.src.what.split(" of ")[0], f.dst.what.split(" of ")[0], f.port) for f in flows if f.admit} >= {
        ("runtime", "prefill worker", "http"), ("runtime", "decode worker", "kv-events"),
        ("prefill worker", "decode worker", "nixl"), ("Prometheus", "decode worker", "http"),
        ("promote in kubeflow", "runtime", "http")}
    assert any(f.dst.what == "MLflow" and f.admit for f in flows)


def _drop_rule(index):
    return lambda objs: _worker_policy(objs)["spec"]["ingress"].pop(index)


def _open_ports(index):
    return lambda objs: _worker_policy(objs)["spec"]["ingress"][index].pop("ports")


@pytest.mark.parametrize("edit,expect", [
    (_drop_rule(1), "runtime of cluster-check (pdserve) -> prefill worker (pdserve) port http is denied, but must be "
                    "admitted"),
    (_drop_rule(1), "-> decode worker (pdserve) port kv-events is denied, but must be admitted"),
    (_drop_rule(0), "prefill worker (pdserve) -> decode worker (pdserve) port nixl is denied"),
    (_drop_rule(2), "Prometheus (monitoring) -> prefill worker (pdserve) port http is denied"),
    (_open_ports(1), "runtime of cluster-check (pdserve) -> prefill worker (pdserve) port nixl is admitted, but must "
                     "be denied"),
    (_open_ports(2), "Prometheus (monitoring) -> decode worker (pdserve) port nixl is admitted"),
    # the workers' own rule widened to every pod of the namespace: another endpoint's runtime gets in
    (lambda objs: _worker_policy(objs)["spec"]["ingress"][0]["from"][0].update(podSelector={}),
     "runtime of another InferenceService (pdserve) -> prefill worker (pdserve) port http is admitted"),
    # no policy at all: everything is open
    (lambda objs: objs.remove(_worker_policy(objs)),
     "a pod of namespace tenant-other (tenant-other) -> prefill worker (pdserve) port nixl is admitted"),
    # an egress policy on the runtime pods without a rule for the workers
    (lambda objs: objs.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                               "metadata": {"name": "runtime-egress", "namespace": "pdserve"},
                               "spec": {"podSelector": {"matchLabels": {"serving.kserve.io/inferenceservice":
                                                                        "cluster-check"}},
                                        "policyTypes": ["Egress"],
                                        "egress": [{"ports": [{"protocol": "UDP", "port": 53}]}]}}),
     "runtime of cluster-check (pdserve) -> decode worker (pdserve) port http is denied"),
])
def test_a_broken_worker_policy_is_reported(model, parsed, edit, expect):
    problems = _problems(_mutated(model, edit), parsed)
    assert any(expect in p for p in problems), problems


@pytest.fixture
def tree(tmp_path):
    shutil.copytree(REPO / "infra", tmp_path / "infra", ignore=shutil.ignore_patterns(".terraform*", "__pycache__"))
    shutil.copytree(REPO / "kserve", tmp_path / "kserve")
    return tmp_path


def _tree_problems(tree, model):
    from runtime.image import DEFAULT_IMAGE

    parsed = V.check_terraform_hcl(tree)[1]
    m = V.cluster_model(tree, parsed, DEFAULT_IMAGE, pipeline=None)
    return V.network_problems(m, parsed)


@pytest.mark.parametrize("old,new,expect", [
    ("                  - kubeflow\n", "", "pipeline step in kubeflow (kubeflow) -> MLflow (mlflow) port http is denied"),
    ("        - namespaceSelector:\n            matchLabels:\n              app.kubernetes.io/part-of: kubeflow-profile\n",
     "", "pipeline step in kubeflow-user-example-com (kubeflow-user-example-com) -> MLflow (mlflow) port http is "
         "denied"),
    ("      ports:\n        - protocol: TCP\n          port: 5000\n",
     "      ports:\n        - protocol: TCP\n          port: 5000\n    - from:\n        - namespaceSelector: {}\n",
     "a pod of namespace tenant-other (tenant-other) -> MLflow (mlflow) port http is admitted"),
])
def test_a_broken_mlflow_policy_is_reported(tree, model, old, new, expect):
    f = tree / "infra/k8s/mlflow/networkpolicy.yaml"
    assert old in f.read_text()
    f.write_text(f.read_text().replace(old, new, 1))
    problems = _tree_problems(tree, model)
    assert any(expect in p for p in problems), problems


def _pod(ns, labels=None, ports=None):
    return V.NetPod("p", ns, labels or {}, ports or {})


def _np(ns, selector, ingress=None, egress=None, types=None):
    spec = {"podSelector": selector}
    if ingress is not None:
        spec["ingress"] = ingress
    if egress is not None:
        spec["egress"] = egress
    if types:
        spec["policyTypes"] = types
    return {"kind": "NetworkPolicy", "metadata": {"name": "x", "namespace": ns}, "spec": spec}


def test_flow_semantics_follow_kubernetes():
    dst = _pod("a", {"app": "w"}, {"http": 8000})
    src = _pod("b", {"role": "r"})
    flow = V.Flow(src, dst, "http", True, "")
    assert V.flow_admitted([], flow)  # no policy: open
    deny_all = _np("a", {})  # policyTypes defaults to Ingress: selected pods accept nothing
    assert not V.flow_admitted([deny_all], flow)
    both = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "b"}},
            "podSelector": {"matchLabels": {"role": "r"}}}
    assert V.flow_admitted([_np("a", {}, ingress=[{"from": [both], "ports": [{"port": "http"}]}])], flow)
    assert not V.flow_admitted([_np("a", {}, ingress=[{"from": [both], "ports": [{"port": 9000}]}])], flow)
    other = V.Flow(_pod("b", {"role": "x"}), dst, 8000, True, "")  # one peer: namespace AND pod must match
    assert not V.flow_admitted([_np("a", {}, ingress=[{"from": [both]}])], other)
    pod_only = {"podSelector": {"matchLabels": {"role": "r"}}}  # a podSelector alone: the policy's namespace only
    assert not V.flow_admitted([_np("a", {}, ingress=[{"from": [pod_only]}])], flow)
    ranged = [{"port": 7000, "endPort": 8500}]
    assert V.flow_admitted([_np("a", {}, ingress=[{"ports": ranged}])], flow)
    assert not V.flow_admitted([_np("b", {}, egress=[])], flow)  # egress section: Egress type implied
    assert V.flow_admitted([_np("b", {"matchLabels": {"role": "other"}}, egress=[])], flow)  # not selected
    with pytest.raises(KeyError):
        V.flow_admitted([], V.Flow(src, dst, "metrics", True, ""))
