"""The runtime's planner loop: reads real worker /metrics over HTTP on 127.0.0.1 (vLLM metric names),
runs the SLA planner, applies through an actuator and exports Prometheus gauges."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig
from runtime.server.actuators import DryRunActuator
from runtime.server.planner_loop import PlannerLoop, RequestWindow, read_pool
from tests.metrics_worker import MetricsWorker

pytestmark = pytest.mark.integration

# Per request to the loopback pages that answer at once: a deadline a stalled CI machine cannot miss (a missed
# one would count a live worker as starting); waiting it out costs nothing, as no such page is slow.
LIVE_TIMEOUT_S = 30.0

PROF = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4, kv_capacity_tokens=100_000)

VLLM_METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
"""


PREFILL_HISTOGRAM = """# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {count}
vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} {count}
vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {sum}
"""


class MetricsServer(MetricsWorker):
    """A worker's /metrics with vLLM's gauges; ``set_prefill(sum_s, count)`` adds the cumulative prefill-time
    histogram."""

    def __init__(self, waiting: float, running: float, kv: float) -> None:
        self.base = VLLM_METRICS.format(waiting=waiting, running=running, kv=kv)
        super().__init__(self.base.encode())

    def set_prefill(self, sum_s: float, count: int) -> None:
        self.body = (self.base + PREFILL_HISTOGRAM.format(sum=sum_s, count=count)).encode()


@pytest.fixture
def servers():
    made = [MetricsServer(4, 2, 0.1), MetricsServer(2, 2, 0.3), MetricsServer(0, 120, 0.6)]
    yield made
    for s in made:
        s.close()


def test_read_pool_averages_workers_and_counts_dead_ones_as_starting(servers):
    with httpx.Client(timeout=LIVE_TIMEOUT_S) as c:
        dead = "http://127.0.0.1:9/metrics"  # discard port: nothing listens
        obs = read_pool(c, [servers[0].url, servers[1].url, dead])
    assert obs.num_ready == 2 and obs.num_starting == 1
    assert obs.queue_per_worker == pytest.approx(3.0) and obs.kv_usage == pytest.approx(0.2)


def test_planner_loop_tick_decides_applies_and_exports_gauges(servers):
    # beta as given (no dispersion scaling): the decision below does not hang on the dispersion defaults
    cfg = PlannerConfig(mode="sla", interval_s=30.0, predictor="constant", allow_aggregated=False,
                        max_prefill=10, max_decode=10, prefill_staffing_beta=1.4, staffing_dispersion_ref=None)
    now = [0.0]
    window = RequestWindow(clock=lambda: now[0])
    for i in range(900):  # 30 req/s spread evenly over a 30 s window (so the peak second is the mean)
        now[0] = i / 30
        window.record_arrival(1000)
        window.record_first_token(0.3)
        window.record_finish(200, itl_s=0.02)
    now[0] = 30.0
    registry = CollectorRegistry()
    act = DryRunActuator()
    with httpx.Client(timeout=LIVE_TIMEOUT_S) as client:
        loop = PlannerLoop(PlannerStateMachine(cfg, PROF), act, window, client=client, registry=registry,
                           metrics_urls=lambda: {"prefill": [servers[0].url, servers[1].url], "decode": [servers[2].url]})
        d = loop.tick(now_s=30.0)
    # 30 req/s x 0.1 s prefill = 3 Erlangs -> square-root staffing 3 + 1.4 x sqrt(3) = 5.4 -> 6 prefill
    # (M/M/c alone: 4); 6000 tok/s / 4475 per worker -> 2 decode
    assert (d.prefill_replicas, d.decode_replicas) == (6, 2) and act.current() == (6, 2)
    text = generate_latest(registry).decode()
    assert "pdserve_planner_prefill_replicas 6.0" in text
    assert "pdserve_planner_decode_replicas 2.0" in text
    assert "pdserve_planner_observed_rate_per_second 30.0" in text
    assert "pdserve_planner_observed_ttft_p90_seconds 0.3" in text
    assert "pdserve_planner_observed_peak_prefill_tokens_per_second 30000.0" in text  # 30 x 1000 tokens each second
    assert window.drain().num_requests == 0  # the tick consumed the window


