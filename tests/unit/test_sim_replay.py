"""Trace replay on simulated workers with a hand-checkable linear performance model."""

import pytest

from runtime.config import RouterSpec
from runtime.router.core import Router
from runtime.sim.replay import SimWorkerSpec, load_scale_factor, replay
from runtime.sim.timing import PerfTiming
from runtime.sim.trace import TraceRequest

BS = 512


class LinearPerf:
    """prefill: 1 ms per token + 10 ms; decode step: 20 ms."""

    def prefill_time_s(self, isl_tokens, tp, batch=1):
        return 0.010 + 0.001 * isl_tokens * batch

    def decode_step_time_s(self, batch, context_tokens, tp):
        return 0.020


def _req(i, t, blocks, osl=2):
    return TraceRequest(f"r{i}", t, len(blocks) * BS, osl, tuple(blocks))


def test_prefill_time_with_a_cached_prefix_uses_the_difference_with_a_floor():
    timing = PerfTiming(LinearPerf(), 8)
    assert timing.prefill_s(1024) == pytest.approx(1.034)
    # max(P(1024) - P(512), P(512)) = max(0.512, 0.522)
    assert timing.prefill_s(1024, 512) == pytest.approx(0.522)
    assert timing.decode_s(10, 100, 3) == pytest.approx(0.2)


def test_kv_aware_sends_the_repeat_to_the_cache_and_ttft_follows_the_model():
    reqs = [_req(0, 0.0, [1, 2]), _req(1, 5.0, [1, 2, 3])]
    timing = PerfTiming(LinearPerf(), 8)
    router = Router(RouterSpec(policy="kv_aware"), BS)
    workers = [SimWorkerSpec(f"w{i}", "both", 100) for i in range(4)]
    for w in workers:
        router.add_worker(w.worker_id, w.role)
    res = replay(reqs, router, workers, timing, BS)
    assert res.hit_blocks == 2 and res.total_blocks == 5
    # r0: P(1024) = 1.034 s; r1: 1536 tokens, 1024 cached: max(P(1536)-P(1024), P(512)) = 0.522
    assert res.ttft_s == pytest.approx([1.034, 0.522])
    assert sum(res.busy_s.values()) == pytest.approx(1.556)
    assert all(w.num_requests == 0 for w in router.workers.values())


def test_round_robin_misses_the_repeat_and_queues_fcfs():
    reqs = [_req(0, 0.0, [1, 2]), _req(1, 0.5, [7]), _req(2, 0.6, [1, 2, 3])]
    timing = PerfTiming(LinearPerf(), 8)
    router = Router(RouterSpec(policy="round_robin"), BS)
    workers = [SimWorkerSpec("a", "both", 100), SimWorkerSpec("b", "both", 100)]
    for w in workers:
        router.add_worker(w.worker_id, w.role)
    res = replay(reqs, router, workers, timing, BS)
    # r2 lands on "a" again (a, b, a) while r0 still runs until 1.034 -> hit 2 blocks after waiting
    assert res.hit_blocks == 2
    assert res.ttft_s[-1] == pytest.approx(1.034 + 0.522 - 0.6)
    assert res.imbalance == pytest.approx(1.556 / ((1.556 + 0.522) / 2))


def test_disaggregated_decisions_prefill_on_the_prefill_worker():
    reqs = [_req(0, 0.0, [1, 2, 3])]
    router = Router(RouterSpec(disagg_min_uncached_tokens=0), BS)
    workers = [SimWorkerSpec("p", "prefill", 100), SimWorkerSpec("d", "decode", 100)]
    for w in workers:
        router.add_worker(w.worker_id, w.role)
    res = replay(reqs, router, workers, PerfTiming(LinearPerf(), 8), BS)
    assert res.num_remote_prefills == 1 and res.busy_s["p"] > 0 and res.busy_s["d"] == 0
    assert router.overlaps([1, 2, 3]) == {"p": 3, "d": 3}


