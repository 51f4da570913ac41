"""Fleet simulator (runtime/sim/fleet.py) and its oracles (runtime/sim/oracles.py) with hand-checkable
engines: prefill 0.1 ms/token, decode step 10 ms + 0.1 ms per running sequence per worker, KV 100k tokens
per worker."""

from collections import deque

import numpy as np
import pytest

from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig, ScalingDecision
from tests.planner_builders import PROF_TP as PROF
from runtime.sim.fleet import FleetConfig, FleetSim, Trace, simulate, static_controller
from runtime.sim.oracles import oracle_gpu_seconds, sequential_oracle


def trace(arrivals, isl=1000, osl=11) -> Trace:
    n = len(arrivals)
    return Trace(np.asarray(arrivals, float), np.full(n, isl), np.full(n, osl))


def fleet(**kw) -> FleetConfig:
    return FleetConfig(**{"prefill_tp": 2, "decode_tp": 4, "interval_s": 10.0, "worker_start_s": 20.0, **kw})


def test_one_request_ttft_and_itl_by_hand():
    res = simulate(trace([0.0]), PROF, fleet(), static_controller(1, 1))
    # prefill 1000 x 0.1 ms = 0.1 s, admitted to decode at 0.1 s, one step at batch 1 = 10.1 ms
    assert res.ttft_s[0] == pytest.approx(0.1 + 0.0101)
    assert res.itl_s[0] == pytest.approx(0.0101)
    assert res.slo_attainment(0.2, 0.02) == 1.0 and res.slo_attainment(0.1, 0.02) == 0.0


def test_prefill_queue_is_fifo_over_workers():
    one = simulate(trace([0.0, 0.0, 0.0]), PROF, fleet(), static_controller(1, 1))
    two = simulate(trace([0.0, 0.0, 0.0]), PROF, fleet(initial_prefill=2), static_controller(2, 1))
    # one worker: prefills end at 0.1, 0.2, 0.3 s; two workers: 0.1, 0.1, 0.2 s
    assert sorted(np.round(one.ttft_s - one.itl_s, 4)) == pytest.approx([0.1, 0.2, 0.3], abs=0.002)
    assert sorted(np.round(two.ttft_s - two.itl_s, 4)) == pytest.approx([0.1, 0.1, 0.2], abs=0.002)


def test_gpu_seconds_of_a_static_fleet_by_hand():
    res = simulate(trace(np.linspace(0, 90, 10)), PROF, fleet(initial_prefill=2), static_controller(2, 1))
    assert res.gpu_seconds == pytest.approx((2 * 2 + 1 * 4) * 90.0)  # counted over [0, last arrival]
    assert res.gpu_hours == pytest.approx(720 / 3600)


def test_new_workers_serve_only_after_the_start_time_and_cost_from_launch():
    calls = []

    def grow(tick):
        calls.append(tick)
        return ScalingDecision(tick.now_s, prefill_replicas=3, decode_replicas=1)

    res = simulate(trace(np.linspace(0, 100, 200)), PROF, fleet(), grow)
    # ticks at 10, 20, 30 s: two prefill workers launch at 10 s and are ready at 30 s
    assert calls[0].prefill.num_ready == 1
    assert calls[1].prefill.num_ready == 1 and calls[1].prefill.num_starting == 2
    assert calls[2].prefill.num_ready == 3
    assert res.gpu_seconds == pytest.approx(2 * 100 + 2 * 2 * 90 + 4 * 100)


def test_decode_queue_is_reported_as_the_gauge_reads_at_the_tick_end():
    # one decode worker holds ~33 sequences of 3000 tokens in its 100k of KV; 20 req/s queue for admission.
    # Nine more decode workers launched at the first tick are ready mid-way through the third (start 25 s).
    # The queue the planner reads (per ready worker x ready workers, as the runtime reads vLLM's
    # num_requests_waiting gauges) is the requests waiting at the tick's end: never more than have arrived
    seen = []

    def grow(tick):
        seen.append(tick)
        return ScalingDecision(tick.now_s, prefill_replicas=4, decode_replicas=10)

    arrivals = np.linspace(0, 60, 1200)
    simulate(trace(arrivals, isl=2000, osl=2000), PROF, fleet(initial_prefill=4, worker_start_s=25.0), grow)
    assert any(t.decode.queue_per_worker > 0 for t in seen)  # the pool was short at first
    for t in seen:
        waiting = t.decode.queue_per_worker * max(t.decode.num_ready, 1)
        assert waiting <= np.sum(arrivals <= t.now_s) + 1e-9, (t.now_s, waiting, t.decode.num_ready)


