"""KFP component `tune-tp`: prefill TP × decode TP search under TTFT/ITL SLOs, every candidate an MLflow run."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Input, Markdown, Metrics, Model, Output

from components.image import STEP_IMAGE
from components.params import documented


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
@documented  # Args: section from components.params.PARAM_DOCS (KFP UI descriptions)
def tune_tp(
    model: Input[Model],
    gpu: str,
    precision: str,
    ttft_p90_ms: float,
    itl_p90_ms: float,
    isl_tokens: int,
    osl_tokens: int,
    request_rate_per_s: float,
    gpu_budget: int,
    mlflow_tracking_uri: str,
    registered_model: str,
    metrics: Output[Metrics],
    table: Output[Markdown],
    plot: Output[HTML],
    traffic_trace_uri: str = "",
    s3_endpoint_url: str = "",
    fsx_root: str = "/fsx",
    planner_mode: str = "off",
    trace_window_h: float = 0.0,
    min_improvement_pct: float = 5.0,
    parallelism: str = "auto",
    max_model_len_tokens: int = 0,
    engine_args: list = [],  # noqa: B006 - KFP reads the default from the signature; never mutated
    usd_per_gpu_hour: list = [],  # noqa: B006 - as engine_args
    replace_model: bool = False,
) -> NamedTuple("TuneOutputs", champion_version=str, prefill_tp=int, decode_tp=int):
    """Tune the staged model (`model.metadata['path']`) and register the winner; it takes alias `champion` by
    the rule of `pdserve tune --register` (no champion yet, or `min_improvement_pct` cheaper than it).

    `precision` `auto`: the checkpoint's own (fp8 for an FP8 checkpoint, else bf16); `gpu_budget` is written
    as the winner's planner.gpu_budget, and a winner needing more GPUs fails the step. `traffic_trace_uri`
    (s3://bucket/key, read with `s3_endpoint_url` and env credentials, or a path under `fsx_root`) sizes for
    that trace as `pdserve tune --trace`; `request_rate_per_s` 0: the trace's mean arrival rate (no trace: 10/s);
    `planner_mode` (off, sla, load) is the champion's planner.mode, as `pdserve tune --planner`;
    `trace_window_h` > 0 sizes for the trace's last hours only (`pdserve tune --trace-window-h`); `parallelism`,
    `max_model_len_tokens` (0: derived), `engine_args` and `usd_per_gpu_hour` as `pdserve tune --parallelism`,
    `--max-model-len`, `--engine-arg` and `--usd-per-gpu-hour`. The step fails, registering nothing, when the
    champion of `registered_model` serves another model, unless `replace_model` (`pdserve tune --replace-model`)."""
    from runtime.usecases.tune import TuneRequest, kfp_tune_outputs, tune

    return kfp_tune_outputs(tune(TuneRequest(
        model_path=model.metadata["path"], model_name=model.metadata["name"], gpu=gpu, precision=precision,
        ttft_p90_ms=ttft_p90_ms, itl_p90_ms=itl_p90_ms, isl_tokens=isl_tokens, osl_tokens=osl_tokens,
        request_rate_per_s=request_rate_per_s, gpu_budget=gpu_budget, mlflow_tracking_uri=mlflow_tracking_uri,
        registered_model=registered_model, traffic_trace_uri=traffic_trace_uri, s3_endpoint_url=s3_endpoint_url,
        fsx_root=fsx_root, planner_mode=planner_mode, trace_window_h=trace_window_h,
        min_improvement_pct=min_improvement_pct, parallelism=parallelism,
        max_model_len_tokens=max_model_len_tokens or None, engine_args=list(engine_args),
        usd_per_gpu_hour=list(usd_per_gpu_hour), replace_model=replace_model), metrics=metrics,
        table_path=table.path, plot_path=plot.path))
