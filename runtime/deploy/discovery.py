"""Worker discovery for the runtime: static URLs (local) or the EndpointSlices of the worker Services.

`EndpointSliceDiscovery.updates()` lists the EndpointSlices of the prefill and decode headless Services
(label `kubernetes.io/service-name`), yields the pool membership, then watches and yields a new
membership whenever it changes. A watch that ends is resumed from the last resourceVersion; `410 Gone`
(expired resourceVersion) triggers a fresh list — the list-then-watch protocol of
kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes. An endpoint counts
while `conditions.ready` is not false (a missing value means ready, per the EndpointSlice API).

Nothing the API server (or a proxy in front of it) answers ends the updates: HTTP errors, malformed list
bodies or watch lines (not JSON, not an object, a slice without `metadata.name`) are logged as warnings,
then discovery waits and lists again. Waits double from `retry_s` up to `max_retry_s` and are also taken
after a second `410 Gone` in a row and after a watch that ends without a single event, so a misbehaving
API server is never polled in a tight loop; the wait goes back to `retry_s` once a watch delivers an event.

Besides the base URL (`http://<pod IP>:<port "http">`) the membership carries, per worker URL, the ZMQ
endpoint of its vLLM KV-event publisher, `tcp://<pod IP>:<port "kv-events">`, read from the same
EndpointSlice (the worker Services of runtime/deploy/workers.py expose that named port). A slice without
the port gives its workers no endpoint: the router then tracks their caches approximately. A worker with
data parallelism (vLLM `--data-parallel-size N`) publishes rank r's events on that port + r; its Service
names those ports too (`kv_events_port_name`: "kv-events-1" … "kv-events-<N-1>"), and the number of
consecutive rank ports from rank 0 is the worker's DP size (`PoolMembership.dp_size`).

A multi-node worker with data parallelism (a LeaderWorkerSet group, runtime/deploy/workers.py) runs its ranks on
several pods: vLLM serves HTTP on the leader only, whose API server takes every rank's `X-data-parallel-rank`,
while each rank's engine publishes on the pod that runs it, at the port + its global rank. Its pool's Service
lists the leaders (HTTP) and no KV-event port; a second headless Service over every pod of the pool
(`kv_events_service_name`) names the KV-event ports of all ranks ("kv-events" … "kv-events-<N-1>", each pod
listed with all of them) and carries the ranks each pod runs as its label `RANKS_PER_POD_LABEL` (L; the
EndpointSlice controller copies a Service's labels onto its slices). The pods of a group are named by the
LeaderWorkerSet controller: the leader `<group>`, the pod of node n `<group>-<n>`; rank r runs on node r // L.
So discovery pairs each ready leader with its pod in that Service (same address), and rank r's endpoint is
`tcp://<IP of pod <group>[-<r // L>]>:<port "kv-events-<r>">` (`PoolMembership.rank_endpoints`); a rank whose
pod is not listed (not ready), or whose pod is unknown (a slice without the label: every rank but 0), has none
and is tracked approximately.

Talks HTTP with an injected `httpx.AsyncClient` (tests use `httpx.MockTransport`); `in_cluster()`
builds one from the pod's service-account token (re-read on every request: bound tokens rotate) and CA.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Mapping

import httpx

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_LABEL = "kubernetes.io/service-name"


KV_EVENTS_PORT_NAME = "kv-events"  # = the worker Services' port name (runtime/deploy/workers.py)
#: label of a pool's KV-event Service (`kv_events_service_name`), copied onto its EndpointSlices: the
#: data-parallel ranks each pod of a multi-node worker runs (vLLM --data-parallel-size-local)
RANKS_PER_POD_LABEL = "pdserve.io/dp-ranks-per-pod"


def kv_events_service_name(service: str) -> str:
    """Name of the headless Service over every pod (leaders and followers) of the multi-node pool whose worker
    Service is `service`: it lists each pod with the KV-event ports of all data-parallel ranks. Discovery
    watches it beside `service` (no such Service: no slices, nothing changes)."""
    return f"{service}-kv-events"


def kv_events_port_name(rank: int, base: str = KV_EVENTS_PORT_NAME) -> str:
    """Name of the worker port of data-parallel rank `rank`'s KV-event publisher: `base` for rank 0 (a worker
    without data parallelism has only that one), `<base>-<rank>` for the others."""
    return base if rank == 0 else f"{base}-{rank}"


@dataclass(frozen=True)
class PoolMembership:
    """Ready workers of the two pools.

    Attributes:
        prefill, decode: base URLs (`http://ip:port`, sorted) of the ready prefill and decode workers.
        kv_events: `(worker URL, "tcp://ip:port")` pairs, sorted by URL: the ZMQ KV-event endpoint of each
            worker whose EndpointSlice has the KV-event port (of its DP rank 0); workers without one are absent.
        dp_sizes: `(worker URL, N)` pairs, sorted by URL, of the workers with N > 1 data-parallel ranks (the
            KV-event ports of ranks 0 … N-1 in their EndpointSlice); the others have one.
        rank_kv_events: `(worker URL, (endpoint of rank 0, …, of rank N-1))` pairs, sorted by URL, of the
            multi-node workers listed in their pool's KV-event Service (`kv_events_service_name`): each rank's
            `tcp://ip:port` on the pod that runs it, None for a rank whose pod is not listed. Their
            `kv_events` entry is rank 0's endpoint (when it has one).
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    kv_events: tuple[tuple[str, str], ...] = ()
    dp_sizes: tuple[tuple[str, int], ...] = ()
    rank_kv_events: tuple[tuple[str, tuple[str | None, ...]], ...] = ()

    def kv_events_endpoint(self, url: str) -> str | None:
        """The KV-event endpoint of the worker at base URL `url` (trailing "/" ignored), or None."""
        url = url.rstrip("/")
        return next((ep for u, ep in self.kv_events if u.rstrip("/") == url), None)

    def dp_size(self, url: str) -> int:
        """Data-parallel ranks of the worker at base URL `url` (trailing "/" ignored): 1 unless listed."""
        url = url.rstrip("/")
        return next((n for u, n in self.dp_sizes if u.rstrip("/") == url), 1)

    def rank_endpoints(self, url: str) -> tuple[str | None, ...]:
        """The KV-event endpoint of each DP rank (`rank_kv_events`) of the worker at base URL `url` (trailing
        "/" ignored), `dp_size` long; () for a worker whose ranks publish at its endpoint's port + rank."""
        url = url.rstrip("/")
        return next((eps for u, eps in self.rank_kv_events if u.rstrip("/") == url), ())


