"""Render every Kubernetes object of a pdserve deployment from a DeploymentSpec (no YAML copies).

Objects, in apply order (see `render_all`):
  ServiceAccounts → Roles/RoleBindings → ClusterServingRuntime `pdserve` → worker Services (headless)
  → worker Deployments, or LeaderWorkerSets for workers spanning nodes (prefill, decode) → PodDisruptionBudgets
  → ServiceMonitor (workers) → PodMonitor (runtime) → InferenceService.

The InferenceService's predictor is the pdserve runtime (`python -m runtime.server`, a KServe
ModelServer with OpenAI routes, router and planner) reading weights/tokenizer from
`storageUri: pvc://<pvc>/models/<model>` (KServe mounts it at /mnt/models); the runtime finds its
workers through the EndpointSlices of the headless worker Services (runtime/deploy/discovery.py) and,
for KV-aware router policies (`--router kv`), their KV-event publishers (port "kv-events", and "kv-events-<r>" of
each further data-parallel rank r) there too, or, for workers whose ranks run on several nodes, in the
EndpointSlices of their pool's KV-event Service (runtime/deploy/workers.py `kv_events_service`).

Bad input (an InferenceService name that is not a DNS-1035 label, a TP larger than the instance's
GPUs, EFA on an instance without it, replicas over int32 or over max_replicas, a port outside 1..65535 or
two worker ports alike, a multi-node worker without EFA or on part of a node, a layout beyond TP with the planner
on) raises
ManifestError naming the field before anything is written or applied.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

import yaml

from runtime.config import DeploymentSpec, OverloadSpec, RouterSpec
from runtime.deploy import rbac, workers
from runtime.deploy.budget import GpuBudgetError, check_gpu_budget
from runtime.deploy.discovery import kv_events_service_name
from runtime.deploy.errors import ManifestError
from runtime.deploy.instances import InstanceType, instance_for
from runtime.deploy.target import (
    DNS1035_LABEL, DNS1123_LABEL, DNS1123_SUBDOMAIN, MAX_SUBDOMAIN_CHARS, ClusterTarget, check_name,
)
from runtime.engines.engine_args import CREDENTIAL_ARGS
from runtime.paths import write_text_atomically

RUNTIME_NAME = "pdserve"
MODEL_FORMAT = "pdserve"
MODEL_FORMAT_VERSION = "1"
SPEC_ENV = "PDSERVE_DEPLOYMENT_SPEC"
INT32_MAX = 2**31 - 1  # Deployment spec.replicas is an int32 (Kubernetes API reference, DeploymentSpec)
MAX_PORT = 65535  # containerPort / Service port range 1..65535 (Kubernetes API reference, ContainerPort)


def spec_digest(spec: DeploymentSpec) -> str:
    """First 16 hex digits of the SHA-256 of the spec's canonical JSON (annotation pdserve.io/spec-sha256)."""
    canon = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def runtime_server_args(*, port: int) -> list[str]:
    """Arguments of `python -m runtime.server` set by the ClusterServingRuntime (runtime/server/__main__.py)."""
    return ["--host=0.0.0.0", f"--http-port={port}"]


MODEL_MOUNT = "/mnt/models"  # where KServe mounts the storageUri in the predictor container
TRAFFIC_DIR = "/var/run/pdserve/traffic"  # emptyDir of the runtime's traffic log (shipped to S3 from there)
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")  # each optional in the Secret
# spec.predictor.timeout (s): Knative's revision timeoutSeconds, the longest a request may take; its default,
# 300 s, cuts long streams (a 32k-token completion at 20 ms per token takes ~650 s). Knative refuses a value above
# config-defaults max-revision-timeout-seconds (600 s by default), which infra/k8s/kserve raises to this value.
PREDICTOR_TIMEOUT_S = 3600
# The runtime's drain of its requests in flight at SIGTERM (`--shutdown-grace-s`, runtime/server/app.py), s. Knative
# sets the pod's terminationGracePeriodSeconds to the revision timeout (PREDICTOR_TIMEOUT_S) and refuses a
# container `lifecycle`: its own preStop on the runtime container (queue-proxy's /wait-for-drain) holds SIGTERM
# back until the pod has left the routing and queue-proxy has finished the requests it took, all counted in
# that one grace period; the kubelet's SIGKILL then comes PREDICTOR_TIMEOUT_S after the deletion, so this drain
# plus uvicorn's 5-s margin must fit well inside it (tests/unit/test_deploy_render.py).
RUNTIME_SHUTDOWN_GRACE_S = 900
TRAFFIC_VOLUME_SIZE = "1Gi"  # ~100 bytes per request: ~10 M requests between shipments before eviction


