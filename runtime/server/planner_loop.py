"""The runtime's planner loop (adapter): every ``interval_s`` read the workers' ``/metrics`` and the
runtime's own request window, run the pure planner (``PlannerStateMachine.on_tick``), apply the
decision with an actuator, and export what it saw and decided as Prometheus gauges.

Worker metrics read (vLLM v1 names, vllm/v1/metrics/loggers.py): ``vllm:num_requests_waiting``,
``vllm:num_requests_running`` (gauges, requests, summed over a data-parallel worker's engines) and
``vllm:kv_cache_usage_perc`` (0-1, each engine's share of its own cache: averaged over the engines; older
releases ``vllm:gpu_cache_usage_perc``). A worker that is draining (leaving after a scale-down, out of the
rotation) is not read: it is no capacity to count on. A worker whose ``/metrics`` does not answer with a complete page
within the read deadline (the whole request, not each network read: see ``fetch_pages``), or errors other than
a refused connection, counts as ready with its last readings for up to ``STALE_READS_MAX`` consecutive failed reads when an earlier read of it
succeeded (an overloaded worker is the one likely to answer slowly: dropping it would hide load just when it is
highest, and the simulator always gives the planner every ready worker's gauges); a worker never read, or silent
for longer, counts as starting, not ready. From the prefill workers also the histogram
``vllm:request_prefill_time_seconds`` (cumulative ``_sum``/``_count``): the mean prefill time of the requests
that finished prefill in the interval (:class:`PrefillTimeMeter`, deltas per worker, a worker's baseline kept
over its failed reads and reset when ``process_start_time_seconds`` shows a new process) goes to the planner as
``TickInput.observed_prefill_time_mean_s``; queueing does not enter it, so the SLA correction of the
prefill service time follows slower engines, not bursts.

Exported gauges (prefix ``pdserve_planner_``): ``prefill_replicas``, ``decode_replicas`` (decided),
``applied_replicas{pool="prefill"|"decode"}`` (what the actuator reports it runs or targets after applying the
decision: fewer than decided under a worker cap or a restart back-off, unchanged when applying failed),
``aggregated`` (0/1), ``burst`` (0/1), ``predicted_rate_per_second``, ``predicted_isl_tokens``,
``predicted_osl_tokens``, ``observed_rate_per_second``, ``observed_ttft_p90_seconds``,
``observed_itl_p90_seconds``, ``ttft_correction``, ``itl_correction``,
``observed_peak_prefill_tokens_per_second``, ``observed_prefill_time_mean_seconds``,
``observed_arrival_dispersion`` (runtime.planner.sla.arrival_dispersion of the requests received in the last
interval: residual variance / mean per ~1-s bin around the interval's trend; 1 for Poisson), ``gpus`` (the
decision's replicas × TP) and ``gpu_budget``, ``leader`` (1 while this replica's planner actuates), and the
counters ``scale_events_total{pool, direction}`` and ``actuations_total`` (decisions handed to the actuator).

A worker a scale-down removed keeps its GPUs until its drain ends (runtime.server.actuators, the actuator's
``draining_counts``): each tick runs the state machine with ``gpu_budget`` less those GPUs (never below the
GPUs its current pools use, so a drain blocks growth but forces no scale-down), and a scale-up elsewhere cannot
start workers on GPUs a draining worker still holds.

With several runtime replicas only the leader actuates (``PlannerLoop(leader=...)``, runtime/server/leader.py):
every replica reads the workers, ticks its own state machine and exports the decision; a follower skips the
actuator, and its ``applied_replicas``, ``scale_events_total`` and ``actuations_total`` stay unchanged.

Each observation goes into the window in which it happened, as the fleet simulator counts it
(runtime/sim/fleet.py), so that the planner the benchmarks replay is the one that runs here: a request is an
arrival when it comes in (its prompt length from the tokenizer, or the body's estimate until its worker's count
comes back within the same window), its TTFT counts when its first token reaches the client, its output length,
ITL and duration when it ends. Counted later (after its prefill, or at its end), a burst's arrivals would reach
the planner only as fast as the prefill pool serves them: a queue that grows would not show in the rate.
The sub-tick peak handed to the planner (``TickInput.peak_prefill_tokens_per_s``) is computed exactly as
the simulator does (``_peak_tokens_per_s``): the prompt tokens arriving in each 1-s bin of the interval, then
their ``PEAK_BIN_QUANTILE`` (0.9) quantile; the arrival dispersion (``TickInput.arrival_dispersion``) is
runtime.planner.sla.arrival_dispersion over the same arrival times. The window's requests, each with the time
it arrived and its prompt length, go to the planner as ``TickInput.prompt_arrivals``, which replays them on
candidate prefill pools (rule 11).

Every request received is an arrival, answered or not: one that failed, that the client abandoned or that
admission control shed is demand too, or shedding would hide the very load that calls for more workers. The
means of TTFT, ITL and request duration (arrival to last token) go to the planner as the simulator gives them;
a non-streamed answer's TTFT is its remote prefill's answer (the client sees no earlier token), and one whose
decode worker prefilled it shows no first token and gives no TTFT or ITL.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import httpx
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from runtime.config import DeploymentSpec
from runtime.engines.metrics import readable_gauge, sample_mean, sample_sum
from runtime.planner.sla import arrival_dispersion
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig, PoolObservation, ScalingDecision, TickInput
from runtime.redact import redact_userinfo
from runtime.server.actuators import Actuator, Applied

log = logging.getLogger(__name__)

PEAK_BIN_QUANTILE = 0.9  # same quantile as the simulator (runtime/sim/fleet.py)
KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFILL_TIME = "vllm:request_prefill_time_seconds"  # histogram, seconds (vllm/v1/metrics/loggers.py)
# prometheus_client's process collector (default registry), Unix epoch seconds. vLLM serves it with one API
# server; with several (--api-server-count > 1, a multiprocess registry) the page lacks it.
PROCESS_START_TIME = "process_start_time_seconds"
# Consecutive failed /metrics reads for which a worker read before still counts as ready with its last
# readings. An overloaded worker misses a deadline or two; past two intervals its old gauges say too little
# about now, and a worker silent that long is more likely restarting or gone than busy.
STALE_READS_MAX = 2


@dataclass(frozen=True)
class WorkerReading:
    """A worker's last successful /metrics read: ``waiting`` and ``running`` (requests) and ``kv_usage``
    (0-1), and ``failed_reads``, the consecutive failed reads since."""

    waiting: float
    running: float
    kv_usage: float
    failed_reads: int = 0


@dataclass(frozen=True)
class WindowStats:
    """Requests seen by the runtime since the last drain."""

    num_requests: int
    num_priority_requests: int
    mean_isl_tokens: float
    p90_isl_tokens: float | None
    mean_osl_tokens: float
    ttft_p90_s: float | None
    itl_p90_s: float | None
    peak_prefill_tokens_per_s: float | None = None
    span_s: float = 0.0  # seconds the window covered (previous drain to this one)
    arrival_dispersion: float | None = None  # runtime.planner.sla.arrival_dispersion of the arrivals
    prompt_arrivals: tuple[tuple[float, float], ...] | None = None  # (arrival_s, prompt tokens) per request
    # means over the answered requests, seconds (as runtime/sim/fleet.py feeds TickInput's)
    ttft_mean_s: float | None = None
    itl_mean_s: float | None = None
    duration_mean_s: float | None = None  # arrival to last token


def scale_window(w: WindowStats, factor: float) -> WindowStats:
    """The window of all the runtime replicas' requests, from one replica's that saw 1/`factor` of them (its
    router's share of the decode workers' requests, `RouterPairing.drain_traffic_share`): counts and the
    sub-tick peak scaled by `factor`, each prompt arrival repeated ``factor`` times (the fraction by a
    deterministic stride, so n requests become ``n * int(factor) + floor(n * frac(factor))`` in the counts and
    in the arrivals alike) within the second after it, as the others' requests of a burst arrive with it.
    Means and percentiles are the replica's sample of the same traffic: unchanged; so is the dispersion, which
    a balancer dealing clumps out across replicas lowers (docs/design/planner.md, "Several runtime
    replicas"). Pure.

    Raises:
        ValueError: `factor` < 1 or not finite.
    """
    if not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"scale_window: factor must be a finite number >= 1, got {factor!r}")
    whole, frac = int(factor), factor - int(factor)

    def scaled(n: int) -> int:  # the stride below summed over n requests (it telescopes to this)
        return n * whole + math.floor(n * frac)

    arrivals = None
    if w.prompt_arrivals:
        out: list[tuple[float, float]] = []
        for i, (t, n) in enumerate(w.prompt_arrivals):
            copies = whole + (1 if math.floor((i + 1) * frac) > math.floor(i * frac) else 0)
            out += [(t + j / copies, n) for j in range(copies)]
        arrivals = tuple(sorted(out))
    return dataclasses.replace(
        w, num_requests=scaled(w.num_requests), num_priority_requests=scaled(w.num_priority_requests),
        peak_prefill_tokens_per_s=None if w.peak_prefill_tokens_per_s is None else w.peak_prefill_tokens_per_s * factor,
        prompt_arrivals=arrivals)


def peak_tokens_per_s(
    arrival_s: list[float] | np.ndarray,
    tokens: list[int] | np.ndarray,
    start_s: float,
    end_s: float,
    quantile: float = PEAK_BIN_QUANTILE,
) -> float | None:
    """``quantile`` of the tokens arriving per 1-s bin of ``[start_s, end_s)``, tokens/s.

    The interval has ``max(ceil(end_s - start_s), 1)`` bins; an arrival outside it is counted in the
    nearest bin (as runtime/sim/fleet.py does). Returns None when nothing arrived.

    Raises:
        ValueError: ``arrival_s`` and ``tokens`` of different lengths, or ``quantile`` outside (0, 1].
    """
    if len(arrival_s) != len(tokens):
        raise ValueError(f"arrival_s has {len(arrival_s)} entries, tokens {len(tokens)}")
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    if len(arrival_s) == 0:
        return None
    num_bins = max(int(np.ceil(end_s - start_s)), 1)
    idx = np.clip(np.floor(np.asarray(arrival_s, dtype=float) - start_s).astype(int), 0, num_bins - 1)
    per_s = np.bincount(idx, weights=np.asarray(tokens, dtype=float), minlength=num_bins)
    return float(np.quantile(per_s, quantile))


class RequestWindow:
    """Thread-safe request counters the runtime feeds, each in the window in which it happened, as the fleet
    simulator counts them (runtime/sim/fleet.py): ``record_arrival`` as a request comes in (its prompt length
    then known or estimated; ``correct_arrival`` gives the worker's count when it answers within the same
    window), ``record_first_token`` when the client's first token is sent, ``record_finish`` when it ends.
    ``drain`` returns and resets them; the window of a drain runs from the previous drain (or creation) to now
    on ``clock`` (monotonic seconds, injectable)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self.clock = clock
        self._since_s = clock()
        self._arrival_s: list[float] = []
        self._isl: list[int] = []
        self._keyed: dict[str, int] = {}  # key -> index in _isl of the arrivals record_arrival named
        self._prio = 0
        self._osl: list[int] = []
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._duration: list[float] = []

    def record_arrival(self, isl_tokens: int, *, priority: bool = False, ago_s: float = 0.0,
                       key: str | None = None) -> None:
        """One request of ``isl_tokens`` prompt tokens that arrived ``ago_s`` seconds ago (the time it took to
        tokenize it; the peak and the dispersion bin it by when it arrived); ``key`` names it for
        ``correct_arrival``.

        Raises:
            ValueError: ``isl_tokens`` < 0.
        """
        if isl_tokens < 0:
            raise ValueError(f"isl_tokens must be >= 0, got {isl_tokens}")
        now_s = self.clock() - max(ago_s, 0.0)
        with self._lock:
            if key is not None:
                self._keyed[key] = len(self._isl)
            self._isl.append(int(isl_tokens))
            self._arrival_s.append(now_s)
            self._prio += int(priority)

    def correct_arrival(self, key: str, isl_tokens: int) -> None:
        """The prompt length of the arrival recorded with ``key`` is ``isl_tokens`` (the worker's count, where
        the arrival had an estimate): applied while that arrival is in the window not yet drained."""
        with self._lock:
            i = self._keyed.get(key)
            if i is not None and isl_tokens >= 0:
                self._isl[i] = int(isl_tokens)

    def record_first_token(self, ttft_s: float) -> None:
        """A request's first token reached its client ``ttft_s`` seconds after it arrived."""
        with self._lock:
            self._ttft.append(float(ttft_s))

    def record_finish(self, osl_tokens: int, itl_s: float | None = None, duration_s: float | None = None) -> None:
        """One answered request: ``osl_tokens`` output tokens, its mean ITL in seconds (None: not seen, e.g. a
        non-streamed answer the decode worker prefilled itself) and its time from arrival to its last token,
        seconds."""
        with self._lock:
            self._osl.append(int(osl_tokens))
            if duration_s is not None:
                self._duration.append(float(duration_s))
            if itl_s is not None:
                self._itl.append(float(itl_s))

    def drain(self) -> WindowStats:
        now_s = self.clock()
        with self._lock:
            isl, osl, ttft, itl, prio = self._isl, self._osl, self._ttft, self._itl, self._prio
            duration = self._duration
            arrival_s, since_s = self._arrival_s, self._since_s
            self._isl, self._osl, self._ttft, self._itl, self._prio, self._duration = [], [], [], [], 0, []
            self._arrival_s, self._since_s, self._keyed = [], now_s, {}
        return WindowStats(
            num_requests=len(isl),
            num_priority_requests=prio,
            mean_isl_tokens=float(np.mean(isl)) if isl else 0.0,
            p90_isl_tokens=float(np.quantile(isl, 0.9)) if isl else None,
            mean_osl_tokens=float(np.mean(osl)) if osl else 0.0,
            ttft_p90_s=float(np.quantile(ttft, 0.9)) if ttft else None,
            itl_p90_s=float(np.quantile(itl, 0.9)) if itl else None,
            ttft_mean_s=float(np.mean(ttft)) if ttft else None,
            itl_mean_s=float(np.mean(itl)) if itl else None,
            duration_mean_s=float(np.mean(duration)) if duration else None,
            peak_prefill_tokens_per_s=peak_tokens_per_s(arrival_s, isl, since_s, now_s),
            span_s=max(now_s - since_s, 0.0),
            arrival_dispersion=arrival_dispersion(arrival_s, since_s, now_s),
            prompt_arrivals=tuple(zip(arrival_s, (float(n) for n in isl))) or None,
        )


def fetch_pages(
    client: httpx.Client,
    urls: list[str],
    deadline_s: float,
    in_flight: dict[str, threading.Thread] | None = None,
) -> dict[str, str | Exception]:
    """GET every URL concurrently, each within ``deadline_s`` seconds for the whole request (connect,
    headers and body together; httpx's own timeouts bound each network operation only, so a server
    trickling a byte every 2 s would otherwise hold a read for ever).

    Each read runs on a daemon thread; the body is read in chunks and abandoned (connection closed) past
    the deadline. A read still blocked after the deadline (headers trickling) is left to finish on its own;
    ``in_flight`` (url -> thread, kept by the caller across calls) makes the next call skip that URL until
    it has, so at most one such thread per URL exists.

    Returns:
        url -> page text, or the exception that made it unreadable (``TimeoutError`` past the deadline,
        ``httpx.HTTPError``, ...).
    """
    in_flight = {} if in_flight is None else in_flight
    end_s = time.monotonic() + deadline_s
    out: dict[str, str | Exception] = {}
    started: dict[str, tuple[threading.Thread, dict]] = {}
    for url in urls:
        prev = in_flight.get(url)
        if prev is not None and prev.is_alive():
            out[url] = TimeoutError(f"its previous read has not ended after {deadline_s:g} s")
            continue
        box: dict = {}
        t = threading.Thread(target=_fetch, args=(client, url, end_s, deadline_s, box), daemon=True,
                             name="pdserve-planner-metrics")
        t.start()
        started[url] = (t, box)
        in_flight[url] = t
    for url, (t, box) in started.items():
        t.join(max(end_s - time.monotonic(), 0.0))
        if t.is_alive():
            out[url] = TimeoutError(f"no complete page within {deadline_s:g} s")
        else:
            in_flight.pop(url, None)
            out[url] = box["error"] if "error" in box else box["text"]
    for url in [u for u, t in in_flight.items() if not t.is_alive()]:
        del in_flight[url]
    return out


def _fetch(client: httpx.Client, url: str, end_s: float, deadline_s: float, box: dict) -> None:
    try:
        with client.stream("GET", url) as r:
            r.raise_for_status()
            chunks = []
            for chunk in r.iter_bytes():
                chunks.append(chunk)
                if time.monotonic() > end_s:
                    raise TimeoutError(f"page not complete within {deadline_s:g} s (server too slow)")
            box["text"] = b"".join(chunks).decode(r.charset_encoding or "utf-8", "replace")
    except Exception as e:  # noqa: BLE001 - any failure makes this worker unreadable for this tick
        box["error"] = e


def read_pool(
    client: httpx.Client,
    metrics_urls: list[str],
    num_starting: int = 0,
    prefill_time_totals: dict[str, tuple[float, float]] | None = None,
    *,
    deadline_s: float | None = None,
    in_flight: dict[str, threading.Thread] | None = None,
    last_readings: dict[str, WorkerReading] | None = None,
    start_times: dict[str, float] | None = None,
) -> PoolObservation:
    """Average vLLM gauges over the workers that answer; the others count as starting.
    ``prefill_time_totals``, when given, receives ``url -> (sum_s, count)`` of each answering worker's
    ``vllm:request_prefill_time_seconds`` histogram (cumulative, as exported); ``start_times``, when given,
    ``url -> process_start_time_seconds`` (Unix epoch seconds) of each answering worker whose page has it.

    ``last_readings`` (url -> :class:`WorkerReading`, kept by the caller across calls, one store per pool)
    makes a worker that answered an earlier call and fails this one count as ready with its last readings,
    logged as stale, for up to ``STALE_READS_MAX`` consecutive failed calls; past that, never read, or refusing
    the connection (no process listens: it exited or is restarting), it counts as starting. The store is updated in place: each answering worker's readings replace its entry, and
    entries of URLs not in ``metrics_urls`` (workers that left the pool) are dropped. Without it every failed
    read counts as starting.

    The pages are read concurrently by :func:`fetch_pages`, each within ``deadline_s`` seconds for the
    whole request (default: the client's read timeout, else 5 s); a worker slower than that counts as
    unreadable for this call. ``in_flight`` is passed on to :func:`fetch_pages`."""
    if deadline_s is None:
        deadline_s = client.timeout.read or 5.0
    if last_readings is not None:
        for url in set(last_readings) - set(metrics_urls):
            del last_readings[url]
    pages = fetch_pages(client, metrics_urls, deadline_s, in_flight) if metrics_urls else {}
    waiting, running, kv = [], [], []
    for url in metrics_urls:
        try:
            text = pages[url]
            if isinstance(text, Exception):
                raise text
            if "vllm:" not in text:
                raise ValueError("no vllm: metrics on the page (not a vLLM worker, or not up yet)")
            w = _gauge(sample_sum(text, "vllm:num_requests_waiting"), url, "num_requests_waiting")
            r = _gauge(sample_sum(text, "vllm:num_requests_running"), url, "num_requests_running")
            # one series per engine of a data-parallel worker, each a fraction of that engine's cache: the mean
            usage = [u for u in (sample_mean(text, n) for n in KV_USAGE_NAMES) if u is not None]
            k = min(_gauge(max(usage, default=0.0), url, "kv_cache_usage_perc"), 1.0)
            if prefill_time_totals is not None and f"{PREFILL_TIME}_sum" in text and f"{PREFILL_TIME}_count" in text:
                totals = (sample_sum(text, PREFILL_TIME + "_sum"), sample_sum(text, PREFILL_TIME + "_count"))
                if all(math.isfinite(v) and v >= 0 for v in totals):
                    prefill_time_totals[url] = totals
            if start_times is not None and PROCESS_START_TIME in text:
                started = sample_mean(text, PROCESS_START_TIME)
                if started is not None and math.isfinite(started) and started > 0:
                    start_times[url] = started
        except Exception as e:  # noqa: BLE001 - HTTP errors, timeouts, unparsable pages: unreadable this tick
            why = redact_userinfo(str(e)) or type(e).__name__
            last = last_readings.get(url) if last_readings is not None else None
            # a refused connection is no busy worker: nothing listens on its port (it exited or is restarting)
            gone = isinstance(e, httpx.ConnectError)
            if last is not None and last.failed_reads < STALE_READS_MAX and not gone:
                last = last_readings[url] = dataclasses.replace(last, failed_reads=last.failed_reads + 1)
                log.warning("planner: worker metrics %s unreadable: %s; counted ready with its last readings "
                            "(stale, failed read %d of at most %d)", redact_userinfo(url), why,
                            last.failed_reads, STALE_READS_MAX)
                waiting.append(last.waiting)
                running.append(last.running)
                kv.append(last.kv_usage)
            else:
                if last is not None:  # silent too long, or gone: starting until it answers again
                    del last_readings[url]
                log.warning("planner: worker metrics %s unreadable: %s", redact_userinfo(url), why)
            continue
        waiting.append(w)
        running.append(r)
        kv.append(k)
        if last_readings is not None:
            last_readings[url] = WorkerReading(w, r, k)
    ready = len(waiting)
    return PoolObservation(
        num_ready=ready,
        num_starting=num_starting + len(metrics_urls) - ready,
        queue_per_worker=float(np.mean(waiting)) if ready else 0.0,
        running_per_worker=float(np.mean(running)) if ready else 0.0,
        kv_usage=float(np.mean(kv)) if ready else 0.0,
    )


def _gauge(v: float, url: str, name: str) -> float:
    """A worker's gauge as the planner may use it: NaN, infinite or negative values read as 0 (warned)."""
    if readable_gauge(v) is not None:
        return v
    log.warning("planner: worker %s reports %s = %s; read as 0", redact_userinfo(url), name, v)
    return 0.0


class PrefillTimeMeter:
    """Mean prefill time (s) per interval from cumulative histogram totals, per worker.

    ``update({url: (sum_s, count)}, start_times={url: start_s}, pool=urls)`` returns the mean over the
    requests counted since each worker's previous read: sum of the workers' sum deltas / sum of their count
    deltas; None when no request finished prefill. A worker seen for the first time only sets its baseline
    (its history predates the interval). A worker absent from ``totals`` (its read failed) keeps its baseline,
    so its next read counts the prefills of the ticks it missed; it is forgotten only when it is not in
    ``pool`` (the pool's current URLs; None: forget none). A worker restarted counts from zero: its
    ``process_start_time_seconds`` (``start_times``, Unix epoch seconds) differs from the one its baseline was
    read with, or either total went down (the only sign where a read lacks the start time)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float, float | None]] = {}  # url -> (sum_s, count, start_s)

    def update(self, totals: dict[str, tuple[float, float]], *, start_times: dict[str, float] | None = None,
               pool: list[str] | None = None) -> float | None:
        start_times = start_times or {}
        d_sum = d_count = 0.0
        for url, (s, c) in totals.items():
            started = start_times.get(url)
            if url in self._last:
                ps, pc, pstarted = self._last[url]
                # a new process counts from zero: its start time tells even when it already passed the old
                # totals; a total that went down tells where a read lacks the start time
                restarted = (started is not None and pstarted is not None and started != pstarted) or c < pc or s < ps
                if restarted:
                    ps, pc = 0.0, 0.0
                d_sum += s - ps
                d_count += c - pc
            self._last[url] = (s, c, started)
        if pool is not None:
            for url in set(self._last) - set(pool):
                del self._last[url]
        return d_sum / d_count if d_count > 0 else None


class PlannerGauges:
    """The planner's Prometheus gauges on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def g(name: str, doc: str) -> Gauge:
            return Gauge(f"pdserve_planner_{name}", doc, registry=registry)

        self.prefill = g("prefill_replicas", "Target prefill workers")
        self.decode = g("decode_replicas", "Target decode workers")
        self.aggregated = g("aggregated", "1 when serving aggregated (decode workers prefill)")
        self.burst = g("burst", "1 while burst mode is on")
        self.pred_rate = g("predicted_rate_per_second", "Predicted request rate, requests/s")
        self.pred_isl = g("predicted_isl_tokens", "Predicted mean input length, tokens")
        self.pred_osl = g("predicted_osl_tokens", "Predicted mean output length, tokens")
        self.obs_rate = g("observed_rate_per_second", "Observed request rate in the last interval, requests/s")
        self.obs_ttft = g("observed_ttft_p90_seconds", "Observed TTFT p90 in the last interval, s")
        self.obs_itl = g("observed_itl_p90_seconds", "Observed ITL p90 in the last interval, s")
        self.ttft_corr = g("ttft_correction", "Observed / model TTFT factor")
        self.itl_corr = g("itl_correction", "Observed / model ITL factor")
        self.obs_prefill_time = g("observed_prefill_time_mean_seconds",
                                  "Mean engine prefill time of the requests prefilled in the last interval, s")
        self.obs_peak = g("observed_peak_prefill_tokens_per_second",
                          "p90 of prompt tokens arriving per 1-s bin in the last interval, tokens/s")
        self.obs_dispersion = g("observed_arrival_dispersion",
                                "Index of dispersion of the requests received per ~1-s bin in the last interval, "
                                "around its trend (1 for Poisson arrivals, more for clumps)")
        self.ticks = Counter("pdserve_planner_ticks", "Planner ticks run", registry=registry)
        self.applied = Gauge("pdserve_planner_applied_replicas",
                             "Workers per pool the actuator reports after applying the last decision (may differ "
                             "from the decided *_replicas: caps, start-up back-off, failed applies)",
                             ["pool"], registry=registry)
        self.draining = g("draining_workers", "Workers a scale-down removed that are still draining (their "
                          "GPUs not released yet; local actuator)")
        self.gpus = g("gpus", "GPUs the last decision uses (replicas x TP of both pools)")
        self.gpu_budget = g("gpu_budget", "The planner's GPU budget (planner.gpu_budget)")
        self.scale_events = Counter("pdserve_planner_scale_events", "Actuated decisions that changed a pool's "
                                    "target replicas", ["pool", "direction"], registry=registry)
        self.leader = g("leader", "1 while this runtime replica's planner actuates (the leader), 0 while it "
                        "only computes and exports its decisions")
        self.traffic_share = g("traffic_share", "This replica's share of the decode workers' requests over the "
                               "last tick (1 with one runtime replica); the planner scales its request window by "
                               "its inverse")
        self.actuations = Counter("pdserve_planner_actuations", "Decisions this replica handed to the actuator",
                                  registry=registry)
        for pool in ("prefill", "decode"):  # every series from the start, so a rate over them is 0, not absent
            for direction in ("up", "down"):
                self.scale_events.labels(pool=pool, direction=direction)

    def export_gpus(self, d: ScalingDecision, cfg: PlannerConfig, last: ScalingDecision | None,
                    actuated: bool = True) -> None:
        """The decision's GPUs against the budget, and when `actuated` a scale event per pool whose target moved
        from `last`."""
        self.gpus.set(d.num_gpus(cfg.prefill_tp, cfg.decode_tp))
        self.gpu_budget.set(cfg.gpu_budget)
        if last is None or not actuated:
            return
        for pool, new, old in (("prefill", d.prefill_replicas, last.prefill_replicas),
                               ("decode", d.decode_replicas, last.decode_replicas)):
            if new != old:
                self.scale_events.labels(pool=pool, direction="up" if new > old else "down").inc()

    def export_applied(self, applied: Applied) -> None:
        self.applied.labels(pool="prefill").set(applied.prefill_replicas)
        self.applied.labels(pool="decode").set(applied.decode_replicas)
        self.draining.set(applied.draining)

    def export(self, tick: TickInput, d: ScalingDecision) -> None:
        self.prefill.set(d.prefill_replicas)
        self.decode.set(d.decode_replicas)
        self.aggregated.set(1 if d.serving_mode == "aggregated" else 0)
        self.burst.set(1 if d.burst else 0)
        self.pred_rate.set(d.predicted_rate_per_s)
        self.pred_isl.set(d.predicted_isl_tokens)
        self.pred_osl.set(d.predicted_osl_tokens)
        self.obs_rate.set(tick.rate_per_s)
        if tick.observed_ttft_p90_s is not None:
            self.obs_ttft.set(tick.observed_ttft_p90_s)
        if tick.observed_itl_p90_s is not None:
            self.obs_itl.set(tick.observed_itl_p90_s)
        if tick.observed_prefill_time_mean_s is not None:
            self.obs_prefill_time.set(tick.observed_prefill_time_mean_s)
        self.ttft_corr.set(d.ttft_correction)
        self.itl_corr.set(d.itl_correction)
        self.obs_peak.set(tick.peak_prefill_tokens_per_s or 0.0)
        if tick.arrival_dispersion is not None:
            self.obs_dispersion.set(tick.arrival_dispersion)
        self.ticks.inc()


def spec_perf(spec: DeploymentSpec, model_config: dict):
    """The performance model (runtime.perf.model.PerfModel) of `spec`'s GPU and precision for the model whose HF
    ``config.json`` dict is `model_config`, as the tuner sized it (runtime.tuner.search.deployment_perf: a
    quantised checkpoint's weights in their own format, KV at ``spec.precision``).

    Raises ``runtime.models.spec.ModelConfigError`` naming a missing config field, KeyError for a GPU not in
    the catalog."""
    from runtime.models.spec import ModelSpec
    from runtime.perf.gpus import get_gpu
    from runtime.tuner.search import deployment_perf

    return deployment_perf(ModelSpec.from_hf_config(model_config, spec.model.name), get_gpu(spec.gpu), spec.precision)


def planner_from_spec(spec: DeploymentSpec, model_config: dict) -> PlannerStateMachine:
    """The state machine for a deployment: config from ``spec`` (``PlannerConfig.from_spec``), profile
    from the perf model of ``spec.gpu`` and the model's HF ``config.json`` dict (SLA mode only).
    Raises ``runtime.models.spec.ModelConfigError`` naming a missing config field, ValueError naming
    a TP that does not fit."""
    cfg = PlannerConfig.from_spec(spec)
    profile = None
    if cfg.mode == "sla":
        from runtime.planner.profiles import build_profile

        profile = build_profile(spec_perf(spec, model_config), spec.prefill.tp, spec.decode.tp,
                                gpu_memory_utilization=spec.engine.gpu_memory_utilization)
    return PlannerStateMachine(cfg, profile, initial_prefill=spec.prefill.replicas, initial_decode=spec.decode.replicas)


class PlannerLoop:
    """Runs ``machine`` every ``interval_s`` on a daemon thread (``start``/``stop``) or on demand
    (``tick(now_s)``). ``metrics_urls()`` returns the current ``{"prefill": [...], "decode": [...]}``
    worker /metrics URLs (from the actuator or the router's worker set). Each worker's /metrics read has
    ``metrics_deadline_s`` seconds in all (default: the client's read timeout; see :func:`read_pool`), so
    one slow worker delays a tick by at most that long. ``leader()`` (default: always) is asked right before
    each actuation: False makes the tick compute and export its decision without applying it."""

    def __init__(
        self,
        machine: PlannerStateMachine,
        actuator: Actuator,
        window: RequestWindow,
        *,
        metrics_urls: Callable[[], dict[str, list[str]]],
        client: httpx.Client,
        registry: CollectorRegistry,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics_deadline_s: float | None = None,
        leader: Callable[[], bool] | None = None,
        traffic_share: Callable[[], float | None] | None = None,
    ) -> None:
        self.machine = machine
        self.leader = leader
        self.traffic_share = traffic_share
        self.actuator = actuator
        self.window = window
        self.metrics_urls = metrics_urls
        self.client = client
        self.gauges = PlannerGauges(registry)
        self.interval_s = interval_s or machine.cfg.interval_s
        self.clock = clock
        self.last_decision: ScalingDecision | None = None
        self.last_applied: Applied | None = None
        self.prefill_time = PrefillTimeMeter()
        self.metrics_deadline_s = metrics_deadline_s
        self._in_flight: dict[str, threading.Thread] = {}  # /metrics reads still running past their deadline
        # each pool's workers' last good /metrics readings, for a worker whose read fails (read_pool)
        self._last_readings: dict[str, dict[str, WorkerReading]] = {"prefill": {}, "decode": {}}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, now_s: float) -> ScalingDecision:
        """One planner step at ``now_s`` (seconds, any monotone clock)."""
        urls = self.metrics_urls()
        want_p, want_d = self.actuator.current()
        totals: dict[str, tuple[float, float]] = {}
        start_times: dict[str, float] = {}
        pre_urls, dec_urls = list(urls.get("prefill", [])), list(urls.get("decode", []))
        pre = read_pool(self.client, pre_urls, max(want_p - len(pre_urls), 0), prefill_time_totals=totals,
                        deadline_s=self.metrics_deadline_s, in_flight=self._in_flight,
                        last_readings=self._last_readings["prefill"], start_times=start_times)
        prefill_time_mean_s = self.prefill_time.update(totals, start_times=start_times, pool=pre_urls)
        dec = read_pool(self.client, dec_urls, max(want_d - len(dec_urls), 0),
                        deadline_s=self.metrics_deadline_s, in_flight=self._in_flight,
                        last_readings=self._last_readings["decode"])
        w = self.window.drain()
        share = self.traffic_share() if self.traffic_share is not None else None
        if share is not None and share < 1.0:
            w = scale_window(w, 1.0 / share)
        self.gauges.traffic_share.set(1.0 if share is None else share)
        tick = TickInput(  # the rate is over the window actually drained (a late tick covers more time)
            now_s=now_s, interval_s=w.span_s if w.span_s > 0 else self.interval_s, num_requests=w.num_requests,
            num_priority_requests=w.num_priority_requests, mean_isl_tokens=w.mean_isl_tokens,
            mean_osl_tokens=w.mean_osl_tokens, p90_isl_tokens=w.p90_isl_tokens, prefill=pre, decode=dec,
            observed_ttft_p90_s=w.ttft_p90_s, observed_itl_p90_s=w.itl_p90_s,
            observed_ttft_mean_s=w.ttft_mean_s, observed_itl_mean_s=w.itl_mean_s,
            mean_request_duration_s=w.duration_mean_s,
            peak_prefill_tokens_per_s=w.peak_prefill_tokens_per_s,
            observed_prefill_time_mean_s=prefill_time_mean_s, arrival_dispersion=w.arrival_dispersion,
            prompt_arrivals=w.prompt_arrivals,
        )
        decision = self._decide(tick)
        actuate = self.leader is None or self.leader()
        self.gauges.leader.set(1 if actuate else 0)
        self.gauges.export(tick, decision)  # the decision shows even when the actuator then fails
        self.gauges.export_gpus(decision, self.machine.cfg, self.last_decision, actuated=actuate)
        self.last_decision = decision
        if not actuate:
            return decision
        self.gauges.actuations.inc()
        applied = self.actuator.apply(decision)
        self.gauges.export_applied(applied)
        self.last_applied = applied
        return decision

    def draining_gpus(self) -> int:
        """GPUs of the workers the actuator is draining (prefill workers x ``prefill_tp`` + decode workers x
        ``decode_tp``); 0 for an actuator without ``draining_counts`` (it stops the workers it removes at once)."""
        counts = getattr(self.actuator, "draining_counts", None)
        if counts is None:
            return 0
        p, d = counts()
        return p * self.machine.cfg.prefill_tp + d * self.machine.cfg.decode_tp

    def _decide(self, tick: TickInput) -> ScalingDecision:
        """``machine.on_tick`` with the GPU budget less the draining workers' GPUs (see the module docstring);
        the configured budget is back in place afterwards, whatever the tick raised."""
        cfg = self.machine.cfg
        held = self.draining_gpus()
        if held <= 0:
            return self.machine.on_tick(tick)
        fleet = (getattr(self.machine, "prefill", 0) * cfg.prefill_tp
                 + getattr(self.machine, "decode", 0) * cfg.decode_tp)
        floor = cfg.min_prefill * cfg.prefill_tp + cfg.min_decode * cfg.decode_tp
        budget = min(cfg.gpu_budget, max(cfg.gpu_budget - held, fleet, floor))
        self.machine.cfg = dataclasses.replace(cfg, gpu_budget=budget)
        try:
            return self.machine.on_tick(tick)
        finally:
            self.machine.cfg = cfg

    def _run(self) -> None:
        next_s = self.clock() + self.interval_s
        while not self._stop.wait(max(next_s - self.clock(), 0.0)):
            try:
                self.tick(self.clock())
            except Exception:  # keep serving; the next tick retries
                log.exception("planner tick failed")
            next_s += self.interval_s
            while next_s <= self.clock():  # a tick that overran (slow /metrics) skips the missed slots
                next_s += self.interval_s

    def start(self) -> "PlannerLoop":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pdserve-planner", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
