"""Length-aware prefill priority (runtime/router/priority.py) and the simulator's "length" order."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.planner.profiles import analytic_profile
from runtime.router.priority import MAX_PRIORITY, PRIORITY_BASE_TOKENS, prefill_priority
from runtime.sim.fleet import FleetConfig, FleetSim, Trace, simulate, static_controller

PROF = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4, kv_capacity_tokens=1_000_000,
                        prefill_tp=1, decode_tp=1)


@pytest.mark.parametrize("isl,bucket", [(0, 0), (1, 0), (1024, 0), (1025, 1), (2048, 1), (2049, 2), (4096, 2),
                                        (4097, 3), (131072, 7), (10**12, MAX_PRIORITY)])
def test_buckets_by_hand(isl, bucket):
    assert prefill_priority(isl) == bucket


@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_monotone_in_prompt_length(a, b):
    lo, hi = sorted((a, b))
    assert prefill_priority(lo) <= prefill_priority(hi)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="isl_tokens"):
        prefill_priority(-1)
    with pytest.raises(ValueError, match="base_tokens"):
        prefill_priority(10, base_tokens=0)
    assert PRIORITY_BASE_TOKENS == 1024


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
