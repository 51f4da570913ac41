"""Atomic publication of a staged folder, the stager lock, and free-space checking.

Layout beside the destination ``<parent>/<name>`` (same filesystem, so renames are atomic):

    <parent>/.<name>.pdserve-staging/   files being fetched and verified (resumable)
    <parent>/.<name>.pdserve-lock       fcntl lock file: one stager per model at a time
    <parent>/.<name>.pdserve-old        previous version during a non-atomic swap

Publishing: the marker is written (fsynced) inside the staging folder, then the folder replaces the
destination with one `renameat2(RENAME_EXCHANGE)` when the C library has it (Linux ≥ 3.15, glibc ≥
2.28; Lustre supports it), else two renames (dest → old, staging → dest). Either way the
destination path only ever names a folder with a valid marker (or, for an instant between the two
renames, nothing). A run that died between the renames is repaired by `recover`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import shutil
import time
from pathlib import Path

from runtime.staging.manifest import StagingError, fsync_path, read_marker

log = logging.getLogger(__name__)

RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100


def sibling(dest: Path, tag: str) -> Path:
    """``<parent>/.<name>.pdserve-<tag>`` beside `dest`."""
    return dest.parent / f".{dest.name}.pdserve-{tag}"


class StageLock:
    """Exclusive `fcntl.flock` on ``.<name>.pdserve-lock``; waits up to `timeout_s`.

    Raises (on enter):
        StagingError: another stager holds the lock longer than `timeout_s`.
    """

    def __init__(self, dest: Path, timeout_s: float = 600.0, poll_s: float = 0.1) -> None:
        self.path = sibling(dest, "lock")
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._fd = -1

    def __enter__(self) -> "StageLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if not waited:
                    waited = True
                    log.warning("another stager is writing %s (lock %s); waiting up to %.0f s",
                                self.path.parent / self.path.name[1:-len(".pdserve-lock")], self.path, self.timeout_s)
                if time.monotonic() >= deadline:
                    os.close(self._fd)
                    raise StagingError(
                        f"{self.path}: another stager holds the lock (waited {self.timeout_s:.0f} s)"
                    ) from None
                time.sleep(self.poll_s)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False when the syscall is unavailable/unsupported."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def publish(staging: Path, dest: Path) -> None:
    """Make `staging` (which must hold a valid marker) the folder at `dest`; removes the old one.

    Raises:
        StagingError: `staging` has no valid marker.
    """
    read_marker(staging)  # refuse to publish anything unmarked
    old = sibling(dest, "old")
    if old.exists():
        shutil.rmtree(old)
    if dest.exists():
        if _renameat2_exchange(staging, dest):
            fsync_path(dest.parent)
            shutil.rmtree(staging)  # now holds the previous version
            return
        os.rename(dest, old)
        os.rename(staging, dest)
        fsync_path(dest.parent)
        shutil.rmtree(old)
    else:
        os.rename(staging, dest)
        fsync_path(dest.parent)


def recover(dest: Path) -> None:
    """Repair a run killed between the two publish renames: put the previous version back."""
    old = sibling(dest, "old")
    if old.exists():
        if not dest.exists():
            try:
                read_marker(old)
                os.rename(old, dest)
                fsync_path(dest.parent)
                return
            except StagingError:
                pass
        shutil.rmtree(old)


def check_free_space(folder: Path, need_bytes: int, margin_bytes: int) -> None:
    """Raise StagingError when `folder`'s filesystem has less than need + margin bytes free."""
    free = shutil.disk_usage(folder).free
    if need_bytes + margin_bytes > free:
        raise StagingError(
            f"{folder}: not enough free space: need {need_bytes} bytes (+{margin_bytes} margin), "
            f"{free} bytes free"
        )
