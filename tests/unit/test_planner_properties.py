"""Invariants of the planner under arbitrary (noisy) load, checked with hypothesis:

1. replicas always within [min, max] per pool (prefill may be 0 only in aggregated mode);
2. GPUs always within the budget;
3. at most one scaling-direction change per pool in any cooldown window;
4. sizing is monotone in the predicted load (more load never means fewer prefill, decode or GPUs),
   the decode band included (from any current decode count).
Configurations include the burst terms: the sub-tick peak term and square-root staffing, its
headroom scaled by the arrival dispersion the ticks report (rule 11; monotonicity of the staffing
term itself: test_planner_staffing.py and test_planner_dispersion.py).
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.planner import sla
from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig, PoolObservation, TickInput
from tests.planner_builders import PROF_TP as PROF

# ITL-limited decode (the band between the full target and DECODE_ITL_MARGIN is not empty here)
PROF_ITL = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.03, decode_s_per_seq=1e-4,
                            kv_capacity_tokens=10_000_000, prefill_tp=2, decode_tp=4)

configs = st.builds(
    dict,
    min_prefill=st.integers(1, 3),
    max_prefill=st.integers(3, 12),
    min_decode=st.integers(1, 2),
    max_decode=st.integers(2, 8),
    gpu_budget=st.integers(14, 80),  # >= the minimums: 3 x 2 + 2 x 4
    cooldown_s=st.sampled_from([0.0, 60.0, 150.0]),
    scale_down_delay_s=st.sampled_from([0.0, 60.0, 180.0]),
    predictor=st.sampled_from(["constant", "moving_average", "burst_quantile"]),
    reserved_priority_share=st.sampled_from([0.0, 0.25]),
    allow_aggregated=st.booleans(),
    mode=st.sampled_from(["sla", "load"]),
    prefill_staffing_beta=st.sampled_from([None, 0.0, 1.5, 3.0]),
    size_on_peak=st.booleans(),
    decode_band=st.booleans(),
    itl_limited=st.booleans(),  # PROF_ITL instead of the KV-limited PROF
)
loads = st.lists(st.tuples(st.floats(0, 120), st.floats(0, 1), st.floats(0, 8), st.floats(0, 1)), min_size=5, max_size=40)


def make(c: dict) -> PlannerStateMachine:
    c = dict(c)
    prof = PROF_ITL if c.pop("itl_limited", False) else PROF
    cfg = PlannerConfig(prefill_tp=2, decode_tp=4, interval_s=30.0, worker_start_s=60.0, **c)
    return PlannerStateMachine(cfg, prof if cfg.mode == "sla" else None)


@settings(max_examples=int(__import__('os').environ.get('PLANNER_EXAMPLES', 60)), deadline=None)
@given(configs, loads)
def test_bounds_budget_and_cooldown_under_noisy_load(c, series):
    sm = make(c)
    cfg = sm.cfg
    moves: dict[str, list[tuple[float, int]]] = {"prefill": [], "decode": []}
    prev = {"prefill": sm.prefill, "decode": sm.decode}
    for k, (rate, noise, queue, kv) in enumerate(series):
        now = 30.0 * (k + 1)
        r = rate * (0.5 + noise)
        t = TickInput(now_s=now, interval_s=30.0, num_requests=int(r * 30), mean_isl_tokens=1000 + 500 * noise,
                      mean_osl_tokens=200, num_priority_requests=int(r * 30 * noise * 0.2),
                      prefill=PoolObservation(num_ready=prev["prefill"], queue_per_worker=queue),
                      decode=PoolObservation(num_ready=prev["decode"], kv_usage=kv, running_per_worker=50 * kv),
                      observed_ttft_p90_s=2.5 * noise if k % 2 else None, observed_itl_p90_s=0.06 * noise,
                      peak_prefill_tokens_per_s=r * (1000 + 500 * noise) * (1 + 3 * noise),
                      arrival_dispersion=30.0 * noise * queue / 8 if k % 3 else None)
        d = sm.on_tick(t)
        min_p = 0 if d.serving_mode == "aggregated" else cfg.min_prefill
        assert min_p <= d.prefill_replicas <= cfg.max_prefill
        assert cfg.min_decode <= d.decode_replicas <= cfg.max_decode
        assert d.num_gpus(2, 4) <= cfg.gpu_budget
        for pool, val in (("prefill", d.prefill_replicas), ("decode", d.decode_replicas)):
            if val != prev[pool]:
                moves[pool].append((now, 1 if val > prev[pool] else -1))
            prev[pool] = val
    for pool, mv in moves.items():
        flips = [t for (t, s), (_, s0) in zip(mv[1:], mv[:-1]) if s != s0]
        for a, b in zip(flips, flips[1:]):
            assert b - a >= cfg.cooldown_s, f"{pool}: direction changed at {a} and {b}"


@settings(max_examples=60, deadline=None)
@given(st.floats(0.01, 200), st.floats(0.01, 200), st.floats(64, 4000), st.floats(16, 1000))
def test_sizing_is_monotone_in_predicted_load(r1, r2, isl, osl):
    sm = make(dict(allow_aggregated=False))
    lo, hi = sorted((r1, r2))
    a, b = sm.size_for_load(lo, isl, osl), sm.size_for_load(hi, isl, osl)
    assert a.prefill <= b.prefill and a.decode <= b.decode
    sm_agg = make(dict(allow_aggregated=True))
    ga = sm_agg._gpus(sm_agg.size_for_load(lo, isl, osl))
    gb = sm_agg._gpus(sm_agg.size_for_load(hi, isl, osl))
    assert ga <= gb


@settings(max_examples=60, deadline=None)
@given(st.floats(0.01, 200), st.floats(0.01, 200), st.floats(64, 4000), st.floats(16, 1000), st.integers(1, 40))
def test_decode_band_is_monotone_in_predicted_load_and_within_its_bounds(r1, r2, isl, osl, current):
    sm = PlannerStateMachine(PlannerConfig(prefill_tp=2, decode_tp=4, interval_s=30.0, worker_start_s=60.0,
                                           allow_aggregated=False, max_decode=64, gpu_budget=512), PROF_ITL,
                             initial_decode=current)
    assert sm.decode == current  # within the budget: not trimmed
    lo, hi = sorted((r1, r2))
    band = []
    for r in (lo, hi):
        margin_sized = sm.size_for_load(r, isl, osl).decode
        d = sm.decode_band_replicas(margin_sized, r, isl, osl)
        at_target = sla.decode_replicas(r, isl, osl, PROF_ITL.decode, itl_target_s=sm.cfg.itl_target_s)
        assert at_target <= margin_sized  # the full target never needs more workers than its margin
        assert at_target <= d <= margin_sized
        if at_target <= current <= margin_sized:
            assert d == current  # inside the band: hold
        band.append(d)
    assert band[0] <= band[1]
