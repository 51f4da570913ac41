"""Where and how a DeploymentSpec is placed on a cluster (deploy-side settings, not tuned values).

`ClusterTarget` holds what the tuner does not decide: EC2 instance type and EFA, NodePool taints,
per-worker CPU/memory headroom, shared-memory size, ports and probe timings. Defaults target EKS with
the Karpenter GPU NodePools of infra/k8s/karpenter/. Name checks follow the Kubernetes rules
(kubernetes.io/docs/concepts/overview/working-with-objects/names/): DNS-1035 labels for Service-backed
names (InferenceService, worker Services), DNS-1123 labels for namespaces, DNS-1123 subdomains for PVCs.
"""

from __future__ import annotations

import hashlib
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.deploy.errors import ManifestError

DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_LABEL_CHARS = 63
MAX_SUBDOMAIN_CHARS = 253
#: Beyond the workers' startup probe budget, a first rollout waits for Karpenter to launch a GPU node and for the
#: worker and runtime images to be pulled onto it (minutes each on a fresh p5 node with a CUDA image), seconds.
NODE_LAUNCH_AND_PULL_S = 1200


class ClusterTarget(BaseModel):
    """Cluster-side placement settings for the rendered objects."""

    model_config = ConfigDict(extra="forbid")

    instance_type: str | None = Field(
        default=None, description="EC2 instance type of the GPU workers; None = default for spec.gpu."
    )
    efa: bool | None = Field(
        default=None,
        description="Use EFA (NIXL LIBFABRIC backend, vpc.amazonaws.com/efa requests); None = if the "
        "instance has an EFA interface for every worker a node holds at both pools' TP (p5: always; p4d/p4de, "
        "g6e.48xlarge: TP >= 2; g5/g6.48xlarge: TP 8), so no worker waits for an interface beside idle GPUs.",
    )
    gpu_taint_key: str = Field(default="nvidia.com/gpu", description="Taint on the Karpenter GPU nodes.")
    cpu_share: float = Field(
        default=0.75, gt=0, le=1, description="Fraction of the instance's per-GPU vCPUs/memory a worker requests."
    )
    shm_size_gib: int = Field(default=16, gt=0, description="/dev/shm emptyDir (Memory) size, GiB.")
    worker_port: int = Field(default=8000, ge=1, le=65535, description="vLLM OpenAI HTTP port on workers.")
    nixl_side_channel_port: int = Field(default=5600, ge=1, le=65535,
                                        description="VLLM_NIXL_SIDE_CHANNEL_PORT on workers.")
    kv_events_port: int = Field(default=5557, ge=1, le=65535, description="ZMQ KV-event publisher port on workers.")
    runtime_port: int = Field(default=8080, ge=1, le=65535,
                              description="HTTP port of the pdserve runtime (KServe).")
    fsx_mount_path: str = Field(default="/mnt/fsx", description="Where the FSx PVC is mounted in workers.")
    worker_startup_timeout_s: int = Field(
        default=1800, gt=0, description="Startup probe budget for a worker (weights load), seconds."
    )
    runtime_cpu: str = Field(default="2", description="CPU request of the runtime container (cores).")
    runtime_memory: str = Field(default="4Gi", description="Memory request of the runtime container.")
    runtime_min_replicas: int = Field(
        default=2, ge=1, le=1000, description="Fewest runtime replicas (KServe predictor minReplicas): 2 keeps a "
        "stand-by that takes over the planner's lease and the traffic when one runtime pod is lost.")
    runtime_max_replicas: int = Field(default=8, ge=1, le=1000,
                                      description="Most runtime replicas (KServe predictor maxReplicas).")
    runtime_rps_target: int = Field(
        default=75, ge=1, description="Requests per second per runtime replica the Knative autoscaler aims at "
        "(predictor scaleMetric rps). Default: half of the 150 requests per second one runtime process sustains within 50 ms "
        "of added TTFT p99 with room to spare (`python bench/frontend.py` on a shared 2-core machine: 150 to 200 "
        "in its runs of 2026-12-06, bench/results/frontend.json): its one event loop, not its CPU, bounds it.")
    run_as_user: int = Field(default=10001, ge=1, description="Non-root UID of every container (image user).")
    monitoring_namespace: str = Field(default="monitoring", description="Namespace Prometheus scrapes from.")
    prometheus_release_label: str = Field(
        default="kube-prometheus-stack", description="`release` label the Prometheus operator selects."
    )
    traffic_upload_uri: str | None = Field(
        default=None,
        description="s3://bucket/prefix/ the runtime ships its recorded traffic to (one JSON line per finished "
        "request, no content), under <prefix><InferenceService name>/<pod name>/: the input of `pdserve batch "
        "retune-schedule --traffic`; None records nothing.",
    )
    traffic_upload_interval_s: float = Field(
        default=300.0, gt=0, le=86400, allow_inf_nan=False,
        description="Seconds between the runtime's traffic shipments (and one at shutdown), at most a day."
    )
    s3_secret: str = Field(
        default="pdserve-s3", description="Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY the runtime "
        "reads (optional: without it, the IAM role of the runtime's service account) when traffic is shipped.",
    )

    @field_validator("traffic_upload_uri")
    @classmethod
    def _traffic_upload(cls, v: str | None) -> str | None:
        if v is not None:
            from runtime.s3uri import check_upload_uri

            check_upload_uri(v)
        return v

    @property
    def rollout_deadline_s(self) -> int:
        """Seconds a new revision may take to become ready: the runtime is ready once a decode worker is, so
        the workers' startup probe budget plus `NODE_LAUNCH_AND_PULL_S` (Knative's progress deadline)."""
        return self.worker_startup_timeout_s + NODE_LAUNCH_AND_PULL_S

    @model_validator(mode="after")
    def _runtime_replicas(self) -> "ClusterTarget":
        if self.runtime_min_replicas > self.runtime_max_replicas:
            raise ValueError(f"runtime_min_replicas {self.runtime_min_replicas} exceeds runtime_max_replicas "
                             f"{self.runtime_max_replicas}")
        return self


