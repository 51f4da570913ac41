"""SLA replica arithmetic: how many prefill and decode workers a predicted load needs.

Prefill: a pool of ``c`` workers behind a least-loaded router is modelled as an M/M/c queue
(Erlang C) served at the engine occupancy ``s = busy_time(ISL) * ttft_correction``, each request's
TTFT carrying the whole latency ``L = prefill_time(ISL) - busy_time(ISL) + s`` (the fixed API-side
part overlaps other prefills: ``PerfModel.prefill_busy_s``). The pool size is the smallest ``c``
with utilisation ``rate * s / c <= target_utilization`` and ``P(wait > ttft_budget - L) <= 1 -
quantile`` where ``P(W > t) = C(c, a) * exp(-(c/s - rate) t)`` (Kleinrock, Queueing Systems vol. 1,
§3.5; Erlang C via the Erlang-B recursion).

Decode: like Dynamo's ``DecodePlanner._compute_replica_requirements``, demand
``rate * OSL`` tokens/s divided by one worker's throughput at its largest batch whose step time
meets ``itl_target / itl_correction`` and whose KV fits (context ``ISL + OSL/2``).

Aggregated: ``n`` workers at the decode TP both prefill and decode; a worker busy prefilling a
fraction ``u`` of the time stretches decode steps by ``1 / (1 - u)`` (prefill and decode
share the GPU, as with chunked prefill), so decode must meet ``itl_target * (1 - u)``.

Arrival dispersion: the index of dispersion of per-second arrival counts (:func:`arrival_dispersion`).

Burst need: the requests an observed window's arrivals would leave late on ``c`` prefill workers,
replayed first come first served (:func:`burst_misses`).

All functions are pure; rates in requests/s, lengths in tokens, times in seconds.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from runtime.planner.profiles import DecodeProfile, PrefillProfile

# share of a decode worker's KV capacity decode sizing fills (context ISL + OSL/2 per request): the rest
# absorbs the spread of context lengths around that mean, so admissions rarely wait for KV
DECODE_KV_HEADROOM = 0.9


def prefill_service_s(profile: PrefillProfile, isl_tokens: float, ttft_correction: float = 1.0) -> tuple[float, float]:
    """``(occupancy, latency)`` of one prefill of ``isl_tokens``, seconds: the worker is busy for
    ``busy_time * ttft_correction``; the request waits that plus the uncorrected fixed latency
    ``prefill_time - busy_time`` for its first token. The correction scales the engine part only (it
    is measured on vLLM's engine-side prefill time)."""
    isl = max(isl_tokens, 1.0)
    busy = float(profile.busy_time_s(isl))
    fixed = max(float(profile.prefill_time_s(isl)) - busy, 0.0)
    return busy * ttft_correction, fixed + busy * ttft_correction

MAX_REPLICAS_SEARCH = 4096
AGG_MAX_PREFILL_SHARE = 0.5


def erlang_c(num_servers: int, offered_load: float) -> float:
    """Probability an arrival waits in M/M/c with ``num_servers`` = c and ``offered_load`` = a
    (Erlangs = rate * service time). Returns 1.0 when ``a >= c`` (unstable). Raises ValueError
    for c < 1 or a < 0."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    if offered_load < 0:
        raise ValueError(f"offered_load must be >= 0, got {offered_load}")
    a, c = offered_load, num_servers
    if a >= c:
        return 1.0
    b = 1.0
    for k in range(1, c + 1):  # Erlang B recursion
        b = a * b / (k + a * b)
    return c * b / (c - a * (1.0 - b))


def wait_quantile_s(num_servers: int, rate_per_s: float, service_s: float, quantile: float) -> float:
    """``quantile`` of the M/M/c waiting time, seconds (``inf`` when unstable, 0 when the chance of
    waiting is below ``1 - quantile``)."""
    if rate_per_s <= 0:
        return 0.0
    a = rate_per_s * service_s
    drain_per_s = num_servers / service_s - rate_per_s  # > 0 iff a < c, but rounding can split the two
    if a >= num_servers or drain_per_s <= 0:
        return math.inf
    p_wait = erlang_c(num_servers, a)
    tail = 1.0 - quantile
    if p_wait <= tail:
        return 0.0
    return math.log(p_wait / tail) / drain_per_s


def prefill_replicas(
    rate_per_s: float,
    isl_tokens: float,
    profile: PrefillProfile,
    *,
    ttft_budget_s: float,
    ttft_correction: float = 1.0,
    target_utilization: float = 0.9,
    quantile: float = 0.99,
) -> int:
    """Smallest prefill pool meeting the TTFT budget at ``quantile`` (see module doc).

    Returns 0 for zero load. When the service time alone exceeds the budget no pool size helps;
    the utilisation bound is returned then (the caller reports the SLO as infeasible)."""
    if rate_per_s <= 0:
        return 0
    s, latency = prefill_service_s(profile, isl_tokens, ttft_correction)
    a = rate_per_s * s
    c = max(1, math.ceil(a / target_utilization - 1e-9))
    slack = ttft_budget_s - latency
    if slack <= 0:
        return c
    while c < MAX_REPLICAS_SEARCH:
        if wait_quantile_s(c, rate_per_s, s, quantile) <= slack:
            return c
        c += 1
    return c


def expected_ttft_s(rate_per_s: float, isl_tokens: float, num_workers: int, profile: PrefillProfile, quantile: float = 0.9) -> float:
    """Model TTFT at ``quantile``: prefill latency + M/M/c waiting-time quantile at the engine
    occupancy (inf if overloaded)."""
    if num_workers < 1:
        return math.inf
    s, latency = prefill_service_s(profile, isl_tokens)
    return latency + wait_quantile_s(num_workers, rate_per_s, s, quantile)


def decode_replicas(
    rate_per_s: float,
    isl_tokens: float,
    osl_tokens: float,
    profile: DecodeProfile,
    *,
    itl_target_s: float,
    itl_correction: float = 1.0,
    kv_headroom: float = DECODE_KV_HEADROOM,
) -> int | None:
    """Decode workers for ``rate * OSL`` tokens/s at the ITL target (Dynamo's decode formula with a
    KV limit). Returns 0 for zero load and None when no batch meets the corrected target."""
    if rate_per_s <= 0 or osl_tokens <= 0:
        return 0
    ctx = isl_tokens + osl_tokens / 2.0
    per_worker = profile.tokens_per_s(itl_target_s / itl_correction, ctx, ctx / kv_headroom)
    if per_worker <= 0:
        return None
    return max(1, math.ceil(rate_per_s * osl_tokens / per_worker - 1e-9))


def aggregated_replicas(
    rate_per_s: float,
    isl_tokens: float,
    osl_tokens: float,
    prefill_on_decode: PrefillProfile,
    decode: DecodeProfile,
    *,
    ttft_budget_s: float,
    itl_target_s: float,
    max_workers: int,
    quantile: float = 0.99,
) -> int | None:
    """Smallest number of aggregated workers (decode TP) serving both phases within SLO, or None
    if ``max_workers`` are not enough. See the module doc for the interference model."""
    if rate_per_s <= 0:
        return 1
    s, latency = prefill_service_s(prefill_on_decode, isl_tokens)
    ctx = isl_tokens + osl_tokens / 2.0
    for n in range(1, max_workers + 1):
        u = rate_per_s * s / n
        if u > AGG_MAX_PREFILL_SHARE:
            continue
        if latency + wait_quantile_s(n, rate_per_s, s, quantile) > ttft_budget_s:
            continue
        per_worker = decode.tokens_per_s(itl_target_s * (1.0 - u), ctx, ctx / DECODE_KV_HEADROOM)
        if per_worker > 0 and rate_per_s * osl_tokens / n <= per_worker:
            return n
    return None


def arrival_dispersion(arrival_s, start_s: float, end_s: float) -> float | None:
    """Index of dispersion of the requests arriving in ``[start_s, end_s)``, per ~1-s bin and around
    the interval's linear trend: 1 for Poisson arrivals (steady or ramping linearly), ~K when they
    come in clumps of K within a second.

    The interval is cut into ``n = round(end_s - start_s)`` equal bins (width ~1 s: a tick that ran a
    few ms long has no near-empty extra bin). The counts are fitted by least squares on the bin index,
    and the result is the residual variance (``n - 2`` degrees of freedom) over the mean count: a rate
    that changes steadily within the interval is not read as burstiness. ``arrival_s``: arrival times,
    seconds on the same clock (any order, a sequence or array); arrivals outside the interval are left
    out.
    Returns None with fewer than 3 bins (an interval of 2.5 s or less) or no arrival inside.
    Dimensionless, finite, >= 0. A step in the rate within the interval, or traffic that starts or
    stops inside it, still reads partly as burstiness.

    Source: the index of dispersion of counts (Cox & Lewis, "The Statistical Analysis of Series of
    Events", 1966, §4.5); Whitt (1992, "Understanding the efficiency of multi-server service systems",
    Management Science 38(5)) sizes square-root staffing of non-Poisson arrivals by their peakedness,
    which this estimates at the 1-s scale.
    """
    span = end_s - start_s
    bins = int(round(span)) if math.isfinite(span) and span > 0 else 0
    if bins < 3:
        return None
    width = span / bins
    counts = [0] * bins
    n = 0
    for t in arrival_s:
        if start_s <= t < end_s:
            counts[min(int((t - start_s) / width), bins - 1)] += 1
            n += 1
    if n == 0:
        return None
    mean = n / bins
    x_mean = (bins - 1) / 2.0
    sxx = sum((i - x_mean) ** 2 for i in range(bins))
    slope = sum((i - x_mean) * c for i, c in enumerate(counts)) / sxx
    ssr = sum((c - mean - slope * (i - x_mean)) ** 2 for i, c in enumerate(counts))
    return max(ssr / (bins - 2), 0.0) / mean


def burst_misses(arrival_s, occupancy_s, slack_s, first_servers: int, max_servers: int) -> list[int]:
    """Requests of one observed window that a prefill pool of ``c`` workers would serve late, for
    ``c = first_servers, first_servers + 1, ...``: the window's arrivals replayed on ``c`` workers
    from idle, first come first served, each request taking the earliest free worker; request ``i``
    is late when its wait exceeds ``slack_s[i]`` (its TTFT budget less its own prefill latency).
    Requests with ``slack_s[i] < 0`` are never counted: no pool size serves them in time.

    ``arrival_s`` (seconds, any order and clock), ``occupancy_s`` (seconds a worker is busy) and
    ``slack_s`` are equal-length sequences. Stops at the first ``c`` with no late request or at
    ``max_servers``; entry ``k`` of the result is the count at ``first_servers + k`` (so a count
    past the end is 0 when the last entry is 0). Raises ValueError for ``first_servers < 1``,
    ``max_servers < first_servers`` or unequal lengths.

    Measures burstiness at every time scale at once (clumps within a second, bursts over a tick)
    by the queue it would build, not by a dispersion statistic: the least ``c`` with few enough
    late requests is what the window needed (a trace-driven G/G/c replay, Kleinrock 1975,
    "Queueing Systems" vol. 1, ch. 2: FCFS waiting times from arrivals and service times alone).
    """
    if first_servers < 1 or max_servers < first_servers:
        raise ValueError(f"burst_misses: need 1 <= first_servers <= max_servers, got {first_servers}, {max_servers}")
    if not len(arrival_s) == len(occupancy_s) == len(slack_s):
        raise ValueError("burst_misses: arrival_s, occupancy_s and slack_s must have equal lengths")
    order = sorted(range(len(arrival_s)), key=lambda i: arrival_s[i])
    arr = [float(arrival_s[i]) for i in order]
    occ = [float(occupancy_s[i]) for i in order]
    slack = [float(slack_s[i]) for i in order]
    counted = [s >= 0.0 for s in slack]
    out: list[int] = []
    for c in range(first_servers, max_servers + 1):
        free = [arr[0] if arr else 0.0] * c
        late = 0
        for a, o, s, k in zip(arr, occ, slack, counted):
            f = heapq.heappop(free)
            start = a if a > f else f
            heapq.heappush(free, start + o)
            if k and start - a > s:
                late += 1
        out.append(late)
        if late == 0:
            break
    return out


def kv_pool(arrival_s, context_tokens, lifetime_s: float, kv_capacity_tokens: float, quantile: float) -> int:
    """The least number of decode workers whose KV (``kv_capacity_tokens`` each, filled to
    ``DECODE_KV_HEADROOM``) holds, at the arrival of all but ``1 - quantile`` of an observed span's
    requests, the context of every request then in decode: request ``i`` arrives at ``arrival_s[i]``,
    holds ``context_tokens[i]`` tokens (ISL + OSL/2) and stays ``lifetime_s`` (OSL x ITL). 0 without
    requests. Pure; O(n log n). Raises ValueError for unequal lengths, a negative lifetime, a capacity
    <= 0 or ``quantile`` outside [0, 1]."""
    arr = np.asarray(arrival_s, float)
    ctx = np.asarray(context_tokens, float)
    if arr.shape != ctx.shape:
        raise ValueError("kv_pool: arrival_s and context_tokens must have equal lengths")
    if not (lifetime_s >= 0.0 and kv_capacity_tokens > 0.0 and 0.0 <= quantile <= 1.0):
        raise ValueError(f"kv_pool: needs lifetime_s >= 0, kv_capacity_tokens > 0 and quantile in [0, 1], got "
                         f"{lifetime_s}, {kv_capacity_tokens}, {quantile}")
    if not len(arr):
        return 0
    order = np.argsort(arr, kind="stable")
    arr, ctx = arr[order], ctx[order]
    held = np.concatenate([[0.0], np.cumsum(ctx)])
    # requests that arrived at or before request i and have not left by its arrival
    gone = np.searchsorted(arr + lifetime_s, arr, side="right")
    demand = held[1:] - held[np.minimum(gone, np.arange(len(arr)))]
    need = float(np.quantile(demand, quantile))
    return math.ceil(need / (kv_capacity_tokens * DECODE_KV_HEADROOM) - 1e-9)


def least_pool(arrival_s, occupancy_s, slack_s, late_share: float, at_least: int = 0) -> int:
    """The least number of prefill workers on which the requests of an observed span, replayed as in
    :func:`burst_misses` (FCFS from idle, earliest free worker), leave at most ``late_share`` of the
    requests that can be served in time (``slack_s >= 0``) late. 0 without such requests. With
    ``at_least`` the larger of it and that pool, searched from it up: one replay when it serves (the
    planner's longer window, whose pool is usually no more than the predictor window's).

    Doubling from the offered load (total occupancy over the span from the first arrival to the last),
    or from ``at_least``, up to one worker per request (nobody waits then), then bisection; the late
    count does not grow with the pool (FCFS on the earliest free of more workers starts no request
    later). Raises ValueError for unequal lengths, ``late_share`` outside [0, 1] or a negative
    ``at_least``.
    """
    if not len(arrival_s) == len(occupancy_s) == len(slack_s):
        raise ValueError("least_pool: arrival_s, occupancy_s and slack_s must have equal lengths")
    if not 0.0 <= late_share <= 1.0:
        raise ValueError(f"least_pool: late_share must be in [0, 1], got {late_share}")
    if at_least < 0:
        raise ValueError(f"least_pool: at_least must be >= 0, got {at_least}")
    order = sorted(range(len(arrival_s)), key=lambda i: arrival_s[i])
    arr = [float(arrival_s[i]) for i in order]
    occ = [float(occupancy_s[i]) for i in order]
    slack = [float(slack_s[i]) for i in order]
    counted = sum(1 for s in slack if s >= 0.0)
    if counted == 0:
        return at_least
    allowed = late_share * counted

    def late(c: int) -> int:
        free = [arr[0]] * c
        n = 0
        for a, o, s in zip(arr, occ, slack):
            f = heapq.heappop(free)
            start = a if a > f else f
            heapq.heappush(free, start + o)
            if s >= 0.0 and start - a > s:
                n += 1
        return n

    # first guess: the offered load over the span; double until it serves (one worker per request does)
    if at_least:
        if at_least >= len(arr) or late(at_least) <= allowed:
            return at_least
        lo, hi = at_least, min(2 * at_least, len(arr))
    else:
        guess = max(math.ceil(sum(occ) / max(arr[-1] - arr[0], max(occ)) - 1e-9), 1)
        lo, hi = 0, min(guess, len(arr))
    while late(hi) > allowed:
        lo, hi = hi, min(2 * hi, len(arr))
    while hi - lo > 1:  # late(lo) > allowed (or lo == 0), late(hi) <= allowed
        mid = (lo + hi) // 2
        if late(mid) <= allowed:
            hi = mid
        else:
            lo = mid
    return hi
