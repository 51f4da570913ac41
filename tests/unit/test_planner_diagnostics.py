"""Where a planner's GPU-hours go: the simulator's per-pool GPU accounting, the prefill peak
predictor's own window/quantile (per-pool predictors), and the bench's diagnostic helpers
(hold reference, per-window worker counts, excess breakdown, warm start).

Profile (hand-checkable): prefill 0.1 ms/token, decode step 10 ms + 0.1 ms per running sequence,
KV 100k tokens per worker; prefill TP 2, decode TP 4."""

import math
from pathlib import Path

import numpy as np
import pytest

from runtime.config import PlannerSpec
from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig, PoolObservation, ScalingDecision, TickInput
from runtime.sim.fleet import FleetConfig, Trace, simulate, static_controller
from tests.planner_builders import PROF_TP as PROF
from tests.planner_builders import planner_cfg
from tests.planner_builders import tick as planner_tick
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    return load_script("bench/planner.py")


def trace(arrivals, isl=1000, osl=11) -> Trace:
    n = len(arrivals)
    return Trace(np.asarray(arrivals, float), np.full(n, isl), np.full(n, osl))


def fleet(**kw) -> FleetConfig:
    return FleetConfig(**{"prefill_tp": 2, "decode_tp": 4, "interval_s": 10.0, "worker_start_s": 20.0, **kw})


# ------------------------------------------------------------------ simulator: GPU-hours per pool
def test_static_fleet_gpu_seconds_split_by_pool_by_hand():
    res = simulate(trace(np.linspace(0, 90, 10)), PROF, fleet(initial_prefill=3, initial_decode=2),
                   static_controller(3, 2))
    assert res.gpu_seconds_by_pool["prefill"] == pytest.approx(3 * 2 * 90.0)
    assert res.gpu_seconds_by_pool["decode"] == pytest.approx(2 * 4 * 90.0)
    assert sum(res.gpu_seconds_by_pool.values()) == pytest.approx(res.gpu_seconds)


def test_pool_split_still_sums_to_the_total_while_pools_grow_and_shrink():
    targets = iter([(4, 1), (4, 3), (1, 3), (1, 1), (2, 2)] + [(2, 2)] * 50)

    def ctl(tick):
        p, d = next(targets)
        return ScalingDecision(now_s=tick.now_s, prefill_replicas=p, decode_replicas=d)

    res = simulate(trace(np.linspace(0, 120, 200)), PROF, fleet(), ctl)
    split = res.gpu_seconds_by_pool
    assert split["prefill"] > 0 and split["decode"] > 0
    assert split["prefill"] + split["decode"] == pytest.approx(res.gpu_seconds)


# ------------------------------------------------------------------ per-pool predictors
def cfg(**kw) -> PlannerConfig:  # noqa: ANN003
    return planner_cfg(**({"predictor": "burst_quantile"} | kw))


def tick(now_s: float, peak: float) -> TickInput:
    return planner_tick(now_s, 10.0, peak_prefill_tokens_per_s=peak)


def test_peak_predictor_forgets_a_burst_after_its_own_window():
    # one 200k-token peak second, then quiet ticks at 20k; quantile 1 = the window's maximum. The rate
    # predictor keeps 10 ticks, the peak predictor only 2 -> after 2 quiet ticks the peak term is back to the quiet size
    short = PlannerStateMachine(cfg(peak_window_ticks=2, burst_quantile=1.0), analytic_profile(
        prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4, kv_capacity_tokens=100_000))
    shared = PlannerStateMachine(cfg(burst_quantile=1.0), short.profile)
    for sm in (short, shared):
        sm.on_tick(tick(30, 200_000.0))
        sm.on_tick(tick(60, 20_000.0))
        sm.on_tick(tick(90, 20_000.0))
    # quiet peak: 20k + 0.9 s x 10 req/s x 1000 = 29k tokens x 0.1 ms = 2.9 worker-s / 1.9 s -> 2
    assert short.peak_prefill_replicas(10.0, 1000) == 2
    # burst still in the 10-tick window: 200k + 9k tokens -> 20.9 / 1.9 = 11
    assert shared.peak_prefill_replicas(10.0, 1000) == 11


