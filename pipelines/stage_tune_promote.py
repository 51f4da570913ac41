"""KFP v2 pipeline `stage_tune_promote`: S3 → FSx staging, prefill/decode TP tuning, promotion to KServe.

Run locally (kfp.local, SubprocessRunner in the current venv) with `run_local(...)`, or compile to YAML for
Kubeflow Pipelines with `python -m pipelines.stage_tune_promote --compile OUT.yaml`.

On a cluster the steps mount the FSx for Lustre PVC named by the `pvc_name` parameter at `/fsx` (so
`fsx_root` must stay `/fsx` there; kfp.local uses it to point at a local folder), the S3 credentials arrive
as env from a Kubernetes Secret (never as parameters) and caching is off for steps with side effects;
kfp.local ignores those settings. A PVC is namespaced: infra/k8s/storage creates `fsx-claim` in namespace
kubeflow, where Kubeflow Pipelines standalone runs the steps as pipeline-runner, and infra/k8s/kubeflow-pdserve
binds that account to the promoter's Role in `namespace` (pdserve); infra/k8s/kubeflow-profile does both for a
multi-user profile namespace (docs/eks-quickstart.md). `pdserve compile --image` sets every step's image.

Parameters tune would refuse (unknown `gpu`, `precision` other than auto/bf16/fp8, SLO or workload values out
of range, `gpu_budget` < 1, a `registered_model` MLflow refuses, an unsafe `model_name`) fail the first step,
validate-parameters, before stage-weights copies anything. `precision` `auto` tunes at the checkpoint's own
precision (fp8 when its config.json quantization_config says fp8, else bf16), like `pdserve tune`;
`gpu_budget` (GPUs, default as `pdserve tune --gpu-budget`) becomes the champion's planner.gpu_budget and
`planner_mode` (`off`, the default, `sla` or `load`, as `pdserve tune --planner`) its planner.mode: whether the
promoted runtime runs the SLO planner (an unknown mode fails validate-parameters). The winner takes the
registered model's `champion` alias by the rule of `pdserve tune --register` (runtime/usecases/champion.py):
when there is no champion yet, when it costs at least `min_improvement_pct` percent less than the champion's
deployment on the same workload, or when the champion cannot serve it; otherwise it is registered without the
alias, tune-tp's `champion_version` output names the champion that stays, and promote renders that one. When
the champion serves another model, tune-tp fails and registers nothing unless `replace_model` is true.

Workload: by default the mean `isl_tokens`/`osl_tokens` (tokens) at `request_rate_per_s` (requests/s).
`traffic_trace_uri` sizes for recorded or published traffic instead, as `pdserve tune --trace`: an
`s3://bucket/key` object (read by tune-tp with `s3_endpoint_url` and the same env credentials as
stage-weights) or an absolute path under `fsx_root`, a Mooncake/`pdserve serve --traffic-log` `.jsonl` or an
Azure `.csv`, or a folder of them written with a trailing '/' (`s3://bucket/traffic/<InferenceService>/`: what
`traffic_upload_uri` makes the endpoint ship, every pod's objects read as one trace); the trace's length sample sizes the pools, the champion records its mean ISL/OSL and
`isl_tokens`/`osl_tokens` are ignored. `request_rate_per_s` 0 (the default) means "not chosen", like
`pdserve tune` without --rate: the trace's mean arrival rate with a trace, else 10 requests/s; a positive rate
always wins (size a recorded mix for a different load). A malformed URI (neither an s3:// object URI nor an
absolute path under `fsx_root`, or not .jsonl/.csv) fails validate-parameters; an unreadable trace, or one with
no valid request, fails tune-tp naming the URI before the model is read. The MLflow parent run records it as
the param `traffic_trace_uri`. `trace_window_h` > 0 sizes for the requests of the trace's last hours only (its
lengths, rate and peak), and objects under an s3:// prefix last modified before that window (less an hour for
clock skew) are not downloaded (`pdserve tune --trace-window-h`); 0, the default, reads the whole trace.

`traffic_upload_uri` (``s3://bucket/prefix/``; "" = off) makes the promoted runtime record its traffic (one line
per finished request, no content) and ship it under ``<prefix><InferenceService>/``: the recorded traffic a
later run's `traffic_trace_uri` or `pdserve batch retune-schedule --traffic` re-tunes for. Checked by
validate-parameters.
"""


