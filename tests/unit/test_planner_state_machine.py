"""The planner state machine: TickInput in, ScalingDecision out, time only from the input.

Profile (hand-checkable): prefill 0.1 ms/token, decode step 10 ms + 0.1 ms per sequence, KV 100k
tokens per worker. Requests: ISL 1000, OSL 200. One prefill worker serves ~9 req/s (0.9 of 10)."""

import dataclasses

import pytest

from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, PoolSpec
from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import SPEC_SETTINGS, PlannerConfig, PoolObservation, TickInput
from tests.planner_builders import PROF, planner_cfg
from tests.planner_builders import tick as planner_tick


def cfg(**kw) -> PlannerConfig:  # noqa: ANN003
    return planner_cfg(**(dict(max_prefill=20, scale_down_delay_s=120.0, cooldown_s=60.0,
                               decode_scale_down_delay_s=None,
                               # M/M/c sizing alone; square-root staffing: test_planner_staffing.py
                               prefill_staffing_beta=None,
                               # the hand arithmetic below caps a prefill worker at 90 % busy
                               target_utilization=0.9) | kw))


def tick(now_s: float, rate: float, **kw) -> TickInput:  # noqa: ANN003
    return planner_tick(now_s, rate, **(dict(ready_p=1, ready_d=1) | kw))


def test_sla_sizes_pools_from_the_rate():
    sm = PlannerStateMachine(cfg(), PROF)
    d = sm.on_tick(tick(30, 30.0))
    # 30 req/s x 0.1 s = 3 Erlangs -> ceil(3 / 0.9) = 4 prefill; 6000 tok/s / 4475 -> 2 decode
    assert (d.prefill_replicas, d.decode_replicas) == (4, 2)
    assert d.serving_mode == "disaggregated" and d.predicted_rate_per_s == pytest.approx(30.0)
    assert d.num_gpus(1, 1) == 6


def test_scale_up_at_once_scale_down_only_after_the_delay():
    sm = PlannerStateMachine(cfg(burst_headroom=0.25), PROF)
    assert sm.on_tick(tick(30, 30.0)).prefill_replicas == 4
    high = [sm.on_tick(tick(t, 30.0)).prefill_replicas for t in (60, 90, 120, 150)]
    assert high == [4, 4, 4, 4]
    low = [sm.on_tick(tick(t, 5.0)).prefill_replicas for t in (180, 210, 240, 270, 300, 330)]
    # the 120 s window still holds a 4 until t=270+: the drop happens only after the delay
    assert low[:3] == [4, 4, 4] and low[-1] == 1
    back = sm.on_tick(tick(360, 30.0))  # back up at once (cooldown 60 s passed); 6x the prediction is a burst:
    assert back.burst and back.prefill_replicas == 5  # 30 x 1.25 = 37.5 req/s -> ceil(3.75 / 0.9) = 5


def test_lead_time_predicts_ahead_with_a_trend_predictor():
    sm = PlannerStateMachine(cfg(predictor="burst_quantile", predictor_window_ticks=3, burst_quantile=0.5, burst_factor=10), PROF)
    assert sm.lead_ticks == 3  # this tick + 60 s / 30 s
    for t, r in ((30, 9.0), (60, 18.0)):
        sm.on_tick(tick(t, r))
    d = sm.on_tick(tick(90, 27.0))
    # +9 req/s per tick: mean of the last two (22.5) + 3 ticks x 9 = 49.5 req/s planned
    # -> 4.95 Erlangs / 0.9 = 5.5 -> 6 prefill workers, where the observed 27 req/s alone needs 3
    assert d.predicted_rate_per_s == pytest.approx(49.5)
    assert d.prefill_replicas == 6


def test_min_max_and_budget_bound_the_decision():
    sm = PlannerStateMachine(cfg(max_prefill=3, max_decode=20, gpu_budget=8, prefill_tp=2, decode_tp=2), PROF)
    d = sm.on_tick(tick(30, 300.0))
    assert d.prefill_replicas <= 3
    assert d.num_gpus(2, 2) <= 8 and d.decode_replicas >= 1
    with pytest.raises(ValueError, match="gpu_budget"):
        cfg(min_prefill=4, prefill_tp=8, gpu_budget=16)


