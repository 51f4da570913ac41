"""EC2 GPU instance catalog used to place worker pools on Karpenter GPU NodePools.

Each entry is a fact from the AWS documentation page "Amazon EC2 instance types — accelerated
computing" (docs.aws.amazon.com/ec2/latest/instancetypes/ac.html): GPUs per instance, vCPUs, memory
(GiB) and the number of EFA network interfaces (0 = EFA not supported). The NodePool names match the
Karpenter NodePools in infra/k8s/karpenter/ (a test checks that they agree).

This module is pure data + lookups (no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceType:
    """One EC2 GPU instance type.

    Attributes:
        name: EC2 instance type, e.g. "p5.48xlarge".
        gpu: GPU catalog name as used in `DeploymentSpec.gpu` (runtime/perf), e.g. "H100-SXM".
        num_gpus: GPUs per instance.
        num_vcpus: vCPUs per instance.
        memory_gib: instance memory, GiB.
        num_efa_interfaces: EFA interfaces (0 = no EFA).
        node_pool: Karpenter NodePool that provisions it (infra/k8s/karpenter/nodepools.yaml).
    """

    name: str
    gpu: str
    num_gpus: int
    num_vcpus: int
    memory_gib: int
    num_efa_interfaces: int
    node_pool: str

    @property
    def efa_capable(self) -> bool:
        return self.num_efa_interfaces > 0

    def efa_for_every_worker(self, num_gpus: int) -> bool:
        """Whether every worker of `num_gpus` GPUs that fits on the instance gets its own EFA interface: a node
        holds num_gpus_per_instance / num_gpus such workers, each requesting `efa_interfaces_for` (>= 1), so
        with fewer interfaces than that the extra workers could not be scheduled beside the first (their GPUs
        idle, or another node launched)."""
        return self.efa_capable and self.num_efa_interfaces * num_gpus >= self.num_gpus

    def efa_interfaces_for(self, num_gpus: int) -> int:
        """EFA interfaces to request for a pod using `num_gpus` GPUs (proportional share, >= 1)."""
        if not self.efa_capable:
            return 0
        return max(1, self.num_efa_interfaces * num_gpus // self.num_gpus)


INSTANCES: dict[str, InstanceType] = {
    i.name: i
    for i in (
        InstanceType("p5.48xlarge", "H100-SXM", 8, 192, 2048, 32, "gpu-p5"),
        InstanceType("p5e.48xlarge", "H200-SXM", 8, 192, 2048, 32, "gpu-p5e"),
        InstanceType("p5en.48xlarge", "H200-SXM", 8, 192, 2048, 16, "gpu-p5e"),
        InstanceType("p4de.24xlarge", "A100-SXM-80GB", 8, 96, 1152, 4, "gpu-p4de"),
        InstanceType("p4d.24xlarge", "A100-SXM-40GB", 8, 96, 1152, 4, "gpu-p4d"),
        InstanceType("p6-b200.48xlarge", "B200-SXM", 8, 192, 2048, 8, "gpu-p6-b200"),
        InstanceType("g6e.xlarge", "L40S", 1, 4, 32, 0, "gpu-g6e"),
        InstanceType("g6e.2xlarge", "L40S", 1, 8, 64, 0, "gpu-g6e"),
        InstanceType("g6e.4xlarge", "L40S", 1, 16, 128, 0, "gpu-g6e"),
        InstanceType("g6e.8xlarge", "L40S", 1, 32, 256, 1, "gpu-g6e"),
        InstanceType("g6e.12xlarge", "L40S", 4, 48, 384, 1, "gpu-g6e"),
        InstanceType("g6e.24xlarge", "L40S", 4, 96, 768, 2, "gpu-g6e"),
        InstanceType("g6e.48xlarge", "L40S", 8, 192, 1536, 4, "gpu-g6e"),
        InstanceType("g6.xlarge", "L4", 1, 4, 16, 0, "gpu-g6"),
        InstanceType("g6.2xlarge", "L4", 1, 8, 32, 0, "gpu-g6"),
        InstanceType("g6.4xlarge", "L4", 1, 16, 64, 0, "gpu-g6"),
        InstanceType("g6.8xlarge", "L4", 1, 32, 128, 1, "gpu-g6"),
        InstanceType("g6.12xlarge", "L4", 4, 48, 192, 1, "gpu-g6"),
        InstanceType("g6.16xlarge", "L4", 1, 64, 256, 1, "gpu-g6"),
        InstanceType("g6.24xlarge", "L4", 4, 96, 384, 1, "gpu-g6"),
        InstanceType("g6.48xlarge", "L4", 8, 192, 768, 1, "gpu-g6"),
        InstanceType("g5.xlarge", "A10G", 1, 4, 16, 0, "gpu-g5"),
        InstanceType("g5.2xlarge", "A10G", 1, 8, 32, 0, "gpu-g5"),
        InstanceType("g5.4xlarge", "A10G", 1, 16, 64, 0, "gpu-g5"),
        InstanceType("g5.8xlarge", "A10G", 1, 32, 128, 1, "gpu-g5"),
        InstanceType("g5.12xlarge", "A10G", 4, 48, 192, 1, "gpu-g5"),
        InstanceType("g5.16xlarge", "A10G", 1, 64, 256, 1, "gpu-g5"),
        InstanceType("g5.24xlarge", "A10G", 4, 96, 384, 1, "gpu-g5"),
        InstanceType("g5.48xlarge", "A10G", 8, 192, 768, 1, "gpu-g5"),
    )
}

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
            "runtime/deploy/instances.py); to add it, give its InstanceType there and a NodePool in "
            "infra/k8s/karpenter/")


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
