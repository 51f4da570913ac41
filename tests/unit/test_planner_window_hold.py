"""Rules 11 and 13 of runtime/planner/state_machine.py: the window pools replay the arrivals of the last
predictor window and of the last ``window_hold_s``, so a burst shorter than a worker start keeps its pool
standing through the gaps of traffic whose bursts recur within the hold.

Profile (tests/planner_builders.py): prefill 0.1 ms per prompt token, so a 5000-token prompt occupies a
prefill worker 0.5 s; 2 req/s of them are 1 Erlang, a burst of 20 req/s 10 Erlangs.
"""

import math

import numpy as np


from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PoolObservation, TickInput
from tests.planner_builders import PROF, bursts, late_per_burst, planner_cfg

INTERVAL_S = 30.0


def test_bursts_that_recur_within_the_hold_are_served_from_the_second_on():
    # 60-s bursts every 8 minutes: each gap (7 min) is longer than the 5-min predictor window and shorter
    # than the default hold (10 min); rule 14 off, so only the hold can keep the pool standing
    starts = [300.0 + 480.0 * k for k in range(7)]
    trace = bursts(starts)
    held, _ = late_per_burst(trace, starts, recurrence_hold=False)
    window, _ = late_per_burst(trace, starts, recurrence_hold=False, window_hold_s=0.0)
    assert held[0] == window[0] > 1000  # the first burst meets the standing fleet either way
    assert min(window[1:]) > 1000  # the predictor window alone releases the pool before each burst
    assert sum(held[1:]) < 0.1 * sum(window[1:])


def test_a_crowd_that_does_not_come_back_is_released_after_the_hold():
    cfg = planner_cfg(predictor="burst_quantile", max_prefill=60, max_decode=20, gpu_budget=100,
                      scale_down_delay_s=0.0, cooldown_s=0.0, recurrence_hold=False)
    sm = PlannerStateMachine(cfg, PROF, initial_prefill=2, initial_decode=1)
    now = 0.0

    def feed(n: int) -> None:
        nonlocal now
        now += INTERVAL_S
        arrivals = tuple((now - INTERVAL_S + INTERVAL_S * (i + 0.5) / n, 5000.0) for i in range(n))
        sm.on_tick(TickInput(now_s=now, interval_s=INTERVAL_S, num_requests=n, mean_isl_tokens=5000.0,
                             mean_osl_tokens=50.0, prompt_arrivals=arrivals,
                             prefill=PoolObservation(num_ready=sm.prefill),
                             decode=PoolObservation(num_ready=sm.decode), observed_itl_mean_s=0.02))

    for _ in range(cfg.predictor_window_ticks):
        feed(60)  # 2 req/s: 1 Erlang
    light = sm.window_pool
    feed(600)  # 20 req/s for a tick: 10 Erlangs
    crowd = sm.window_pool
    assert crowd > light
    hold_ticks = math.ceil(cfg.window_hold_s / INTERVAL_S)
    assert hold_ticks > cfg.predictor_window_ticks
    for _ in range(hold_ticks - 1):
        feed(60)
        assert sm.window_pool == crowd and sm.prefill >= crowd
    feed(60)
    assert sm.window_pool == light
    for _ in range(2):
        feed(60)
    assert sm.prefill < crowd


def test_the_hold_never_lowers_a_window_pool_after_a_shift_to_longer_prompts():
    # Poisson arrivals of short prompts, then of long ones: over a span longer than the predictor window the
    # new prompts are a smaller share and the quantile would let more of them be late; the predictor
    # window's own pool is kept, so at every tick the pools with the hold are at least those without it
    rng = np.random.default_rng(1)
    ticks = []
    for median, n_ticks in ((500.0, 30), (6000.0, 12)):
        for _ in range(n_ticks):
            t = np.sort(rng.uniform(0.0, INTERVAL_S, rng.poisson(6.0 * INTERVAL_S)))
            ticks.append(list(zip(t, rng.lognormal(math.log(median), 0.7, len(t)))))
    pools = {}
    for hold_s in (0.0, 600.0):
        cfg = planner_cfg(predictor="burst_quantile", max_prefill=60, max_decode=20, gpu_budget=100,
                          window_hold_s=hold_s)
        sm = PlannerStateMachine(cfg, PROF, initial_prefill=2, initial_decode=1)
        seen = []
        for k, arrivals in enumerate(ticks):
            now = (k + 1) * INTERVAL_S
            sm.on_tick(TickInput(
                now_s=now, interval_s=INTERVAL_S, num_requests=len(arrivals),
                mean_isl_tokens=float(np.mean([n for _, n in arrivals])), mean_osl_tokens=50.0,
                prompt_arrivals=tuple((now - INTERVAL_S + a, float(n)) for a, n in arrivals),
                prefill=PoolObservation(num_ready=sm.prefill), decode=PoolObservation(num_ready=sm.decode),
                observed_itl_mean_s=0.02))
            seen.append((sm.window_pool, sm.decode_window_pool))
        pools[hold_s] = seen
    assert pools[0.0][-1][0] > pools[0.0][29][0]  # the shift raises the prefill window pool
    for k, ((p0, d0), (p1, d1)) in enumerate(zip(pools[0.0], pools[600.0])):
        assert p1 >= p0 and d1 >= d0, (k, (p0, d0), (p1, d1))
