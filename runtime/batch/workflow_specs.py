"""What a batch or re-tuning workflow is asked to be: the checked specs (``BatchInferenceWorkflowSpec``,
``RetuneCronWorkflowSpec``), their field checks (names, S3 URIs, cron schedules, time zones) and the names shared
with the cluster (secrets, service accounts, the controller's instance label). runtime/batch/workflows.py builds
the Argo objects from them; runtime/batch/workflow_validation.py checks built objects."""

from __future__ import annotations

import re
import zoneinfo
from typing import Annotated, Any, Literal, Optional
from urllib.parse import urlparse

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from runtime.image import DEFAULT_IMAGE, cpu_image
from runtime.s3uri import split_s3_object_uri, split_s3_trace_uri

API_VERSION = "argoproj.io/v1alpha1"
PROMOTER_SERVICE_ACCOUNT = "pdserve-promoter"  # runtime/deploy/rbac.py PROMOTER_NAME (kserve/promoter-rbac.yaml)
FSX_PVC = "fsx-claim"  # same claim as pipelines/stage_tune_promote.py FSX_PVC (infra/k8s/storage)
BATCH_SERVICE_ACCOUNT = "pdserve-batch"  # infra/k8s/batch/serviceaccount.yaml
MLFLOW_URI = "http://mlflow.mlflow.svc:5000"  # infra/k8s/mlflow/service.yaml, from the steps' pods
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

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_GPU = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")



# ---------------------------------------------------------------------------------------------------- checks


def _dns_label(value: str, what: str, max_len: int = 63) -> str:
    if not DNS_LABEL.match(value) or len(value) > max_len:
        raise ValueError(f"{what} {value!r}: must be a DNS-1123 label (lowercase letters, digits and '-', starting "
                         f"and ending with a letter or digit) of at most {max_len} characters")
    return value


def _k8s_name(value: str, info: ValidationInfo) -> str:
    return _dns_label(value, info.field_name or "name")


K8sName = Annotated[str, AfterValidator(_k8s_name)]


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


def check_timezone(tz: str) -> str:
    try:
        zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as e:
        raise ValueError(f"timezone {tz!r}: not an IANA time zone name (e.g. UTC, Europe/Paris)") from e
    return tz


# ---------------------------------------------------------------------------------------------------- specs


class CommonWorkflowSpec(BaseModel):
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

    @field_validator("*")
    @classmethod
    def _no_kubelet_expansion(cls, v: Any, info: ValidationInfo) -> Any:
        """The kubelet expands ``$(VAR)`` in container args from the pod's environment, which holds the S3
        Secret's keys: a value holding a '$' would not reach the step as written (and could read a secret)."""
        if isinstance(v, str) and "$" in v:
            raise ValueError(f"{info.field_name} {v!r}: must not contain '$' (Kubernetes expands $(VAR) in "
                             "container args)")
        return v

    namespace: K8sName = Field("pdserve", description="Namespace the workflow (and its pods) run in.")
    image: str = Field(cpu_image(DEFAULT_IMAGE), min_length=1,
                       description="Container image the steps run, pdserve installed; no step needs a GPU: the CPU "
                                   "build (kserve/Dockerfile.cpu, runtime/image.py) by default.")
    service_account: K8sName = Field(
        BATCH_SERVICE_ACCOUNT, description="spec.serviceAccountName: the pods' service account (it needs Argo's "
                                           "executor permissions; with IRSA / Pod Identity, also the AWS role).")
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


class BatchInferenceWorkflowSpec(CommonWorkflowSpec):
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
        split_s3_object_uri(v, info.field_name or "uri")
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


class RetuneCronWorkflowSpec(CommonWorkflowSpec):
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
    # finite: `pdserve tune` refuses inf, so every scheduled run would fail
    ttft_ms: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description="TTFT p90 SLO, ms; None: the "
                                                                                  "champion's.")
    itl_ms: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description="ITL p90 SLO, ms; None: the "
                                                                                "champion's.")
    rate: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False, description="Target request rate, requests/s; None: the recorded traffic's mean arrival rate "
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
                                         "GeneratedTokens; BurstGPT: Request tokens, Response tokens) or .jsonl (Mooncake: input_length, output_length), or "
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
    mlflow_uri: str = Field(MLFLOW_URI, description="MLflow tracking server, http(s)://.")
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
        return check_timezone(v)

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
        split_s3_trace_uri(v, "traffic_uri")
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
    bucket, key, is_prefix = split_s3_trace_uri(spec.traffic_uri, "traffic_uri")
    head, _, last = key.rpartition("/")
    if not is_prefix or last != isvc_name(spec.registered_model):
        return None
    return f"s3://{bucket}/{head}/" if head else f"s3://{bucket}/"
