"""Leader election for the planner of several runtime replicas, as a pure state machine.

Exactly one replica's planner may actuate at a time; every replica computes and exports its decisions. The
replicas share one lease record (a Kubernetes coordination.k8s.io/v1 Lease, or a file on one machine:
runtime/server/leader.py holds the adapters). The rules are client-go's leader election
(k8s.io/client-go/tools/leaderelection/leaderelection.go, `tryAcquireOrRenew`):

1. Every `retry_period_s` each replica reads the record; it creates it, holding it, when there is none.
2. A record that differs from the one last seen (every write changes its version) is "observed" at the
   local time it was read. Expiry is judged on that local observation time plus the record's
   `lease_duration_s`, never on the times written in the record, so the replicas' clocks need not agree.
3. A replica may take the record when it holds it already, when it names no holder (released), or when it has
   not changed for `lease_duration_s` since it was observed. Taking it writes this replica as holder with the
   renew time now; the acquire time and transition count stay when renewing, and the count grows by one
   when the holder changes. The write carries the version read, so of two replicas racing for an expired
   record only one succeeds (the store refuses the other: a conflict).
4. A holder is leader only while its last successful write is less than `renew_deadline_s` old
   (`renew_deadline_s` < `lease_duration_s`), so it stops actuating before any other replica may take over.
5. On shutdown a holder writes a released record (no holder, duration 1 s), so another replica takes over at
   its next read.

A leader that dies is replaced after at most `lease_duration_s + 2 * retry_period_s` (its last write is seen
at most a retry period late, and the takeover happens at most a retry period after expiry).
`ElectionConfig.for_interval` sizes the durations so that this is within one planner interval.

Times are seconds on any monotone clock, passed in by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# client-go's defaults (kube-controller-manager --leader-elect-lease-duration / -renew-deadline /
# -retry-period): 15 s, 10 s, 2 s.
DEFAULT_LEASE_DURATION_S = 15.0
RENEW_DEADLINE_FRACTION = 10.0 / 15.0
RETRY_PERIOD_FRACTION = 2.0 / 15.0
RELEASED_DURATION_S = 1.0  # client-go's release: holder "" and leaseDurationSeconds 1


@dataclass(frozen=True)
class LeaseRecord:
    """The shared record. `holder` "" is a released record; `version` is the store's opaque version of what
    was read (Kubernetes resourceVersion), which every write changes; None on a record to create."""

    holder: str
    lease_duration_s: float
    transitions: int = 0
    version: str | None = None


@dataclass(frozen=True)
class ElectionConfig:
    """Durations of one election, seconds.

    Raises:
        ValueError: not `lease_duration_s > renew_deadline_s > retry_period_s > 0` (client-go's checks).
    """

    lease_duration_s: float = DEFAULT_LEASE_DURATION_S
    renew_deadline_s: float = DEFAULT_LEASE_DURATION_S * RENEW_DEADLINE_FRACTION
    retry_period_s: float = DEFAULT_LEASE_DURATION_S * RETRY_PERIOD_FRACTION

    def __post_init__(self) -> None:
        if not self.lease_duration_s > self.renew_deadline_s > self.retry_period_s > 0:
            raise ValueError("need lease_duration_s > renew_deadline_s > retry_period_s > 0, got "
                             f"{self.lease_duration_s}, {self.renew_deadline_s}, {self.retry_period_s}")

    @classmethod
    def for_interval(cls, interval_s: float) -> "ElectionConfig":
        """client-go's defaults (15 s / 10 s / 2 s) where a lost leader is then replaced within `interval_s`
        (`takeover_bound_s` ≤ `interval_s`: intervals ≥ 19 s); for shorter intervals the same proportions
        with a lease of half the interval (takeover within 0.63 interval).

        Raises:
            ValueError: `interval_s` ≤ 0.
        """
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        default = cls()
        if default.takeover_bound_s <= interval_s:
            return default
        lease = interval_s / 2
        return cls(lease, lease * RENEW_DEADLINE_FRACTION, lease * RETRY_PERIOD_FRACTION)

    @property
    def takeover_bound_s(self) -> float:
        """Longest time from a leader's death to another replica holding the record (module docstring)."""
        return self.lease_duration_s + 2 * self.retry_period_s


@dataclass(frozen=True)
class Write:
    """A write the adapter must attempt: create `record` (`create` True) or update the read one to it (the
    store must refuse the update when its version is no longer `record.version`). `acquired` is True when this
    write takes the record from another holder (the adapter then sets its acquire time)."""

    record: LeaseRecord
    create: bool
    acquired: bool


class LeaderElector:
    """One replica's side of the election (`identity`: its holder name, e.g. the pod name).

    Per retry period the adapter calls `step(now_s, read)` with the record it just read (None: none exists),
    attempts the returned `Write` if any, and reports the outcome with `written(now_s, ok)`. `is_leader(now_s)`
    says whether this replica may actuate now.

    Raises:
        ValueError: an empty `identity`.
    """

    def __init__(self, identity: str, cfg: ElectionConfig) -> None:
        if not identity:
            raise ValueError("identity must be non-empty")
        self.identity = identity
        self.cfg = cfg
        self._observed: LeaseRecord | None = None
        self._observed_s: float | None = None
        self._last_renew_s: float | None = None  # last successful write as holder
        self._pending: Write | None = None
        self.leader_transitions = 0  # times this replica became leader

    def step(self, now_s: float, read: LeaseRecord | None) -> Write | None:
        """The write to attempt after reading `read` at `now_s`; None when another replica holds the record."""
        self._pending = None
        if read is None:
            self._pending = Write(LeaseRecord(self.identity, self.cfg.lease_duration_s), create=True, acquired=True)
            return self._pending
        if self._observed is None or read != self._observed:  # every write changes the version
            self._observed, self._observed_s = read, now_s
        mine = read.holder == self.identity
        if not mine:
            self._last_renew_s = None  # someone else holds it: not leader, whatever we wrote before
            expired = self._observed_s is not None and now_s >= self._observed_s + read.lease_duration_s
            if read.holder and not expired:
                return None
        self._pending = Write(
            LeaseRecord(self.identity, self.cfg.lease_duration_s,
                        read.transitions if mine else read.transitions + 1, read.version),
            create=False, acquired=not mine)
        return self._pending

    def written(self, now_s: float, ok: bool) -> None:
        """The outcome of the write `step` returned (ok False: conflict or store error)."""
        w, self._pending = self._pending, None
        if w is None:
            return
        if ok:
            if not self.is_leader(now_s):
                self.leader_transitions += 1
            self._last_renew_s = now_s
            self._observed, self._observed_s = w.record, now_s
        # a failed write keeps the last renewal: the leader stays leader until its renew deadline passes

    def is_leader(self, now_s: float) -> bool:
        """True while this replica's last successful write is less than `renew_deadline_s` old."""
        return self._last_renew_s is not None and now_s - self._last_renew_s < self.cfg.renew_deadline_s

    def release(self, read: LeaseRecord | None) -> Write | None:
        """The write that gives the record up on shutdown (None when `read` is not held by this replica)."""
        self._last_renew_s = None
        if read is None or read.holder != self.identity:
            return None
        return Write(replace(read, holder="", lease_duration_s=RELEASED_DURATION_S), create=False, acquired=False)
