"""Planner leader election: the pure state machine (runtime/planner/leadership.py) on an in-memory store, and
its adapters (runtime/server/leader.py): the Kubernetes Lease store against a fake CoordinationV1Api (no API
server can run here), the file store, and the planner loop's gating of the actuator."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from runtime.planner.leadership import ElectionConfig, LeaderElector, LeaseRecord, Write
from runtime.server.leader import FileLeaseStore, KubernetesLeaseStore, LeaderElection

CFG = ElectionConfig(lease_duration_s=15, renew_deadline_s=10, retry_period_s=2)


class MemStore:
    """Compare-and-write store, the semantics the real ones give (version bumps on every write)."""

    def __init__(self) -> None:
        self.rec: LeaseRecord | None = None
        self.n = 0

    def read(self) -> LeaseRecord | None:
        return self.rec

    def write(self, w: Write) -> bool:
        if (self.rec is not None) if w.create else (self.rec is None or self.rec.version != w.record.version):
            return False
        self.n += 1
        self.rec = LeaseRecord(w.record.holder, w.record.lease_duration_s, w.record.transitions, str(self.n))
        return True


def rounds(replicas: dict[str, LeaderElection], t: list[float], until: float, alive: set[str]) -> list[tuple]:
    """Run every alive replica each retry period until `until`; the (time, leaders) seen after each round."""
    seen = []
    while t[0] < until:
        for name in sorted(alive):
            replicas[name].run_once()
        seen.append((t[0], {n for n in alive if replicas[n].is_leader()}))
        t[0] += CFG.retry_period_s
    return seen


def make(store, t: list[float], names=("a", "b", "c")) -> dict[str, LeaderElection]:
    return {n: LeaderElection(store, LeaderElector(n, CFG), clock=lambda: t[0]) for n in names}


def test_exactly_one_leader_and_takeover_within_bound():
    store, t = MemStore(), [0.0]
    reps = make(store, t)
    seen = rounds(reps, t, 60, {"a", "b", "c"})
    assert all(len(leaders) == 1 for _, leaders in seen)
    (first,) = seen[0][1]
    assert all(leaders == {first} for _, leaders in seen)  # a renewing leader keeps it
    died_at = t[0]
    rest = {"a", "b", "c"} - {first}
    seen = rounds(reps, t, died_at + 60, rest)
    took = next(ts for ts, leaders in seen if leaders)
    assert took - died_at <= CFG.takeover_bound_s
    assert took - died_at >= CFG.lease_duration_s - CFG.retry_period_s  # not before the lease could expire
    assert all(len(leaders) <= 1 for _, leaders in seen)
    assert store.rec.transitions == 1 and store.rec.holder in rest
    # the dead leader's clock: it stopped being leader at its renew deadline, before anyone could take over
    assert not reps[first].elector.is_leader(died_at - CFG.retry_period_s + CFG.renew_deadline_s)


def test_leader_that_cannot_write_stops_before_takeover():
    store, t = MemStore(), [0.0]
    reps = make(store, t, ("a", "b"))
    rounds(reps, t, 10, {"a", "b"})
    leader = next(n for n in reps if reps[n].is_leader())
    last_ok = t[0] - CFG.retry_period_s
    real_write = store.write

    def failing(w):  # the leader's writes fail (API errors); the record stays as it was
        if w.record.holder == leader:
            raise ConnectionError("API server unreachable")
        return real_write(w)

    store.write = failing
    other = ({"a", "b"} - {leader}).pop()
    seen = rounds(reps, t, 40, {"a", "b"})
    lost = next(ts for ts, leaders in seen if leader not in leaders)
    took = next(ts for ts, leaders in seen if other in leaders)
    assert lost - last_ok <= CFG.renew_deadline_s and lost < took  # never two leaders
    assert all(len(leaders) <= 1 for _, leaders in seen)


def test_release_hands_over_at_next_read():
    store, t = MemStore(), [0.0]
    reps = make(store, t, ("a", "b"))
    rounds(reps, t, 6, {"a", "b"})
    leader = next(n for n in reps if reps[n].is_leader())
    reps[leader].stop()
    assert store.rec.holder == "" and not reps[leader].is_leader()
    other = ({"a", "b"} - {leader}).pop()
    assert reps[other].run_once()


def test_racing_takeover_has_one_winner():
    store = MemStore()
    store.write(Write(LeaseRecord("dead", 15), create=True, acquired=True))
    a, b = LeaderElector("a", CFG), LeaderElector("b", CFG)
    for e in (a, b):
        assert e.step(0.0, store.read()) is None  # fresh holder: wait
    wa, wb = a.step(15.0, store.read()), b.step(15.0, store.read())
    assert wa is not None and wb is not None
    a.written(15.0, store.write(wa))
    b.written(15.0, store.write(wb))
    assert a.is_leader(15.0) != b.is_leader(15.0)


def test_for_interval_keeps_takeover_within_interval():
    assert ElectionConfig.for_interval(30.0) == ElectionConfig()
    for iv in (0.5, 2.0, 10.0, 18.9, 19.0, 30.0, 600.0):
        assert ElectionConfig.for_interval(iv).takeover_bound_s <= iv
    with pytest.raises(ValueError):
        ElectionConfig(10, 10, 2)
    with pytest.raises(ValueError):
        ElectionConfig.for_interval(0)


# ------------------------------------------------------------------------------------------ Kubernetes adapter
class FakeCoordinationApi:
    """The three CoordinationV1Api calls the store makes, with the API server's resourceVersion checks."""

    def __init__(self) -> None:
        self.leases: dict[tuple[str, str], client.V1Lease] = {}
        self.rv = 0

    def read_namespaced_lease(self, name, namespace):
        if (namespace, name) not in self.leases:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.leases[(namespace, name)])

    def _store(self, namespace, body):
        self.rv += 1
        body = copy.deepcopy(body)
        body.metadata.resource_version = str(self.rv)
        self.leases[(namespace, body.metadata.name)] = body
        return body

    def create_namespaced_lease(self, namespace, body):
        if (namespace, body.metadata.name) in self.leases:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._store(namespace, body)

    def replace_namespaced_lease(self, name, namespace, body):
        cur = self.leases.get((namespace, name))
        if cur is None:
            raise ApiException(status=404, reason="Not Found")
        if body.metadata.resource_version != cur.metadata.resource_version:
            raise ApiException(status=409, reason="Conflict")
        return self._store(namespace, body)