def traffic_args(target: ClusterTarget, *, name: str) -> list[str]:
    """Runtime arguments that record traffic and ship it to ``<target.traffic_upload_uri><name>/`` (one folder
    per pod: runtime.server.traffic.TrafficShipper names it after $HOSTNAME, the pod name); [] when
    ``target.traffic_upload_uri`` is None."""
    if target.traffic_upload_uri is None:
        return []
    from runtime.s3uri import check_upload_uri

    bucket, prefix = check_upload_uri(target.traffic_upload_uri)  # rebuilt from its parts: never s3://bucketNAME
    return [f"--traffic-log={TRAFFIC_DIR}/traffic.jsonl", f"--traffic-upload=s3://{bucket}/{prefix}{name}/",
            f"--traffic-upload-interval-s={_exact(target.traffic_upload_interval_s)}"]


def _exact(x: float) -> str:
    """A number as an argument without rounding (``repr``), integers without a fraction (``60``, not ``60.0``)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# Policies the runtime's discovery pairing serves without the KV-aware router: cache- and load-blind, so
# they need neither tokens nor KV events (the dynamic pool then round-robins, runtime/server/app.py `serve`).
FIXED_PAIRING_POLICIES = frozenset({"round_robin", "random"})


def uses_kv_router(router: RouterSpec) -> bool:
    """True when the runtime must run `--router kv` for `router.policy`: every policy that scores workers
    by cached prefix (kv_aware, dynamo_cost) or by in-flight tokens (least_loaded), i.e. all but
    FIXED_PAIRING_POLICIES."""
    return router.policy not in FIXED_PAIRING_POLICIES


def runtime_pool_args(*, model_name: str, namespace: str, prefill_service: str, decode_service: str,
                      worker_port: int, planner: bool = False, router: RouterSpec | None = None,
                      block_size_tokens: int = 16, tokenizer_dir: str = MODEL_MOUNT,
                      kv_lease_s: int | None = None, overload: OverloadSpec | None = None,
                      ttft_slo_ms: float | None = None, leader_lease: str = "") -> list[str]:
    """Per-InferenceService runtime arguments (KServe appends them to the runtime's): the OpenAI model
    name and where the worker pools come from: the EndpointSlices of the headless prefill/decode Services
    (`--discovery=kubernetes`, runtime/server/discovery_sync.py over runtime/deploy/discovery.py), so only
    ready worker pods become routing targets. `worker_port` is the Services' port named "http" (the
    discovery reads the port number from the EndpointSlices). With `planner` the runtime also runs the
    SLO planner scaling the worker Deployments (named like their Services, runtime/deploy/workers.py
    `pool_name`) through their `scale` subresource (RBAC: runtime/deploy/rbac.py), with the spec from env
    PDSERVE_DEPLOYMENT_SPEC and the model's config.json from the KServe model mount.

    Always `--model-dir=<MODEL_MOUNT> --require-staged`: the runtime refuses to start unless the mounted
    model folder (and `--tokenizer-dir`) is a staged copy with a valid `.pdserve-staged.json` marker.

    With a `router` whose policy needs it (`uses_kv_router`) the runtime runs the KV-aware router:
    `--router=kv`, `--router-spec=<RouterSpec JSON>`, `--block-size=<block_size_tokens>` (must equal the
    workers' vLLM `--block-size`, spec.engine.block_size_tokens) and `--tokenizer-dir=<tokenizer_dir>`
    (the served model folder: the KServe mount of `pvc://<fsx-claim>/models/<model>`, /mnt/models). It
    subscribes to each discovered worker's KV events at the EndpointSlices' "kv-events" port (and those of its
    further data-parallel ranks, "kv-events-<r>", each request then naming its rank). With another policy and a
    `router.migration_limit` other than the default, `--router-spec={"migration_limit": N}` (the fixed
    pairing reads that field of it). With any
    `router`, `--prefill-priority=<router.prefill_priority>` (the prefill Deployments' vLLM scheduling
    policy follows the same field, runtime/deploy/workers.py). With `kv_lease_s` (the workers'
    `EngineSpec.kv_lease_s`), `--kv-lease-s`: the runtime bounds its decode legs by the workers' lease.
    With an `overload` other than the defaults, `--overload-spec=<OverloadSpec JSON>` and
    `--ttft-slo-ms=<ttft_slo_ms>` (the SLO its admission control protects).
    With `planner` and `leader_lease`, `--leader-election=kubernetes --leader-lease=<leader_lease>`: of the
    runtime's replicas only the one holding that Lease actuates (runtime/server/leader.py)."""
    del worker_port  # carried by the EndpointSlices' "http" port
    args = [
        f"--model-name={model_name}",
        "--discovery=kubernetes",
        f"--namespace={namespace}",
        f"--prefill-service={prefill_service}",
        f"--decode-service={decode_service}",
        f"--model-dir={MODEL_MOUNT}",
        "--require-staged",
    ]
    if router is not None:  # the runtime sets prefill priorities iff the prefill workers schedule by them
        args.append(f"--prefill-priority={router.prefill_priority}")
    if router is not None and uses_kv_router(router):
        args += ["--router=kv", f"--router-spec={router.model_dump_json()}",
                 f"--block-size={block_size_tokens}", f"--tokenizer-dir={tokenizer_dir}"]
    elif router is not None and router.migration_limit != RouterSpec().migration_limit:
        args.append(f"--router-spec={json.dumps({'migration_limit': router.migration_limit})}")
    if kv_lease_s is not None:
        args.append(f"--kv-lease-s={kv_lease_s}")
    if overload is not None and overload != OverloadSpec():
        args.append(f"--overload-spec={overload.model_dump_json()}")
        if ttft_slo_ms is not None:
            args.append(f"--ttft-slo-ms={ttft_slo_ms}")
    if planner:
        args += ["--planner=kubernetes", f"--prefill-deployment={prefill_service}",
                 f"--decode-deployment={decode_service}"]
        if leader_lease:
            args += ["--leader-election=kubernetes", f"--leader-lease={leader_lease}"]
    return args


def cluster_serving_runtime(*, image: str, target: ClusterTarget, name: str = RUNTIME_NAME) -> dict[str, Any]:
    """serving.kserve.io/v1alpha1 ClusterServingRuntime of the pdserve runtime (one per cluster)."""
    port = target.runtime_port
    return {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ClusterServingRuntime",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "pdserve",
                                              "app.kubernetes.io/component": "runtime"}},
        "spec": {
            "supportedModelFormats": [
                {"name": MODEL_FORMAT, "version": MODEL_FORMAT_VERSION, "autoSelect": True, "priority": 1}
            ],
            "protocolVersions": ["v1"],
            "annotations": {"prometheus.kserve.io/port": str(port), "prometheus.kserve.io/path": "/metrics"},
            "containers": [
                {
                    "name": "kserve-container",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-m", "runtime.server"],
                    "args": runtime_server_args(port=port),
                    "ports": [{"containerPort": port, "protocol": "TCP"}],
                    "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": port},
                                       "periodSeconds": 5, "failureThreshold": 3},
                    "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": port},
                                      "periodSeconds": 15, "failureThreshold": 4, "timeoutSeconds": 5},
                    "resources": {
                        "requests": {"cpu": target.runtime_cpu, "memory": target.runtime_memory},
                        "limits": {"memory": target.runtime_memory},
                    },
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "runAsNonRoot": True,
                        "runAsUser": target.run_as_user,
                        "capabilities": {"drop": ["ALL"]},
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                }
            ],
        },
    }


