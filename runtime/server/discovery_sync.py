"""Worker discovery feeding the runtime's router pool (adapter).

`python -m runtime.server --discovery kubernetes --namespace NS --prefill-service P --decode-service D`
watches the EndpointSlices of the headless worker Services (runtime.deploy.discovery.EndpointSliceDiscovery)
and `follow_discovery` turns every membership change into `RouterPairing.add_worker`/`remove_worker`:
only addresses the discovery reports ever become routing targets. `--discovery static` (the default) uses
the `--prefill-url`/`--decode-url` flags as the whole pool.

With a KV-event subscriber (the runtime runs `--router kv`), each discovered worker whose EndpointSlice
carries a KV-event port (`PoolMembership.kv_events`) is added as a KV-event worker and subscribed to
(`KvEventSubscriber.add`); a worker that leaves is unsubscribed before it leaves the pool (and the router's
index), so no late event re-adds its blocks. Workers without an endpoint, or without a subscriber, are
tracked approximately (the router learns their caches from its own decisions). A worker with data
parallelism (`PoolMembership.dp_size` > 1) joins as one router entry per DP rank, each subscribed to its
rank's publisher (`WorkerEndpoint.kv_event_subscriptions`: the endpoint's port + r, or, for a multi-node
worker, the rank's endpoint on the pod that runs it, `PoolMembership.rank_endpoints`).

Worker ids of discovered workers are `"<role>-<12 hex digits of sha256(base URL)>"`: a pod that comes back at
the same address gets the same id (its old index entry was dropped when it left), and the id, which reaches
response headers, logs and metrics, names no address (the membership log line maps ids to addresses).

The runtime runs discovery under `supervise_discovery`: if `follow_discovery` dies (an exception out of the
discovery's updates or out of applying a membership), the error is logged with its traceback and discovery
starts again after a back-off. Restarting is safe: a fresh `updates()` lists the whole membership again and
`apply_membership` makes the pool equal to it, so whatever changed meanwhile is reconciled.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from runtime.deploy.discovery import PoolMembership
from runtime.redact import redact_userinfo
from runtime.server.routing import RouterPairing, WorkerEndpoint

log = logging.getLogger(__name__)

DISCOVERY_KINDS = ("static", "kubernetes")


class EventSubscriptions(Protocol):
    """What apply_membership needs of runtime.engines.kv_events.KvEventSubscriber."""

    def add(self, worker_id: str, endpoint: str) -> bool: ...

    def remove(self, worker_id: str) -> bool: ...


def discovered_id(role: str, url: str) -> str:
    """Worker id of a discovered worker: `"<role>@<first 12 hex digits of sha256(base URL)>"`. It names no
    address in logs; the "@" marks it as not a configured name, so response headers show it only keyed
    (runtime.server.model.public_worker_id), since an unkeyed hash of a pod IP can be reversed by trying the
    pod network's addresses."""
    return f"{role}@{hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:12]}"


