"""A checkpoint's weight and KV-cache precision, read from its ``quantization_config``.

Pure: takes the already-parsed ``quantization_config`` object (``config.json``, or a TensorRT Model Optimizer
``hf_quant_config.json`` restated as one by ``runtime.modelfiles.load``).

Formats (``WEIGHT_FORMATS``) and how they are recognised, as vLLM 0.28 selects its quantization method
(``vllm/model_executor/layers/quantization``):

* ``bf16``: no ``quantization_config`` (fp16 / fp32 checkpoints are served in the engine's 16-bit dtype).
* ``fp8``: ``quant_method`` ``fp8`` without ``weight_block_size`` (per-tensor scales, ``fp8.py``),
  ``fbgemm_fp8`` (per-channel), ModelOpt ``quant_algo`` ``FP8``, compressed-tensors 8-bit float weights with
  the ``tensor`` or ``channel`` strategy.
* ``fp8-block``: ``fp8`` with ``weight_block_size`` (DeepSeek-V3/R1: 128 x 128 blocks, one fp32 scale each),
  ModelOpt ``FP8_PB_WO``, compressed-tensors 8-bit float ``block`` strategy.
* ``mxfp4``: ``quant_method`` ``mxfp4`` (gpt-oss, experts only; OCP Microscaling v1.0: 32 FP4 values share one
  8-bit exponent), compressed-tensors 4-bit float weights in groups of 32 (every linear layer not ignored).
* ``nvfp4``: ModelOpt ``quant_algo`` ``NVFP4`` (vLLM ``modelopt_fp4``; 16 FP4 values share one FP8 scale, plus
  a per-tensor fp32 scale), compressed-tensors 4-bit float weights in groups of 16.
* ``unknown``: any other method (AWQ, GPTQ, bitsandbytes, a ModelOpt algorithm other than the above, ...).
  The checkpoint's precision cannot be told from its config alone; ``CheckpointPrecision.note`` says so and
  it is sized as ``bf16`` (its weights are smaller than that, so the sizing is conservative) and costed at the
  bf16 GEMM rate whatever the deployment precision (vLLM runs AWQ / GPTQ weight-only, Marlin W4A16).

Modules a checkpoint keeps in 16 bits (``CheckpointPrecision.unquantized``), by the key vLLM 0.28 reads for
each method: ``fp8`` ``ignored_layers`` (else ``modules_to_not_convert``), ``fbgemm_fp8`` and ``mxfp4``
``modules_to_not_convert``, compressed-tensors ``ignore``, ModelOpt ``exclude_modules`` (``ignore`` /
``ignored_layers`` as fallbacks). Entries are full module paths (``model.layers.0.self_attn.k_proj``),
compressed-tensors regexes (``re:...``, matched from the start of the name) or ModelOpt wildcards (``*``);
``module_unquantized`` matches a name against them.

Block-wise FP8 (``fp8`` with ``weight_block_size``, compressed-tensors ``block`` strategy with
``block_structure``, ModelOpt ``FP8_PB_WO`` at vLLM's fixed 128 x 128) records its ``[block_n, block_k]`` in
``CheckpointPrecision.block_size``: vLLM refuses tensor-parallel shards that split a block
(``runtime.models.spec.ModelSpec.block_quant_problem``).

The KV cache is ``fp8`` when the checkpoint carries calibrated FP8 KV scales (ModelOpt ``kv_cache_quant_algo``
``FP8``, compressed-tensors ``kv_cache_scheme`` of 8-bit floats); vLLM uses them with ``--kv-cache-dtype fp8``.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

WEIGHT_FORMATS = ("bf16", "fp8", "fp8-block", "mxfp4", "nvfp4", "unknown")

# Bytes per quantised weight, scales included:
# fp8 per-tensor: 1 (one fp32 scale per tensor); fp8 128 x 128 blocks: 1 + 4 / 16384 (one fp32 scale a block,
# DeepSeek-V3 config ``weight_block_size``); MXFP4: (32 x 4 + 8) / 32 bits (OCP MX v1.0, E8M0 scale per 32);
# NVFP4: (16 x 4 + 8) / 16 bits (FP8 E4M3 scale per 16, NVIDIA "Introducing NVFP4", 2025-06-24).
BYTES_PER_PARAM = {"bf16": 2.0, "fp8": 1.0, "fp8-block": 1.0 + 4.0 / (128 * 128), "mxfp4": 4.25 / 8,
                   "nvfp4": 4.5 / 8, "unknown": 2.0}
# The PerfModel precision each format is costed at (runtime.perf.model.WEIGHT_BYTES names).
PERF_PRECISION = {"bf16": "bf16", "fp8": "fp8", "fp8-block": "fp8", "mxfp4": "fp4", "nvfp4": "fp4",
                  "unknown": "bf16"}

_MODELOPT_ALGOS = {"FP8": "fp8", "FP8_PB_WO": "fp8-block", "NVFP4": "nvfp4"}
#: (block_n, block_k) of ModelOpt ``FP8_PB_WO`` weights: vLLM 0.28 ``ModelOptFp8PbWoLinearMethod._WEIGHT_BLOCK_SIZE``
#: (``quantization/modelopt.py``), a constant; the checkpoint's config does not set it
MODELOPT_PB_WO_BLOCK = (128, 128)


@dataclass(frozen=True)
class CheckpointPrecision:
    """What a checkpoint stores: ``weights`` (one of ``WEIGHT_FORMATS``), ``kv_cache`` (``fp8`` when it carries
    FP8 KV scales, else ``""``), the ``method`` its config names (``""`` for none) and, when the precision
    cannot be told, a ``note`` saying why and what is assumed."""

    weights: str = "bf16"
    kv_cache: str = ""
    method: str = ""
    note: str = ""
    # block-wise FP8: (block_n, block_k) of the weight blocks; () otherwise
    block_size: tuple[int, ...] = ()
    # the modules the config keeps unquantised (names, ``re:`` regexes or ``*`` wildcards), as listed
    unquantized: tuple[str, ...] = ()

    @property
    def quantized(self) -> bool:
        """True when the weights are stored narrower than 16 bits in a format pdserve models."""
        return self.weights not in ("bf16", "unknown")

    @property
    def bytes_per_param(self) -> float:
        """Bytes per quantised weight, scales included (``BYTES_PER_PARAM``)."""
        return BYTES_PER_PARAM[self.weights]

    @property
    def perf_precision(self) -> str:
        """The ``runtime.perf.model.PerfModel`` precision the weights are costed at (bf16, fp8 or fp4)."""
        return PERF_PRECISION[self.weights]


def detect_precision(quant: Any, name: str = "") -> CheckpointPrecision:
    """The precision of a checkpoint from its ``quantization_config`` (None or ``{}``: bf16).

    Args:
        quant: the parsed ``quantization_config`` object.
        name: model name for the note.

    Returns:
        CheckpointPrecision; ``weights == "unknown"`` with a ``note`` when the method is not one of those in
        the module docstring. Never raises on an unknown method: the caller decides (the tuner sizes it as
        bf16 and reports the note).

    Raises:
        TypeError: ``quant`` is neither None nor a dict (``ModelSpec`` reports it as a ModelConfigError).
    """
    if not quant:
        return CheckpointPrecision()
    if not isinstance(quant, dict):
        raise TypeError(f"quantization_config must be a JSON object, got {type(quant).__name__}")
    method = str(quant.get("quant_method") or "")
    m = method.lower()
    who = f"{name}: " if name else ""
    if m == "fp8":
        block = _block(quant.get("weight_block_size"))
        skip = _names(quant.get("ignored_layers")) or _names(quant.get("modules_to_not_convert"))
        return CheckpointPrecision("fp8-block" if quant.get("weight_block_size") else "fp8", method=method,
                                   block_size=block,
                                   unquantized=skip)
    if m == "fbgemm_fp8":
        return CheckpointPrecision("fp8", method=method, unquantized=_names(quant.get("modules_to_not_convert")))
    if m == "mxfp4":
        return CheckpointPrecision("mxfp4", method=method,
                                   unquantized=_names(quant.get("modules_to_not_convert")))
    if m in ("modelopt", "modelopt_fp4"):
        algo = str(quant.get("quant_algo") or ("NVFP4" if m == "modelopt_fp4" else "")).upper()
        kv = "fp8" if str(quant.get("kv_cache_quant_algo") or "").upper() == "FP8" else ""
        fmt = _MODELOPT_ALGOS.get(algo)
        if fmt is None:
            return CheckpointPrecision("unknown", kv, method, note=(
                f"{who}ModelOpt quant_algo {algo or '(none)'!r} is not a format pdserve models "
                f"({', '.join(_MODELOPT_ALGOS)}); sized as bf16, which overstates its weights"))
        skip = (_names(quant.get("exclude_modules")) or _names(quant.get("ignore"))
                or _names(quant.get("ignored_layers")))
        # FP8_PB_WO: vLLM's ModelOptFp8PbWoLinearMethod fixes its blocks at 128 x 128 whatever the config says
        block = MODELOPT_PB_WO_BLOCK if algo == "FP8_PB_WO" else ()
        return CheckpointPrecision(fmt, kv, method, block_size=block, unquantized=skip)
    if m == "compressed-tensors":
        return _compressed_tensors(quant, method, who)
    return CheckpointPrecision("unknown", method=method, note=(
        f"{who}quantization_config.quant_method {method or '(none)'!r} is not a format pdserve models "
        "(fp8, fbgemm_fp8, mxfp4, modelopt FP8/NVFP4, compressed-tensors FP8/FP4); its precision cannot be "
        "told, so it is sized as bf16, which overstates its weights"))


def _compressed_tensors(quant: dict, method: str, who: str) -> CheckpointPrecision:
    """compressed-tensors (llm-compressor): the weights scheme of its config groups, the KV scheme."""
    kv_scheme = quant.get("kv_cache_scheme")
    kv = "fp8" if isinstance(kv_scheme, dict) and kv_scheme.get("num_bits") == 8 and \
        kv_scheme.get("type") == "float" else ""
    groups = quant.get("config_groups")
    found = set()
    blocks = set()
    for g in (groups.values() if isinstance(groups, dict) else ()):
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            continue
        bits, kind, strategy, size = w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("group_size")
        if kind == "float" and bits == 8:
            found.add("fp8-block" if strategy == "block" else "fp8")
            if strategy == "block":
                blocks.add(_block(w.get("block_structure")))
        elif kind == "float" and bits == 4 and size in (16, 32):
            found.add("nvfp4" if size == 16 else "mxfp4")
        else:
            found.add(f"{kind}{bits} {strategy}")
    if len(found) == 1 and next(iter(found)) in BYTES_PER_PARAM:
        block = next(iter(blocks)) if len(blocks) == 1 else ()
        return CheckpointPrecision(next(iter(found)), kv, method, block_size=block,
                                   unquantized=_names(quant.get("ignore")))
    what = ", ".join(sorted(found)) or "no weights scheme"
    return CheckpointPrecision("unknown", kv, method, note=(
        f"{who}compressed-tensors config_groups hold {what}: not one format pdserve models (fp8, fp8 block, "
        "fp4 in groups of 16 or 32); sized as bf16, which overstates its weights"))


def _block(v: Any) -> tuple[int, ...]:
    """``weight_block_size`` / ``block_structure`` as ``(block_n, block_k)``; () when absent or not two
    positive whole numbers."""
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
        return (int(v[0]), int(v[1]))
    return ()


def _names(v: Any) -> tuple[str, ...]:
    """A list of module names / patterns as a tuple of strings; () when absent, null or not a list."""
    if isinstance(v, str):
        return (v,)
    if not isinstance(v, (list, tuple)):
        return ()
    return tuple(x for x in v if isinstance(x, str) and x)


def module_unquantized(name: str, patterns: tuple[str, ...]) -> bool:
    """True when module ``name`` (a full path, ``model.layers.0.self_attn.k_proj``) is one a checkpoint's
    ``patterns`` (``CheckpointPrecision.unquantized``) keep in 16 bits: an entry equal to the name or to one of
    its parent modules (``model.layers.0.mlp`` covers its projections), a compressed-tensors ``re:`` regex
    matching from the start of the name (vLLM ``_is_equal_or_regex_match``: ``re.match``), or a ModelOpt /
    gpt-oss wildcard (``model.layers.*.self_attn``, ``fnmatch``), which also covers children."""
    for p in patterns:
        if p.startswith("re:"):
            try:
                if re.match(p[3:], name):
                    return True
            except re.error:
                continue
        elif "*" in p or "?" in p:
            if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*"):
                return True
        elif name == p or name.startswith(p + "."):
            return True
    return False
