"""Rule 13 of the SLA planner: observed decode admission waits, ITL and KV usage raise a floor under the
decode pool.

Property: whatever the configuration and the load before, while decode stays overloaded (requests wait for
admission, ITL p90 over its target, KV full) the decode target never falls and rises, within max_decode and
the GPU budget, until no further decode worker fits; once the overload clears the floor falls back to 0.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.planner.state_machine import QUEUE_PRESSURE_TICKS, PlannerStateMachine
from runtime.planner.types import PlannerConfig, PoolObservation, TickInput
from tests.planner_builders import PROF_TP as PROF
from tests.planner_builders import fleet_tick

INTERVAL_S = 30.0
ITL_TARGET_S = 0.05

configs = st.builds(
    dict,
    min_prefill=st.integers(1, 2),
    max_prefill=st.integers(2, 8),
    min_decode=st.integers(1, 2),
    max_decode=st.integers(2, 12),
    gpu_budget=st.integers(14, 80),
    cooldown_s=st.sampled_from([0.0, 30.0, 60.0, 150.0]),
    decode_scale_down_delay_s=st.sampled_from([0.0, 60.0, 120.0, 300.0]),
    predictor=st.sampled_from(["constant", "moving_average", "burst_quantile"]),
    decode_band=st.booleans(),
    allow_aggregated=st.booleans(),
)
warmup = st.lists(st.tuples(st.floats(0, 5), st.floats(0, 0.5)), min_size=0, max_size=12)


def make(c: dict) -> PlannerStateMachine:
    cfg = PlannerConfig(prefill_tp=2, decode_tp=4, interval_s=INTERVAL_S, worker_start_s=60.0,
                        itl_target_s=ITL_TARGET_S, **c)
    return PlannerStateMachine(cfg, PROF)


def tick(sm: PlannerStateMachine, now: float, rate: float, *, waiting: float, itl_p90: float | None,
         kv: float) -> None:
    """One tick whose fleet is what the planner asked for, all of it ready; ``waiting`` requests per decode
    worker wait for admission, 64 run in each batch."""
    fleet_tick(sm, now, rate, isl=500.0, osl=200.0, interval_s=INTERVAL_S,
               decode=dict(queue_per_worker=waiting, running_per_worker=64.0, kv_usage=kv),
               observed_itl_p90_s=itl_p90, observed_itl_mean_s=None if itl_p90 is None else itl_p90 * 0.8)


def room(sm: PlannerStateMachine) -> int:
    """Decode workers the planner could still add: max_decode and the budget left by prefill."""
    cfg = sm.cfg
    return min(cfg.max_decode - sm.decode, (cfg.gpu_budget - sm.prefill * cfg.prefill_tp) // cfg.decode_tp - sm.decode)


def limited_by_prefill_floor(sm: PlannerStateMachine) -> bool:
    """The rest of the budget is held by a prefill pool above its minimum: the floor's cap leaves that to
    the prefill pool's own scale-down (growth is trimmed, never the running fleet)."""
    cfg = sm.cfg
    return sm.decode >= min(cfg.max_decode, (cfg.gpu_budget - cfg.min_prefill * cfg.prefill_tp) // cfg.decode_tp) \
        or sm.prefill > cfg.min_prefill


@settings(max_examples=25, deadline=None)
# 60+ waiting per worker behind 64 running ones of OSL 200 at ~24 ms: an admission wait of 4.5 s and more,
# over the 2-s TTFT budget
@given(configs, warmup, st.floats(0.1, 1.0), st.floats(60.0, 400.0), st.sampled_from(["queue", "itl", "both"]))
def test_sustained_decode_overload_raises_decode_until_the_budget_and_the_floor_falls_after(
        c, series, rate, waiting, cause):
    sm = make(c)
    cfg = sm.cfg
    now = 0.0
    for r, kv in series:  # any light history before
        now += INTERVAL_S
        tick(sm, now, r, waiting=0.0, itl_p90=0.02, kv=kv)
    # a request rate the model sizes one decode worker for: only the observed overload can ask for more
    over = dict(waiting=waiting if cause != "itl" else 0.0, itl_p90=0.08 if cause != "queue" else 0.03, kv=1.0)
    lifted = None
    delay = max(cfg.cooldown_s, cfg.decode_scale_down_delay_s or 0.0)
    ticks_per_rise = QUEUE_PRESSURE_TICKS + math.ceil(delay / INTERVAL_S) + 1
    for i in range(ticks_per_rise + 2 * cfg.max_decode + 2):
        before = sm.decode
        now += INTERVAL_S
        tick(sm, now, rate, **over)
        assert sm.prefill * cfg.prefill_tp + sm.decode * cfg.decode_tp <= cfg.gpu_budget
        assert sm.decode <= cfg.max_decode
        if lifted is None and sm.decode_floor() > 0:
            lifted = i
        if lifted is not None:
            assert sm.decode >= before, "the decode pool fell while it stayed overloaded"
    # the floor lifts within k ticks (and a cooldown), unless the model alone already filled the room
    assert (lifted is not None and lifted < QUEUE_PRESSURE_TICKS + math.ceil(delay / INTERVAL_S) + 1) or (
        room(sm) == 0 and sm.decode_floor() == 0)
    assert room(sm) == 0 or limited_by_prefill_floor(sm), f"sustained overload left room for {room(sm)} decode workers"
    for _ in range(2 * cfg.max_decode + 2):  # the overload is gone: the floor steps down to 0
        now += INTERVAL_S
        tick(sm, now, rate, waiting=0.0, itl_p90=0.02, kv=0.1)
    assert sm.decode_floor() == 0


def test_one_overloaded_tick_is_a_burst_not_a_trend():
    sm = make(dict(max_decode=8, gpu_budget=64, allow_aggregated=False))
    for i in range(4):
        tick(sm, 30.0 * (i + 1), 0.5, waiting=0.0, itl_p90=0.02, kv=0.3)
    tick(sm, 150.0, 0.5, waiting=100.0, itl_p90=0.08, kv=1.0)
    tick(sm, 180.0, 0.5, waiting=0.0, itl_p90=0.02, kv=0.3)
    assert sm.decode_floor() == 0


def test_a_full_kv_holds_the_floor_a_release_would_overfill():
    # the overload cleared (no wait, ITL fine) but the KV in use would not fit one worker fewer: hold
    sm = make(dict(max_decode=8, gpu_budget=64, allow_aggregated=False, decode_scale_down_delay_s=0.0, cooldown_s=0.0))
    now = 0.0
    for _ in range(6):
        now += INTERVAL_S
        tick(sm, now, 0.5, waiting=100.0, itl_p90=0.08, kv=1.0)
    floor = sm.decode_floor()
    assert floor > 1
    for _ in range(3):
        now += INTERVAL_S
        tick(sm, now, 0.5, waiting=0.0, itl_p90=0.02, kv=0.85)
    assert sm.decode_floor() == floor
    now += INTERVAL_S
    tick(sm, now, 0.5, waiting=0.0, itl_p90=0.02, kv=0.3)
    assert sm.decode_floor() == floor // 2


@pytest.mark.parametrize("on", [True, False])
def test_the_floor_is_what_reaches_the_budget_open_loop_stays_below(on):
    # the open loop sizes decode for the forecast rate at mean lengths: a steady admission queue never enters it
    sm = make(dict(max_decode=12, gpu_budget=64, allow_aggregated=False, decode_floor=on))
    for i in range(30):
        tick(sm, 30.0 * (i + 1), 0.5, waiting=50.0, itl_p90=0.03, kv=1.0)
    if on:
        assert sm.decode == 12 and sm.decode_floor() == 12
    else:
        assert sm.decode < 12 and sm.decode_floor() == 0


def test_kv_pool_counts_the_requests_in_decode_at_each_arrival():
    from runtime.planner.sla import DECODE_KV_HEADROOM, kv_pool
    cap = 1000.0 / DECODE_KV_HEADROOM  # each worker holds 1000 tokens within the headroom
    # ten requests of 400 tokens one second apart, each decoding 2.5 s: three at a time at most -> 1200 tokens
    arr = [float(i) for i in range(10)]
    assert kv_pool(arr, [400.0] * 10, 2.5, cap, 1.0) == 2
    # the same requests decoding 0.5 s: one at a time -> one worker
    assert kv_pool(arr, [400.0] * 10, 0.5, cap, 1.0) == 1
    # all ten at once: 4000 tokens -> four workers; the quantile lets the late arrivals' peak go
    assert kv_pool([0.0] * 10, [400.0] * 10, 5.0, cap, 1.0) == 4
    assert kv_pool([0.0] * 10, [400.0] * 10, 5.0, cap, 0.5) < 4
    assert kv_pool([], [], 5.0, cap, 0.99) == 0
    with pytest.raises(ValueError):
        kv_pool([0.0], [1.0, 2.0], 1.0, cap, 0.9)
    with pytest.raises(ValueError):
        kv_pool([0.0], [1.0], -1.0, cap, 0.9)


def _arrivals_tick(sm: PlannerStateMachine, now: float, n: int, isl: float, osl: float) -> None:
    """A tick reporting ``n`` arrivals of ``isl``-token prompts spread over the interval, no overload."""
    arrivals = tuple((now - INTERVAL_S + INTERVAL_S * (i + 0.5) / n, isl) for i in range(n)) if n else None
    sm.on_tick(TickInput(
        now_s=now, interval_s=INTERVAL_S, num_requests=n, mean_isl_tokens=isl if n else 0.0,
        mean_osl_tokens=osl if n else 0.0, prompt_arrivals=arrivals,
        prefill=PoolObservation(num_ready=sm.prefill), decode=PoolObservation(num_ready=sm.decode),
        observed_itl_mean_s=0.02 if n else None,
    ))


def test_decode_holds_the_kv_a_recent_burst_needed_for_a_window():
    # a burst whose contexts fill several workers' KV, then a trickle: the decode pool holds the burst's need
    # for window_hold_s (a decode worker launched for the next burst would be ready after it), then follows
    # the load down
    c = dict(max_decode=16, gpu_budget=200, allow_aggregated=False, decode_scale_down_delay_s=0.0, cooldown_s=0.0,
             max_prefill=16)
    sm = make(c)
    now = 0.0
    for _ in range(sm.cfg.predictor_window_ticks):  # a window of light load
        now += INTERVAL_S
        _arrivals_tick(sm, now, 3, 500.0, 200.0)
    light = sm.decode
    now += INTERVAL_S
    _arrivals_tick(sm, now, 200, 20_000.0, 400.0)  # 6.7 requests/s of 20k-token prompts: ~12 workers of KV
    burst = sm.decode_window_pool
    assert light < burst <= sm.cfg.max_decode
    hold_ticks = max(sm.cfg.predictor_window_ticks, math.ceil(sm.cfg.window_hold_s / INTERVAL_S))
    assert hold_ticks > sm.cfg.predictor_window_ticks  # the default holds longer than the predictor window
    for _ in range(hold_ticks - 1):
        now += INTERVAL_S
        _arrivals_tick(sm, now, 3, 500.0, 200.0)
        assert sm.decode >= burst
    for _ in range(2):
        now += INTERVAL_S
        _arrivals_tick(sm, now, 3, 500.0, 200.0)
    assert sm.decode_window_pool < burst


@pytest.mark.parametrize("measured", [True, False])
def test_a_clump_the_aggregated_pool_cannot_prefill_in_time_leaves_aggregated_serving(measured):
    # twelve 3k-token prompts within 1.2 s every tick: 0.4 requests/s, which M/M/c serves on one worker, but
    # one worker prefills the clump in 3.6 s, past the 2-s TTFT: rule 11's window pool asks for two
    sm = make(dict(max_decode=8, max_prefill=8, gpu_budget=64, scale_down_delay_s=0.0, cooldown_s=0.0,
                   allow_aggregated=True, measure_burst=measured))
    now = 0.0
    for _ in range(sm.cfg.predictor_window_ticks + 1):  # light chat traffic: after a measured window (rule 10),
        now += INTERVAL_S                                  # aggregated serving on the minimum decode pool
        _arrivals_tick(sm, now, 3, 200.0, 100.0)
        assert not (sm._measuring_first_window() and sm.mode == "aggregated")
    assert sm.mode == "aggregated"
    for _ in range(3):
        now += INTERVAL_S
        sm.on_tick(TickInput(
            now_s=now, interval_s=INTERVAL_S, num_requests=12, mean_isl_tokens=3000.0, mean_osl_tokens=100.0,
            prompt_arrivals=tuple((now - 20.0 + 0.1 * i, 3000.0) for i in range(12)),
            prefill=PoolObservation(num_ready=sm.prefill), decode=PoolObservation(num_ready=sm.decode),
        ))
    assert (sm.mode == "disaggregated") == measured


def test_no_release_before_a_window_of_arrivals_was_measured():
    # a fleet started large on light traffic keeps its pools until rule 11 has seen a predictor window, then
    # follows the load down
    sm = PlannerStateMachine(PlannerConfig(prefill_tp=2, decode_tp=4, interval_s=INTERVAL_S, worker_start_s=60.0,
                                           max_prefill=8, max_decode=8, gpu_budget=64, scale_down_delay_s=0.0,
                                           cooldown_s=0.0, decode_scale_down_delay_s=0.0, allow_aggregated=False),
                             PROF, initial_prefill=6, initial_decode=4)
    now = 0.0
    for _ in range(sm.cfg.predictor_window_ticks - 1):
        now += INTERVAL_S
        _arrivals_tick(sm, now, 3, 500.0, 100.0)
        assert (sm.prefill, sm.decode) == (6, 4)
    for _ in range(3):
        now += INTERVAL_S
        _arrivals_tick(sm, now, 3, 500.0, 100.0)
    assert sm.prefill < 6 and sm.decode < 4
