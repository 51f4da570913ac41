"""Worker layouts beyond plain TP, from the tuner to Kubernetes objects: DeepSeek-V3 on p5.48xlarge tunes
(`parallelism="auto"`) to workers spanning two nodes, rendered as LeaderWorkerSet groups with vLLM's multi-node
launch, EFA and NIXL over LIBFABRIC; single-node EP / DP-attention workers stay Deployments; what cannot run is
refused by name."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, PoolSpec, SloSpec, WorkloadSpec
from runtime.deploy import workers
from runtime.deploy.errors import ManifestError
from runtime.deploy.render import find, render_all
from runtime.deploy.target import ClusterTarget
from runtime.deploy.validate import validate_object
from runtime.modelfiles.catalog import load_catalog_spec
from runtime.tuner.search import tune

P5 = ClusterTarget(instance_type="p5.48xlarge")


@pytest.fixture(scope="module")
def tuned():
    res = tune(load_catalog_spec("deepseek-v3"), "p5.48xlarge", SloSpec(), WorkloadSpec(), precision="fp8",
               parallelism="auto")
    return res, res.to_deployment_spec(ModelRef(name="deepseek-v3"))


@pytest.fixture(scope="module")
def objs(tuned):
    return render_all(tuned[1], name="dsv3", namespace="pdserve", image="repo/pdserve:1", pvc_name="fsx-claim",
                      target=P5)


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def _container(lws: dict, which: str) -> dict:
    return lws["spec"]["leaderWorkerTemplate"][f"{which}Template"]["spec"]["containers"][0]


def test_the_tuned_layouts_are_written_into_the_spec(tuned):
    res, spec = tuned
    for pool, lay in ((spec.prefill, res.best.prefill), (spec.decode, res.best.decode)):
        assert (pool.tp, pool.pp, pool.dp, pool.ep) == (lay.tp, lay.pp, lay.dp, lay.ep)
        assert pool.nodes == lay.nodes(8) and pool.gpus == lay.gpus
    assert spec.model.mla and spec.precision == "fp8"
    assert DeploymentSpec.model_validate_json(spec.model_dump_json()) == spec


def test_every_multi_node_pool_is_a_leader_worker_set_group_of_its_nodes(tuned, objs):
    _, spec = tuned
    for role in ("prefill", "decode"):
        pool = getattr(spec, role)
        kind = "LeaderWorkerSet" if pool.nodes > 1 else "Deployment"
        w = find(objs, kind, f"dsv3-{role}")
        if kind == "Deployment":
            continue
        assert w["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        assert w["spec"]["replicas"] == pool.replicas
        lwt = w["spec"]["leaderWorkerTemplate"]
        assert lwt["size"] == pool.nodes and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
        for which in ("leader", "worker"):
            c = _container(w, which)
            res = c["resources"]["limits"]
            assert res["nvidia.com/gpu"] == str(pool.gpus // pool.nodes) == "8"  # a whole p5 node per pod
            assert res["vpc.amazonaws.com/efa"] == "32"  # every EFA interface of a p5.48xlarge
            assert c["command"] == workers.SERVE_COMMAND
            env = {e["name"]: e for e in c["env"]}
            assert env["FI_PROVIDER"]["value"] == "efa"
            assert env[workers.NODE_RANK_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == (
                f"metadata.labels['{workers.WORKER_INDEX_LABEL}']")
            kv = _flag(c["args"], "--kv-transfer-config")
            assert '"backends":["LIBFABRIC"]' in kv and '"kv_connector":"NixlConnector"' in kv
            assert _flag(c["args"], "--nnodes") == str(pool.nodes)
        # the Service lists the leaders only: the followers serve no HTTP. It does not take the LeaderWorkerSet's
        # name: the LWS controller creates its own headless Service of that name (publishing not-ready pods, so
        # that the followers resolve their leader before anything is ready) only when none exists
        svc = find(objs, "Service", f"dsv3-{role}-leaders")
        assert svc["spec"]["selector"][workers.WORKER_INDEX_LABEL] == "0"
        assert not [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == f"dsv3-{role}"]
        runtime_args = find(objs, "InferenceService", "dsv3")["spec"]["predictor"]["model"]["args"]
        assert f"--{role}-service=dsv3-{role}-leaders" in runtime_args
        follower = _container(w, "worker")
        assert "--headless" in follower["args"] and "readinessProbe" not in follower
        assert "http" not in {p["name"] for p in follower["ports"]}
        leader = _container(w, "leader")
        assert "--headless" not in leader["args"] and _flag(leader["args"], "--node-rank") == "0"
        assert _flag(follower["args"], "--node-rank") == f"$({workers.NODE_RANK_ENV})"


def test_the_pipelined_prefill_launches_its_stages_across_nodes(tuned, objs):
    _, spec = tuned
    assert spec.prefill.pp == 2 and spec.prefill.nodes == 2 and spec.prefill.tp == 8
    lws = find(objs, "LeaderWorkerSet", "dsv3-prefill")
    for which, addr in (("leader", f"$({workers.POD_IP_ENV})"), ("worker", f"$({workers.LEADER_ADDRESS_ENV})")):
        args = _container(lws, which)["args"]
        assert _flag(args, "--tensor-parallel-size") == "8" and _flag(args, "--pipeline-parallel-size") == "2"
        assert _flag(args, "--distributed-executor-backend") == "mp"
        assert _flag(args, "--master-addr") == addr and _flag(args, "--master-port") == str(workers.PP_MASTER_PORT)
        assert "--data-parallel-size" not in args and "--enable-expert-parallel" not in args


def test_the_wide_ep_decode_launches_its_dp_ranks_across_nodes(tuned, objs):
    _, spec = tuned
    assert (spec.decode.tp, spec.decode.dp, spec.decode.ep, spec.decode.nodes) == (1, 16, True, 2)
    lws = find(objs, "LeaderWorkerSet", "dsv3-decode")
    for which, addr in (("leader", f"$({workers.POD_IP_ENV})"), ("worker", f"$({workers.LEADER_ADDRESS_ENV})")):
        args = _container(lws, which)["args"]
        assert _flag(args, "--tensor-parallel-size") == "1" and _flag(args, "--data-parallel-size") == "16"
        assert _flag(args, "--data-parallel-size-local") == "8" and "--enable-expert-parallel" in args
        assert _flag(args, "--data-parallel-address") == addr
        assert _flag(args, "--data-parallel-rpc-port") == str(workers.DP_RPC_PORT)
        assert "--pipeline-parallel-size" not in args and "--master-addr" not in args


def test_rendered_leader_worker_sets_validate_and_a_broken_one_is_refused(objs):
    lws = find(objs, "LeaderWorkerSet", "dsv3-decode")
    assert "leaderworkerset" in validate_object(lws).lower() or "lws" in validate_object(lws)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["size"] = 0
    with pytest.raises(ManifestError, match="spec.leaderWorkerTemplate.size"):
        validate_object(bad)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(ManifestError, match=r"workerTemplate\.spec\.containers\[0\]\.gpus"):
        validate_object(bad)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(ManifestError, match="restartPolicy"):
        validate_object(bad)
    bad = copy.deepcopy(lws)
    del bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    with pytest.raises(ManifestError, match="workerTemplate"):
        validate_object(bad)


def test_a_single_node_ep_worker_stays_a_deployment():
    spec = DeploymentSpec(model=ModelRef(name="m", mla=True), gpu="H100-SXM", prefill=PoolSpec(tp=8, ep=True),
                          decode=PoolSpec(tp=1, dp=8, ep=True))
    objs = render_all(spec, name="moe", namespace="pdserve", image="repo/pdserve:1", pvc_name="fsx-claim",
                      target=P5)
    assert not [o for o in objs if o["kind"] == "LeaderWorkerSet"]
    dec = find(objs, "Deployment", "moe-decode")["spec"]["template"]["spec"]["containers"][0]
    assert dec["command"] == workers.SERVE_COMMAND
    assert _flag(dec["args"], "--data-parallel-size") == "8" and "--enable-expert-parallel" in dec["args"]
    assert "--nnodes" not in dec["args"] and dec["resources"]["limits"]["nvidia.com/gpu"] == "8"
    pre = find(objs, "Deployment", "moe-prefill")["spec"]["template"]["spec"]["containers"][0]
    assert "--enable-expert-parallel" in pre["args"] and "--data-parallel-size" not in pre["args"]
    assert "selector" in find(objs, "Service", "moe-decode")["spec"]
    assert workers.WORKER_INDEX_LABEL not in find(objs, "Service", "moe-decode")["spec"]["selector"]


def test_a_plain_tp_pool_serialises_and_renders_as_before():
    pool = PoolSpec(tp=2, replicas=2)
    assert set(pool.model_dump()) == {"tp", "replicas", "min_replicas", "max_replicas"}
    spec = DeploymentSpec(model=ModelRef(name="m"), gpu="H100-SXM", prefill=pool, decode=pool)
    dep = find(render_all(spec, name="m", namespace="pdserve", image="repo/pdserve:1", pvc_name="fsx-claim"),
               "Deployment", "m-decode")["spec"]["template"]["spec"]["containers"][0]
    assert dep["command"] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert not {"--nnodes", "--data-parallel-size", "--enable-expert-parallel"} & set(dep["args"])


WIDE = dict(prefill=PoolSpec(tp=8, pp=2, nodes=2), decode=PoolSpec(tp=1, dp=16, ep=True, nodes=2))


@pytest.mark.parametrize("spec_kw,target,match", [
    ({**WIDE, "planner": PlannerSpec(mode="sla")}, P5, "planner sizes and scales plain-TP worker Deployments, not "
                                                       "the LeaderWorkerSet"),
    ({"prefill": PoolSpec(tp=8, ep=True), "decode": PoolSpec(tp=8), "planner": PlannerSpec(mode="load")}, P5,
     r"spec.prefill: the planner .* not the layout of a tp 8 x dp 1 x pp 1 \+ ep worker"),
    (WIDE, ClusterTarget(instance_type="p5.48xlarge", efa=False), "target.efa: false"),
    ({**WIDE, "gpu": "CPU"}, ClusterTarget(), "need EFA between the nodes"),
    ({**WIDE, "prefill": PoolSpec(tp=4, pp=2, nodes=2)}, P5, "takes whole nodes"),
])
def test_multi_node_workers_that_cannot_run_are_refused_by_name(spec_kw, target, match):
    spec = DeploymentSpec(**{"model": ModelRef(name="m", mla=True), "gpu": "H100-SXM", **spec_kw})
    with pytest.raises(ManifestError, match=match):
        render_all(spec, name="m", namespace="pdserve", image="repo/pdserve:1", pvc_name="fsx-claim", target=target)


@pytest.mark.parametrize("kw,match", [
    ({"tp": 1, "dp": 8}, "without ep"),
    ({"tp": 1, "dp": 2, "pp": 2, "ep": True}, "with pipeline stages"),
    ({"tp": 8, "nodes": 2}, "whole tensor-parallel groups per node"),
    ({"tp": 8, "pp": 3, "nodes": 2}, "whole tensor-parallel groups per node|whole pipeline stages"),
    ({"tp": 4, "pp": 2, "nodes": 4}, "whole tensor-parallel groups per node"),
    ({"tp": 2, "dp": 3, "ep": True, "nodes": 2}, "every node runs the same number of data-parallel ranks"),
])
def test_a_layout_a_pool_cannot_hold_is_refused(kw, match):
    with pytest.raises(ValidationError, match=match):
        PoolSpec(**kw)


def test_a_pipelined_decode_pool_is_refused():
    with pytest.raises(ValidationError, match="NixlConnector decode workers refuse pipeline stages"):
        DeploymentSpec(model=ModelRef(name="m"), prefill=PoolSpec(tp=8, pp=2, nodes=2),
                       decode=PoolSpec(tp=8, pp=2, nodes=2))


def test_promote_applies_waits_for_and_cleans_up_leader_worker_sets(objs):
    from runtime.deploy.apply import readiness, referenced_pvcs
    from runtime.deploy.kube import resource_path
    from runtime.deploy.rollout import _worker_objects

    lws = find(objs, "LeaderWorkerSet", "dsv3-decode")
    assert resource_path(lws["apiVersion"], "LeaderWorkerSet", "dsv3-decode", "pdserve") == (
        "/apis/leaderworkerset.x-k8s.io/v1/namespaces/pdserve/leaderworkersets/dsv3-decode")
    assert referenced_pvcs([lws]) == {("pdserve", "fsx-claim")}
    live = copy.deepcopy(lws)
    live["spec"]["replicas"] = 2
    live["status"] = {"readyReplicas": 1, "updatedReplicas": 2}
    assert readiness(live) == (False, "1/2 groups ready, 2 updated")
    live["status"]["readyReplicas"] = 2
    assert readiness(live)[0]
    assert {(o["kind"], o["metadata"]["name"]) for o in _worker_objects(objs) if "decode" in o["metadata"]["name"]} == {
        ("LeaderWorkerSet", "dsv3-decode"), ("Service", "dsv3-decode-leaders"), ("PodDisruptionBudget", "dsv3-decode"),
        ("Service", "dsv3-decode-leaders-kv-events")}  # its DP ranks' KV-event ports on every pod of a group


def test_every_layout_flag_is_one_engine_args_may_not_repeat(objs):
    from runtime.deploy.workers import precision_args
    from runtime.engines.engine_args import RESERVED, engine_arg_flags

    own = set(precision_args(DeploymentSpec(model=ModelRef(name="m"), precision="fp8"), gpu=True))
    for lws in [o for o in objs if o["kind"] == "LeaderWorkerSet"]:
        for which in ("leader", "worker"):
            args = _container(lws, which)["args"]
            flags = {a[2:].split("=", 1)[0] for a in args if a.startswith("--") and a not in own}
            assert flags <= RESERVED.keys(), flags - RESERVED.keys()
    with pytest.raises(ValueError, match="pdserve sets --data-parallel-size itself from the pool's layout"):
        engine_arg_flags(["data-parallel-size=2"])
