"""ServiceAccounts and least-privilege RBAC for a pdserve deployment and for the promoter.

* runtime (`<name>-runtime`): reads EndpointSlices (worker discovery) and, when the planner is on,
  may get/patch/update the `deployments/scale` subresource of exactly its two worker Deployments and
  get/update the planner's leader-election Lease (`planner_lease_name`; `create` on leases, which RBAC cannot
  restrict by name: runtime/server/leader.py creates it when absent), and list/patch pods (the
  `pod-deletion-cost` annotation naming the pods a scale-down removes; RBAC cannot limit `list` by name); one
  planner Role per worker revision (`<name>-<revision>-planner`): the runtime
  replicas of one revision elect one planner leader.
* workers (`<name>-worker`): no API access at all (token not mounted).
* promoter (`pdserve-promoter`, see `promoter_rbac`): manages the rendered kinds in ONE namespace,
  plus get/create/patch on the cluster-scoped ClusterServingRuntime and get/create/update/delete on Leases
  (the per-InferenceService promote lock, runtime/deploy/lease.py). Kubernetes RBAC forbids granting
  permissions one does not hold (escalation prevention, kubernetes.io/docs/reference/access-authn-authz/
  rbac/#privilege-escalation-prevention-and-bootstrapping), so the promoter also holds what the runtime
  role grants (endpointslices read, deployments/scale, pods list/patch).
"""

from __future__ import annotations

from typing import Any

MANAGE = ["get", "list", "watch", "create", "patch", "update", "delete"]
READ = ["get", "list", "watch"]
SCALE = ["get", "patch", "update"]
POD_REMOVAL = ["list", "patch"]  # the planner names the pods it removes (runtime/server/actuators.py)
PROMOTER_NAME = "pdserve-promoter"


def service_account(name: str, namespace: str, labels: dict[str, str], *, automount: bool) -> dict[str, Any]:
    """v1 ServiceAccount; `automount` False keeps the API token out of pods that need no API access."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "automountServiceAccountToken": automount,
    }


def role(name: str, namespace: str, labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "rules": rules,
    }


def role_binding(name: str, namespace: str, labels: dict[str, str], *, role_name: str,
                 sa_name: str, cluster: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": dict(labels)}
    if not cluster:
        meta["namespace"] = namespace
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding" if cluster else "RoleBinding",
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole" if cluster else "Role",
                    "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": namespace}],
    }


def planner_role_name(name: str, revision: str | None) -> str:
    """Name of the planner Role/RoleBinding of one worker revision: `<name>[-<revision>]-planner`."""
    return f"{name}-{revision}-planner" if revision else f"{name}-planner"


def planner_lease_name(name: str, revision: str | None) -> str:
    """Name of the Lease the runtime replicas of one worker revision elect their planner leader on:
    `<name>[-<revision>]-planner-leader`."""
    return f"{planner_role_name(name, revision)}-leader"


LEASE_VERBS = ["get", "update"]  # runtime/server/leader.py: read_namespaced_lease, replace_namespaced_lease


def lease_rbac_rules(lease: str) -> list[dict[str, Any]]:
    """RBAC rules of the planner's leader election on Lease `lease`: get/update on it, create on leases."""
    return [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [lease],
             "verbs": list(LEASE_VERBS)}]


def runtime_rbac(*, name: str, namespace: str, labels: dict[str, str], runtime_sa: str,
                 worker_deployments: list[str], planner: bool, revision: str | None = None,
                 planner_labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Roles + bindings for the runtime ServiceAccount (discovery always, planner scale if `planner`).

    The planner Role/RoleBinding is per worker revision (`planner_role_name`, labelled `planner_labels`,
    e.g. with `pdserve.io/revision`): during a canary both revisions' runtimes share the ServiceAccount, and
    each must keep scaling its own two Deployments; the rollout deletes a revision's Role with its workers.
    """
    objs = [
        role(f"{name}-discovery", namespace, labels,
             [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": READ}]),
        role_binding(f"{name}-discovery", namespace, labels, role_name=f"{name}-discovery", sa_name=runtime_sa),
    ]
    if planner:
        pname, plab = planner_role_name(name, revision), planner_labels or labels
        objs += [
            role(pname, namespace, plab,
                 [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                   "resourceNames": list(worker_deployments), "verbs": SCALE},
                  *lease_rbac_rules(planner_lease_name(name, revision)),
                  {"apiGroups": [""], "resources": ["pods"], "verbs": POD_REMOVAL}]),
            role_binding(pname, namespace, plab, role_name=pname, sa_name=runtime_sa),
        ]
    return objs


def promoter_rbac(namespace: str, *, sa_name: str = PROMOTER_NAME,
                  runtime_name: str = "pdserve") -> list[dict[str, Any]]:
    """Bootstrap objects a cluster admin applies once per namespace so `promote` can run there.

    Returns: ServiceAccount, Role (namespaced kinds), RoleBinding, ClusterRole (only the
    ClusterServingRuntime `runtime_name`; `create` cannot be limited by name in RBAC), ClusterRoleBinding.
    """
    lab = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "promoter"}
    rules = [
        {"apiGroups": ["serving.kserve.io"], "resources": ["inferenceservices"], "verbs": MANAGE},
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": MANAGE},
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": SCALE},
        # workers spanning nodes (runtime/deploy/workers.py worker_leader_worker_set)
        {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"], "verbs": MANAGE},
        {"apiGroups": [""], "resources": ["services", "serviceaccounts"], "verbs": MANAGE},
        {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": POD_REMOVAL},  # granted to the planner
        {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": MANAGE},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": MANAGE},
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": MANAGE},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": READ},
        {"apiGroups": ["monitoring.coreos.com"], "resources": ["servicemonitors", "podmonitors"], "verbs": MANAGE},
        # the promote lock (runtime/deploy/lease.py): one Lease per InferenceService
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update", "delete"]},
    ]
    cluster_name = f"{sa_name}-{namespace}-runtimes"
    return [
        service_account(sa_name, namespace, lab, automount=True),
        role(sa_name, namespace, lab, rules),
        role_binding(sa_name, namespace, lab, role_name=sa_name, sa_name=sa_name),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": cluster_name, "labels": dict(lab)},
            "rules": [
                {"apiGroups": ["serving.kserve.io"], "resources": ["clusterservingruntimes"],
                 "verbs": ["create"]},
                {"apiGroups": ["serving.kserve.io"], "resources": ["clusterservingruntimes"],
                 "resourceNames": [runtime_name], "verbs": ["get", "patch", "update"]},
            ],
        },
        role_binding(cluster_name, namespace, lab, role_name=cluster_name, sa_name=sa_name, cluster=True),
    ]
