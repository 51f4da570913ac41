"""Thin Kubernetes REST adapter over the official `kubernetes` client (server-side apply, get, delete,
and create/replace for the promote Lease).

Uses `ApiClient.call_api` with resource paths built from a small kind → plural table, so no API
discovery round-trips are needed and tests can point it at any HTTP server on loopback.
Server-side apply: `PATCH ...?fieldManager=pdserve&force=true` with `Content-Type:
application/apply-patch+yaml` (JSON is valid YAML) — kubernetes.io/docs/reference/using-api/server-side-apply/.

Credentials: a kubeconfig context (`from_context`), or inside a pod the service-account token the kubelet
mounts (`in_cluster`; paths and env names as kubernetes.config.incluster_config and
kubernetes.io/docs/tasks/run-application/access-api-from-pod/).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from runtime.deploy.errors import ApplyError, ConflictError, KubeconfigError

# kind -> (plural, namespaced)
RESOURCES: dict[str, tuple[str, bool]] = {
    "Namespace": ("namespaces", False),
    "ServiceAccount": ("serviceaccounts", True),
    "Service": ("services", True),
    "ConfigMap": ("configmaps", True),
    "PersistentVolumeClaim": ("persistentvolumeclaims", True),
    "Deployment": ("deployments", True),
    "LeaderWorkerSet": ("leaderworkersets", True),
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
    "PodMonitor": ("podmonitors", True),
    "Lease": ("leases", True),
}
FIELD_MANAGER = "pdserve"
# In-cluster config (kubernetes.config.incluster_config): env set by the kubelet in every pod, token + CA mounted
# from the pod's service account.
SERVICE_HOST_ENV, SERVICE_PORT_ENV = "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"
IN_CLUSTER_TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"
IN_CLUSTER_CA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
CREDENTIAL_OPTIONS = ("pass a kubeconfig context (kube_context / --kube-context) or run inside a Kubernetes pod "
                      "(in-cluster service-account config)")


def in_cluster_available(environ: Mapping[str, str] | None = None, token_path: str | None = None) -> bool:
    """True inside a pod: the API server's host/port env vars are set and the service-account token exists."""
    env = os.environ if environ is None else environ
    return bool(env.get(SERVICE_HOST_ENV) and env.get(SERVICE_PORT_ENV)) and Path(
        token_path or IN_CLUSTER_TOKEN_PATH).is_file()


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
        ~/.kube/config), else (no context given) the in-cluster service-account config.

        $KUBECONFIG is read when called (the kubernetes client reads it once, at import), and may list several
        files separated by ':' as kubectl takes it.

        Raises:
            KubeconfigError: the context is not in the kubeconfig, or a kubeconfig file is not YAML.
            ApplyError: no context was given and there is neither a kubeconfig nor an in-cluster config (the
                message names both options).
        """
        import yaml
        from kubernetes import config

        files = kubeconfig or os.environ.get("KUBECONFIG") or None
        try:
            return cls(config.new_client_from_config(config_file=files, context=kube_context))
        except yaml.YAMLError as e:  # its mark names the file and line; the first line says what is wrong
            where = getattr(e, "problem_mark", None)
            name = where.name if where is not None else (files or "~/.kube/config")
            line = f", line {where.line + 1}" if where is not None else ""
            raise KubeconfigError(f"kubeconfig {name}{line} is not valid YAML: "
                                  f"{getattr(e, 'problem', None) or str(e).splitlines()[0]}") from None
        except config.ConfigException as e:
            if kube_context:
                raise KubeconfigError(f"kubeconfig context {kube_context!r}: {e}") from None
            return cls.in_cluster()

    @classmethod
    def in_cluster(cls, *, environ: Mapping[str, str] | None = None, token_path: str | None = None,
                   ca_path: str | None = None) -> "Kube":
        """Client from the pod's service account: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT,
        bearer token `token_path` (re-read every minute, for projected tokens), CA `ca_path`
        (defaults: IN_CLUSTER_TOKEN_PATH, IN_CLUSTER_CA_PATH, os.environ).

        Raises:
            ApplyError: not inside a pod (env vars, token or CA missing); the message names both options.
        """
        from kubernetes import client, config
        from kubernetes.config.incluster_config import InClusterConfigLoader

        cfg = client.Configuration()
        try:
            InClusterConfigLoader(token_filename=token_path or IN_CLUSTER_TOKEN_PATH,
                                  cert_filename=ca_path or IN_CLUSTER_CA_PATH,
                                  environ=os.environ if environ is None else environ).load_and_set(cfg)
        except config.ConfigException as e:
            raise ApplyError(f"no Kubernetes credentials (in-cluster config: {e}): {CREDENTIAL_OPTIONS}") from None
        return cls(client.ApiClient(cfg))

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
        """One API request; the decoded JSON answer.

        Raises:
            KeyError: HTTP 404 (the path).
            ConflictError: HTTP 409 (already exists, or a stale resourceVersion).
            ApplyError: any other HTTP error (status and the API server's message), or a transport error
                (connection refused/reset, TLS, timeout: urllib3 errors and OSError) naming the request.
        """
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError as TransportError

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
            if e.status == 409:
                raise ConflictError(f"{method} {path}: HTTP 409: {reason}") from None
            raise ApplyError(f"{method} {path}: HTTP {e.status}: {reason}") from None
        except (TransportError, OSError) as e:
            host = getattr(getattr(self.api, "configuration", None), "host", "?")
            raise ApplyError(f"{method} {path}: cannot reach the Kubernetes API server {host}: "
                             f"{type(e).__name__}: {e}") from e

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

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create `obj` (POST to its collection). Returns the live object.

        Raises:
            ConflictError: it already exists. ApplyError: any other API or transport error.
        """
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], None, meta.get("namespace"))
        try:
            return self._call("POST", path, body=obj)
        except KeyError:
            raise ApplyError(f"{ident(obj)}: POST {path}: HTTP 404 (is the namespace there?)") from None

    def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace `obj` (PUT); with `metadata.resourceVersion` set, only if it is still that version.

        Raises:
            ConflictError: the object changed since that version. ApplyError: it does not exist, or any
                other API or transport error.
        """
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace"))
        try:
            return self._call("PUT", path, body=obj)
        except KeyError:
            raise ApplyError(f"{ident(obj)}: PUT {path}: HTTP 404 (it was deleted)") from None

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