def _port(slice_: dict[str, Any], name: str | None) -> int | None:
    if name is None:
        return None
    return next((p.get("port") for p in slice_.get("ports") or [] if p.get("name") == name), None)


def _num_ranks(slice_: dict[str, Any], name: str | None) -> int:
    """KV-event ports of consecutive DP ranks from rank 0 (`kv_events_port_name`) the slice names."""
    n = 0
    while name is not None and _port(slice_, kv_events_port_name(n, name)) is not None:
        n += 1
    return n


@dataclass(frozen=True)
class _RankPod:
    """One ready pod of a pool's KV-event Service: its host (bracketed IPv6), the KV-event port of each
    rank the Service names, and the ranks per pod its slice's label gives (None: unlabelled)."""

    host: str
    ports: tuple[int | None, ...]
    ranks_per_pod: int | None


def _ranks_per_pod(slice_: dict[str, Any]) -> int | None:
    raw = (slice_.get("metadata", {}).get("labels") or {}).get(RANKS_PER_POD_LABEL)
    return int(raw) if isinstance(raw, str) and raw.isdigit() and int(raw) > 0 else None


def _rank_endpoints(leader: str, pods: Mapping[str, _RankPod]) -> tuple[str | None, ...]:
    """Each rank's endpoint of the worker whose leader pod is named `leader` (see the module docstring)."""
    head = pods[leader]
    # without the label the pod of a rank past 0 is unknown: such ranks get no endpoint (tracked approximately)
    # rather than one on the leader, where nothing publishes them
    per_pod = head.ranks_per_pod
    out: list[str | None] = []
    for r in range(len(head.ports)):
        if per_pod is None and r > 0:
            out.append(None)
            continue
        pod = pods.get(leader if per_pod is None or r < per_pod else f"{leader}-{r // per_pod}")
        port = pod.ports[r] if pod is not None and r < len(pod.ports) else None
        out.append(None if port is None else f"tcp://{pod.host}:{port}")
    return tuple(out)


