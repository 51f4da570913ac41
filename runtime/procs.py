"""Stopping child processes through their own Popen handle (adapter; never by name)."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen | None, timeout_s: float) -> int | None:
    """Terminate `proc`, wait up to `timeout_s`, then kill and wait again; return its exit code.

    Returns None when `proc` is None. Safe on a process that already exited.

    Raises:
        subprocess.TimeoutExpired: the process survived SIGKILL for `timeout_s` (uninterruptible sleep).
    """
    if proc is None:
        return None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    return proc.returncode
