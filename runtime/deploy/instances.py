"""Where workers run: the EC2 instance types Karpenter GPU NodePools provision, by name, and each GPU's default.

The instance types and their facts live in runtime/perf/instances.py (one ``InstanceType``); here are the ones
with a NodePool (``InstanceType.node_pool``, infra/k8s/karpenter/, a test checks that they agree) and the lookups
that place a worker pool. Pure data + lookups (no I/O).
"""

from __future__ import annotations

from runtime.perf.instances import INSTANCES as _ALL, InstanceType

INSTANCES: dict[str, InstanceType] = {i.name: i for i in _ALL if i.node_pool}  # name -> a NodePool's type

# The instance a GPU name maps to by default: the largest of its family (most GPUs, EFA).
DEFAULT_INSTANCE_FOR_GPU: dict[str, str] = {
    "H100-SXM": "p5.48xlarge",
    "H200-SXM": "p5e.48xlarge",
    "A100-SXM-80GB": "p4de.24xlarge",
    "A100-SXM-40GB": "p4d.24xlarge",
    "B200-SXM": "p6-b200.48xlarge",
    "L40S": "g6e.48xlarge",
    "L4": "g6.48xlarge",
    "A10G": "g5.48xlarge",
}

CPU_GPU_NAME = "CPU"


def deployable_problem(gpu_option: str, gpu: str) -> str | None:
    """Why ``pdserve promote`` could not place workers for ``--gpu gpu_option`` (resolved to catalog GPU ``gpu``)
    on a NodePool, with how to add it; None when it can (an instance type in ``INSTANCES``, or a GPU with a
    default instance, or the "CPU" pseudo-GPU, whose workers need no GPU node)."""
    is_instance_type = "." in gpu_option  # EC2 names are family.size; GPU catalog names have no dot
    if gpu == CPU_GPU_NAME or gpu_option in INSTANCES or (not is_instance_type and gpu in DEFAULT_INSTANCE_FOR_GPU):
        return None
    return (f"{gpu_option!r} ({gpu}) can be tuned but not deployed: no Karpenter NodePool provisions it "
            f"(deployable: {', '.join(sorted(DEFAULT_INSTANCE_FOR_GPU))} and their instance types in "
            "runtime/perf/instances.py with a node_pool); to add it, give its InstanceType a node_pool there and a "
            "NodePool in infra/k8s/karpenter/")


def instance_for(gpu: str, instance_type: str | None = None) -> InstanceType | None:
    """The instance type to run `gpu` workers on; None for the "CPU" pseudo-GPU (no GPU node).

    Raises:
        KeyError: unknown instance type, no default instance for the GPU, or an instance whose GPU
            differs from `gpu` (message names the field `gpu`/`instance_type` and the known values).
    """
    if gpu == CPU_GPU_NAME and instance_type is None:
        return None
    if instance_type is None:
        if gpu not in DEFAULT_INSTANCE_FOR_GPU:
            raise KeyError(
                f"gpu {gpu!r} has no default EC2 instance type; known: {sorted(DEFAULT_INSTANCE_FOR_GPU)} "
                f"(or set instance_type)"
            )
        instance_type = DEFAULT_INSTANCE_FOR_GPU[gpu]
    if instance_type not in INSTANCES:
        raise KeyError(f"instance_type {instance_type!r} unknown; known: {sorted(INSTANCES)}")
    inst = INSTANCES[instance_type]
    if inst.gpu != gpu:
        raise KeyError(f"instance_type {instance_type!r} carries {inst.gpu}, but gpu is {gpu!r}")
    return inst
