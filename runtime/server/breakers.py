"""The runtime's worker rotation: one circuit breaker per worker (runtime.router.breaker), fed by every worker
call and health check, acting on the pairing. The one place that decides whether a worker takes traffic.

* Every call of a request to a worker reports its outcome (`record_call`): a refused or reset connection
  opens the worker's breaker at once; 5xx answers count as failures (`OverloadSpec.breaker_failures` in a row
  open it); an answer resets the count; a timeout (504: a busy worker) counts neither way.
* `check_round` (every 2 s, `check_loop`) asks each worker's `/health` and feeds the answer and its latency
  to the board: a failed check, or one far slower than the other workers' (`BreakerBoard.is_outlier`), is a
  failure, so one slow check no longer takes a worker out. Open workers are not checked; a half-open
  worker's check is its probe (one at a time; `breaker_probes` good probes close it, a bad one reopens it).
  A worker that has not yet answered a check since it joined the pool is *starting*: its failed checks do
  not count against its breaker (vLLM loads for minutes), but one takes a decode worker out of the pairing's
  rotation until it answers, so it is never a request's decode worker (a prefill worker stays in: a request it
  cannot take is prefilled locally); it does not make the runtime ready.
* A breaker that leaves CLOSED takes the worker out of the pairing (`mark_down`); one that closes puts it
  back (`mark_up`). Half-open workers get probes only, no client request.
* A worker a scale-down removes is *draining* (`drain`): out of the rotation whatever its breaker says,
  until the actuator stops it once `drained` (no request in flight, or the drain cap passed); `undrain`
  takes it back when a scale-up keeps it.
* A breaker that opens, and every check round while it stays open or half-open, abandons the worker's calls in
  flight that have received nothing for `silent_s`, when the worker's last health check (or probe) failed as
  well: a breaker opened by 5xx answers, slow checks or one cut stream while /health answers leaves a live
  worker's queued calls alone (`on_down`, runtime.server.model: their readers get a
  worker-gone error and the request migrates as from a dead worker). A hung worker (it accepts requests and
  answers nothing, its /health included) would otherwise hold them for the whole read timeout. `silent_s` is
  the breaker's own evidence window, `breaker_failures` check rounds of at most `CHECK_INTERVAL_S` +
  `HEALTH_TIMEOUT_S` each (12 s with the defaults): a call silent that long was silent through every failed
  check that opened the breaker; a stream still producing tokens (a live engine's decode steps take well under
  a second) is never silent that long, so a breaker opened on a slow but live worker does not cut it. A
  non-streamed answer shows nothing until it is whole, so one not whole within `silent_s` on a worker judged
  down is served again elsewhere.
* A worker can hang with its /health answering (its engine loop stuck: it accepts requests and streams
  nothing more). A check round judges each CLOSED worker whose check answered by its streams in flight
  (`stalled`, runtime.engines.h1.H1Pool.stall_verdict): when at least one of them has sent its first chunk
  and every such stream has received nothing for `OverloadSpec.breaker_stall_s`, the worker is *stalled*
  and the round counts a failed check, as if /health had failed; its last check counts as failed, so once
  the breaker opens `on_down` abandons its calls silent for min(`silent_s`, `breaker_stall_s`) (the stall
  verdict is the evidence) and their requests migrate as from a dead worker. A live engine streams every
  running request at each step, so its streams are never all silent that long; streams that may pause for
  many steps of a live engine (a client's `stream_interval` above 1, `tools`: runtime.engines.client
  .steady_stream) and streams whose client does not read (their reading paused) are left out of the verdict,
  neither making nor clearing it; a queue wait before the first
  token (vLLM under load queues new requests, and writes a stream's head before its first chunk) and a
  non-streamed call show nothing until they start or end, so they neither make nor clear the verdict. A
  worker that was judged stalled stays suspect until one of its streams produces again: meanwhile its
  streams waiting for a first chunk for `breaker_stall_s` count as silent too, so an engine still stuck
  when its breaker closes after the half-open probes (/health answered them) is taken out again by the
  requests it queues rather than holding them for the read timeout. The log line of a stalled round and of
  the breaker it opens say "stalled".
* `pdserve_worker_breaker_state{role, worker}` shows every worker's state (0 closed, 1 half-open, 2 open).
* The pool is followed (`sync`) on every check round and whenever the pairing's `pool_version` moves (a
  worker joined or left), not on every request: a request's calls only look the pool up again when it
  changed. Breakers that pass their cool-down between rounds turn half-open on their first query (the board
  decides that lazily); the gauge shows it from the next round on, within one check interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from runtime.config import OverloadSpec
from runtime.engines.client import HEALTH_TIMEOUT_S, BackendError
from runtime.redact import redact_userinfo
from runtime.router.breaker import BreakerBoard, BreakerState

log = logging.getLogger(__name__)

_UNSYNCED = object()  # no pool version seen yet / the pairing keeps none
#: seconds between two health-check rounds (`check_loop`'s default, what runtime.server.app runs)
CHECK_INTERVAL_S = 2.0


def pool_workers(pairing: Any) -> dict[str, tuple[str, str, object]]:
    """`{base URL: (worker id, role, identity)}` of the pairing's pool: runtime.server.routing.RouterPairing's
    `workers` (identity: the endpoint object, new when a worker leaves and joins again) or
    RoundRobinPairing's URL lists (ids "prefill-i" / "decode-i"); {} for a pairing that exposes neither."""
    workers = getattr(pairing, "workers", None)
    if isinstance(workers, dict):
        return {w.url.rstrip("/"): (wid, getattr(w, "role", "decode"), w) for wid, w in workers.items()}
    out: dict[str, tuple[str, str, object]] = {}
    for role in ("prefill", "decode"):
        for i, url in enumerate(getattr(pairing, f"{role}_urls", None) or ()):
            out[url.rstrip("/")] = (f"{role}-{i}", role, role)
    return out