def test_peak_quantile_below_one_ignores_a_single_outlier():
    sm = PlannerStateMachine(cfg(peak_window_ticks=5, peak_quantile=0.5), analytic_profile(
        prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4, kv_capacity_tokens=100_000))
    for t, peak in zip(range(30, 180, 30), (20_000.0, 20_000.0, 200_000.0, 20_000.0, 20_000.0)):
        sm.on_tick(tick(t, peak))
    assert sm.peak_prefill_replicas(10.0, 1000) == 2  # median of the peaks: 20k


@pytest.mark.parametrize("field,value", [("peak_window_ticks", 0), ("peak_quantile", 0.0), ("peak_quantile", 1.5)])
def test_bad_peak_predictor_settings_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        cfg(**{field: value})


def test_peak_predictor_settings_flow_from_the_deployment_spec():
    spec = PlannerSpec(peak_window_ticks=6, peak_quantile=0.5)
    assert spec.peak_window_ticks == 6 and spec.peak_quantile == 0.5
    assert PlannerSpec().peak_window_ticks is None and PlannerSpec().peak_quantile is None
    with pytest.raises(ValueError, match="peak_quantile"):
        PlannerSpec(peak_quantile=2.0)


# ------------------------------------------------------------------ bench diagnostics
def test_hold_controller_asks_for_the_plan_maximum_around_each_tick():
    bench = load_bench()
    plan = [(2, 1), (5, 1), (3, 2), (1, 1)]
    ctl = bench.hold_controller(plan, 60.0, 60.0, 60.0)

    def at(t):
        d = ctl(TickInput(now_s=t, interval_s=30.0, num_requests=0, mean_isl_tokens=0, mean_osl_tokens=0))
        return d.prefill_replicas, d.decode_replicas

    assert at(0.0) == (5, 1)  # windows 0..1
    assert at(90.0) == (5, 2)  # windows 0..2
    assert at(200.0) == (3, 2)  # windows 2..3 (past the plan's end: its last window)
    # the reacting reference (lead 0): the window in progress and the one before, nothing later
    react = bench.hold_controller(plan, 60.0, 0.0, 60.0)
    d = react(TickInput(now_s=90.0, interval_s=30.0, num_requests=0, mean_isl_tokens=0, mean_osl_tokens=0))
    assert (d.prefill_replicas, d.decode_replicas) == (5, 1)  # windows 0..1, not window 2's decode pool


def test_window_counts_average_the_timeline_over_each_window():
    bench = load_bench()
    timeline = [{"t_s": 30.0, "prefill": 4, "decode": 2}, {"t_s": 60.0, "prefill": 2, "decode": 2},
                {"t_s": 90.0, "prefill": 6, "decode": 1}]
    # window 0 = [0, 60): 30 s with nothing recorded yet + 30 s at 4 -> only the covered part counts
    counts = bench.window_counts(timeline, 60.0, 2)
    assert counts[0] == pytest.approx((4.0, 2.0))
    assert counts[1] == pytest.approx(((2 * 30 + 6 * 30) / 60, (2 * 30 + 1 * 30) / 60))


def test_excess_breakdown_sums_to_the_planner_figure():
    bench = load_bench()
    res = {"gpu_hours_prefill": 30.0, "gpu_hours_decode": 12.0}
    hold = {"gpu_hours_prefill": 25.0, "gpu_hours_decode": 11.0}
    out = bench.excess_breakdown(res, {"prefill": 20.0, "decode": 9.0}, hold)
    assert out["prefill"] == {"oracle": 20.0, "start_lag_and_hold": 5.0, "forecast_and_headroom": 5.0}
    assert out["decode"] == {"oracle": 9.0, "start_lag_and_hold": 2.0, "forecast_and_headroom": 1.0}


def test_warm_fleet_covers_the_first_scale_up_lead_plus_one_window():
    bench = load_bench()
    plan = [(11, 2), (9, 2), (13, 3), (20, 5)]
    # first scale-up ready at 30 + 60 = 90 s -> windows 0..1, plus one held window -> 0..2
    assert bench.warm_fleet(plan, "oracle_lead", 60.0, 90.0) == (13, 3)
    assert bench.warm_fleet(plan, "oracle_first_window", 60.0, 90.0) == (11, 2)