def test_reserved_priority_share_caps_normal_traffic_but_not_priority():
    sm = PlannerStateMachine(cfg(gpu_budget=10, reserved_priority_share=0.4), PROF)
    d = sm.on_tick(tick(30, 300.0))
    assert d.num_gpus(1, 1) == 6  # 10 GPUs minus 4 reserved for priority traffic
    sm2 = PlannerStateMachine(cfg(gpu_budget=10, reserved_priority_share=0.4), PROF)
    d2 = sm2.on_tick(tick(30, 300.0, prio=30.0))
    assert d2.num_gpus(1, 1) == 10  # priority traffic needs the whole reserve (4 + 2 GPUs for 30 req/s)


def test_burst_mode_adds_headroom_within_the_budget():
    c = cfg(burst_factor=1.5, burst_headroom=0.5, gpu_budget=14, reserved_priority_share=0.3)
    sm = PlannerStateMachine(c, PROF)
    for t in (30, 60, 90):
        assert not sm.on_tick(tick(t, 20.0)).burst
    d = sm.on_tick(tick(120, 50.0))  # 2.5x the prediction
    assert d.burst and "burst" in d.reason
    # 50 x 1.5 = 75 req/s: ceil(7.5 / 0.9) = 9 prefill + ceil(15000 / 4475) = 4 decode = 13 GPUs:
    # above the 14 - 4 reserved = 10 GPUs normal traffic may use, within the whole budget
    assert d.num_gpus(1, 1) == 13
    assert not sm.on_tick(tick(150, 10.0)).burst  # back under the prediction: burst over


def test_aggregated_at_low_load_after_a_full_window_and_back_at_once():
    sm = PlannerStateMachine(cfg(allow_aggregated=True, scale_down_delay_s=60.0), PROF)
    modes = [sm.on_tick(tick(t, 0.5)).serving_mode for t in (30, 60, 90, 120)]
    assert modes[0] == "disaggregated" and modes[-1] == "aggregated"
    d = sm.on_tick(tick(150, 0.5))
    assert d.prefill_replicas == 0 and d.decode_replicas == 1
    d = sm.on_tick(tick(180, 30.0, ready_p=0))
    assert d.serving_mode == "disaggregated" and d.prefill_replicas >= 4


def test_aggregated_keeps_prefill_until_decode_workers_are_ready():
    sm = PlannerStateMachine(cfg(allow_aggregated=True, scale_down_delay_s=0.0, min_decode=1), PROF,
                             initial_prefill=1, initial_decode=1)
    d = sm.on_tick(tick(30, 0.5, ready_d=0))
    assert d.serving_mode == "aggregated" and d.prefill_replicas == 1  # no ready decode worker yet
    assert sm.on_tick(tick(60, 0.5, ready_d=1)).prefill_replicas == 0


def test_correction_factor_follows_slow_engines():
    sm = PlannerStateMachine(cfg(), PROF, initial_prefill=4, initial_decode=2)
    base = sm.size_for_load(30.0, 1000, 200).prefill
    for t in range(30, 330, 30):  # TTFT 1.5 s where the model expects ~0.2 s; ITL 40 ms vs 20 ms at batch 100
        sm.on_tick(tick(t, 30.0, ready_p=4, ready_d=2, running_d=100, observed_ttft_p90_s=1.5, observed_itl_p90_s=0.04))
    assert sm.ttft_correction == pytest.approx(2.0, rel=0.05)  # clamped at 2
    assert sm.itl_correction == pytest.approx(2.0, rel=0.05)  # 40 ms / 20 ms
    assert sm.size_for_load(30.0, 1000, 200).prefill > base


