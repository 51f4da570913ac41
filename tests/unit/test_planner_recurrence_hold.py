"""Rule 14 of runtime/planner/state_machine.py: the window pools are held through the gaps after which a
released pool was needed again while short (runtime.planner.stability.RecurrenceHold).

Profile (tests/planner_builders.py): prefill 0.1 ms per prompt token, so a 5000-token prompt occupies a
prefill worker 0.5 s; 2 req/s of them are 1 Erlang, a burst of 20 req/s 10 Erlangs.
"""

import pytest

from runtime.planner.stability import RecurrenceHold
from tests.planner_builders import bursts, late_per_burst


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


def test_bursts_that_recur_after_the_window_are_served_once_they_have_recurred():
    # 60-s bursts every 8 minutes: each gap (7 min) is longer than the 5-min predictor window, so the window
    # pool (window_hold_s 0: the predictor window alone) releases each burst's workers before the next; a
    # launch at a burst is ready after it is over
    starts = [300.0 + 480.0 * k for k in range(7)]
    trace = bursts(starts)
    held, _ = late_per_burst(trace, starts, window_hold_s=0.0)
    window_only, _ = late_per_burst(trace, starts, recurrence_hold=False, window_hold_s=0.0)
    assert held[:2] == window_only[:2]  # nothing to learn from before the second burst
    assert min(window_only[3:]) > 1000  # without the hold every burst finds the pool released
    assert sum(held[3:]) < 0.25 * sum(window_only[3:])


def test_a_crowd_that_does_not_come_back_is_not_held():
    trace = bursts([1500.0])
    assert late_per_burst(trace, [1500.0]) == late_per_burst(trace, [1500.0], recurrence_hold=False)