class WorkerBreakers:
    """Breakers of the pairing's workers (see the module docstring).

    Args:
        pairing: the runtime's pairing (`mark_down(url)` / `mark_up(url)` take a worker out / back).
        spec: breaker settings.
        gauge: `RuntimeMetrics.breaker_state` (labels role, worker) or None.
        label: worker id → the `worker` label value (never an address: runtime.server.model.public_worker_id).
        clock: monotonic seconds.
        on_down: called with (base URL, `silent_s`) when a worker's breaker opens and on every check round
            while it is open or half-open: abandon the worker's calls silent for `silent_s` seconds (see the
            module docstring). None: nothing is abandoned.
        check_interval_s: seconds between check rounds, for `silent_s`.
        stalled: `(base URL, window seconds, waiting) -> True | False | None`, the worker's streams in flight
            judged as runtime.engines.h1.H1Pool.stall_verdict does (True: stalled); None: no worker is ever
            judged stalled.
    """

    def __init__(self, pairing: Any, spec: OverloadSpec, *, gauge: Any = None,
                 label: Callable[[str], str] = str, clock: Callable[[], float] = time.monotonic,
                 on_down: Callable[[str, float], None] | None = None,
                 check_interval_s: float = CHECK_INTERVAL_S,
                 stalled: Callable[[str, float, bool], bool | None] | None = None) -> None:
        self.pairing, self.spec, self.gauge, self.label, self.clock = pairing, spec, gauge, label, clock
        self.on_down = on_down
        #: seconds without a byte after which a call to a worker judged down is abandoned (module docstring)
        self.silent_s = spec.breaker_failures * (check_interval_s + HEALTH_TIMEOUT_S)
        self.stalled = stalled
        #: seconds every begun stream of a worker is silent for it to be stalled (module docstring)
        self.stall_s = spec.breaker_stall_s
        self._suspect: set[str] = set()  # URLs judged stalled and not seen producing since
        self._stall_failed: set[str] = set()  # URLs whose last check counted as failed for a stall
        self.board = BreakerBoard(spec)
        self._known: dict[str, tuple[str, str, object]] = {}  # URL -> (id, role, identity) as last synced
        self._seen: set[str] = set()  # URLs that answered a health check since they joined
        # URL -> whether its last health check (or probe) answered: only a worker whose own /health fails has its
        # silent calls abandoned (`_down`); a breaker opened by 5xx answers, slow checks or one cut stream leaves
        # a live worker's queued calls alone
        self._check_ok: dict[str, bool] = {}
        self._failed_start: set[str] = set()  # starting URLs whose last check failed
        self._applied: dict[str, bool] = {}  # URL -> in the pairing's rotation as last applied
        # URL -> the state the gauge shows (also without a gauge: its change to OPEN calls `on_down`): every call
        # of every request reports its outcome, and a gauge update (label lookup, lock) per call costs more than
        # the rest of the report
        self._gauged: dict[str, BreakerState] = {}
        self._pool_version: object = _UNSYNCED  # the pairing's `pool_version` at the last sync

    # -- state ------------------------------------------------------------------------------------------
    def sync(self) -> None:
        """Follow the pool (workers that joined start CLOSED and *starting*; those that left, or left and
        came back, are forgotten), move breakers whose cool-down passed to half-open, and apply each state
        to the pairing and the gauge."""
        self._pool_version = getattr(self.pairing, "pool_version", _UNSYNCED)
        pool = pool_workers(self.pairing)
        for url in [u for u in self._known if u not in pool or pool[u][2] is not self._known[u][2]]:
            self._forget(url)
        now = self.clock()
        for url, entry in pool.items():
            self._known[url] = entry
            self._apply(url, self.board.state(url, now))

    def follow_pool(self) -> None:
        """`sync` when the pool changed since the last one (the pairing's `pool_version` moved; every time for a
        pairing without one): what a request's calls need, at the cost of one attribute read."""
        version = getattr(self.pairing, "pool_version", _UNSYNCED)
        if version is _UNSYNCED or version != self._pool_version:
            self.sync()

    def _forget(self, url: str) -> None:
        wid, role, _ = self._known.pop(url)
        self.board.remove(url)
        self._seen.discard(url)
        self._check_ok.pop(url, None)
        self._suspect.discard(url)
        self._stall_failed.discard(url)
        self._failed_start.discard(url)
        self._applied.pop(url, None)
        self._gauged.pop(url, None)
        if self.gauge is not None:
            try:
                self.gauge.remove(role, self.label(wid))
            except KeyError:
                pass

    def _apply(self, url: str, state: BreakerState) -> None:
        entry = self._known.get(url)
        if entry is None:
            return
        wid, role, _ = entry
        if self._gauged.get(url) is not state:
            if self.gauge is not None:
                self.gauge.labels(role, self.label(wid)).set(int(state))
            self._gauged[url] = state
            if state is BreakerState.OPEN:
                self._down(url)
        # a starting decode worker whose check failed is out of the pairing too: the router would otherwise keep
        # choosing it (least loaded: nothing runs there) and each request would have to choose again. A starting
        # prefill worker stays in: a request it cannot take falls back to a local prefill at once, and one that
        # has just come up serves the first requests rather than waiting for the next check round
        starting = url in self._failed_start and role != "prefill"
        rotate = state is BreakerState.CLOSED and not self.board.draining(url) and not starting
        if self._applied.get(url, True) == rotate and url in self._applied:
            return
        self._applied[url] = rotate
        if rotate:
            log.info("worker %s (%s): breaker closed, back in rotation", wid, redact_userinfo(url))
            self.pairing.mark_up(url)
        else:
            why = ("draining" if self.board.draining(url) else f"breaker {state.name.lower()}"
                   if state is not BreakerState.CLOSED else "starting (no health check answered yet)")
            if url in self._stall_failed and state is not BreakerState.CLOSED:
                why += f" (stalled: its streams silent for {self.stall_s:g} s while /health answers)"
            log.warning("worker %s (%s): %s, out of rotation", wid, redact_userinfo(url), why)
            self.pairing.mark_down(url)

    def state(self, url: str) -> BreakerState:
        """The breaker state of the worker at `url` now."""
        return self.board.state(url.rstrip("/"), self.clock())

    def usable(self, url: str) -> bool:
        """Whether a request may be sent to the worker at `url`: its breaker is closed and it is not a starting
        worker whose last health check failed."""
        key = url.rstrip("/")
        return self.board.allows_traffic(key, self.clock()) and key not in self._failed_start

    def serving(self, url: str) -> bool:
        """Breaker closed and answered a health check since it joined (what readiness counts)."""
        key = url.rstrip("/")
        return key in self._seen and self.board.allows_traffic(key, self.clock())

    def any_decode_serving(self) -> bool:
        """Some decode-capable worker (any role but "prefill") is `serving`: what makes the runtime ready.
        Asked on every request, so it reads the synced pool rather than building the pairing's URL list."""
        self.follow_pool()
        now = self.clock()
        return any(r != "prefill" and url in self._seen and self.board.allows_traffic(url, now)
                   for url, (_, r, _) in self._known.items())

    def in_rotation(self, role: str) -> int:
        """Workers of `role` ("prefill" or "decode": decode-capable) that take traffic: breaker closed, and not
        a starting worker whose check failed (`usable`)."""
        self.follow_pool()
        now = self.clock()
        roles = ("prefill",) if role == "prefill" else ("decode", "both")
        return sum(1 for url, (_, r, _) in self._known.items()
                   if r in roles and self.board.allows_traffic(url, now) and url not in self._failed_start)

    def any_open(self, role: str) -> bool:
        """Whether some worker of `role` (as `in_rotation`) has a breaker that is not closed."""
        now = self.clock()
        roles = ("prefill",) if role == "prefill" else ("decode", "both")
        return any(r in roles and self.board.state(url, now) is not BreakerState.CLOSED
                   for url, (_, r, _) in self._known.items())

    def _down(self, url: str) -> None:
        """The worker at `url` is out of the rotation: where its last health check failed too, `on_down` abandons
        its silent calls (errors logged, never raised: the caller is reporting some other call's outcome)."""
        if self.on_down is None or self._check_ok.get(url) is not False:
            return
        silent_s = min(self.silent_s, self.stall_s) if url in self._stall_failed else self.silent_s
        try:
            self.on_down(url, silent_s)
        except Exception:
            log.exception("abandoning the silent calls of worker %s failed", redact_userinfo(url))

    # -- draining ----------------------------------------------------------------------------------------
    def drain(self, url: str, cap_s: float) -> None:
        """Take the worker at `url` out of the rotation for removal, for at most `cap_s` seconds (then it is
        `drained` whatever it still serves). Unknown URLs are ignored."""
        self.follow_pool()
        key = url.rstrip("/")
        if key not in self._known:
            return
        self.board.start_drain(key, self.clock(), cap_s)
        self._apply(key, self.board.state(key, self.clock()))

    def undrain(self, url: str) -> None:
        """The worker at `url` stays after all: back in the rotation as its breaker allows."""
        key = url.rstrip("/")
        if not self.board.draining(key):
            return
        self.board.end_drain(key)
        self._apply(key, self.board.state(key, self.clock()))

    def draining(self, url: str) -> bool:
        """Whether the worker at `url` is draining."""
        return self.board.draining(url.rstrip("/"))

    def drained(self, url: str, in_flight: int) -> bool:
        """Whether the draining worker at `url`, holding `in_flight` requests, may be stopped now (nothing in
        flight, or its cap passed)."""
        return self.board.drained(url.rstrip("/"), self.clock(), in_flight)

    # -- outcomes -------------------------------------------------------------------------------------------
    def record_call(self, url: str, exc: BackendError | None) -> None:
        """Outcome of one request's call to the worker at `url`: None (answered), or the worker's error."""
        self.follow_pool()
        key = url.rstrip("/")
        if key not in self._known:
            return
        now = self.clock()
        if exc is None or (400 <= exc.status_code < 500 and not exc.unreachable):
            state = self.board.record_call(key, now, True)
        elif exc.unreachable:
            self._failed_start.discard(key)
            state = self.board.record_call(key, now, False, fatal=True)
        elif exc.status_code == 504:  # timed out: a busy worker, not a failing one
            return
        else:
            state = self.board.record_call(key, now, False)
        self._apply(key, state)

    def record_check(self, url: str, ok: bool, latency_s: float | None = None, *, probe: bool = False,
                     stalled: bool = False) -> None:
        """Outcome of a health check (or, with `probe`, a half-open worker's probe) of the worker at `url`;
        `stalled`: it answered but the worker is stalled (module docstring), a failed check."""
        key = url.rstrip("/")
        if key not in self._known:
            return
        now = self.clock()
        if stalled:  # its /health answered: a worker that has started, whose check counts as failed
            self._seen.add(key)
            self._failed_start.discard(key)
            self._stall_failed.add(key)
            ok = False
        else:
            self._stall_failed.discard(key)
        self._check_ok[key] = ok
        if ok:
            self._seen.add(key)
            self._failed_start.discard(key)
        elif key not in self._seen:  # still starting: its failed checks do not count against its breaker
            self._failed_start.add(key)
            if probe:
                self.board.breaker(key).release_probe()
            self._apply(key, self.board.state(key, now))  # but it leaves the rotation until it answers
            return
        self._apply(key, self.board.record_check(key, now, ok, latency_s, probe=probe))

    async def check_round(self, check: Callable[[str], Awaitable[bool]]) -> None:
        """Check every worker once, concurrently: closed workers' health, half-open workers' probe (open ones
        wait for their cool-down)."""
        self.sync()

        async def one(url: str) -> None:
            now = self.clock()
            state = self.board.state(url, now)
            if state is not BreakerState.CLOSED:  # calls that fell silent since it opened
                self._down(url)
            if state is BreakerState.OPEN:
                return
            probe = state is BreakerState.HALF_OPEN
            if probe and not self.board.breaker(url).try_probe(now):
                return
            t0 = self.clock()
            try:
                ok = await check(url)
            except BaseException:
                if probe:
                    self.board.breaker(url).release_probe()
                raise
            latency_s = self.clock() - t0
            stalled = ok and not probe and self._is_stalled(url)
            self.record_check(url, ok, latency_s, probe=probe, stalled=stalled)

        await asyncio.gather(*(one(u) for u in list(self._known)))
        self.sync()

    def _is_stalled(self, url: str) -> bool:
        """Judge the closed worker at `url` by its streams in flight (module docstring); errors are logged and
        judge nothing."""
        if self.stalled is None:
            return False
        suspect = url in self._suspect
        try:
            verdict = self.stalled(url, self.stall_s, suspect)
        except Exception:
            log.exception("judging the streams of worker %s failed", redact_userinfo(url))
            return False
        if verdict is False:
            self._suspect.discard(url)
        if not verdict:
            return False
        self._suspect.add(url)
        wid = self._known[url][0] if url in self._known else "?"
        log.warning("worker %s (%s): stalled: /health answers but its streams in flight received nothing for "
                    "%g s; counted as a failed check", wid, redact_userinfo(url), self.stall_s)
        return True


async def check_loop(breakers: WorkerBreakers, check: Callable[[str], Awaitable[bool]], *,
                     interval_s: float = CHECK_INTERVAL_S) -> None:
    """Forever: `breakers.check_round(check)` every `interval_s` seconds. Cancel the task to stop."""
    while True:
        await breakers.check_round(check)
        await asyncio.sleep(interval_s)
