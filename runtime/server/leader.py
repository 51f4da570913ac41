"""Planner leadership among runtime replicas (adapter): the stores of the shared lease record and the loop that
runs the pure election (runtime/planner/leadership.py) on a daemon thread.

Stores:
* `KubernetesLeaseStore`: one coordination.k8s.io/v1 Lease (`CoordinationV1Api` of the `kubernetes` client):
  `read_namespaced_lease`, `create_namespaced_lease`, `replace_namespaced_lease` (a PUT carrying the read
  `resourceVersion`, which the API server refuses with 409 Conflict when the Lease changed since). The RBAC it
  needs is runtime/deploy/rbac.py `lease_rbac_rules`: get/update on that Lease, create on leases
  (RBAC cannot restrict `create` by name). Lease fields: kubernetes.io/docs/concepts/architecture/leases/.
* `FileLeaseStore`: runtime replicas on one machine (`--leader-election file`): the record is a JSON file, and
  each read or compare-and-write holds an exclusive `fcntl.flock` on a sidecar `.lock` file, so a write whose
  version is stale is refused like the API server's 409. The kernel drops a flock when its process dies, so a
  killed replica never leaves the file locked. Same election rules as on Kubernetes; local monotonic time.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from runtime.deploy.lease import _micro_time  # MicroTime text: always 6 fractional digits, as the API wants
from runtime.planner.leadership import ElectionConfig, LeaderElector, LeaseRecord, Write

log = logging.getLogger(__name__)

#: an identity the operator may set; a pod's host name is its pod name, which the rendered InferenceService
#: relies on (Knative refuses downward-API `fieldRef` env vars unless `kubernetes.podspec-fieldref` is enabled)
POD_NAME_ENV = "POD_NAME"


def default_identity(environ: dict[str, str] | None = None) -> str:
    """Holder identity: env POD_NAME when set, else `<host name>/pid-<pid>` (distinct per process; in a pod the
    host name is the pod's name)."""
    env = os.environ if environ is None else environ
    return env.get(POD_NAME_ENV) or f"{socket.gethostname()}/pid-{os.getpid()}"


class LeaseStore(Protocol):
    """The shared record. `read` returns None when there is none; `write` returns False when the store refused
    it (the record exists on create, or its version changed since `w.record.version` on update)."""

    def read(self) -> LeaseRecord | None: ...

    def write(self, w: Write) -> bool: ...


# ----------------------------------------------------------------------------------------------- Kubernetes
class KubernetesLeaseStore:
    """One Lease `name` in `namespace` through `api` (a `kubernetes.client.CoordinationV1Api`, or anything
    with its read/create/replace_namespaced_lease methods that raise `ApiException` with `.status`).

    Durations are written rounded up to whole seconds (`leaseDurationSeconds` is an integer); acquire and
    renew times as MicroTime text (a datetime without microseconds would serialise without the fraction).
    """

    def __init__(self, api: Any, *, namespace: str, name: str, now: Callable[[], float] = time.time) -> None:
        self.api, self.namespace, self.name, self.now = api, namespace, name, now
        self._acquire_time: dt.datetime | str | None = None  # of the Lease last read: kept when renewing

    def read(self) -> LeaseRecord | None:
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        spec = lease.spec
        self._acquire_time = spec.acquire_time if spec is not None else None
        return LeaseRecord(
            holder=(spec.holder_identity if spec is not None else None) or "",
            lease_duration_s=float((spec.lease_duration_seconds if spec is not None else None) or 0),
            transitions=int((spec.lease_transitions if spec is not None else None) or 0),
            version=lease.metadata.resource_version)

    def write(self, w: Write) -> bool:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        now = _micro_time(self.now())
        r = w.record
        body = client.V1Lease(
            api_version="coordination.k8s.io/v1", kind="Lease",
            metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace, resource_version=r.version,
                                         labels={"app.kubernetes.io/name": "pdserve",
                                                 "app.kubernetes.io/component": "planner-leader"}),
            spec=client.V1LeaseSpec(
                holder_identity=r.holder or None, lease_duration_seconds=max(math.ceil(r.lease_duration_s), 1),
                acquire_time=now if (w.acquired or self._acquire_time is None) else _as_micro(self._acquire_time),
                renew_time=now, lease_transitions=r.transitions))
        try:
            if w.create:
                self.api.create_namespaced_lease(self.namespace, body)
            else:
                self.api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as e:
            if e.status in (404, 409):  # created by another replica first / changed or deleted since read
                return False
            raise
        return True


def _as_micro(t: dt.datetime | str) -> str:
    """MicroTime text of a time the client read (a datetime) or that was set as text."""
    return t if isinstance(t, str) else _micro_time(t.timestamp())


