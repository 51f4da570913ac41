"""Thin Kubernetes REST adapter over the official `kubernetes` client (server-side apply, get, delete).

Uses `ApiClient.call_api` with resource paths built from a small kind → plural table, so no API
discovery round-trips are needed and tests can point it at any HTTP server on loopback.
Server-side apply: `PATCH ...?fieldManager=pdserve&force=true` with `Content-Type:
application/apply-patch+yaml` (JSON is valid YAML) — kubernetes.io/docs/reference/using-api/server-side-apply/.
"""

from __future__ import annotations

from typing import Any

from runtime.deploy.errors import ApplyError

# kind -> (plural, namespaced)
RESOURCES: dict[str, tuple[str, bool]] = {
    "Namespace": ("namespaces", False),
    "ServiceAccount": ("serviceaccounts", True),
    "Service": ("services", True),
    "ConfigMap": ("configmaps", True),
    "PersistentVolumeClaim": ("persistentvolumeclaims", True),
    "Deployment": ("deployments", True),
    "PodDisruptionBudget": ("poddisruptionbudgets", True),
    "NetworkPolicy": ("networkpolicies", True),
    "Role": ("roles", True),
    "RoleBinding": ("rolebindings", True),
    "ClusterRole": ("clusterroles", False),
    "ClusterRoleBinding": ("clusterrolebindings", False),
    "EndpointSlice": ("endpointslices", True),
    "ClusterServingRuntime": ("clusterservingruntimes", False),
    "ServingRuntime": ("servingruntimes", True),
    "InferenceService": ("inferenceservices", True),
    "ServiceMonitor": ("servicemonitors", True),
}
FIELD_MANAGER = "pdserve"


def resource_path(api_version: str, kind: str, name: str | None = None, namespace: str | None = None) -> str:
    """REST path of an object (or its collection when `name` is None).

    Raises:
        ApplyError: unknown kind, or a namespaced kind without a namespace.
    """
    if kind not in RESOURCES:
        raise ApplyError(f"kind {kind!r} is not supported by the applier (known: {sorted(RESOURCES)})")
    plural, namespaced = RESOURCES[kind]
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced:
        if not namespace:
            raise ApplyError(f"{kind}/{name}: metadata.namespace is required for a namespaced kind")
        prefix += f"/namespaces/{namespace}"
    path = f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path


def ident(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


class Kube:
    """Minimal Kubernetes API access through a `kubernetes.client.ApiClient`."""

    def __init__(self, api_client: Any, *, request_timeout_s: float = 30.0) -> None:
        self.api = api_client
        self.request_timeout_s = request_timeout_s

    @classmethod
    def from_context(cls, kube_context: str | None = None, *, kubeconfig: str | None = None) -> "Kube":
        """Kubeconfig context (None = current context) from `kubeconfig` (default: $KUBECONFIG or
        ~/.kube/config), else the in-cluster service-account config."""
        from kubernetes import config

        try:
            return cls(config.new_client_from_config(config_file=kubeconfig, context=kube_context))
        except config.ConfigException:
            if kube_context:
                raise
            config.load_incluster_config()
            from kubernetes import client

            return cls(client.ApiClient())

    @classmethod
    def for_host(cls, host: str, *, token: str | None = None) -> "Kube":
        """Client for an explicit API server URL (tests, port-forwards)."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = host
        if token:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        return cls(client.ApiClient(cfg))

    def _call(self, method: str, path: str, *, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.api.call_api(
                path, method, query_params=query or [], body=body,
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                response_type="object", auth_settings=["BearerToken"], _return_http_data_only=True,
                # (connect, read): the client ignores a bare float timeout
                _request_timeout=(self.request_timeout_s, self.request_timeout_s),
            )
        except ApiException as e:
            if e.status == 404:
                raise KeyError(path) from None
            reason = e.reason
            try:
                import json

                reason = json.loads(e.body).get("message", reason)
            except Exception:  # noqa: BLE001 - body is not JSON; keep the HTTP reason
                pass
            raise ApplyError(f"{method} {path}: HTTP {e.status}: {reason}") from None

    def apply(self, obj: dict[str, Any], *, field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply `obj` (force: pdserve owns the fields it sets). Returns the live object."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace"))
        try:
            return self._call("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                              query=[("fieldManager", field_manager), ("force", "true")])
        except KeyError:
            raise ApplyError(f"{ident(obj)}: PATCH {path}: HTTP 404 (is the CRD/namespace installed?)") from None
        except ApplyError as e:
            raise ApplyError(f"{ident(obj)}: {e}") from None

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The live object, or None when it does not exist."""
        try:
            return self._call("GET", resource_path(api_version, kind, name, namespace))
        except KeyError:
            return None

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete (foreground propagation); False when it did not exist."""
        try:
            self._call("DELETE", resource_path(api_version, kind, name, namespace),
                       body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Foreground"})
            return True
        except KeyError:
            return False
