"""Shared builders for use-case tests: requests in the pipeline's positional parameter order, and staged models."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.usecases.tune import TuneRequest


def stage_config(config: Path | dict, dest: Path, work: Path) -> Path:
    """``dest`` made a verified staged model (marker + manifest; runtime.staging.stage.stage_model) of a folder
    under ``work`` holding ``config`` (a config.json path, or its content as a dict) and a 16-byte stand-in for
    the weights; returns ``dest``. The tuner only reads config.json, so no real weights are needed."""
    from runtime.staging.stage import stage_model

    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config) if isinstance(config, dict) else Path(config).read_text()
    (src / "config.json").write_text(text)
    (src / "model.safetensors").write_bytes(b"\0" * 16)
    stage_model(str(src), dest, progress=False)
    return dest


def tune_request(model_path, model_name: str, gpu: str, precision: str, ttft_p90_ms: float, itl_p90_ms: float,
                 isl_tokens: int, osl_tokens: int, request_rate_per_s: float, mlflow_tracking_uri: str,
                 registered_model: str, **kw) -> TuneRequest:
    """A TuneRequest from the tune component's parameters in its order (`components/tune.py`)."""
    return TuneRequest(model_path=str(model_path), model_name=model_name, gpu=gpu, precision=precision,
                       ttft_p90_ms=ttft_p90_ms, itl_p90_ms=itl_p90_ms, isl_tokens=isl_tokens, osl_tokens=osl_tokens,
                       request_rate_per_s=request_rate_per_s, mlflow_tracking_uri=mlflow_tracking_uri,
                       registered_model=registered_model, **kw)
