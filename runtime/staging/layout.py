"""Where staged models live on the FSx mount: `<fsx_root>/models/<model_name>`, in both directions.

The pipeline's steps mount the FSx claim at FSX_MOUNT; `pdserve stage`, the pipeline's stage step and the
workers (runtime/deploy/workers.py `model_path`) agree on the `models/<name>` layout below it.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime.config import check_model_name

FSX_MOUNT = "/fsx"  # where the pipeline's steps and the re-tuning workflow mount the FSx claim
MODELS_DIR = "models"


def staged_model_dir(fsx_root: str | Path, model_name: str) -> Path:
    """Where a model is published on the FSx mount: `<fsx_root>/models/<model_name>`.

    Raises:
        ValueError: `model_name` is not a clean relative path (`check_model_name`).
    """
    return Path(fsx_root) / MODELS_DIR / check_model_name(model_name)


def staged_model_name(folder: Path, roots: list[Path]) -> str | None:
    """The model name of `folder` when it is staged under `<root>/models/` for one of `roots`: its path relative
    to that folder (`org/llama8` for `<root>/models/org/llama8`), the name the stage step published it under.

    Paths compare as given (made absolute, as a recorded model path), then symlink-resolved (a root or folder
    reached through a link). None when the folder is under none of them or its relative path is not a clean
    name (`.`, the models folder itself).
    """
    folder = Path(os.path.abspath(folder))
    pairs = [(folder, Path(os.path.abspath(r))) for r in roots] + [(folder.resolve(), Path(r).resolve()) for r in roots]
    for folder_path, root in pairs:
        try:
            name = folder_path.relative_to(root / MODELS_DIR).as_posix()
        except ValueError:
            continue
        try:
            return check_model_name(name)
        except ValueError:
            return None
    return None
