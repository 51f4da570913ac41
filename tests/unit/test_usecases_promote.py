"""The promote use case with apply=True: where it may apply without a kube context, checked before anything else."""

from __future__ import annotations

import pytest

from runtime.deploy import kube as kube_mod
from runtime.usecases.promote import PromoteRequest, promote


def test_apply_without_context_outside_a_pod_fails_before_reading_mlflow(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    out = tmp_path / "m.yaml"
    # A tracking URI that does not exist: reaching MLflow would raise TrackingError instead.
    with pytest.raises(RuntimeError, match=r"without kube_context and not inside a Kubernetes pod: pass a kubeconfig "
                                           r"context .* or run inside a Kubernetes pod \(in-cluster"):
        promote(PromoteRequest(registered_model="m", mlflow_tracking_uri=f"sqlite:///{tmp_path / 'none.db'}",
                               out_path=str(out), image="img:1", apply=True))
    assert not out.exists() and not (tmp_path / "none.db").exists()


def test_in_cluster_detection_needs_env_and_token(tmp_path):
    token = tmp_path / "token"
    env = {"KUBERNETES_SERVICE_HOST": "10.100.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert not kube_mod.in_cluster_available(env, str(token))
    token.write_text("t")
    assert kube_mod.in_cluster_available(env, str(token))
    assert not kube_mod.in_cluster_available({}, str(token))
