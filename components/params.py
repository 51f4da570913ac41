"""One description per KFP parameter, shown by the Kubeflow Pipelines UI beside each input and output.

KFP reads a component's (and a pipeline's) input descriptions from the Google-style ``Args:`` section of the
function's docstring (``kfp.dsl.component_factory``: ``inspect.getdoc`` + ``docstring_parser``) into the
compiled IR's ``inputDefinitions.*.description``. :func:`documented` appends that section from
:data:`PARAM_DOCS`, so the pipeline and the components it calls describe a parameter with the same words and a
new parameter without a description fails at import (``tests/unit/test_pipeline_compile.py`` checks the
compiled YAML). It returns the function itself: KFP still embeds the function's own source (decorator lines
dropped) in the component's command.
"""

from __future__ import annotations

import inspect
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

PARAM_DOCS: dict[str, str] = {
    # staging
    "source_uri": "Weights to stage: s3://bucket/prefix/ (safetensors, config.json, tokenizer files).",
    "model_name": "Served model name; the weights land in <fsx_root>/models/<model_name> (a relative path, "
                  "no '..').",
    "fsx_root": "FSx for Lustre mount path in the step containers (/fsx on a cluster; kfp.local: a local folder).",
    "s3_endpoint_url": "S3-compatible endpoint (http(s)://host:port, e.g. MinIO/SeaweedFS); empty: AWS S3. "
                       "Credentials come from the pdserve-s3 Secret or the pod's IAM role, never parameters.",
    # tuning
    "gpu": "GPU catalog name (H100-SXM, H200-SXM, A100-SXM-80GB, L40S, B200, ...) or an AWS instance type "
           "(p5.48xlarge).",
    "precision": "Weights and KV-cache precision: auto (the checkpoint's own: fp8 for an FP8 checkpoint, else "
                 "bf16), bf16 or fp8.",
    "ttft_p90_ms": "TTFT SLO: p90 time to first token, milliseconds.",
    "itl_p90_ms": "ITL SLO: p90 inter-token latency, milliseconds.",
    "isl_tokens": "Mean input sequence length (ISL), tokens; ignored with traffic_trace_uri.",
    "osl_tokens": "Mean output sequence length (OSL), tokens; ignored with traffic_trace_uri.",
    "request_rate_per_s": "Target load, requests/s; 0: the trace's mean arrival rate with traffic_trace_uri, "
                          "else 10.",
    "gpu_budget": "GPUs the deployment may use (planner.gpu_budget); a winner needing more fails tune-tp.",
    "planner_mode": "SLO planner of the promoted runtime: off (fixed replicas), sla (scale prefill for TTFT and "
                    "decode for ITL) or load.",
    "traffic_trace_uri": "Traffic to size for instead of isl_tokens/osl_tokens: s3://bucket/key (.jsonl/.csv), "
                         "s3://bucket/prefix/ (every object under it, e.g. what traffic_upload_uri ships) or an "
                         "absolute path under fsx_root; empty: none.",
    "trace_window_h": "With traffic_trace_uri: size only for the requests of the last HOURS before the trace's "
                      "newest one (an s3:// prefix skips objects last modified before that window); 0: the whole "
                      "trace.",
    "mlflow_tracking_uri": "MLflow tracking server (http://mlflow.mlflow.svc:5000 in-cluster; sqlite:///... "
                           "locally); credentials from the pdserve-mlflow Secret.",
    "registered_model": "MLflow registered model the winner is registered under; it takes alias champion "
                        "when there is none yet or it beats the champion by min_improvement_pct.",
    "min_improvement_pct": "The winner takes alias champion when its deployment costs at least this many percent "
                           "less than the champion's on the same workload (GPUs, or $/Mtok across GPU types), or "
                           "when the champion cannot serve it; else it is registered without the alias.",
    "replace_model": "Register the winner even when the champion of registered_model serves another model (its "
                     "alias may then move, and the next promote changes the model served behind the same "
                     "InferenceService); false: the tune step fails and registers nothing.",
    "parallelism": "Worker layouts the tuner searches: tp (tensor parallelism on one node), all (also expert-"
                   "parallel, data-parallel attention and multi-node workers) or auto (all when plain TP has no "
                   "candidate that meets the SLO).",
    "max_model_len_tokens": "vLLM --max-model-len of the winner, tokens (at least isl_tokens + osl_tokens, at most "
                            "the model's context and the KV capacity); 0: derived by the tuner.",
    "engine_args": "vLLM engine arguments the winner's spec records, as KEY=VALUE strings (e.g. "
                   "max-num-seqs=128), checked against the pinned vLLM's parser; []: none.",
    "usd_per_gpu_hour": "GPU=USD strings: your USD per GPU-hour replacing the AWS on-demand price in $/Mtok, for "
                        "the candidates and the champion comparison alike; []: on-demand prices.",
    "model": "The staged model folder (metadata: path, manifest digest).",
    "metrics": "The winner: prefill_tp, decode_tp (tensor-parallel degrees), prefill_worker_gpus, "
               "decode_worker_gpus (GPUs per worker: tp x dp x pp), predicted ttft_p90_ms / itl_p90_ms, "
               "goodput_per_gpu (requests/s per GPU) and num_candidates.",
    "table": "Every candidate (prefill TP × decode TP) as a Markdown table.",
    "plot": "Pareto plot of goodput per GPU against TTFT and ITL (HTML with the PNG inline).",
    # promotion
    "champion_version": "Registered model version of the tuning's winner (alias champion), which promote renders.",
    "prefill_tp": "The winner's prefill tensor-parallel degree (vLLM --tensor-parallel-size; a worker's GPUs are "
                  "tp x dp x pp, the metrics' prefill_worker_gpus).",
    "decode_tp": "The winner's decode tensor-parallel degree (vLLM --tensor-parallel-size; a worker's GPUs are "
                 "tp x dp x pp, the metrics' decode_worker_gpus).",
    "namespace": "Kubernetes namespace of the InferenceService.",
    "image": "pdserve runtime container image of the ClusterServingRuntime.",
    "pvc_name": "PersistentVolumeClaim of the FSx for Lustre volume, mounted at /fsx in every step.",
    "apply": "Apply the rendered objects to the cluster (server-side apply, canary rolled back when the SLO is "
             "missed); false: render and validate only.",
    "kube_context": "kubeconfig context for apply; empty: the step pod's in-cluster service account.",
    "traffic_upload_uri": "s3://bucket/prefix/ the promoted runtime ships its traffic log under "
                          "(<prefix><InferenceService>/; no request content); empty: off.",
    "manifests": "Every rendered object in apply order (YAML): ClusterServingRuntime, InferenceService, the "
                 "prefill and decode worker Deployments and Services, service accounts, RBAC, PDBs, "
                 "NetworkPolicy, ServiceMonitor.",
}


