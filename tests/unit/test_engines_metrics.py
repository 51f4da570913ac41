"""Reading vLLM's Prometheus text (runtime.engines.metrics).

The exposition text is produced by prometheus_client itself with vLLM's metric names and labels, so the
parser is checked against the real format; expected values come from what was observed, not constants.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runtime.engines.metrics import nixl_transfer_count, nixl_transfer_stats, parse_worker_metrics, sample_sum


def _vllm_like_text(num_xfers_by_engine: dict[str, int], queries: float, hits: float, running: int) -> str:
    reg = CollectorRegistry()
    h = Histogram("vllm:nixl_xfer_time_seconds", "NIXL transfers", ["model_name", "engine"], registry=reg)
    for engine, n in num_xfers_by_engine.items():
        for i in range(n):
            h.labels("m", engine).observe(0.001 * (i + 1))
    Counter("vllm:prefix_cache_queries", "q", ["model_name", "engine"], registry=reg).labels("m", "0").inc(queries)
    Counter("vllm:prefix_cache_hits", "h", ["model_name", "engine"], registry=reg).labels("m", "0").inc(hits)
    Gauge("vllm:num_requests_running", "r", ["model_name", "engine"], registry=reg).labels("m", "0").set(running)
    Gauge("vllm:num_requests_waiting", "w", ["model_name", "engine"], registry=reg).labels("m", "0").set(0)
    return generate_latest(reg).decode()


def test_nixl_count_sums_observations_over_engines():
    text = _vllm_like_text({"0": 3, "1": 2}, 10, 4, 1)
    assert nixl_transfer_count(text) == 5


def test_nixl_count_is_zero_when_metric_absent():
    assert nixl_transfer_count("# nothing here\n") == 0


def test_worker_snapshot_reads_prefix_cache_and_queue():
    m = parse_worker_metrics(_vllm_like_text({"0": 1}, queries=320, hits=256, running=2))
    assert m.nixl_transfers == 1
    assert m.prefix_cache_queries_tokens == 320
    assert m.prefix_cache_hits_tokens == 256
    assert m.prefix_hit_rate == pytest.approx(256 / 320)
    assert m.num_requests_running == 2
    assert m.num_requests_waiting == 0


def test_label_filter_selects_one_series():
    text = _vllm_like_text({"0": 3, "1": 2}, 0, 0, 0)
    assert sample_sum(text, "vllm:nixl_xfer_time_seconds_count", engine="1") == 2


def test_malformed_text_raises_value_error():
    with pytest.raises(ValueError):
        sample_sum('metric{label="unterminated} 1\n', "metric")


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_non_finite_transfer_count_is_an_error_naming_the_metric(value):
    text = _vllm_like_text({"0": 2}, 0, 0, 0) + f'vllm:nixl_xfer_time_seconds_count{{engine="9"}} {value}\n'
    with pytest.raises(ValueError, match=r"vllm:nixl_xfer_time_seconds_count is .*finite number >= 0"):
        nixl_transfer_count(text)
    with pytest.raises(ValueError, match="vllm:nixl_xfer_time_seconds_count"):
        nixl_transfer_stats(text)


def test_a_non_finite_gauge_is_returned_for_the_caller_to_judge():
    text = _vllm_like_text({"0": 1}, 0, 0, 0) + 'vllm:num_requests_waiting{engine="1"} NaN\n'
    assert math.isnan(sample_sum(text, "vllm:num_requests_waiting"))
    assert nixl_transfer_count(text) == 1


def test_a_parse_error_names_the_line():
    text = _vllm_like_text({"0": 1}, 0, 0, 0)
    bad_line = len(text.splitlines()) + 1
    with pytest.raises(ValueError, match=rf"metrics text line {bad_line}: .* in 'this is not prometheus'"):
        parse_worker_metrics(text + "this is not prometheus\n")


def test_a_data_parallel_workers_kv_usage_is_the_mean_of_its_engines_and_its_requests_the_sum():
    """Two engines at 45 % of their own caches: the worker is 45 % full (a sum read 0.9 and grew the decode
    pool every tick in load mode), and it runs 4 + 6 requests."""
    import httpx

    from runtime.engines.metrics import sample_mean
    from runtime.server.planner_loop import read_pool

    reg = CollectorRegistry()
    kv = Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name", "engine"], registry=reg)
    running = Gauge("vllm:num_requests_running", "r", ["model_name", "engine"], registry=reg)
    Gauge("vllm:num_requests_waiting", "w", ["model_name", "engine"], registry=reg).labels("m", "0").set(1)
    for engine, n in (("0", 4), ("1", 6)):
        kv.labels("m", engine).set(0.45)
        running.labels("m", engine).set(n)
    text = generate_latest(reg).decode()
    assert sample_mean(text, "vllm:kv_cache_usage_perc") == pytest.approx(0.45)
    assert sample_mean(text, "vllm:gpu_cache_usage_perc") is None
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, text=text))) as client:
        obs = read_pool(client, ["http://w0/metrics"], deadline_s=2.0)
    assert (obs.kv_usage, obs.running_per_worker, obs.queue_per_worker) == (pytest.approx(0.45), 10.0, 1.0)


def test_read_pool_reads_the_process_start_time_prometheus_clients_process_collector_writes():
    """vLLM serves /metrics from prometheus_client's default registry (one API server), which holds the
    process collector: ``process_start_time_seconds`` is on the page, and read_pool hands it on per worker
    for the prefill-time meter to tell a restarted process."""
    import httpx
    from prometheus_client import ProcessCollector

    from runtime.server.planner_loop import read_pool

    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    Gauge("vllm:num_requests_waiting", "w", ["model_name", "engine"], registry=reg).labels("m", "0").set(0)
    text = generate_latest(reg).decode()
    started = sample_sum(text, "process_start_time_seconds")
    assert started > 1e9  # Unix epoch seconds (Linux /proc)
    start_times: dict[str, float] = {}
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, text=text))) as client:
        obs = read_pool(client, ["http://w0/metrics"], deadline_s=2.0, start_times=start_times)
    assert obs.num_ready == 1 and start_times == {"http://w0/metrics": started}