def test_load_scale_factor_puts_no_cache_work_at_the_requested_fraction():
    reqs = [_req(0, 0.0, [1]), _req(1, 10.0, [2])]
    timing = PerfTiming(LinearPerf(), 8)
    # work = 2 * 0.522 = 1.044 s; 2 workers at load 0.5 over span 10 s * f: f = 1.044 / (0.5*2*10)
    assert load_scale_factor(reqs, timing, 2, 0.5) == pytest.approx(0.1044)
    with pytest.raises(ValueError, match="load"):
        load_scale_factor(reqs, timing, 2, 0)


class SplitPerf(LinearPerf):
    """LinearPerf whose 10 ms constant is API-side latency: the engine is busy 1 ms per token + 1 ms."""

    def prefill_busy_s(self, isl_tokens, tp, batch=1):
        return 0.001 + 0.001 * isl_tokens * batch


def test_workers_are_held_for_the_engine_time_and_ttft_adds_the_fixed_latency():
    timing = PerfTiming(SplitPerf(), 8)
    assert timing.fixed_latency_s == pytest.approx(0.009)
    assert timing.prefill_s(1024) == pytest.approx(1.025)
    # a cache hit removes engine work only: the fixed latency is paid either way
    assert timing.prefill_s(1024, 512) == pytest.approx(max(1.025 - 0.513, 0.513))
    reqs = [_req(0, 0.0, [1, 2]), _req(1, 0.0, [3, 4])]
    router = Router(RouterSpec(policy="round_robin"), BS)
    workers = [SimWorkerSpec("w0", "both", 100)]
    router.add_worker("w0", "both")
    res = replay(reqs, router, workers, timing, BS)
    # one worker, FCFS: the second prefill starts when the first one's engine time ends, not its TTFT
    assert res.ttft_s == pytest.approx([1.025 + 0.009, 2 * 1.025 + 0.009])
    assert sum(res.busy_s.values()) == pytest.approx(2 * 1.025)


def test_load_scale_factor_on_an_empty_trace_says_so():
    with pytest.raises(ValueError, match="no requests"):
        load_scale_factor([], PerfTiming(LinearPerf(), 8), 2, 0.5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_arrivals_are_refused_naming_the_request(bad):
    reqs = [_req(0, 0.0, [1]), _req(1, bad, [2]), _req(2, 10.0, [3])]
    timing = PerfTiming(LinearPerf(), 8)
    with pytest.raises(ValueError, match="request 'r1': arrival_s must be finite"):
        load_scale_factor(reqs, timing, 2, 0.5)
    router = Router(RouterSpec(policy="round_robin"), BS)
    router.add_worker("w0", "both")
    with pytest.raises(ValueError, match="request 'r1': arrival_s must be finite"):
        replay(reqs, router, [SimWorkerSpec("w0", "both", 100)], timing, BS)


class BatchPerf(LinearPerf):
    """LinearPerf whose decode step grows with the batch: 10 ms per sequence."""

    def decode_step_time_s(self, batch, context_tokens, tp):
        return 0.010 * batch


def test_tpot_is_each_request_decode_time_per_output_token_at_its_batch():
    # one worker: r0 decodes alone (batch 1); r1's prefill ends while r0 still decodes (batch 2);
    # r2 has no output token and has no TPOT
    reqs = [_req(0, 0.0, [1], osl=100), _req(1, 0.0, [2], osl=10), _req(2, 0.0, [3], osl=0)]
    timing = PerfTiming(BatchPerf(), 8)
    router = Router(RouterSpec(policy="round_robin"), BS)
    workers = [SimWorkerSpec("w0", "both", 100)]
    router.add_worker("w0", "both", kv_events=True, kv_capacity_blocks=100)
    res = replay(reqs, router, workers, timing, BS)
    assert res.tpot_s == pytest.approx([0.010, 0.020])
    assert len(res.ttft_s) == 3
