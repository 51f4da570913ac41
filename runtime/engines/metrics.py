"""Read a vLLM worker's Prometheus `/metrics` text (adapter helper; parsing only, no I/O here).

Metric names are vLLM's (v1 engine, vllm/v1/metrics/loggers.py and the NIXL connector's stats):
`vllm:nixl_xfer_time_seconds` (histogram, one observation per NIXL KV transfer on the receiving worker),
`vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (counters, tokens),
`vllm:num_requests_running` / `vllm:num_requests_waiting` (gauges, requests).
Values are summed over label sets (model_name, engine index), so a multi-engine worker reads as one.
"""

from __future__ import annotations

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

    Raises:
        ValueError: `text` is not valid exposition format (from prometheus_client's parser).
    """
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in label_filter.items()):
                total += float(s.value)
    return total


def nixl_transfer_count(text: str) -> int:
    """Number of NIXL KV transfers the worker has received (count of `vllm:nixl_xfer_time_seconds`)."""
    return int(sample_sum(text, NIXL_XFER_COUNT))


def nixl_transfer_stats(text: str) -> dict[str, float | int | None]:
    """``{"nixl_transfers": count, "nixl_xfer_ms_mean": mean transfer time in ms (None without transfers)}``
    from a worker's `vllm:nixl_xfer_time_seconds` histogram, as the bench scripts report them."""
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