def test_kubernetes_store_election():
    api, t, wall = FakeCoordinationApi(), [0.0], [1_700_000_000.0]
    reps = {n: LeaderElection(KubernetesLeaseStore(api, namespace="ns", name="m-planner-leader", now=lambda: wall[0]),
                              LeaderElector(n, CFG), clock=lambda: t[0]) for n in ("pod-a", "pod-b")}
    for n in sorted(reps):
        reps[n].run_once()
    lease = api.leases[("ns", "m-planner-leader")]
    leader = lease.spec.holder_identity
    assert reps[leader].is_leader() and sum(r.is_leader() for r in reps.values()) == 1
    assert lease.spec.lease_duration_seconds == 15 and lease.spec.lease_transitions == 0
    acquired = lease.spec.acquire_time
    t[0] += 2
    wall[0] += 2
    reps[leader].run_once()  # renewal: acquire time kept, renew time moves
    lease = api.leases[("ns", "m-planner-leader")]
    assert lease.spec.acquire_time == acquired and lease.spec.renew_time > acquired
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", acquired)  # MicroTime, 6 digits even at .0
    other = ({"pod-a", "pod-b"} - {leader}).pop()
    while not reps[other].run_once():  # the leader died: the other takes over after the lease
        t[0] += 2
        wall[0] += 2
        assert t[0] <= 2 + CFG.takeover_bound_s
    lease = api.leases[("ns", "m-planner-leader")]
    assert lease.spec.holder_identity == other and lease.spec.lease_transitions == 1
    reps[other].stop()
    assert api.leases[("ns", "m-planner-leader")].spec.holder_identity is None


def test_kubernetes_store_conflict_is_a_failed_write():
    api = FakeCoordinationApi()
    store = KubernetesLeaseStore(api, namespace="ns", name="l")
    assert store.write(Write(LeaseRecord("a", 15), create=True, acquired=True))
    assert not store.write(Write(LeaseRecord("b", 15), create=True, acquired=True))
    stale = store.read()
    assert store.write(Write(LeaseRecord("a", 15, 0, stale.version), create=False, acquired=False))
    assert not store.write(Write(LeaseRecord("b", 15, 1, stale.version), create=False, acquired=True))


def test_file_store_compare_and_write(tmp_path):
    store = FileLeaseStore(tmp_path / "sub" / "leader.json")
    assert store.read() is None
    assert store.write(Write(LeaseRecord("a", 1.0), create=True, acquired=True))
    assert not store.write(Write(LeaseRecord("b", 1.0), create=True, acquired=True))
    r = store.read()
    assert r.holder == "a" and r.version == "1"
    assert store.write(Write(LeaseRecord("b", 1.0, 1, r.version), create=False, acquired=True))
    assert not store.write(Write(LeaseRecord("c", 1.0, 2, r.version), create=False, acquired=True))  # stale
    assert store.read().holder == "b"
    (tmp_path / "sub" / "leader.json").write_text("{torn")
    r = store.read()
    assert r.holder == "" and store.write(Write(LeaseRecord("c", 1.0, 0, r.version), create=False, acquired=True))


