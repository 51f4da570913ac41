"""Use case: render the registered champion's KServe + Kubernetes objects, validate them, write the YAML, and
roll them out on request (canary, SLO probe, automatic rollback).

`pdserve promote` (runtime/faces/promote.py), the pipeline's promote step (`components/promote.py`) and the
re-tuning workflow's promote step (which runs `pdserve promote`) all call :func:`promote`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class PromoteValueError(ValueError):
    """A request value that does not fit the champion (e.g. a max_model_len_tokens below its workload's
    ISL + OSL, an engine argument vLLM refuses): a face's bad value (exit 2), found before anything is written."""


def _model_context(spec) -> int | None:  # noqa: ANN001 - a DeploymentSpec
    """The context window of the champion's model (tokens), from the config.json in its model folder, else the
    one `tune` recorded in the spec (`model.context_tokens`, read when the folder was readable where tune ran);
    None when neither is known (a folder mounted on the cluster only, a spec recorded without it)."""
    from runtime.modelfiles.load import load_model_spec
    from runtime.models.spec import ModelConfigError

    recorded = spec.model.context_tokens or None
    if not spec.model.path or not (Path(spec.model.path) / "config.json").is_file():
        return recorded
    try:
        model = load_model_spec(Path(spec.model.path))
    except ModelConfigError:
        return recorded
    return model.max_context_tokens or model.max_position_embeddings or recorded


class PromoteRequest(BaseModel):
    """One promotion of a registered model's champion."""

    model_config = ConfigDict(extra="forbid")

    registered_model: str = Field(description="MLflow registered model whose alias champion is promoted.")
    mlflow_tracking_uri: str = Field(description="MLflow tracking URI of the registry.")
    out_path: str = Field(description="File the validated YAML is written to.")
    namespace: str = Field("pdserve", description="Kubernetes namespace of the InferenceService.")
    image: str = Field(description="pdserve runtime container image of the ClusterServingRuntime.")
    pvc_name: str = Field("fsx-claim", description="PersistentVolumeClaim of the FSx volume holding the models.")
    expect_version: str = Field("", description="Promote only when alias champion is this version; empty: any.")
    apply: bool = Field(False, description="Roll the objects out (canary beside the current champion, SLO probe, "
                                           "rollback when it misses); false: render and validate only.")
    kube_context: str = Field("", description="kubeconfig context for apply; empty: the in-cluster service account.")
    require_staged: bool = Field(True, description="Refuse a champion whose model path is not a verified staged "
                                                   "folder (marker and every listed file with its size).")
    traffic_upload_uri: str = Field("", description="s3://bucket/prefix/ the runtime ships its traffic log under "
                                                    "(<prefix><InferenceService>/); empty: off.")
    skip_if_live: bool = Field(False, description="With apply: apply nothing when the InferenceService already "
                                                  "serves this version's revision with the same image.")
    max_model_len_tokens: Optional[int] = Field(None, description="vLLM --max-model-len to deploy the champion "
                                                                  "with, tokens (at least its workload's ISL + "
                                                                  "OSL); None: the spec's.")
    engine_args: list[str] = Field(default_factory=list, description="vLLM engine arguments (KEY=VALUE) to deploy "
                                                                     "the champion with, checked against the pinned "
                                                                     "vLLM's parser; they replace the spec's "
                                                                     "engine.extra_args of the same argument.")


@dataclass(frozen=True)
class PromoteOutcome:
    """What :func:`promote` did: the ``version`` rendered, ``num_objects`` and their ``kinds`` written to
    ``path``; ``applied`` (rolled out) or ``already_live`` (nothing applied: it serves already); ``notes``."""

    path: str
    num_objects: int
    version: str
    applied: bool
    already_live: bool
    kinds: list[str]
    notes: list[str] = field(default_factory=list)

    def metadata(self) -> dict[str, object]:
        """The KFP Artifact's metadata (``kinds`` as a JSON list)."""
        return {"path": self.path, "num_objects": self.num_objects, "version": self.version, "applied": self.applied,
                "already_live": self.already_live, "kinds": json.dumps(self.kinds)}


