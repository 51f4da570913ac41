"""LocalActuator lifecycle rules, with in-process stand-in workers and an injected clock.

Specification:
* scale-down stops workers that are not ready (still starting) before ready ones;
* a worker not ready `startup_timeout_s` after its start is stopped and counted as failed;
* a worker that exits on its own is logged (exit code, log path, log tail) and counted as failed; restarts of
  that role back off exponentially (first one at once, then base, 2*base, ... capped);
* every stopped or crashed worker's ports go back to runtime.ports.
"""

from __future__ import annotations

import logging

import pytest

from runtime import ports
from runtime.planner.types import ScalingDecision
from runtime.server.actuators import LocalActuator, worker_ports


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class FakeWorker:
    """WorkerProcess's interface without a process: `ready` and `crash` script its life."""

    def __init__(self, role: str, index: int, *, ready: bool = True, crash: bool = False) -> None:
        self.role, self.index, self.ready, self.crash = role, index, ready, crash
        self.running = self.stopped = False
        self.log_path = f"/logs/{role}-{index}.log"

    base_url = property(lambda self: f"http://127.0.0.1:{9000 + self.index}")

    def start(self):
        self.running = not self.crash
        return self

    def stop(self, timeout_s: float = 30.0):
        self.running, self.stopped = False, True
        return 3 if self.crash else 0

    def alive(self) -> bool:
        return self.running

    def wait_ready(self, timeout_s: float = 600.0, poll_interval_s: float = 1.0) -> None:
        if not self.running:
            raise RuntimeError("exited")
        if not self.ready:
            raise TimeoutError("not ready")

    def log_tail(self, num_bytes: int = 4000) -> str:
        return "RuntimeError: out of KV cache memory"


def decision(p: int, d: int) -> ScalingDecision:
    return ScalingDecision(now_s=0.0, prefill_replicas=p, decode_replicas=d)


def test_scale_down_stops_a_starting_worker_before_the_only_ready_one():
    made: list[FakeWorker] = []

    def factory(role, index):
        # the first worker never becomes ready, the second (newer) one does
        made.append(FakeWorker(role, index, ready=index == 1))
        return made[-1]

    act = LocalActuator(factory, max_workers=2)
    act.apply(decision(0, 2))
    act.apply(decision(0, 2))  # a tick later: the newer worker answers, the older still starts
    act.apply(decision(0, 1))
    assert act.workers("decode") == [made[1]]
    assert made[0].stopped and not made[1].stopped


def test_scale_down_among_ready_workers_stops_the_newest():
    made: list[FakeWorker] = []
    act = LocalActuator(lambda r, i: made.append(FakeWorker(r, i)) or made[-1], max_workers=3)
    act.apply(decision(0, 3))
    act.apply(decision(0, 3))
    act.apply(decision(0, 1))
    assert act.workers("decode") == [made[0]]


def test_a_worker_not_ready_by_the_start_up_deadline_is_stopped_and_counted_failed(caplog):
    clock = Clock()
    made: list[FakeWorker] = []

    def factory(role, index):
        made.append(FakeWorker(role, index, ready=index > 0))  # only the first one hangs
        return made[-1]

    act = LocalActuator(factory, max_workers=2, startup_timeout_s=900.0, clock=clock)
    act.apply(decision(0, 1))
    clock.now_s = 899.0
    act.apply(decision(0, 1))
    assert act.workers("decode") == [made[0]] and not made[0].stopped  # still within its deadline
    clock.now_s = 901.0
    with caplog.at_level(logging.WARNING, logger="runtime.server.actuators"):
        act.apply(decision(0, 1))
    assert made[0].stopped and act.num_failed["decode"] == 1
    assert act.workers("decode") == [made[1]]  # its slot went to a new worker
    assert "start-up deadline" in caplog.text and made[0].log_path in caplog.text


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_start_up_deadline_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="startup_timeout_s"):
        LocalActuator(FakeWorker, startup_timeout_s=bad)


def test_a_crash_loop_backs_off_exponentially_and_logs_each_crash(caplog):
    clock = Clock()
    made: list[FakeWorker] = []
    act = LocalActuator(lambda r, i: made.append(FakeWorker(r, i, crash=True)) or made[-1], max_workers=2,
                        restart_backoff_s=10.0, restart_backoff_max_s=600.0, clock=clock)
    starts_s: list[float] = []
    with caplog.at_level(logging.WARNING, logger="runtime.server.actuators"):
        for t in range(0, 3000):  # one tick per second
            clock.now_s = float(t)
            before = len(made)
            act.apply(decision(0, 1))
            if len(made) > before:
                starts_s.append(clock.now_s)
    gaps = [b - a for a, b in zip(starts_s, starts_s[1:])]
    # first restart at once (next tick), then 10, 20, 40, ... s after each crash, capped at 600 s
    assert gaps[:8] == [1.0, 11.0, 21.0, 41.0, 81.0, 161.0, 321.0, 601.0]
    assert max(gaps) == 601.0
    crashes = [r for r in caplog.records if "exited with code 3 before it was ready" in r.getMessage()]
    assert len(crashes) == act.num_failed["decode"] and len(made) - 1 <= len(crashes) <= len(made)
    assert "/logs/decode-0.log" in crashes[0].getMessage() and "out of KV cache memory" in crashes[0].getMessage()


