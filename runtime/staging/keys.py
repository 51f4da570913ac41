"""Object-key safety and file selection (include/exclude globs, safetensors preference).

Pure functions over key strings; no I/O.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import PurePosixPath
from typing import Iterable, Sequence

from runtime.staging.manifest import MARKER_NAME, StagingError

DEFAULT_INCLUDE: tuple[str, ...] = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
    "preprocessor_config.json",
    "*.bin",
    "*.pth",
    "*.pt",
    "*.bin.index.json",
)
"""Default include globs: safetensors + config + tokenizer (HF layout). `.bin`/`.pth`/`.pt` weights are
included here but dropped by `prefer_safetensors` in folders where a safetensors file is selected."""

LEGACY_WEIGHT_SUFFIXES = (".bin", ".pth", ".pt")
LEGACY_INDEX_SUFFIX = ".bin.index.json"
#: files that hold a checkpoint's weights in a format vLLM loads (`--load-format auto`: safetensors, else PyTorch)
WEIGHT_SUFFIXES = (".safetensors", *LEGACY_WEIGHT_SUFFIXES)
#: Meta's own checkpoint format beside the Hugging Face one in Meta's Hub repos (`original/consolidated.*.pth`,
#: params.json): the same weights again, which vLLM does not load
META_ORIGINAL_FOLDER = "original"


def weight_files(rel_paths: Iterable[str]) -> list[str]:
    """The paths among `rel_paths` that hold model weights (`WEIGHT_SUFFIXES`), sorted."""
    return sorted(p for p in rel_paths if p.endswith(WEIGHT_SUFFIXES))


class UnsafeKeyError(StagingError):
    """An object key would escape the destination folder."""


def relative_path(key: str, prefix: str) -> str:
    """Destination path (relative, POSIX) of `key` under `prefix`, refusing keys that could escape.

    Rejects: NUL bytes, backslashes, absolute paths, empty segments after the prefix, `.` and `..`
    segments, and the reserved marker name.

    Raises:
        UnsafeKeyError: naming the key and the reason.
    """
    if "\x00" in key:
        raise UnsafeKeyError(f"unsafe object key {key!r}: contains a NUL byte")
    if "\\" in key:
        raise UnsafeKeyError(f"unsafe object key {key!r}: contains a backslash")
    if not key.startswith(prefix):
        raise UnsafeKeyError(f"unsafe object key {key!r}: not under prefix {prefix!r}")
    rel = key[len(prefix):]
    if rel.startswith("/") or PurePosixPath(rel).is_absolute():
        raise UnsafeKeyError(f"unsafe object key {key!r}: absolute path after prefix")
    parts = rel.split("/")
    if not rel or any(p == "" for p in parts):
        raise UnsafeKeyError(f"unsafe object key {key!r}: empty path segment")
    if any(p in (".", "..") for p in parts):
        raise UnsafeKeyError(f"unsafe object key {key!r}: '.' or '..' segment escapes the destination")
    if (parts[-1].startswith(MARKER_NAME) or parts[0] == ".pdserve-journal"
            or any(p.endswith(".pdserve-part") for p in parts)):
        raise UnsafeKeyError(f"unsafe object key {key!r}: reserved name (the stager's marker, journal or "
                             "partial files)")
    return rel


def is_source_marker(key: str, prefix: str) -> bool:
    """True for the marker file at the root of the source (`key` == prefix + marker name): a folder
    pdserve staged earlier, used as a source or copied to S3 as it is (``aws s3 sync``). Its marker
    describes that earlier stage; the listing skips it and the new stage writes its own."""
    return key == prefix + MARKER_NAME


MAX_NAME_BYTES = 255  # NAME_MAX of Linux filesystems (ext4, xfs, Lustre)
PART_SUFFIX_BYTES = len(".pdserve-part")


def check_utf8(rel_paths: Sequence[str]) -> None:
    """Refuse paths that are not valid UTF-8 (a local file's name in another encoding, which Python
    holds with surrogate escapes): the manifest and the journal keep paths as UTF-8 text.

    Raises:
        StagingError: naming the first such path, repr-escaped (each undecodable byte shows as
            ``\\udcXX``).
    """
    for rel in rel_paths:
        try:
            rel.encode()
        except UnicodeEncodeError:
            raise StagingError(f"file name {rel!r} is not valid UTF-8; rename it or leave it out (--exclude)"
                               ) from None


def check_paths(rel_paths: Sequence[str]) -> None:
    """Refuse a selection the stager cannot write, before any byte is fetched.

    Raises:
        StagingError: a path that is not valid UTF-8 (`check_utf8`), a file name longer than
            ``MAX_NAME_BYTES - len(".pdserve-part")`` bytes (its partial file would exceed NAME_MAX), or
            a path that is both a file and a folder (keys ``a`` and ``a/b``); the message names the paths.
    """
    check_utf8(rel_paths)
    limit = MAX_NAME_BYTES - PART_SUFFIX_BYTES
    for rel in rel_paths:
        name = rel.rsplit("/", 1)[-1]
        if len(name.encode()) > limit:
            raise StagingError(f"file name of '{rel}' is {len(name.encode())} bytes; the stager writes it as "
                               f"'<name>.pdserve-part' first, so names are limited to {limit} bytes "
                               f"(NAME_MAX {MAX_NAME_BYTES})")
    files = set(rel_paths)
    for rel in rel_paths:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in files:
                raise StagingError(f"'{folder}' is both a file and a folder in the source (also '{rel}'); "
                                   "exclude one of them (--exclude)")


def _matches(rel: str, pattern: str) -> bool:
    # A pattern with "/" matches the whole relative path; otherwise the file name (like .gitignore).
    target = rel if "/" in pattern else rel.rsplit("/", 1)[-1]
    return fnmatchcase(target, pattern)


def select_paths(
    rel_paths: Iterable[str],
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    prefer_safetensors: bool = True,
) -> list[str]:
    """Filter relative paths by globs.

    Args:
        rel_paths: candidate paths relative to the model root.
        include: globs to keep (None → `DEFAULT_INCLUDE`; ["*"] keeps everything).
        exclude: globs to drop (applied after include).
        prefer_safetensors: in each folder that holds a selected `.safetensors` file, and in its subfolder
            `original` (Meta's own format of the same weights), drop the `.bin`/`.pth`/`.pt` weights and
            `*.bin.index.json` (duplicate PyTorch checkpoints of the same weights). PyTorch weights in other
            folders (a draft model, an adapter) are kept.

    Returns:
        The selected paths, sorted.
    """
    inc = DEFAULT_INCLUDE if include is None else tuple(include)
    chosen = [
        p
        for p in rel_paths
        if any(_matches(p, g) for g in inc) and not any(_matches(p, g) for g in exclude)
    ]
    if prefer_safetensors:
        with_st = {_folder(p) for p in chosen if p.endswith(".safetensors")}

        def duplicate(p: str) -> bool:
            folder = _folder(p)
            beside = folder in with_st or (PurePosixPath(folder).name == META_ORIGINAL_FOLDER
                                           and _folder(folder) in with_st)
            return beside and (p.endswith(LEGACY_WEIGHT_SUFFIXES) or p.endswith(LEGACY_INDEX_SUFFIX))

        chosen = [p for p in chosen if not duplicate(p)]
    return sorted(chosen)


def _folder(rel: str) -> str:
    return rel.rsplit("/", 1)[0] if "/" in rel else ""
