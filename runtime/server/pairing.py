"""Which prefill worker and which decode worker serve a request: the runtime's seam for the router.

`Pairing` is the narrow interface the runtime model calls; `RoundRobinPairing` is the walking-skeleton
policy (prefill and decode pools each in turn). The KV-aware router (runtime.router) plugs in behind the
same Protocol. Every URL a pairing returns comes from the pool it was built with (configuration), never
from a request.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class Route:
    """Where one request goes.

    Attributes:
        prefill_url: base URL of the worker that prefills remotely, or None = prefill locally on the
            decode worker (aggregated serving; also the failover path).
        decode_url: base URL of the worker that decodes.
        reason: why (for logs/metrics), e.g. "round_robin", "remote", "local_short".
        prefill_worker: id of the prefill worker (None when local), e.g. "prefill-0".
        decode_worker: id of the decode worker, e.g. "decode-0".
        overlap_blocks: cached prefix blocks predicted on the worker that prefills (0 when unknown).
        prefill_dp_rank, decode_dp_rank: the data-parallel rank (engine) of the prefill / decode worker the
            request is pinned to (vLLM's `X-data-parallel-rank` header); None for a worker without data
            parallelism, whose API server has one engine.
    """

    prefill_url: str | None
    decode_url: str
    reason: str = ""
    prefill_worker: str | None = None
    decode_worker: str = ""
    overlap_blocks: int = 0
    prefill_dp_rank: int | None = None
    decode_dp_rank: int | None = None


@dataclass(frozen=True)
class RouteRequest:
    """What a pairing may look at.

    Attributes:
        request_id: the X-Request-Id sent to both workers.
        path: worker path ("/v1/chat/completions" or "/v1/completions").
        body: the OpenAI request body as received (never a source of addresses).
        token_ids: the prompt's token ids when the runtime tokenized it, else None.
        now_s: monotonic time of arrival, seconds.
    """

    request_id: str
    path: str
    body: dict
    token_ids: Sequence[int] | None = None
    now_s: float = 0.0


class Pairing(Protocol):
    """Chooses the (prefill, decode) pair of each request and hears how it went."""

    def choose(self, req: RouteRequest) -> Route:
        """Route for `req`. Raises RuntimeError when no decode worker is available."""
        ...

    def on_first_token(self, request_id: str, now_s: float) -> None:
        """The first token arrived (prefill load is gone)."""
        ...

    def on_prefill_failed(self, request_id: str, now_s: float) -> Route:
        """The remote prefill failed: returns the local-prefill route the runtime continues with."""
        ...

    def on_complete(self, request_id: str, now_s: float, ok: bool) -> None:
        """The request finished (ok) or failed; release its load."""
        ...

    def on_decode_failed(self, request_id: str, now_s: float) -> Route | None:
        """The decode worker died: another decode worker (local prefill) to continue on, or None when the
        request may not migrate again (`RouterSpec.migration_limit`) or no other decode worker is left."""
        ...


class RoundRobinPairing:
    """Prefill and decode pools, each taken in turn, skipping workers marked down; with no prefill pool, or
    every prefill worker down, a request is prefilled locally on its decode worker.

    A worker is marked down by `mark_down` and back up by `mark_up`, both called by the runtime's circuit
    breakers (runtime.server.breakers) as a worker's breaker opens and closes.

    Args:
        prefill_urls: prefill worker base URLs (may be empty).
        decode_urls: decode worker base URLs (at least one).
        migration_limit: decode-worker failovers allowed per request.

    Raises:
        ValueError: when `decode_urls` is empty.
    """

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str], *, migration_limit: int = 1) -> None:
        if not decode_urls:
            raise ValueError("decode_urls: at least one decode worker URL is required")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._prefill_cycle = itertools.cycle(self.prefill_urls) if self.prefill_urls else None
        self._decode_cycle = itertools.cycle(self.decode_urls)
        self._routes: dict[str, Route] = {}
        self._failed: dict[str, set[str]] = {}
        self.migration_limit = migration_limit
        self.down: set[str] = set()  # base URLs of workers marked down
        self.pool_version = 0  # the URL lists are fixed (runtime.server.breakers follows pools by version)

    def _next_up(self, cycle: itertools.cycle, urls: list[str]) -> str | None:
        """The next URL of `cycle` not marked down (one turn at most), or None when all are down."""
        for _ in urls:
            url = next(cycle)
            if url not in self.down:
                return url
        return None

    def choose(self, req: RouteRequest) -> Route:
        decode = self._next_up(self._decode_cycle, self.decode_urls)
        if decode is None:
            raise RuntimeError("every decode worker is down")
        did = f"decode-{self.decode_urls.index(decode)}"
        prefill = None if self._prefill_cycle is None else self._next_up(self._prefill_cycle, self.prefill_urls)
        if self._prefill_cycle is None:
            route = Route(None, decode, "local_no_prefill_pool", None, did)
        elif prefill is None:
            route = Route(None, decode, "local_prefill_down", None, did)
        else:
            route = Route(prefill, decode, "round_robin", f"prefill-{self.prefill_urls.index(prefill)}", did)
        self._routes[req.request_id] = route
        return route

    def on_first_token(self, request_id: str, now_s: float) -> None:
        return None

    def on_prefill_failed(self, request_id: str, now_s: float) -> Route:
        old = self._routes.get(request_id)
        decode = old.decode_url if old else self.decode_urls[0]
        route = Route(None, decode, "local_prefill_failed", None, f"decode-{self.decode_urls.index(decode)}")
        self._routes[request_id] = route
        return route

    def on_complete(self, request_id: str, now_s: float, ok: bool) -> None:
        self._routes.pop(request_id, None)
        self._failed.pop(request_id, None)

    def on_decode_failed(self, request_id: str, now_s: float) -> Route | None:
        old = self._routes.get(request_id)
        failed = self._failed.setdefault(request_id, set())
        if old is not None:
            failed.add(old.decode_url)
        left = [u for u in self.decode_urls if u not in failed and u not in self.down]
        if len(failed) > self.migration_limit or not left:
            return None
        route = Route(None, left[0], "migrated", None, f"decode-{self.decode_urls.index(left[0])}")
        self._routes[request_id] = route
        return route

    def mark_down(self, url: str) -> list[str]:
        """Stop choosing the worker at `url` (a configured URL; others are ignored). Returns [] (requests in
        flight on it end by themselves: their calls fail or finish)."""
        url = url.rstrip("/")
        if url in self.prefill_urls or url in self.decode_urls:
            self.down.add(url)
        return []

    def mark_up(self, url: str) -> None:
        """Choose the worker at `url` again."""
        self.down.discard(url.rstrip("/"))
