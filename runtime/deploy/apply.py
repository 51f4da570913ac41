"""Apply rendered objects to a cluster and wait until they are ready.

`apply_objects` validates everything first, checks that every PersistentVolumeClaim the workers mount
exists in the target namespace, then server-side applies the objects in order and (optionally) waits
for Deployments, LeaderWorkerSets and the InferenceService to become ready, reporting progress through a callback.
Nothing is applied when validation or the pre-flight check fails.

Readiness rules (kubernetes.io/docs/concepts/workloads/controllers/deployment/#complete-deployment and
KServe's `Ready` condition): a Deployment is ready when `status.observedGeneration >= metadata.generation`
and updated/available replicas reach `spec.replicas`; a LeaderWorkerSet when its ready and updated groups
(`status.readyReplicas`, `status.updatedReplicas`) reach `spec.replicas`; an InferenceService when its `Ready`
condition is "True"; any other kind as soon as it is applied.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from runtime.deploy.errors import ApplyError
from runtime.deploy.kube import Kube, ident, resource_path
from runtime.deploy.validate import validate_objects

Progress = Callable[[str], None]


def _noop(_: str) -> None:
    return None


def referenced_pvcs(objs: Iterable[dict[str, Any]]) -> set[tuple[str, str]]:
    """(namespace, claimName) of every PVC a Deployment or LeaderWorkerSet mounts or an InferenceService's
    pvc:// names."""
    out: set[tuple[str, str]] = set()
    for o in objs:
        ns = o.get("metadata", {}).get("namespace", "")
        if o.get("kind") == "Deployment":
            pods = [o["spec"]["template"]["spec"]]
        elif o.get("kind") == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            pods = [t["spec"] for t in (lwt.get("leaderTemplate"), lwt["workerTemplate"]) if t]
        else:
            pods = []
        for pod in pods:
            for v in pod.get("volumes", []):
                if "persistentVolumeClaim" in v:
                    out.add((ns, v["persistentVolumeClaim"]["claimName"]))
        if o.get("kind") == "InferenceService":
            uri = o["spec"]["predictor"].get("model", {}).get("storageUri", "")
            if uri.startswith("pvc://"):
                out.add((ns, uri[len("pvc://"):].split("/", 1)[0]))
    return out


def preflight(kube: Kube, objs: list[dict[str, Any]]) -> None:
    """Raise ApplyError, before anything is applied, when an object's kind is not supported by the
    applier or a referenced PVC does not exist in its namespace (the message names the claim)."""
    for o in objs:
        m = o["metadata"]
        resource_path(o["apiVersion"], o["kind"], m["name"], m.get("namespace"))
    for ns, claim in sorted(referenced_pvcs(objs)):
        if kube.get("v1", "PersistentVolumeClaim", claim, ns) is None:
            raise ApplyError(f"pvc_name: PersistentVolumeClaim {claim!r} does not exist in namespace {ns!r}; "
                             "nothing was applied")


def readiness(obj: dict[str, Any]) -> tuple[bool, str]:
    """(ready, reason) of a live object (see module docstring for the rules)."""
    kind, status = obj.get("kind"), obj.get("status") or {}
    if kind == "Deployment":
        want = obj.get("spec", {}).get("replicas", 1)
        gen = obj.get("metadata", {}).get("generation", 0)
        if status.get("observedGeneration", 0) < gen:
            return False, "controller has not observed the latest generation"
        upd, avail = status.get("updatedReplicas", 0), status.get("availableReplicas", 0)
        if upd < want or avail < want:
            return False, f"{avail}/{want} replicas available, {upd} updated"
        return True, f"{avail}/{want} replicas available"
    if kind == "LeaderWorkerSet":  # status of the LWS v1 API: groups whose pods are all ready / updated
        want = obj.get("spec", {}).get("replicas", 1)
        ready, upd = status.get("readyReplicas", 0), status.get("updatedReplicas", 0)
        if ready < want or upd < want:
            return False, f"{ready}/{want} groups ready, {upd} updated"
        return True, f"{ready}/{want} groups ready"
    if kind == "InferenceService":
        for c in status.get("conditions", []):
            if c.get("type") == "Ready":
                ok = c.get("status") == "True"
                return ok, "Ready" if ok else f"{c.get('reason', 'NotReady')}: {c.get('message', '')}".strip()
        return False, "no Ready condition yet"
    return True, "applied"


