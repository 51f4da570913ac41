"""Recorded traffic: one JSON line per finished request, the input of scheduled re-tuning (adapter: file I/O).

Each line is a Mooncake-style trace record (FAST'25 trace format, github.com/kvcache-ai/Mooncake):
``{"timestamp": <Unix epoch ms>, "input_length": <prompt tokens>, "output_length": <completion tokens>,
"hash_ids": []}``; ``pdserve tune --trace`` (runtime.tracking.traces) and the re-tuning CronWorkflow
(runtime.batch.workflows) read it. The lengths come from the workers' ``usage``; nothing the client sent
(no prompt text, no model or user field) is written. ``hash_ids`` is empty: the runtime does not record
which prefixes a request shared (a replay that needs prefix reuse must take it from elsewhere). Timestamps are
absolute (epoch ms), so files of several runtimes or restarts can be concatenated; a replay subtracts the first.

A write that fails (disk full, file removed) is logged once and the request is unaffected.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class TrafficLog:
    """Append one trace line per finished request to ``path`` (parent folders created; an existing file is
    appended to, never truncated).

    Args:
        path: the JSONL file.
        wall_clock: seconds since the Unix epoch (injected for tests).

    Raises:
        OSError: the file cannot be opened for appending (at construction, so a bad path fails start-up).
    """

    def __init__(self, path: Path, wall_clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        self._clock = wall_clock
        self._lock = threading.Lock()
        self._warned = False
        self.lines = 0

    def record(self, input_tokens: int, output_tokens: int) -> None:
        """Write one finished request (token counts; negative values are written as 0)."""
        line = json.dumps({"timestamp": int(self._clock() * 1000), "input_length": max(0, int(input_tokens)),
                           "output_length": max(0, int(output_tokens)), "hash_ids": []}, separators=(",", ":"))
        with self._lock:
            try:
                self._f.write(line + "\n")
                self._f.flush()
                self.lines += 1
            except (OSError, ValueError) as e:  # ValueError: the file was closed
                if not self._warned:
                    self._warned = True
                    log.warning("traffic log %s: cannot write (%s); requests are served but not recorded",
                                self.path, e)

    def close(self) -> None:
        with self._lock:
            self._f.close()
