"""The other runtime replicas' load on each worker, read from the workers' own gauges (adapter).

Each runtime replica routes on its own in-flight counts (runtime.router.load). With several replicas in front
of the same workers, one replica does not see the requests the others sent, and balances on a partial view.
The engines see all of them: every `interval_s` this loop reads each decode-capable worker's `/metrics`
(vLLM `vllm:num_requests_running` + `vllm:num_requests_waiting`, runtime.engines.drain_wait.busy_requests)
and hands the count to the pairing (`RouterPairing.set_engine_load`), which counts what exceeds its own
requests as the other replicas' load. No exchange between replicas is needed, and a replica that dies
stops counting as soon as the engines finish its requests.

The view lags the engines by up to `interval_s` plus the read; a page that cannot be read within
`timeout_s` drops that worker's external share until the next read (never a stale one kept).

A worker with data parallelism (`pairing.dp_size_of(url)` > 1) is read per rank: vLLM labels each engine's
gauges with `engine` = its DP rank, and the router keeps one load entry per rank.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from runtime.engines.drain_wait import BUSY_GAUGES, busy_requests
from runtime.engines.metrics import readable_gauge, sample_sums_by

log = logging.getLogger(__name__)

#: Seconds between two reads of the workers' gauges: a second is short next to a decode stream (seconds to
#: minutes) and costs each worker one small page per second per replica.
DEFAULT_INTERVAL_S = 1.0


def _rank_requests(text: str, dp_size: int) -> dict[int, float | None]:
    """`{rank: requests}` of a data-parallel worker's engines (vLLM's gauges labelled `engine` = rank); a rank
    with an unreadable gauge maps to None."""
    by_gauge = [sample_sums_by(text, g, "engine") for g in BUSY_GAUGES]
    out: dict[int, float | None] = {}
    for r in range(dp_size):
        counts = [readable_gauge(by_engine.get(str(r), 0.0)) for by_engine in by_gauge]
        out[r] = None if None in counts else sum(counts)
    return out


async def read_engine_load(read_page: Callable[[str], Awaitable[str]], url: str, timeout_s: float,
                           dp_size: int = 1) -> float | dict[int, float | None] | None:
    """Requests the engine at `url` runs or queues, from its /metrics page; None when unreadable (no page within
    `timeout_s` seconds, not exposition text, a NaN, infinite or negative gauge). With `dp_size` > 1,
    `{rank: requests or None}` of its engines."""
    try:
        text = await asyncio.wait_for(read_page(url), timeout_s)
        if dp_size > 1:
            return _rank_requests(text, dp_size)
        count = busy_requests(text)
    except Exception as exc:  # noqa: BLE001 - any failure: no reading this round
        log.debug("engine load of %s unreadable: %s", url, exc)
        return None
    if count is None:
        log.debug("engine load of %s unreadable: a NaN, infinite or negative request gauge", url)
    return count


async def engine_load_loop(pairing, read_page: Callable[[str], Awaitable[str]], *,
                           interval_s: float = DEFAULT_INTERVAL_S, timeout_s: float = 2.0) -> None:
    """Forever: read every decode-capable worker's load (`pairing.decode_worker_urls()`) concurrently and
    pass it to `pairing.set_engine_load`; then sleep `interval_s` seconds. Cancel the task to stop.

    Nothing is restarted when this task ends, so a round that fails (an unexpected error from the pairing) is
    logged — once, until a round succeeds again — and the loop goes on with the next round.

    Raises:
        ValueError: `interval_s` or `timeout_s` not > 0.
    """
    if not (interval_s > 0 and timeout_s > 0):
        raise ValueError(f"interval_s={interval_s}, timeout_s={timeout_s}: expected seconds > 0")
    failing = False
    while True:
        try:
            urls = pairing.decode_worker_urls()
            dp_size_of = getattr(pairing, "dp_size_of", lambda url: 1)
            loads = await asyncio.gather(*(read_engine_load(read_page, u, timeout_s, dp_size_of(u)) for u in urls))
            for url, load in zip(urls, loads):
                pairing.set_engine_load(url, load)
            failing = False
        except Exception:  # noqa: BLE001 - one bad round must not end the other replicas' load view for good
            if not failing:
                log.exception("engine load round failed; retrying every %.1f s", interval_s)
            failing = True
        await asyncio.sleep(interval_s)