# ------------------------------------------------------------------ oracle: fewest GPUs, jointly
def test_oracle_trades_a_prefill_worker_for_many_decode_workers():
    from runtime.sim.oracles import _trade_prefill_for_decode

    # a window at the TTFT boundary: 12 prefill workers meet it only with 20 decode workers (decode
    # admission shaves the last TTFT misses), 13 prefill workers with 3 -> 13 x 2 + 3 x 4 = 38 GPUs < 104
    def run(p: int, d: int) -> float:
        return 1.0 if (p >= 13 and d >= 3) or (p == 12 and d >= 20) else 0.0

    assert _trade_prefill_for_decode(run, 12, 20, 0.99, 2, 4, 64) == (13, 3)
    # nothing to gain: the minimum prefill already has the minimum decode
    assert _trade_prefill_for_decode(lambda p, d: 1.0 if p >= 5 else 0.0, 5, 1, 0.99, 2, 4, 64) == (5, 1)


def test_oracle_plan_is_no_costlier_than_its_sequential_search():
    from runtime.sim.oracles import oracle_gpu_seconds

    rng = np.random.default_rng(5)
    arr = np.sort(rng.uniform(0, 120, 2400))  # 20 req/s = 2 Erlangs of prefill
    tr = Trace(arr, rng.integers(200, 3000, len(arr)), rng.integers(5, 60, len(arr)))
    total, plan = oracle_gpu_seconds(tr, PROF, fleet(interval_s=60.0), ttft_target_s=0.6, itl_target_s=0.05)
    for w, (p, d) in enumerate(plan):
        sub = tr.window(60.0 * w, 60.0 * (w + 1))
        ok = simulate(sub, PROF, fleet(interval_s=60.0, worker_start_s=0.0, initial_prefill=p, initial_decode=d),
                      static_controller(p, d)).slo_attainment(0.6, 0.05)
        assert ok >= 0.99  # every window's plan meets the SLO
        # no neighbour with fewer GPUs meets it: one prefill worker fewer with any decode pool up to 8,
        # or one decode worker fewer
        cheaper = [(p - 1, k) for k in range(1, 9) if p > 1 and (p - 1) * 2 + k * 4 < p * 2 + d * 4]
        cheaper += [(p, d - 1)] if d > 1 else []
        for cp, cd in cheaper:
            res = simulate(sub, PROF, fleet(interval_s=60.0, worker_start_s=0.0, initial_prefill=cp,
                                            initial_decode=cd), static_controller(cp, cd))
            assert res.slo_attainment(0.6, 0.05) < 0.99, (w, (p, d), (cp, cd))


