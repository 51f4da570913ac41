"""Per-worker circuit breaker (runtime/router/breaker.py): transitions, latency outliers, properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import OverloadSpec
from runtime.router.breaker import BreakerBoard, BreakerState, CircuitBreaker

MIN_LATENCY_SAMPLES = 3  # the default breaker_latency_window

CLOSED, HALF, OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN


def test_k_failures_in_a_row_open_it_and_a_success_between_resets_the_count():
    b = CircuitBreaker(failures=3, cooldown_s=10, probes=2)
    b.record_failure(0)
    b.record_failure(1)
    b.record_success(2)
    b.record_failure(3)
    assert b.record_failure(4) is CLOSED and b.allows_traffic(4)
    assert b.record_failure(5) is OPEN and not b.allows_traffic(5)


def test_a_fatal_failure_opens_it_at_once():
    b = CircuitBreaker(failures=3, cooldown_s=10, probes=1)
    assert b.record_failure(0, fatal=True) is OPEN


def test_cooldown_then_half_open_probes_close_it():
    b = CircuitBreaker(failures=1, cooldown_s=10, probes=2)
    b.record_failure(100)
    assert b.state(109.9) is OPEN and not b.try_probe(109.9)
    assert b.state(110) is HALF
    assert not b.allows_traffic(110)  # half-open: probes only, no client traffic
    assert b.try_probe(110) and not b.try_probe(110)  # one probe at a time
    assert b.record_success(111, probe=True) is HALF
    assert b.try_probe(112)
    assert b.record_success(113, probe=True) is CLOSED and b.allows_traffic(113)


def test_a_failed_probe_opens_it_again_for_a_whole_cooldown():
    b = CircuitBreaker(failures=1, cooldown_s=10, probes=1)
    b.record_failure(0)
    assert b.try_probe(10)
    assert b.record_failure(12, probe=True) is OPEN
    assert b.state(21.9) is OPEN and b.state(22) is HALF


def test_outcomes_of_calls_started_before_it_opened_are_ignored():
    b = CircuitBreaker(failures=1, cooldown_s=10, probes=1)
    b.record_failure(0)
    assert b.record_success(1) is OPEN  # a request that was in flight answers late
    assert b.record_success(10) is HALF  # not a probe: does not close it
    assert b.record_failure(10) is HALF  # not a probe: does not reopen it either


def test_a_cancelled_probe_frees_the_slot():
    b = CircuitBreaker(failures=1, cooldown_s=1, probes=1)
    b.record_failure(0)
    assert b.try_probe(1)
    b.release_probe()
    assert b.try_probe(1)


@pytest.mark.parametrize("kw", [dict(failures=0, cooldown_s=1, probes=1), dict(failures=1, cooldown_s=0, probes=1),
                                dict(failures=1, cooldown_s=1, probes=0)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        CircuitBreaker(**kw)


def _board(**kw) -> BreakerBoard:
    return BreakerBoard(OverloadSpec(breaker_failures=2, breaker_latency_factor=5, breaker_latency_floor_s=0.5, **kw))


def test_a_check_far_slower_than_its_peers_is_a_failure():
    board = _board()
    for i in range(MIN_LATENCY_SAMPLES):
        board.record_check("fast", 0, True, 0.01 + i * 0.001)
    assert board.record_check("slow", 1, True, 0.9) is CLOSED  # one outlier counts as one failure
    assert board.record_check("slow", 2, True, 0.9) is OPEN
    assert board.state("fast", 2) is CLOSED


def test_a_pool_slow_as_a_whole_a_lone_worker_and_the_floor_are_not_outliers():
    board = _board()
    assert not board.is_outlier("a", 100.0)  # no peer: no baseline
    for _ in range(MIN_LATENCY_SAMPLES):
        board.record_check("a", 0, True, 0.05)
    assert not board.is_outlier("a", 100.0)  # judged against the others only
    assert not board.is_outlier("b", 0.4)  # 8 x the baseline but under the floor: never an outlier
    assert board.is_outlier("b", 0.6)
    for t in range(20):  # the whole pool slows down together: nobody is an outlier
        assert board.record_check("a", t, True, 2.0) is CLOSED
        assert board.record_check("b", t, True, 2.0) is CLOSED
    assert not board.is_outlier("b", 3.0)


def test_a_peer_needs_a_few_samples_to_count_in_the_baseline():
    board = _board()
    for _ in range(MIN_LATENCY_SAMPLES - 1):
        board.record_check("a", 0, True, 0.01)
    assert board.baseline_s("b") is None
    board.record_check("a", 0, True, 0.01)
    assert board.baseline_s("b") == pytest.approx(0.01)


def test_calls_count_like_checks_and_removed_workers_are_forgotten():
    board = _board()
    board.record_call("w", 0, False)
    assert board.record_call("w", 1, False) is OPEN
    board.remove("w")
    assert "w" not in board and board.state("w", 2) is CLOSED  # back as a new worker


# ---- properties: random event sequences against the specification -----------------------------------
EVENTS = st.lists(st.tuples(st.sampled_from(["ok", "fail", "fatal", "probe", "probe_ok", "probe_fail",
                                             "cancel"]),
                            st.floats(min_value=0, max_value=30, allow_nan=False)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.integers(1, 4), st.integers(1, 3), st.floats(0.5, 20))
def test_the_state_machine_follows_its_specification(events, k, probes, cooldown):
    b = CircuitBreaker(failures=k, cooldown_s=cooldown, probes=probes)
    now, prev = 0.0, CLOSED
    fails_in_row, opened_at, probing, probed = 0, None, False, 0
    for kind, dt in events:
        now += dt
        state = b.state(now)
        # time alone only moves OPEN -> HALF_OPEN, exactly when the cool-down has passed
        if prev is OPEN:
            assert state is (HALF if now - opened_at >= cooldown else OPEN)
            if state is HALF:
                probing, probed = False, 0
        else:
            assert state is prev
        if kind == "ok":
            new = b.record_success(now)
            fails_in_row = 0 if state is CLOSED else fails_in_row
            assert new is state
        elif kind in ("fail", "fatal"):
            new = b.record_failure(now, fatal=kind == "fatal")
            if state is CLOSED:
                fails_in_row += 1
                expect = OPEN if kind == "fatal" or fails_in_row >= k else CLOSED
                assert new is expect
                if new is OPEN:
                    opened_at, fails_in_row = now, 0
            else:
                assert new is state  # OPEN / HALF_OPEN ignore client outcomes
        elif kind == "probe":
            got = b.try_probe(now)
            assert got == (state is HALF and not probing)
            probing = probing or got
            new = state
        elif kind == "cancel":
            b.release_probe()
            probing, new = False, state
        else:
            ok = kind == "probe_ok"
            new = b.record_success(now, probe=True) if ok else b.record_failure(now, probe=True)
            if state is HALF and probing:
                probing = False
                if ok:
                    probed += 1
                    assert new is (CLOSED if probed >= probes else HALF)
                    fails_in_row = 0
                else:
                    assert new is OPEN
                    opened_at = now
            elif state is CLOSED:  # a probe outcome outside half-open counts as a plain outcome
                if ok:
                    fails_in_row = 0
                else:
                    fails_in_row += 1
                    if fails_in_row >= k:
                        assert new is OPEN
                        opened_at, fails_in_row = now, 0
                if new is not OPEN:
                    assert new is CLOSED
            else:
                assert new is state
        assert b.allows_traffic(now) == (new is CLOSED)
        # never from CLOSED straight to HALF_OPEN, never from OPEN straight to CLOSED
        assert not (state is CLOSED and new is HALF) and not (state is OPEN and new is CLOSED)
        prev = new


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=40), st.integers(1, 5))
def test_fewer_than_k_failures_between_successes_never_open_it(outcomes, k):
    b = CircuitBreaker(failures=k, cooldown_s=1, probes=1)
    run = 0
    for t, ok in enumerate(outcomes):
        state = b.record_success(t) if ok else b.record_failure(t)
        run = 0 if ok else run + 1
        if run < k and state is OPEN:
            pytest.fail("opened before k failures in a row")
        if state is OPEN:
            break
