"""M/D/1 queueing for prefill workers (DistServe, Zhong et al., OSDI 2024, section 3.1).

A prefill worker serves requests one at a time with deterministic service time ``D`` (the prefill time of
the mean prompt); requests arrive as a Poisson process of rate ``lam``. With utilisation ``rho = lam * D``:

* mean wait (Pollaczek-Khinchine for deterministic service): ``Wq = rho * D / (2 * (1 - rho))``;
  DistServe's average TTFT is ``D + Wq``.
* q-quantile of the wait: exponential tail approximation for M/G/1 (Kingman; e.g. Kleinrock, Queueing
  Systems Vol. 2, section 2.9): ``P(W > t) ~= rho * exp(-t / Wd)`` with ``Wd = Wq / rho`` the mean wait of
  the requests that do wait, so the quantile is ``Wd * ln(rho / (1 - q))`` when ``rho > 1 - q``, else 0.

Pure functions of floats (seconds, requests/s).
"""

from __future__ import annotations

import math


def md1_mean_wait_s(rate_per_s: float, service_s: float) -> float:
    """Mean queueing delay of M/D/1, seconds; ``inf`` when ``rate * service >= 1``.

    Raises:
        ValueError: negative rate or non-positive service time.
    """
    if rate_per_s < 0 or service_s <= 0:
        raise ValueError(f"need rate_per_s >= 0 and service_s > 0, got {rate_per_s}, {service_s}")
    rho = rate_per_s * service_s
    if rho >= 1:
        return math.inf
    return rho * service_s / (2 * (1 - rho))


def md1_wait_quantile_s(rate_per_s: float, service_s: float, q: float = 0.9) -> float:
    """q-quantile of the M/D/1 queueing delay (exponential tail approximation), seconds."""
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q}")
    wq = md1_mean_wait_s(rate_per_s, service_s)
    rho = rate_per_s * service_s
    if math.isinf(wq):
        return math.inf
    if rho <= 1 - q:
        return 0.0
    return (wq / rho) * math.log(rho / (1 - q))


def ttft_quantile_s(rate_per_s: float, service_s: float, q: float = 0.9, extra_s: float = 0.0) -> float:
    """TTFT q-quantile = queueing delay quantile + prefill service time + ``extra_s`` (e.g. KV transfer)."""
    return md1_wait_quantile_s(rate_per_s, service_s, q) + service_s + extra_s


def max_rate_under_ttft(service_s: float, ttft_slo_s: float, q: float = 0.9, extra_s: float = 0.0) -> float:
    """Largest arrival rate (requests/s) whose TTFT q-quantile meets ``ttft_slo_s``; 0 if even an idle
    worker misses it. Bisection on the utilisation (the quantile is increasing in the rate)."""
    if service_s + extra_s > ttft_slo_s:
        return 0.0
    lo, hi = 0.0, 1.0 / service_s
    for _ in range(60):
        mid = (lo + hi) / 2
        if ttft_quantile_s(mid, service_s, q, extra_s) <= ttft_slo_s:
            lo = mid
        else:
            hi = mid
    return lo


def mg1_wait_quantile_s(rate_per_s: float, mean_service_s: float, second_moment_s2: float, q: float = 0.9) -> float:
    """q-quantile of the M/G/1 queueing delay for general service times (prompts of varying length).

    Pollaczek-Khinchine mean wait ``Wq = rate * E[S^2] / (2 (1 - rho))``, ``rho = rate * E[S]``; the same
    exponential tail approximation as :func:`md1_wait_quantile_s` (which this equals when ``E[S^2] = E[S]^2``).
    """
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q}")
    if rate_per_s < 0 or mean_service_s <= 0 or second_moment_s2 < mean_service_s**2 * (1 - 1e-9):
        raise ValueError("need rate >= 0, E[S] > 0 and E[S^2] >= E[S]^2")
    rho = rate_per_s * mean_service_s
    if rho >= 1:
        return math.inf
    if rho <= 1 - q:
        return 0.0
    wq = rate_per_s * second_moment_s2 / (2 * (1 - rho))
    return (wq / rho) * math.log(rho / (1 - q))


def max_rate_under_ttft_mg1(
    mean_service_s: float, second_moment_s2: float, service_quantile_s: float, ttft_slo_s: float,
    q: float = 0.9, extra_s: float = 0.0,
) -> float:
    """Largest rate whose approximate TTFT q-quantile ``service_quantile_s + wait quantile + extra_s`` meets
    ``ttft_slo_s`` (0 if even an idle worker misses it)."""
    if service_quantile_s + extra_s > ttft_slo_s:
        return 0.0
    lo, hi = 0.0, 1.0 / mean_service_s
    for _ in range(60):
        mid = (lo + hi) / 2
        if service_quantile_s + extra_s + mg1_wait_quantile_s(mid, mean_service_s, second_moment_s2, q) <= ttft_slo_s:
            lo = mid
        else:
            hi = mid
    return lo
