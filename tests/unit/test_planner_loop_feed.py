"""What the planner loop hands the planner when a worker's /metrics read fails (runtime.server.planner_loop).

Workers are loopback HTTP servers on 127.0.0.1 whose pages prometheus_client writes with vLLM's metric names;
each can answer, answer 503, or answer only after the read deadline. The planner sees what the fleet simulator
gives it: a busy worker that answers one read late is still a ready worker with its queue, and the prefill time
of the requests it prefilled meanwhile is counted once it answers again.
"""

from __future__ import annotations

import logging
import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig
from runtime.server.actuators import DryRunActuator
from runtime.server import planner_loop
from runtime.server.planner_loop import PlannerLoop, PrefillTimeMeter, RequestWindow, read_pool
from tests.metrics_worker import MetricsWorker

PROF = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4, kv_capacity_tokens=100_000)
DEADLINE_S = 1.0  # loopback pages answer in ms; a loaded CI machine still makes each read in time


def vllm_page(waiting: float, running: float, kv: float, prefill: tuple[float, float] | None = None,
              started_s: float | None = None) -> bytes:
    """A worker's /metrics text: vLLM's gauges, optionally its cumulative prefill-time totals (sum s, count)
    and prometheus_client's process start time (Unix epoch s)."""
    reg = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "w", ["model_name", "engine"], registry=reg).labels("m", "0").set(waiting)
    Gauge("vllm:num_requests_running", "r", ["model_name", "engine"], registry=reg).labels("m", "0").set(running)
    Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name", "engine"], registry=reg).labels("m", "0").set(kv)
    text = generate_latest(reg).decode()
    if prefill is not None:
        s, c = prefill
        text += ("# TYPE vllm:request_prefill_time_seconds histogram\n"
                 f'vllm:request_prefill_time_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {c}\n'
                 f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} {c}\n'
                 f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {s}\n')
    if started_s is not None:
        text += f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {started_s!r}\n"
    return text.encode()


@pytest.fixture
def workers():
    made: list[MetricsWorker] = []

    def make(body: bytes) -> MetricsWorker:
        made.append(MetricsWorker(body))
        return made[-1]

    yield make
    for w in made:
        w.close()