def test_aggregated_decode_workers_prefill_when_no_prefill_worker_exists():
    res = simulate(trace([0.0, 5.0]), PROF, fleet(initial_prefill=0), static_controller(0, 1))
    assert np.all(np.isfinite(res.ttft_s))
    assert res.ttft_s[0] == pytest.approx(0.1 + 0.0101 / (1 - 0.01), rel=0.05)  # prefill on the decode worker
    assert res.gpu_seconds == pytest.approx(4 * 5.0)


def test_sla_planner_on_the_simulator_learns_slow_engines():
    rng = np.random.default_rng(1)
    arr = np.sort(rng.uniform(0, 600, 6000))  # 10 req/s for 10 minutes
    tr = trace(arr, isl=1000, osl=50)
    cfg = PlannerConfig(prefill_tp=2, decode_tp=4, interval_s=10.0, worker_start_s=20.0, scale_down_delay_s=60.0,
                        cooldown_s=30.0, predictor="moving_average", allow_aggregated=False, max_prefill=16, max_decode=8)
    fast = PlannerStateMachine(cfg, PROF, initial_prefill=2, initial_decode=1)
    res_fast = simulate(tr, PROF, fleet(initial_prefill=2), fast.on_tick)
    slow = PlannerStateMachine(cfg, PROF, initial_prefill=2, initial_decode=1)
    res_slow = simulate(tr, PROF, fleet(initial_prefill=2, slowdown=3.0), slow.on_tick)
    assert res_fast.slo_attainment(2.0, 0.05) >= 0.99
    assert slow.itl_correction > 1.5  # engines 3x slower than the profile: ITL 3x the model
    assert res_slow.gpu_seconds > res_fast.gpu_seconds


def test_oracle_is_the_smallest_fleet_per_window():
    rng = np.random.default_rng(2)
    tr = trace(np.sort(rng.uniform(0, 60, 1500)), isl=1000, osl=20)  # 25 req/s = 2.5 Erlangs of prefill
    cfg = fleet(interval_s=60.0)
    total, plan = oracle_gpu_seconds(tr, PROF, cfg, ttft_target_s=0.5, itl_target_s=0.05, interval_s=60.0)
    (p, d), = plan
    assert p >= 3  # below 2.5 Erlangs plus queueing no fleet can meet a 0.5 s TTFT
    assert total == pytest.approx((p * 2 + d * 4) * float(tr.arrival_s[-1]))
    worse = simulate(tr, PROF, fleet(interval_s=60.0, initial_prefill=p - 1, initial_decode=d),
                     static_controller(p - 1, d))
    assert worse.slo_attainment(0.5, 0.05) < 0.99


def test_sequential_oracle_sizes_a_window_for_the_sequences_the_last_one_left():
    # 300 requests in [50, 60) s still decode at 60 s (400 tokens at ~40 ms) when 300 more arrive:
    # sized from empty, each window needs one decode worker; together they need two for ITL <= 50 ms
    rng = np.random.default_rng(0)
    tr = trace(np.sort(np.concatenate([rng.uniform(50, 60, 300), rng.uniform(60, 70, 300)])), isl=100, osl=400)
    cfg = fleet(interval_s=60.0)
    lower_s, lower_plan = oracle_gpu_seconds(tr, PROF, cfg, ttft_target_s=0.5, itl_target_s=0.05, interval_s=60.0)
    res, plan = sequential_oracle(tr, PROF, cfg, ttft_target_s=0.5, itl_target_s=0.05, interval_s=60.0)
    assert lower_plan == [(1, 1), (1, 1)] and plan == [(1, 1), (1, 2)]
    replay = simulate(tr, PROF, fleet(interval_s=60.0, worker_start_s=0.0),
                      lambda t: ScalingDecision(now_s=t.now_s, prefill_replicas=1, decode_replicas=1))
    assert replay.slo_attainment(0.5, 0.05) < 0.9  # the lower bound's plan misses when replayed
    assert res.slo_attainment(0.5, 0.05) >= 0.99  # the sequential plan's own replay meets the SLO
    # one more decode worker (TP 4) from 60 s to the last arrival
    assert res.gpu_seconds == pytest.approx(lower_s + 4 * (float(tr.arrival_s[-1]) - 60.0))


