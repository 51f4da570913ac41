"""Per-worker circuit breakers (pure: every time is an argument, nothing reads a clock).

One state machine per worker (:class:`CircuitBreaker`)::

    CLOSED ──k failures in a row, or one fatal failure──▶ OPEN ──cool-down elapsed──▶ HALF_OPEN
       ▲                                                  ▲                               │
       └───────────── `probes` successful probes ─────────┼───────────────────────────────┤
                                                          └────────── a failed probe ──────┘

* CLOSED: the worker takes traffic. A failure (a 5xx answer, a failed health check, a latency outlier)
  counts; a success resets the count. ``failures`` failures in a row, or one *fatal* failure (a refused or
  reset connection: nothing listens), open the breaker.
* OPEN: no traffic and no probes. Outcomes of calls started before it opened are ignored. After
  ``cooldown_s`` it is HALF_OPEN (computed from the time passed in, so no timer is needed).
* HALF_OPEN: still no client traffic; at most one probe at a time (:meth:`CircuitBreaker.try_probe`).
  ``probes`` successful probes close it; one failed probe opens it again for another cool-down. Outcomes
  that are not probes are ignored.

:class:`BreakerBoard` holds the breakers of a pool and each worker's recent probe latencies: a successful
health check slower than ``latency_factor`` × the median latency of the *other* workers (each one's median
over its last ``latency_window`` checks, counted once it has that many), and slower than
``latency_floor_s``, is a failure. So one worker that answers far slower than its peers leaves the rotation,
while a pool that slows down as a whole (a loaded machine) does not: the peers' medians follow it within
about half a window of check rounds, fewer than the failures that open a breaker (defaults: window 3,
failures 3). A worker without peers is never judged by latency. The same pattern is Envoy's
outlier detection (consecutive 5xx; success rate or latency relative to the cluster) and the breaker of
Nygard, *Release It!* (2nd ed., ch. 5).

Draining (scale-down) lives here too, as the other reason a worker is out of the rotation:
:meth:`BreakerBoard.start_drain` takes a worker that a scale-down will remove out of the rotation (whatever
its breaker says) and :meth:`BreakerBoard.drained` says when it may be stopped: when it holds no in-flight
request (its decodes finished, and every request prefilled on it completed, so the decode side has read or
dropped its KV handoff), or once the drain cap has passed (what is still in flight then fails over to
another worker: the runtime's migration path). Kubernetes' pod termination follows the same pattern
(readiness off, then ``terminationGracePeriodSeconds`` before SIGKILL).

Settings come from :class:`runtime.config.OverloadSpec`.
"""

from __future__ import annotations

import statistics
from collections import deque
from enum import IntEnum

from runtime.config import OverloadSpec

