"""Stopping child processes through their own Popen handle (adapter; never by name), and turning
SIGTERM into SystemExit so an entry point's `with`/`finally` blocks stop what it started."""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# After SIGKILL the kernel still has to tear the process down (free its memory, close its files): wait at
# least this long, whatever the caller's grace period, before calling it a survivor.
KILL_WAIT_S = 5.0


def stop_process(proc: subprocess.Popen | None, timeout_s: float) -> int | None:
    """Terminate `proc`, wait up to `timeout_s` seconds, then kill and wait again; return its exit code.

    `timeout_s` is the grace period after SIGTERM (0 or less: kill at once if it has not exited). The wait
    after SIGKILL is `max(timeout_s, KILL_WAIT_S)` seconds. Returns None when `proc` is None. Safe on a
    process that already exited.

    Raises:
        subprocess.TimeoutExpired: the process survived SIGKILL for that long (uninterruptible sleep).
    """
    if proc is None:
        return None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=max(timeout_s, KILL_WAIT_S))
    return proc.returncode


def _group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group `pgid`, read from /proc (Linux); where /proc
    cannot be read, [pgid] while the group still exists (os.killpg signal 0) and [] once it does not."""
    try:
        names = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(name))
    return members


def stop_group(pgid: int, timeout_s: float) -> bool:
    """Stop every process of process group `pgid` (a child started with `start_new_session=True` leads its
    own group, pgid = its pid): SIGTERM to the group, wait up to `timeout_s` seconds for it to empty, then
    SIGKILL and wait up to `KILL_WAIT_S`. A group is addressed by its id only, never by process names.

    Returns True when no live process is left in the group (zombies, waiting for their parent to reap
    them, count as gone: they hold no CPU or memory)."""
    for sig, wait_s in ((signal.SIGTERM, max(timeout_s, 0.0)), (signal.SIGKILL, max(timeout_s, KILL_WAIT_S))):
        if not _group_members(pgid):
            return True
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True
        except PermissionError:  # the group holds someone else's process: not ours to stop
            return False
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _group_members(pgid):
                return True
            time.sleep(0.1)
    return not _group_members(pgid)


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM handler: raise SystemExit(128 + SIGTERM) in the main thread, like Ctrl-C raises
    KeyboardInterrupt, so every `with`/`finally` runs and stops the processes the command started
    (vLLM workers, the runtime, SeaweedFS, a benchmark's servers) through their handles. The default
    action would kill this process at once and leave them running, re-parented to PID 1. A later
    SIGTERM is ignored so it cannot cut that cleanup short (each stop is bounded: terminate, wait,
    kill)."""
    signal.signal(signal.SIGTERM, _ignore_signal)
    raise SystemExit(128 + signum)


def _ignore_signal(signum: int, frame: object) -> None:
    """A no-op handler (unlike SIG_IGN it is not inherited by processes started afterwards)."""


def install_sigterm_handler() -> object:
    """Make SIGTERM stop the current command (a `pdserve` command, a bench script) cleanly (see
    `_stop_on_sigterm`); return the previous handler.

    No-op (returns None) outside the main thread, where Python cannot set signal handlers."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _stop_on_sigterm)


@contextlib.contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore the previous values."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: Longest Unix socket path ZMQ accepts (runtime.engines.vllm_worker.MAX_IPC_PATH_BYTES, not imported: it pulls
#: in the engine modules) and the name vLLM gives an IPC socket in the temp folder (``/`` + a uuid4).
_MAX_IPC_PATH_BYTES, _IPC_NAME_BYTES = 107, 37


def _torch_cache_dir() -> str:
    """torch's default TorchInductor cache folder (torch._inductor.runtime.cache_dir_utils.default_cache_dir,
    not imported: it imports torch) in the current temp folder."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


@contextlib.contextmanager
def temp_folder(tmp: Path, prefix: str = "pdserve-tmp-") -> Iterator[Path]:
    """Within the block, the temp folder (``TMPDIR``, and ``tempfile``'s cached one) of this process and of every
    process it starts is ``tmp``, emptied first (what a killed run left) and removed at the end; yields it.

    Where ``tmp`` is too long a path for a vLLM IPC socket in it (a Unix socket path is at most 107 bytes), a
    fresh folder named ``prefix...`` in the system temp folder stands in (removed at the end as well) and ``tmp``
    is left untouched.
    TorchInductor's compile cache stays where torch keeps it without this (``$TORCHINDUCTOR_CACHE_DIR``, else
    ``torchinductor_<user>`` in the system temp folder): a cache kept warm across runs, not a leftover.
    """
    if len(os.fsencode(tmp)) + _IPC_NAME_BYTES <= _MAX_IPC_PATH_BYTES:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    else:  # ``tmp`` is left as it is: it is not used
        tmp = Path(tempfile.mkdtemp(prefix=prefix))
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or _torch_cache_dir()
    before = tempfile.tempdir
    try:
        with scoped_env({"TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": inductor}):
            tempfile.tempdir = str(tmp)  # this process: tempfile caches the folder it found first
            try:
                yield tmp
            finally:
                tempfile.tempdir = before
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
