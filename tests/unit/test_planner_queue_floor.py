"""Rule 12 of the SLA planner: the observed prefill queue raises a floor under the prefill pool.

Property: whatever the configuration and the load before, while the queue wait stays above the TTFT
budget the prefill target never falls and rises, within max_prefill and the GPU budget, until no
further prefill worker fits; once the queue is gone the floor falls back to 0.
"""

import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.planner.state_machine import QUEUE_PRESSURE_TICKS, PlannerStateMachine
from runtime.planner.types import PlannerConfig
from tests.planner_builders import PROF_TP as PROF
from tests.planner_builders import fleet_tick

INTERVAL_S = 30.0

configs = st.builds(
    dict,
    min_prefill=st.integers(1, 3),
    max_prefill=st.integers(3, 16),
    min_decode=st.integers(1, 2),
    max_decode=st.integers(2, 8),
    gpu_budget=st.integers(14, 80),
    cooldown_s=st.sampled_from([0.0, 30.0, 60.0, 150.0]),
    scale_down_delay_s=st.sampled_from([0.0, 60.0, 180.0]),
    predictor=st.sampled_from(["constant", "moving_average", "burst_quantile"]),
    prefill_staffing_beta=st.sampled_from([None, 0.0, 1.65]),
    allow_aggregated=st.just(False),  # the floor sizes the disaggregated prefill pool
)
warmup = st.lists(st.tuples(st.floats(0, 40), st.floats(0, 3)), min_size=0, max_size=12)


def make(c: dict) -> PlannerStateMachine:
    cfg = PlannerConfig(prefill_tp=2, decode_tp=4, interval_s=INTERVAL_S, worker_start_s=60.0, **c)
    return PlannerStateMachine(cfg, PROF)


def tick(sm: PlannerStateMachine, now: float, rate: float, queue_per_worker: float) -> None:
    """One tick whose fleet is what the planner asked for, all of it ready (the actuator is done)."""
    fleet_tick(sm, now, rate, isl=2000.0, osl=100.0, interval_s=INTERVAL_S,
               prefill={"queue_per_worker": queue_per_worker})