def documented(func: F, **overrides: str) -> F:
    """Append Google-style ``Args:`` (every parameter) and ``Returns:`` (the ``Output[...]`` artifacts and the
    fields of a NamedTuple return) sections from :data:`PARAM_DOCS` (``overrides`` win) to ``func``'s
    docstring, and return ``func`` itself. KFP describes outputs only from a ``Returns:`` section.

    Raises:
        KeyError: a parameter or returned field has no description (its names are listed).
    """
    from kfp.dsl.types.type_annotations import is_artifact_wrapped_in_Output

    docs = {**PARAM_DOCS, **overrides}
    params = inspect.signature(func).parameters
    outputs = [n for n, p in params.items() if is_artifact_wrapped_in_Output(p.annotation)]
    outputs += list(getattr(inspect.signature(func).return_annotation, "_fields", ()))
    missing = [n for n in [*params, *outputs] if n not in docs]
    if missing:
        raise KeyError(f"{func.__name__}: no description for parameter(s) {', '.join(missing)} "
                       f"(add them to components.params.PARAM_DOCS)")
    doc = inspect.cleandoc(func.__doc__ or func.__name__) + "\n\nArgs:\n"
    doc += "".join(f"    {n}: {docs[n]}\n" for n in params)
    if outputs:
        doc += "\nReturns:\n" + "".join(f"    {n}: {docs[n]}\n" for n in outputs)
    func.__doc__ = doc
    return func


def documented_with(**overrides: str) -> Callable[[F], F]:
    """:func:`documented` as a decorator with per-function descriptions (e.g. an output named like an input)."""
    return lambda func: documented(func, **overrides)
