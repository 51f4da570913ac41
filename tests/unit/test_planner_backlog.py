"""The SLA planner against a backlog: queues that a phase of long prompts leaves behind a fleet too small for it.

* Decode plans for every request not yet admitted (queued for prefill or waiting for decode admission):
  prefill drains its queue into decode within the backlog drain time.
* The closed-loop floors (rules 12 and 13) raise a pool by what its *ready* workers lack: workers a sizing
  raise is still starting and the spare capacity of the ready ones count toward the backlog.

Profiles (tests/planner_builders.py): prefill 0.1 ms per prompt token, decode step 10 ms + 0.1 ms per running
sequence, KV 100k tokens per worker.
"""

import math

from runtime.planner import sla
from runtime.planner.state_machine import QUEUE_PRESSURE_TICKS, PlannerStateMachine
from runtime.planner.types import PoolObservation, TickInput
from tests.planner_builders import PROF, fleet_tick, planner_cfg

INTERVAL_S = 30.0
ISL, OSL = 2000.0, 200.0


def steady(sm: PlannerStateMachine, ticks: int, rate: float) -> float:
    """``ticks`` quiet ticks at ``rate`` requests/s, the fleet what the planner asked for; returns the time."""
    now = 0.0
    for _ in range(ticks):
        now += INTERVAL_S
        fleet_tick(sm, now, rate, isl=ISL, osl=OSL, interval_s=INTERVAL_S,
                   decode=dict(running_per_worker=10.0, kv_usage=0.2), observed_itl_p90_s=0.012,
                   observed_itl_mean_s=0.011)
    return now


def test_decode_plans_for_the_prefill_queue_it_will_receive():
    # 20 req/s of ISL 2000 / OSL 200: one decode worker holds ~40 sequences of context 2100 in 90 % of its
    # KV at ~14 ms a step, ~14 req/s; a prefill queue of 1,200 requests reaches decode within the 60-s drain
    # time on top of the arrivals, so decode must be sized above what the arrivals alone ask for
    def final(queue: float) -> int:
        sm = PlannerStateMachine(planner_cfg(), PROF)
        now = steady(sm, 4, 20.0)
        d = fleet_tick(sm, now + INTERVAL_S, 20.0, isl=ISL, osl=OSL, interval_s=INTERVAL_S,
                       prefill=dict(queue_per_worker=queue / sm.prefill),
                       decode=dict(running_per_worker=10.0, kv_usage=0.2), observed_itl_p90_s=0.012,
                       observed_itl_mean_s=0.011)
        return d.decode_replicas

    without, with_queue = final(0.0), final(1200.0)
    need = sla.decode_replicas(20.0 + 1200.0 / planner_cfg().backlog_drain_s, ISL, OSL, PROF.decode,
                               itl_target_s=planner_cfg().itl_target_s)
    assert with_queue > without
    assert with_queue >= need


def test_prefill_floor_counts_the_workers_a_raise_is_still_starting():
    # a quiet fleet meets a step to 100 req/s (20 Erlangs at 0.2 s a prompt): the sizing launches a pool for
    # it at the first tick; while those workers start the queue keeps growing for QUEUE_PRESSURE_TICKS ticks.
    # The floor asks for the workers that serve the load and clear the queue within a tick, counting the
    # ready ones, not that on top of a pool still starting
    sm = PlannerStateMachine(planner_cfg(max_prefill=200, gpu_budget=400, scale_down_delay_s=300.0), PROF)
    now = steady(sm, 4, 10.0)
    ready = sm.prefill
    rate, queue = 100.0, 0.0
    s = sla.prefill_service_s(PROF.prefill, ISL, 1.0)[0]
    for _ in range(QUEUE_PRESSURE_TICKS):
        now += INTERVAL_S
        queue += (rate - ready / s) * INTERVAL_S  # what the ready workers do not serve
        sm.on_tick(TickInput(
            now_s=now, interval_s=INTERVAL_S, num_requests=int(rate * INTERVAL_S), mean_isl_tokens=ISL,
            mean_osl_tokens=OSL, prefill=PoolObservation(num_ready=ready, num_starting=max(sm.prefill - ready, 0),
                                                         queue_per_worker=queue / ready),
            decode=PoolObservation(num_ready=sm.decode, running_per_worker=10.0, kv_usage=0.2)))
    assert sm.prefill > ready  # the sizing did launch for the step
    need = math.ceil(rate * s * sm.ttft_correction + queue * s * sm.ttft_correction / INTERVAL_S)
    assert 0 < sm.queue_floor() <= need


def test_decode_floor_adds_one_worker_for_a_backlog_the_ready_pool_admits_in_seconds():
    # 4 decode workers with full batches of 64 sequences at 20 ms a step and OSL 200 free a slot 64 times a
    # second (Little's law: 256 running / 4 s each); 400 requests waiting for admission wait ~6 s, over the
    # TTFT budget, so the floor rises, but the ready pool admits them long before a new worker is ready:
    # one worker, not the 5 whose KV would hold all 400 at once
    sm = PlannerStateMachine(planner_cfg(), PROF, initial_prefill=4, initial_decode=4)
    now = steady(sm, 2, 10.0)
    ready = 4
    for _ in range(QUEUE_PRESSURE_TICKS):
        now += INTERVAL_S
        sm.on_tick(TickInput(
            now_s=now, interval_s=INTERVAL_S, num_requests=300, mean_isl_tokens=1000.0, mean_osl_tokens=OSL,
            prefill=PoolObservation(num_ready=sm.prefill),
            decode=PoolObservation(num_ready=ready, queue_per_worker=100.0, running_per_worker=64.0, kv_usage=0.95),
            observed_itl_p90_s=0.022, observed_itl_mean_s=0.02))
    assert sm.decode_floor() == ready + 1
