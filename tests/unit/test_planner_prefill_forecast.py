"""Rule 9 of runtime.planner.state_machine: the prefill M/M/c term sizes on the rate predictor's forecast
through the lead time (a ramp is launched for ahead of it), or with ``size_on_tokens`` on the prompt-token
forecast.

Profile (hand-checkable): prefill 0.1 ms/token; decode step 10 ms + 0.1 ms per sequence; KV 1M tokens.
"""

from runtime.planner.profiles import analytic_profile
from runtime.planner.state_machine import PlannerStateMachine
from runtime.planner.types import PlannerConfig
from tests.planner_builders import fleet_tick, planner_cfg

PROF = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4,
                        kv_capacity_tokens=1_000_000)


def cfg(**kw) -> PlannerConfig:  # noqa: ANN003
    return planner_cfg(**(dict(predictor="burst_quantile", prefill_staffing_beta=None) | kw))


def run(sm: PlannerStateMachine, rates: list[float], isls: list[float] | None = None) -> list[int]:
    return [fleet_tick(sm, 30.0 * (i + 1), rate, isl=isls[i] if isls else 1000.0,
                       decode={"running_per_worker": 50}).prefill_replicas for i, rate in enumerate(rates)]


def test_mmc_term_launches_ahead_of_a_ramp():
    # a steady ramp: the trend through the lead time is what the M/M/c term sizes for
    got = run(PlannerStateMachine(cfg(), PROF, initial_prefill=2, initial_decode=2), [10.0, 20.0, 30.0, 40.0, 50.0])
    assert got[-1] >= 7  # 50 req/s x 0.1 s = 5 Erlangs now, more through the lead time
    assert got == sorted(got)


def test_size_on_tokens_keeps_the_prompt_token_forecast():
    # size_on_tokens: a steady 20 req/s whose prompts go from 1000 to 8000 tokens is 16 Erlangs of prefill
    # (20 x 8000 x 0.1 ms); the M/M/c term must size on the prompt-token forecast, not the request rate x mean ISL
    sm = PlannerStateMachine(cfg(size_on_tokens=True), PROF, initial_prefill=2, initial_decode=2)
    got = run(sm, [20.0] * 10, [1000.0] * 6 + [8000.0] * 4)
    assert min(got[7:]) >= 17, got  # utilisation below 1 from the second tick of long prompts on


def test_a_shift_to_longer_prompts_is_planned_for_at_the_tick_that_shows_it():
    # 20 req/s whose prompts go from 1000 to 8000 tokens: 2 Erlangs, then 16 (20 x 8000 x 0.1 ms). The
    # predicted ISL is a ten-tick mean (1700 tokens at the first long tick); the M/M/c term plans on the
    # tick's own mean at once, not half a window later
    sm = PlannerStateMachine(cfg(), PROF, initial_prefill=2, initial_decode=2)
    got = run(sm, [20.0] * 8, [1000.0] * 6 + [8000.0] * 2)
    assert got[6] >= 17, got  # the first tick of long prompts: utilisation below 1 at 8000 tokens
    assert max(got[:6]) <= 4, got


def test_a_shift_to_longer_outputs_is_planned_for_at_the_tick_that_shows_it():
    sm = PlannerStateMachine(cfg(), PROF, initial_prefill=2, initial_decode=1)
    decisions = []
    for i in range(8):
        osl = 100.0 if i < 6 else 2000.0
        decisions.append(fleet_tick(sm, 30.0 * (i + 1), 20.0, isl=1000.0, osl=osl,
                                    decode={"running_per_worker": 50}).decode_replicas)
    assert decisions[6] > max(decisions[:6]), decisions
