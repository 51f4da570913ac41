"""AWS EC2 GPU instance types — dated data with its source; the one home of ``InstanceType``.

Sizes: GPUs per instance, vCPUs, memory (GiB) and the number of EFA network interfaces (0 = EFA not supported)
from the AWS documentation page "Amazon EC2 instance types — accelerated computing"
(docs.aws.amazon.com/ec2/latest/instancetypes/ac.html). ``node_pool`` names the Karpenter NodePool in
infra/k8s/karpenter/ that provisions the type (a test checks that they agree; runtime/deploy/instances.py places
workers with it).

Prices: US East (N. Virginia), Linux, on-demand, USD per instance-hour, from the AWS EC2 On-Demand pricing
page as of ``PRICE_DATE`` (P4d/P4de/P5/P5en after AWS's June 2025 price reduction of up to 45% on P5 and 33% on
P4). They were recorded from memory of that page, not fetched here (no network to AWS from this machine):
treat them as estimates and refresh with ``aws pricing get-products --service-code AmazonEC2`` before
budgeting. p5e is sold mainly through EC2 Capacity Blocks; it is priced like p5en (same 8x H200).
CPU (this dev machine) has price 0: $/Mtok is then reported as 0.

Network bandwidth between instances (``network_gbps``, EFA where the type has it): the AWS EC2 accelerated
computing instance specifications page (https://aws.amazon.com/ec2/instance-types/, "Network bandwidth
(Gbps)", as of ``NETWORK_DATE``): p5 / p5e / p5en 3200 Gbps EFA (p5en: EFAv3), p6-b200 3200 Gbps (EFAv4),
p4d / p4de 400 Gbps EFA, g6e.48xlarge 400 Gbps, g6e.12xlarge, g6.48xlarge and g5.48xlarge 100 Gbps, the
single-GPU types 20-25 Gbps without EFA (0 here: not used across nodes). Recalled, like the prices.

Pure data + lookup, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

PRICE_DATE = "2025-06-05"
PRICE_SOURCE = "https://aws.amazon.com/ec2/pricing/on-demand/ (us-east-1, Linux); recalled, estimate"
NETWORK_DATE = "2025-06-05"


@dataclass(frozen=True)
class InstanceType:
    """One EC2 instance type: the one home of its facts, for the tuner (price, network) and for placing workers on
    Karpenter NodePools (runtime/deploy/instances.py: vCPUs, memory, EFA interfaces, NodePool).

    Attributes:
        name: EC2 instance type, e.g. "p5.48xlarge".
        gpu: GPU catalog name (runtime.perf.gpus; ``DeploymentSpec.gpu``), e.g. "H100-SXM".
        num_gpus: GPUs per instance.
        usd_per_hour: on-demand USD per instance-hour (``PRICE_SOURCE``); None: not priced here (the tuner
            prices a GPU by its smallest priced type, :func:`instance_for`).
        num_vcpus: vCPUs per instance; memory_gib: instance memory, GiB.
        num_efa_interfaces: EFA interfaces (0 = no EFA).
        node_pool: Karpenter NodePool that provisions it (infra/k8s/karpenter/nodepools.yaml); "" none.
        network_gbps: bandwidth between instances (EFA), Gbit/s; 0: no multi-node serving over it.
    """

    name: str
    gpu: str
    num_gpus: int
    usd_per_hour: float | None
    num_vcpus: int = 0
    memory_gib: int = 0
    num_efa_interfaces: int = 0
    node_pool: str = ""
    network_gbps: float = 0.0
    price_date: str = PRICE_DATE
    source: str = PRICE_SOURCE

    @property
    def usd_per_gpu_hour(self) -> float | None:
        return None if self.usd_per_hour is None else self.usd_per_hour / self.num_gpus

    @property
    def network_bw_per_gpu_bytes_per_s(self) -> float:
        """Each GPU's share of the instance's network bandwidth, bytes/s (``network_gbps / 8 / num_gpus``:
        p5.48xlarge 3200 Gbps = 50 GB/s per GPU); 0 without EFA."""
        return self.network_gbps * 1e9 / 8 / self.num_gpus

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


def _t(name: str, gpu: str, gpus: int, usd: float | None, vcpus: int, mem: int, efa: int, pool: str,
       gbps: float = 0.0) -> InstanceType:
    return InstanceType(name, gpu, gpus, usd, vcpus, mem, efa, pool, gbps)


# name, GPU, GPUs, USD/h (None: not priced), vCPUs, memory GiB, EFA interfaces, NodePool, network Gbit/s
INSTANCES: tuple[InstanceType, ...] = (
    _t("p5.48xlarge", "H100-SXM", 8, 55.04, 192, 2048, 32, "gpu-p5", 3200),
    _t("p5e.48xlarge", "H200-SXM", 8, 63.296, 192, 2048, 32, "gpu-p5e", 3200),
    _t("p5en.48xlarge", "H200-SXM", 8, 63.296, 192, 2048, 16, "gpu-p5e", 3200),
    _t("p4d.24xlarge", "A100-SXM-40GB", 8, 21.96, 96, 1152, 4, "gpu-p4d", 400),
    _t("p4de.24xlarge", "A100-SXM-80GB", 8, 27.447, 96, 1152, 4, "gpu-p4de", 400),
    _t("p6-b200.48xlarge", "B200-SXM", 8, 113.9328, 192, 2048, 8, "gpu-p6-b200", 3200),
    _t("g6e.xlarge", "L40S", 1, 1.861, 4, 32, 0, "gpu-g6e"),
    _t("g6e.2xlarge", "L40S", 1, None, 8, 64, 0, "gpu-g6e"),
    _t("g6e.4xlarge", "L40S", 1, None, 16, 128, 0, "gpu-g6e"),
    _t("g6e.8xlarge", "L40S", 1, None, 32, 256, 1, "gpu-g6e"),
    _t("g6e.12xlarge", "L40S", 4, 10.4926, 48, 384, 1, "gpu-g6e", 100),
    _t("g6e.24xlarge", "L40S", 4, None, 96, 768, 2, "gpu-g6e"),
    _t("g6e.48xlarge", "L40S", 8, 30.1312, 192, 1536, 4, "gpu-g6e", 400),
    _t("g6.xlarge", "L4", 1, 0.8048, 4, 16, 0, "gpu-g6"),
    _t("g6.2xlarge", "L4", 1, None, 8, 32, 0, "gpu-g6"),
    _t("g6.4xlarge", "L4", 1, None, 16, 64, 0, "gpu-g6"),
    _t("g6.8xlarge", "L4", 1, None, 32, 128, 1, "gpu-g6"),
    _t("g6.12xlarge", "L4", 4, 4.6016, 48, 192, 1, "gpu-g6"),
    _t("g6.16xlarge", "L4", 1, None, 64, 256, 1, "gpu-g6"),
    _t("g6.24xlarge", "L4", 4, None, 96, 384, 1, "gpu-g6"),
    _t("g6.48xlarge", "L4", 8, 13.3504, 192, 768, 1, "gpu-g6", 100),
    _t("g5.xlarge", "A10G", 1, 1.006, 4, 16, 0, "gpu-g5"),
    _t("g5.2xlarge", "A10G", 1, None, 8, 32, 0, "gpu-g5"),
    _t("g5.4xlarge", "A10G", 1, None, 16, 64, 0, "gpu-g5"),
    _t("g5.8xlarge", "A10G", 1, None, 32, 128, 1, "gpu-g5"),
    _t("g5.12xlarge", "A10G", 4, 5.672, 48, 192, 1, "gpu-g5"),
    _t("g5.16xlarge", "A10G", 1, None, 64, 256, 1, "gpu-g5"),
    _t("g5.24xlarge", "A10G", 4, None, 96, 384, 1, "gpu-g5"),
    _t("g5.48xlarge", "A10G", 8, 16.288, 192, 768, 1, "gpu-g5", 100),
    InstanceType("local-cpu", "CPU", 1, 0.0, price_date="", source="this development machine"),
)
PRICED: tuple[InstanceType, ...] = tuple(i for i in INSTANCES if i.usd_per_hour is not None)


def get_instance(name: str) -> InstanceType:
    """Look up an instance type by name (e.g. ``p5.48xlarge``).

    Raises:
        KeyError: unknown name; the message lists known names.
    """
    for i in INSTANCES:
        if i.name == name.strip().lower():
            return i
    raise KeyError(f"unknown instance type {name!r}; known: {', '.join(i.name for i in INSTANCES)}")


def instance_for(gpu: str, num_gpus: int) -> InstanceType | None:
    """The priced instance type of ``gpu`` with the fewest GPUs >= ``num_gpus`` (a TP worker's node), else None."""
    fits = [i for i in PRICED if i.gpu == gpu and i.num_gpus >= num_gpus]
    return min(fits, key=lambda i: (i.num_gpus, i.usd_per_hour)) if fits else None


def usd_per_gpu_hour(gpu: str, num_gpus: int = 1, prices: Mapping[str, float] | None = None) -> float | None:
    """USD per GPU-hour for a worker of ``num_gpus`` GPUs of ``gpu``: ``prices[gpu]`` when given (an operator's
    negotiated or reserved price, :func:`parse_price_overrides` / :func:`parse_price_file`), else the on-demand
    price of the smallest AWS type that holds the worker; None when neither has it."""
    if prices and gpu in prices:
        return prices[gpu]
    inst = instance_for(gpu, num_gpus)
    return None if inst is None else inst.usd_per_gpu_hour


def _price(gpu: str, value: object, where: str) -> tuple[str, float]:
    from runtime.perf.gpus import get_gpu  # GPU names and aliases (H100, h100-sxm5-80gb, ...) -> catalog names

    try:
        name = get_gpu(str(gpu).strip()).name
    except KeyError as e:
        raise ValueError(f"{where}: {e.args[0]}") from None
    if isinstance(value, bool):
        raise ValueError(f"{where}: price of {name} must be a number of USD per GPU-hour, got {value!r}")
    try:
        usd = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: price of {name} must be a number of USD per GPU-hour, got {value!r}") from None
    if not math.isfinite(usd) or usd < 0:
        raise ValueError(f"{where}: price of {name} must be a finite USD per GPU-hour >= 0, got {value!r}")
    return name, usd


def parse_price_overrides(items: Iterable[str]) -> dict[str, float]:
    """``["H100-SXM=3.2", "L40S=1.1"]`` (GPU name or alias ``=`` USD per GPU-hour, what ``--usd-per-gpu-hour``
    takes) -> ``{"H100-SXM": 3.2, "L40S": 1.1}``, keyed by catalog name; a later item for the same GPU wins.

    Raises:
        ValueError: an item without '=', an unknown GPU (message lists the names), or a price that is not a
            finite number >= 0.
    """
    out: dict[str, float] = {}
    for item in items:
        gpu, sep, value = str(item).partition("=")
        if not sep or not gpu.strip():
            raise ValueError(f"--usd-per-gpu-hour {item!r}: expected GPU=USD_PER_GPU_HOUR, e.g. H100-SXM=3.2")
        name, usd = _price(gpu, value.strip(), f"--usd-per-gpu-hour {item!r}")
        out[name] = usd
    return out


def parse_price_file(text: str, source: str = "price file") -> dict[str, float]:
    """A price file's text -> ``{catalog GPU name: USD per GPU-hour}``: a JSON or YAML mapping of GPU name or
    alias to USD per GPU-hour (``{"H100-SXM": 3.2}`` / ``H100-SXM: 3.2``). ``source`` names the file in errors.

    Raises:
        ValueError: not a mapping, an unknown GPU, a price that is not a finite number >= 0, or two keys
            naming the same GPU.
    """
    import yaml  # JSON is YAML 1.2; safe_load builds only plain data

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{source}: not JSON or YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not doc:
        raise ValueError(f"{source}: expected a mapping of GPU name to USD per GPU-hour, e.g. {{H100-SXM: 3.2}}")
    out: dict[str, float] = {}
    for gpu, value in doc.items():
        name, usd = _price(gpu, value, source)
        if name in out:
            raise ValueError(f"{source}: {name} is priced twice")
        out[name] = usd
    return out
