"""Argo Workflows for batch work beside the online endpoint: built with hera from the checked specs of
runtime/batch/workflow_specs.py, validated offline (runtime/batch/workflow_validation.py), never applied here.

* ``batch_inference_workflow`` builds an ``argoproj.io/v1alpha1`` **Workflow** (``generateName: <name>-``) with one
  container step, ``pdserve batch run --input s3://… --output s3://… --endpoint URL …``: an HTTP client
  that sends an OpenAI Batch file to the pdserve InferenceService already serving online traffic (no GPU of its
  own; ``--concurrency`` bounds its share of the endpoint, ``priority_class_name`` lets its pod yield to the
  endpoint's). A failed pod is retried (``retryStrategy`` limit 2, ``OnError``); the runner resumes from the
  partial output, so a retry does not resend finished lines.
* ``retune_cron_workflow`` builds an ``argoproj.io/v1alpha1`` **CronWorkflow** whose workflow runs
  ``pdserve tune /fsx/models/<model>/config.json --like <name> … --trace /work/traffic/<file> --register <name>`` on
  a schedule, re-tuning the registered champion's deployment (GPU, precision, SLO, GPU budget, planner mode: the
  champion's unless the spec sets them):
  the model's config.json comes from the FSx for Lustre PVC (mounted read-only at /fsx), the recorded traffic
  (Azure CSV: ContextTokens, GeneratedTokens; BurstGPT CSV: Request tokens, Response tokens; Mooncake JSONL:
  input_length, output_length) arrives as an Argo S3
  input artifact, the winner is registered in MLflow and takes alias champion only when it beats the champion's
  deployment on the same traffic by ``--min-improvement-pct``. Promotion is a separate step unless ``promote`` is
  on: then the workflow is two steps, ``tune`` (which also writes its decision, ``tune --decision-out`` /
  ``--decision-values``, and exposes ``replaced``, ``registered_version`` and ``champion_version`` as output
  parameters) and ``promote``, ``pdserve promote <name> --apply --skip-if-live --expect-version
  <champion_version>`` as service account pdserve-promoter: a canary rollout with the SLO probe and automatic
  rollback when the champion is not live yet, nothing when it already serves (the champion stayed).
  The traffic may be one object or a PREFIX (``s3://bucket/traffic/llama8/``, e.g. one traffic log per runtime
  replica): Argo downloads every object under a key that names no object as a directory (Argo docs,
  walk-through/hardwired-artifacts.md), and ``pdserve tune --trace DIR`` reads the folder as one trace. With
  ``trace_window_h`` the step instead runs ``pdserve tune --trace-uri s3://… --trace-window-h H``: no artifact,
  tune reads S3 itself (credentials by ``envFrom`` of the S3 secret, else IAM) and leaves unread the objects
  last modified before the window, so a prefix holding weeks of shipments is not downloaded whole.

Credentials are only ever referenced, never embedded: S3 and MLflow credentials reach the containers through
``envFrom: secretRef`` (secrets ``pdserve-s3`` with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and ``pdserve-mlflow``
with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, as in pipelines/stage_tune_promote.py), the artifact's
through ``accessKeySecret`` / ``secretKeySecret`` selectors; a secret of None means IAM (IRSA / Pod Identity).

``validate_workflow_objects`` (runtime/batch/workflow_validation.py) checks the objects against the vendored Argo
Workflow CRD schema (runtime/deploy/schemas/argoproj.io_v1alpha1_workflow.json, strict about unknown fields), a
CronWorkflow's ``spec.workflowSpec`` as a Workflow ``spec`` plus the cron-only fields by hand (no CronWorkflow CRD
is vendored), and what the schema leaves to the controller (entrypoint, container image, mounts naming volumes).

Field names: https://argo-workflows.readthedocs.io/en/latest/fields/ (Workflow, CronWorkflow, Template,
RetryStrategy, S3Artifact); CronWorkflow options (``schedules`` replaced ``schedule``, removed in Argo v4):
https://argo-workflows.readthedocs.io/en/latest/cron-workflows/.
"""

from __future__ import annotations

import posixpath
from typing import Any
from urllib.parse import urlparse

import yaml

from runtime.image import gpu_image
from runtime.batch.workflow_specs import (INSTANCE_ID_LABEL, PART_OF, WORK_DIR, BatchInferenceWorkflowSpec,
                                          CommonWorkflowSpec, RetuneCronWorkflowSpec, promote_traffic_upload_uri)
from runtime.s3uri import split_s3_trace_uri
from runtime.command_options import PROMOTE_OPTIONS, TUNE_OPTIONS
from runtime.staging.layout import FSX_MOUNT


