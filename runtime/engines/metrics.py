"""Read a vLLM worker's Prometheus `/metrics` text (adapter helper; parsing only, no I/O here).

Metric names are vLLM's (v1 engine, vllm/v1/metrics/loggers.py and the NIXL connector's stats):
`vllm:nixl_xfer_time_seconds` (histogram, one observation per NIXL KV transfer on the receiving worker),
`vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (counters, tokens),
`vllm:num_requests_running` / `vllm:num_requests_waiting` (gauges, requests).
Counts are summed over label sets (model_name, engine index), so a multi-engine worker reads as one; a
fraction of each engine's capacity (KV usage) is averaged over them (`sample_mean`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

NIXL_XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"


def sample_sum(text: str, sample_name: str, **label_filter: str) -> float:
    """Sum of every sample named `sample_name` whose labels include `label_filter`; 0.0 when absent.

    Args:
        text: Prometheus text exposition format.
        sample_name: full sample name, e.g. "vllm:prefix_cache_hits_total" or "..._count" of a histogram.

    Returns the sum as read: a NaN or infinite sample makes the sum NaN or infinite (gauges are judged
    by the caller; counts by `nixl_transfer_count`).

    Raises:
        ValueError: `text` is not valid exposition format; the message names the first line that does
            not parse on its own (1-based) when there is one.
    """
    total = 0.0
    for family in _families(text):
        for s in family.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in label_filter.items()):
                total += float(s.value)
    return total


def sample_sums_by(text: str, sample_name: str, label: str) -> dict[str, float]:
    """`{label value: sum of the samples named `sample_name` with that value of `label`}` (one parse); samples
    without the label are left out. E.g. `label="engine"`: vLLM's per-engine (data-parallel rank) series.

    Raises:
        ValueError: `text` is not valid exposition format (as `sample_sum`).
    """
    out: dict[str, float] = {}
    for family in _families(text):
        for s in family.samples:
            if s.name == sample_name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + float(s.value)
    return out


def readable_gauge(value: float) -> float | None:
    """A count or fraction gauge (requests, KV usage) as a reader may use it: `value` when finite and >= 0;
    None (unreadable) for NaN, an infinity or a negative value, which no engine state can produce: a caller
    must not take it for a count (NaN compares False both ways, so it would read as idle)."""
    return value if math.isfinite(value) and value >= 0 else None


def sample_mean(text: str, sample_name: str) -> float | None:
    """Mean of every sample named `sample_name` over its label sets; None when absent. For a gauge that is a
    fraction of each engine's own capacity (``vllm:kv_cache_usage_perc``: one series per engine of a
    data-parallel worker), where a sum would read two engines at 0.45 as 0.9.

    Raises:
        ValueError: `text` is not valid exposition format (as `sample_sum`).
    """
    values = [float(s.value) for family in _families(text) for s in family.samples if s.name == sample_name]
    return sum(values) / len(values) if values else None


def _families(text: str) -> Iterator:
    """prometheus_client's metric families of `text`, with parse errors that name the bad line."""
    try:
        yield from list(text_string_to_metric_families(text))
    except ValueError as exc:
        for lineno, line in enumerate(text.splitlines(), start=1):
            try:
                list(text_string_to_metric_families(line + "\n"))
            except ValueError as line_exc:
                raise ValueError(f"metrics text line {lineno}: {line_exc} in {line[:200]!r}") from exc
        raise ValueError(f"metrics text is not Prometheus exposition format: {exc}") from exc


def nixl_transfer_count(text: str) -> int:
    """Number of NIXL KV transfers the worker has received (count of `vllm:nixl_xfer_time_seconds`).

    Raises:
        ValueError: `text` does not parse (see `sample_sum`), or the count is NaN, infinite or negative
            (the message names the metric).
    """
    n = sample_sum(text, NIXL_XFER_COUNT)
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"{NIXL_XFER_COUNT} is {n}: a transfer count must be a finite number >= 0")
    return int(n)


def nixl_transfer_stats(text: str) -> dict[str, float | int | None]:
    """``{"nixl_transfers": count, "nixl_xfer_ms_mean": mean transfer time in ms (None without transfers)}``
    from a worker's `vllm:nixl_xfer_time_seconds` histogram, as the bench scripts report them.

    Raises:
        ValueError: as `nixl_transfer_count`.
    """
    n = nixl_transfer_count(text)
    total_s = sample_sum(text, NIXL_XFER_COUNT.replace("_count", "_sum"))
    return {"nixl_transfers": n, "nixl_xfer_ms_mean": round(1000 * total_s / n, 2) if n else None}


@dataclass(frozen=True)
class WorkerMetrics:
    """One snapshot of a worker's counters and gauges."""

    nixl_transfers: int
    prefix_cache_queries_tokens: float
    prefix_cache_hits_tokens: float
    num_requests_running: float
    num_requests_waiting: float

    @property
    def prefix_hit_rate(self) -> float:
        """hits / queries (tokens), 0.0 before any query."""
        q = self.prefix_cache_queries_tokens
        return self.prefix_cache_hits_tokens / q if q else 0.0


def parse_worker_metrics(text: str) -> WorkerMetrics:
    """Snapshot of the vLLM metrics pdserve uses. Raises ValueError on malformed exposition text."""
    return WorkerMetrics(
        nixl_transfers=nixl_transfer_count(text),
        prefix_cache_queries_tokens=sample_sum(text, PREFIX_CACHE_QUERIES),
        prefix_cache_hits_tokens=sample_sum(text, PREFIX_CACHE_HITS),
        num_requests_running=sample_sum(text, REQUESTS_RUNNING),
        num_requests_waiting=sample_sum(text, REQUESTS_WAITING),
    )