def promote(request: PromoteRequest) -> PromoteOutcome:
    """Render, validate and write the champion's objects; with ``apply`` roll them out.

    The InferenceService is named `dns_label(registered_model)` (runtime/deploy/target.py): the registered model
    name when it is a DNS-1035 label of at most 45 characters, else its normalised form plus a short hash.
    Revisions are `v<version>`, numbered per registered model.

    Raises:
        PromoteValueError: ``max_model_len_tokens`` or an ``engine_args`` item that does not fit the champion
            (named after its `pdserve promote` option).
        ValueError: a bad ``traffic_upload_uri`` (checked first), skip_if_live with engine overrides, or alias
            champion is not ``expect_version``.
        RuntimeError: ``apply`` without a ``kube_context`` outside a Kubernetes pod (checked before anything else).
        runtime.staging.manifest.StagingError: ``require_staged`` and the champion's model path is empty or not a
            verified staged folder.
        runtime.tracking.mlflow_runs.TrackingError: the registry or its champion cannot be read.
        runtime.deploy.validate.ManifestError: an object fails its schema (object and field named).
        runtime.deploy.errors.KubeconfigError: ``apply`` with a ``kube_context`` the kubeconfig lacks, or a
            kubeconfig that is not YAML (before MLflow is read; nothing written).
        runtime.deploy.errors.ApplyError: the cluster refused an object or a PVC is missing (nothing applied).
        runtime.deploy.errors.RolledBackError: ``apply`` and the canary was rolled back (the previous champion
            serves again).
    """
    from pydantic import ValidationError

    from runtime.deploy.mlflow_recorder import revision_for
    from runtime.deploy.render import render_all, write_yaml
    from runtime.deploy.target import ClusterTarget, dns_label
    from runtime.deploy.validate import validate_objects
    from runtime.tracking.mlflow_runs import load_champion

    r = request
    try:
        target = ClusterTarget(traffic_upload_uri=r.traffic_upload_uri or None)
    except ValidationError as e:
        raise ValueError("; ".join(str(x["msg"]).removeprefix("Value error, ") for x in e.errors())) from None
    if r.apply and not r.kube_context:
        from runtime.deploy.kube import CREDENTIAL_OPTIONS, in_cluster_available

        if not in_cluster_available():
            raise RuntimeError(f"promote: apply=True without kube_context and not inside a Kubernetes pod: "
                               f"{CREDENTIAL_OPTIONS}")
    kube = None
    if r.apply:  # before MLflow is read or a manifest written: a context the kubeconfig lacks fails here
        from runtime.deploy.kube import Kube

        # No context: the pod's own service account, never whatever kubeconfig happens to be current.
        kube = Kube.from_context(r.kube_context) if r.kube_context else Kube.in_cluster()
    overrides = r.max_model_len_tokens is not None or bool(r.engine_args)
    if overrides and r.skip_if_live:  # the live revision is the registered spec's: skipping would drop them
        raise ValueError("skip_if_live: not with max_model_len_tokens / engine_args (the live revision of this "
                         "version would be kept without them)")
    version, spec = load_champion(r.mlflow_tracking_uri, r.registered_model)
    if r.expect_version and str(version) != str(r.expect_version):
        raise ValueError(
            f"registered model {r.registered_model!r}: alias champion is version {version}, "
            f"but this run tuned version {r.expect_version}; refusing to promote a different version")
    if overrides:  # before anything is verified, rendered or applied
        from runtime.engines.engine_args import with_engine_overrides

        from runtime.command_options import PROMOTE_OPTIONS

        try:
            spec = with_engine_overrides(spec, max_model_len_tokens=r.max_model_len_tokens,
                                         context_tokens=_model_context(spec))
        except ValueError as e:
            raise PromoteValueError(f"{PROMOTE_OPTIONS['max_model_len_tokens']}: {e}") from None
        try:
            spec = with_engine_overrides(spec, engine_args=r.engine_args)
        except ValueError as e:  # its message names --engine-arg
            raise PromoteValueError(str(e)) from None
    if r.require_staged:
        from runtime.staging.manifest import StagingError, verify_staged

        if not spec.model.path:
            raise StagingError(f"registered model {r.registered_model!r} version {version}: the champion records no "
                               "model path, so its staged copy cannot be verified")
        try:
            verify_staged(Path(spec.model.path), check_digests=False)
        except StagingError as e:
            raise StagingError(f"registered model {r.registered_model!r} version {version}: refusing to promote a "
                               f"model folder that is not a verified staged copy: {e}") from e
    # Named after the registered model (what is promoted), not the served model: revisions are `v<version>`,
    # numbered per registered model, so two registered models must never share an InferenceService.
    name = dns_label(r.registered_model)
    revision = revision_for(version)
    objs = render_all(spec, name=name, namespace=r.namespace, image=r.image, pvc_name=r.pvc_name, revision=revision,
                      target=target)
    validate_objects(objs)
    write_yaml(objs, Path(r.out_path))
    kinds = sorted({o["kind"] for o in objs})
    if not r.apply:
        return PromoteOutcome(r.out_path, len(objs), str(version), False, False, kinds)
    from runtime.deploy.errors import RolledBackError
    from runtime.deploy.promote import promote_version

    if r.skip_if_live:
        from runtime.deploy.rollout import current_champion

        live = current_champion(kube, name=name, namespace=r.namespace)
        if live is not None and live.revision == revision and live.image == r.image:
            return PromoteOutcome(r.out_path, len(objs), str(version), False, True, kinds)
    # Canary beside the current champion, SLO probe, automatic rollback; every step tagged in MLflow.
    result = promote_version(spec, str(version), name=name, namespace=r.namespace, image=r.image,
                             pvc_name=r.pvc_name, kube_context=r.kube_context or None, kube=kube,
                             tracking_uri=r.mlflow_tracking_uri, registered_model=r.registered_model, target=target)
    if result.outcome != "promoted":
        raise RolledBackError(
            f"registered model {r.registered_model!r} version {version} was not promoted: rolled back to "
            f"revision {result.previous_revision}: {result.reason} (see the MLflow version's pdserve.deploy.* tags)")
    return PromoteOutcome(r.out_path, len(objs), str(version), True, False, kinds)