def test_load_mode_steps_by_one():
    sm = PlannerStateMachine(cfg(mode="load", scale_down_delay_s=0.0, cooldown_s=0.0), None,
                             initial_prefill=3, initial_decode=3)
    up = TickInput(now_s=30, interval_s=30, num_requests=100, mean_isl_tokens=1000, mean_osl_tokens=200,
                   prefill=PoolObservation(num_ready=3, queue_per_worker=5.0), decode=PoolObservation(num_ready=3, kv_usage=0.95))
    d = sm.on_tick(up)
    assert (d.prefill_replicas, d.decode_replicas) == (4, 4)
    down = TickInput(now_s=60, interval_s=30, num_requests=10, mean_isl_tokens=1000, mean_osl_tokens=200,
                     prefill=PoolObservation(num_ready=4, queue_per_worker=0.0), decode=PoolObservation(num_ready=4, kv_usage=0.1),
                     observed_ttft_p90_s=0.2, observed_itl_p90_s=0.01)
    d = sm.on_tick(down)
    assert (d.prefill_replicas, d.decode_replicas) == (3, 3)
    slow = TickInput(now_s=90, interval_s=30, num_requests=10, mean_isl_tokens=1000, mean_osl_tokens=200,
                     prefill=PoolObservation(num_ready=3), decode=PoolObservation(num_ready=3, kv_usage=0.5),
                     observed_ttft_p90_s=1.9, observed_itl_p90_s=0.049)
    assert (sm.on_tick(slow).prefill_replicas, sm.decode) == (4, 4)  # latency near SLO -> +1 each


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="interval_s"):
        TickInput(now_s=0, interval_s=0, num_requests=1, mean_isl_tokens=1, mean_osl_tokens=1)
    with pytest.raises(ValueError, match="num_priority_requests"):
        TickInput(now_s=0, interval_s=1, num_requests=1, mean_isl_tokens=1, mean_osl_tokens=1, num_priority_requests=2)
    with pytest.raises(ValueError, match="ServiceProfile"):
        PlannerStateMachine(cfg(), None)
    sm = PlannerStateMachine(cfg(), PROF)
    sm.on_tick(tick(60, 1.0))
    with pytest.raises(ValueError, match="backwards"):
        sm.on_tick(tick(30, 1.0))
    with pytest.raises(ValueError, match="load_kv_down"):
        PlannerSpec(load_kv_down=0.9, load_kv_up=0.8)


def test_a_repeated_tick_is_a_duplicate_and_counts_its_window_once():
    """A caller retrying a tick (same now_s) gets the same decision back; the predictors do not see the window
    twice, so the machine stays in step with one that got the tick once."""
    kw = dict(predictor="burst_quantile", predictor_window_ticks=3, burst_quantile=0.5, burst_factor=10)
    once, twice = PlannerStateMachine(cfg(**kw), PROF), PlannerStateMachine(cfg(**kw), PROF)
    for t, r in ((30, 9.0), (60, 18.0)):
        once.on_tick(tick(t, r))
        first = twice.on_tick(tick(t, r))
        assert twice.on_tick(tick(t, 90.0)) is first  # even with other numbers: the window was already counted
    a, b = once.on_tick(tick(90, 27.0)), twice.on_tick(tick(90, 27.0))
    assert a == b and a.predicted_rate_per_s > 27.0  # the trend 9 -> 18 -> 27, not a 90 req/s spike


def test_config_from_deployment_spec():
    spec = DeploymentSpec(model=ModelRef(name="m"), prefill=PoolSpec(tp=2, min_replicas=1, max_replicas=6),
                          decode=PoolSpec(tp=4, min_replicas=1, max_replicas=3),
                          planner=PlannerSpec(mode="sla", predictor="arima", gpu_budget=32, worker_start_s=90))
    c = PlannerConfig.from_spec(spec)
    assert (c.prefill_tp, c.decode_tp, c.max_prefill, c.max_decode, c.gpu_budget) == (2, 4, 6, 3, 32)
    assert c.ttft_target_s == pytest.approx(2.0) and c.itl_target_s == pytest.approx(0.05)
    assert c.predictor == "arima" and c.worker_start_s == 90


def test_every_planner_spec_setting_reaches_the_core():
    # mode ('off' stops the planner) and drain_cap_s (the worker drain) are the spec's own; every other
    # planner field is a PlannerConfig setting, and from_spec carries each one, a non-default value included
    assert set(PlannerSpec.model_fields) == set(SPEC_SETTINGS) | {"mode", "drain_cap_s"}
    base = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(mode="sla"))
    c = PlannerConfig.from_spec(base)
    for name in SPEC_SETTINGS:
        assert getattr(c, name) == getattr(base.planner, name), name
    changed = {"gpu_budget": 33, "burst_factor": 2.5, "size_on_peak": True, "peak_quantile": 0.5}
    c = PlannerConfig.from_spec(base.model_copy(update={"planner": PlannerSpec(mode="sla", **changed)}))
    assert {k: getattr(c, k) for k in changed} == changed
    field = PlannerSpec.model_fields["gpu_budget"]
    assert (field.default, field.description) == (64, "Total GPUs the planner may use.")