class Recording(PlannerStateMachine):
    """The planner, keeping every TickInput it was given."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen = []

    def on_tick(self, tick):  # noqa: ANN001, ANN202
        self.seen.append(tick)
        return super().on_tick(tick)


def make_loop(client: httpx.Client, pools: dict[str, list[str]]) -> tuple[PlannerLoop, Recording]:
    """A follower loop (it never actuates, so the actuator's targets stay 0 and every starting worker the
    planner sees is one whose read failed)."""
    cfg = PlannerConfig(mode="sla", interval_s=30.0, predictor="constant", allow_aggregated=False)
    machine = Recording(cfg, PROF)
    loop = PlannerLoop(machine, DryRunActuator(prefill=0, decode=0), RequestWindow(), client=client,
                       registry=CollectorRegistry(), metrics_urls=lambda: pools, metrics_deadline_s=DEADLINE_S,
                       leader=lambda: False)
    return loop, machine


def test_a_worker_that_misses_reads_stays_ready_with_its_last_readings_for_a_bounded_number_of_ticks(
        workers, caplog):
    """A busy decode worker (queue 10) misses the deadline, then errors: for STALE_READS_MAX ticks the planner
    still sees two ready workers and a mean queue of (10 + 2) / 2; after that it is starting, and once it
    answers again it is ready with its new readings. A worker never read is starting from its first miss."""
    busy, calm = workers(vllm_page(10, 50, 0.8)), workers(vllm_page(2, 10, 0.2))
    pools = {"prefill": [], "decode": [busy.url, calm.url]}
    with httpx.Client(timeout=2.0) as client, caplog.at_level(logging.WARNING, "runtime.server.planner_loop"):
        loop, machine = make_loop(client, pools)
        loop.tick(now_s=30.0)
        busy.mode = "slow"  # misses the read deadline
        loop.tick(now_s=60.0)
        assert "stale" in caplog.text and busy.url in caplog.text
        busy.mode = "error"
        # The late read is still running (the stand-in answers within 50 ms of leaving "slow"): wait for it,
        # so the next ticks read the 503 rather than skip a URL whose read has not ended.
        loop._in_flight[busy.url].join(5.0)
        loop.tick(now_s=90.0)
        loop.tick(now_s=120.0)  # a third failed read in a row: past the bound
        busy.body, busy.mode = vllm_page(6, 40, 0.5), "ok"
        loop.tick(now_s=150.0)
        fresh = workers(vllm_page(0, 0, 0.0))
        fresh.mode = "error"
        pools["decode"] = [busy.url, calm.url, fresh.url]
        loop.tick(now_s=180.0)
    seen = [(t.decode.num_ready, t.decode.num_starting, t.decode.queue_per_worker, t.decode.running_per_worker,
             t.decode.kv_usage) for t in machine.seen]
    assert seen == [
        (2, 0, 6.0, 30.0, pytest.approx(0.5)),
        (2, 0, 6.0, 30.0, pytest.approx(0.5)),  # stale, 1st failed read
        (2, 0, 6.0, 30.0, pytest.approx(0.5)),  # stale, 2nd
        (1, 1, 2.0, 10.0, pytest.approx(0.2)),  # silent too long: starting
        (2, 0, 4.0, 25.0, pytest.approx(0.35)),  # back, its new readings
        (2, 1, 4.0, 25.0, pytest.approx(0.35)),  # never read: starting at once
    ]
    assert planner_loop.STALE_READS_MAX == 2  # the ticks above are laid out for this bound


def test_a_worker_that_left_the_pool_is_forgotten(workers):
    """A failed read is stale while the worker stays in the pool; its last readings go when its URL leaves
    the pool, so back in the pool but unreadable it is starting."""
    w, other = workers(vllm_page(8, 8, 0.4)), workers(vllm_page(0, 2, 0.1))
    pools = {"prefill": [], "decode": [w.url, other.url]}
    with httpx.Client(timeout=2.0) as client:
        loop, machine = make_loop(client, pools)
        loop.tick(now_s=30.0)
        w.mode = "error"
        loop.tick(now_s=60.0)
        pools["decode"] = [other.url]
        loop.tick(now_s=90.0)
        pools["decode"] = [w.url, other.url]
        loop.tick(now_s=120.0)
    assert [(t.decode.num_ready, t.decode.num_starting, t.decode.queue_per_worker) for t in machine.seen] == [
        (2, 0, 4.0), (2, 0, 4.0), (1, 0, 0.0), (1, 1, 0.0)]


def test_a_worker_that_refuses_the_connection_is_starting_at_once(workers):
    """A refused connection is no busy worker (nothing listens on its port: it exited or restarts): starting
    at its first failed read, its last readings dropped, where a slow or erroring worker stays ready."""
    gone, calm = workers(vllm_page(9, 9, 0.9)), workers(vllm_page(1, 1, 0.1))
    pools = {"prefill": [], "decode": [gone.url, calm.url]}
    with httpx.Client(timeout=2.0) as client:
        loop, machine = make_loop(client, pools)
        loop.tick(now_s=30.0)
        gone.close()  # its port closed: the next read is refused
        loop.tick(now_s=60.0)
    assert [(t.decode.num_ready, t.decode.num_starting, t.decode.queue_per_worker) for t in machine.seen] == [
        (2, 0, 5.0), (1, 1, 1.0)]
    assert loop._last_readings["decode"].keys() == {calm.url}


def test_read_pool_takes_the_store_as_an_option_and_prunes_it_to_the_pool(workers):
    """With a store a failed read is stale-ready; positional callers without one see a failed read as
    starting; a URL not in the call's list leaves the store."""
    w = workers(vllm_page(3, 5, 0.3))
    store: dict = {}
    with httpx.Client(timeout=2.0) as client:
        assert read_pool(client, [w.url], deadline_s=DEADLINE_S, last_readings=store).num_ready == 1
        assert (store[w.url].waiting, store[w.url].running, store[w.url].kv_usage) == (3.0, 5.0, 0.3)
        w.mode = "error"
        obs = read_pool(client, [w.url], 0, None, deadline_s=DEADLINE_S)
        assert (obs.num_ready, obs.num_starting) == (0, 1)
        obs = read_pool(client, [w.url], deadline_s=DEADLINE_S, last_readings=store)
        assert (obs.num_ready, obs.num_starting, obs.queue_per_worker) == (1, 0, 3.0)
        assert store[w.url].failed_reads == 1
        read_pool(client, [], deadline_s=DEADLINE_S, last_readings=store)
    assert store == {}