# ---------------------------------------------------------------------------------------------------- builders


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _labels(workload: str) -> dict[str, str]:
    return {**PART_OF, "pdserve.io/workload": workload}


def _object_labels(workload: str, spec: CommonWorkflowSpec) -> dict[str, str]:
    """Labels of the Workflow / CronWorkflow itself: ``_labels`` plus the controller instance label. A CronWorkflow's
    runs inherit that label from it (Argo workflow/common/convert.go ``toWorkflow``); the controller labels the
    pods itself."""
    iid = {} if spec.controller_instance_id is None else {INSTANCE_ID_LABEL: spec.controller_instance_id}
    return {**_labels(workload), **iid}


def batch_inference_argv(spec: BatchInferenceWorkflowSpec) -> list[str]:
    """The step's command line (command + args)."""
    argv = ["pdserve", "batch", "run", "--input", spec.input_uri, "--output", spec.output_uri,
            "--endpoint", spec.endpoint, "--concurrency", str(spec.concurrency)]
    if spec.model is not None:
        argv += ["--model", spec.model]
    return argv + ["--max-retries", str(spec.max_retries), "--no-progress"]  # the JSON summary line says it all


def trace_path(spec: RetuneCronWorkflowSpec) -> str:
    """Where the traffic artifact lands in the tune container: /work/traffic/<last segment of the key> (a file,
    or for a prefix a folder of its objects)."""
    key = split_s3_trace_uri(spec.traffic_uri, "traffic_uri")[1]
    return posixpath.join(WORK_DIR, "traffic", posixpath.basename(key))


def retune_argv(spec: RetuneCronWorkflowSpec) -> list[str]:
    """The tune step's command line (command + args): ``pdserve tune … --like NAME … --register NAME``, so the run
    re-tunes the registered champion's deployment (its GPU, precision, SLO, GPU budget and planner mode, each
    overridden only by a value the spec gives) and moves alias champion only when the winner beats it. The traffic:
    ``--trace <artifact path> --trace-uri <traffic_uri>``, or with ``trace_window_h`` ``--trace-uri <traffic_uri>
    --trace-window-h H`` (tune reads S3 itself). With ``spec.promote`` it also writes its decision (DECISION_FILE,
    and DECISION_DIR for the output parameters)."""
    o = TUNE_OPTIONS  # the CLI's own table (runtime/command_options.py): one spelling of each option
    given = [(o["gpu"], spec.gpu), (o["precision"], spec.precision), (o["ttft_p90_ms"], spec.ttft_ms),
             (o["itl_p90_ms"], spec.itl_ms),
             (o["request_rate_per_s"], spec.rate),  # None: the trace's own arrival rate
             (o["gpu_budget"], spec.gpu_budget), (o["planner_mode"], spec.planner),
             (o["min_improvement_pct"], spec.min_improvement_pct)]
    opts = [a for opt, v in given if v is not None for a in (opt, v if isinstance(v, str) else _num(v))]
    trace = (["--trace", trace_path(spec)] if spec.trace_window_h is None
             else [o["trace_window_h"], _num(spec.trace_window_h)])
    return ["pdserve", "tune", f"{FSX_MOUNT}/models/{spec.model_name}/config.json",
            "--like", spec.registered_model, *opts, *trace,
            o["traffic_trace_uri"], spec.traffic_uri,
            o["mlflow_tracking_uri"], spec.mlflow_uri,
            o["registered_model"], spec.registered_model, "--out", f"{WORK_DIR}/winner.json",
            *(["--decision-out", DECISION_FILE, "--decision-values", DECISION_DIR] if spec.promote else [])]


#: where the tune step writes its decision when promote is on (`pdserve tune --decision-out / --decision-values`)
DECISION_FILE = f"{WORK_DIR}/decision.json"
DECISION_DIR = f"{WORK_DIR}/decision"
#: the tune step's output parameters (one file each in DECISION_DIR): what became of the alias, for the run's record,
#: and the version alias champion names after the run, which the promote step promotes
REPLACED_PARAM, VERSION_PARAM, CHAMPION_PARAM = "replaced", "registered_version", "champion_version"
# a container template sees only its own inputs: the step passes the champion in as input parameter `version`
PROMOTE_VERSION_ARG = f"{{{{steps.tune.outputs.parameters.{CHAMPION_PARAM}}}}}"
PROMOTE_VERSION = "{{inputs.parameters.version}}"


