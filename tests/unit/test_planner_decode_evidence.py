"""Rule 9 (the M/M/c prefill term on the level and trend, not the window quantile) and rule 10
(decode growth bounded by the observed concurrency) of runtime.planner.state_machine.

Profiles (hand-checkable): prefill 0.1 ms/token; decode step 10 ms + 0.1 ms per sequence at every
context, so a worker steps within the 50 ms ITL target up to 400 sequences. Context 1000 + 200 / 2 =
1100 tokens, KV per sequence 1100 / 0.9 = 1222 tokens: with 100k tokens of KV a worker holds 81
sequences (4475 tokens/s at 18.1 ms), with 1M tokens 400 (8000 tokens/s at 50 ms).
"""

from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig, PoolObservation, TickInput

PROF = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4, kv_capacity_tokens=100_000)
PROF_1M = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4,
                           kv_capacity_tokens=1_000_000)


def cfg(**kw) -> PlannerConfig:
    base = dict(mode="sla", prefill_tp=1, decode_tp=1, min_prefill=1, max_prefill=40, min_decode=1, max_decode=20,
                gpu_budget=64, interval_s=30.0, worker_start_s=60.0, predictor="burst_quantile",
                allow_aggregated=False)
    return PlannerConfig(**(base | kw))


def tick(now_s: float, rate: float, *, running: float = 0.0, waiting: float = 0.0, kv: float = 0.0,
         ready_d: int = 2, starting_d: int = 0) -> TickInput:
    return TickInput(now_s=now_s, interval_s=30.0, num_requests=round(rate * 30), mean_isl_tokens=1000,
                     mean_osl_tokens=200, prefill=PoolObservation(num_ready=4),
                     decode=PoolObservation(num_ready=ready_d, num_starting=starting_d, running_per_worker=running,
                                            queue_per_worker=waiting, kv_usage=kv))


def test_decode_concurrency_replicas_by_hand():
    sm = PlannerStateMachine(cfg(), PROF_1M, initial_prefill=4, initial_decode=2)
    # 2 workers x 150 sequences at 20 req/s, 25 ms steps: Little's law T = 300 / (20 x 0.025) = 600
    # tokens per request; one worker serves 8000 tokens/s within 50 ms
    assert sm.decode_concurrency_replicas(tick(30, 20.0, running=150), 40.0) == 3  # 24000 / 8000
    assert sm.decode_concurrency_replicas(tick(30, 20.0, running=150), 60.0) == 5  # 36000 / 8000 = 4.5
    # waiting sequences count as concurrency
    assert sm.decode_concurrency_replicas(tick(30, 20.0, running=100, waiting=50), 40.0) == 3
    # a forecast below the observed rate sizes for the observed rate: 12000 / 8000 = 1.5
    assert sm.decode_concurrency_replicas(tick(30, 20.0, running=150), 5.0) == 2
    # an ITL correction of 1.25 applies to both steps: the observed one is 31.25 ms, so T = 480 tokens;
    # the profile must step within 50 / 1.25 = 40 ms, 300 sequences, 7500 tokens/s; 19200 / 7500 = 2.56
    sm.itl_correction = 1.25
    assert sm.decode_concurrency_replicas(tick(30, 20.0, running=150), 40.0) == 3
    sm.itl_correction = 1.0
    # no evidence: no limit
    cap = sm.cfg.max_decode
    assert sm.decode_concurrency_replicas(tick(30, 20.0, running=0.0), 60.0) == cap
    assert sm.decode_concurrency_replicas(tick(30, 20.0, running=150, starting_d=1), 60.0) == cap
    assert sm.decode_concurrency_replicas(tick(30, 0.0, running=150), 60.0) == cap
    assert sm.decode_concurrency_replicas(tick(30, 20.0, running=150, ready_d=0), 60.0) == cap


def test_decode_concurrency_replicas_is_not_a_linear_scaling_of_the_batch():
    # 1 worker at 200 sequences (30 ms) for 10 req/s: T = 200 / (10 x 0.03) = 666.7 tokens. Twice the
    # rate is 13333 tokens/s, 1.67 workers at 8000 each -> 2, although 400 sequences (twice the batch)
    # would step in exactly 50 ms on one worker
    sm = PlannerStateMachine(cfg(), PROF_1M, initial_prefill=4, initial_decode=1)
    assert sm.decode_concurrency_replicas(tick(30, 10.0, running=200, ready_d=1), 20.0) == 2


def _decode_after_ramp(**kw) -> int:
    sm = PlannerStateMachine(cfg(**kw), PROF, initial_prefill=10, initial_decode=2)
    d = None
    # a three-point ramp (10, 30, 32 req/s) whose trend forecasts ~65 req/s; the pool runs 15
    # sequences per worker at 16 % KV: twice the load still fits in one worker
    for i, rate in enumerate((10.0, 30.0, 32.0)):
        d = sm.on_tick(tick(30.0 * (i + 1), rate, running=15, kv=0.165))
    return d.decode_replicas


def test_decode_grows_only_as_far_as_the_observed_concurrency_needs():
    assert _decode_after_ramp(decode_scale_up_on_concurrency=False) > 2  # the rate forecast alone launches
    assert _decode_after_ramp() == 2


def test_decode_grows_when_the_observed_concurrency_needs_it():
    sm = PlannerStateMachine(cfg(), PROF, initial_prefill=10, initial_decode=2)
    d = None
    for i, rate in enumerate((10.0, 30.0, 32.0)):
        d = sm.on_tick(tick(30.0 * (i + 1), rate, running=300, kv=0.6))
    assert d.decode_replicas > 2


def _prefill_after_burst(**kw) -> int:
    sm = PlannerStateMachine(cfg(prefill_staffing_beta=None, **kw), PROF, initial_prefill=2, initial_decode=2)
    d = None
    for i, rate in enumerate((20.0, 20.0, 20.0, 80.0, 20.0, 20.0, 20.0, 20.0)):
        d = sm.on_tick(tick(30.0 * (i + 1), rate, running=50, kv=0.1))
    return d.prefill_replicas


def test_mmc_term_follows_the_load_down_after_a_burst():
    # five ticks after a one-tick burst: the window's 90th percentile still holds ~62 req/s, the level
    # and (no longer upward) trend are 20 req/s
    held, followed = _prefill_after_burst(prefill_queue_on_trend=False), _prefill_after_burst()
    assert followed < held
