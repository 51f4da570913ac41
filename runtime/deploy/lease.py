"""A promote lock per InferenceService: a coordination.k8s.io/v1 Lease (adapter).

Two promotes of the same InferenceService must not interleave (one could delete the workers the other's
InferenceService points at while both report success). `acquire` creates the Lease `<name>-promote` in the
InferenceService's namespace; when it exists and has not expired, it fails naming the holder; when it has
expired (renewTime, else acquireTime, plus leaseDurationSeconds is in the past, or the times are missing)
it takes it over with an update carrying the read resourceVersion, so two promotes racing for a stale Lease
cannot both win (the API server answers 409 Conflict to the second). `release` deletes the Lease if this
holder still holds it.

Lease fields and semantics: kubernetes.io/docs/concepts/architecture/leases/ and the Lease API reference
(spec.holderIdentity, leaseDurationSeconds, acquireTime/renewTime as MicroTime, leaseTransitions).
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from runtime.deploy.errors import ApplyError, ConflictError
from runtime.deploy.kube import Kube

API_VERSION, KIND = "coordination.k8s.io/v1", "Lease"
# The longest rollout: up to four readiness waits of `timeout_s` each (new workers, canary, promote or
# rollback re-apply, rollback wait) plus the SLO probe (runtime/deploy/slo_probe.py: 4 prompts x 60 s);
# this margin (seconds) covers the probe and the API calls.
LEASE_MARGIN_S = 900


def lease_name(name: str) -> str:
    """Name of the promote Lease of InferenceService `name`: `<name>-promote`."""
    return f"{name}-promote"


def lease_duration_s(timeout_s: float) -> int:
    """Lease duration (seconds) for a rollout whose readiness waits last at most `timeout_s` seconds each:
    4 × timeout_s + LEASE_MARGIN_S, longer than any rollout, so a live promote's lock never expires."""
    return int(4 * timeout_s + LEASE_MARGIN_S)


def default_holder() -> str:
    """Holder identity: `<host>/pid-<pid>/<8 random hex>` (inside a pod the host name is the pod name)."""
    return f"{socket.gethostname()}/pid-{os.getpid()}/{uuid.uuid4().hex[:8]}"


def _micro_time(t: float) -> str:
    """Kubernetes MicroTime (RFC 3339, microseconds, UTC) of Unix time `t` (seconds)."""
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: Any) -> float | None:
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def expires_at(lease: dict[str, Any]) -> float | None:
    """Unix time (seconds) when `lease` expires; None when it records no usable time or duration."""
    spec = lease.get("spec") or {}
    start = _parse_time(spec.get("renewTime") or spec.get("acquireTime"))
    dur = spec.get("leaseDurationSeconds")
    if start is None or not isinstance(dur, int):
        return None
    return start + dur


@dataclass(frozen=True)
class HeldLease:
    """A Lease this process holds: its name/namespace, holder identity, and whom it was taken over from."""

    name: str
    namespace: str
    holder: str
    taken_over_from: str | None = None


def _body(name: str, namespace: str, holder: str, duration_s: int, t: float, transitions: int,
          resource_version: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "promote-lock"}}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration_s, "acquireTime": _micro_time(t),
                     "renewTime": _micro_time(t), "leaseTransitions": transitions}}


def acquire(kube: Kube, *, name: str, namespace: str, holder: str, duration_s: int,
            now: Callable[[], float] = time.time) -> HeldLease:
    """Take the promote Lease of InferenceService `name` for `holder` (`duration_s` seconds; `now`: Unix time).

    Raises:
        ApplyError: another holder's Lease has not expired (message: holder, expiry time, how to proceed), or
            another promote took an expired Lease over first, or the API failed.
    """
    lname = lease_name(name)
    for _ in range(2):  # create; on AlreadyExists inspect (and maybe take over) what is there
        t = now()
        try:
            kube.create(_body(lname, namespace, holder, duration_s, t, 0))
            return HeldLease(lname, namespace, holder)
        except ConflictError:
            pass
        live = kube.get(API_VERSION, KIND, lname, namespace)
        if live is None:
            continue  # released between our create and get: try once more
        spec = live.get("spec") or {}
        other = spec.get("holderIdentity") or "<no holder>"
        end = expires_at(live)
        if end is not None and end > t:
            raise ApplyError(
                f"InferenceService/{name}: another promote holds the lock Lease/{lname} in namespace {namespace!r} "
                f"(holder {other!r}, expires {_micro_time(end)}); nothing was applied. Wait for it to finish, or "
                f"if it died, delete the Lease: kubectl delete lease {lname} -n {namespace}")
        rv = (live.get("metadata") or {}).get("resourceVersion")
        transitions = int(spec.get("leaseTransitions") or 0) + 1
        try:
            kube.replace(_body(lname, namespace, holder, duration_s, t, transitions, resource_version=rv))
        except ConflictError:
            raise ApplyError(f"InferenceService/{name}: another promote took over the expired lock Lease/{lname} "
                             f"first; nothing was applied") from None
        return HeldLease(lname, namespace, holder, taken_over_from=other)
    raise ApplyError(f"InferenceService/{name}: could not acquire the lock Lease/{lname}: it keeps changing")


def release(kube: Kube, held: HeldLease) -> bool:
    """Delete the Lease if `held.holder` still holds it; True when deleted. Raises ApplyError on API errors."""
    live = kube.get(API_VERSION, KIND, held.name, held.namespace)
    if live is None or (live.get("spec") or {}).get("holderIdentity") != held.holder:
        return False
    return kube.delete(API_VERSION, KIND, held.name, held.namespace)