def membership_from_slices(slices: Iterable[dict[str, Any]], *, roles: dict[str, str],
                           port_name: str = "http",
                           kv_events_port_name: str | None = KV_EVENTS_PORT_NAME) -> PoolMembership:
    """Pure: pool membership from EndpointSlice objects.

    Args:
        slices: EndpointSlice dicts (discovery.k8s.io/v1), of the `roles` Services and of their KV-event
            Services (`kv_events_service_name`; their endpoints' `targetRef.name` is the pod's name).
        roles: Service name → "prefill" | "decode".
        port_name: the Service port whose number is used in the URL.
        kv_events_port_name: the Service port of the workers' ZMQ KV-event publisher; its number gives
            each worker's `tcp://ip:port` endpoint, and the ports of its further DP ranks (`<name>-<r>`) its
            DP size (None: report no endpoints and DP size 1). A worker whose pod is also in its pool's
            KV-event Service takes its DP size and every rank's endpoint from there (`rank_kv_events`).
    """
    pools: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    events: dict[str, str] = {}
    dp_sizes: dict[str, int] = {}
    hosts: dict[str, tuple[str, str]] = {}  # worker URL -> (role, host)
    rank_services = {} if kv_events_port_name is None else {kv_events_service_name(s): r for s, r in roles.items()}
    # role -> pod name -> _RankPod, and role -> host -> pod name, of the KV-event Services' ready pods
    rank_pods: dict[str, dict[str, _RankPod]] = {"prefill": {}, "decode": {}}
    pod_at: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    for s in slices:
        service = s.get("metadata", {}).get("labels", {}).get(SERVICE_LABEL, "")
        if service in rank_services and service not in roles:
            _collect_rank_pods(s, kv_events_port_name, rank_pods[rank_services[service]],
                               pod_at[rank_services[service]])
            continue
        role = roles.get(service)
        if role is None:
            continue
        port = _port(s, port_name)
        if port is None:
            continue
        ev_port = _port(s, kv_events_port_name)
        num_ranks = _num_ranks(s, kv_events_port_name)
        v6 = s.get("addressType") == "IPv6"
        for ep in s.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            for addr in ep.get("addresses") or []:
                host = f"[{addr}]" if v6 else addr
                url = f"http://{host}:{port}"
                pools[role].add(url)
                hosts[url] = (role, host)
                if ev_port is not None:
                    events[url] = f"tcp://{host}:{ev_port}"
                if num_ranks > 1:
                    dp_sizes[url] = num_ranks
    rank_events: dict[str, tuple[str | None, ...]] = {}
    for url, (role, host) in hosts.items():
        leader = pod_at[role].get(host)
        if leader is None or not rank_pods[role][leader].ports:
            continue
        eps = rank_events[url] = _rank_endpoints(leader, rank_pods[role])
        if eps[0] is not None:
            events[url] = eps[0]
        if len(eps) > 1:
            dp_sizes[url] = len(eps)
    return PoolMembership(prefill=tuple(sorted(pools["prefill"])), decode=tuple(sorted(pools["decode"])),
                          kv_events=tuple(sorted(events.items())), dp_sizes=tuple(sorted(dp_sizes.items())),
                          rank_kv_events=tuple(sorted(rank_events.items())))


def _collect_rank_pods(slice_: dict[str, Any], port_name: str, pods: dict[str, _RankPod],
                       pod_at: dict[str, str]) -> None:
    """Add the ready pods of one slice of a KV-event Service to `pods` (by name) and `pod_at` (host -> name)."""
    ports = tuple(_port(slice_, kv_events_port_name(r, port_name)) for r in range(_num_ranks(slice_, port_name)))
    per_pod = _ranks_per_pod(slice_)
    v6 = slice_.get("addressType") == "IPv6"
    for ep in slice_.get("endpoints") or []:
        ref = ep.get("targetRef") or {}
        name, addrs = ref.get("name"), ep.get("addresses") or []
        if (ep.get("conditions") or {}).get("ready") is False or not isinstance(name, str) or not addrs:
            continue
        host = f"[{addrs[0]}]" if v6 else addrs[0]
        pods[name] = _RankPod(host, ports, per_pod)
        pod_at[host] = name