def check_name(field: str, value: str, *, pattern: re.Pattern[str] = DNS1035_LABEL,
               max_chars: int = MAX_LABEL_CHARS) -> str:
    """Return `value` if it is a valid Kubernetes name, else raise ManifestError naming `field`."""
    if not value:
        raise ManifestError(f"{field}: must not be empty")
    if len(value) > max_chars:
        raise ManifestError(f"{field}: {value!r} is {len(value)} characters, more than {max_chars}")
    if not pattern.match(value):
        rule = {
            DNS1035_LABEL.pattern: "a DNS-1035 label (lower-case letters, digits, '-'; starts with a letter)",
            DNS1123_LABEL.pattern: "a DNS-1123 label (lower-case letters, digits, '-')",
            DNS1123_SUBDOMAIN.pattern: "a DNS-1123 subdomain (lower-case letters, digits, '-', '.')",
        }.get(pattern.pattern, pattern.pattern)
        raise ManifestError(f"{field}: {value!r} is not {rule}")
    return value


NAME_HASH_CHARS = 8  # hex digits of SHA-256 appended by `dns_label` when normalisation was lossy


def dns_label(text: str, *, max_chars: int = 45) -> str:
    """A DNS-1035 label derived from `text` (the MLflow registered model name being promoted) for use as
    an InferenceService name; at most `max_chars` characters (45 leaves room for the
    `-<revision>-prefill` suffixes under the 63-character label limit).

    A `text` that already is a DNS-1035 label of at most `max_chars` characters is returned unchanged.
    Otherwise the readable part is `text` lower-cased, runs of other characters replaced by '-', with a
    leading 'm-' if it does not start with a letter, and the label is that part cut to leave room for
    `-<h>`, where `<h>` is the first NAME_HASH_CHARS hex digits of the SHA-256 of the original `text`.
    So names that normalise alike (`Meta-Llama-3.1-8B`, `meta_llama_3.1_8b`) or differ only after the cut
    get different labels, and the same text always gets the same label.

    Raises:
        ManifestError: `text` has no letter or digit at all.
    """
    label = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not label:
        raise ManifestError(f"name: {text!r} has no letters or digits to build a DNS label from")
    if not label[0].isalpha():
        label = "m-" + label
    if label == text and len(label) <= max_chars:
        return label
    digest = hashlib.sha256(text.encode()).hexdigest()[:NAME_HASH_CHARS]
    return f"{label[:max_chars - NAME_HASH_CHARS - 1].rstrip('-')}-{digest}"
