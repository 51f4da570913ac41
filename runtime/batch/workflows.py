"""Argo Workflows for batch work beside the online endpoint: built with hera, validated offline, never applied here.

* ``batch_inference_workflow`` builds an ``argoproj.io/v1alpha1`` **Workflow** (``generateName: <name>-``) with one
  container step, ``python -m runtime.batch run --input s3://… --output s3://… --endpoint URL …``: an HTTP client
  that sends an OpenAI Batch file to the pdserve InferenceService already serving online traffic (no GPU of its
  own; ``--concurrency`` bounds its share of the endpoint, ``priority_class_name`` lets its pod yield to the
  endpoint's). A failed pod is retried (``retryStrategy`` limit 2, ``OnError``); the runner resumes from the
  partial output, so a retry does not resend finished lines.
* ``retune_cron_workflow`` builds an ``argoproj.io/v1alpha1`` **CronWorkflow** whose workflow runs
  ``pdserve tune /fsx/models/<model>/config.json --like <name> … --trace /work/traffic/<file> --register <name>`` on
  a schedule, re-tuning the registered champion's deployment (GPU, precision, SLO, GPU budget, planner mode: the
  champion's unless the spec sets them):
  the model's config.json comes from the FSx for Lustre PVC (mounted read-only at /fsx), the recorded traffic
  (Azure CSV: ContextTokens, GeneratedTokens; Mooncake JSONL: input_length, output_length) arrives as an Argo S3
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

``validate_workflow_objects`` checks the objects against the vendored Argo Workflow CRD schema
(runtime/deploy/schemas/argoproj.io_v1alpha1_workflow.json, strict about unknown fields), a CronWorkflow's
``spec.workflowSpec`` as a Workflow ``spec`` plus the cron-only fields by hand (no CronWorkflow CRD is vendored),
and what the schema leaves to the controller (entrypoint, container image, mounts naming volumes).

Field names: https://argo-workflows.readthedocs.io/en/latest/fields/ (Workflow, CronWorkflow, Template,
RetryStrategy, S3Artifact); CronWorkflow options (``schedules`` replaced ``schedule``, removed in Argo v4):
https://argo-workflows.readthedocs.io/en/latest/cron-workflows/.
"""

from __future__ import annotations

import copy
import posixpath
import re
import zoneinfo
from typing import Annotated, Any, Iterable, Literal, Optional
from urllib.parse import urlparse

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from runtime.image import DEFAULT_IMAGE, cpu_image, gpu_image
from runtime.command_options import PROMOTE_OPTIONS, TUNE_OPTIONS
from runtime.staging.layout import FSX_MOUNT
from runtime.traces.formats import READABLE_SUFFIXES

__all__ = [
    "BatchInferenceWorkflowSpec", "RetuneCronWorkflowSpec", "batch_inference_workflow", "retune_cron_workflow",
    "validate_workflow_objects", "to_yaml", "batch_inference_argv", "retune_argv", "trace_path", "split_s3_uri",
    "check_cron", "FSX_PVC", "S3_SECRET", "MLFLOW_SECRET", "INSTANCE_ID_LABEL", "CONTROLLER_INSTANCE_ID",
]

API_VERSION = "argoproj.io/v1alpha1"
PROMOTER_SERVICE_ACCOUNT = "pdserve-promoter"  # runtime/deploy/rbac.py PROMOTER_NAME (kserve/promoter-rbac.yaml)
FSX_PVC = "fsx-claim"  # same claim as pipelines/stage_tune_promote.py FSX_PVC (infra/k8s/storage)
WORK_DIR = "/work"
S3_SECRET = "pdserve-s3"  # keys: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY
BATCH_PRIORITY_CLASS = "pdserve-batch"  # infra/k8s/batch/priorityclass.yaml
MLFLOW_SECRET = "pdserve-mlflow"  # keys: MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD
PART_OF = {"app.kubernetes.io/part-of": "pdserve"}
# The pdserve workflow-controller (infra/k8s/argo) acts only on objects with this label and value (its ConfigMap's
# instanceID); KFP's controller (no instanceID) skips labelled objects, so the two never act on the same one.
# Argo docs, workflow-controller-configmap.yaml: instanceID.
INSTANCE_ID_LABEL = "workflows.argoproj.io/controller-instanceid"
CONTROLLER_INSTANCE_ID = "pdserve"
# A Workflow's name is a label value (workflows.argoproj.io/workflow, ≤ 63): generateName adds 5 characters.
WORKFLOW_NAME_MAX = 63 - 6
# The controller names each run <cron name>-<unix minutes> (Argo's documented CronWorkflow limit, as CronJob).
CRON_NAME_MAX = 52

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_GPU = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# ---------------------------------------------------------------------------------------------------- checks