class StaticDiscovery:
    """Fixed worker URLs (local runs): yields one membership.

    `kv_events` maps a worker URL to its ZMQ KV-event endpoint (optional; URLs outside the pools ignored).
    """

    def __init__(self, prefill_urls: Iterable[str], decode_urls: Iterable[str],
                 kv_events: Mapping[str, str] | None = None) -> None:
        prefill, decode = tuple(sorted(prefill_urls)), tuple(sorted(decode_urls))
        urls = {u.rstrip("/") for u in (*prefill, *decode)}
        ev = {u.rstrip("/"): e for u, e in (kv_events or {}).items() if u.rstrip("/") in urls}
        self.membership = PoolMembership(prefill, decode, tuple(sorted(ev.items())))

    async def updates(self) -> AsyncIterator[PoolMembership]:
        yield self.membership


class _FileTokenAuth(httpx.Auth):
    def __init__(self, token_path: Path) -> None:
        self.token_path = token_path

    def auth_flow(self, request: httpx.Request):  # type: ignore[override]
        request.headers["Authorization"] = f"Bearer {self.token_path.read_text().strip()}"
        yield request


class _Gone(Exception):
    """The watch's resourceVersion expired (HTTP 410): list again."""


class MalformedWatchError(ValueError):
    """The API server's list body or a watch line is not the JSON object the Kubernetes API defines."""


def _object_name(obj: Any, what: str) -> str:
    """`obj["metadata"]["name"]` of a listed or watched EndpointSlice.

    Raises:
        MalformedWatchError: `obj` is not an object with a string `metadata.name`.
    """
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str):
        raise MalformedWatchError(f"{what}: EndpointSlice without metadata.name: {str(obj)[:200]}")
    return name


