"""AWS EC2 GPU instance types with on-demand prices — dated data with its source.

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

from dataclasses import dataclass

PRICE_DATE = "2025-06-05"
PRICE_SOURCE = "https://aws.amazon.com/ec2/pricing/on-demand/ (us-east-1, Linux); recalled, estimate"
NETWORK_DATE = "2025-06-05"


@dataclass(frozen=True)
class InstanceType:
    """One EC2 instance type: ``num_gpus`` of ``gpu`` (a runtime.perf.gpus name) at ``usd_per_hour``."""

    name: str
    gpu: str
    num_gpus: int
    usd_per_hour: float
    price_date: str = PRICE_DATE
    source: str = PRICE_SOURCE
    network_gbps: float = 0.0  # between instances (EFA), Gbit/s; 0: no multi-node serving over it

    @property
    def usd_per_gpu_hour(self) -> float:
        return self.usd_per_hour / self.num_gpus

    @property
    def network_bw_per_gpu_bytes_per_s(self) -> float:
        """Each GPU's share of the instance's network bandwidth, bytes/s (``network_gbps / 8 / num_gpus``:
        p5.48xlarge 3200 Gbps = 50 GB/s per GPU); 0 without EFA."""
        return self.network_gbps * 1e9 / 8 / self.num_gpus


INSTANCES: tuple[InstanceType, ...] = (
    InstanceType("p5.48xlarge", "H100-SXM", 8, 55.04, network_gbps=3200),
    InstanceType("p5e.48xlarge", "H200-SXM", 8, 63.296, network_gbps=3200),
    InstanceType("p5en.48xlarge", "H200-SXM", 8, 63.296, network_gbps=3200),
    InstanceType("p4d.24xlarge", "A100-SXM-40GB", 8, 21.96, network_gbps=400),
    InstanceType("p4de.24xlarge", "A100-SXM-80GB", 8, 27.447, network_gbps=400),
    InstanceType("p6-b200.48xlarge", "B200-SXM", 8, 113.9328, network_gbps=3200),
    InstanceType("g6e.xlarge", "L40S", 1, 1.861),
    InstanceType("g6e.12xlarge", "L40S", 4, 10.4926, network_gbps=100),
    InstanceType("g6e.48xlarge", "L40S", 8, 30.1312, network_gbps=400),
    InstanceType("g6.xlarge", "L4", 1, 0.8048),
    InstanceType("g6.12xlarge", "L4", 4, 4.6016),
    InstanceType("g6.48xlarge", "L4", 8, 13.3504, network_gbps=100),
    InstanceType("g5.xlarge", "A10G", 1, 1.006),
    InstanceType("g5.12xlarge", "A10G", 4, 5.672),
    InstanceType("g5.48xlarge", "A10G", 8, 16.288, network_gbps=100),
    InstanceType("local-cpu", "CPU", 1, 0.0, price_date="", source="this development machine"),
)


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
    """The instance type of ``gpu`` with the fewest GPUs >= ``num_gpus`` (a TP worker's node), else None."""
    fits = [i for i in INSTANCES if i.gpu == gpu and i.num_gpus >= num_gpus]
    return min(fits, key=lambda i: (i.num_gpus, i.usd_per_hour)) if fits else None


def usd_per_gpu_hour(gpu: str, num_gpus: int = 1) -> float | None:
    """On-demand USD per GPU-hour for a worker of ``num_gpus`` GPUs of ``gpu``; None when no AWS type has it."""
    inst = instance_for(gpu, num_gpus)
    return None if inst is None else inst.usd_per_gpu_hour