import argparse
from pathlib import Path
from typing import NamedTuple

from kfp import compiler, dsl, kubernetes
from kfp.dsl import Artifact

from components.params import documented
from components.promote import promote
from components.stage import stage_weights
from components.tune import tune_tp
from components.validate import validate_parameters
from runtime.config import PlannerSpec
from runtime.image import DEFAULT_IMAGE, cpu_image
from runtime.staging.layout import FSX_MOUNT
from runtime.usecases.tune import AUTO_REQUEST_RATE
from runtime.tuner.champion import DEFAULT_MIN_IMPROVEMENT_PCT

FSX_PVC = "fsx-claim"
S3_SECRET = "pdserve-s3"  # keys: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (optional with Pod Identity)
MLFLOW_SECRET = "pdserve-mlflow"  # keys: MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD


def _on_cluster(task: dsl.PipelineTask, *, pvc_name, secrets: dict[str, dict[str, str]]) -> dsl.PipelineTask:
    """Kubernetes-only settings: FSx PVC `pvc_name` (a pipeline parameter) mounted at /fsx, secrets as env,
    caching off (side effects)."""
    kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=FSX_MOUNT)
    for secret, keys in secrets.items():
        kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env=keys, optional=True)
    task.set_caching_options(enable_caching=False)
    return task


_S3_KEYS = {"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"}
_MLFLOW_KEYS = {"MLFLOW_TRACKING_USERNAME": "MLFLOW_TRACKING_USERNAME",
                "MLFLOW_TRACKING_PASSWORD": "MLFLOW_TRACKING_PASSWORD"}


PIPELINE_NAME = "stage-tune-promote"  # the compiled package's pipelineInfo.name