def wait_ready(kube: Kube, objs: list[dict[str, Any]], *, timeout_s: float, poll_s: float = 5.0,
               progress: Progress = _noop, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll until every Deployment/InferenceService in `objs` is ready.

    Raises:
        ApplyError: after `timeout_s` seconds, naming each object that is not ready and why.
    """
    pending = {ident(o): o for o in objs if o["kind"] in ("Deployment", "LeaderWorkerSet", "InferenceService")}
    deadline = clock() + timeout_s
    reasons: dict[str, str] = {}
    while pending:
        for key, o in list(pending.items()):
            meta = o["metadata"]
            live = kube.get(o["apiVersion"], o["kind"], meta["name"], meta.get("namespace"))
            ok, why = (False, "not found") if live is None else readiness(live)
            if ok:
                progress(f"ready: {key} ({why})")
                del pending[key]
            else:
                reasons[key] = why
        if not pending:
            return
        if clock() >= deadline:
            detail = "; ".join(f"{k}: {reasons[k]}" for k in sorted(pending))
            raise ApplyError(f"not ready after {timeout_s:.0f} s: {detail}")
        progress(f"waiting for {len(pending)} object(s): " + ", ".join(sorted(pending)))
        sleep(poll_s)


#: kinds whose `spec.replicas` the SLO planner (runtime.server.actuators, through the scale subresource) or an
#: operator changes after they are applied
SCALED_KINDS = ("Deployment", "LeaderWorkerSet")


def apply_keeping_scale(kube: Kube, obj: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply `obj`; a worker pool (`SCALED_KINDS`) that is live keeps its live `spec.replicas`.

    Why: applying the rendered count again (a revision promoted twice, the previous champion re-applied by a
    rollback) would undo the planner's scaling at once, removing workers that serve traffic or dropping the
    capacity it launched for the load. The count is sent as it stands rather than left out: under server-side
    apply a field its manager stops sending is removed, which would reset the pool to one replica.

    Returns:
        the live object the API server returns. Raises ApplyError as `Kube.apply`.
    """
    if obj["kind"] in SCALED_KINDS and "replicas" in obj.get("spec", {}):
        meta = obj["metadata"]
        live = kube.get(obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace"))
        replicas = ((live or {}).get("spec") or {}).get("replicas")
        if isinstance(replicas, int) and replicas != obj["spec"]["replicas"]:
            obj = {**obj, "spec": {**obj["spec"], "replicas": replicas}}
    return kube.apply(obj)


def apply_objects(objs: list[dict[str, Any]], *, kube_context: str | None = None, kube: Kube | None = None,
                  wait: bool = True, timeout_s: float = 1800.0, poll_s: float = 5.0,
                  progress: Progress = _noop, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> list[dict[str, Any]]:
    """Validate, pre-flight, server-side apply `objs` in order, then wait for readiness.

    Args:
        objs: objects from `runtime.deploy.render.render_all` (apply order).
        kube_context: kubeconfig context (None: current context or in-cluster); ignored if `kube` given.
        kube: an existing `Kube` adapter (tests point it at a loopback server).
        wait: poll readiness of Deployments and the InferenceService.
        timeout_s: readiness budget, seconds.

    Returns:
        the live objects returned by the API server, in apply order.

    Raises:
        ManifestError: an object fails schema validation (nothing applied).
        ApplyError: a referenced PVC is missing (nothing applied), the API rejects an object, or
            readiness times out.
    """
    validate_objects(objs)
    kube = kube or Kube.from_context(kube_context)
    preflight(kube, objs)
    live = []
    for o in objs:
        live.append(apply_keeping_scale(kube, o))
        progress(f"applied: {ident(o)}")
    if wait:
        wait_ready(kube, objs, timeout_s=timeout_s, poll_s=poll_s, progress=progress, clock=clock, sleep=sleep)
    return live
