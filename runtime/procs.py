"""Stopping child processes through their own Popen handle (adapter; never by name), and turning
SIGTERM into SystemExit so an entry point's `with`/`finally` blocks stop what it started."""

from __future__ import annotations

import signal
import subprocess

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