# ------------------------------------------------------------------ NVIDIA Dynamo's real planner (optional)
def small_trace(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    t = np.sort(rng.uniform(0, 400.0, 400))
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for s, i, o in zip(t, rng.integers(100, 3000, 400), rng.integers(10, 400, 400)):
        m, sec = divmod(s, 60.0)
        lines.append(f"2023-11-16 18:{int(m):02d}:{sec:010.7f},{i},{o}")
    path = tmp_path / "t.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_dynamo_planner_is_skipped_with_its_reason_when_its_venv_is_absent(tmp_path):
    res = load_bench().main(["--trace", str(small_trace(tmp_path)), "--rate-scale", "2", "--planners",
                             "dynamo_planner,dynamo_sla", "--dynamo-venv", str(tmp_path / "no-venv")])
    assert "dynamo_planner" not in res["planners"] and "dynamo_sla" in res["planners"]
    assert "ai-dynamo" in res["skipped_planners"]["dynamo_planner"]


def test_dynamo_profile_payload_is_our_profile_in_dynamo_units():
    bench = load_bench()
    pay = bench.dynamo_profile_payload(PROF, 2, 4)
    # prefill 1000 tokens x 0.1 ms = 0.1 s -> 100 ms TTFT
    assert pay["prefill"]["ttft_ms"][pay["prefill"]["isl"].index(1024)] == pytest.approx(102.4)
    dec = pay["decode"]
    i = next(k for k, (x, y) in enumerate(zip(dec["x_kv_usage"], dec["y_context_length"])) if y == 1024 and x == 1.0)
    batch = 100_000 / 1024  # full KV at 1024-token contexts
    step_s = 0.01 + batch * 1e-4
    assert dec["z_itl_ms"][i] == pytest.approx(step_s * 1000.0)
    assert dec["z_thpt_per_gpu"][i] == pytest.approx(batch / step_s / 4)


DYNAMO_PY = ROOT / ".venv-bench-planner" / "bin" / "python"


@pytest.mark.skipif(not DYNAMO_PY.exists(), reason="no .venv-bench-planner with ai-dynamo==1.0.2")
def test_real_dynamo_planner_agrees_with_our_restatement_of_its_formula(tmp_path):
    res = load_bench().main(["--trace", str(small_trace(tmp_path)), "--rate-scale", "3", "--planners",
                             "dynamo_planner,dynamo_sla"])
    real, ours = res["planners"]["dynamo_planner"], res["planners"]["dynamo_sla"]
    assert real["gpu_hours"] > 0
    # same formula, predictor and interval: the GPU-hours agree within one replica-interval
    assert real["gpu_hours"] == pytest.approx(ours["gpu_hours"], abs=4 * 180 / 3600)


@pytest.mark.skipif(not DYNAMO_PY.exists(), reason="no .venv-bench-planner with ai-dynamo==1.0.2")
def test_real_dynamo_planner_acts_every_180_s_and_keeps_the_fleet_without_traffic():
    bench = load_bench()

    def tk(t: float, n: int) -> TickInput:
        return TickInput(now_s=t, interval_s=30.0, num_requests=n, mean_isl_tokens=1000 if n else 0,
                         mean_osl_tokens=100 if n else 0, prefill=PoolObservation(num_ready=2),
                         decode=PoolObservation(num_ready=1, running_per_worker=10.0),
                         observed_ttft_mean_s=0.2 if n else None, observed_itl_mean_s=0.02 if n else None,
                         mean_request_duration_s=2.2 if n else None)

    with bench.DynamoPlannerProcess(DYNAMO_PY, PROF, prefill_tp=2, decode_tp=4, ttft_s=2.0, itl_s=0.05,
                                    gpu_budget=64, tick_s=30.0) as dyn:
        busy = [dyn(tk(30.0 * (k + 1), 540)) for k in range(6)]  # 18 req/s for one 180-s interval
        idle = [dyn(tk(30.0 * (k + 7), 0)) for k in range(6)]
    assert busy[:5] == [None] * 5 and busy[5] is not None and busy[5].reason == "dynamo"
    # Dynamo's prefill formula: 18 req/s x 1000 tokens / (1000 tokens / 0.1 s / 2 GPUs) / 2 GPUs = 1.8 -> 2
    assert busy[5].prefill_replicas == 2 and busy[5].decode_replicas >= 1
    assert idle == [None] * 6  # no traffic: Dynamo skips the adjustment
    assert dyn.proc.poll() is not None  # the driver process was stopped


def test_a_driver_that_cannot_import_dynamo_fails_with_its_error():
    import sys

    bench = load_bench()
    # this venv has no ai-dynamo: the driver dies on import and the bench names it and its error
    with pytest.raises(RuntimeError, match=r"(?s)dynamo_planner_driver\.py stopped: .*No module named .dynamo"):
        bench.DynamoPlannerProcess(Path(sys.executable), PROF, prefill_tp=2, decode_tp=4, ttft_s=2.0, itl_s=0.05,
                                   gpu_budget=64, tick_s=30.0, timeout_s=60.0)


def test_match_attainment_finds_the_smallest_headroom_to_the_resolution():
    bench = load_bench()
    calls = []

    def run(h):  # attainment rises with headroom and crosses 0.99 at h = 0.6; GPU-hours rise too
        calls.append(h)
        return {"slo_attainment": min(0.9 + h * 0.15, 1.0), "gpu_hours": 30.0 * (1 + h)}

    got = bench.match_attainment(run, 0.99, first=0.25, resolution=0.05)
    assert got["found"]
    assert 0.6 <= got["headroom"] <= 0.6 + 0.05
    assert got["result"]["slo_attainment"] >= 0.99
    assert calls[:3] == [0.25, 0.5, 1.0]  # doubling until the first hit, then bisection
    assert [t[0] for t in got["tried"]] == [round(h, 4) for h in calls]
    # a target no headroom up to the cap reaches: not found, every probe listed, the cap itself probed
    never = bench.match_attainment(lambda h: {"slo_attainment": 0.5, "gpu_hours": 1.0}, 0.99, max_headroom=3.0)
    assert not never["found"] and never["headroom"] is None and [t[0] for t in never["tried"]] == [0.25, 0.5, 1.0,
                                                                                                 2.0, 3.0]
    at_cap = bench.match_attainment(lambda h: {"slo_attainment": 0.99 if h >= 3.0 else 0.5, "gpu_hours": h}, 0.99,
                                    max_headroom=3.0, resolution=1.0)
    assert at_cap["found"] and at_cap["headroom"] == 3.0
    # the formula already meets the target: headroom 0, nothing probed
    zero = bench.match_attainment(run, 0.99, at_zero={"slo_attainment": 0.995, "gpu_hours": 30.0})
    assert zero["found"] and zero["headroom"] == 0.0 and zero["tried"] == []
    for bad in (dict(first=0.0), dict(resolution=0.0), dict(max_headroom=float("inf")), dict(first=5.0)):
        with pytest.raises(ValueError, match="match_attainment"):
            bench.match_attainment(run, 0.99, **bad)


def test_match_gpu_hours_finds_the_largest_beta_within_the_budget():
    bench = load_bench()
    calls = []

    def run(beta):  # GPU-hours rise with beta and cross 34.75 at beta = 0.9; attainment rises too
        calls.append(beta)
        return {"slo_attainment": 0.7 + beta * 0.2, "gpu_hours": 33.0 + beta * 1.75 / 0.9}

    got = bench.match_gpu_hours(run, 34.75, hi=1.65, resolution=0.05)
    assert got["found"]
    assert 0.9 - 0.05 <= got["beta"] <= 0.9
    assert got["result"]["gpu_hours"] <= 34.75
    assert calls[:2] == [1.65, 0.0]  # the default, then the floor, then bisection
    assert [t[0] for t in got["tried"]] == [round(b, 4) for b in calls]
    assert got["budget_gpu_hours"] == 34.75
    # the default already within the budget: returned at once
    cheap = bench.match_gpu_hours(run, 100.0, hi=1.65)
    assert cheap["found"] and cheap["beta"] == 1.65 and len(cheap["tried"]) == 1
    # over the budget even without staffing: not found, both ends listed
    never = bench.match_gpu_hours(run, 10.0, hi=1.65)
    assert not never["found"] and never["beta"] is None and never["result"] is None
    assert [t[0] for t in never["tried"]] == [1.65, 0.0]
    for bad in (dict(hi=-1.0), dict(hi=float("nan")), dict(hi=1.65, resolution=0.0)):
        with pytest.raises(ValueError, match="match_gpu_hours"):
            bench.match_gpu_hours(run, 34.75, **bad)
    with pytest.raises(ValueError, match="match_gpu_hours"):
        bench.match_gpu_hours(run, 0.0, hi=1.65)


@pytest.mark.parametrize("gpus,peak", [(40, 13), (40, 1), (40, 38), (7, 3), (40, 25)])
def test_best_static_fleet_finds_the_best_split_of_the_gpus(gpus, peak):
    bench = load_bench()
    runs = []

    def run(p, d):  # attainment peaks at p = peak prefill workers (TP 1) and falls on both sides
        runs.append((p, d))
        assert p + d == gpus and p >= 1 and d >= 1
        return {"slo_attainment": 1.0 - abs(p - peak) / gpus, "gpu_hours": float(p + d)}

    got = bench.best_static_fleet(run, gpus, 1, 1)
    assert (got["prefill"], got["decode"]) == (peak, gpus - peak)
    assert got["result"]["slo_attainment"] == 1.0
    assert len(runs) == len(set(runs)) == len(got["tried"])
    assert len(runs) <= (gpus - 1 if gpus <= 8 else 2 * math.ceil(math.log2(gpus)) + 8)


def test_best_static_fleet_keeps_the_tp_arithmetic_and_refuses_too_few_gpus():
    bench = load_bench()

    def run(p, d):  # prefill TP 2, decode TP 4: what is left after p prefill workers, in whole decode workers
        assert 2 * p + 4 * d <= 22 and 2 * p + 4 * (d + 1) > 22
        return {"slo_attainment": min(p, d) / 10, "gpu_hours": 2 * p + 4 * d}

    got = bench.best_static_fleet(run, 22, 2, 4)
    assert (got["prefill"], got["decode"]) == (3, 4)  # 2*3 + 4*4 = 22; p=4 leaves 3 decode workers
    assert bench.best_static_fleet(run, 5, 2, 4) is None