def test_sequential_oracle_does_not_buy_a_fleet_for_a_request_that_already_missed():
    # one request's prefill alone (20000 tokens x 0.1 ms = 2 s) exceeds the 0.5 s TTFT target and it
    # decodes 3000 tokens into the next windows: no fleet can save it, so it must not size them
    rng = np.random.default_rng(0)
    arr = np.sort(np.concatenate([rng.uniform(0, 58, 300), [58.0], rng.uniform(60, 120, 20), [150.0]]))
    isl, osl = np.full(len(arr), 100), np.full(len(arr), 20)
    k = int(np.flatnonzero(arr == 58.0)[0])
    isl[k], osl[k] = 20_000, 3000
    res, plan = sequential_oracle(Trace(arr, isl, osl), PROF, fleet(interval_s=60.0), ttft_target_s=0.5,
                                  itl_target_s=0.05, interval_s=60.0)
    assert plan == [(1, 1), (1, 1), (1, 1)]
    assert np.isnan(res.ttft_s).sum() == 0 and res.ttft_s[k] > 0.5


def test_sequential_oracle_timeline_holds_each_window_plan_from_its_start():
    rng = np.random.default_rng(0)
    tr = trace(np.sort(np.concatenate([rng.uniform(50, 60, 300), rng.uniform(60, 70, 300)])), isl=100, osl=400)
    res, plan = sequential_oracle(tr, PROF, fleet(interval_s=60.0), ttft_target_s=0.5, itl_target_s=0.05,
                                  interval_s=60.0)
    at = {e["t_s"]: (e["prefill"], e["decode"]) for e in res.timeline}
    assert plan == [(1, 1), (1, 2)] and at[60.0] == (1, 2)


def test_a_clone_shares_only_the_read_only_inputs():
    sim = FleetSim(trace(np.linspace(0, 30, 50)), PROF, fleet())
    sim.step(static_controller(1, 1))
    c = sim.clone()
    shared = {k for k, v in vars(sim).items() if isinstance(v, (list, dict, set, np.ndarray, deque))
              and vars(c)[k] is v}
    assert shared <= {"busy_p", "lat_p", "busy_a", "lat_a"}  # per-request prefill times: computed once, never written


def test_a_cloned_simulation_runs_on_without_touching_the_original():
    rng = np.random.default_rng(3)
    tr = trace(np.sort(rng.uniform(0, 40, 400)), isl=500, osl=50)
    ctl = static_controller(2, 1)
    fresh = simulate(tr, PROF, fleet(initial_prefill=2), ctl)
    sim = FleetSim(tr, PROF, fleet(initial_prefill=2))
    for _ in range(2):
        sim.step(ctl)
    what_if = sim.clone()
    limit = what_if.arrival_limit = sim.next_arrival + 50
    what_if._apply(sim.t_s, ScalingDecision(now_s=sim.t_s, prefill_replicas=0, decode_replicas=3))
    while what_if.step(static_controller(0, 3)):
        pass
    assert np.isnan(what_if.first_s[limit:]).all() and not np.isnan(what_if.first_s[:limit]).any()
    res = sim.run(ctl)
    np.testing.assert_array_equal(res.ttft_s, fresh.ttft_s)
    np.testing.assert_array_equal(res.itl_s, fresh.itl_s)
    assert res.gpu_seconds == fresh.gpu_seconds


def test_bad_trace_is_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="sorted"):
        Trace(np.array([1.0, 0.0]), np.array([1, 1]), np.array([1, 1]))
    with pytest.raises(ValueError, match="isl_tokens and osl_tokens must be >= 1"):
        Trace(np.array([0.0]), np.array([0]), np.array([1]))


@pytest.mark.parametrize("kw,field", [
    ({"interval_s": 0.0}, "interval_s"), ({"interval_s": float("inf")}, "interval_s"),
    ({"decode_dt_s": 0.0}, "decode_dt_s"), ({"initial_prefill": -3}, "initial_prefill"),
    ({"prefill_tp": 0}, "prefill_tp"), ({"slowdown": 0.0}, "slowdown"), ({"kv_watermark": 0.0}, "kv_watermark"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"worker_start_s": float("nan")}, "worker_start_s"),
    ({"interval_s": 1e9}, "decode steps per tick"),
])
def test_fleet_config_refuses_bad_values_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        fleet(**kw)