@dsl.pipeline(name=PIPELINE_NAME, description="Stage weights S3→FSx, tune prefill/decode TP, promote to KServe.")
@documented  # parameter descriptions for the KFP UI (components.params.PARAM_DOCS)
def stage_tune_promote(
    source_uri: str = "s3://pdserve-models/smollm2-135m-instruct/",
    model_name: str = "smollm2-135m-instruct",
    fsx_root: str = FSX_MOUNT,
    s3_endpoint_url: str = "",
    gpu: str = "H100-SXM",
    precision: str = "auto",
    ttft_p90_ms: float = 2000.0,
    itl_p90_ms: float = 50.0,
    isl_tokens: int = 3000,
    osl_tokens: int = 150,
    request_rate_per_s: float = AUTO_REQUEST_RATE,  # 0: the trace's mean arrival rate, else 10/s (module doc)
    gpu_budget: int = PlannerSpec.model_fields["gpu_budget"].default,
    mlflow_tracking_uri: str = "http://mlflow.mlflow.svc:5000",
    registered_model: str = "smollm2-135m-instruct-pd",
    namespace: str = "pdserve",
    image: str = DEFAULT_IMAGE,  # the runtime image promote renders; `compile_pipeline(image=...)` sets it
    pvc_name: str = FSX_PVC,
    apply: bool = False,
    kube_context: str = "",
    traffic_trace_uri: str = "",  # "": size for isl_tokens/osl_tokens; else s3://bucket/key or a path under fsx_root
    traffic_upload_uri: str = "",  # "": the endpoint records no traffic; else s3://bucket/prefix/ (module doc)
    planner_mode: str = "off",  # the champion's SLO planner: off, sla or load (as `pdserve tune --planner`)
    trace_window_h: float = 0.0,  # > 0: size for the trace's last hours only (`pdserve tune --trace-window-h`)
    min_improvement_pct: float = DEFAULT_MIN_IMPROVEMENT_PCT,  # the champion rule (`pdserve tune --register`)
    replace_model: bool = False,  # register when the champion serves another model (`pdserve tune --replace-model`)
    parallelism: str = "auto",  # tp, auto or all (`pdserve tune --parallelism`)
    max_model_len_tokens: int = 0,  # 0: derived (`pdserve tune --max-model-len`)
    engine_args: list = [],  # noqa: B006 - KEY=VALUE strings (`pdserve tune --engine-arg`); KFP reads the default
    usd_per_gpu_hour: list = [],  # noqa: B006 - GPU=USD strings (`pdserve tune --usd-per-gpu-hour`)
) -> NamedTuple("PipelineOutputs", champion_version=str, manifests=Artifact):
    # Parameters tune would refuse fail here, in seconds, not after stage-weights copied the whole model.
    validated = validate_parameters(
        model_name=model_name, gpu=gpu, precision=precision, ttft_p90_ms=ttft_p90_ms, itl_p90_ms=itl_p90_ms,
        isl_tokens=isl_tokens, osl_tokens=osl_tokens, request_rate_per_s=request_rate_per_s, gpu_budget=gpu_budget,
        registered_model=registered_model, traffic_trace_uri=traffic_trace_uri, fsx_root=fsx_root,
        traffic_upload_uri=traffic_upload_uri, planner_mode=planner_mode, trace_window_h=trace_window_h,
        min_improvement_pct=min_improvement_pct, parallelism=parallelism, max_model_len_tokens=max_model_len_tokens,
        engine_args=engine_args, usd_per_gpu_hour=usd_per_gpu_hour,
    ).set_display_name("validate-parameters")

    staged = stage_weights(
        source_uri=source_uri, fsx_root=fsx_root, model_name=model_name, s3_endpoint_url=s3_endpoint_url
    ).set_display_name("stage-weights").after(validated)
    _on_cluster(staged, pvc_name=pvc_name, secrets={S3_SECRET: _S3_KEYS})

    tuned = tune_tp(
        model=staged.outputs["model"], gpu=gpu, precision=precision, ttft_p90_ms=ttft_p90_ms,
        itl_p90_ms=itl_p90_ms, isl_tokens=isl_tokens, osl_tokens=osl_tokens,
        request_rate_per_s=request_rate_per_s, gpu_budget=gpu_budget, mlflow_tracking_uri=mlflow_tracking_uri,
        registered_model=registered_model, traffic_trace_uri=traffic_trace_uri, s3_endpoint_url=s3_endpoint_url,
        fsx_root=fsx_root, planner_mode=planner_mode, trace_window_h=trace_window_h,
        min_improvement_pct=min_improvement_pct, parallelism=parallelism, max_model_len_tokens=max_model_len_tokens,
        engine_args=engine_args, usd_per_gpu_hour=usd_per_gpu_hour, replace_model=replace_model,
    ).set_display_name("tune-tp")
    # the S3 secret too: traffic_trace_uri may name an s3:// object (optional secret: absent keys are fine)
    _on_cluster(tuned, pvc_name=pvc_name, secrets={MLFLOW_SECRET: _MLFLOW_KEYS, S3_SECRET: _S3_KEYS})

    promoted = promote(
        champion_version=tuned.outputs["champion_version"], registered_model=registered_model,
        mlflow_tracking_uri=mlflow_tracking_uri, namespace=namespace, image=image, pvc_name=pvc_name,
        apply=apply, kube_context=kube_context, traffic_upload_uri=traffic_upload_uri,
    ).set_display_name("promote")
    _on_cluster(promoted, pvc_name=pvc_name, secrets={MLFLOW_SECRET: _MLFLOW_KEYS})

    Outputs = NamedTuple("PipelineOutputs", champion_version=str, manifests=Artifact)
    return Outputs(champion_version=tuned.outputs["champion_version"], manifests=promoted.outputs["manifests"])


PACKAGE_SUFFIXES = (".yaml", ".yml")  # what Kubeflow Pipelines uploads as a pipeline package in YAML


