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

import math
from collections.abc import Iterable, Mapping
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
