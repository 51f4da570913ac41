"""KV cache tiers in the rendered workers (docs/architecture.md#kv-cache-tiers).

Specification:
* ``engine.kv_offload.cpu_gib > 0`` composes vLLM's NixlConnector (first) with its OffloadingConnector in a
  MultiConnector; a ``disk_path`` adds the TieringOffloadingSpec with a filesystem secondary tier; both
  publish self-describing KV events. Aggregated workers get the offloading connector alone. vLLM 0.28's own
  config classes and factories accept every part (the same check a worker makes at start-up).
* the local launch args parse with vLLM's own CLI parser into that KVTransferConfig;
* the Kubernetes workers carry the same config, memory for the CPU tier (refused when it does not fit the
  pod's share of the node) and a writable volume at the filesystem tier's path;
* a CPU tier on gpu "CPU" and a disk tier without a CPU tier are refused with a clear error.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from runtime.config import DeploymentSpec, EngineSpec, KvOffloadSpec, ModelRef, PoolSpec
from runtime.deploy.errors import ManifestError
from runtime.deploy.render import render_all
from runtime.engines.vllm_worker import build_vllm_args, kv_transfer_config

TIERED = EngineSpec(kv_offload=KvOffloadSpec(cpu_gib=8, disk_path="/var/cache/kv"))


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_no_tier_keeps_the_plain_nixl_connector():
    assert kv_transfer_config(EngineSpec())["kv_connector"] == "NixlConnector"
    assert kv_transfer_config(EngineSpec(), nixl=False) is None


def test_a_cpu_tier_composes_nixl_first_with_the_offloading_connector():
    cfg = kv_transfer_config(EngineSpec(kv_offload=KvOffloadSpec(cpu_gib=1.5)), cpu=False)
    assert (cfg["kv_connector"], cfg["kv_role"]) == ("MultiConnector", "kv_both")
    nixl, off = cfg["kv_connector_extra_config"]["connectors"]
    assert nixl == kv_transfer_config(EngineSpec(), cpu=False)
    assert off == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"cpu_bytes_to_use": int(1.5 * 2**30),
                                                 "self_describing_kv_events": True}}
    alone = kv_transfer_config(EngineSpec(kv_offload=KvOffloadSpec(cpu_gib=1.5)), nixl=False)
    assert alone == off


def test_every_part_is_accepted_by_vllms_own_config_classes_and_factories():
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    cfg = kv_transfer_config(TIERED, cpu=False)
    top = KVTransferConfig(**cfg)
    assert KVConnectorFactory.get_connector_class(top).__name__ == "MultiConnector"
    names = []
    for child in top.kv_connector_extra_config["connectors"]:  # as MultiConnector builds its children
        names.append(KVConnectorFactory.get_connector_class(KVTransferConfig(**child)).__name__)
    assert names[0].startswith("Nixl") and names[1] == "OffloadingConnector"  # 0.28: NixlPullConnector class
    extra = cfg["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra).__name__ == "TieringOffloadingSpec"
    (tier,) = extra["secondary_tiers"]
    tier_cls = SecondaryTierFactory.get_tier_class(tier)
    assert tier_cls.__name__ == "FileSystemTierManager"
    kwargs = {k: v for k, v in tier.items() if k != "type"}  # what SecondaryTierFactory passes on
    inspect.signature(tier_cls).bind(offloading_spec=None, primary_kv_view=None, tier_type="fs", **kwargs)
    cpu_only = kv_transfer_config(EngineSpec(kv_offload=KvOffloadSpec(cpu_gib=1)), cpu=False)
    off_extra = cpu_only["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(off_extra).__name__ == "CPUOffloadingSpec"


def test_local_launch_args_parse_into_the_composed_config():
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    for role, connector in (("prefill", "MultiConnector"), ("decode", "MultiConnector"),
                            ("both", "OffloadingConnector")):
        args = build_vllm_args(TIERED, model_dir=Path("/m"), served_model_name="tiny", role=role,
                               host="127.0.0.1", port=8123, python="/py", cpu=False, kv_events_port=5599)
        ea = AsyncEngineArgs.from_cli_args(parser.parse_args(args[3:]))
        assert ea.kv_transfer_config.kv_connector == connector
        assert ea.kv_offloading_size is None  # the tier is configured on the connector, not by this flag
        assert ea.enable_prefix_caching


def _spec(**engine) -> DeploymentSpec:
    return DeploymentSpec(model=ModelRef(name="m"), gpu="H100-SXM", prefill=PoolSpec(tp=2, replicas=1),
                          decode=PoolSpec(tp=4, replicas=1), engine=EngineSpec(**engine))


def _workers(spec: DeploymentSpec) -> dict[str, dict]:
    objs = render_all(spec, name="m", namespace="ns", image="img:1", pvc_name="pvc")
    return {o["metadata"]["name"].rsplit("-", 1)[1]: o["spec"]["template"]["spec"]
            for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].rsplit("-", 1)[1]
            in ("prefill", "decode")}


def test_rendered_workers_carry_the_tiers_memory_and_a_disk_volume():
    plain = _workers(_spec())
    tiered = _workers(_spec(kv_offload=KvOffloadSpec(cpu_gib=100, disk_path="/var/cache/kv")))
    for role, gpus in (("prefill", 2), ("decode", 4)):
        c0, c1 = plain[role]["containers"][0], tiered[role]["containers"][0]
        cfg = json.loads(_flag(c1["args"], "--kv-transfer-config"))
        assert cfg == kv_transfer_config(_spec(kv_offload=KvOffloadSpec(cpu_gib=100, disk_path="/var/cache/kv"))
                                         .engine, cpu=False, backends=["LIBFABRIC"])
        assert "--kv-events-config" in c1["args"]  # the tiers' events need the publisher
        mem = int(c1["resources"]["limits"]["memory"].removesuffix("Gi"))
        assert mem == int(c0["resources"]["limits"]["memory"].removesuffix("Gi")) + 100
        assert {"name": "kv-offload", "mountPath": "/var/cache/kv"} in c1["volumeMounts"]
        assert {"name": "kv-offload", "emptyDir": {}} in tiered[role]["volumes"]
        assert all(v["name"] != "kv-offload" for v in plain[role]["volumes"])
        assert gpus == int(c1["resources"]["limits"]["nvidia.com/gpu"])


def test_a_cpu_tier_beyond_the_pods_share_of_node_memory_is_refused():
    # p5.48xlarge: 2048 GiB / 8 GPUs; a TP2 pod works in 0.75 x 512 = 384 GiB and may add 128 GiB at most
    _workers(_spec(kv_offload=KvOffloadSpec(cpu_gib=128)))
    with pytest.raises(ManifestError, match="kv_offload.cpu_gib 129.*512 GiB share"):
        _workers(_spec(kv_offload=KvOffloadSpec(cpu_gib=129)))


def test_bad_tier_specs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="disk_path needs kv_offload.cpu_gib > 0"):
        KvOffloadSpec(disk_path="/x")
    with pytest.raises(ValueError, match="CUDA/XPU GPUs only"):
        DeploymentSpec(model=ModelRef(name="m"), gpu="CPU", engine=EngineSpec(kv_offload=KvOffloadSpec(cpu_gib=1)))
    with pytest.raises(ValueError):
        KvOffloadSpec(cpu_gib=-1)


def test_each_data_parallel_engine_holds_its_own_cpu_tier():
    spec = DeploymentSpec(model=ModelRef(name="m"), gpu="H100-SXM", prefill=PoolSpec(tp=1, replicas=1),
                          decode=PoolSpec(tp=1, dp=2, ep=True, replicas=1),
                          engine=EngineSpec(kv_offload=KvOffloadSpec(cpu_gib=10)))
    plain = _workers(spec.model_copy(update={"engine": EngineSpec()}))
    tiered = _workers(spec)
    mem = {w: {k: int(v[w]["containers"][0]["resources"]["limits"]["memory"].removesuffix("Gi"))
               for k, v in (("plain", plain), ("tiered", tiered))} for w in ("prefill", "decode")}
    assert mem["prefill"]["tiered"] - mem["prefill"]["plain"] == 10
    assert mem["decode"]["tiered"] - mem["decode"]["plain"] == 20  # two vLLM engines, one tier each
