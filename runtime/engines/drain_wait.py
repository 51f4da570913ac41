"""A worker pod's preStop drain: wait until its vLLM engine holds no work, at most a cap (adapter).

    python -m runtime.engines.drain_wait --port 8000 --hold-s 30 --cap-s 120

Kubernetes runs a container's preStop hook before it sends SIGTERM, and the pod has left its Service's
EndpointSlices by then, so the runtime's discovery has taken it out of the router's pool: no new request
reaches it. The hook returns when the engine's `/metrics` has shown no running and no waiting request
(`vllm:num_requests_running` + `vllm:num_requests_waiting`) for `hold_s` seconds in a row, or after `cap_s`
seconds whatever it holds (streams still running then fail over to another decode worker: the runtime's
migration). A prefill worker's KV handoffs are not requests in vLLM's gauges: it keeps a handoff's blocks
for its KV lease after the request finished, so a prefill pod holds for the lease (`hold_s` =
`EngineSpec.kv_lease_s`, vLLM's 30 s by default) and every handoff is read or expired before it stops.
An unreadable page counts as busy (the engine may still be serving) until the cap.

`terminationGracePeriodSeconds` must exceed the cap plus vLLM's own shutdown (runtime/deploy/workers.py).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from runtime.engines.metrics import readable_gauge, sample_sum

BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def busy_requests(metrics_text: str) -> float | None:
    """Requests a vLLM engine is running or queueing, from its /metrics page (Prometheus text); None when a
    gauge reads NaN, infinite or negative (unreadable: the engine may hold requests).

    Raises:
        ValueError: `metrics_text` is not Prometheus exposition format.
    """
    counts = [readable_gauge(sample_sum(metrics_text, g)) for g in BUSY_GAUGES]
    return None if None in counts else sum(counts)


def wait_drained(read_busy: Callable[[], float | None], *, hold_s: float, cap_s: float, poll_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> bool:
    """Poll `read_busy` (requests in the engine; None, NaN, infinite or negative: unreadable, so busy) every
    `poll_s` seconds until it has read 0 for `hold_s` seconds in a row (True), or `cap_s` seconds have passed
    (False).

    Raises:
        ValueError: a negative `hold_s` or `cap_s`, or `poll_s` <= 0.
    """
    if hold_s < 0 or cap_s < 0 or poll_s <= 0:
        raise ValueError(f"hold_s={hold_s}, cap_s={cap_s} must be >= 0 and poll_s={poll_s} > 0")
    start = clock()
    idle_since: float | None = None
    while True:
        now = clock()
        busy = read_busy()
        if busy is None or readable_gauge(busy) is None or busy > 0:  # NaN > 0 is False: not idle either
            idle_since = None
        elif idle_since is None:
            idle_since = now
        if idle_since is not None and now - idle_since >= hold_s:
            return True
        if now - start >= cap_s:
            return False
        sleep(min(poll_s, max(cap_s - (now - start), 0.0)) or poll_s)


def main(argv: list[str] | None = None) -> int:
    """The preStop command; exits 0 either way (a hook that fails would only be logged as an event)."""
    import httpx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True, help="the worker's HTTP port on 127.0.0.1")
    ap.add_argument("--hold-s", type=float, required=True, help="seconds of no request before it is drained")
    ap.add_argument("--cap-s", type=float, required=True, help="longest wait, seconds")
    args = ap.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}/metrics"

    def read() -> float | None:
        try:
            r = httpx.get(url, timeout=2.0)
            return busy_requests(r.text) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):  # ValueError: not exposition text; unreadable, so busy
            return None

    drained = wait_drained(read, hold_s=args.hold_s, cap_s=args.cap_s)
    print("drained" if drained else f"drain cap of {args.cap_s:.0f} s reached", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
