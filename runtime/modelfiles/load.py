"""Adapter: read a ``config.json`` (file or model folder) into a :class:`ModelSpec`."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.models.spec import ModelConfigError, ModelSpec


def load_model_spec(path: Path, name: str | None = None) -> ModelSpec:
    """Read ``path`` (a ``config.json`` or a folder containing one) and parse it.

    Args:
        path: file or model folder.
        name: model name; default: the folder name (or the file stem for ``<org>--<model>_config.json``).

    Raises:
        ModelConfigError: file missing or unreadable (OSError), not UTF-8, not JSON, or missing/invalid
            fields (named in the message); the message names the model and the path.
    """
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    if name is None:
        name = path.name if path.is_dir() else cfg_path.stem.removesuffix("_config").replace("--", "/")
        if name == "config":
            name = cfg_path.parent.name
    if not cfg_path.is_file():
        raise ModelConfigError(f"{name}: no config.json at {cfg_path}")
    try:
        raw = cfg_path.read_bytes()
    except OSError as e:  # unreadable: permissions, I/O error
        raise ModelConfigError(f"{name}: cannot read {cfg_path}: {e.strerror or e}") from e
    try:
        cfg = json.loads(raw.decode("utf-8-sig"))  # a leading UTF-8 byte-order mark is tolerated
    except UnicodeDecodeError as e:  # JSON files are UTF-8 (RFC 8259 section 8.1)
        raise ModelConfigError(f"{name}: {cfg_path} is not UTF-8 text (not a JSON config.json): {e}") from e
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{name}: {cfg_path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ModelConfigError(f"{name}: {cfg_path} is nested too deeply to be a config.json") from None
    if isinstance(cfg, dict) and cfg.get("quantization_config") is None:
        quant = _modelopt_quant_config(cfg_path.parent / "hf_quant_config.json", name)
        if quant is not None:
            cfg = {**cfg, "quantization_config": quant}
    try:
        return ModelSpec.from_hf_config(cfg, name)
    except ModelConfigError as e:  # the pure parser knows no file: name the one that says it
        raise ModelConfigError(f"{e} (in {cfg_path})") from e


def _modelopt_quant_config(path: Path, name: str) -> dict | None:
    """The quantization of a checkpoint that keeps it beside config.json in ``hf_quant_config.json``
    (TensorRT Model Optimizer 0.29 and before, e.g. nvidia/Llama-3.1-70B-Instruct-FP8), as a
    ``quantization_config``: ``{"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}``
    (the KV algorithm only when the file names one). vLLM reads the same file
    when config.json has no quantization_config (vllm/transformers_utils/config.py). None when there is no
    such file.

    Raises:
        ModelConfigError: the file is unreadable, not JSON, or has no ``quantization.quant_algo``.
    """
    if not path.is_file():
        return None
    try:
        q = json.loads(path.read_bytes().decode("utf-8-sig"))
        algo = q["quantization"]["quant_algo"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelConfigError(f"{name}: {path} is not a readable ModelOpt hf_quant_config.json "
                               f"(quantization.quant_algo): {type(e).__name__}: {e}") from e
    producer = (q.get("producer") or {}).get("name") if isinstance(q.get("producer"), dict) else None
    out = {"quant_method": producer or "modelopt", "quant_algo": algo}
    kv = q["quantization"].get("kv_cache_quant_algo")
    if kv is not None:
        out["kv_cache_quant_algo"] = kv
    exclude = q["quantization"].get("exclude_modules")
    if exclude is not None:  # the modules kept in 16 bits (vLLM ModelOptFp8Config reads it from here)
        out["exclude_modules"] = exclude
    return out


PRECISIONS = ("bf16", "fp8")  # what a DeploymentSpec deploys (runtime/config.py Precision)
AUTO_PRECISION = "auto"  # "the checkpoint's own" (checkpoint_precision)


def checkpoint_precision(model: ModelSpec) -> str:
    """The deployment precision a checkpoint is tuned at when none is chosen: `fp8` when its weights are FP8
    (config.json `quantization_config.quant_method` `fp8` / `fbgemm_fp8`, a TensorRT Model Optimizer
    `quant_algo` `FP8`, also from `hf_quant_config.json`: :func:`load_model_spec`) or it carries FP8 KV-cache
    scales (ModelOpt `kv_cache_quant_algo` `FP8`), else `bf16` (`runtime.models.quant.detect_precision`).

    The deployment precision is the KV-cache dtype (and online FP8 quantisation of a 16-bit checkpoint,
    runtime.deploy.workers.precision_args); a quantised checkpoint's weights keep their own format either way,
    and the tuner sizes them so (`runtime.tuner.search.tune`). One rule for `pdserve tune` (no --precision),
    the pipeline's tune step (precision `auto`) and `pdserve models`.
    """
    fp8 = model.weight_format in ("fp8", "fp8-block") or model.kv_cache_format == "fp8"
    return "fp8" if fp8 else "bf16"


def check_precision(precision: str) -> str:
    """Return `precision` lower-cased when it is `auto` or one of PRECISIONS.

    Raises:
        ValueError: anything else (message lists the accepted values).
    """
    value = precision.lower() if isinstance(precision, str) else precision
    if value != AUTO_PRECISION and value not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: must be {AUTO_PRECISION} (the checkpoint's own: fp8 for an FP8 "
                         f"checkpoint, else bf16) or one of {', '.join(PRECISIONS)}")
    return value
