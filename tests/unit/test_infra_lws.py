"""Check `cluster` (infra/validate.py) covers workers spanning nodes: the LeaderWorkerSet render's leader and
follower pods are checked for their ServiceAccount, claims and images, promote's rights on LeaderWorkerSets, and
the NetworkPolicy flows among a multi-node worker's pods. Each rule is broken once and the break is reported."""

from __future__ import annotations

import copy
import shutil

import pytest

from tests.infra_cluster import REPO, V, model, parsed  # noqa: F401 - fixtures used by name


def _lws(objs, role="decode"):
    return next(o for o in objs if o.get("kind") == "LeaderWorkerSet"
                and o["metadata"]["name"] == f"{V.CHECK_LWS_ISVC}-{role}")


def _rebuilt(model, edit):
    """The model with `edit` applied to its objects and the promote render's pods derived again."""
    m = copy.deepcopy(model)
    edit(m.objects)
    runtimes = [o for o in m.objects if o.get("kind") == "ClusterServingRuntime"]
    m.pods = [p for p in m.pods if not p.where.startswith("promote render")]
    m.pods += [p for o in m.objects if (o.get("metadata") or {}).get("namespace") == V.DEPLOY_NAMESPACE
               and o.get("kind") in ("Deployment", "LeaderWorkerSet", "InferenceService")
               for p in V.pod_uses(o, "promote render", pdserve=True, runtimes=runtimes)]
    return m


def test_the_model_holds_the_leader_worker_set_pods_and_flows(model, parsed):
    lws_pods = [p for p in model.pods if "LeaderWorkerSet" in p.where]
    # two pools x (leader, worker) templates, each on the FSx claim as the worker ServiceAccount
    assert len(lws_pods) == 4
    assert {p.service_account for p in lws_pods} == {f"{V.CHECK_LWS_ISVC}-worker"}
    assert all(p.claims == ["fsx-claim"] for p in lws_pods)
    flows = V.multinode_flows(model)
    assert sum(f.admit for f in flows) >= 8 and sum(not f.admit for f in flows) >= 4
    assert V.reference_problems(model) == [] and V.image_problems(model) == []
    assert V.rbac_problems(model) == [] and V.network_problems(model, parsed) == []
    assert any(n.resource == "leaderworkersets" for n in model.needs)


def _follower_pod(objs):
    return _lws(objs)["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]


def test_a_follower_without_its_service_account_is_reported(model):
    m = _rebuilt(model, lambda objs: _follower_pod(objs).update(serviceAccountName="nobody"))
    problems = V.reference_problems(m)
    assert any(f"LeaderWorkerSet pdserve/{V.CHECK_LWS_ISVC}-decode worker pods: ServiceAccount pdserve/nobody "
               "does not exist" in p for p in problems), problems


def test_a_follower_claim_that_does_not_exist_is_reported(model):
    def edit(objs):
        _follower_pod(objs)["volumes"][0]["persistentVolumeClaim"]["claimName"] = "gone"
    problems = V.reference_problems(_rebuilt(model, edit))
    assert any("worker pods: PersistentVolumeClaim pdserve/gone does not exist" in p for p in problems), problems


def test_a_leader_image_from_another_registry_is_reported(model):
    def edit(objs):
        _lws(objs, "prefill")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0][
            "image"] = "docker.io/someone/vllm:1"
    problems = V.image_problems(_rebuilt(model, edit))
    assert any(f"{V.CHECK_LWS_ISVC}-prefill leader pods: image docker.io/someone/vllm:1 is not from the configured"
               in p for p in problems), problems


def test_promote_without_rights_on_leader_worker_sets_is_reported(tmp_path):
    pytest.importorskip("kfp")
    from runtime.image import DEFAULT_IMAGE

    shutil.copytree(REPO / "infra", tmp_path / "infra", ignore=shutil.ignore_patterns(".terraform*", "__pycache__"))
    shutil.copytree(REPO / "kserve", tmp_path / "kserve")
    f = tmp_path / "kserve/promoter-rbac.yaml"
    old = "  - leaderworkerset.x-k8s.io\n  resources:\n  - leaderworkersets\n"
    assert old in f.read_text()
    f.write_text(f.read_text().replace(old, "  - leaderworkerset.x-k8s.io\n  resources:\n  - statefulsets\n", 1))
    parsed = V.check_terraform_hcl(tmp_path)[1]
    problems = V.rbac_problems(V.cluster_model(tmp_path, parsed, DEFAULT_IMAGE))
    assert any("may not create/delete/get/patch leaderworkerset.x-k8s.io/leaderworkersets in namespace pdserve"
               in p for p in problems), problems


def _worker_policy(objs):
    return next(o for o in objs if o.get("kind") == "NetworkPolicy"
                and o["metadata"]["name"] == f"{V.CHECK_LWS_ISVC}-workers")


def _leaders_only(objs):
    # a policy that selects the leaders only leaves the followers open to every pod of the cluster
    from runtime.deploy.workers import WORKER_INDEX_LABEL

    _worker_policy(objs)["spec"]["podSelector"]["matchExpressions"].append(
        {"key": WORKER_INDEX_LABEL, "operator": "In", "values": ["0"]})


def _runtime_rule_for_leader_ranks(objs):
    rule = next(r for r in _worker_policy(objs)["spec"]["ingress"]
                if any(p["port"] == "kv-events" for p in r.get("ports") or []))
    rule["ports"] = [p for p in rule["ports"] if p["port"] == "http" or p["port"] == "kv-events"
                     or (p["port"].startswith("kv-events-") and int(p["port"].rsplit("-", 1)[1]) < 8)]


@pytest.mark.parametrize("edit,expect", [
    (_leaders_only, f"a pod of namespace tenant-other (tenant-other) -> decode worker pod of {V.CHECK_LWS_ISVC} "
                    "(pdserve) port 5600 is admitted, but must be denied"),
    # the workers' own rule gone: the followers cannot reach the leader's rendezvous
    (lambda objs: _worker_policy(objs)["spec"]["ingress"].pop(0),
     f"prefill worker pod of {V.CHECK_LWS_ISVC} (pdserve) -> prefill leader pod of {V.CHECK_LWS_ISVC} (pdserve) "
     "port 29501 is denied, but must be admitted"),
    # the workers' rule narrowed to the named NIXL port: the other DP ranks' side channels are shut
    (lambda objs: _worker_policy(objs)["spec"]["ingress"][0].update(ports=[{"protocol": "TCP", "port": "nixl"}]),
     "port 5609 is denied, but must be admitted"),
    # the runtime's rule opens the leaders' rank ports only: the ranks on the follower pods publish unheard
    (_runtime_rule_for_leader_ranks,
     f"runtime of {V.CHECK_LWS_ISVC} (pdserve) -> decode worker pod of {V.CHECK_LWS_ISVC} (pdserve) port "
     "kv-events-8 is denied, but must be admitted"),
])
def test_a_broken_policy_for_multi_node_workers_is_reported(model, parsed, edit, expect):
    m = copy.deepcopy(model)
    edit(m.objects)
    problems = V.network_problems(m, parsed)
    assert any(expect in p for p in problems), problems
