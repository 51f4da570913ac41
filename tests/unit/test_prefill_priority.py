"""Length-aware prefill priority (runtime/router/priority.py) and the simulator's "length" order."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.planner.profiles import analytic_profile
from runtime.router.priority import (
    MAX_BUCKET,
    PRIORITY_AGING_S,
    PRIORITY_BASE_TOKENS,
    prefill_order_key_s,
    prompt_length_bucket,
    vllm_priority,
)
from runtime.sim.fleet import FleetConfig, FleetSim, Trace, simulate, static_controller

PROF = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4, kv_capacity_tokens=1_000_000,
                        prefill_tp=1, decode_tp=1)


@pytest.mark.parametrize("isl,bucket", [(0, 0), (1, 0), (1024, 0), (1025, 1), (2048, 1), (2049, 2), (4096, 2),
                                        (4097, 3), (131072, 7), (10**12, MAX_BUCKET)])
def test_buckets_by_hand(isl, bucket):
    assert prompt_length_bucket(isl) == bucket


@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_monotone_in_prompt_length(a, b):
    lo, hi = sorted((a, b))
    assert prompt_length_bucket(lo) <= prompt_length_bucket(hi)
    assert prefill_order_key_s(lo, 5.0) <= prefill_order_key_s(hi, 5.0)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="isl_tokens"):
        prompt_length_bucket(-1)
    with pytest.raises(ValueError, match="base_tokens"):
        prompt_length_bucket(10, base_tokens=0)
    with pytest.raises(ValueError, match="arrival_s"):
        prefill_order_key_s(10, float("nan"))
    with pytest.raises(ValueError, match="aging_s"):
        prefill_order_key_s(10, 0.0, aging_s=-1.0)
    assert PRIORITY_BASE_TOKENS == 1024 and PRIORITY_AGING_S == 1.0


def test_order_key_and_vllm_priority_by_hand():
    # a 3000-token prompt (bucket 2) at t=100 s ranks with a short prompt arriving 2 s later
    assert prefill_order_key_s(3000, 100.0) == 102.0
    assert prefill_order_key_s(100, 102.0) == 102.0
    assert prefill_order_key_s(3000, 100.0, aging_s=0.5) == 101.0
    assert vllm_priority(3000, 1_764_560_000.25) == 1_764_560_002_250  # wall-clock milliseconds


def test_a_long_prompt_yields_only_to_prompts_arriving_within_its_aging_window():
    # 20000 tokens = bucket 5: it goes before short prompts arriving more than 5 s after it
    key_long = prefill_order_key_s(20000, 0.0)
    assert prefill_order_key_s(500, 4.9) < key_long < prefill_order_key_s(500, 5.1)


def _trace(isl):
    n = len(isl)
    return Trace(np.zeros(n) + np.arange(n) * 1e-3, np.asarray(isl), np.full(n, 2))


def test_short_prompts_overtake_a_queued_long_one():
    # one prefill worker, 0.1 ms/token: a 1000-token prompt runs 0.1 s, then a 20000-token (2 s) and a
    # 500-token one are queued behind it; by length the short one goes first
    isl = [1000, 20000, 500]
    fc = FleetConfig(prefill_tp=1, decode_tp=1, interval_s=10.0, worker_start_s=0.0)
    fifo = simulate(_trace(isl), PROF, fc, static_controller(1, 1))
    by_len = simulate(_trace(isl), PROF, replace(fc, prefill_order="length"), static_controller(1, 1))
    prefill_fifo, prefill_len = fifo.ttft_s - fifo.itl_s, by_len.ttft_s - by_len.itl_s
    assert prefill_fifo[2] == pytest.approx(0.1 + 2.0 + 0.05 - 0.002, abs=0.01)
    assert prefill_len[2] == pytest.approx(0.1 + 0.05 - 0.002, abs=0.01)
    assert prefill_len[1] == pytest.approx(0.1 + 0.05 + 2.0 - 0.001, abs=0.01)
    assert fifo.gpu_seconds == by_len.gpu_seconds


def test_a_request_is_never_started_before_it_arrives():
    isl = [20000, 100, 100, 100]
    arr = np.array([0.0, 0.5, 3.0, 3.0])
    tr = Trace(arr, np.asarray(isl), np.full(4, 2))
    res = simulate(tr, PROF, FleetConfig(prefill_tp=1, decode_tp=1, interval_s=1.0, worker_start_s=0.0,
                                         prefill_order="length"), static_controller(1, 1))
    # the 2 s prompt started at 0; the one arriving at 0.5 s waits for it; the two at 3 s start at once
    assert res.ttft_s[1] == pytest.approx(2.0 - 0.5 + 0.01 + 0.0101, abs=0.01)
    assert res.ttft_s[2] == pytest.approx(0.01 + 0.0101, abs=0.01)
    assert np.all(np.isfinite(res.ttft_s))


def test_clones_do_not_share_the_queue():
    tr = _trace([30000] * 3 + [100] * 3)
    cfg = FleetConfig(prefill_tp=1, decode_tp=1, interval_s=4.0, worker_start_s=0.0, prefill_order="length")
    sim = FleetSim(tr, PROF, cfg)
    sim.step(static_controller(1, 1))
    # the first 3 s prompt ran 0-3 s, then the three short ones, then one long one: one long one waits
    assert [i for _, _, i in sim.prefill_q] == [2]
    twin = sim.clone()
    twin.run(static_controller(1, 1))
    assert sim.prefill_q and not twin.prefill_q
    a = sim.run(static_controller(1, 1))
    b = FleetSim(tr, PROF, cfg).run(static_controller(1, 1))
    np.testing.assert_allclose(a.ttft_s, b.ttft_s)


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="prefill_order"):
        FleetConfig(prefill_tp=1, decode_tp=1, prefill_order="sjf")


def test_long_prompt_waits_a_bounded_time_under_sustained_short_load():
    # one worker overloaded by short prompts (0.09 s each, two every 0.1 s for 60 s: load 1.8) and one
    # 8000-token prompt (0.8 s, bucket 3) at 1 s: by bucket alone it would run after all 1200 short ones
    # (~108 s); with 1 s of aging per bucket it runs once the short prompts that arrived before 4 s are done
    arr = np.repeat(np.arange(600) * 0.1, 2)
    isl = np.full(len(arr), 900)
    arr, isl = np.insert(arr, 21, 1.0), np.insert(isl, 21, 8000)
    tr = Trace(arr, isl, np.full(len(arr), 2))
    cfg = FleetConfig(prefill_tp=1, decode_tp=1, interval_s=5.0, worker_start_s=0.0, prefill_order="length")
    res = simulate(tr, PROF, cfg, static_controller(1, 1))
    # 80 short prompts arrive before 4 s and about 10 run before 1 s: ~70 x 0.09 s + 0.8 s after 1 s
    assert res.ttft_s[21] < 10.0
    fifo = simulate(tr, PROF, replace(cfg, prefill_order="fcfs"), static_controller(1, 1))
    assert fifo.ttft_s[21] < res.ttft_s[21]  # FCFS serves it even earlier; buckets cost it a bounded wait


def test_queued_prompts_never_start_before_the_tick_that_dispatches_them():
    # the only prefill worker leaves at t=1 while three 2 s prompts wait: the decode worker (idle since
    # t=0) takes them over from t=1, not from their arrival
    from runtime.planner.types import ScalingDecision

    tr = Trace(np.array([0.0, 0.1, 0.2, 0.3]), np.full(4, 20000), np.full(4, 2))
    for order in ("fcfs", "length"):
        sim = FleetSim(tr, PROF, FleetConfig(prefill_tp=1, decode_tp=1, interval_s=1.0, worker_start_s=0.0,
                                             initial_prefill=1, initial_decode=1, prefill_order=order))
        sim.run(lambda t: ScalingDecision(now_s=t.now_s, prefill_replicas=0 if t.now_s >= 1.0 else 1,
                                          decode_replicas=1))
        start = sim.prefill_done_s - np.where(np.arange(4) == 0, sim.lat_p, sim.lat_a)
        assert start[0] == pytest.approx(0.0) and np.all(start[1:] >= 1.0 - 1e-9), (order, start)


def test_decode_workers_prefilling_in_aggregated_mode_keep_fcfs():
    # no prefill worker: the decode worker prefills, and the runtime sets no priority there (FCFS)
    isl = [1000, 20000, 500]
    cfg = FleetConfig(prefill_tp=1, decode_tp=1, interval_s=10.0, worker_start_s=0.0, initial_prefill=0)
    fifo = simulate(_trace(isl), PROF, cfg, static_controller(0, 1))
    by_len = simulate(_trace(isl), PROF, replace(cfg, prefill_order="length"), static_controller(0, 1))
    np.testing.assert_allclose(by_len.ttft_s, fifo.ttft_s)
    assert by_len.ttft_s[2] > by_len.ttft_s[1]  # the short one waits behind the long one, as FCFS does
