"""The command-line option of each use-case request field, one table per command.

A leaf of pure data (it imports nothing), so every layer may read it: `pdserve tune` and `pdserve promote` (and
the tune use case, runtime/usecases/tune_model.py) name a field's problem after its option from here, and the Argo workflows
(runtime/batch/workflows.py `retune_argv`, `promote_argv`) build their `pdserve` command lines from the same
tables, so an option is spelled in one place. tests/unit/test_cli_option_tables.py checks that every entry is an
option of the real command and that every request field has an option or is listed as having none.
"""

from __future__ import annotations

# runtime.usecases.tune.TuneRequest field -> `pdserve tune` option
TUNE_OPTIONS = {
    "gpu": "--gpu", "precision": "--precision", "ttft_p90_ms": "--ttft-ms", "itl_p90_ms": "--itl-ms",
    "isl_tokens": "--isl", "osl_tokens": "--osl", "request_rate_per_s": "--rate", "gpu_budget": "--gpu-budget",
    "planner_mode": "--planner", "min_improvement_pct": "--min-improvement-pct", "traffic_trace_uri": "--trace-uri",
    "trace_window_h": "--trace-window-h", "fsx_root": "--fsx-root", "registered_model": "--register",
    "mlflow_tracking_uri": "--mlflow-uri", "parallelism": "--parallelism", "max_model_len_tokens": "--max-model-len",
    "engine_args": "--engine-arg", "usd_per_gpu_hour": "--usd-per-gpu-hour", "replace_model": "--replace-model",
}
# TuneRequest fields `pdserve tune` sets otherwise: the MODEL argument (folder and name), AWS_ENDPOINT_URL_S3
TUNE_WITHOUT_OPTION = frozenset({"model_path", "model_name", "s3_endpoint_url"})

# runtime.usecases.promote.PromoteRequest field -> `pdserve promote` option (require_staged: its negation)
PROMOTE_OPTIONS = {
    "mlflow_tracking_uri": "--mlflow-uri", "out_path": "--out", "namespace": "--namespace", "image": "--image",
    "pvc_name": "--pvc", "expect_version": "--expect-version", "apply": "--apply", "kube_context": "--kube-context",
    "require_staged": "--allow-unstaged", "traffic_upload_uri": "--traffic-upload", "skip_if_live": "--skip-if-live",
    "max_model_len_tokens": "--max-model-len", "engine_args": "--engine-arg",
}
PROMOTE_WITHOUT_OPTION = frozenset({"registered_model"})  # the REGISTERED_MODEL argument