class EndpointSliceDiscovery:
    """List + watch the EndpointSlices of the prefill and decode Services in one namespace.

    `port_name` names the Services' HTTP port (worker base URLs), `kv_events_port_name` their KV-event
    port (`PoolMembership.kv_events`; None reports none). The slices of each Service's KV-event Service
    (`kv_events_service_name`) are watched too.
    """

    def __init__(self, *, namespace: str, prefill_service: str, decode_service: str, client: httpx.AsyncClient,
                 port_name: str = "http", kv_events_port_name: str | None = KV_EVENTS_PORT_NAME,
                 retry_s: float = 1.0, max_retry_s: float = 30.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.namespace, self.client, self.port_name = namespace, client, port_name
        self.kv_events_port_name = kv_events_port_name
        self.roles = {prefill_service: "prefill", decode_service: "decode"}
        self.retry_s, self.max_retry_s, self.sleep = retry_s, max_retry_s, sleep
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        # with the pools' KV-event Services (multi-node workers' ranks on every pod of their groups)
        services = set(self.roles) | {kv_events_service_name(s) for s in self.roles}
        self.selector = f"{SERVICE_LABEL} in ({','.join(sorted(services))})"

    @classmethod
    def in_cluster(cls, *, namespace: str, prefill_service: str, decode_service: str,
                   sa_dir: Path = SA_DIR, host: str | None = None, **kw: Any) -> "EndpointSliceDiscovery":
        """From the pod's service account (`KUBERNETES_SERVICE_HOST`/`_PORT`, token, ca.crt).

        Raises:
            RuntimeError: not running in a pod (no KUBERNETES_SERVICE_HOST and no `host`).
        """
        if host is None:
            h, p = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not h:
                raise RuntimeError("KUBERNETES_SERVICE_HOST is not set: not running in a Kubernetes pod")
            host = f"https://{h}:{p}" if ":" not in h else f"https://[{h}]:{p}"
        ca = sa_dir / "ca.crt"
        client = httpx.AsyncClient(base_url=host, auth=_FileTokenAuth(sa_dir / "token"),
                                   verify=str(ca) if ca.exists() else True, timeout=httpx.Timeout(10, read=None))
        return cls(namespace=namespace, prefill_service=prefill_service, decode_service=decode_service,
                   client=client, **kw)

    async def _list(self) -> tuple[dict[str, dict[str, Any]], str]:
        r = await self.client.get(self.path, params={"labelSelector": self.selector})
        r.raise_for_status()
        body = r.json()  # ValueError when not JSON
        if not isinstance(body, dict) or not isinstance(body.get("items") or [], list):
            raise MalformedWatchError(f"list: not an EndpointSliceList: {str(body)[:200]}")
        meta = body.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if not isinstance(rv, str):
            raise MalformedWatchError("list: EndpointSliceList without metadata.resourceVersion")
        return {_object_name(i, "list"): i for i in body.get("items") or []}, rv

    async def _watch(self, slices: dict[str, dict[str, Any]], rv: str) -> AsyncIterator[str]:
        params = {"labelSelector": self.selector, "watch": "1", "resourceVersion": rv,
                  "allowWatchBookmarks": "true"}
        async with self.client.stream("GET", self.path, params=params) as r:
            if r.status_code == 410:
                raise _Gone()
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                try:
                    ev = json.loads(line)
                except ValueError as exc:
                    raise MalformedWatchError(f"watch line is not JSON ({exc}): {line[:200]!r}") from exc
                if not isinstance(ev, dict) or not isinstance(ev.get("object") or {}, dict):
                    raise MalformedWatchError(f"watch line is not a watch event: {line[:200]!r}")
                typ, obj = ev.get("type"), ev.get("object") or {}
                if typ == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise httpx.HTTPError(f"watch error: {obj.get('message', obj)}")
                if typ in ("ADDED", "MODIFIED"):
                    slices[_object_name(obj, f"watch {typ}")] = obj
                elif typ == "DELETED":
                    slices.pop(_object_name(obj, "watch DELETED"), None)
                meta = obj.get("metadata")
                new_rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
                rv = new_rv if isinstance(new_rv, str) else rv
                yield rv

    def _membership(self, slices: dict[str, dict[str, Any]]) -> PoolMembership:
        return membership_from_slices(slices.values(), roles=self.roles, port_name=self.port_name,
                                      kv_events_port_name=self.kv_events_port_name)

    async def updates(self) -> AsyncIterator[PoolMembership]:
        """Yield the membership now and after every change (runs until the consumer stops).

        Never raises for what the API server answers: HTTP errors (including a watch `ERROR` event) and
        malformed bodies or lines (ValueError, KeyError) are logged as warnings and retried after a wait of
        `retry_s` seconds, doubling up to `max_retry_s`. The first `410 Gone` lists again at once; further
        ones in a row wait like errors. A watch that ends without any event is reopened after the same
        wait (an immediate reopen would poll the API server in a tight loop); one that delivered events is
        reopened at once and resets the wait to `retry_s`.
        """
        last: PoolMembership | None = None
        delay = self.retry_s
        num_gone = 0  # 410 Gone answers since the last watch event
        slices: dict[str, dict[str, Any]] = {}
        rv: str | None = None

        async def back_off() -> None:
            nonlocal delay
            await self.sleep(delay)
            delay = min(delay * 2, self.max_retry_s)

        while True:
            try:
                if rv is None:
                    slices, rv = await self._list()
                    m = self._membership(slices)
                    if m != last:
                        last = m
                        yield m
                num_events = 0
                async for rv in self._watch(slices, rv):
                    num_events += 1
                    delay, num_gone = self.retry_s, 0
                    m = self._membership(slices)
                    if m != last:
                        last = m
                        yield m
                if num_events:
                    await asyncio.sleep(0)  # the server closed the watch (its timeout): resume it
                else:
                    log.warning("discovery: the EndpointSlice watch ended without an event; reopening it in "
                                "%.1f s", delay)
                    await back_off()
            except _Gone:
                num_gone += 1
                rv = None
                if num_gone > 1:
                    log.warning("discovery: resourceVersion expired (410 Gone) %d times in a row; listing "
                                "again in %.1f s", num_gone, delay)
                    await back_off()
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                log.warning("discovery: EndpointSlice list/watch failed (%s: %s); listing again in %.1f s",
                            type(exc).__name__, exc, delay)
                rv = None
                await back_off()