def room(sm: PlannerStateMachine) -> int:
    """Prefill workers the planner could still add: max_prefill and the budget left by decode."""
    cfg = sm.cfg
    return min(cfg.max_prefill - sm.prefill, (cfg.gpu_budget - sm.decode * cfg.decode_tp) // cfg.prefill_tp - sm.prefill)


@settings(max_examples=30, deadline=None)
# a decode pool holding a busy window's KV (rule 13) while the budget is full: prefill keeps its workers
@example(c=dict(min_prefill=1, max_prefill=4, min_decode=1, max_decode=2, gpu_budget=14, cooldown_s=0.0,
                scale_down_delay_s=60.0, predictor="burst_quantile", prefill_staffing_beta=None,
                allow_aggregated=False), series=[(13.0, 0.0), (38.0, 0.0)], rate=1.0, queue=20.0)
# the prefill queue is decode load too: decode asks for its second TP-4 worker, the budget trim takes both
# pools down, and the GPUs it freed beyond the excess go back to prefill
@example(c=dict(min_prefill=1, max_prefill=7, min_decode=1, max_decode=2, gpu_budget=18, cooldown_s=0.0,
                scale_down_delay_s=0.0, predictor="constant", prefill_staffing_beta=None, allow_aggregated=False),
         series=[], rate=2.0, queue=333.0)
# decode releases its second worker at the loop's last tick: prefill takes the GPUs one tick later
@example(c=dict(min_prefill=1, max_prefill=6, min_decode=1, max_decode=2, gpu_budget=14, cooldown_s=60.0,
                scale_down_delay_s=0.0, predictor="burst_quantile", prefill_staffing_beta=None,
                allow_aggregated=False), series=[(29.0, 0.0), (30.0, 0.0)], rate=1.0, queue=20.0)
@given(configs, warmup, st.floats(0.1, 2.0), st.floats(20.0, 500.0))
def test_sustained_queue_raises_prefill_until_the_budget_and_the_floor_falls_after(c, series, rate, queue):
    sm = make(c)
    cfg = sm.cfg
    now = 0.0
    for r, q_share in series:  # any history before: the queue of up to a few requests per worker
        now += INTERVAL_S
        tick(sm, now, r, q_share)
    # a queue of `queue` requests per worker, far above the wait budget (2 s TTFT; 0.2 s per prefill: >= 4 s),
    # at a request rate the model sizes one or two workers for: only the queue can ask for more
    lifted = None
    ticks_per_rise = QUEUE_PRESSURE_TICKS + math.ceil(cfg.cooldown_s / INTERVAL_S) + 1
    for i in range(ticks_per_rise + cfg.max_prefill + 2):
        before = sm.prefill
        now += INTERVAL_S
        tick(sm, now, rate, queue)
        assert sm.prefill * cfg.prefill_tp + sm.decode * cfg.decode_tp <= cfg.gpu_budget
        assert sm.prefill <= cfg.max_prefill
        if lifted is None and sm.queue_floor() > 0:
            lifted = i
        if lifted is not None:
            assert sm.prefill >= before, "the prefill pool fell while its queue wait stayed above the budget"
    # the floor lifts within k ticks (and a cooldown), unless the model alone already filled the room
    assert (lifted is not None and lifted < QUEUE_PRESSURE_TICKS + math.ceil(cfg.cooldown_s / INTERVAL_S)) or (
        room(sm) == 0 and sm.queue_floor() == 0)
    # a decode worker released at the last tick (its window pool expired) leaves room the floor takes within
    # a rise; the pool never falls meanwhile
    for _ in range(ticks_per_rise):
        if room(sm) == 0:
            break
        before = sm.prefill
        now += INTERVAL_S
        tick(sm, now, rate, queue)
        assert sm.prefill >= before
    assert room(sm) == 0, f"sustained queue left room for {room(sm)} more prefill workers"
    for _ in range(cfg.max_prefill + 1):  # the queue is gone: the floor steps down to 0
        now += INTERVAL_S
        tick(sm, now, rate, 0.0)
    assert sm.queue_floor() == 0


def test_one_tick_over_budget_is_a_burst_not_a_trend():
    sm = make(dict(max_prefill=8, gpu_budget=64, prefill_staffing_beta=None, allow_aggregated=False))
    for i in range(4):
        tick(sm, 30.0 * (i + 1), 0.5, 0.0)
    p = sm.prefill
    tick(sm, 150.0, 0.5, 200.0)  # one deep queue at a tick's end
    tick(sm, 180.0, 0.5, 0.0)
    assert sm.queue_floor() == 0  # (the open-loop backlog term may still add a worker for it)


def test_the_floor_is_what_reaches_the_budget_open_loop_stays_below():
    # the open loop sees the queue only as extra rate (drained within backlog_drain_s): a steady error
    pools = {}
    for on in (True, False):
        sm = make(dict(max_prefill=16, gpu_budget=64, prefill_staffing_beta=None, allow_aggregated=False,
                       queue_floor=on))
        for i in range(20):
            tick(sm, 30.0 * (i + 1), 0.5, 20.0)
        pools[on] = (sm.prefill, sm.queue_floor())
    assert pools[True][0] == 16 and pools[False][1] == 0 and pools[False][0] < 16


def ttft_tick(sm: PlannerStateMachine, now: float, *, prefill_queue: float, ttft_p90: float, decode_queue: float) -> None:
    """A tick with a short prefill queue (its own wait under the budget) and a TTFT p90 far over the target."""
    fleet_tick(sm, now, 0.5, isl=2000.0, osl=100.0, interval_s=INTERVAL_S,  # 15 requests
               prefill={"queue_per_worker": prefill_queue},
               decode={"queue_per_worker": decode_queue, "running_per_worker": 8.0}, observed_ttft_p90_s=ttft_p90)


def test_a_ttft_spent_waiting_for_decode_admission_does_not_raise_prefill():
    # the same TTFT p90 (8 s, target 2 s) behind the same short prefill queue: while requests also wait for
    # decode admission the excess is decode's (rule 13 sizes that pool), so the prefill floor stays down;
    # with no decode queue the excess is prefill's and the floor rises
    floors = {}
    for decode_queue in (0.0, 5.0):
        sm = make(dict(max_prefill=16, gpu_budget=64, prefill_staffing_beta=None, allow_aggregated=False))
        for i in range(QUEUE_PRESSURE_TICKS + 2):
            ttft_tick(sm, 30.0 * (i + 1), prefill_queue=0.5, ttft_p90=8.0, decode_queue=decode_queue)
        floors[decode_queue] = sm.queue_floor()
    assert floors[0.0] > 0 and floors[5.0] == 0


def test_a_queue_over_budget_launches_the_staffing_count_at_once():
    # rule 8 launches for the smoothed level, so a step in load reaches the full staffing count over several
    # ticks; a queue already waiting over the budget at the step's first tick is no transient: the count the
    # tick's load asks for is launched at once
    def first_tick_of_step(queue: float) -> tuple[int, int]:
        sm = make(dict(max_prefill=64, gpu_budget=400, max_decode=8, prefill_staffing_beta=1.0, measure_burst=False))
        for i in range(10):
            tick(sm, 30.0 * (i + 1), 2.0, 0.0)
        tick(sm, 330.0, 40.0, queue)
        return sm.prefill, sm.staffing_prefill_replicas()
    calm, queued = first_tick_of_step(0.0), first_tick_of_step(50.0)
    assert calm[0] < calm[1]  # the launch cap holds the step back
    assert queued[0] >= queued[1] and queued[0] > calm[0]
