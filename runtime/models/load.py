"""Adapter: read a ``config.json`` (file or model folder) into a :class:`ModelSpec`."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.models.spec import ModelConfigError, ModelSpec


def load_model_spec(path: Path, name: str | None = None) -> ModelSpec:
    """Read ``path`` (a ``config.json`` or a folder containing one) and parse it.

    Args:
        path: file or model folder.
        name: model name; default: the folder name (or the file stem for ``<org>--<model>_config.json``).

    Raises:
        ModelConfigError: file missing or unreadable (OSError), not UTF-8, not JSON, or missing/invalid
            fields (named in the message); the message names the model and, for file problems, the path.
    """
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    if name is None:
        name = path.name if path.is_dir() else cfg_path.stem.removesuffix("_config").replace("--", "/")
        if name == "config":
            name = cfg_path.parent.name
    if not cfg_path.is_file():
        raise ModelConfigError(f"{name}: no config.json at {cfg_path}")
    try:
        raw = cfg_path.read_bytes()
    except OSError as e:  # unreadable: permissions, I/O error
        raise ModelConfigError(f"{name}: cannot read {cfg_path}: {e.strerror or e}") from e
    try:
        cfg = json.loads(raw.decode("utf-8-sig"))  # a leading UTF-8 byte-order mark is tolerated
    except UnicodeDecodeError as e:  # JSON files are UTF-8 (RFC 8259 section 8.1)
        raise ModelConfigError(f"{name}: {cfg_path} is not UTF-8 text (not a JSON config.json): {e}") from e
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{name}: {cfg_path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ModelConfigError(f"{name}: {cfg_path} is nested too deeply to be a config.json") from None
    return ModelSpec.from_hf_config(cfg, name)