def test_a_default_spec_runs_the_planner_the_bench_measures():
    # bench/planner.py measures PlannerConfig's defaults; a spec that sets nothing must deploy exactly those
    spec = PlannerSpec(mode="sla")
    core = {f.name: f.default for f in dataclasses.fields(PlannerConfig) if f.name in SPEC_SETTINGS}
    assert {name: getattr(spec, name) for name in SPEC_SETTINGS} == core


# decode limited by the ITL target, not KV: step 30 ms + 0.1 ms per sequence. At the full 50 ms target
# a worker runs 200 sequences (4000 tok/s), at DECODE_ITL_MARGIN (45 ms) 150 (3333 tok/s). OSL 200:
# 30 req/s needs 2 workers either way, 36 req/s 2 at the target but 3 at the margin, 42 req/s 3.
PROF_ITL = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.03, decode_s_per_seq=1e-4,
                            kv_capacity_tokens=10_000_000)


def test_decode_band_grows_at_the_target_and_shrinks_at_the_margin():
    sm = PlannerStateMachine(cfg(decode_scale_down_delay_s=60.0, cooldown_s=30.0), PROF_ITL)
    series = [(30, 30.0), (60, 36.0), (90, 36.0), (120, 42.0), (150, 36.0), (180, 36.0), (210, 36.0),
              (240, 30.0), (270, 30.0), (300, 30.0)]
    got = [sm.on_tick(tick(t, r)).decode_replicas for t, r in series]
    # 36 req/s holds 2 (the margin alone would launch a third); 42 grows to 3; back at 36 the third
    # stays (the margin needs it); at 30 it goes after the 60 s scale-down delay
    assert got == [2, 2, 2, 3, 3, 3, 3, 3, 3, 2]
    without = PlannerStateMachine(cfg(decode_scale_down_delay_s=60.0, cooldown_s=30.0, decode_band=False), PROF_ITL)
    assert [without.on_tick(tick(t, r)).decode_replicas for t, r in series[:3]] == [2, 3, 3]


def test_decode_band_is_the_current_count_clamped_between_the_two_sizings():
    sm = PlannerStateMachine(cfg(), PROF_ITL, initial_decode=5)
    assert sm.decode_band_replicas(3, 36.0, 1000, 200) == 3  # above the margin sizing: shrink to it
    sm.decode = 1
    assert sm.decode_band_replicas(3, 36.0, 1000, 200) == 2  # below the target sizing: grow to it
    sm.decode = 2
    assert sm.decode_band_replicas(3, 36.0, 1000, 200) == 2  # in the band: hold
    sm.decode = 3
    assert sm.decode_band_replicas(3, 36.0, 1000, 200) == 3


def test_decode_band_waits_while_decode_workers_still_prefill():
    # a long cooldown holds prefill at 0 after aggregated serving while the load rises: the decode
    # workers still prefill, so they keep the margin sizing (the band would hold one fewer)
    prof = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.03, decode_s_per_seq=1e-3,
                            kv_capacity_tokens=100_000)
    runs = {}
    for band in (True, False):
        sm = PlannerStateMachine(cfg(scale_down_delay_s=30.0, cooldown_s=300.0, allow_aggregated=True,
                                     decode_scale_down_delay_s=30.0, decode_band=band), prof)
        out = []
        for k, r in enumerate([0.2] * 4 + [8.0] * 8):
            d = sm.on_tick(tick(30.0 * (k + 1), r, ready_p=sm.prefill, ready_d=sm.decode))
            out.append((d.prefill_replicas, d.decode_replicas))
        runs[band] = out
    assert (0, 5) in runs[True]  # held aggregated at 8 req/s
    assert runs[True] == runs[False]