def test_planner_loop_corrects_prefill_by_the_engines_prefill_time_deltas(servers):
    """Tick 1 sets each prefill worker's histogram baseline (no sample); tick 2 hands the planner the
    mean over the new requests only, (12 + 4) s / (60 + 20) = 0.2 s, twice the profile's 0.1 s at
    1000 tokens, so the prefill correction moves one EWMA step: 0.7 x 1 + 0.3 x 2 = 1.3."""
    cfg = PlannerConfig(mode="sla", interval_s=30.0, predictor="constant", allow_aggregated=False,
                        max_prefill=10, max_decode=10)
    now = [0.0]
    window = RequestWindow(clock=lambda: now[0])
    registry = CollectorRegistry()
    machine = PlannerStateMachine(cfg, PROF)
    servers[0].set_prefill(100.0, 1000)  # history before the loop started: 0.1 s each
    servers[1].set_prefill(50.0, 500)

    def fill(t0: float) -> None:
        for i in range(300):
            now[0] = t0 + i / 10
            window.record_arrival(1000)
            window.record_first_token(0.3)
            window.record_finish(200, itl_s=0.02)

    with httpx.Client(timeout=LIVE_TIMEOUT_S) as client:
        loop = PlannerLoop(machine, DryRunActuator(), window, client=client, registry=registry,
                           metrics_urls=lambda: {"prefill": [servers[0].url, servers[1].url], "decode": [servers[2].url]})
        fill(0.0)
        loop.tick(now_s=30.0)
        assert machine.ttft_correction == pytest.approx(1.0)  # baseline only: TTFT 0.3 s is under half the SLO
        servers[0].set_prefill(112.0, 1060)
        servers[1].set_prefill(54.0, 520)
        fill(30.0)
        loop.tick(now_s=60.0)
    assert machine.ttft_correction == pytest.approx(1.3)
    assert "pdserve_planner_observed_prefill_time_mean_seconds 0.2" in generate_latest(registry).decode()


def test_prefill_time_meter_baselines_new_workers_and_survives_restarts():
    from runtime.server.planner_loop import PrefillTimeMeter

    m = PrefillTimeMeter()
    assert m.update({"a": (10.0, 100)}) is None  # first sight: baseline only
    assert m.update({"a": (10.0, 100)}) is None  # nothing new
    assert m.update({"a": (13.0, 110), "b": (99.0, 9)}) == pytest.approx(0.3)  # b: baseline
    # a restarted (count fell): counts from zero; b adds 1 s over 2 requests -> (2 + 1) / (4 + 2)
    assert m.update({"a": (2.0, 4), "b": (100.0, 11)}) == pytest.approx(0.5)
    assert m.update({"b": (100.0, 11)}, pool=["b"]) is None  # a left the pool: forgotten
    assert m.update({"a": (5.0, 10), "b": (100.0, 11)}) is None  # a is new again


def test_planner_loop_thread_ticks_on_its_interval(servers):
    cfg = PlannerConfig(mode="sla", interval_s=0.05, predictor="constant", allow_aggregated=False)
    act = DryRunActuator()
    with httpx.Client(timeout=LIVE_TIMEOUT_S) as client:
        loop = PlannerLoop(PlannerStateMachine(cfg, PROF), act, RequestWindow(), client=client,
                           registry=CollectorRegistry(), metrics_urls=lambda: {"decode": [servers[2].url]})
        loop.start()
        try:
            deadline = time.monotonic() + 60
            while len(act.decisions) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            loop.stop()
    assert len(act.decisions) >= 3
    times = [d.now_s for d in act.decisions]
    assert times == sorted(times)


def test_planner_from_a_deployment_spec_uses_the_perf_model():
    import json
    from pathlib import Path

    from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, PoolSpec
    from runtime.server.planner_loop import planner_from_spec

    from runtime.modelfiles.catalog import catalog_path

    cfg_path = catalog_path("llama-3.1-70b")
    spec = DeploymentSpec(model=ModelRef(name="llama-70b"), gpu="H100-SXM",
                          prefill=PoolSpec(tp=2, replicas=3, max_replicas=16), decode=PoolSpec(tp=4, replicas=1),
                          planner=PlannerSpec(mode="sla", predictor="constant"))
    sm = planner_from_spec(spec, json.loads(cfg_path.read_text()))
    assert (sm.prefill, sm.decode) == (3, 1)
    assert sm.profile is not None and sm.profile.decode.kv_capacity_tokens > 0
    low, high = sm.size_for_load(5.0, 1000, 200, with_agg=False), sm.size_for_load(50.0, 1000, 200, with_agg=False)
    assert high.prefill > low.prefill >= 1
    with pytest.raises(Exception, match="num_hidden_layers|hidden_size|num_attention_heads"):
        planner_from_spec(spec, {"model_type": "llama"})


def test_read_pool_survives_nan_inf_and_non_vllm_pages(caplog):
    nan_worker = MetricsServer(4, 2, 0.1)
    nan_worker.body = VLLM_METRICS.format(waiting="NaN", running="+Inf", kv=-0.5).encode()
    other = MetricsServer(0, 0, 0)
    other.body = b"# HELP up 1 if up\n# TYPE up gauge\nup 1\n"
    try:
        with httpx.Client(timeout=LIVE_TIMEOUT_S) as c:
            obs = read_pool(c, [nan_worker.url, other.url])
    finally:
        nan_worker.close()
        other.close()
    assert obs.num_ready == 1 and obs.num_starting == 1  # the page without vllm: metrics is not a ready worker
    assert obs.queue_per_worker == 0 and obs.running_per_worker == 0 and obs.kv_usage == 0
    assert "num_requests_waiting = nan; read as 0" in caplog.text


