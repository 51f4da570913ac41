"""Length-aware prefill priority: short prompts go ahead of long ones in a prefill worker's queue, with aging.

A prefill worker serves its waiting requests one prefill after another; behind a 30k-token prompt
(seconds of prefill) every short prompt misses its TTFT target although it needs tens of
milliseconds. Ordering the queue by prompt length (shortest-job-first, Smith's rule; the SLO
scheduling argument of DistServe, OSDI'24 §4) turns those misses into hits at the same worker
count. Prompt lengths are bucketed by powers of two (:func:`prompt_length_bucket`) so requests of
similar length stay first come, first served among themselves.

Pure shortest-first starves long prompts under sustained load (a long prompt waits until no shorter
one is queued). So the order key is a deadline, not the bucket alone (:func:`prefill_order_key_s`):
``arrival + bucket * aging_s``. A long prompt yields to shorter prompts that arrive up to
``bucket * aging_s`` seconds after it, never to later ones, so its extra wait is bounded by that
time plus the work of those prompts. What it changes on the planner bench (lower TTFT p90, a little
less SLO attainment than FCFS on the Azure trace: long prompts wait longer): docs/design/router.md,
"Prefill priority".

The runtime passes ``round(1000 * key)`` (wall-clock milliseconds) as vLLM's request ``priority``
(lower runs first: vLLM ``--scheduling-policy priority`` orders the waiting queue by ``(priority,
arrival_time)``) to prefill workers; the fleet simulator orders its prefill queue by the same key.
Pure: times are arguments.
"""

from __future__ import annotations

import math

PRIORITY_BASE_TOKENS = 1024
"""Prompts up to this many tokens share the first bucket (0)."""

MAX_BUCKET = 16
"""Bucket cap: a prompt of 1024 x 2^16 tokens or more shares the last bucket."""

PRIORITY_AGING_S = 1.0
"""Seconds of precedence a prompt yields per bucket above 0 (see the module doc)."""


def prompt_length_bucket(isl_tokens: int, base_tokens: int = PRIORITY_BASE_TOKENS) -> int:
    """Power-of-two bucket of a prompt of ``isl_tokens`` tokens: 0 up to ``base_tokens``, then
    ``ceil(log2(isl / base))`` (1025-2048 tokens -> 1, 2049-4096 -> 2, ...), at most :data:`MAX_BUCKET`.

    Raises:
        ValueError: ``isl_tokens`` < 0 or ``base_tokens`` < 1.
    """
    if isl_tokens < 0:
        raise ValueError(f"isl_tokens must be >= 0, got {isl_tokens}")
    if base_tokens < 1:
        raise ValueError(f"base_tokens must be >= 1, got {base_tokens}")
    if isl_tokens <= base_tokens:
        return 0
    return min(((int(isl_tokens) - 1) // base_tokens).bit_length(), MAX_BUCKET)


def prefill_order_key_s(isl_tokens: int, arrival_s: float, aging_s: float = PRIORITY_AGING_S) -> float:
    """Order key of a prefill, seconds on the caller's clock (lower runs first):
    ``arrival_s + prompt_length_bucket(isl_tokens) * aging_s``.

    Raises:
        ValueError: ``isl_tokens`` < 0, or ``arrival_s`` / ``aging_s`` not finite, or ``aging_s`` < 0.
    """
    if not math.isfinite(arrival_s):
        raise ValueError(f"arrival_s must be finite, got {arrival_s}")
    if not (math.isfinite(aging_s) and aging_s >= 0):
        raise ValueError(f"aging_s must be finite and >= 0, got {aging_s}")
    return arrival_s + prompt_length_bucket(isl_tokens) * aging_s


def vllm_priority(isl_tokens: int, now_unix_s: float, aging_s: float = PRIORITY_AGING_S) -> int:
    """vLLM request ``priority`` for a prefill sent at ``now_unix_s`` (wall clock, so that several runtime
    replicas agree): :func:`prefill_order_key_s` in whole milliseconds.

    Raises:
        ValueError: as :func:`prefill_order_key_s`.
    """
    return int(round(1000.0 * prefill_order_key_s(isl_tokens, now_unix_s, aging_s)))
