"""Validate Kubernetes objects offline, before anything is written or applied.

* Built-in kinds: `kubernetes-validate` in strict mode (unknown fields rejected) against the upstream
  Kubernetes OpenAPI schemas of `KUBERNETES_VERSION`. It passes unknown (CRD) kinds silently, so
* custom resources are checked here with jsonschema against the CRD's own openAPIV3Schema vendored in
  runtime/deploy/schemas/ (see crd_schemas.py), made strict the way `kubectl --validate=strict` /
  server-side field validation is: an object schema with `properties` and no `additionalProperties` /
  `x-kubernetes-preserve-unknown-fields` rejects unknown fields (the API server would silently prune
  them). `metadata` gets a minimal ObjectMeta schema (name required, DNS-1123 subdomain).
* A kind with no schema at all is an error, never a silent pass.

CEL rules (`x-kubernetes-validations`) are not evaluated; no kube-apiserver can run here.
"""

from __future__ import annotations

import copy
import re
from functools import lru_cache
from typing import Any, Iterable

import jsonschema
import kubernetes_validate.utils as kv_utils
from referencing import Registry, Resource

from runtime.deploy import crd_schemas
from runtime.deploy.errors import ManifestError

# Pinned Kubernetes schema version (kubernetes-validate ships 1.25–1.37; EKS standard support covers 1.33).
KUBERNETES_VERSION = "1.33"

_OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253,
                 "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
        "namespace": {"type": "string", "maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}

__all__ = ["ManifestError", "validate_objects", "validate_object", "KUBERNETES_VERSION"]


def _strict(schema: Any) -> Any:
    """Copy of a structural schema where objects with `properties` reject unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=None)
def _cr_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator | None:
    rec = crd_schemas.load(api_version, kind)
    if rec is None:
        return None
    schema = _strict(copy.deepcopy(rec["openAPIV3Schema"]))
    props = schema.setdefault("properties", {})
    props["metadata"] = _OBJECT_META
    props["apiVersion"] = {"const": api_version}
    props["kind"] = {"const": kind}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


@lru_cache(maxsize=None)
def _builtin_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator | None:
    """Cached strict validator for a built-in kind (same files and logic as
    `kubernetes_validate.validate`, which re-reads its 1.4 MB definitions on every call)."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema_dir = f"kubernetes-json-schema/v{KUBERNETES_VERSION}.0-local-strict"
    try:
        schema = kv_utils.schema_contents(f"{schema_dir}/{kind.lower()}-{group_version}.json", KUBERNETES_VERSION)
    except FileNotFoundError:
        return None
    defs = kv_utils.schema_contents(f"{schema_dir}/_definitions.json", KUBERNETES_VERSION)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def _field_path(err: jsonschema.ValidationError) -> str:
    parts: list[str] = []
    for p in err.absolute_path:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        else:
            parts.append(("." if parts else "") + str(p))
    path = "".join(parts)
    extra = ""
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        allowed = set((err.schema or {}).get("properties", {}))
        unknown = sorted(k for k in err.instance if k not in allowed)
        extra = unknown[0] if unknown else ""
    elif err.validator == "required" and isinstance(err.validator_value, list) and isinstance(err.instance, dict):
        missing = [k for k in err.validator_value if k not in err.instance]
        extra = missing[0] if missing else ""
    if extra:
        path = f"{path}.{extra}" if path else extra
    return path or "<root>"


def _ident(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return f"{obj.get('kind', '<no kind>')}/{meta.get('name', '<no name>')}"


POD_TEMPLATE_MARK = "x-pdserve-validated-as"  # a vendored schema's field checked as a Kubernetes PodTemplateSpec


def _validate_pod_templates(obj: Any, schema: dict[str, Any], ident: str, path: str = "") -> None:
    """Check each field of `obj` that `schema` marks `POD_TEMPLATE_MARK` (a CRD schema subset written by hand
    for a kind embedding pod templates, e.g. LeaderWorkerSet) strictly as a Kubernetes PodTemplateSpec, by
    validating a v1 PodTemplate holding it. Raises ManifestError naming the field path."""
    if not isinstance(obj, dict):
        return
    for key, sub in (schema.get("properties") or {}).items():
        if key not in obj:
            continue
        where = f"{path}.{key}" if path else key
        if sub.get(POD_TEMPLATE_MARK):
            holder = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": obj[key]}
            err = jsonschema.exceptions.best_match(_builtin_validator("v1", "PodTemplate").iter_errors(holder))
            if err is not None:
                inner = _field_path(err).removeprefix("template").lstrip(".")
                raise ManifestError(f"{ident}: {where}{'.' + inner if inner else ''}: {err.message}")
        else:
            _validate_pod_templates(obj[key], sub, ident, where)


def validate_object(obj: dict[str, Any]) -> str:
    """Validate one object; returns what it was checked against ("kubernetes 1.33" or the CRD source).

    Raises:
        ManifestError: "Kind/name: field.path: reason" for a schema violation, a missing
            apiVersion/kind, or a kind with no known schema.
    """
    if not isinstance(obj, dict):
        raise ManifestError(f"object is a {type(obj).__name__}, not a mapping")
    ident = _ident(obj)
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        raise ManifestError(f"{ident}: apiVersion and kind must both be strings")
    validator = _cr_validator(api_version, kind)
    if validator is not None:
        err = jsonschema.exceptions.best_match(validator.iter_errors(obj))
        if err is not None:
            raise ManifestError(f"{ident}: {_field_path(err)}: {err.message}")
        rec = crd_schemas.load(api_version, kind) or {}
        _validate_pod_templates(obj, rec.get("openAPIV3Schema") or {}, ident)
        return f"CRD {rec.get('source', '?')} @ {rec.get('source_version', '?')}"
    builtin = _builtin_validator(api_version, kind)
    if builtin is not None:
        err = jsonschema.exceptions.best_match(builtin.iter_errors(obj))
        if err is not None:
            raise ManifestError(f"{ident}: {_field_path(err)}: {err.message}")
    else:
        known = ", ".join(f"{a} {k}" for a, k in crd_schemas.known_kinds())
        raise ManifestError(
            f"{ident}: apiVersion {api_version} kind {kind}: no schema (not a Kubernetes {KUBERNETES_VERSION} "
            f"built-in kind; vendored custom resources: {known})"
        )
    return f"kubernetes {KUBERNETES_VERSION}"


def validate_objects(objs: Iterable[dict[str, Any]]) -> int:
    """Validate every object; returns how many were checked.

    Raises:
        ManifestError: at the first invalid object (message names `Kind/name` and the field path), or
            when two objects share kind, namespace and name.
    """
    seen: set[tuple[str, str, str]] = set()
    n = 0
    for obj in objs:
        validate_object(obj)
        meta = obj["metadata"]
        key = (obj["kind"], meta.get("namespace", ""), meta["name"])
        if key in seen:
            raise ManifestError(f"{_ident(obj)}: metadata.name: duplicate object in namespace {key[1]!r}")
        seen.add(key)
        n += 1
    return n