def test_prefill_time_needs_both_totals_and_a_restart_is_seen_when_either_drops(servers):
    from runtime.server.planner_loop import PrefillTimeMeter

    servers[0].body = (servers[0].base + "# TYPE vllm:request_prefill_time_seconds histogram\n"
                       'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 10\n').encode()
    totals: dict = {}
    with httpx.Client(timeout=LIVE_TIMEOUT_S) as c:
        read_pool(c, [servers[0].url], prefill_time_totals=totals)
    assert totals == {}  # a count without a sum would read as a 0-s prefill time
    meter = PrefillTimeMeter()
    meter.update({"w": (10.0, 100)})
    assert meter.update({"w": (1.0, 250)}) == pytest.approx(1.0 / 250)  # restarted: the sum went down


def test_a_late_tick_plans_on_the_window_it_actually_covered(servers):
    cfg = PlannerConfig(mode="sla", interval_s=30.0, predictor="constant", allow_aggregated=False,
                        max_prefill=10, max_decode=10)
    now = [0.0]
    window = RequestWindow(clock=lambda: now[0])
    for i in range(900):  # 10 req/s for 90 s: the tick came 60 s late
        now[0] = i / 10
        window.record_arrival(1000)
        window.record_first_token(0.3)
        window.record_finish(200, itl_s=0.02)
    now[0] = 90.0
    seen = []

    class Recording(PlannerStateMachine):
        def on_tick(self, tick):  # noqa: ANN001, ANN202
            seen.append(tick)
            return super().on_tick(tick)

    with httpx.Client(timeout=LIVE_TIMEOUT_S) as client:
        loop = PlannerLoop(Recording(cfg, PROF), DryRunActuator(), window, client=client, registry=CollectorRegistry(),
                           metrics_urls=lambda: {"prefill": [servers[0].url], "decode": [servers[2].url]})
        d = loop.tick(now_s=90.0)
    assert seen[0].interval_s == pytest.approx(90.0) and seen[0].rate_per_s == pytest.approx(10.0)
    assert d.predicted_rate_per_s == pytest.approx(10.0)


# A trickled page takes a minute (one byte every TRICKLE_GAP_S); a read its deadline bounds ends within
# seconds. The tests' bounds lie between the two: their deadlines plus STALL_S, for a loaded CI machine that
# pauses the test or its server threads for seconds, and still far below the page's minute.
TRICKLE_GAP_S = 0.25
TRICKLE_BYTES = 240
STALL_S = 15.0
# Each read's deadline where a page that answers at once is read beside the trickling one: long enough that a
# stalled machine still reads that page within it (it must count as ready).
DEADLINE_S = 3.0


class TrickleServer:
    """A loopback server that answers every connection one byte at a time, one byte every `gap_s`: the
    status line and headers too (`headers=True`: a padding header longer than the trickle, so they never
    end) or only the body (after complete headers). It hangs up after `num_bytes` trickled bytes (a minute at
    the defaults), so an unbounded reader fails the bound, not the session."""

    def __init__(self, gap_s: float = TRICKLE_GAP_S, *, headers: bool, num_bytes: int = TRICKLE_BYTES) -> None:
        import socket

        self.gap_s, self.headers, self.num_bytes, self.stop = gap_s, headers, num_bytes, threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/metrics"
        self.threads: list[threading.Thread] = []
        self.accepter = threading.Thread(target=self._accept, daemon=True)
        self.accepter.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, conn) -> None:
        body = VLLM_METRICS.format(waiting=1, running=1, kv=0.1).encode() * 50
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                f"X-Padding: {'x' * self.num_bytes}\r\n\r\n").encode()
        try:
            conn.recv(65536)
            if not self.headers:
                conn.sendall(head)
            for b in ((head if self.headers else b"") + body)[:self.num_bytes]:
                if self.stop.wait(self.gap_s):
                    break
                conn.sendall(bytes([b]))
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.accepter.join(5)
        for t in self.threads:
            t.join(5)
        self.sock.close()


