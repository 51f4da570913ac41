"""Canary promotion with an SLO probe and automatic rollback to the previous champion.

Sequence (each step is reported to a `Recorder`, e.g. as MLflow model-version tags):

1. preflight      render + validate the new revision, check the PVC, read the current champion from the
                  live InferenceService (its spec is in env PDSERVE_DEPLOYMENT_SPEC, its revision in the
                  `pdserve.io/revision` label, its image in the `pdserve.io/image` annotation)
2. apply_workers  server-side apply the new revision's worker pools etc. (not yet the InferenceService)
                  and wait until the new workers are ready
3. canary         apply the InferenceService with `canaryTrafficPercent` (KServe Serverless canary; the
                  first deployment gets 100 %) and wait for Ready
4. slo_probe      `probe(url)` measures TTFT/ITL p90 of a small request set against the new revision
5a. promote       SLO met: re-apply without canaryTrafficPercent (100 % to the new revision), then
    cleanup       delete the previous revision's worker Deployments/Services/PDBs
5b. rollback      SLO missed or any step failed: re-apply the previous champion (its objects re-rendered
                  from its own spec, revision and image), delete the new revision's workers and tell
                  the recorder which revision is champion again.

The module does no MLflow import: recording is a callback (`Recorder`); see tracking adapters.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from runtime.config import DeploymentSpec, SloSpec
from runtime.deploy import workers
from runtime.deploy.apply import Progress, _noop, preflight, wait_ready
from runtime.deploy.errors import ApplyError, ManifestError
from runtime.deploy.kube import Kube, ident
from runtime.deploy.render import SPEC_ENV, find, render_all
from runtime.deploy.target import ClusterTarget


@dataclass(frozen=True)
class ProbeResult:
    """Latency of a probe request set: p90 TTFT and ITL in milliseconds, request/error counts."""

    ttft_p90_ms: float
    itl_p90_ms: float
    num_requests: int
    num_errors: int = 0

    def verdict(self, slo: SloSpec) -> tuple[bool, str]:
        """(meets SLO, explanation) — all requests must succeed and both p90s be within the SLO."""
        problems = []
        if self.num_requests == 0 or self.num_errors:
            problems.append(f"{self.num_errors}/{self.num_requests} probe requests failed")
        if self.ttft_p90_ms > slo.ttft_p90_ms:
            problems.append(f"TTFT p90 {self.ttft_p90_ms:.1f} ms > SLO {slo.ttft_p90_ms:.1f} ms")
        if self.itl_p90_ms > slo.itl_p90_ms:
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
    """What is live now: its spec, worker revision and image (read from the InferenceService)."""

    spec: DeploymentSpec
    revision: str | None
    image: str


@dataclass(frozen=True)
class RolloutResult:
    outcome: str  # "promoted" | "rolled_back"
    revision: str
    previous_revision: str | None
    reason: str


def current_champion(kube: Kube, *, name: str, namespace: str) -> Champion | None:
    """The live champion, or None on a first deployment. Raises ApplyError if it cannot be parsed."""
    live = kube.get("serving.kserve.io/v1beta1", "InferenceService", name, namespace)
    if live is None:
        return None
    meta = live.get("metadata", {})
    env = {e.get("name"): e.get("value") for e in live["spec"]["predictor"].get("model", {}).get("env", [])}
    try:
        spec = DeploymentSpec.model_validate_json(env[SPEC_ENV])
        image = meta["annotations"]["pdserve.io/image"]
    except (KeyError, ValueError) as e:
        raise ApplyError(f"InferenceService/{name}: live object was not rendered by pdserve ({e})") from None
    return Champion(spec=spec, revision=meta.get("labels", {}).get("pdserve.io/revision"), image=image)


def probe_url(isvc: dict[str, Any]) -> str:
    """URL of the newest revision (tag-routing `latest` traffic entry), else the service URL."""
    status = isvc.get("status") or {}
    for t in status.get("components", {}).get("predictor", {}).get("traffic", []):
        if t.get("latestRevision") and t.get("url"):
            return t["url"]
    if status.get("url"):
        return status["url"]
    raise ApplyError(f"{ident(isvc)}: status has no URL to probe")


def _worker_objects(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "Service", "PodDisruptionBudget")
            and o["metadata"].get("labels", {}).get("app.kubernetes.io/component") in ("prefill", "decode")]


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
            sleep: Callable[[float], None] = time.sleep) -> RolloutResult:
    """Roll out `spec` as worker revision `revision` with a canary, an SLO probe and auto-rollback.

    Raises:
        ManifestError: bad input (name, TP, ...) — before anything is applied.
        ApplyError: pre-flight failure (missing PVC; nothing applied), or a failure with no previous
            champion to roll back to (the new revision's workers are deleted first).
    """
    if not revision:
        raise ManifestError("revision: required for a canary rollout (worker pools are named per revision)")
    waits = dict(timeout_s=timeout_s, poll_s=poll_s, progress=progress, clock=clock, sleep=sleep)

    def rec(step: str, status: str, **detail: Any) -> None:
        progress(f"{step}: {status} {json.dumps(detail, sort_keys=True) if detail else ''}".rstrip())
        recorder.record(step, status, detail)

    new_objs = render_all(spec, name=name, namespace=namespace, image=image, pvc_name=pvc_name,
                          target=target, revision=revision)
    try:
        preflight(kube, new_objs)
        champ = current_champion(kube, name=name, namespace=namespace)
    except (ApplyError, ManifestError) as e:
        rec("preflight", "failed", error=str(e))
        raise
    prev_rev = champ.revision if champ else None
    rec("preflight", "ok", revision=revision, previous_revision=prev_rev)
    isvc = find(new_objs, "InferenceService", name)
    rest = [o for o in new_objs if o is not isvc]
    try:
        for o in rest:
            kube.apply(o)
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
        result = probe(probe_url(live))
        ok, why = result.verdict(spec.slo)
        rec("slo_probe", "ok" if ok else "failed", reason=why, ttft_p90_ms=result.ttft_p90_ms,
            itl_p90_ms=result.itl_p90_ms, num_requests=result.num_requests, num_errors=result.num_errors)
        if not ok:
            raise ApplyError(f"SLO probe failed: {why}")
        if percent is not None:
            kube.apply(isvc)  # no canaryTrafficPercent: 100 % to the new revision
            wait_ready(kube, [isvc], **waits)
        rec("promote", "ok", traffic_percent=100)
    except (ApplyError, ManifestError) as e:
        reason = str(e)
        if champ is None:
            gone = _delete(kube, _worker_objects(new_objs) + [isvc])
            rec("rollback", "no_previous_champion", error=reason, deleted=gone)
            raise ApplyError(f"rollout of {revision} failed and there is no previous champion: {reason}") from None
        prev_objs = render_all(champ.spec, name=name, namespace=namespace, image=champ.image,
                               pvc_name=pvc_name, target=target, revision=champ.revision)
        for o in prev_objs:
            kube.apply(o)
        wait_ready(kube, prev_objs, **waits)
        gone = _delete(kube, _worker_objects(new_objs)) if revision != prev_rev else []
        rec("rollback", "ok", error=reason, restored_revision=prev_rev, deleted=gone)
        recorder.champion_restored(prev_rev)
        return RolloutResult("rolled_back", revision, prev_rev, reason)
    if champ is not None and prev_rev != revision:
        old = render_all(champ.spec, name=name, namespace=namespace, image=champ.image, pvc_name=pvc_name,
                         target=target, revision=prev_rev, validate=False)
        rec("cleanup", "ok", deleted=_delete(kube, _worker_objects(old)))
    rec("outcome", "promoted", revision=revision)
    return RolloutResult("promoted", revision, prev_rev, "SLO met")
