"""Routing policies: hand-computed costs and the registry."""

import pytest

from runtime.router.load import WorkerLoad
from runtime.router.policies import POLICIES, UnknownPolicyError, make_policy

BS = 16


def _w(wid, prefill=0, decode_blocks=0, total=0):
    return WorkerLoad(wid, "both", prefill_tokens=prefill, decode_blocks=decode_blocks, prefill_work=float(prefill),
                      total_prefill_work=float(total))


def test_registry_has_the_five_policies_and_unknown_names_list_them():
    assert set(POLICIES) == {"kv_aware", "round_robin", "random", "least_loaded", "dynamo_cost"}
    with pytest.raises(UnknownPolicyError, match="'kv_aware'"):
        make_policy("nope")


def test_kv_aware_prefers_the_cache_until_its_queue_costs_more_than_recomputing():
    p = make_policy("kv_aware", decode_weight=0.0)
    # 320-token prompt (20 blocks); A holds 10 blocks = 160 tokens.
    # cost A = 0 + 320 - 160 = 160, cost B = 0 + 320 = 320 -> A
    assert p.choose([_w("A"), _w("B")], {"A": 10}, 20, 320, BS) == "A"
    # A queues 200 tokens: cost A = 360 > cost B = 320 -> B
    assert p.choose([_w("A", prefill=200), _w("B")], {"A": 10}, 20, 320, BS) == "B"


def test_kv_aware_decode_weight_charges_active_decode_tokens():
    p = make_policy("kv_aware", decode_weight=0.5)
    # A: 320-160 + 0.5*16*30 = 400 ; B: 320 + 0 = 320 -> B
    assert p.choose([_w("A", decode_blocks=30), _w("B")], {"A": 10}, 20, 320, BS) == "B"


def test_kv_aware_breaks_ties_towards_the_worker_that_prefilled_least():
    p = make_policy("kv_aware")
    assert p.choose([_w("A", total=500), _w("B", total=100), _w("C", total=300)], {}, 4, 64, BS) == "B"


def test_kv_aware_compares_work_from_the_prefill_cost_function():
    # quadratic toy cost: work = (n^2 - c^2) / 1000 ; prompt 320 tokens, A caches 160
    p = make_policy("kv_aware", prefill_cost=lambda n, c: (n * n - c * c) / 1000)
    # A: 50 queued + (102400 - 25600)/1000 = 126.8 ; B: 0 + 102.4 -> B
    assert p.choose([_w("A", prefill=50), _w("B")], {"A": 10}, 20, 320, BS) == "B"
    # A: 20 + 76.8 = 96.8 < 102.4 -> A
    assert p.choose([_w("A", prefill=20), _w("B")], {"A": 10}, 20, 320, BS) == "A"


def test_kv_aware_balance_weight_penalises_cumulative_excess_over_the_mean():
    p = make_policy("kv_aware", balance_weight=0.5)
    # mean total = 1000; A: 320-160 + 0.5*(1500-1000)=410 ; B: 320 + 0 = 320 -> B
    assert p.choose([_w("A", total=1500), _w("B", total=500)], {"A": 10}, 20, 320, BS) == "B"


def test_dynamo_cost_is_overlap_weight_times_prefill_blocks_plus_decode_blocks():
    p = make_policy("dynamo_cost", overlap_weight=1.0)
    # A: prefill_blocks = 32/16 + (20-10) = 12, decode = 8 + 20 = 28 -> 40
    # B: prefill_blocks = 0 + 20 = 20, decode = 0 + 20 = 20 -> 40 ... tie broken at random, both valid
    # C: prefill_blocks = 20, decode = 1 + 20 -> 41
    picks = {p.choose([_w("A", prefill=32, decode_blocks=8), _w("B"), _w("C", decode_blocks=1)],
                      {"A": 10}, 20, 320, BS) for _ in range(50)}
    assert picks == {"A", "B"}
    p2 = make_policy("dynamo_cost", overlap_weight=2.0)
    # A: 2*12 + 28 = 52 ; B: 2*20 + 20 = 60 -> A
    assert p2.choose([_w("A", prefill=32, decode_blocks=8), _w("B")], {"A": 10}, 20, 320, BS) == "A"


def test_temperature_samples_every_worker_but_favours_the_cheapest():
    p = make_policy("kv_aware", temperature=1.0, seed=3)
    picks = [p.choose([_w("A"), _w("B")], {"A": 20}, 20, 320, BS) for _ in range(400)]
    assert picks.count("A") > picks.count("B") > 0


def test_least_loaded_ignores_the_cache():
    p = make_policy("least_loaded")
    assert p.choose([_w("A", prefill=100), _w("B", decode_blocks=1)], {"A": 20}, 20, 320, BS) == "B"


def test_round_robin_cycles_in_pool_order():
    p = make_policy("round_robin")
    ws = [_w("A"), _w("B"), _w("C")]
    assert [p.choose(ws, {}, 1, 16, BS) for _ in range(4)] == ["A", "B", "C", "A"]


def test_random_is_seeded_and_stays_in_the_pool():
    ws = [_w("A"), _w("B"), _w("C")]
    a = [make_policy("random", seed=7).choose(ws, {}, 1, 16, BS) for _ in range(1)]
    p1, p2 = make_policy("random", seed=7), make_policy("random", seed=7)
    s1 = [p1.choose(ws, {}, 1, 16, BS) for _ in range(30)]
    s2 = [p2.choose(ws, {}, 1, 16, BS) for _ in range(30)]
    assert s1 == s2 and set(s1) <= {"A", "B", "C"} and len(set(s1)) == 3 and a[0] in "ABC"


def test_the_config_rejects_an_unknown_policy_naming_the_field():
    from pydantic import ValidationError

    from runtime.config import RouterSpec

    with pytest.raises(ValidationError, match="policy") as err:
        RouterSpec(policy="kv-aware")
    assert "round_robin" in str(err.value)
