"""Rollout `Recorder` that writes each step onto the MLflow model version being promoted (adapter).

Tags (MLflow model-version tags, values are JSON, at most 5000 characters — MLflow's tag value limit):
  `pdserve.deploy.<step>` = {"status": ..., **detail}   one per rollout step (preflight, canary, ...)
  `pdserve.deploy.status` = last step's status
On rollback the alias (default `champion`) is moved back to the previous version and the failed version
gets `pdserve.deploy.rolled_back_to`. Worker revisions are named `v<version>` (`revision_for`).
"""

from __future__ import annotations

import json
from typing import Any

MAX_TAG_CHARS = 5000


def revision_for(version: str | int) -> str:
    """Worker revision name of an MLflow model version: "3" → "v3"."""
    return f"v{version}"


def version_of(revision: str | None) -> str | None:
    """Inverse of `revision_for` ("v3" → "3"); None for None or a revision not made by it."""
    if revision and revision.startswith("v") and revision[1:].isdigit():
        return revision[1:]
    return None


class MlflowRecorder:
    """Records rollout steps on `registered_model` version `version` (mlflow imported lazily)."""

    def __init__(self, *, tracking_uri: str, registered_model: str, version: str, alias: str = "champion",
                 client: Any = None) -> None:
        if client is None:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=tracking_uri)
        self.client, self.name, self.version, self.alias = client, registered_model, str(version), alias

    def _tag(self, key: str, value: str) -> None:
        self.client.set_model_version_tag(self.name, self.version, key, value[:MAX_TAG_CHARS])

    def record(self, step: str, status: str, detail: dict[str, Any]) -> None:
        self._tag(f"pdserve.deploy.{step}", json.dumps({"status": status, **detail}, sort_keys=True, default=str))
        self._tag("pdserve.deploy.status", f"{step}:{status}")

    def champion_restored(self, revision: str | None) -> None:
        self._tag("pdserve.deploy.rolled_back_to", revision or "")
        previous = version_of(revision)
        if previous is not None:
            self.client.set_registered_model_alias(self.name, self.alias, previous)