def apply_membership(pairing: RouterPairing, membership: PoolMembership, *,
                     subscriber: EventSubscriptions | None = None) -> tuple[list[str], list[str]]:
    """Make the pairing's pool equal `membership` (prefill and decode base URLs).

    Workers that left are removed (their in-flight requests run on where they are: a stream whose worker
    is gone fails and migrates in the model; a worker that comes back under its id takes their load back,
    runtime.router.core.Router.add_worker); new ones are added with an empty KV index entry. A URL reported in both pools keeps its first role
    (prefill) and is logged. With `subscriber`, a new worker with a KV-event endpoint in `membership` is
    subscribed to and routed precisely, every DP rank on its own port (`PoolMembership.dp_size`) or at its
    own endpoint (`PoolMembership.rank_endpoints`); a removed one is unsubscribed first; a worker whose
    endpoint, rank endpoints or DP size changed (appeared, moved, vanished) is removed and added again (empty
    index entry). An endpoint ZMQ refuses (malformed) is logged and its worker tracked approximately until
    the next membership.

    Returns:
        (added worker ids, removed worker ids), each sorted.
    """
    wanted: dict[str, str] = {}
    for role, urls in (("prefill", membership.prefill), ("decode", membership.decode)):
        for url in urls:
            url = url.rstrip("/")
            if url in wanted:
                log.warning("discovery: %s is in both pools; kept as %s", url, wanted[url])
                continue
            wanted[url] = role
    want: dict[str, WorkerEndpoint] = {}
    for url, role in wanted.items():
        ep = membership.kv_events_endpoint(url) if subscriber is not None else None
        wid = discovered_id(role, url)
        ranks = membership.rank_endpoints(url) if subscriber is not None else ()
        want[wid] = WorkerEndpoint(wid, role, url, ep, dp_size=membership.dp_size(url), rank_endpoints=ranks)
    removed = sorted(wid for wid, w in pairing.workers.items()
                     if wid not in want or w.dp_size != want[wid].dp_size
                     or (subscriber is not None and (w.kv_events_endpoint, w.rank_endpoints)
                         != (want[wid].kv_events_endpoint, want[wid].rank_endpoints)))
    for wid in removed:
        if subscriber is not None:
            for sid in pairing.workers[wid].rank_ids():
                subscriber.remove(sid)
        pairing.remove_worker(wid)
    added = []
    for wid, w in sorted(want.items()):
        if wid in pairing.workers:
            continue
        if subscriber is not None and w.publishes_kv_events():
            w = _subscribe(subscriber, w)
        pairing.add_worker(w)
        log.info("discovery: worker %s is %s%s", wid, redact_userinfo(w.url),
                 f" ({w.dp_size} data-parallel ranks)" if w.dp_size > 1 else "")
        added.append(wid)
    if added or removed:
        log.info("discovery: pool now %d prefill, %d decode (added %s, removed %s)", len(membership.prefill),
                 len(membership.decode), added, removed)
    return added, removed


def _subscribe(subscriber: EventSubscriptions, w: WorkerEndpoint) -> WorkerEndpoint:
    """Subscribe to the KV events of every DP rank of `w`; `w` as given, or, when an endpoint is refused
    (logged; the ranks subscribed already are unsubscribed again), `w` without its endpoint (tracked
    approximately)."""
    done: list[str] = []
    try:
        for sid, ep in w.kv_event_subscriptions().items():
            subscriber.add(sid, ep)
            done.append(sid)
    except ValueError as exc:
        log.warning("discovery: %s; its cache is tracked approximately", exc)
        for sid in done:
            subscriber.remove(sid)
        return WorkerEndpoint(w.worker_id, w.role, w.url, None, dp_size=w.dp_size)  # no rank_endpoints either
    return w


async def follow_discovery(discovery, pairing: RouterPairing,
                           on_change: Callable[[PoolMembership], None] | None = None, *,
                           subscriber: EventSubscriptions | None = None) -> None:
    """Apply every membership `discovery.updates()` yields to `pairing` (runs until the updates end or the
    task is cancelled), subscribing to discovered KV-event endpoints through `subscriber` when given (see
    apply_membership). `on_change` is called after each applied membership (tests, metrics)."""
    async for membership in discovery.updates():
        apply_membership(pairing, membership, subscriber=subscriber)
        if on_change is not None:
            on_change(membership)


async def supervise_discovery(discovery, pairing: RouterPairing,
                              on_change: Callable[[PoolMembership], None] | None = None, *,
                              subscriber: EventSubscriptions | None = None, retry_s: float = 1.0,
                              max_retry_s: float = 30.0,
                              sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                              clock: Callable[[], float] = time.monotonic) -> None:
    """`follow_discovery`, started again whenever it dies; returns when the updates end (static discovery).

    An exception out of `follow_discovery` is logged at ERROR with its traceback, then discovery restarts
    after `retry_s` seconds, doubling per failure in a row up to `max_retry_s`; a run that lasted at least
    `max_retry_s` seconds (by `clock`, seconds) counts as healthy and resets the wait. Cancel the task to
    stop (cancellation is never retried).
    """
    delay = retry_s
    while True:
        started_s = clock()
        try:
            await follow_discovery(discovery, pairing, on_change, subscriber=subscriber)
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            if clock() - started_s >= max_retry_s:
                delay = retry_s
            log.error("discovery died; the worker pool is frozen until it restarts in %.1f s", delay,
                      exc_info=True)
        await sleep(delay)
        delay = min(delay * 2, max_retry_s)
