"""Admission control (runtime/router/admission.py): when a request is shed, and with what Retry-After."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.router.admission import ServiceTimeEstimate, decide, is_priority
from runtime.router.priority import PRIORITY_BASE_TOKENS


def test_a_queue_that_would_break_the_slo_by_the_factor_is_shed_with_the_drain_time():
    # 6 ahead on 2 servers at 0.5 s each: (3 + 1) x 0.5 = 2.0 s predicted; bound 1.5 x 1.0 s
    d = decide(ahead=6, servers=2, service_s=0.5, slo_ttft_s=1.0, factor=1.5)
    assert not d.admit and d.predicted_ttft_s == pytest.approx(2.0) and d.bound_s == pytest.approx(1.5)
    assert d.retry_after_s == 1  # 0.5 s of draining, rounded up to whole seconds
    assert decide(ahead=4, servers=2, service_s=0.5, slo_ttft_s=1.0, factor=1.5).admit  # 1.5 s: on the bound


def test_retry_after_is_the_time_to_drain_to_the_bound():
    d = decide(ahead=40, servers=1, service_s=0.5, slo_ttft_s=2.0, factor=1.0)
    # 20.5 s predicted, 2 s allowed: the 37 requests beyond the bound take 18.5 s on one server
    assert d.retry_after_s == math.ceil(20.5 - 2.0) == 19


def test_priority_traffic_is_shed_last():
    kw = dict(ahead=5, servers=1, service_s=0.5, slo_ttft_s=1.0, factor=2.0, priority_factor=2.0)
    assert not decide(**kw).admit  # 3 s > 2 s
    assert decide(**kw, priority=True).admit  # 3 s <= 4 s
    assert not decide(**{**kw, "ahead": 9}, priority=True).admit  # 5 s > 4 s


def test_never_shed_without_a_queue_or_without_an_estimate():
    assert decide(ahead=0, servers=1, service_s=60.0, slo_ttft_s=1.0, factor=1.0).admit
    assert decide(ahead=100, servers=1, service_s=None, slo_ttft_s=1.0, factor=1.0).admit


@pytest.mark.parametrize("kw", [dict(ahead=-1), dict(slo_ttft_s=0), dict(factor=0), dict(priority_factor=0.9)])
def test_bad_arguments_are_refused(kw):
    args = dict(ahead=1, servers=1, service_s=1.0, slo_ttft_s=1.0, factor=1.0) | kw
    with pytest.raises(ValueError):
        decide(**args)


def test_priority_is_bucket_zero_of_the_prefill_priority():
    assert is_priority(1) and is_priority(PRIORITY_BASE_TOKENS) and not is_priority(PRIORITY_BASE_TOKENS + 1)


def test_the_service_time_is_learned_from_first_tokens_per_queue_position():
    est = ServiceTimeEstimate(alpha=1.0)
    assert est.value is None
    est.observe(3.0, ahead=4, servers=2)  # 3 s after arriving behind 2 per server: 1 s each
    assert est.value == pytest.approx(1.0)
    est.observe(float("nan"), ahead=0, servers=1)
    est.observe(-1.0, ahead=0, servers=1)
    assert est.value == pytest.approx(1.0)
    est = ServiceTimeEstimate(alpha=0.5)
    est.observe(1.0, 0, 1)
    est.observe(3.0, 0, 1)
    assert est.value == pytest.approx(2.0)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(0, 8), st.floats(0.001, 30), st.floats(0.01, 10), st.floats(0.1, 5),
       st.floats(1, 4))
def test_shedding_is_monotone_in_the_queue_and_priority_never_sheds_first(ahead, servers, service, slo, factor, pf):
    kw = dict(servers=servers, service_s=service, slo_ttft_s=slo, factor=factor, priority_factor=pf)
    d, longer = decide(ahead=ahead, **kw), decide(ahead=ahead + 1, **kw)
    assert d.admit or not longer.admit  # a longer queue never admits what a shorter one sheds
    if not decide(ahead=ahead, priority=True, **kw).admit:
        assert not d.admit  # priority traffic is shed only when other traffic is too
    if not d.admit:
        assert d.retry_after_s >= 1 and d.predicted_ttft_s > d.bound_s
    else:
        assert d.retry_after_s == 0
