"""Rule 14 of runtime/planner/state_machine.py: the window pools are held through the gaps after which a
released pool was needed again while short (runtime.planner.stability.RecurrenceHold).

Profile (tests/planner_builders.py): prefill 0.1 ms per prompt token, so a 5000-token prompt occupies a
prefill worker 0.5 s; 2 req/s of them are 1 Erlang, a burst of 20 req/s 10 Erlangs.
"""

import numpy as np
import pytest

from runtime.planner.stability import RecurrenceHold
from runtime.planner.state_machine import PlannerStateMachine
from runtime.sim.fleet import FleetConfig, Trace, simulate
from tests.planner_builders import PROF, planner_cfg


def feed(hold: RecurrenceHold, needs: list[int], ready: int, short_at: set[int] = frozenset()) -> list[int]:
    return [hold.update(n, ready, i in short_at) for i, n in enumerate(needs)]


def test_a_need_that_recurs_while_short_is_held_through_its_gap():
    h = RecurrenceHold(history_ticks=100)
    # a pool of 10 needed for 3 ticks, released to 2 for 8 ticks, needed again at tick 11 while short
    needs = [10] * 3 + [2] * 8 + [10]
    assert feed(h, needs, ready=2, short_at={11}) == needs  # nothing held before the recurrence
    assert h.records == [(9, 10)]  # the last tick that needed 10 was 9 ticks before
    # the next fall holds 10 for 9 ticks, then follows the need
    assert feed(h, [2] * 12, ready=10) == [10] * 9 + [2] * 3


def test_the_hold_reaches_only_the_level_that_came_back():
    h = RecurrenceHold(history_ticks=100)
    # 5 was needed, 4 is ready; a crowd needing 12 finds the pool short: only 5 recurred
    feed(h, [5, 5, 4, 4, 4, 12], ready=4, short_at={5})
    assert h.records == [(4, 5)]  # 5 was last needed 4 ticks before
    assert feed(h, [12, 3, 3, 3], ready=12) == [12, 5, 5, 5]


def test_a_need_that_does_not_recur_records_nothing():
    h = RecurrenceHold(history_ticks=100)
    needs = [3] * 10 + [12] * 4 + [3] * 10
    assert feed(h, needs, ready=3, short_at={10, 11}) == needs  # the crowd's own rise is not a recurrence
    assert h.records == []


def test_without_shortness_nothing_is_held_and_records_expire():
    h = RecurrenceHold(history_ticks=20)
    assert feed(h, [10, 2, 2, 10, 2, 2], ready=2) == [10, 2, 2, 10, 2, 2]
    feed(h, [10, 2, 2, 2, 10], ready=2, short_at={4})
    assert h.records == [(4, 10)]
    feed(h, [2] * 19, ready=2)
    assert h.records == [(4, 10)]
    feed(h, [2], ready=2)
    assert h.records == []  # recorded history_ticks ticks ago
    with pytest.raises(ValueError, match="history_ticks"):
        RecurrenceHold(0)


def bursts(starts: list[float], duration_s: float = 3600.0) -> Trace:
    """2 req/s of 5000-token prompts all along, plus 20 req/s for 60 s from each of ``starts``."""
    rng = np.random.default_rng(0)
    t = list(rng.uniform(0, duration_s, int(2 * duration_s)))
    for s in starts:
        t += list(rng.uniform(s, s + 60.0, 20 * 60))
    arr = np.sort(np.array(t))
    return Trace(arr, np.full(len(arr), 5000), np.full(len(arr), 50))


def late_per_burst(trace: Trace, starts: list[float], **cfg_kw) -> tuple[list[int], float]:
    cfg = planner_cfg(predictor="burst_quantile", max_prefill=60, max_decode=20, gpu_budget=100, **cfg_kw)
    sm = PlannerStateMachine(cfg, PROF, initial_prefill=3, initial_decode=1)
    res = simulate(trace, PROF, FleetConfig(prefill_tp=1, decode_tp=1, initial_prefill=3, initial_decode=1), sm.on_tick)
    ok = (res.ttft_s <= cfg.ttft_target_s) & (res.itl_s <= cfg.itl_target_s)
    late = [int((~ok[(trace.arrival_s >= s) & (trace.arrival_s < s + 60.0)]).sum()) for s in starts]
    return late, res.gpu_seconds


def test_bursts_that_recur_after_the_window_are_served_once_they_have_recurred():
    # 60-s bursts every 8 minutes: each gap (7 min) is longer than the 5-min predictor window, so the window
    # pool releases each burst's workers before the next; a launch at a burst is ready after it is over
    starts = [300.0 + 480.0 * k for k in range(7)]
    trace = bursts(starts)
    held, _ = late_per_burst(trace, starts)
    window_only, _ = late_per_burst(trace, starts, recurrence_hold=False)
    assert held[:2] == window_only[:2]  # nothing to learn from before the second burst
    assert min(window_only[3:]) > 1000  # without the hold every burst finds the pool released
    assert sum(held[3:]) < 0.25 * sum(window_only[3:])


def test_a_crowd_that_does_not_come_back_is_not_held():
    trace = bursts([1500.0])
    assert late_per_burst(trace, [1500.0]) == late_per_burst(trace, [1500.0], recurrence_hold=False)