def inference_service(spec: DeploymentSpec, *, name: str, namespace: str, pvc_name: str, image: str,
                      target: ClusterTarget, revision: str | None, service_account: str,
                      canary_traffic_percent: int | None = None) -> dict[str, Any]:
    """serving.kserve.io/v1beta1 InferenceService whose predictor is the pdserve runtime.

    `canary_traffic_percent` (0..100) sends that share of traffic to the newest revision (KServe
    Serverless mode); None omits the field (100 % to the latest ready revision).

    The runtime scales itself: `target.runtime_min_replicas`..`runtime_max_replicas` replicas, the Knative
    autoscaler aiming at `target.runtime_rps_target` requests per second each (`scaleMetric: rps`; KServe's
    Serverless mode runs the Knative Pod Autoscaler, which scales on concurrency or rps, not CPU). Its planner
    elects one leader among them on Lease `rbac.planner_lease_name(name, revision)`, the holder identity being
    the pod's host name (its pod name; no downward-API env: Knative refuses `fieldRef` env vars unless the
    cluster enables `kubernetes.podspec-fieldref`, off by default).

    With `target.traffic_upload_uri` the runtime records every finished request (`traffic_args`) in an
    emptyDir and ships it to S3 (credentials: the optional Secret `target.s3_secret` as env, else the IAM role
    of `service_account` through Pod Identity / IRSA).
    """
    labels = workers.labels(name, "runtime", revision)
    predictor: dict[str, Any] = {
        # the runtime is ready once a decode worker is: a revision's rollout takes a GPU node's launch and the
        # workers' start, beyond Knative's default progress deadline of 600 s (which would fail the revision);
        # KServe puts a component's annotations on its Knative revision template (Knative >= 1.4)
        "annotations": {"serving.knative.dev/progress-deadline": f"{target.rollout_deadline_s}s"},
        "serviceAccountName": service_account,
        "minReplicas": target.runtime_min_replicas,
        "maxReplicas": target.runtime_max_replicas,
        "scaleMetric": "rps",
        "scaleTarget": target.runtime_rps_target,
        "timeout": PREDICTOR_TIMEOUT_S,
        "model": {
            "modelFormat": {"name": MODEL_FORMAT, "version": MODEL_FORMAT_VERSION},
            "runtime": RUNTIME_NAME,
            # pinned here, not only on the cluster-wide runtime: promoting or rolling back another model,
            # which re-applies the ClusterServingRuntime with its own image, must not change this one's
            "image": image,
            "protocolVersion": "v1",
            "storageUri": f"pvc://{pvc_name}/models/{spec.model.name}",
            "args": runtime_pool_args(
                model_name=spec.model.name,
                namespace=namespace,
                prefill_service=workers.service_name(name, "prefill", revision, spec.prefill.nodes > 1),
                decode_service=workers.service_name(name, "decode", revision, spec.decode.nodes > 1),
                worker_port=target.worker_port,
                planner=spec.planner.mode != "off",
                router=spec.router,
                block_size_tokens=spec.engine.block_size_tokens,
                kv_lease_s=spec.engine.kv_lease_s,
                overload=spec.overload,
                ttft_slo_ms=spec.slo.ttft_p90_ms,
                leader_lease=rbac.planner_lease_name(name, revision),
            ) + traffic_args(target, name=name) + [f"--shutdown-grace-s={RUNTIME_SHUTDOWN_GRACE_S}"],
            "env": [{"name": SPEC_ENV, "value": spec.model_dump_json()}],
        },
    }
    if target.traffic_upload_uri is not None:  # a writable folder for the log; S3 credentials optional (IAM)
        predictor["volumes"] = [{"name": "traffic", "emptyDir": {"sizeLimit": TRAFFIC_VOLUME_SIZE}}]
        predictor["model"]["volumeMounts"] = [{"name": "traffic", "mountPath": TRAFFIC_DIR}]
        # only the two keys, each optional: the internet-facing runtime gets nothing else the Secret may hold
        predictor["model"]["env"] += [
            {"name": k, "valueFrom": {"secretKeyRef": {"name": target.s3_secret, "key": k, "optional": True}}}
            for k in S3_SECRET_KEYS]
    if canary_traffic_percent is not None:
        if not 0 <= canary_traffic_percent <= 100:
            raise ManifestError(f"canary_traffic_percent: {canary_traffic_percent} is not in 0..100")
        predictor["canaryTrafficPercent"] = canary_traffic_percent
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": {
                "pdserve.io/spec-sha256": spec_digest(spec),
                "pdserve.io/image": image,
                # Knative-backed mode: the one that supports canaryTrafficPercent
                "serving.kserve.io/deploymentMode": "Serverless",
                # a separate URL per revision, so the SLO probe can target the canary (KServe tag routing)
                "serving.kserve.io/enable-tag-routing": "true",
            },
        },
        "spec": {"predictor": predictor},
    }