def test_a_worker_seen_ready_resets_the_backoff():
    clock = Clock()
    made: list[FakeWorker] = []
    script = [True, True, False]  # crash, crash, then a healthy one

    def factory(role, index):
        made.append(FakeWorker(role, index, crash=script[index] if index < len(script) else True))
        return made[-1]

    act = LocalActuator(factory, max_workers=2, restart_backoff_s=10.0, clock=clock)
    for t in (0, 1, 2, 12, 13):
        clock.now_s = t
        act.apply(decision(0, 1))
    assert len(made) == 3 and made[2].alive() and act.is_ready(made[2])
    made[2].running = False  # it crashes later: replaced at once, the failures in a row start over
    clock.now_s = 14
    act.apply(decision(0, 1))
    assert len(made) == 4


class PortWorker(FakeWorker):
    """Takes its ports from runtime.ports like WorkerProcess does."""

    def __init__(self, role: str, index: int) -> None:
        super().__init__(role, index, crash=True)
        self.host = "127.0.0.1"
        self.port, self.side_channel_port, self.kv_events_port = ports.free_ports(3, self.host)


def test_crashed_and_stopped_workers_give_their_ports_back():
    clock = Clock()
    made: list[PortWorker] = []
    act = LocalActuator(lambda r, i: made.append(PortWorker(r, i)) or made[-1], max_workers=2,
                        restart_backoff_s=0.0, restart_backoff_max_s=0.0, clock=clock)
    num_given = len(ports._given)
    for t in range(60):
        clock.now_s = float(t)
        act.apply(decision(0, 1))
    assert len(made) == 60
    live = set(worker_ports(made[-1]))
    given = {p for _, p in ports._given}
    assert len(ports._given) == num_given + 3  # only the live worker's ports stay taken
    # a crashed worker's port is taken again only when a later worker was handed it (that is the point)
    assert all(p not in given or p in live for w in made[:-1] for p in worker_ports(w))
    assert live <= given  # the live one still holds its ports
    act.close()
    assert all(p not in {q for _, q in ports._given} for p in worker_ports(made[-1]))


def test_worker_ports_skips_missing_and_unset_ports():
    w = FakeWorker("decode", 0)
    assert worker_ports(w) == []
    w.port, w.side_channel_port, w.kv_events_port = 20001, 20002, None
    assert worker_ports(w) == [20001, 20002]


def _draining_actuator() -> tuple[Clock, list[FakeWorker], LocalActuator]:
    clock, made = Clock(), []

    def factory(role, index):
        made.append(FakeWorker(role, index))
        return made[-1]

    return clock, made, LocalActuator(factory, max_workers=3, drain_s=30.0, clock=clock, ready_probe=lambda w: True)


def test_a_ready_worker_drains_out_of_the_pool_before_it_is_stopped():
    clock, made, act = _draining_actuator()
    act.apply(ScalingDecision(now_s=0, prefill_replicas=0, decode_replicas=2))
    clock.now_s = 1.0
    act.apply(ScalingDecision(now_s=1, prefill_replicas=0, decode_replicas=2))  # both seen ready
    clock.now_s = 2.0
    act.apply(ScalingDecision(now_s=2, prefill_replicas=0, decode_replicas=1))
    leaving = made[1]
    assert leaving not in act.workers("decode") and act.current() == (0, 1)  # out of the router's pool ...
    assert leaving.running and not leaving.stopped  # ... but still finishing what it has
    clock.now_s = 20.0
    act.apply(ScalingDecision(now_s=20, prefill_replicas=0, decode_replicas=1))
    assert not leaving.stopped  # drain not over
    clock.now_s = 33.0
    act.apply(ScalingDecision(now_s=33, prefill_replicas=0, decode_replicas=1))
    assert leaving.stopped and len(made) == 2


def test_a_scale_up_during_the_drain_takes_the_worker_back_and_close_stops_draining_ones():
    clock, made, act = _draining_actuator()
    act.apply(ScalingDecision(now_s=0, prefill_replicas=0, decode_replicas=2))
    clock.now_s = 1.0
    act.apply(ScalingDecision(now_s=1, prefill_replicas=0, decode_replicas=1))
    act.apply(ScalingDecision(now_s=1, prefill_replicas=0, decode_replicas=1))
    clock.now_s = 5.0
    act.apply(ScalingDecision(now_s=5, prefill_replicas=0, decode_replicas=2))
    assert len(made) == 2 and act.current() == (0, 2) and not any(w.stopped for w in made)  # no new process
    act.apply(ScalingDecision(now_s=5, prefill_replicas=0, decode_replicas=1))
    act.close()
    assert all(w.stopped for w in made)