class BreakerState(IntEnum):
    """State of a breaker; the value is the one `pdserve_worker_breaker_state` exports."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """The breaker of one worker (see the module docstring).

    Args:
        failures: failures in a row that open it (>= 1).
        cooldown_s: seconds from opening to half-open (> 0).
        probes: successful probes that close a half-open breaker (>= 1).

    Raises:
        ValueError: a setting out of range.
    """

    def __init__(self, failures: int, cooldown_s: float, probes: int) -> None:
        if failures < 1 or probes < 1 or not cooldown_s > 0:
            raise ValueError(f"failures={failures}, probes={probes} must be >= 1 and cooldown_s={cooldown_s} > 0")
        self.failures, self.cooldown_s, self.probes = failures, cooldown_s, probes
        self._state = BreakerState.CLOSED
        self._failed = 0  # CLOSED: failures in a row
        self._opened_at = 0.0  # OPEN: when it opened, seconds
        self._probing = False  # HALF_OPEN: a probe is out
        self._probed = 0  # HALF_OPEN: successful probes so far

    def state(self, now_s: float) -> BreakerState:
        """The state at `now_s` (an OPEN breaker whose cool-down has passed is HALF_OPEN)."""
        if self._state is BreakerState.OPEN and now_s - self._opened_at >= self.cooldown_s:
            self._state, self._probing, self._probed = BreakerState.HALF_OPEN, False, 0
        return self._state

    def allows_traffic(self, now_s: float) -> bool:
        """Whether client requests may go to the worker (CLOSED only)."""
        return self.state(now_s) is BreakerState.CLOSED

    def try_probe(self, now_s: float) -> bool:
        """Take the probe slot: True when HALF_OPEN and no probe is out (the caller then reports the probe's
        outcome with ``probe=True``)."""
        if self.state(now_s) is not BreakerState.HALF_OPEN or self._probing:
            return False
        self._probing = True
        return True

    def record_success(self, now_s: float, *, probe: bool = False) -> BreakerState:
        """A call (or, with `probe`, the probe) succeeded; returns the new state."""
        state = self.state(now_s)
        if state is BreakerState.CLOSED:
            self._failed = 0
        elif state is BreakerState.HALF_OPEN and probe and self._probing:
            self._probing = False
            self._probed += 1
            if self._probed >= self.probes:
                self._state, self._failed = BreakerState.CLOSED, 0
        return self._state

    def record_failure(self, now_s: float, *, fatal: bool = False, probe: bool = False) -> BreakerState:
        """A call (or, with `probe`, the probe) failed; `fatal`: the worker is certainly gone. Returns the new
        state."""
        state = self.state(now_s)
        if state is BreakerState.CLOSED:
            self._failed += 1
            if fatal or self._failed >= self.failures:
                self._open(now_s)
        elif state is BreakerState.HALF_OPEN and probe and self._probing:
            self._open(now_s)
        return self._state

    def release_probe(self) -> None:
        """The probe ended without an outcome (cancelled): the slot is free again."""
        self._probing = False

    def _open(self, now_s: float) -> None:
        self._state, self._opened_at, self._failed, self._probing = BreakerState.OPEN, now_s, 0, False


class BreakerBoard:
    """The breakers of a worker pool, keyed by worker id, plus each worker's recent probe latencies.

    Args:
        spec: breaker settings (`OverloadSpec.breaker_*`).
    """

    def __init__(self, spec: OverloadSpec) -> None:
        self.spec = spec
        self._breakers: dict[str, CircuitBreaker] = {}
        self._latencies: dict[str, deque[float]] = {}
        self._drain_until: dict[str, float] = {}  # worker -> when its drain cap ends, seconds

    def add(self, worker: str) -> None:
        """Track `worker` (CLOSED); a worker already tracked keeps its breaker."""
        if worker not in self._breakers:
            self._breakers[worker] = CircuitBreaker(self.spec.breaker_failures, self.spec.breaker_cooldown_s,
                                                    self.spec.breaker_probes)
            self._latencies[worker] = deque(maxlen=self.spec.breaker_latency_window)

    def remove(self, worker: str) -> None:
        """Forget `worker` (left the pool); unknown ids are ignored."""
        self._breakers.pop(worker, None)
        self._latencies.pop(worker, None)
        self._drain_until.pop(worker, None)

    def __contains__(self, worker: object) -> bool:
        return worker in self._breakers

    def workers(self) -> list[str]:
        """Ids of the tracked workers."""
        return list(self._breakers)

    def breaker(self, worker: str) -> CircuitBreaker:
        """The breaker of `worker` (added on first use)."""
        self.add(worker)
        return self._breakers[worker]

    def state(self, worker: str, now_s: float) -> BreakerState:
        """State of `worker`'s breaker at `now_s`."""
        return self.breaker(worker).state(now_s)

    def start_drain(self, worker: str, now_s: float, cap_s: float) -> None:
        """Take `worker` out of the rotation for removal, for at most `cap_s` seconds from `now_s` (a worker
        already draining keeps its first deadline).

        Raises:
            ValueError: `cap_s` negative or not finite.
        """
        if not (0 <= cap_s < float("inf")):
            raise ValueError(f"drain cap_s must be a finite number >= 0, got {cap_s}")
        self.add(worker)
        self._drain_until.setdefault(worker, now_s + cap_s)

    def end_drain(self, worker: str) -> None:
        """`worker` stays after all (a scale-up took it back): in the rotation again as its breaker allows."""
        self._drain_until.pop(worker, None)

    def draining(self, worker: str) -> bool:
        """Whether `worker` is draining (out of the rotation until it is removed)."""
        return worker in self._drain_until

    def drained(self, worker: str, now_s: float, in_flight: int) -> bool:
        """Whether a draining `worker` holding `in_flight` requests may be stopped at `now_s`: nothing in
        flight, or its drain cap has passed. False for a worker that is not draining."""
        until = self._drain_until.get(worker)
        return until is not None and (in_flight <= 0 or now_s >= until)

    def allows_traffic(self, worker: str, now_s: float) -> bool:
        """Whether client requests may go to `worker`: its breaker is closed and it is not draining."""
        return not self.draining(worker) and self.breaker(worker).allows_traffic(now_s)

    def baseline_s(self, worker: str) -> float | None:
        """The latency `worker` is judged against, seconds: the median over the other workers with a full
        window of recent latencies (`breaker_latency_window`) of each one's median; None without such a peer."""
        peers = [statistics.median(d) for w, d in self._latencies.items()
                 if w != worker and len(d) == d.maxlen]
        return statistics.median(peers) if peers else None

    def is_outlier(self, worker: str, latency_s: float) -> bool:
        """Whether a successful check of `worker` taking `latency_s` seconds is a latency outlier: slower than
        `breaker_latency_floor_s` and than `breaker_latency_factor` × `baseline_s(worker)`."""
        if latency_s <= self.spec.breaker_latency_floor_s:
            return False
        base = self.baseline_s(worker)
        return base is not None and latency_s > self.spec.breaker_latency_factor * base

    def record_check(self, worker: str, now_s: float, ok: bool, latency_s: float | None = None, *,
                     fatal: bool = False, probe: bool = False) -> BreakerState:
        """A health check or probe of `worker` answered (`ok`) in `latency_s` seconds, or failed (`fatal`:
        refused or reset connection). A latency outlier counts as a failure. Returns the new state."""
        b = self.breaker(worker)
        if ok and latency_s is not None:
            slow = self.is_outlier(worker, latency_s)
            self._latencies[worker].append(latency_s)
            if slow:
                return b.record_failure(now_s, probe=probe)
        if ok:
            return b.record_success(now_s, probe=probe)
        return b.record_failure(now_s, fatal=fatal, probe=probe)

    def record_call(self, worker: str, now_s: float, ok: bool, *, fatal: bool = False) -> BreakerState:
        """A client request's call to `worker` succeeded (`ok`) or failed (`fatal`: refused or reset
        connection). Returns the new state."""
        b = self.breaker(worker)
        return b.record_success(now_s) if ok else b.record_failure(now_s, fatal=fatal)
