"""Filesystem locations (adapter: reads env and the filesystem; the pure core never imports this)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent


def state_dir() -> Path:
    """Working state (.pdserve/: MLflow sqlite, FSx stand-in, demo output), an absolute path.

    `PDSERVE_HOME` overrides (`~` expanded; a relative value is taken from the current directory, so child
    processes started in another folder see the same place); unset or empty: `<repo>/.pdserve`.
    """
    return Path(os.environ.get("PDSERVE_HOME") or REPO_ROOT / ".pdserve").expanduser().absolute()


def write_text_atomically(path: Path, text: str) -> Path:
    """Write `text` to `path` (parent folders created) through a temporary file in the same folder and a
    rename, so a reader never sees a half-written file; returns `path`.

    A `path` that is a symbolic link is written through: the file it points to is replaced and the link stays
    (as a plain write would do; a rename onto the link would replace the link with a file, and whatever read
    the file through another path would keep the old text).

    Raises:
        OSError: the folder cannot be created or written (the temporary file is removed).
    """
    import tempfile

    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a spec or manifest is for kubectl / CI to read
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def output_file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a file to write (with :func:`write_text_atomically`, which creates missing parent
    folders): "is a folder", or "<ancestor> is not a folder" when the nearest existing ancestor is a file;
    None when it can be tried (permissions and free space show only when writing). For an --out option to be
    refused as a bad value before any work, rather than fail with an OS error after it.
    """
    path = Path(path)
    if path.is_dir():
        return "is a folder"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        return f"{parent} is not a folder"
    return None


RECOGNISED_MAX_BYTES = 64 << 20  # a larger file is no output of a pdserve command: never read whole to tell


def replace_problem(path: Path, ours: Callable[[str], bool], what: str, *, force: bool = False) -> str | None:
    """Why a command must not replace the file at ``path`` with its output, or None: the one rule of every
    option that names a file a command writes (`pdserve compile`, `promote --out`, `tune --out` /
    `--decision-out`, `batch workflow` / `retune-schedule --out`).

    A missing or empty file may be written, and so may one that ``ours`` (called with the file's text) recognises
    as ``what``: an earlier output of the same command, which a rerun replaces. Anything else (someone's notes, a
    values file, another tool's output, a file that cannot be read as UTF-8 text) is refused unless ``force``, so
    a typo never destroys it; the message ends "pass --force to replace it". A folder or an unwritable parent is
    :func:`output_file_problem`'s to report.
    """
    path = Path(path)
    if force or not path.is_file():
        return None
    try:
        size = path.stat().st_size
        if size == 0:
            return None
        if size <= RECOGNISED_MAX_BYTES and ours(path.read_text(encoding="utf-8")):
            return None
    except Exception:  # noqa: BLE001 - unreadable, not UTF-8, not the format ``ours`` parses: not ours
        pass
    return f"exists and is not {what}; pass --force to replace it"


def json_object_with(*keys: str) -> Callable[[str], bool]:
    """A recogniser for :func:`replace_problem`: the text is a JSON object holding every one of ``keys``."""
    def ours(text: str) -> bool:
        import json

        obj = json.loads(text)
        return isinstance(obj, dict) and set(keys) <= obj.keys()
    return ours


def overwrites(out: Path, inputs: "list[Path | None]") -> Path | None:
    """The first of ``inputs`` (files or folders; None skipped) that writing the file ``out`` would replace or
    change: the same file (through links too), or a folder ``out`` lies in; None when there is none. So that an
    --out option never destroys what the command reads (a model's config.json, a trace, a database).
    """
    target = Path(out).resolve()
    for path in inputs:
        if path is None:
            continue
        src = Path(path).resolve()
        try:
            if target.exists() and src.exists() and os.path.samefile(target, src):
                return Path(path)
        except OSError:
            pass
        if target == src or (src.is_dir() and target.is_relative_to(src)):
            return Path(path)
    return None


def print_json_line(obj: dict, out: Path | None = None) -> str:
    """Print `obj` as ONE JSON line on stdout (what every bench/ script reports) and, when `out` is
    given, also write that line to it (`write_text_atomically`: parent folders created); returns the line."""
    import json

    line = json.dumps(obj)
    print(line, flush=True)
    if out:
        write_text_atomically(Path(out), line + "\n")
    return line