def package_path_problem(out: Path, *, replace: bool = False) -> str | None:
    """Why `compile_pipeline` should not write `out`, or None.

    `out` must end in .yaml or .yml (Kubeflow Pipelines tells a package's format by its suffix). An existing
    file is replaced only when it is this pipeline's package (its `pipelineInfo.name` is stage-tune-promote),
    or when `replace` is set: a typo must not turn a manifest, a values file or notes into a pipeline.
    """
    if out.suffix.lower() not in PACKAGE_SUFFIXES:
        return "must end in .yaml or .yml (Kubeflow Pipelines tells a pipeline package by its suffix)"
    if replace or not out.is_file():
        return None
    import yaml

    try:
        with out.open() as f:
            first = next(yaml.safe_load_all(f), None)
        name = first.get("pipelineInfo", {}).get("name") if isinstance(first, dict) else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        name = None
    if name != PIPELINE_NAME:
        return f"exists and is not the {PIPELINE_NAME} pipeline package; pass --force to replace it"
    return None


def compile_pipeline(out: Path, *, image: str = DEFAULT_IMAGE, steps_image: str | None = None) -> Path:
    """Compile the pipeline to a KFP v2 IR YAML that Kubeflow Pipelines accepts for upload.

    `image` (the pdserve image, runtime/image.py) becomes the default of the `image` parameter, the runtime image
    promote renders; every step's container runs `steps_image`, by default the CPU build of `image`
    (`cpu_image`: no step needs a GPU). KFP fixes a component's image when it is defined, so the compiled
    executors are rewritten here. The package is compiled in a temporary folder and `out` replaced in one
    rename: a failure leaves a file already at `out` as it was. Callers check `package_path_problem` first.

    Raises:
        ValueError: `image` is not an image reference, or has no tag while `steps_image` is not given.
        OSError: `out` cannot be written.
    """
    import tempfile

    import yaml

    from runtime.paths import write_text_atomically

    steps_image = steps_image or cpu_image(image)
    with tempfile.TemporaryDirectory(prefix="pdserve-compile-") as tmp:
        package = Path(tmp) / "pipeline.yaml"
        compiler.Compiler().compile(stage_tune_promote, package_path=str(package))
        docs = list(yaml.safe_load_all(package.read_text()))
    pipeline = docs[0]
    for executor in pipeline["deploymentSpec"]["executors"].values():
        executor["container"]["image"] = steps_image
    pipeline["root"]["inputDefinitions"]["parameters"]["image"]["defaultValue"] = image
    return write_text_atomically(out, yaml.safe_dump_all(docs, sort_keys=False))


def run_local(*, pipeline_root: Path, **arguments) -> dict:
    """Run the pipeline with kfp.local in this venv (SubprocessRunner, use_venv=False).

    Returns:
        {"champion_version": str, "manifests": str (path to the YAML written by promote)}.

    Raises:
        RuntimeError: from kfp.local when a task fails (its log names the step and the error).
    """
    import warnings

    from kfp import local

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root),
               raise_on_error=True)
    with warnings.catch_warnings():
        # kfp.local warns for every step whose image name lacks "python" that the image's dependencies may be
        # missing; here the steps run in this venv on purpose (use_venv=False), where pdserve is installed, so
        # the warning would only alarm a demo user.
        warnings.filterwarnings("ignore", message="You may be attemping to run a task that uses custom",
                                category=RuntimeWarning)
        task = stage_tune_promote(**arguments)
    return {"champion_version": task.outputs["champion_version"],
            "manifests": task.outputs["manifests"].path}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--compile", type=Path, required=True, help="write the pipeline YAML here")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="the pdserve image (promote's runtime image); the "
                        "steps run its CPU build (REPO:TAG-cpu)")
    parser.add_argument("--steps-image", default=None, help="the steps' image (default: the CPU build of --image)")
    parser.add_argument("--force", action="store_true", help="replace --compile even when it is another file")
    args = parser.parse_args(argv)
    problem = package_path_problem(args.compile, replace=args.force)
    if problem:
        parser.error(f"--compile {args.compile}: {problem}")
    try:
        print(compile_pipeline(args.compile, image=args.image, steps_image=args.steps_image))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
