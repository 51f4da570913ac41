"""The multi-node launch flags rendered for LeaderWorkerSet pods (runtime/deploy/workers.py `multinode_args`) are
ones the pinned vLLM's `vllm serve` parser accepts, with the values its engine arguments then hold."""

from __future__ import annotations

import re

import pytest

from runtime.config import DeploymentSpec, ModelRef, PoolSpec
from runtime.deploy import workers
from runtime.deploy.render import find, render_all
from runtime.deploy.target import ClusterTarget

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def serve_parser():
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def _expanded(args: list[str], env: dict[str, str]) -> list[str]:
    # what the kubelet does with $(VAR) in container args
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


@pytest.mark.parametrize("role,pool", [
    ("prefill", PoolSpec(tp=8, pp=2, nodes=2)),
    ("decode", PoolSpec(tp=1, dp=16, ep=True, nodes=2)),
])
def test_leader_and_follower_flags_parse_in_vllm(serve_parser, role, pool):
    from vllm.engine.arg_utils import AsyncEngineArgs

    other = PoolSpec(tp=8, pp=2, nodes=2) if role == "decode" else PoolSpec(tp=1, dp=16, ep=True, nodes=2)
    spec = DeploymentSpec(model=ModelRef(name="ds", mla=True), gpu="H100-SXM", precision="fp8",
                          **{role: pool, ("decode" if role == "prefill" else "prefill"): other})
    objs = render_all(spec, name="ds", namespace="pdserve", image="repo/pdserve:1", pvc_name="fsx-claim",
                      target=ClusterTarget(instance_type="p5.48xlarge"))
    lwt = find(objs, "LeaderWorkerSet", f"ds-{role}")["spec"]["leaderWorkerTemplate"]
    for which, rank in (("leader", 0), ("worker", 1)):
        c = lwt[f"{which}Template"]["spec"]["containers"][0]
        assert c["command"][-1] == "serve"
        env = {workers.POD_IP_ENV: "10.0.0.5", workers.LEADER_ADDRESS_ENV: "ds-prefill-0.ds-prefill.pdserve",
               workers.NODE_RANK_ENV: str(rank)}
        ns = serve_parser.parse_args(_expanded(c["args"], env))
        ea = AsyncEngineArgs.from_cli_args(ns)
        assert ns.headless == (which == "worker")
        assert (ea.nnodes, ea.node_rank) == (2, rank)
        assert (ea.tensor_parallel_size, ea.pipeline_parallel_size, ea.data_parallel_size) == (pool.tp, pool.pp,
                                                                                               pool.dp)
        assert ea.enable_expert_parallel == pool.ep
        if pool.dp > 1:
            assert ea.data_parallel_size_local == 8 and ea.data_parallel_rpc_port == workers.DP_RPC_PORT
            assert ea.data_parallel_address == ("10.0.0.5" if rank == 0 else "ds-prefill-0.ds-prefill.pdserve")
        else:
            assert ea.distributed_executor_backend == "mp" and ea.master_port == workers.PP_MASTER_PORT
