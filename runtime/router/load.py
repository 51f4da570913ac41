"""In-flight load per worker as the router sees it (pure).

A request adds load when it is routed: its *uncached* prompt tokens to the worker that prefills it
(``prefill_tokens``) and its prompt blocks to the worker that decodes it (``decode_blocks``). The prefill
load is dropped when the first token arrives (prefill finished) and the decode load when the request
completes. This is the same bookkeeping as Dynamo's ``ActiveSequences`` (lib/llm/src/kv_router/sequence.rs)
— the router's own estimate, independent of engine metrics, so it reacts within one request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")


@dataclass(slots=True)
class WorkerLoad:
    """Mutable load counters of one worker.

    Attributes:
        worker_id: the worker's id in the pool.
        role: ``prefill`` (prefill pool), ``decode`` (decode pool) or ``both`` (aggregated worker).
        prefill_tokens: uncached prompt tokens routed here whose first token has not arrived, tokens.
        decode_blocks: KV blocks (prompt blocks, at least one a request) of requests decoding here that have
            not completed.
        num_requests: requests that hold any load here.
        engine_requests: this router's requests the engine itself holds now (counts in its running + waiting
            gauges): those prefilling on it, and those decoding on it once their decode leg was sent (from
            routing with a local prefill, from the remote prefill's first token otherwise). A request still
            prefilling elsewhere is in ``num_requests`` of its decode worker but not here.
        kv_events: whether the worker publishes KV events (else the router learns approximately).
        prefill_work: predicted prefill work queued here (the router's ``prefill_cost`` unit: seconds
            when a performance model is given, else uncached tokens).
        total_prefill_work: prefill work ever routed here, same unit (evens out long-run busy time).
        available: False while the worker is suspended (failed a health check): never chosen, but its
            index entry and counters are kept.
        external_requests: requests on the worker that other routers (runtime replicas) sent, as last
            estimated from the engine's own gauges (`set_external_load`); not in ``num_requests``.
        external_decode_blocks: the part of ``decode_blocks`` those requests stand for.
    """

    worker_id: str
    role: str
    prefill_tokens: int = 0
    decode_blocks: int = 0
    num_requests: int = 0
    engine_requests: int = 0
    kv_events: bool = True
    prefill_work: float = 0.0
    total_prefill_work: float = 0.0
    available: bool = True
    external_requests: float = 0.0
    external_decode_blocks: int = 0

    @property
    def can_prefill(self) -> bool:
        """Whether this worker may be chosen as a (remote) prefill worker."""
        return self.role in ("prefill", "both")

    @property
    def can_decode(self) -> bool:
        """Whether this worker may be chosen as a decode worker (and prefill locally)."""
        return self.role in ("decode", "both")


def set_external_load(w: WorkerLoad, engine_requests: float | None, blocks_per_request: float) -> None:
    """Fold the load other routers put on decode-capable worker `w` into its counters.

    `engine_requests`: requests the engine itself reports running or waiting (vLLM
    ``vllm:num_requests_running`` + ``vllm:num_requests_waiting``); None when its page could not be read (the
    external share is dropped rather than kept stale). The requests beyond this router's own
    (``engine_requests``: the ones the engine holds, so requests still prefilling elsewhere are not taken for
    another replica's absence) are the other replicas'; each stands for `blocks_per_request` KV blocks (the mean
    prompt blocks this router charges per request: the other replicas serve the same traffic). The share
    replaces the previous one in ``decode_blocks`` (so the router's own charge and release stay exact), and
    ``num_requests`` is left to the router's own requests. A worker that cannot decode is left as it is: a
    prefill engine's queue empties within one prefill, faster than its gauges can be read. A NaN, infinite or
    negative `engine_requests` is no engine state: it counts as None (an infinite share has no block count).

    Raises:
        ValueError: `blocks_per_request` < 0 or not finite.
    """
    if not (math.isfinite(blocks_per_request) and blocks_per_request >= 0):
        raise ValueError(f"blocks_per_request={blocks_per_request}: expected a finite number >= 0")
    if not w.can_decode:
        return
    if engine_requests is not None and not (math.isfinite(engine_requests) and engine_requests >= 0):
        engine_requests = None
    external = 0.0 if engine_requests is None else max(0.0, float(engine_requests) - w.engine_requests)
    blocks = int(round(external * blocks_per_request))
    w.decode_blocks += blocks - w.external_decode_blocks
    w.external_requests, w.external_decode_blocks = external, blocks


def removal_choice(loads: "list[WorkerLoad | None]") -> int:
    """Index of the worker a scale-down removes: the least loaded one, so the drain that precedes its removal
    (runtime/router/breaker.py, `BreakerBoard.start_drain`) is the shortest.

    Load order: fewest in-flight requests (`num_requests`), then fewest decode KV blocks, then fewest queued
    prefill tokens; ties go to the last index (the newest worker, whose cache is the coldest). `None` stands
    for a worker the router does not track (not yet in the pool): it holds no request, so it counts as idle.

    Raises:
        ValueError: `loads` is empty.
    """
    if not loads:
        raise ValueError("removal_choice: no worker to choose from")

    def key(i: int) -> tuple[int, int, int, int]:
        w = loads[i]
        return (0, 0, 0, -i) if w is None else (w.num_requests, w.decode_blocks, w.prefill_tokens, -i)

    return min(range(len(loads)), key=key)