def _dns_label(value: str, what: str, max_len: int = 63) -> str:
    if not _DNS_LABEL.match(value) or len(value) > max_len:
        raise ValueError(f"{what} {value!r}: must be a DNS-1123 label (lowercase letters, digits and '-', starting "
                         f"and ending with a letter or digit) of at most {max_len} characters")
    return value


def _k8s_name(value: str, info: ValidationInfo) -> str:
    return _dns_label(value, info.field_name or "name")


K8sName = Annotated[str, AfterValidator(_k8s_name)]


def split_traffic_uri(uri: str, what: str = "traffic_uri") -> tuple[str, str, bool]:
    """Recorded traffic → ``(bucket, key, is_prefix)``: ``s3://bucket/key.jsonl`` / ``.csv`` (one object) or
    ``s3://bucket/prefix/`` (every object under it; ``key`` is then returned WITHOUT the trailing '/', so a
    zero-byte "folder" object that S3 consoles create under that name is not fetched as the trace).

    Raises:
        ValueError: (message naming ``what``) not s3://, a query string or fragment (a presigned URL; not echoed),
            a bad bucket, no key, an object key that is neither
            .csv nor .jsonl / .json, an empty, '.' or '..' path segment, or a '$' (``$(VAR)`` is expanded by the
            kubelet in container args).
    """
    if isinstance(uri, str) and ("?" in uri or "#" in uri):  # a presigned URL's query is a credential: not echoed
        cut = min(i for i in (uri.find("?"), uri.find("#")) if i >= 0)
        raise ValueError(f"{what} {uri[:cut]!r}…: must not carry a query string or fragment (a presigned URL's "
                         "signature is a credential; the step signs its own requests)")
    if isinstance(uri, str) and "$" in uri:  # the kubelet expands $(VAR) in the tune step's args
        raise ValueError(f"{what} {uri!r}: must not contain '$'")
    if isinstance(uri, str) and uri.endswith("/"):
        bucket, key = split_s3_uri(uri.rstrip("/"), what)  # the bucket and a non-empty prefix checked as a key
        if any(seg in ("", ".", "..") for seg in key.split("/")):
            raise ValueError(f"{what} {uri!r}: empty, '.' or '..' path segment in the prefix")
        return bucket, key, True
    bucket, key = split_s3_uri(uri, what)
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        raise ValueError(f"{what} {uri!r}: empty, '.' or '..' path segment in the key")
    if not key.lower().endswith(READABLE_SUFFIXES):
        raise ValueError(f"{what} {uri!r}: must name a .csv (Azure) or .jsonl / .json (Mooncake) trace, or a "
                         "prefix ending in '/' holding such files")
    return bucket, key, False


def split_s3_uri(uri: str, what: str = "uri") -> tuple[str, str]:
    """``s3://bucket/key`` → (bucket, key) (``runtime.s3uri.split_s3_object_uri``).

    Raises:
        ValueError: (message naming ``what``) not s3://, a bucket S3 would refuse, no key, or a key ending in '/'.
    """
    from runtime.s3uri import split_s3_object_uri

    return split_s3_object_uri(uri, what)


def _http_url(value: str, what: str) -> str:
    from runtime.redact import redact_userinfo

    try:
        u = urlparse(value)
        u.port  # noqa: B018 - raises ValueError for a port outside 0-65535
    except ValueError as e:
        raise ValueError(f"{what} {redact_userinfo(value)!r}: not a URL ({e})") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"{what} {redact_userinfo(value)!r}: must be an http:// or https:// URL with a host")
    if u.username is not None or u.password is not None:  # it would be written into the object in clear
        raise ValueError(f"{what} {redact_userinfo(value)!r}: must not carry credentials (use a Secret)")
    return value


