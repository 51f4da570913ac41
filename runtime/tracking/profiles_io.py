"""Adapter: write/read planner profiles (runtime.tuner.profiles.PlannerProfiles) as JSON files."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from runtime.tuner.profiles import PlannerProfiles


def write_profiles(profiles: PlannerProfiles, folder: Path) -> list[Path]:
    """Write ``profiles.json`` (everything) plus ``prefill_tp<N>.json`` / ``decode_tp<N>.json`` per TP
    into ``folder`` (created). Each file is written atomically (temp file + rename). Returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d = profiles.to_dict()
    files = {"profiles.json": d}
    for tp, pts in d["prefill"].items():
        files[f"prefill_tp{tp}.json"] = {"model": d["model"], "gpu": d["gpu"], "tp": int(tp), "points": pts}
    for tp, pts in d["decode"].items():
        files[f"decode_tp{tp}.json"] = {"model": d["model"], "gpu": d["gpu"], "tp": int(tp), "points": pts}
    out = []
    for name, obj in files.items():
        path = folder / name
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
        out.append(path)
    return out


def read_profiles(path: Path) -> PlannerProfiles:
    """Read a ``profiles.json`` (file, or the folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "profiles.json"
    return PlannerProfiles.from_dict(json.loads(path.read_text()))
