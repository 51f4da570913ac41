"""Length-aware prefill priority: short prompts go ahead of long ones in a prefill worker's queue.

A prefill worker serves its waiting requests one prefill after another; behind a 30k-token prompt
(seconds of prefill) every short prompt misses its TTFT target although it needs tens of
milliseconds. Ordering the queue by prompt length (shortest-job-first, Smith's rule; the SLO
scheduling argument of DistServe, OSDI'24 §4) turns those misses into hits at the same worker
count. Prompt lengths are bucketed by powers of two so requests of similar length stay first come,
first served among themselves and a long prompt waits only behind clearly shorter ones.

The runtime passes the bucket as vLLM's request ``priority`` (lower runs first,
``--scheduling-policy priority``: vLLM ``SchedulingPolicy.PRIORITY`` orders the waiting queue by
``(priority, arrival_time)``) to prefill workers; the fleet simulator orders its prefill queue by
the same key. Pure.
"""

from __future__ import annotations

PRIORITY_BASE_TOKENS = 1024
"""Prompts up to this many tokens share the first bucket (priority 0)."""

MAX_PRIORITY = 16
"""Bucket cap: a prompt of 1024 x 2^16 tokens or more shares the last bucket."""


def prefill_priority(isl_tokens: int, base_tokens: int = PRIORITY_BASE_TOKENS) -> int:
    """Priority bucket of a prompt of ``isl_tokens`` tokens: 0 up to ``base_tokens``, then
    ``ceil(log2(isl / base))`` (1025-2048 tokens -> 1, 2049-4096 -> 2, ...), at most
    :data:`MAX_PRIORITY`. Lower is served first.

    Raises:
        ValueError: ``isl_tokens`` < 0 or ``base_tokens`` < 1.
    """
    if isl_tokens < 0:
        raise ValueError(f"isl_tokens must be >= 0, got {isl_tokens}")
    if base_tokens < 1:
        raise ValueError(f"base_tokens must be >= 1, got {base_tokens}")
    if isl_tokens <= base_tokens:
        return 0
    return min(((int(isl_tokens) - 1) // base_tokens).bit_length(), MAX_PRIORITY)