_CRON_FIELDS = (  # (name, low, high, names)
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")),
    # 0-6: Argo parses schedules with robfig/cron v3, whose standard parser has no 7 for Sunday
    ("day of week", 0, 6, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")),
)


def check_cron(schedule: str) -> str:
    """Return ``schedule`` when it is a standard 5-field cron expression (minute hour day-of-month month
    day-of-week; ``*``, ``a``, ``a-b``, ``/step`` and ``,`` lists; month and weekday names; ``?`` for a day).

    Raises:
        ValueError: wrong field count, or a field (named in the message) out of range or malformed.
    """
    if not isinstance(schedule, str):
        raise ValueError(f"schedule {schedule!r}: must be a string")
    fields = schedule.split()
    if len(fields) != 5:
        raise ValueError(f"schedule {schedule!r}: must have 5 fields (minute hour day-of-month month day-of-week), "
                         f"got {len(fields)}")
    for text, (fname, lo, hi, names) in zip(fields, _CRON_FIELDS):
        def value(v: str) -> int:
            if v.upper() in names:
                return names.index(v.upper()) + (lo if fname == "month" else 0)
            if not v.isdigit() or not lo <= int(v) <= hi:
                raise ValueError(f"schedule {schedule!r}: {fname} {v!r} is not in {lo}-{hi}")
            return int(v)

        for item in text.split(","):
            rng, slash, step = item.partition("/")
            if slash and (not step.isdigit() or int(step) < 1):
                raise ValueError(f"schedule {schedule!r}: {fname} step {step!r} must be a positive integer")
            if rng == "*" or (rng == "?" and fname.startswith("day")):
                continue
            a, dash, b = rng.partition("-")
            if dash and value(a) > value(b):
                raise ValueError(f"schedule {schedule!r}: {fname} range {rng!r} is reversed")
            if not dash:
                value(a)
    return schedule


def _check_timezone(tz: str) -> str:
    try:
        zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as e:
        raise ValueError(f"timezone {tz!r}: not an IANA time zone name (e.g. UTC, Europe/Paris)") from e
    return tz


# ---------------------------------------------------------------------------------------------------- specs


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_argo_expressions(cls, data: Any) -> Any:
        """Argo substitutes ``{{...}}`` anywhere in a template: a value holding one would not reach the step as
        written (and could read workflow variables), so none may."""
        if isinstance(data, dict):
            for k, v in data.items():
                if isinstance(v, str) and "{{" in v:
                    raise ValueError(f"{k} {v!r}: must not contain '{{{{' (Argo would substitute it)")
        return data

    namespace: K8sName = Field("pdserve", description="Namespace the workflow (and its pods) run in.")
    image: str = Field(cpu_image(DEFAULT_IMAGE), min_length=1,
                       description="Container image the steps run, pdserve installed; no step needs a GPU: the CPU "
                                   "build (kserve/Dockerfile.cpu, runtime/image.py) by default.")
    service_account: K8sName = Field(
        "pdserve-batch", description="spec.serviceAccountName: the pods' service account (it needs Argo's executor "
                                     "permissions; with IRSA / Pod Identity, also the AWS role).")
    priority_class_name: Optional[str] = Field(
        BATCH_PRIORITY_CLASS, description="spec.podPriorityClassName: a PriorityClass lower than the online "
                                          "endpoint's, so batch pods are preempted first (infra/k8s/batch defines "
                                          "pdserve-batch). None: the cluster default.")
    s3_secret: Optional[K8sName] = Field(
        S3_SECRET, description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (referenced, never copied); "
                               "None: the pod's IAM role (IRSA / Pod Identity).")
    s3_endpoint_url: Optional[str] = Field(
        None, description="S3-compatible endpoint (http(s)://host[:port], e.g. MinIO); None: AWS S3.")
    controller_instance_id: Optional[str] = Field(
        CONTROLLER_INSTANCE_ID, description=f"Value of the {INSTANCE_ID_LABEL} label on the Workflow / CronWorkflow "
        "(its runs inherit it): the instanceID of the Argo controller that runs it (infra/k8s/argo: "
        "'pdserve', managing namespace pdserve only). None: no label, for a controller without instanceID.")

    @field_validator("controller_instance_id")
    @classmethod
    def _instance_id(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not re.match(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", v) or len(v) > 63):
            raise ValueError(f"controller_instance_id {v!r}: must be a label value (at most 63 letters, digits, "
                             "'-', '_', '.', starting and ending with a letter or digit)")
        return v

    @field_validator("priority_class_name")
    @classmethod
    def _priority(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", v) or len(v) > 253):
            raise ValueError(f"priority_class_name {v!r}: must be a DNS-1123 subdomain (a PriorityClass name)")
        return v

    @field_validator("s3_endpoint_url")
    @classmethod
    def _s3_endpoint(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else _http_url(v, "s3_endpoint_url")


class BatchInferenceWorkflowSpec(_Common):
    """One batch inference run: an OpenAI Batch file on S3 sent to the online pdserve endpoint."""

    name: str = Field(description=f"Workflow generateName prefix (DNS-1123 label, ≤ {WORKFLOW_NAME_MAX} characters; "
                                  "the controller appends '-' and 5 characters).")
    input_uri: str = Field(description="OpenAI Batch input file (JSONL), s3://bucket/key.")
    output_uri: str = Field(description="Output JSONL, s3://bucket/key; existing successful lines are kept (resume).")
    endpoint: str = Field(description="OpenAI base URL of the pdserve InferenceService, in-cluster: "
                                      "http://<isvc>-predictor.<namespace>.svc.cluster.local/openai.")
    model: Optional[str] = Field(None, min_length=1, description="Served model name for lines whose body has none.")
    concurrency: int = Field(8, ge=1, description="Requests in flight: the batch's share of the online endpoint.")
    max_retries: int = Field(3, ge=0, description="Extra tries per request after a connection error, 429 or 5xx.")
    active_deadline_seconds: int = Field(86400, ge=1, description="spec.activeDeadlineSeconds: the run's time limit.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _dns_label(v, "name", WORKFLOW_NAME_MAX)

    @field_validator("input_uri", "output_uri")
    @classmethod
    def _s3(cls, v: str, info: ValidationInfo) -> str:
        split_s3_uri(v, info.field_name or "uri")
        return v

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        from runtime.batch.run import BatchRunError, check_endpoint

        try:  # exactly what the runner in the pod accepts (no query, fragment or credentials)
            check_endpoint(v)
        except BatchRunError as e:
            raise ValueError(str(e).removeprefix("--endpoint ")) from None
        return v

    @model_validator(mode="after")
    def _distinct(self) -> "BatchInferenceWorkflowSpec":
        if self.input_uri == self.output_uri:
            raise ValueError(f"output_uri {self.output_uri!r}: must differ from input_uri (it would be overwritten)")
        return self


class RetuneCronWorkflowSpec(_Common):
    """Scheduled re-tuning of a staged model from recorded traffic, registering the winner in MLflow."""

    name: str = Field(description=f"CronWorkflow name (DNS-1123 label, ≤ {CRON_NAME_MAX} characters: Argo appends "
                                  "the scheduled time to name each run).")
    schedule: str = Field("0 3 * * 0", description="5-field cron expression (spec.schedules[0]); default Sunday "
                                                   "03:00.")
    timezone: str = Field("UTC", description="IANA time zone the schedule is read in.")
    concurrency_policy: Literal["Allow", "Forbid", "Replace"] = Field(
        "Forbid", description="What to do when a run is due while the previous one still runs.")
    starting_deadline_seconds: int = Field(
        3600, ge=0, description="A run missed by more than this (controller down) is skipped.")
    successful_jobs_history_limit: int = Field(3, ge=0, description="Finished successful runs kept.")
    failed_jobs_history_limit: int = Field(3, ge=0, description="Finished failed runs kept.")
    model_name: str = Field(description="Served model name = its folder under /fsx/models (e.g. llama8, org/llama8).")
    gpu: Optional[str] = Field(None, description="GPU catalog name or AWS instance type (pdserve tune --gpu); None: "
                                                 "the champion's.")
    ttft_ms: Optional[float] = Field(None, gt=0, description="TTFT p90 SLO, ms; None: the champion's.")
    itl_ms: Optional[float] = Field(None, gt=0, description="ITL p90 SLO, ms; None: the champion's.")
    rate: Optional[float] = Field(
        None, gt=0, description="Target request rate, requests/s; None: the recorded traffic's mean arrival rate "
                                "(what `pdserve tune --trace` uses without --rate).")
    precision: Optional[Literal["auto", "bf16", "fp8"]] = Field(
        None, description="Weights and KV precision (pdserve tune --precision); None: the champion's.")
    gpu_budget: Optional[int] = Field(None, ge=1, description="GPUs the deployment may use; None: the champion's.")
    planner: Optional[Literal["off", "sla", "load"]] = Field(
        None, description="SLO planner mode of the re-tuned deployment (pdserve tune --planner); None: the "
                          "champion's.")
    min_improvement_pct: Optional[float] = Field(
        None, ge=0, allow_inf_nan=False,
        description="How much less (percent) the winner must cost than the champion's deployment to take the "
                    "champion alias (pdserve tune --min-improvement-pct); None: tune's default.")
    traffic_uri: str = Field(description="Recorded traffic, s3://bucket/key ending in .csv (Azure: ContextTokens, "
                                         "GeneratedTokens) or .jsonl (Mooncake: input_length, output_length), or "
                                         "s3://bucket/prefix/ (every such file under it, e.g. one traffic log "
                                         "per runtime replica, read as one trace).")
    trace_window_h: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False,
        description="Size for the requests of the traffic's last HOURS only (pdserve tune --trace-window-h). Set, "
                    "the step reads the traffic from S3 itself instead of an Argo artifact (credentials: the "
                    "s3_secret by envFrom, else the pod's IAM role), so objects of a prefix last modified before "
                    "the window are not downloaded. None: the whole traffic, downloaded as an Argo artifact.")
    s3_region: Optional[str] = Field(None, min_length=1, description="Region of the traffic bucket (artifact).")
    s3_secret: Optional[K8sName] = Field(
        None, description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for reading the traffic "
                          "(referenced, never copied); None (default): the pod's IAM role, which infra/terraform "
                          "gives pdserve-batch through EKS Pod Identity (no such Secret exists there).")
    mlflow_uri: str = Field("http://mlflow.mlflow.svc:5000", description="MLflow tracking server, http(s)://.")
    mlflow_secret: Optional[K8sName] = Field(
        MLFLOW_SECRET, description="Secret with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (envFrom); "
                                   "None: no credentials.")
    registered_model: str = Field(description="MLflow registered model whose champion is re-tuned (`pdserve tune "
                                              "--like`) and under which the winner is registered (it takes alias "
                                              "champion only when it beats the champion).")
    pvc_name: K8sName = Field(FSX_PVC, description="FSx for Lustre PVC holding /fsx/models (mounted read-only); "
                                                   "with promote also the promoted workers' (`pdserve promote --pvc`).")
    active_deadline_seconds: int = Field(21600, ge=1, description="Each run's time limit (both steps), seconds.")
    promote: bool = Field(
        False, description="Add a second step, `pdserve promote NAME --apply --skip-if-live --expect-version V`, "
                           "V the version alias champion names after the tune step: a canary beside the serving "
                           "revision, probed against the SLO and rolled back when it misses; nothing applied when "
                           "V already serves with promote_image (the champion stayed).")
    promote_namespace: Optional[K8sName] = Field(
        None, description="Namespace of the InferenceService (`pdserve promote --namespace`); None: the workflow's. "
                          "promote_service_account must be allowed to manage it there (kserve/promoter-rbac.yaml).")
    promote_image: Optional[str] = Field(
        None, min_length=1, description="pdserve runtime image the promoted InferenceService runs (`pdserve promote "
                                        "--image`); None: the GPU build of ``image`` (its tag without the CPU suffix, "
                                        "runtime/image.py gpu_image; an endpoint on another image than the one it "
                                        "was promoted with is rolled out again).")
    promote_service_account: K8sName = Field(
        PROMOTER_SERVICE_ACCOUNT, description="serviceAccountName of the promote step only (the tune step keeps "
        "service_account): pdserve-promoter (kserve/promoter-rbac.yaml) may apply the rendered objects, and "
        "infra/k8s/batch lets it report the step's result to Argo.")
    promote_traffic_upload: Optional[str] = Field(
        None, description="`pdserve promote --traffic-upload`: s3://bucket/prefix/ the promoted endpoint keeps "
        "shipping its traffic to, so later runs have traffic to re-tune from; 'none': it records nothing. None: "
        "derived from traffic_uri when that is <prefix><InferenceService>/ (what the endpoint ships), else "
        "refused with promote (the new revision would silently stop recording).")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _dns_label(v, "name", CRON_NAME_MAX)

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, v: str) -> str:
        return check_cron(v)

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        return _check_timezone(v)

    @field_validator("model_name")
    @classmethod
    def _model_name(cls, v: str) -> str:
        from runtime.config import check_model_name

        return check_model_name(v)

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _GPU.match(v):
            raise ValueError(f"gpu {v!r}: must be a GPU catalog name or instance type (letters, digits, . _ -)")
        if v is not None:  # what `pdserve tune --gpu` accepts, checked now rather than at the first scheduled run
            from runtime.tuner.search import resolve_gpu

            try:
                resolve_gpu(v)
            except KeyError as e:
                raise ValueError(f"gpu {v!r}: neither a GPU catalog name nor a known AWS instance type "
                                 f"({e.args[0]})") from None
        return v

    @field_validator("traffic_uri")
    @classmethod
    def _traffic(cls, v: str) -> str:
        split_traffic_uri(v, "traffic_uri")
        return v

    @field_validator("mlflow_uri")
    @classmethod
    def _mlflow(cls, v: str) -> str:
        return _http_url(v, "mlflow_uri")

    @field_validator("registered_model")
    @classmethod
    def _registered(cls, v: str) -> str:
        from runtime.tracking.mlflow_runs import check_registered_model_name

        return check_registered_model_name(v)

    @field_validator("promote_traffic_upload")
    @classmethod
    def _upload(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and v != "none":
            from runtime.s3uri import check_upload_uri

            check_upload_uri(v)
        return v

    @model_validator(mode="after")
    def _promote_options(self) -> "RetuneCronWorkflowSpec":
        extra = sorted(f for f, info in type(self).model_fields.items()
                       if f.startswith("promote_") and getattr(self, f) != info.default)
        if not self.promote and extra:
            raise ValueError(f"{extra[0]}: only used with promote (--promote; the workflow has no promote step "
                             "without it)")
        if self.promote and self.promote_traffic_upload is None and promote_traffic_upload_uri(self) is None:
            raise ValueError(
                f"promote_traffic_upload: traffic_uri {self.traffic_uri!r} is not <prefix><InferenceService>/ "
                f"(<InferenceService> = {isvc_name(self.registered_model)!r}), so the upload prefix of the promoted "
                "endpoint cannot be derived; give the s3://bucket/prefix/ it was promoted with (--traffic-upload), "
                "or 'none' to let the new revision record nothing")
        return self


# ---------------------------------------------------------------------------------------------------- builders


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _labels(workload: str) -> dict[str, str]:
    return {**PART_OF, "pdserve.io/workload": workload}


def _object_labels(workload: str, spec: _Common) -> dict[str, str]:
    """Labels of the Workflow / CronWorkflow itself: ``_labels`` plus the controller instance label. A CronWorkflow's
    runs inherit that label from it (Argo workflow/common/convert.go ``toWorkflow``); the controller labels the
    pods itself."""
    iid = {} if spec.controller_instance_id is None else {INSTANCE_ID_LABEL: spec.controller_instance_id}
    return {**_labels(workload), **iid}


def batch_inference_argv(spec: BatchInferenceWorkflowSpec) -> list[str]:
    """The step's command line (command + args)."""
    argv = ["python", "-m", "runtime.batch", "run", "--input", spec.input_uri, "--output", spec.output_uri,
            "--endpoint", spec.endpoint, "--concurrency", str(spec.concurrency)]
    if spec.model is not None:
        argv += ["--model", spec.model]
    return argv + ["--max-retries", str(spec.max_retries), "--no-progress"]  # the JSON summary line says it all


def trace_path(spec: RetuneCronWorkflowSpec) -> str:
    """Where the traffic artifact lands in the tune container: /work/traffic/<last segment of the key> (a file,
    or for a prefix a folder of its objects)."""
    return posixpath.join(WORK_DIR, "traffic", posixpath.basename(split_traffic_uri(spec.traffic_uri)[1]))


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


def isvc_name(registered_model: str) -> str:
    """The InferenceService `pdserve promote` names after ``registered_model`` (runtime.deploy.target.dns_label)."""
    from runtime.deploy.target import dns_label

    return dns_label(registered_model)


def promote_traffic_upload_uri(spec: RetuneCronWorkflowSpec) -> Optional[str]:
    """The ``--traffic-upload`` of the promote step: ``spec.promote_traffic_upload`` (None for 'none'), else the
    prefix the endpoint ships to when ``spec.traffic_uri`` is ``s3://bucket/<prefix><InferenceService>/`` (the
    runtime writes under ``<prefix><InferenceService>/<pod>/``, runtime.deploy.target.ClusterTarget), else None."""
    if spec.promote_traffic_upload is not None:
        return None if spec.promote_traffic_upload == "none" else spec.promote_traffic_upload
    bucket, key, is_prefix = split_traffic_uri(spec.traffic_uri)
    head, _, last = key.rpartition("/")
    if not is_prefix or last != isvc_name(spec.registered_model):
        return None
    return f"s3://{bucket}/{head}/" if head else f"s3://{bucket}/"


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

    bucket, key, _ = split_traffic_uri(spec.traffic_uri)
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


# ---------------------------------------------------------------------------------------------------- validation

_CRON_SPEC_KEYS = {"schedules", "timezone", "concurrencyPolicy", "startingDeadlineSeconds", "suspend",
                   "successfulJobsHistoryLimit", "failedJobsHistoryLimit", "workflowSpec", "workflowMetadata",
                   "stopStrategy", "when"}


def _controller_problems(ident: str, path: str, spec: Any) -> list[str]:
    """What the CRD schema leaves to the controller: entrypoint names a template, containers have an image,
    volume mounts name a volume of the template or the workflow, containers do not refer to steps' outputs
    (out of their scope), and steps templates refer to what exists (``_steps_problems``)."""
    if not isinstance(spec, dict):
        return []
    out: list[str] = []
    templates = [t for t in spec.get("templates") or [] if isinstance(t, dict)]
    names = {t.get("name") for t in templates}
    if spec.get("entrypoint") not in names:
        out.append(f"{ident}: {path}.entrypoint: {spec.get('entrypoint')!r} names no template")
    wf_volumes = {v.get("name") for v in spec.get("volumes") or [] if isinstance(v, dict)}
    for i, t in enumerate(templates):
        c = t.get("container")
        if not isinstance(c, dict):
            continue
        tpath = f"{path}.templates[{i}]"
        if not c.get("image"):
            out.append(f"{ident}: {tpath}.container.image: a container needs an image")
        if re.search(r"\{\{\s*(steps|tasks)\.", str(c)):
            out.append(f"{ident}: {tpath}.container: refers to steps./tasks. outputs, which a container template "
                       "cannot see (pass them in as input parameters)")
        volumes = wf_volumes | {v.get("name") for v in t.get("volumes") or [] if isinstance(v, dict)}
        for j, vm in enumerate(c.get("volumeMounts") or []):
            if isinstance(vm, dict) and vm.get("name") not in volumes:
                out.append(f"{ident}: {tpath}.container.volumeMounts[{j}].name: {vm.get('name')!r} names no volume")
    out += _steps_problems(ident, path, templates)
    return out


_STEP_OUTPUT = re.compile(r"\{\{\s*steps\.([-\w]+)\.outputs\.parameters\.([-\w]+)\s*\}\}")


def _steps_problems(ident: str, path: str, templates: list[dict[str, Any]]) -> list[str]:
    """Steps templates: every step names a template; every ``{{steps.S.outputs.parameters.P}}`` (``when``,
    arguments) names an EARLIER step S whose template declares output parameter P; every input parameter without
    a default of the called template gets an argument (what the controller refuses at submission)."""
    by_name = {t.get("name"): t for t in templates}
    out: list[str] = []
    for i, t in enumerate(templates):
        if not isinstance(t.get("steps"), list):
            continue
        seen: dict[str, dict[str, Any]] = {}
        for g, group in enumerate(t["steps"]):
            current: dict[str, dict[str, Any]] = {}
            for j, step in enumerate(group if isinstance(group, list) else []):
                if not isinstance(step, dict):
                    continue
                where = f"{path}.templates[{i}].steps[{g}][{j}]"
                called = by_name.get(step.get("template"))
                if called is None:
                    out.append(f"{ident}: {where}.template: {step.get('template')!r} names no template")
                    continue
                for s_name, p_name in _STEP_OUTPUT.findall(str({k: v for k, v in step.items() if k != "name"})):
                    declared = {p.get("name") for p in ((seen.get(s_name) or {}).get("outputs") or {}).get(
                        "parameters") or []}
                    if s_name not in seen or p_name not in declared:
                        out.append(f"{ident}: {where}: steps.{s_name}.outputs.parameters.{p_name} is not an output "
                                   "parameter of an earlier step")
                given = {p.get("name") for p in (step.get("arguments") or {}).get("parameters") or []}
                for p in (called.get("inputs") or {}).get("parameters") or []:
                    if "value" not in p and "default" not in p and p.get("name") not in given:
                        out.append(f"{ident}: {where}.arguments: input parameter {p.get('name')!r} of template "
                                   f"{called.get('name')!r} is not given")
                current[step.get("name")] = called
            seen.update(current)
    return out


def _cron_problems(ident: str, spec: dict[str, Any]) -> list[str]:
    out = [f"{ident}: spec.{k}: unknown CronWorkflow field"
           for k in sorted(set(spec) - _CRON_SPEC_KEYS - {"schedule"})]
    if "schedule" in spec:
        out.append(f"{ident}: spec.schedule: removed in Argo Workflows v4, use schedules (a list)")
    schedules = spec.get("schedules")
    if not isinstance(schedules, list) or not schedules:
        out.append(f"{ident}: spec.schedules: must be a non-empty list of cron expressions")
    else:
        for i, s in enumerate(schedules):
            try:
                check_cron(s)
            except ValueError as e:
                out.append(f"{ident}: spec.schedules[{i}]: {e}")
    if spec.get("concurrencyPolicy", "Allow") not in ("Allow", "Forbid", "Replace"):
        out.append(f"{ident}: spec.concurrencyPolicy: {spec['concurrencyPolicy']!r} is not Allow, Forbid or Replace")
    for k in ("startingDeadlineSeconds", "successfulJobsHistoryLimit", "failedJobsHistoryLimit"):
        v = spec.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            out.append(f"{ident}: spec.{k}: {v!r} is not a non-negative integer")
    if "timezone" in spec:
        try:
            _check_timezone(spec["timezone"] if isinstance(spec["timezone"], str) else "")
        except ValueError as e:
            out.append(f"{ident}: spec.timezone: {e}")
    if "suspend" in spec and not isinstance(spec["suspend"], bool):
        out.append(f"{ident}: spec.suspend: must be a boolean")
    if not isinstance(spec.get("workflowSpec"), dict):
        out.append(f"{ident}: spec.workflowSpec: required (a Workflow spec)")
    return out


def validate_workflow_objects(objs: Iterable[dict[str, Any]]) -> list[str]:
    """Problems with Argo ``Workflow`` / ``CronWorkflow`` objects; empty when all are valid.

    A Workflow is checked against the vendored Argo Workflow CRD schema (``runtime.deploy.validate``; one with
    only ``generateName`` as if the controller had appended 5 characters); a CronWorkflow's ``spec.workflowSpec``
    the same way as a Workflow ``spec``, its own fields (``schedules``: 5-field crons, ``concurrencyPolicy``:
    Allow/Forbid/Replace, non-negative deadlines and history limits, IANA ``timezone``, no unknown field) by hand.
    Both also get the controller's checks (entrypoint names a template, containers have an image, mounts name a
    volume, a step's ``{{steps.S.outputs.parameters.P}}`` names an output parameter of an earlier step, a called
    template's input parameters are given, no container refers to steps' outputs). Never raises for a bad object: every problem is a "Kind/name: field.path: reason" string.
    """
    from runtime.deploy.errors import ManifestError
    from runtime.deploy.validate import validate_object

    problems: list[str] = []
    for obj in objs:
        if not isinstance(obj, dict):
            problems.append(f"object is a {type(obj).__name__}, not a mapping")
            continue
        kind = obj.get("kind")
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        name = meta.get("name") or meta.get("generateName")
        ident = f"{kind}/{name}"
        if obj.get("apiVersion") != API_VERSION or kind not in ("Workflow", "CronWorkflow"):
            problems.append(f"{ident}: apiVersion/kind: not an {API_VERSION} Workflow or CronWorkflow")
            continue
        if not isinstance(name, str) or not name:
            problems.append(f"{ident}: metadata.name: a name or generateName is required")
            continue
        spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
        if kind == "Workflow":
            candidate = copy.deepcopy(obj)
            if not meta.get("name"):
                candidate["metadata"]["name"] = f"{name}abcde"
                if len(candidate["metadata"]["name"]) > 63:
                    problems.append(f"{ident}: metadata.generateName: longer than {WORKFLOW_NAME_MAX} characters")
            prefix, path = "", "spec"
        else:
            if len(name) > CRON_NAME_MAX or not _DNS_LABEL.match(name):
                problems.append(f"{ident}: metadata.name: must be a DNS-1123 label of at most {CRON_NAME_MAX} "
                                "characters")
            problems += _cron_problems(ident, spec)
            if not isinstance(spec.get("workflowSpec"), dict):
                continue
            candidate = {"apiVersion": API_VERSION, "kind": "Workflow",
                         "metadata": {k: v for k, v in meta.items() if k in ("name", "namespace", "labels")},
                         "spec": spec["workflowSpec"]}
            prefix, path = "spec.workflowSpec", "spec.workflowSpec"
        try:
            validate_object(candidate)
        except ManifestError as e:
            msg = str(e)
            head = f"Workflow/{candidate['metadata'].get('name')}: "
            rest = msg[len(head):] if msg.startswith(head) else msg
            if prefix and rest.startswith("spec."):
                rest = prefix + rest[len("spec"):]
            elif prefix and rest.startswith("spec:"):
                rest = prefix + rest[len("spec"):]
            problems.append(f"{ident}: {rest}")
        problems += _controller_problems(ident, path, candidate.get("spec"))
    return problems
