"""Errors of runtime.deploy."""

from __future__ import annotations


class ManifestError(ValueError):
    """A rendered or supplied Kubernetes object is invalid; the message names the object
    (`Kind/name`) and the failing field path (e.g. `spec.predictor.model.storageUri`)."""


class ApplyError(RuntimeError):
    """Applying objects to a cluster failed (API error, readiness timeout, missing PVC)."""


class KubeconfigError(ApplyError):
    """The kubeconfig cannot give a client for the asked context: the context is not in it, or a kubeconfig file
    is not YAML (the message names the context or the file). Nothing was sent to a cluster."""


class RolledBackError(ApplyError):
    """A rollout did not promote the new version: it was rolled back and the previous champion serves again
    (message: version, restored revision, reason)."""


class ConflictError(ApplyError):
    """The API server answered 409 Conflict: the object already exists (create) or changed since it was read
    (update with a stale resourceVersion)."""