@pytest.mark.parametrize("headers", [False, True], ids=["body-trickles", "headers-trickle"])
def test_a_trickling_metrics_endpoint_costs_one_deadline_not_the_tick(servers, headers, caplog):
    slow = TrickleServer(headers=headers)
    assert slow.num_bytes * slow.gap_s > 3 * DEADLINE_S + STALL_S  # an unbounded read fails every bound below
    try:
        with httpx.Client(timeout=DEADLINE_S) as c:  # per network read, and read_pool's default per page
            t0 = time.monotonic()
            obs = read_pool(c, [servers[0].url, slow.url])
            took_s = time.monotonic() - t0
            assert took_s < DEADLINE_S + STALL_S, took_s
            assert obs.num_ready == 1 and obs.num_starting == 1 and obs.queue_per_worker == pytest.approx(4.0)
            assert f"planner: worker metrics {slow.url} unreadable" in caplog.text
            in_flight: dict = {}
            t0 = time.monotonic()
            for _ in range(3):  # a read still blocked is not started again
                obs = read_pool(c, [servers[0].url, slow.url], deadline_s=DEADLINE_S, in_flight=in_flight)
                assert obs.num_ready == 1 and obs.num_starting == 1
            assert time.monotonic() - t0 < 3 * DEADLINE_S + STALL_S
            # at most one connection per read_pool call; the headers never end, so the read of the first of the
            # three calls is still blocked at the other two, which open none
            assert len(slow.threads) <= (2 if headers else 4), len(slow.threads)
    finally:
        slow.close()


def test_planner_loop_tick_is_bounded_by_the_metrics_deadline(servers):
    cfg = PlannerConfig(mode="sla", interval_s=30.0, predictor="constant", allow_aggregated=False)
    slow = TrickleServer(headers=False)
    try:
        with httpx.Client(timeout=5.0) as client:
            loop = PlannerLoop(PlannerStateMachine(cfg, PROF), DryRunActuator(), RequestWindow(), client=client,
                               registry=CollectorRegistry(), metrics_deadline_s=0.5,
                               metrics_urls=lambda: {"prefill": [slow.url], "decode": [servers[2].url]})
            t0 = time.monotonic()
            loop.tick(now_s=0.0)
            assert time.monotonic() - t0 < 2 * 0.5 + STALL_S  # a deadline per pool, not the page's minute
    finally:
        slow.close()


class CappedActuator:
    """Applies at most `cap` workers in all (decode first), like LocalActuator's max_workers; `fail` raises."""

    def __init__(self, cap: int) -> None:
        self.cap, self.fail, self.now = cap, False, (0, 0)

    def apply(self, decision):
        from runtime.server.actuators import Applied

        if self.fail:
            raise RuntimeError("API server unreachable")
        d = min(decision.decode_replicas, self.cap)
        p = min(decision.prefill_replicas, self.cap - d)
        changed, self.now = (p, d) != self.now, (p, d)
        return Applied(p, d, changed)

    def current(self):
        return self.now

    def close(self):
        pass


def test_gauges_show_what_the_actuator_applied_beside_the_decision(servers):
    # beta as given (no dispersion scaling): the decision below does not hang on the dispersion defaults
    cfg = PlannerConfig(mode="sla", interval_s=30.0, predictor="constant", allow_aggregated=False,
                        max_prefill=10, max_decode=10, prefill_staffing_beta=1.4, staffing_dispersion_ref=None)
    now = [0.0]
    window = RequestWindow(clock=lambda: now[0])

    def load() -> None:
        for i in range(900):  # 30 req/s over 30 s: the planner decides 6 prefill + 2 decode (test above)
            now[0] = i / 30
            window.record_arrival(1000)
            window.record_first_token(0.3)
            window.record_finish(200, itl_s=0.02)
        now[0] = 30.0

    registry = CollectorRegistry()
    act = CappedActuator(cap=4)
    with httpx.Client(timeout=LIVE_TIMEOUT_S) as client:
        loop = PlannerLoop(PlannerStateMachine(cfg, PROF), act, window, client=client, registry=registry,
                           metrics_urls=lambda: {"prefill": [servers[0].url, servers[1].url], "decode": [servers[2].url]})
        load()
        d = loop.tick(now_s=30.0)
        assert (d.prefill_replicas, d.decode_replicas) == (6, 2)
        text = generate_latest(registry).decode()
        assert "pdserve_planner_prefill_replicas 6.0" in text and "pdserve_planner_decode_replicas 2.0" in text
        assert 'pdserve_planner_applied_replicas{pool="prefill"} 2.0' in text
        assert 'pdserve_planner_applied_replicas{pool="decode"} 2.0' in text
        assert (loop.last_applied.prefill_replicas, loop.last_applied.decode_replicas) == (2, 2)
        act.cap, act.fail = 10, True  # the next apply fails: the decision shows, the applied counts stay
        load()
        with pytest.raises(RuntimeError, match="unreachable"):
            loop.tick(now_s=60.0)
        text = generate_latest(registry).decode()
        assert "pdserve_planner_ticks_total 2.0" in text
        assert 'pdserve_planner_applied_replicas{pool="prefill"} 2.0' in text
