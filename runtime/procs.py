"""Stopping child processes through their own Popen handle (adapter; never by name)."""

from __future__ import annotations

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
