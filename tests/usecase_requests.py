"""Shared builders of use-case requests for tests: the pipeline's positional parameter order, one place."""

from __future__ import annotations

from runtime.usecases.tune import TuneRequest


def tune_request(model_path, model_name: str, gpu: str, precision: str, ttft_p90_ms: float, itl_p90_ms: float,
                 isl_tokens: int, osl_tokens: int, request_rate_per_s: float, mlflow_tracking_uri: str,
                 registered_model: str, **kw) -> TuneRequest:
    """A TuneRequest from the tune component's parameters in its order (`components/tune.py`)."""
    return TuneRequest(model_path=str(model_path), model_name=model_name, gpu=gpu, precision=precision,
                       ttft_p90_ms=ttft_p90_ms, itl_p90_ms=itl_p90_ms, isl_tokens=isl_tokens, osl_tokens=osl_tokens,
                       request_rate_per_s=request_rate_per_s, mlflow_tracking_uri=mlflow_tracking_uri,
                       registered_model=registered_model, **kw)