def test_prefill_minimum_wins_over_a_held_decode_scale_down():
    # a fleet started below min_prefill (1 < 2) with decode at max_decode filling the budget
    # exactly (1x2 + 4x4 = 18): the minimum must be met at once, taking a decode worker, although
    # the decode scale-down delay would otherwise hold decode for 120 s
    sm = PlannerStateMachine(cfg(min_prefill=2, prefill_tp=2, decode_tp=4, max_decode=4, gpu_budget=18),
                             PROF, initial_prefill=1, initial_decode=50)
    assert (sm.prefill, sm.decode) == (1, 4)
    d = sm.on_tick(tick(30, 0.5, ready_p=1, ready_d=4))
    assert d.prefill_replicas == 2 and d.decode_replicas == 3
    assert d.num_gpus(2, 4) <= 18
    for t in (60, 90, 120):  # and it stays within the bounds afterwards
        d = sm.on_tick(tick(t, 0.5, ready_p=sm.prefill, ready_d=sm.decode))
        assert d.prefill_replicas >= 2 and d.num_gpus(2, 4) <= 18


def test_back_from_aggregated_below_min_prefill_never_flips_decode_within_its_cooldown():
    # budget 3 GPUs, min_prefill 2: decode grew to 2 while aggregated; going disaggregated needs
    # 2 prefill + 1 decode, but decode may not shrink within its 60 s cooldown of growing: the
    # fleet stays aggregated until it may (found by a breaker round on the min_prefill fix)
    sm = PlannerStateMachine(cfg(prefill_tp=1, decode_tp=1, min_prefill=2, max_prefill=8, max_decode=8, gpu_budget=3,
                                 scale_down_delay_s=0.0, cooldown_s=60.0, decode_scale_down_delay_s=None,
                                 allow_aggregated=True), PROF)
    seen, last_dir = [], {}
    for k, r in enumerate((0.5, 0.5, 8, 12, 12, 12, 12)):
        now = 30.0 * (k + 1)
        before = (sm.prefill, sm.decode)
        d = sm.on_tick(tick(now, r, ready_p=sm.prefill, ready_d=sm.decode))
        seen.append((d.prefill_replicas, d.decode_replicas, d.serving_mode))
        assert d.prefill_replicas == 0 or d.prefill_replicas >= 2
        assert d.num_gpus(1, 1) <= 3
        step = (d.decode_replicas > before[1]) - (d.decode_replicas < before[1])
        if step:
            if "dir" in last_dir and last_dir["dir"] != step:
                assert now - last_dir["t"] >= 60.0, seen
            if last_dir.get("dir") != step:
                last_dir = {"dir": step, "t": now}
    assert seen[-1][2] == "disaggregated" and seen[-1][:2] == (2, 1)


def test_a_tick_in_which_no_request_ended_is_sized_on_the_last_output_lengths_seen():
    """mean_osl_tokens is of the requests that ended in the window (what a runtime can know): 0 where none
    ended, which must not read as outputs of no tokens."""
    seen, held = PlannerStateMachine(cfg(), PROF), PlannerStateMachine(cfg(), PROF)
    for sm in (seen, held):
        sm.on_tick(tick(30, 30.0, osl=600))
    a = seen.on_tick(tick(60, 30.0, osl=600))
    b = held.on_tick(tick(60, 30.0, osl=0))  # the same traffic; none of its requests ended in this window
    assert b.predicted_osl_tokens == pytest.approx(600.0)
    assert (b.prefill_replicas, b.decode_replicas) == (a.prefill_replicas, a.decode_replicas)
    # with no output length seen yet: the prior (from_spec: the workload the deployment was tuned for), else 0
    cold = PlannerStateMachine(cfg(prior_osl_tokens=600.0), PROF).on_tick(tick(30, 30.0, osl=0))
    warm = PlannerStateMachine(cfg(), PROF).on_tick(tick(30, 30.0, osl=600))
    assert cold.predicted_osl_tokens == pytest.approx(600.0)
    assert (cold.prefill_replicas, cold.decode_replicas) == (warm.prefill_replicas, warm.decode_replicas)
    assert PlannerStateMachine(cfg(), PROF).on_tick(tick(30, 30.0, osl=0)).predicted_osl_tokens == 0.0
    spec = DeploymentSpec(model=ModelRef(name="m"))
    assert PlannerConfig.from_spec(spec).prior_osl_tokens == spec.workload.osl_tokens
    with pytest.raises(ValueError, match="prior_osl_tokens"):
        cfg(prior_osl_tokens=-1.0)
