"""pytest plug-in: a run stopped with SIGTERM (a CI step's timeout, `timeout(1)`) tears its fixtures down as
Ctrl-C does. The servers session fixtures start (vLLM workers, S3, MLflow) run in sessions of their own, so a
pytest that died on the signal's default action would leave them running, holding gigabytes and ports."""

from __future__ import annotations

import signal
import threading


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's Config
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