# ------------------------------------------------------------------------------------------ planner loop gating
def test_a_follower_computes_and_exports_but_does_not_actuate():
    import httpx
    from prometheus_client import CollectorRegistry

    from runtime.planner.profiles import analytic_profile
    from runtime.planner.state_machine import PlannerStateMachine
    from runtime.planner.types import PlannerConfig
    from runtime.server.actuators import DryRunActuator
    from runtime.server.planner_loop import PlannerLoop, RequestWindow

    prof = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4,
                            kv_capacity_tokens=100_000)
    cfg = PlannerConfig(mode="sla", interval_s=30.0, predictor="constant", allow_aggregated=False,
                        max_prefill=10, max_decode=10)
    now, leader = [0.0], [False]
    window = RequestWindow(clock=lambda: now[0])
    registry, act = CollectorRegistry(), DryRunActuator(prefill=1, decode=1)
    with httpx.Client() as http:
        loop = PlannerLoop(PlannerStateMachine(cfg, prof), act, window, client=http, registry=registry,
                           metrics_urls=lambda: {"prefill": [], "decode": []}, leader=lambda: leader[0])
        for i in range(900):
            now[0] = i / 30
            window.record_arrival(1000)
        now[0] = 30.0
        d = loop.tick(now_s=30.0)
        assert d.prefill_replicas > 1 and act.decisions == [] and act.current() == (1, 1)
        assert registry.get_sample_value("pdserve_planner_leader") == 0
        assert registry.get_sample_value("pdserve_planner_prefill_replicas") == d.prefill_replicas
        assert registry.get_sample_value("pdserve_planner_actuations_total") == 0
        leader[0] = True
        now[0] = 60.0
        d = loop.tick(now_s=60.0)
        assert act.decisions == [d] and registry.get_sample_value("pdserve_planner_leader") == 1
        assert registry.get_sample_value("pdserve_planner_actuations_total") == 1


def test_a_read_acquire_time_is_written_back_as_micro_time():
    import datetime as dt

    from runtime.server.leader import _as_micro

    t = dt.datetime(2026, 12, 5, 1, 2, 3, tzinfo=dt.timezone.utc)  # as the client deserialises MicroTime
    assert _as_micro(t) == "2026-12-05T01:02:03.000000Z"
    assert _as_micro("2026-12-05T01:02:03.500000Z") == "2026-12-05T01:02:03.500000Z"


# ------------------------------------------------------------------ the leader plans for every replica's traffic
def test_a_replicas_window_is_scaled_to_all_the_traffic_by_its_share():
    from runtime.server.planner_loop import RequestWindow, scale_window

    now = [0.0]
    window = RequestWindow(clock=lambda: now[0])
    for i in range(10):
        now[0] = float(i)
        window.record_arrival(100 + i, priority=i < 2)
    now[0] = 10.0
    w = window.drain()
    two = scale_window(w, 2.0)
    assert (two.num_requests, two.num_priority_requests) == (20, 4)
    assert two.peak_prefill_tokens_per_s == pytest.approx(2 * w.peak_prefill_tokens_per_s)
    assert (two.mean_isl_tokens, two.p90_isl_tokens, two.arrival_dispersion) == (
        w.mean_isl_tokens, w.p90_isl_tokens, w.arrival_dispersion)
    # each arrival twice, the copy within the second after it (the others' share of a burst comes with it)
    assert len(two.prompt_arrivals) == 20
    assert sorted(n for _, n in two.prompt_arrivals) == sorted(n for _, n in w.prompt_arrivals for _ in range(2))
    assert all(0 <= t2 - t < 1 for (t, _), (t2, _) in zip(sorted(w.prompt_arrivals * 2), two.prompt_arrivals))
    half = scale_window(w, 1.5)  # a fraction by a deterministic stride: 15 arrivals of 10
    assert len(half.prompt_arrivals) == 15 and half.num_requests == 15
    for n in (1, 3, 5, 7):  # the counts and the arrivals agree for every size and fraction
        arrivals = tuple((float(i), 100.0) for i in range(n))
        small = dataclasses.replace(w, num_requests=n, num_priority_requests=n, prompt_arrivals=arrivals)
        for f in (1.3, 2.5, 3.7, 16.0):
            s = scale_window(small, f)
            assert s.num_requests == s.num_priority_requests == len(s.prompt_arrivals)
    assert scale_window(w, 1.0) == w
    with pytest.raises(ValueError, match="factor"):
        scale_window(w, 0.5)