def test_a_missed_read_keeps_the_prefill_time_baseline_and_a_new_start_time_is_a_restart(workers):
    """Tick 1 sets the baseline; tick 2 the prefill worker errors (no sample, baseline kept); tick 3 hands
    the planner the mean over both ticks' prefills, (130 - 100) s / (1100 - 1000); tick 4 the worker
    restarted (a new process start time) and already counted past its old totals: all of them are new,
    150 s / 1200. Tick 5, no start time on the page, the totals went down: counted from zero too."""
    p = workers(vllm_page(0, 1, 0.1, prefill=(100.0, 1000), started_s=1_700_000_000.25))
    d = workers(vllm_page(0, 1, 0.1))
    with httpx.Client(timeout=2.0) as client:
        loop, machine = make_loop(client, {"prefill": [p.url], "decode": [d.url]})
        loop.tick(now_s=30.0)
        p.mode = "error"
        loop.tick(now_s=60.0)
        p.body, p.mode = vllm_page(0, 1, 0.1, prefill=(130.0, 1100), started_s=1_700_000_000.25), "ok"
        loop.tick(now_s=90.0)
        p.body = vllm_page(0, 1, 0.1, prefill=(150.0, 1200), started_s=1_700_003_600.5)
        loop.tick(now_s=120.0)
        p.body = vllm_page(0, 1, 0.1, prefill=(8.0, 100))
        loop.tick(now_s=150.0)
    means = [t.observed_prefill_time_mean_s for t in machine.seen]
    assert means == [None, None, pytest.approx(0.3), pytest.approx(0.125), pytest.approx(0.08)]


def test_prefill_time_meter_forgets_a_worker_only_when_it_leaves_the_pool():
    m = PrefillTimeMeter()
    assert m.update({"a": (10.0, 100), "b": (5.0, 50)}) is None  # baselines
    assert m.update({"b": (6.0, 60)}) == pytest.approx(0.1)  # a's read failed: its baseline kept
    assert m.update({"a": (14.0, 110), "b": (6.0, 60)}) == pytest.approx(0.4)
    assert m.update({"b": (6.0, 60)}, pool=["b"]) is None  # a left the pool: forgotten
    assert m.update({"a": (99.0, 999), "b": (6.0, 60)}, pool=["a", "b"]) is None  # a is new again


def test_prefill_time_meter_sees_a_restart_by_its_start_time_even_past_the_old_totals():
    m = PrefillTimeMeter()
    m.update({"a": (10.0, 100)}, start_times={"a": 1000.0})
    assert m.update({"a": (12.0, 120)}, start_times={"a": 1000.0}) == pytest.approx(0.1)  # same process
    # a new process that prefilled 150 requests in 30 s since it started: every one of them is new
    assert m.update({"a": (45.0, 150)}, start_times={"a": 5000.0}) == pytest.approx(0.3)
    # a start time on one read only: the totals decide (went down: restarted)
    assert m.update({"a": (2.0, 10)}) == pytest.approx(0.2)
