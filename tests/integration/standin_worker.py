"""A real lightweight stand-in for a vLLM worker process (`python -m http.server` on 127.0.0.1) with the
interface of runtime.engines.vllm_worker.WorkerProcess, for actuator tests that start and stop processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx

from runtime.procs import stop_process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TinyWorker:
    """A real lightweight worker process (python -m http.server) with WorkerProcess's interface."""

    def __init__(self, role: str, index: int) -> None:
        self.role, self.index, self.port = role, index, _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "TinyWorker":
        self.proc = subprocess.Popen([sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 30.0, poll_interval_s: float = 0.05) -> None:
        deadline = time.monotonic() + timeout_s
        while True:  # at least one try: timeout_s=0 is a single readiness probe (the local actuator's)
            try:
                if httpx.get(self.base_url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.role} worker {self.base_url} not ready")
            time.sleep(poll_interval_s)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        proc, self.proc = self.proc, None
        return stop_process(proc, timeout_s)
