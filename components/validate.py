"""KFP component `validate-parameters`: the pipeline's cheap parameter checks, run before anything is staged."""

from kfp import dsl

from components.image import STEP_IMAGE
from components.params import documented


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
@documented  # Args: section from components.params.PARAM_DOCS (KFP UI descriptions)
def validate_parameters(
    model_name: str,
    gpu: str,
    precision: str,
    ttft_p90_ms: float,
    itl_p90_ms: float,
    isl_tokens: int,
    osl_tokens: int,
    request_rate_per_s: float,
    gpu_budget: int,
    registered_model: str,
    traffic_trace_uri: str = "",
    fsx_root: str = "/fsx",
    traffic_upload_uri: str = "",
    planner_mode: str = "off",
    trace_window_h: float = 0.0,
    min_improvement_pct: float = 5.0,
    parallelism: str = "auto",
    max_model_len_tokens: int = 0,
    engine_args: list = [],  # noqa: B006 - KFP reads the default from the signature; never mutated
    usd_per_gpu_hour: list = [],  # noqa: B006 - as engine_args
):
    """Fail (naming every bad parameter) before stage-weights copies the model when tune would refuse them;
    `traffic_trace_uri` must be "" (none), an s3://bucket/key object URI or an absolute path under `fsx_root`."""
    from runtime.usecases.validate import ValidateRequest, validate

    validate(ValidateRequest(
        model_name=model_name, gpu=gpu, precision=precision, ttft_p90_ms=ttft_p90_ms, itl_p90_ms=itl_p90_ms,
        isl_tokens=isl_tokens, osl_tokens=osl_tokens, request_rate_per_s=request_rate_per_s, gpu_budget=gpu_budget,
        registered_model=registered_model, traffic_trace_uri=traffic_trace_uri, fsx_root=fsx_root,
        traffic_upload_uri=traffic_upload_uri, planner_mode=planner_mode, trace_window_h=trace_window_h,
        min_improvement_pct=min_improvement_pct, parallelism=parallelism,
        max_model_len_tokens=max_model_len_tokens or None, engine_args=list(engine_args),
        usd_per_gpu_hour=list(usd_per_gpu_hour)))