def test_the_routers_share_of_the_decode_workers_requests_is_measured_from_the_engines_gauges():
    from runtime.config import RouterSpec
    from runtime.server.routing import MIN_TRAFFIC_SHARE, RouterPairing, WorkerEndpoint

    pairing = RouterPairing(RouterSpec(policy="least_loaded"), 16, [WorkerEndpoint("d0", "decode", "http://d0"),
                                                             WorkerEndpoint("d1", "decode", "http://d1")])
    assert pairing.drain_traffic_share() is None  # nothing read yet
    pairing.load_of("http://d0").engine_requests = 2
    pairing.load_of("http://d1").engine_requests = 1
    pairing.set_engine_load("http://d0", 6)  # the engines run twice as many: two more replicas' worth
    pairing.set_engine_load("http://d1", 3)
    pairing.set_engine_load("http://d1", None)  # an unreadable page counts for nothing
    assert pairing.drain_traffic_share() == pytest.approx(3 / 9)
    assert pairing.drain_traffic_share() is None  # drained
    pairing.set_engine_load("http://d0", 1)  # a request ended between the gauge's read and the router's count
    assert pairing.drain_traffic_share() == 1.0
    pairing.load_of("http://d0").engine_requests = 0
    pairing.set_engine_load("http://d0", 50)
    assert pairing.drain_traffic_share() == MIN_TRAFFIC_SHARE


def test_requests_still_prefilling_elsewhere_count_neither_in_the_share_nor_against_the_other_replicas():
    """P/D: a decode engine counts a request from its decode leg on, so the router must too: three requests
    routed, one still prefilling, and the engine runs two of ours and two of another replica's."""
    from runtime.config import RouterSpec
    from runtime.server.pairing import RouteRequest
    from runtime.server.routing import RouterPairing, WorkerEndpoint

    pairing = RouterPairing(RouterSpec(policy="least_loaded", disagg_min_uncached_tokens=0), 16, [
        WorkerEndpoint("p0", "prefill", "http://p0"), WorkerEndpoint("d0", "decode", "http://d0")])
    routes = [pairing.choose(RouteRequest(f"r{i}", "/v1/completions", {"prompt": "x"})) for i in range(3)]
    assert all(r.prefill_url == "http://p0" for r in routes)
    d0, p0 = pairing.load_of("http://d0"), pairing.load_of("http://p0")
    assert (d0.num_requests, d0.engine_requests, p0.engine_requests) == (3, 0, 3)
    pairing.on_first_token("r0", 1.0)
    pairing.on_first_token("r1", 1.0)
    assert (d0.engine_requests, p0.engine_requests) == (2, 1)
    pairing.set_engine_load("http://d0", 4)
    assert pairing.drain_traffic_share() == pytest.approx(2 / 4)
    assert d0.external_requests == 2
    # a failed prefill falls back to the decode worker, which holds the request from then on
    pairing.on_prefill_failed("r2", 2.0)
    assert (d0.engine_requests, p0.engine_requests) == (3, 0)
    for rid in ("r0", "r1", "r2"):
        pairing.on_complete(rid, 3.0, ok=True)
    assert (d0.engine_requests, d0.num_requests, p0.engine_requests) == (0, 0, 0)


def test_the_leader_sizes_for_its_share_scaled_up():
    import httpx
    from prometheus_client import CollectorRegistry

    from runtime.planner.profiles import analytic_profile
    from runtime.planner.state_machine import PlannerStateMachine
    from runtime.planner.types import PlannerConfig
    from runtime.server.actuators import DryRunActuator
    from runtime.server.planner_loop import PlannerLoop, RequestWindow

    prof = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4,
                            kv_capacity_tokens=100_000)
    cfg = PlannerConfig(mode="sla", interval_s=30.0, predictor="constant", allow_aggregated=False,
                        max_prefill=64, max_decode=64)
    seen = {}
    for share in (None, 0.25):
        now = [0.0]
        window = RequestWindow(clock=lambda: now[0])
        registry = CollectorRegistry()
        machine = PlannerStateMachine(cfg, prof)
        on_tick = machine.on_tick
        machine.on_tick = lambda t, on_tick=on_tick, share=share: seen.setdefault(share, t) and on_tick(t)
        with httpx.Client() as http:
            loop = PlannerLoop(machine, DryRunActuator(prefill=1, decode=1), window, client=http, registry=registry,
                               metrics_urls=lambda: {"prefill": [], "decode": []}, traffic_share=lambda s=share: s)
            for i in range(300):
                now[0] = i / 10
                window.record_arrival(1000)
            now[0] = 30.0
            loop.tick(now_s=30.0)
        assert registry.get_sample_value("pdserve_planner_traffic_share") == (share or 1.0)
    assert seen[0.25].num_requests == 4 * seen[None].num_requests
    assert len(seen[0.25].prompt_arrivals) == 4 * len(seen[None].prompt_arrivals)