def service_monitor(*, name: str, namespace: str, target: ClusterTarget) -> dict[str, Any]:
    """monitoring.coreos.com/v1 ServiceMonitor scraping `/metrics` of every worker of `name` (all revisions)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {
            "name": f"{name}-workers",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": name,
                       "release": target.prometheus_release_label},
        },
        "spec": {
            "selector": {
                "matchLabels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": name},
                "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                      "values": ["prefill", "decode"]}],
            },
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s", "scheme": "http"}],
        },
    }


def runtime_pod_monitor(*, name: str, namespace: str, target: ClusterTarget) -> dict[str, Any]:
    """monitoring.coreos.com/v1 PodMonitor scraping `/metrics` of the runtime pods of InferenceService `name` (all
    revisions): the pdserve_* series the SLO alerts, dashboards and planner panels read. KServe labels the
    predictor's pods `serving.kserve.io/inferenceservice`; the runtime container declares `target.runtime_port`
    (Knative renames that port `user-port`, so the endpoint names the number, not a port name)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {
            "name": f"{name}-runtime",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": name,
                       "release": target.prometheus_release_label},
        },
        "spec": {
            "selector": {"matchLabels": {"serving.kserve.io/inferenceservice": name}},
            "namespaceSelector": {"matchNames": [namespace]},
            "podMetricsEndpoints": [{"portNumber": target.runtime_port, "path": "/metrics", "interval": "15s",
                                     "scheme": "http"}],
        },
    }