def kubernetes_coordination_api() -> Any:
    """`CoordinationV1Api` from the in-cluster config, else the local kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoordinationV1Api()


# ----------------------------------------------------------------------------------------------- local file
class FileLeaseStore:
    """The record as JSON in `path` (`{"holder", "lease_duration_s", "transitions", "version"}`); reads and
    compare-and-writes hold an exclusive flock on `<path>.lock`. The folder must exist or be creatable."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.path.with_name(self.path.name + ".lock")

    def _locked(self):
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _read_unlocked(self) -> LeaseRecord | None:
        try:
            d = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:  # a torn or foreign file: treat as released, the next write replaces it
            return LeaseRecord("", 0.0, 0, "corrupt")
        return LeaseRecord(str(d.get("holder") or ""), float(d.get("lease_duration_s") or 0.0),
                           int(d.get("transitions") or 0), str(d.get("version")))

    def read(self) -> LeaseRecord | None:
        fd = self._locked()
        try:
            return self._read_unlocked()
        finally:
            os.close(fd)  # closing the descriptor drops the flock

    def write(self, w: Write) -> bool:
        fd = self._locked()
        try:
            cur = self._read_unlocked()
            if (cur is not None) if w.create else (cur is None or cur.version != w.record.version):
                return False
            version = str(int(cur.version) + 1) if cur is not None and (cur.version or "").isdigit() else "1"
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"holder": w.record.holder, "lease_duration_s": w.record.lease_duration_s,
                                       "transitions": w.record.transitions, "version": version}))
            os.replace(tmp, self.path)  # atomic: a reader never sees half a record
            return True
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------------------------- the loop
class LeaderElection:
    """Runs `elector` against `store` every retry period on a daemon thread (`start`/`stop`), or one round on
    demand (`run_once`). `is_leader()` is what the planner asks before it actuates. `stop` releases the record
    when this replica holds it, so another replica takes over at its next read. Store errors are logged and
    count as failed writes (a leader stays leader until its renew deadline)."""

    def __init__(self, store: LeaseStore, elector: LeaderElector, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.elector, self.clock = store, elector, clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._was_leader = False

    @property
    def identity(self) -> str:
        return self.elector.identity

    def run_once(self) -> bool:
        """One read and, if the election says so, one write; returns `is_leader()` afterwards."""
        with self._lock:
            try:
                read = self.store.read()
                w = self.elector.step(self.clock(), read)  # observed once read (a slow read delays expiry)
                if w is not None:
                    sent_s = self.clock()  # a renewal counts from before the write: the conservative side
                    self.elector.written(sent_s, self.store.write(w))
            except Exception as e:  # noqa: BLE001 - API/IO errors: a failed round, retried next period
                log.warning("leader election (%s): %s", self.identity, e)
                self.elector.written(self.clock(), False)
            leader = self.elector.is_leader(self.clock())
        if leader != self._was_leader:
            log.info("leader election: %s %s the planner's leader", self.identity,
                     "is now" if leader else "is no longer")
            self._was_leader = leader
        return leader

    def is_leader(self) -> bool:
        return self.elector.is_leader(self.clock())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.run_once()
            self._stop.wait(self.elector.cfg.retry_period_s)

    def start(self) -> "LeaderElection":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pdserve-leader-election", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and release the record if held (errors logged). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with self._lock:
            try:
                w = self.elector.release(self.store.read())
                if w is not None and self.store.write(w):
                    log.info("leader election: %s released the lease", self.identity)
            except Exception as e:  # noqa: BLE001 - the lease then expires on its own
                log.warning("leader election (%s): release failed: %s", self.identity, e)


def build_election(kind: str, *, interval_s: float, identity: str | None = None, namespace: str = "default",
                   lease_name: str = "", lock_file: Path | None = None, api: Any = None) -> LeaderElection:
    """The election of one runtime replica: `kind` "kubernetes" (Lease `lease_name` in `namespace`, `api`
    default from the in-cluster config) or "file" (`lock_file`); durations from `interval_s`
    (`ElectionConfig.for_interval`).

    Raises:
        ValueError: an unknown kind, a missing lease name or lock file, `interval_s` ≤ 0.
    """
    cfg = ElectionConfig.for_interval(interval_s)
    elector = LeaderElector(identity or default_identity(), cfg)
    if kind == "kubernetes":
        if not lease_name:
            raise ValueError("leader election kubernetes: a Lease name is required")
        store: LeaseStore = KubernetesLeaseStore(api if api is not None else kubernetes_coordination_api(),
                                                 namespace=namespace, name=lease_name)
    elif kind == "file":
        if lock_file is None:
            raise ValueError("leader election file: a lease file is required")
        store = FileLeaseStore(lock_file)
    else:
        raise ValueError(f"leader election: unknown kind {kind!r}; choose kubernetes or file")
    return LeaderElection(store, elector)