@pytest.mark.parametrize("arr,isl,prio,match", [
    ([0.0, float("nan")], [10, 10], None, "arrival_s"),
    ([-100.0, 0.0], [10, 10], None, ">= 0"),
    ([0.0, 1.0], [10, float("nan")], None, "isl_tokens"),
    ([0.0, 1.0], [10, 10], [1], "priority"),
])
def test_trace_refuses_bad_values(arr, isl, prio, match):
    with pytest.raises(ValueError, match=match):
        Trace(np.asarray(arr), np.asarray(isl, float), np.full(len(arr), 5),
              None if prio is None else np.asarray(prio))


def test_a_prompt_no_worker_can_hold_is_refused_not_a_queue_block():
    # KV 100k tokens per worker: a 200k-token prompt can never be admitted; the 49 after it are served
    isl = np.full(50, 1000)
    isl[0] = 200_000
    tr = Trace(np.linspace(0.0, 5.0, 50), isl, np.full(50, 11))
    res = simulate(tr, PROF, fleet(worker_start_s=0.0, initial_prefill=4), static_controller(4, 1))
    assert np.isnan(res.ttft_s[0])
    assert np.all(np.isfinite(res.ttft_s[1:]))
    eight = simulate(tr, PROF, fleet(worker_start_s=0.0, initial_prefill=4, initial_decode=8), static_controller(4, 8))
    assert np.isnan(eight.ttft_s[0])  # pooled capacity does not help one sequence


def test_oracles_give_a_plan_when_every_request_arrives_at_once():
    tr = trace([0.0] * 5)
    total, plan = oracle_gpu_seconds(tr, PROF, fleet(), ttft_target_s=2.0, itl_target_s=0.05)
    assert len(plan) == 1 and plan[0][0] >= 1 and total == 0.0  # cost over [0, last arrival] = 0 s
    res, seq_plan = sequential_oracle(tr, PROF, fleet(), ttft_target_s=2.0, itl_target_s=0.05)
    assert len(seq_plan) == 1 and np.all(np.isfinite(res.ttft_s))


def test_kv_usage_reported_to_the_planner_is_a_share_of_the_pool_at_most_one():
    # admitted on their prompts (90 x 1,000 tokens of a 100k-token worker), the contexts grow to 90 x 3,000:
    # vLLM would preempt; its kv_cache_usage_perc gauge never reads above 1, nor may the simulator's
    seen = []

    def keep(tick):
        seen.append(tick.decode.kv_usage)
        return ScalingDecision(tick.now_s, prefill_replicas=1, decode_replicas=1)

    simulate(trace(np.linspace(0.0, 5.0, 90), isl=1000, osl=2000), PROF, fleet(), keep)
    assert max(seen) == pytest.approx(1.0, abs=0.05) and all(0.0 <= k <= 1.0 for k in seen)


def test_ticks_report_the_output_lengths_of_the_requests_that_ended_in_them():
    # a runtime learns a request's output length when it ends: the simulator reports what it would see
    seen = []

    def keep(tick):
        seen.append((tick.num_requests, tick.mean_osl_tokens))
        return ScalingDecision(tick.now_s, prefill_replicas=1, decode_replicas=1)

    tr = Trace(np.array([0.0, 1.0, 12.0]), np.array([1000, 1000, 1000]), np.array([11, 3000, 21]))
    simulate(tr, PROF, fleet(), keep)
    # ticks of 10 s: [0, 10) the 11-token request ends (the 3,000-token one decodes for ~30 s), [10, 20) the
    # 21-token one; the long one ends later, in a tick with no arrival
    assert seen[0] == (2, 11.0) and seen[1] == (1, 21.0)
    assert any(n == 0 and osl == 3000.0 for n, osl in seen[2:])


def test_decode_gauges_are_read_at_the_ticks_end_as_the_runtime_scrapes_them():
    seen = []

    def keep(tick):
        seen.append(tick.decode)
        return ScalingDecision(tick.now_s, prefill_replicas=1, decode_replicas=1)

    # one request done within its first second, one decoding across the whole first tick's end
    simulate(Trace(np.array([0.0, 5.0]), np.array([1000, 4000]), np.array([11, 3000])), PROF, fleet(), keep)
    first = seen[0]
    assert first.running_per_worker == 1.0  # the long one, running at 10 s (a mean over the tick reads less)
    decoded = (10.0 - 5.4) / 0.0101  # prefilled by 5.4 s (4,000 x 0.1 ms), then 10.1 ms a step at batch 1
    assert first.kv_usage == pytest.approx((4000 + decoded) / 100_000, rel=0.05)