def promote_argv(spec: RetuneCronWorkflowSpec) -> list[str]:
    """The promote step's command line (command + args): ``pdserve promote NAME --apply --skip-if-live
    --expect-version V …``, V being the version alias champion names after the tune step (the step's input
    parameter ``version``, PROMOTE_VERSION_ARG; the template substitutes PROMOTE_VERSION), so a champion moved by
    anyone else in between is refused. It runs after every successful tune, not only when that tune moved the
    alias: ``--skip-if-live`` applies nothing when V already serves (the champion stayed), and a champion that is
    not live yet is still promoted (a retried tune whose first attempt moved the alias sees its own version as
    the champion and keeps it). In-cluster credentials (no --kube-context); the champion's model folder is
    checked as a staged copy on the FSx mount."""
    o = PROMOTE_OPTIONS  # the CLI's own table (runtime/command_options.py): one spelling of each option
    argv = ["pdserve", "promote", spec.registered_model, o["apply"], o["skip_if_live"], o["expect_version"],
            PROMOTE_VERSION,
            o["mlflow_tracking_uri"], spec.mlflow_uri, o["namespace"], spec.promote_namespace or spec.namespace,
            o["image"], spec.promote_image or gpu_image(spec.image), o["pvc_name"], spec.pvc_name,
            o["out_path"], f"{WORK_DIR}/manifests.yaml"]
    upload = promote_traffic_upload_uri(spec)
    return argv + ([] if upload is None else [o["traffic_upload_uri"], upload])


def batch_inference_workflow(spec: BatchInferenceWorkflowSpec) -> dict[str, Any]:
    """The batch inference ``Workflow`` for ``spec`` as a plain dict (nothing is submitted).

    Raises:
        pydantic.ValidationError: only when ``spec`` was built with ``model_construct`` and is invalid (a
            validated spec always builds).
    """
    from hera.workflows import Container, Env, Resources, RetryStrategy, SecretEnvFrom, Workflow
    from hera.workflows import models as m

    spec = BatchInferenceWorkflowSpec.model_validate(spec.model_dump())
    labels = _labels("batch-inference")
    argv = batch_inference_argv(spec)
    env = [Env(name="PYTHONUNBUFFERED", value="1")]
    if spec.s3_endpoint_url:
        env.append(Env(name="AWS_ENDPOINT_URL_S3", value=spec.s3_endpoint_url))
    with Workflow(
        generate_name=f"{spec.name}-", namespace=spec.namespace, labels=_object_labels("batch-inference", spec),
        entrypoint="batch-inference",
        service_account_name=spec.service_account, active_deadline_seconds=spec.active_deadline_seconds,
        pod_priority_class_name=spec.priority_class_name, pod_metadata=m.Metadata(labels=labels),
    ) as wf:
        Container(
            name="batch-inference", image=spec.image, command=argv[:3], args=argv[3:], env=env,
            # optional: without the Secret, boto3 falls back to the pod's IAM role (IRSA / Pod Identity)
            env_from=[SecretEnvFrom(name=spec.s3_secret, optional=True)] if spec.s3_secret else None,
            resources=Resources(cpu_request="500m", cpu_limit="2", memory_request="1Gi", memory_limit="1Gi"),
            retry_strategy=RetryStrategy(limit=2, retry_policy="OnError"),
        )
    return wf.to_dict()


def _traffic_artifact(spec: RetuneCronWorkflowSpec):  # -> hera S3Artifact
    from hera.workflows import S3Artifact
    from hera.workflows import models as m

    bucket, key, _ = split_s3_trace_uri(spec.traffic_uri, "traffic_uri")
    kw: dict[str, Any] = {}
    if spec.s3_endpoint_url:  # Argo wants host[:port]; http means insecure
        u = urlparse(spec.s3_endpoint_url)
        kw.update(endpoint=u.netloc, insecure=u.scheme == "http")
    else:
        kw.update(endpoint="s3.amazonaws.com")
    if spec.s3_region:
        kw["region"] = spec.s3_region
    if spec.s3_secret:
        kw.update(access_key_secret=m.SecretKeySelector(name=spec.s3_secret, key="AWS_ACCESS_KEY_ID"),
                  secret_key_secret=m.SecretKeySelector(name=spec.s3_secret, key="AWS_SECRET_ACCESS_KEY"))
    else:
        kw["use_sdk_creds"] = True
    return S3Artifact(name="traffic", path=trace_path(spec), bucket=bucket, key=key, **kw)


