"""Worker discovery feeding the runtime's router pool (adapter; issue #7 item 4).

`python -m runtime.server --discovery kubernetes --namespace NS --prefill-service P --decode-service D`
watches the EndpointSlices of the headless worker Services (runtime.deploy.discovery.EndpointSliceDiscovery)
and `follow_discovery` turns every membership change into `RouterPairing.add_worker`/`remove_worker`:
only addresses the discovery reports ever become routing targets. `--discovery static` (the default) uses
the `--prefill-url`/`--decode-url` flags as the whole pool.

Worker ids of discovered workers are `"<role>@<base URL>"`, so a pod that comes back at the same address
gets the same id (its old index entry was dropped when it left).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from runtime.deploy.discovery import PoolMembership
from runtime.server.routing import RouterPairing, WorkerEndpoint

log = logging.getLogger(__name__)

DISCOVERY_KINDS = ("static", "kubernetes")


def discovered_id(role: str, url: str) -> str:
    """Worker id of a discovered worker: `"<role>@<base URL>"`."""
    return f"{role}@{url.rstrip('/')}"


def apply_membership(pairing: RouterPairing, membership: PoolMembership) -> tuple[list[str], list[str]]:
    """Make the pairing's pool equal `membership` (prefill and decode base URLs).

    Workers that left are removed (their in-flight requests are then migrated or failed by the model);
    new ones are added with an empty KV index entry. A URL reported in both pools keeps its first role
    (prefill) and is logged.

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
    want_ids = {discovered_id(role, url): (role, url) for url, role in wanted.items()}
    removed = sorted(wid for wid in pairing.workers if wid not in want_ids)
    for wid in removed:
        pairing.remove_worker(wid)
    added = []
    for wid, (role, url) in sorted(want_ids.items()):
        if wid not in pairing.workers:
            pairing.add_worker(WorkerEndpoint(wid, role, url))
            added.append(wid)
    if added or removed:
        log.info("discovery: pool now %d prefill, %d decode (added %s, removed %s)", len(membership.prefill),
                 len(membership.decode), added, removed)
    return added, removed


async def follow_discovery(discovery, pairing: RouterPairing,
                           on_change: Callable[[PoolMembership], None] | None = None) -> None:
    """Apply every membership `discovery.updates()` yields to `pairing` (runs until the updates end or the
    task is cancelled). `on_change` is called after each applied membership (tests, metrics)."""
    async for membership in discovery.updates():
        apply_membership(pairing, membership)
        if on_change is not None:
            on_change(membership)
