"""Canary promotion with an SLO probe and automatic rollback to the previous champion.

Sequence (each step is reported to a `Recorder`, e.g. as MLflow model-version tags):

0. lock           once the new revision renders, take the promote Lease <name>-promote (lease.py); released at the end
1. preflight      render + validate the new revision, check the PVC, read the current champion from the
                  live InferenceService (its spec is in env PDSERVE_DEPLOYMENT_SPEC, its revision in the
                  `pdserve.io/revision` label, its image in the `pdserve.io/image` annotation)
2. apply_workers  server-side apply the new revision's worker pools etc. (not yet the InferenceService)
                  and wait until the new workers are ready
3. canary         apply the InferenceService with `canaryTrafficPercent` (KServe Serverless canary; the
                  first deployment gets 100 %) and wait for Ready
4. slo_probe      `probe(url)` measures TTFT/ITL p90 of a small request set against the new revision
5a. promote       SLO met: re-apply without canaryTrafficPercent (100 % to the new revision), then
    cleanup       delete the previous revision's worker Deployments/Services/PDBs and planner Role/RoleBinding
5b. rollback      SLO missed or any step failed — including unexpected errors (a probe or recorder bug, a
                  transport error): re-apply the previous champion (its objects re-rendered from its own
                  spec, revision and image), delete the new revision's workers (and its planner Role/RoleBinding) and tell the recorder which
                  revision is champion again (also when the re-apply or its wait fails, so the registry
                  alias never keeps pointing at the failed version).

The module does no MLflow import: recording is a callback (`Recorder`); see tracking adapters.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from pydantic import ValidationError

from runtime.config import DeploymentSpec, SloSpec
from runtime.deploy import lease, workers
from runtime.deploy.apply import Progress, _noop, apply_keeping_scale, preflight, wait_ready
from runtime.deploy.errors import ApplyError, ManifestError, RolledBackError
from runtime.deploy.kube import Kube, ident
from runtime.deploy.render import SPEC_ENV, find, render_all
from runtime.deploy.target import ClusterTarget


@dataclass(frozen=True)
class ProbeResult:
    """Latency of a probe request set: p90 TTFT and ITL in milliseconds, request/error counts.

    `itl_p90_ms` is None when ITL was not measured: no request streamed two or more content chunks, so
    there was no inter-token gap to time (runtime/deploy/slo_probe.py)."""

    ttft_p90_ms: float
    itl_p90_ms: float | None
    num_requests: int
    num_errors: int = 0

    def verdict(self, slo: SloSpec) -> tuple[bool, str]:
        """(meets SLO, explanation) — all requests must succeed and both p90s be measured and within the SLO;
        an unmeasured ITL fails (no evidence is not a pass)."""
        problems = []
        if self.num_requests == 0 or self.num_errors:
            problems.append(f"{self.num_errors}/{self.num_requests} probe requests failed")
        if self.ttft_p90_ms > slo.ttft_p90_ms:
            problems.append(f"TTFT p90 {self.ttft_p90_ms:.1f} ms > SLO {slo.ttft_p90_ms:.1f} ms")
        if self.itl_p90_ms is None:
            problems.append("ITL was not measured: no probe request streamed two or more content chunks, so the "
                            f"ITL SLO ({slo.itl_p90_ms:.1f} ms) cannot be confirmed")
        elif self.itl_p90_ms > slo.itl_p90_ms:
            problems.append(f"ITL p90 {self.itl_p90_ms:.1f} ms > SLO {slo.itl_p90_ms:.1f} ms")
        if problems:
            return False, "; ".join(problems)
        return True, (f"TTFT p90 {self.ttft_p90_ms:.1f} ms <= {slo.ttft_p90_ms:.1f} ms, "
                      f"ITL p90 {self.itl_p90_ms:.1f} ms <= {slo.itl_p90_ms:.1f} ms")


class Recorder(Protocol):
    """Receives every rollout step (MLflow adapter: model-version tags + champion alias)."""

    def record(self, step: str, status: str, detail: dict[str, Any]) -> None: ...

    def champion_restored(self, revision: str | None) -> None: ...


@dataclass
class ListRecorder:
    """In-memory recorder (CLI output, tests)."""

    steps: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    restored: list[str | None] = field(default_factory=list)

    def record(self, step: str, status: str, detail: dict[str, Any]) -> None:
        self.steps.append((step, status, detail))

    def champion_restored(self, revision: str | None) -> None:
        self.restored.append(revision)


@dataclass(frozen=True)
class Champion:
    """What is live now: its spec, worker revision and image (read from the InferenceService), and the
    fields of its live spec this pdserve version does not know and ignored (dotted paths)."""

    spec: DeploymentSpec
    revision: str | None
    image: str
    ignored_fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class RolloutResult:
    outcome: str  # "promoted" | "rolled_back"
    revision: str
    previous_revision: str | None
    reason: str


def _drop(data: Any, loc: tuple[Any, ...]) -> None:
    for key in loc[:-1]:
        data = data[key]
    del data[loc[-1]]


def read_live_spec(text: str) -> tuple[DeploymentSpec, tuple[str, ...]]:
    """Parse a live PDSERVE_DEPLOYMENT_SPEC leniently: fields this version does not know (written by a newer
    pdserve) are dropped and returned as dotted paths; everything else must validate as usual.

    Raises:
        ValueError: not JSON, or invalid for another reason than unknown fields (pydantic's message).
    """
    data = json.loads(text)
    try:
        return DeploymentSpec.model_validate(data), ()
    except ValidationError as e:
        errors = e.errors()
        if not isinstance(data, dict) or any(err["type"] != "extra_forbidden" for err in errors):
            raise
    for err in errors:
        _drop(data, tuple(err["loc"]))
    return DeploymentSpec.model_validate(data), tuple(sorted(".".join(map(str, err["loc"])) for err in errors))


def current_champion(kube: Kube, *, name: str, namespace: str) -> Champion | None:
    """The live champion, or None on a first deployment. Unknown fields in its spec are ignored
    (`Champion.ignored_fields`; the rollout records a warning).

    Raises:
        ApplyError: the InferenceService was not rendered by pdserve (no spec env or image annotation), or its
            spec cannot be read by this version (the message says what to do: promote with the pdserve
            version that rendered it, or delete the InferenceService and promote again).
    """
    live = kube.get("serving.kserve.io/v1beta1", "InferenceService", name, namespace)
    if live is None:
        return None
    meta = live.get("metadata") or {}
    model = ((live.get("spec") or {}).get("predictor") or {}).get("model") or {}
    env = {e.get("name"): e.get("value") for e in model.get("env") or [] if isinstance(e, dict)}
    image = (meta.get("annotations") or {}).get("pdserve.io/image")
    delete = f"kubectl delete inferenceservice {name} -n {namespace}"
    if env.get(SPEC_ENV) is None or not image:
        raise ApplyError(f"InferenceService/{name} in namespace {namespace!r} was not rendered by pdserve (no env "
                         f"{SPEC_ENV} or annotation pdserve.io/image), so it will not be replaced: remove it "
                         f"(`{delete}`) or promote under another registered model name")
    try:
        spec, ignored = read_live_spec(env[SPEC_ENV])
    except ValueError as e:
        detail = " ".join(str(e).split())
        raise ApplyError(
            f"InferenceService/{name}: the live champion's {SPEC_ENV} cannot be read by this pdserve version, so "
            f"it could not be restored on rollback; nothing was applied ({detail[:500]}). Promote with the pdserve "
            f"version that rendered it (image {image}), or accept no rollback: `{delete}` (and its worker "
            f"Deployments/Services labelled app.kubernetes.io/instance={name}), then promote again") from None
    return Champion(spec=spec, revision=(meta.get("labels") or {}).get("pdserve.io/revision"), image=image,
                    ignored_fields=ignored)


def probe_url(isvc: dict[str, Any], *, cluster_local: bool = False) -> str:
    """URL of the newest revision (tag-routing `latest` traffic entry), else the service URL.

    `cluster_local` (promote running inside the cluster): the same route's in-cluster address, which needs no
    external DNS or Knative domain: Knative serves every route, and each tag of it, as the Kubernetes Service
    `<host's first label>` in the InferenceService's namespace (`latest-<name>-predictor.<ns>.svc.cluster.local`);
    without a tagged URL, `status.address.url` (KServe's cluster-local address).

    Raises:
        ApplyError: the status has no URL yet.
    """
    from urllib.parse import urlsplit

    status = isvc.get("status") or {}
    ns = (isvc.get("metadata") or {}).get("namespace")
    for t in status.get("components", {}).get("predictor", {}).get("traffic", []):
        if t.get("latestRevision") and t.get("url"):
            if not cluster_local:
                return t["url"]
            u = urlsplit(t["url"])
            host = (u.hostname or "").split(".")[0]
            if host and ns:
                return f"http://{host}.{ns}.svc.cluster.local"
    if cluster_local and (status.get("address") or {}).get("url"):
        # its origin only: in Serverless mode KServe has written the v2 inference path of the model into it
        # (".../v2/models/<name>/infer"), where the OpenAI routes are not
        u = urlsplit(status["address"]["url"])
        return f"{u.scheme}://{u.netloc}"
    if status.get("url"):
        return status["url"]
    raise ApplyError(f"{ident(isvc)}: status has no URL to probe")


def _worker_objects(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-revision objects of a rendering: worker Deployments/Services/PDBs and the planner's
    Role/RoleBinding (what cleanup and rollback delete for a revision that no longer serves)."""
    def component(o: dict[str, Any]) -> str | None:
        return o["metadata"].get("labels", {}).get("app.kubernetes.io/component")

    return [o for o in objs
            if (o["kind"] in ("Deployment", "LeaderWorkerSet", "Service", "PodDisruptionBudget")
                and component(o) in ("prefill", "decode"))
            or (o["kind"] in ("Role", "RoleBinding") and component(o) == "planner")]


def _legacy_planner_rbac(name: str, namespace: str) -> list[dict[str, Any]]:
    """The `<name>-planner` Role/RoleBinding that pdserve shared between revisions before planner RBAC became
    per revision; no revisioned runtime uses it, so cleanup removes it (a no-op when absent)."""
    meta = {"name": f"{name}-planner", "namespace": namespace}
    return [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": k, "metadata": dict(meta)}
            for k in ("RoleBinding", "Role")]


def _delete(kube: Kube, objs: list[dict[str, Any]]) -> list[str]:
    gone = []
    for o in objs:
        m = o["metadata"]
        if kube.delete(o["apiVersion"], o["kind"], m["name"], m.get("namespace")):
            gone.append(ident(o))
    return gone


def rollout(spec: DeploymentSpec, *, name: str, namespace: str, image: str, pvc_name: str, revision: str,
            kube: Kube, probe: Callable[[str], ProbeResult], recorder: Recorder,
            target: ClusterTarget | None = None, canary_percent: int = 10, timeout_s: float = 1800.0,
            poll_s: float = 5.0, progress: Progress = _noop, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep, lease_holder: str | None = None,
            now: Callable[[], float] = time.time, probe_cluster_local: bool = False) -> RolloutResult:
    """Roll out `spec` as worker revision `revision` with a canary, an SLO probe and auto-rollback.

    The whole rollout holds the InferenceService's promote lock (runtime/deploy/lease.py: Lease
    `<name>-promote`, holder `lease_holder` or `lease.default_holder()`, duration
    `lease.lease_duration_s(timeout_s)`, `now` = Unix time in seconds), taken after the new revision
    renders and before pre-flight, and released (deleted) when the rollout ends, however it ends. A
    second promote of the same InferenceService meanwhile fails with ApplyError naming the holder and
    touches nothing; an expired Lease (a promote that died) is taken over. The SLO probe calls the canary's
    cluster-local address when `probe_cluster_local` (promote runs in a pod), else its external URL
    (`probe_url`).

    Returns:
        RolloutResult "promoted", or "rolled_back" when the SLO probe missed or a step raised ApplyError /
        ManifestError (the previous champion serves again).

    Raises:
        ManifestError: bad input (name, TP, ...) — before anything is applied.
        ApplyError: another promote holds the lock (nothing applied), pre-flight failure (missing PVC;
            nothing applied), an unreadable live spec (nothing applied), a failure with no previous
            champion to roll back to (the new revision's workers are deleted first), or a rollback that did
            not complete (the message names the original failure and the rollback's; the recorder was still
            told the previous revision is champion).
        RolledBackError: any other exception during apply/canary/probe/promote (a bug, not a verdict): the
            rollout was rolled back as above, then this is raised with the original error chained.
        KeyboardInterrupt, SystemExit: re-raised after the same rollback, which then re-applies the
            previous champion (or deletes a first revision) without waiting for readiness.
    """
    if not revision:
        raise ManifestError("revision: required for a canary rollout (worker pools are named per revision)")
    new_objs = render_all(spec, name=name, namespace=namespace, image=image, pvc_name=pvc_name,
                          target=target, revision=revision)

    def rec(step: str, status: str, **detail: Any) -> None:
        progress(f"{step}: {status} {json.dumps(detail, sort_keys=True) if detail else ''}".rstrip())
        recorder.record(step, status, detail)

    try:
        held = lease.acquire(kube, name=name, namespace=namespace, holder=lease_holder or lease.default_holder(),
                             duration_s=lease.lease_duration_s(timeout_s), now=now)
    except ApplyError as e:
        rec("preflight", "failed", error=str(e))
        raise
    if held.taken_over_from is not None:
        progress(f"lock: took over the expired Lease/{held.name} of {held.taken_over_from!r}")
    try:
        return _rollout_locked(spec, new_objs, name=name, namespace=namespace, image=image, pvc_name=pvc_name,
                               revision=revision, kube=kube, probe=probe, recorder=recorder, rec=rec, target=target,
                               canary_percent=canary_percent, timeout_s=timeout_s, poll_s=poll_s,
                               progress=progress, clock=clock, sleep=sleep, held=held,
                               probe_cluster_local=probe_cluster_local)
    finally:
        try:
            lease.release(kube, held)
        except Exception as e:  # noqa: BLE001 - the rollout's own outcome/error wins; the Lease expires anyway
            progress(f"lock: could not release Lease/{held.name} ({type(e).__name__}: {e}); it expires after "
                     f"{lease.lease_duration_s(timeout_s)} s")


def _rollout_locked(spec: DeploymentSpec, new_objs: list[dict[str, Any]], *, name: str, namespace: str,
                    image: str, pvc_name: str, revision: str, kube: Kube, probe: Callable[[str], ProbeResult],
                    recorder: Recorder, rec: Callable[..., None], target: ClusterTarget | None,
                    canary_percent: int, timeout_s: float, poll_s: float, progress: Progress,
                    clock: Callable[[], float], sleep: Callable[[float], None],
                    held: "lease.HeldLease", probe_cluster_local: bool = False) -> RolloutResult:
    """`rollout` after the lock is held (same steps, results and errors)."""
    waits = dict(timeout_s=timeout_s, poll_s=poll_s, progress=progress, clock=clock, sleep=sleep)
    try:
        preflight(kube, new_objs)
        champ = current_champion(kube, name=name, namespace=namespace)
    except (ApplyError, ManifestError) as e:
        rec("preflight", "failed", error=str(e))
        raise
    prev_rev = champ.revision if champ else None
    extra: dict[str, Any] = {}
    if held.taken_over_from is not None:
        extra["lease_taken_over_from"] = held.taken_over_from
    if champ is not None and champ.ignored_fields:
        extra["ignored_live_spec_fields"] = list(champ.ignored_fields)
        extra["warning"] = (f"the live spec of revision {prev_rev} has fields this pdserve version does not know; "
                            f"they were ignored (a rollback re-applies it without them): "
                            + ", ".join(champ.ignored_fields))
    rec("preflight", "ok", revision=revision, previous_revision=prev_rev, **extra)
    isvc = find(new_objs, "InferenceService", name)
    rest = [o for o in new_objs if o is not isvc]
    try:
        for o in rest:
            apply_keeping_scale(kube, o)
        wait_ready(kube, rest, **waits)
        rec("apply_workers", "ok", objects=len(rest))
        percent = canary_percent if champ is not None else None
        canary = render_all(spec, name=name, namespace=namespace, image=image, pvc_name=pvc_name,
                            target=target, revision=revision, canary_traffic_percent=percent)
        canary_isvc = find(canary, "InferenceService", name)
        kube.apply(canary_isvc)
        wait_ready(kube, [canary_isvc], **waits)
        rec("canary", "ok", canary_traffic_percent=percent if percent is not None else 100)
        live = kube.get(canary_isvc["apiVersion"], "InferenceService", name, namespace) or {}
        result = probe(probe_url(live, cluster_local=probe_cluster_local))
        ok, why = result.verdict(spec.slo)
        rec("slo_probe", "ok" if ok else "failed", reason=why, ttft_p90_ms=result.ttft_p90_ms,
            itl_p90_ms=result.itl_p90_ms, num_requests=result.num_requests, num_errors=result.num_errors)
        if not ok:
            raise ApplyError(f"SLO probe failed: {why}")
        if percent is not None:
            kube.apply(isvc)  # no canaryTrafficPercent: 100 % to the new revision
            wait_ready(kube, [isvc], **waits)
        rec("promote", "ok", traffic_percent=100)
    except BaseException as e:  # noqa: BLE001 - whatever failed, the canary must not stay half rolled out
        # Ctrl-C / SystemExit too: roll back without waiting for readiness, then re-raise the interrupt
        interrupted = not isinstance(e, Exception)
        expected = isinstance(e, (ApplyError, ManifestError))
        reason = (f"interrupted ({type(e).__name__})" if interrupted
                  else str(e) if expected else f"unexpected {type(e).__name__}: {e}")
        cause = None if expected else e

        def rec_safely(step: str, status: str, **detail: Any) -> None:
            try:
                rec(step, status, **detail)
            except Exception as rec_err:  # noqa: BLE001 - recording must not stop the rollback
                progress(f"{step}: could not record ({type(rec_err).__name__}: {rec_err})")

        if champ is None:
            try:
                gone = _delete(kube, _worker_objects(new_objs) + [isvc])
            except Exception as del_err:  # noqa: BLE001
                reason += f"; deleting the new revision failed too: {del_err}"
                gone = []
            rec_safely("rollback", "no_previous_champion", error=reason, deleted=gone)
            if interrupted:
                raise
            raise ApplyError(f"rollout of {revision} failed and there is no previous champion: {reason}") from cause
        rollback_err: Exception | None = None
        gone = []
        try:
            prev_objs = render_all(champ.spec, name=name, namespace=namespace, image=champ.image,
                                   pvc_name=pvc_name, target=target, revision=champ.revision)
            for o in prev_objs:
                apply_keeping_scale(kube, o)
        except Exception as err:  # noqa: BLE001
            rollback_err = err
        else:
            # The InferenceService serves the previous revision again: the new workers are unused either way.
            try:
                if not interrupted:  # an interrupted caller wants out: the objects are applied, not waited for
                    wait_ready(kube, prev_objs, **waits)
            except Exception as err:  # noqa: BLE001
                rollback_err = err
            try:
                gone = _delete(kube, _worker_objects(new_objs)) if revision != prev_rev else []
            except Exception as err:  # noqa: BLE001
                rollback_err = rollback_err or err
        if rollback_err is None:
            rec_safely("rollback", "ok", error=reason, restored_revision=prev_rev, deleted=gone)
        else:
            rec_safely("rollback", "failed", error=reason, restored_revision=prev_rev, deleted=gone,
                       rollback_error=f"{type(rollback_err).__name__}: {rollback_err}")
        alias_err: Exception | None = None
        try:
            recorder.champion_restored(prev_rev)
        except Exception as err:  # noqa: BLE001
            alias_err = err
        if interrupted:  # the caller wants out: say what did not complete, then re-raise the interrupt itself
            if alias_err is not None:
                rec_safely("rollback", "alias_not_restored", restored_revision=prev_rev,
                           alias_error=f"{type(alias_err).__name__}: {alias_err}")
            raise
        if rollback_err is not None:
            raise ApplyError(f"rollout of {revision} failed ({reason}) and the rollback to {prev_rev} did not "
                             f"complete: {type(rollback_err).__name__}: {rollback_err}"
                             + (f"; restoring the champion alias failed too: {alias_err}" if alias_err else "")
                             ) from rollback_err
        if alias_err is not None:
            raise ApplyError(f"rollout of {revision} was rolled back to {prev_rev} ({reason}), but restoring the "
                             f"champion alias failed: {type(alias_err).__name__}: {alias_err}") from alias_err
        if not expected:
            raise RolledBackError(f"rollout of {revision} was rolled back to {prev_rev} after an {reason}") from e
        return RolloutResult("rolled_back", revision, prev_rev, reason)
    if champ is not None and prev_rev != revision:
        old = render_all(champ.spec, name=name, namespace=namespace, image=champ.image, pvc_name=pvc_name,
                         target=target, revision=prev_rev, validate=False)
        rec("cleanup", "ok", deleted=_delete(kube, _worker_objects(old) + _legacy_planner_rbac(name, namespace)))
    rec("outcome", "promoted", revision=revision)
    return RolloutResult("promoted", revision, prev_rev, "SLO met")