def retune_cron_workflow(spec: RetuneCronWorkflowSpec) -> dict[str, Any]:
    """The scheduled re-tuning ``CronWorkflow`` for ``spec`` as a plain dict (nothing is submitted).

    Without ``spec.promote`` one container template, ``retune`` (the entrypoint), runs ``retune_argv``. With it
    the entrypoint ``retune`` is a steps template: step ``tune`` (template ``tune``, output parameters ``replaced``,
    ``registered_version`` and ``champion_version`` read from DECISION_DIR) then step ``promote`` (template
    ``promote``, input parameter ``version`` = the tune step's ``champion_version``; ``promote_argv``, which
    applies nothing when that version already serves; serviceAccountName ``spec.promote_service_account``).

    Raises:
        pydantic.ValidationError: only when ``spec`` was built with ``model_construct`` and is invalid.
    """
    from hera.workflows import (Container, CronWorkflow, EmptyDirVolume, Env, ExistingVolume, Parameter, Resources,
                                RetryStrategy, SecretEnvFrom, Steps)
    from hera.workflows import models as m

    spec = RetuneCronWorkflowSpec.model_validate(spec.model_dump())
    labels = _labels("retune")
    argv = retune_argv(spec)
    direct = spec.trace_window_h is not None  # tune reads the traffic from S3 itself: env credentials, no artifact
    env = [Env(name="PYTHONUNBUFFERED", value="1"),
           Env(name="PDSERVE_HOME", value=f"{WORK_DIR}/state")]  # writable (the image's tree may not be)
    if direct and spec.s3_endpoint_url:
        env.append(Env(name="AWS_ENDPOINT_URL_S3", value=spec.s3_endpoint_url))
    if direct and spec.s3_region:
        env.append(Env(name="AWS_REGION", value=spec.s3_region))
    # optional: infra/k8s/mlflow has no authentication; a Secret is only needed where MLflow has one
    mlflow_env = [SecretEnvFrom(name=spec.mlflow_secret, optional=True)] if spec.mlflow_secret else []
    tune_env_from = list(mlflow_env)
    if direct and spec.s3_secret:  # optional: without it boto3 falls back to the pod's IAM role
        tune_env_from.append(SecretEnvFrom(name=spec.s3_secret, optional=True))

    def volumes():
        return [ExistingVolume(name="fsx", claim_name=spec.pvc_name, mount_path=FSX_MOUNT, read_only=True),
                EmptyDirVolume(name="work", mount_path=WORK_DIR)]
    with CronWorkflow(
        name=spec.name, namespace=spec.namespace, labels=_object_labels("retune", spec), schedules=[spec.schedule],
        timezone=spec.timezone,
        concurrency_policy=spec.concurrency_policy, starting_deadline_seconds=spec.starting_deadline_seconds,
        successful_jobs_history_limit=spec.successful_jobs_history_limit,
        failed_jobs_history_limit=spec.failed_jobs_history_limit, entrypoint="retune",
        service_account_name=spec.service_account, active_deadline_seconds=spec.active_deadline_seconds,
        pod_priority_class_name=spec.priority_class_name, pod_metadata=m.Metadata(labels=labels),
        workflow_metadata=m.WorkflowMetadata(labels=labels),
    ) as cron:
        tune = Container(
            name="tune" if spec.promote else "retune", image=spec.image, command=argv[:1], args=argv[1:], env=env,
            env_from=tune_env_from or None, volumes=volumes(), inputs=None if direct else [_traffic_artifact(spec)],
            # Argo reads each output parameter from a file (valueFrom.path): the values tune --decision-values wrote
            outputs=[Parameter(name=p, value_from=m.ValueFrom(path=f"{DECISION_DIR}/{p}"))
                     for p in (REPLACED_PARAM, VERSION_PARAM, CHAMPION_PARAM)] if spec.promote else None,
            resources=Resources(cpu_request="1", cpu_limit="2", memory_request="2Gi", memory_limit="4Gi"),
            retry_strategy=RetryStrategy(limit=1, retry_policy="OnError"),
        )
        if spec.promote:
            pargv = promote_argv(spec)
            promote = Container(
                name="promote", image=spec.image, command=pargv[:1], args=pargv[1:], env=env, env_from=mlflow_env or None,
                volumes=volumes(),  # /fsx: promote checks the champion's staged copy; /work: its --out
                inputs=[Parameter(name="version")],
                service_account_name=spec.promote_service_account,  # may apply; the tune pod may not
                resources=Resources(cpu_request="500m", cpu_limit="1", memory_request="1Gi", memory_limit="1Gi"),
                # no retry: a rolled-back canary must not be tried again within the same run
            )
            with Steps(name="retune"):
                tune(name="tune")
                promote(name="promote", arguments=[Parameter(name="version", value=PROMOTE_VERSION_ARG)])
    return cron.to_dict()


def to_yaml(objs: list[dict[str, Any]]) -> str:
    """Multi-document YAML of ``objs`` (keys in build order)."""
    return yaml.safe_dump_all(objs, sort_keys=False)
