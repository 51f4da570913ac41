"""Errors of runtime.deploy."""

from __future__ import annotations


class ManifestError(ValueError):
    """A rendered or supplied Kubernetes object is invalid; the message names the object
    (`Kind/name`) and the failing field path (e.g. `spec.predictor.model.storageUri`)."""


class ApplyError(RuntimeError):
    """Applying objects to a cluster failed (API error, readiness timeout, missing PVC)."""