def _check_inputs(spec: DeploymentSpec, *, name: str, namespace: str, image: str, pvc_name: str,
                  revision: str | None, target: ClusterTarget) -> tuple[InstanceType | None, bool]:
    check_name("name (InferenceService)", name, pattern=DNS1035_LABEL)
    check_name("namespace", namespace, pattern=DNS1123_LABEL)
    check_name("pvc_name", pvc_name, pattern=DNS1123_SUBDOMAIN, max_chars=MAX_SUBDOMAIN_CHARS)
    if revision is not None:
        check_name("revision", revision, pattern=DNS1123_LABEL)
    if not image or any(c.isspace() for c in image):
        raise ManifestError(f"image: {image!r} is not a container image reference")
    mname = spec.model.name
    if not mname or mname.startswith("/") or ".." in mname.split("/") or any(c.isspace() for c in mname):
        raise ManifestError(f"spec.model.name: {mname!r} cannot be a path under models/ on the PVC")
    if mname.startswith("-"):  # it follows --served-model-name as its own argv token: vLLM would parse a flag
        raise ManifestError(f"spec.model.name: {mname!r} starts with '-', which the workers would read as an option")
    if "$" in mname:  # the kubelet expands $(VAR) in container args (Kubernetes: dependent environment variables)
        raise ManifestError(f"spec.model.name: {mname!r} contains '$', which the kubelet expands in container args")
    secret = [a for a in spec.engine.extra_args if a.split("=", 1)[0].removeprefix("--") in CREDENTIAL_ARGS]
    if secret:  # a spec made before engine_arg_flags refused them: never into a manifest (named, not shown)
        raise ManifestError(f"spec.engine.extra_args: {secret[0].split('=', 1)[0]} carries a credential, which "
                            "must not be written into the manifests; drop it from the spec")
    expanded = [a for a in spec.engine.extra_args if "$" in a]
    if expanded:  # the workers' args, beside AWS credentials a pod may hold in its environment
        raise ManifestError(f"spec.engine.extra_args: {expanded[0]!r} contains '$', which the kubelet expands in "
                            "container args")
    services = [workers.service_name(name, r, revision, getattr(spec, r).nodes > 1) for r in ("prefill", "decode")]
    services += [kv_events_service_name(workers.service_name(name, r, revision, True)) for r in ("prefill", "decode")
                 if workers.spreads_ranks(getattr(spec, r))]
    longest = max(services, key=len)
    for derived in (longest, f"{name}-discovery", f"{name}-workers", rbac.planner_role_name(name, revision)):
        check_name(f"name (derived object name {derived!r})", derived, pattern=DNS1035_LABEL)
    for role in ("prefill", "decode"):
        pool = getattr(spec, role)
        if pool.replicas > INT32_MAX:
            raise ManifestError(f"spec.{role}.replicas: {pool.replicas} is more than {INT32_MAX}, the largest "
                                "Deployment spec.replicas (int32)")
        if pool.replicas > pool.max_replicas:
            raise ManifestError(f"spec.{role}.replicas: {pool.replicas} is more than spec.{role}.max_replicas "
                                f"{pool.max_replicas}")
    # what tune and promote's own overrides refuse, for a spec that reached the registry some other way
    try:
        check_gpu_budget(spec)
    except GpuBudgetError as e:
        raise ManifestError(f"spec: {e}") from None
    need = spec.workload.isl_tokens + spec.workload.osl_tokens
    if spec.engine.max_model_len_tokens is not None and spec.engine.max_model_len_tokens < need:
        raise ManifestError(f"spec.engine.max_model_len_tokens: {spec.engine.max_model_len_tokens} < the workload's "
                            f"ISL + OSL ({need} tokens): the requests this configuration is tuned for would be refused")
    ports = {f: getattr(target, f) for f in ("worker_port", "nixl_side_channel_port", "kv_events_port", "runtime_port")}
    for f, port in ports.items():
        if not 1 <= port <= MAX_PORT:
            raise ManifestError(f"target.{f}: {port} is not a TCP port number (1..{MAX_PORT})")
    seen: dict[int, str] = {}
    for f in ("worker_port", "nixl_side_channel_port", "kv_events_port"):  # one worker container, one Service
        if ports[f] in seen:
            raise ManifestError(f"target.{f}: {ports[f]} is also target.{seen[ports[f]]}; a worker's HTTP, NIXL "
                                "side-channel and KV-event ports must differ (duplicate container/Service ports)")
        seen[ports[f]] = f
    kv_ranks = max(workers.kv_event_ranks(spec.prefill), workers.kv_event_ranks(spec.decode))
    last = target.kv_events_port + kv_ranks - 1  # vLLM publishes data-parallel rank r on kv_events_port + r
    if last > MAX_PORT:
        raise ManifestError(f"target.kv_events_port: {target.kv_events_port} + {kv_ranks - 1} (the KV-event port of "
                            f"the last data-parallel rank) is not a TCP port number (1..{MAX_PORT})")
    for f in ("worker_port", "nixl_side_channel_port"):
        if target.kv_events_port < ports[f] <= last:
            raise ManifestError(f"target.{f}: {ports[f]} is the KV-event port of data-parallel rank "
                                f"{ports[f] - target.kv_events_port} (target.kv_events_port + rank, up to {last})")
    try:
        inst = instance_for(spec.gpu, target.instance_type)
    except KeyError as e:
        raise ManifestError(f"gpu/instance_type: {e.args[0]}") from None
    multinode = [r for r in ("prefill", "decode") if getattr(spec, r).nodes > 1]
    for role in ("prefill", "decode"):
        pool = getattr(spec, role)
        gpus = workers.gpus_per_pod(pool)
        if inst is not None and gpus > inst.num_gpus:
            what = f"tp: {gpus} GPUs per worker" if pool.gpus == pool.tp else f"layout: {gpus} GPUs per pod"
            raise ManifestError(f"spec.{role}.{what}, but {inst.name} has only {inst.num_gpus} GPUs")
    for role in multinode:
        pool = getattr(spec, role)
        if inst is None or not inst.efa_capable:
            where = inst.name if inst else "the CPU pseudo-GPU"
            raise ManifestError(f"spec.{role}.nodes: {pool.nodes} nodes per worker need EFA between the nodes, "
                                f"and {where} has none")
        if workers.gpus_per_pod(pool) != inst.num_gpus:
            raise ManifestError(f"spec.{role}.nodes: a worker spanning {pool.nodes} nodes takes whole nodes, but "
                                f"{workers.gpus_per_pod(pool)} of {inst.name}'s {inst.num_gpus} GPUs per pod")
    for role in ("prefill", "decode"):
        pool = getattr(spec, role)
        if spec.planner.mode != "off" and (pool.gpus != pool.tp or pool.ep):
            # the planner sizes and scales plain-TP Deployments (runtime/planner/types.py, runtime/server/actuators.py)
            what = "LeaderWorkerSet" if pool.nodes > 1 else "layout"
            raise ManifestError(f"spec.{role}: the planner sizes and scales plain-TP worker Deployments, not the "
                                f"{what} of a tp {pool.tp} x dp {pool.dp} x pp {pool.pp}{' + ep' if pool.ep else ''} "
                                "worker; set planner.mode off")
    if target.efa is False and multinode:
        raise ManifestError(f"target.efa: false, but spec.{multinode[0]} workers span nodes: their all-to-all, "
                            "pipeline hand-offs and KV transfers need EFA")
    if target.efa and (inst is None or not inst.efa_capable):
        where = inst.name if inst else "the CPU pseudo-GPU"
        raise ManifestError(f"target.efa: EFA requested but {where} has no EFA interfaces")
    if target.efa is None:  # default: EFA where every worker pod packed on a node gets an interface of its own
        # (a worker spanning nodes needs EFA whatever the other pool's packing)
        efa = inst is not None and (bool(multinode) or all(
            inst.efa_for_every_worker(workers.gpus_per_pod(getattr(spec, r))) for r in ("prefill", "decode")))
    else:
        efa = target.efa
    return inst, efa


