"""Admission control: shed a request whose predicted TTFT would break the TTFT SLO (pure, no clock).

Model: the runtime's workers that make first tokens (``servers``, those in rotation) serve the requests
waiting for one (``ahead``, admitted requests without a first token yet) at one request per ``service_s``
each, so a new request's predicted TTFT is its queue wait plus its own service::

    predicted_ttft_s = (ahead / servers + 1) * service_s          (an M/D/c queue's FCFS wait, deterministic)

``service_s`` is learned from the runtime's own first tokens (:class:`ServiceTimeEstimate`): a request that
saw ``a`` requests ahead on ``c`` servers and got its first token after ``t`` seconds implies
``service_s = t / (a / c + 1)``, averaged exponentially. Batching engines (vLLM prefills many prompts in one
step) make ``t`` grow less than linearly with ``a``; the estimate then falls, and the prediction keeps
matching what requests at that queue depth saw.

A request is shed (HTTP 429 with ``Retry-After``) when ``predicted_ttft_s > bound_s`` with
``bound_s = shed_ttft_factor * slo_ttft_s`` (× ``shed_priority_factor`` for priority traffic: prompts in
priority bucket 0 of runtime/router/priority.py, the ones prefill workers serve first, so they are shed
last). Never shed: a request with nothing ahead of it (shedding cannot make it faster, and the estimate
could only be corrected by serving it), or before any first token was seen (no estimate).
``Retry-After`` is the time the queue needs to drain to the bound: ``(ahead - ahead_ok) * service_s /
servers = predicted_ttft_s - bound_s``, rounded up to whole seconds (at least 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.router.priority import prompt_length_bucket

#: Weight of the newest first token in the service-time average: the last ~5 requests dominate, so the
#: estimate follows a change of load within a burst while one odd request moves it by a fifth at most.
SERVICE_EWMA_ALPHA = 0.2


def is_priority(isl_tokens: int) -> bool:
    """Priority traffic: a prompt of `isl_tokens` tokens in priority bucket 0 (runtime/router/priority.py).

    Raises:
        ValueError: `isl_tokens` < 0.
    """
    return prompt_length_bucket(isl_tokens) == 0


class ServiceTimeEstimate:
    """Exponential average of the per-request service time, seconds (None until the first observation)."""

    def __init__(self, alpha: float = SERVICE_EWMA_ALPHA) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value: float | None = None

    def observe(self, ttft_s: float, ahead: int, servers: int) -> None:
        """A first token came `ttft_s` seconds after arrival, with `ahead` requests waiting for theirs on
        `servers` workers at arrival. Non-finite or negative times are ignored (never corrupt the estimate)."""
        if not (math.isfinite(ttft_s) and ttft_s >= 0) or ahead < 0:
            return
        sample = ttft_s / (ahead / max(1, servers) + 1)
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)


@dataclass(frozen=True)
class Admission:
    """One admission decision.

    Attributes:
        admit: serve the request (False: answer 429).
        predicted_ttft_s: predicted TTFT, seconds (0 without an estimate).
        bound_s: the TTFT the request may be predicted at most, seconds.
        retry_after_s: whole seconds a shed client should wait (0 when admitted).
    """

    admit: bool
    predicted_ttft_s: float
    bound_s: float
    retry_after_s: int = 0


def decide(*, ahead: int, servers: int, service_s: float | None, slo_ttft_s: float, factor: float,
           priority: bool = False, priority_factor: float = 1.0) -> Admission:
    """Admit or shed one request (formulas in the module docstring).

    Args:
        ahead: admitted requests still waiting for their first token (>= 0).
        servers: workers in rotation that make first tokens (0 is taken as 1: routing answers that case).
        service_s: per-request service time, seconds (`ServiceTimeEstimate.value`; None: admit).
        slo_ttft_s: the TTFT SLO, seconds (> 0).
        factor: `OverloadSpec.shed_ttft_factor` (> 0; below 1 leaves headroom for the prediction's error).
        priority: the request is priority traffic (`is_priority`).
        priority_factor: `OverloadSpec.shed_priority_factor` (>= 1).

    Raises:
        ValueError: `ahead` < 0, `slo_ttft_s` <= 0, `factor` <= 0 or `priority_factor` < 1.
    """
    if ahead < 0 or not slo_ttft_s > 0 or not factor > 0 or priority_factor < 1:
        raise ValueError(f"ahead={ahead} >= 0, slo_ttft_s={slo_ttft_s} > 0, factor={factor} > 0 and "
                         f"priority_factor={priority_factor} >= 1 expected")
    bound = factor * slo_ttft_s * (priority_factor if priority else 1.0)
    if service_s is None:
        return Admission(True, 0.0, bound)
    predicted = (ahead / max(1, servers) + 1) * service_s
    if ahead == 0 or predicted <= bound:
        return Admission(True, predicted, bound)
    return Admission(False, predicted, bound, max(1, math.ceil(predicted - bound)))
