"""Vendored CustomResourceDefinition schemas (openAPIV3Schema) for offline validation.

Each file in runtime/deploy/schemas/ is small JSON:
``{"group", "version", "kind", "source", "source_version", "openAPIV3Schema"}``, extracted from the
upstream CRD (`python -m runtime.deploy.crd_schemas CRD.yaml SOURCE SOURCE_VERSION` regenerates one from
the project's CRD YAML; schemas/README.md names each source). Shipping only the schemas, not the CRDs, keeps
validation offline and every file < 1 MB.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

SCHEMA_DIR = Path(__file__).with_name("schemas")


def schema_filename(group: str, version: str, kind: str) -> str:
    return f"{group}_{version}_{kind.lower()}.json"


@lru_cache(maxsize=None)
def _index() -> dict[tuple[str, str], Path]:
    out: dict[tuple[str, str], Path] = {}
    for p in sorted(SCHEMA_DIR.glob("*.json")):
        group, version, _ = p.name.split("_", 2)
        with open(p) as f:
            kind = json.load(f)["kind"]
        out[(f"{group}/{version}", kind)] = p
    return out


def known_kinds() -> list[tuple[str, str]]:
    """(apiVersion, kind) pairs with a vendored schema."""
    return sorted(_index())


@lru_cache(maxsize=None)
def load(api_version: str, kind: str) -> dict[str, Any] | None:
    """The vendored record for (apiVersion, kind), or None when none is vendored."""
    p = _index().get((api_version, kind))
    if p is None:
        return None
    with open(p) as f:
        return json.load(f)


def extract(crd: dict[str, Any], *, source: str, source_version: str) -> list[dict[str, Any]]:
    """One record per served version of a CRD (raises KeyError naming a missing CRD field)."""
    spec = crd["spec"]
    out = []
    for v in spec["versions"]:
        if not v.get("served", True):
            continue
        out.append({
            "group": spec["group"],
            "version": v["name"],
            "kind": spec["names"]["kind"],
            "scope": spec.get("scope", "Namespaced"),
            "source": source,
            "source_version": source_version,
            "openAPIV3Schema": v["schema"]["openAPIV3Schema"],
        })
    return out


def vendor(crd_path: Path, *, source: str, source_version: str, out_dir: Path = SCHEMA_DIR) -> list[Path]:
    """Write the schema records of `crd_path` into `out_dir`; returns the files written."""
    with open(crd_path) as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    written = []
    for rec in extract(crd, source=source, source_version=source_version):
        p = out_dir / schema_filename(rec["group"], rec["version"], rec["kind"])
        p.write_text(json.dumps(rec, separators=(",", ":"), sort_keys=True))
        written.append(p)
    return written


if __name__ == "__main__":  # pragma: no cover - maintenance command
    for path in vendor(Path(sys.argv[1]), source=sys.argv[2], source_version=sys.argv[3]):
        print(path, path.stat().st_size)