def render_all(spec: DeploymentSpec, *, name: str, namespace: str, image: str, pvc_name: str,
               target: ClusterTarget | None = None, revision: str | None = None,
               canary_traffic_percent: int | None = None, validate: bool = True) -> list[dict[str, Any]]:
    """Render every object of one deployment, in apply order.

    Args:
        spec: the (tuned) DeploymentSpec; prefill/decode TP become GPU requests and vLLM args.
        name: InferenceService name (DNS-1035 label); prefixes every namespaced object.
        namespace: target namespace (DNS-1123 label).
        image: container image of runtime and workers (kserve/Dockerfile).
        pvc_name: FSx PersistentVolumeClaim holding `models/<spec.model.name>`.
        target: placement settings (instance type, EFA, ports); default `ClusterTarget()`.
        revision: optional worker-pool revision (e.g. MLflow version "v3"); worker objects are then
            named `<name>-<revision>-{prefill,decode}` so a canary runs beside the current champion.
        canary_traffic_percent: set `spec.predictor.canaryTrafficPercent` (0..100).
        validate: check every object against its schema (runtime/deploy/validate.py).

    Returns:
        list of Kubernetes object dicts (ServiceAccount ×2, Role/RoleBinding ×1–2, ClusterServingRuntime,
        Service ×2 (and, per pool whose workers run data-parallel ranks on several nodes, its KV-event Service,
        workers.kv_events_service), Deployment or LeaderWorkerSet ×2 (a pool with `nodes > 1` is a
        LeaderWorkerSet of groups of `nodes` pods), PodDisruptionBudget ×2, NetworkPolicy, ServiceMonitor,
        PodMonitor, InferenceService).

    Raises:
        ManifestError: bad name/namespace/pvc/image, TP (or a pod's share of a layout) larger than the
            instance's GPUs, EFA requested on an instance without EFA, a worker spanning nodes without EFA or on
            part of a node, a layout beyond plain TP with the planner on (it sizes and scales plain-TP
            Deployments only), `spec.<pool>.replicas` over int32 or over its max_replicas, a
            `target` port outside 1..65535 or worker ports that coincide, or an object failing schema
            validation.
    """
    target = target or ClusterTarget()
    inst, efa = _check_inputs(spec, name=name, namespace=namespace, image=image, pvc_name=pvc_name,
                              revision=revision, target=target)
    runtime_sa, worker_sa = f"{name}-runtime", f"{name}-worker"
    base = workers.labels(name, "runtime", None)
    deps = [workers.pool_name(name, r, revision) for r in ("prefill", "decode") if getattr(spec, r).nodes == 1]
    objs: list[dict[str, Any]] = [
        rbac.service_account(runtime_sa, namespace, base, automount=True),
        rbac.service_account(worker_sa, namespace, workers.labels(name, "worker", None), automount=False),
        *rbac.runtime_rbac(name=name, namespace=namespace, labels=base, runtime_sa=runtime_sa,
                           worker_deployments=deps, planner=spec.planner.mode != "off", revision=revision,
                           planner_labels=workers.labels(name, "planner", revision)),
        cluster_serving_runtime(image=image, target=target),
    ]
    for role in ("prefill", "decode"):
        pool = getattr(spec, role)
        spread = workers.spreads_ranks(pool)
        objs.append(workers.worker_service(role, name=name, namespace=namespace, target=target, revision=revision,
                                           multinode=pool.nodes > 1, kv_ranks=0 if spread else pool.dp))
        if spread:  # its ranks publish on every pod of a group: the runtime finds them through this Service
            objs.append(workers.kv_events_service(pool, role, name=name, namespace=namespace, target=target,
                                                  revision=revision))
    for role in ("prefill", "decode"):
        objs.append(workers.worker_workload(
            spec, role, name=name, namespace=namespace, image=image, pvc_name=pvc_name, inst=inst, efa=efa,
            target=target, revision=revision, service_account=worker_sa))
    for role in ("prefill", "decode"):
        objs.append(workers.worker_pdb(role, name=name, namespace=namespace, revision=revision))
    objs.append(workers.worker_network_policy(
        name=name, namespace=namespace, monitoring_namespace=target.monitoring_namespace,
        kv_ranks=max(workers.kv_event_ranks(spec.prefill), workers.kv_event_ranks(spec.decode))))
    objs.append(service_monitor(name=name, namespace=namespace, target=target))
    objs.append(runtime_pod_monitor(name=name, namespace=namespace, target=target))
    objs.append(inference_service(spec, name=name, namespace=namespace, pvc_name=pvc_name, image=image,
                                  target=target,
                                  revision=revision, service_account=runtime_sa,
                                  canary_traffic_percent=canary_traffic_percent))
    if validate:
        from runtime.deploy.validate import validate_objects

        validate_objects(objs)
    return objs


def find(objs: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of `kind` (and `name`, if given). Raises KeyError naming what was not found."""
    hits = [o for o in objs if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]
    if len(hits) != 1:
        raise KeyError(f"{len(hits)} objects of kind {kind!r} named {name!r}")
    return hits[0]


def write_yaml(objs: list[dict[str, Any]], path: str | Path, *, header: str = "") -> Path:
    """Write `objs` as one multi-document YAML file, atomically (temp file + rename); `header` (e.g. a
    comment line) is written first.

    Returns the path. Raises OSError if the folder cannot be written; never leaves a partial file.
    """
    text = header + yaml.safe_dump_all(objs, sort_keys=False, default_flow_style=False, width=120)
    return write_text_atomically(Path(path), text)


def read_yaml(path: str | Path) -> list[dict[str, Any]]:
    """Read a multi-document YAML file of objects (empty documents skipped)."""
    with open(path) as f:
        return [d for d in yaml.load_all(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d]
