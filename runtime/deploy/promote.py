"""One call for `promote --apply`: canary rollout of an MLflow model version with SLO probe, automatic
rollback and every step recorded on that version (composes rollout.py, slo_probe.py, mlflow_recorder.py).

Adapter: talks to the cluster (kubeconfig context or in-cluster) and to MLflow.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from runtime.config import DeploymentSpec
from runtime.deploy.kube import Kube, in_cluster_available
from runtime.deploy.mlflow_recorder import MlflowRecorder, revision_for
from runtime.deploy.rollout import RolloutResult, rollout
from runtime.deploy.slo_probe import probe
from runtime.deploy.target import ClusterTarget


def promote_version(spec: DeploymentSpec, version: str, *, name: str, namespace: str, image: str, pvc_name: str,
                    kube_context: str | None, tracking_uri: str, registered_model: str,
                    canary_percent: int = 10, timeout_s: float = 1800.0, target: ClusterTarget | None = None,
                    progress: Callable[[str], None] = print, kube: Kube | None = None) -> RolloutResult:
    """Roll out MLflow version `version` of `registered_model` (spec = that version's DeploymentSpec) as
    worker revision `v<version>`; see `runtime.deploy.rollout.rollout` for the steps and errors.

    Returns the RolloutResult ("promoted" or "rolled_back"; on rollback the `champion` alias is moved back).
    Raises ManifestError / ApplyError as `rollout` does (nothing applied on bad input or a missing PVC).
    """
    return rollout(
        spec, name=name, namespace=namespace, image=image, pvc_name=pvc_name, revision=revision_for(version),
        kube=kube or Kube.from_context(kube_context),
        probe=partial(probe, model=spec.model.name),
        recorder=MlflowRecorder(tracking_uri=tracking_uri, registered_model=registered_model, version=version),
        target=target, canary_percent=canary_percent, timeout_s=timeout_s, progress=progress,
        # in a pod (the pipeline's promote step, the re-tune's): the in-cluster address, no external DNS needed
        probe_cluster_local=kube is None and not kube_context and in_cluster_available(),
    )
