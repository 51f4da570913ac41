"""Challenger vs champion (runtime/tuner/champion.py): the champion's deployment predicted on the new workload, and
the rule that decides whether the new winner takes the alias."""

from __future__ import annotations

import math

import pytest

from runtime.config import DeploymentSpec, ModelRef, SloSpec, WorkloadSpec
from runtime.modelfiles.load import load_model_spec
from runtime.modelfiles.catalog import CATALOG_DIR, load_catalog_spec
from runtime.tuner.champion import (DEFAULT_MIN_IMPROVEMENT_PCT, champion_perf, compare_with_champion,
                                    evaluate_deployment)
from runtime.tuner.search import Candidate, tune

L70 = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json")
SLO = SloSpec()


def _winner_spec(rate: float, planner: str = "off", gpu: str = "H100-SXM") -> tuple[object, DeploymentSpec]:
    r = tune(L70, gpu, SLO, WorkloadSpec(request_rate_per_s=rate))
    spec = r.to_deployment_spec(ModelRef(name="llama70b"))
    spec.planner.mode = planner
    return r, spec


def _cand(label_tp=(4, 4), gpus=16, usd: float | None = 20.0, feasible=True, reason="") -> Candidate:
    p, d = label_tp
    return Candidate(p, d, feasible=feasible, reason=reason, num_gpus=gpus if feasible else 0,
                     usd_per_mtok=usd if feasible else None, goodput_per_gpu=0.8 if feasible else 0.0,
                     prefill_replicas=1, decode_replicas=1)


# ------------------------------------------------------------------------------------ the champion as deployed


def test_re_tuning_the_same_traffic_finds_the_champion_as_good_and_keeps_it():
    """Invariant: the winner's own spec, evaluated as a deployment on its own workload, costs what the winner
    costs, so re-running a tuning on unchanged traffic never moves the alias."""
    r, spec = _winner_spec(10.0)
    old = evaluate_deployment(champion_perf(r.model, spec, r.perf), spec, r.slo, r.workload, 64)
    assert old.feasible and old.num_gpus == r.best.num_gpus
    assert old.usd_per_mtok == pytest.approx(r.best.usd_per_mtok)
    cmp = compare_with_champion(r.best, old, same_gpu=True)
    assert cmp.metric == "num_gpus" and cmp.improvement_pct == 0.0 and not cmp.replace
    assert cmp.min_improvement_pct == DEFAULT_MIN_IMPROVEMENT_PCT == 5.0


def test_fixed_replicas_sized_for_more_traffic_cost_their_gpus_and_lose_to_a_smaller_winner():
    r10, spec = _winner_spec(10.0)  # p4d4 3:1 = 16 GPUs on H100 at 10 requests/s
    assert (spec.prefill.replicas, spec.decode.replicas, spec.prefill.tp, spec.decode.tp) == (3, 1, 4, 4)
    r2 = tune(L70, "H100-SXM", SLO, WorkloadSpec(request_rate_per_s=2.0))  # p4d4 1:1 = 8 GPUs
    old = evaluate_deployment(champion_perf(L70, spec, r2.perf), spec, r2.slo, r2.workload, 64)
    assert old.feasible and (old.prefill_replicas, old.decode_replicas, old.num_gpus) == (3, 1, 16)
    assert old.usd_per_mtok == pytest.approx(r2.best.usd_per_mtok * 2)  # twice the GPUs, same price per GPU
    cmp = compare_with_champion(r2.best, old, same_gpu=True)
    assert cmp.replace and cmp.improvement_pct == pytest.approx(50.0)
    assert "16 GPUs" in cmp.reason and "8 GPUs" in cmp.reason and "50.0% less" in cmp.reason


def test_with_a_planner_the_champion_runs_what_the_rate_needs_within_its_bounds():
    _, spec = _winner_spec(10.0, planner="sla")  # max replicas 8:8
    r2 = tune(L70, "H100-SXM", SLO, WorkloadSpec(request_rate_per_s=2.0))
    old = evaluate_deployment(champion_perf(L70, spec, r2.perf), spec, r2.slo, r2.workload, 64)
    assert (old.prefill_replicas, old.decode_replicas, old.num_gpus) == (1, 1, 8)  # the planner scales down
    spec.prefill.min_replicas = 2
    old = evaluate_deployment(champion_perf(L70, spec, r2.perf), spec, r2.slo, r2.workload, 64)
    assert (old.prefill_replicas, old.num_gpus) == (2, 12)  # but never below min_replicas


def test_a_champion_without_the_workers_the_new_rate_needs_cannot_serve_it():
    _, spec = _winner_spec(10.0)  # 3:1 fixed
    r40 = tune(L70, "H100-SXM", SLO, WorkloadSpec(request_rate_per_s=40.0))
    old = evaluate_deployment(champion_perf(L70, spec, r40.perf), spec, r40.slo, r40.workload, 64)
    assert not old.feasible and "fixed replicas (planner off) are 3:1" in old.reason
    cmp = compare_with_champion(r40.best, old, same_gpu=True, min_improvement_pct=99)
    assert cmp.replace and cmp.metric == "" and cmp.improvement_pct is None and "cannot serve" in cmp.reason

    spec.planner.mode = "load"  # max replicas 8:8: too few for 40 requests/s, enough for 20 but over the budget
    old = evaluate_deployment(champion_perf(L70, spec, r40.perf), spec, r40.slo, r40.workload, 64)
    assert not old.feasible and "max replicas (planner load) are 8:8" in old.reason
    r20 = tune(L70, "H100-SXM", SLO, WorkloadSpec(request_rate_per_s=20.0))
    old = evaluate_deployment(champion_perf(L70, spec, r20.perf), spec, r20.slo, r20.workload, 16)
    assert not old.feasible and "over the GPU budget 16" in old.reason
    assert evaluate_deployment(champion_perf(L70, spec, r20.perf), spec, r20.slo, r20.workload, 64).feasible


def test_a_champion_missing_the_new_slo_cannot_serve_it():
    _, spec = _winner_spec(2.0)
    tight = SloSpec(ttft_p90_ms=2000.0, itl_p90_ms=5.0)
    old = evaluate_deployment(champion_perf(L70, spec), spec, tight, WorkloadSpec(request_rate_per_s=2.0), 64)
    assert not old.feasible and old.reason.startswith("SLO miss")


def test_the_champions_own_gpu_and_precision_are_used():
    r, spec = _winner_spec(2.0, gpu="H200-SXM")
    assert champion_perf(L70, spec, r.perf) is r.perf  # same model, GPU and precision: the same calibration
    h100 = tune(L70, "H100-SXM", SLO, WorkloadSpec(request_rate_per_s=2.0))
    perf = champion_perf(L70, spec, h100.perf)
    assert perf is not h100.perf and perf.gpu.name == "H200-SXM" and perf.precision == spec.precision
    spec.gpu = "NoSuchGPU"
    with pytest.raises(KeyError):
        champion_perf(L70, spec)


def test_evaluate_deployment_refuses_a_budget_below_one():
    r, spec = _winner_spec(2.0)
    with pytest.raises(ValueError, match="gpu_budget"):
        evaluate_deployment(r.perf, spec, r.slo, r.workload, 0)


# ------------------------------------------------------------------------------------------------ the rule


@pytest.mark.parametrize("old_gpus, new_gpus, pct, replace", [
    (16, 8, 50.0, True),
    (20, 19, 5.0, True),  # exactly the threshold
    (100, 96, 4.0, False),
    (8, 8, 0.0, False),
    (8, 16, -100.0, False),  # a worse challenger
])
def test_same_gpu_type_compares_gpus(old_gpus, new_gpus, pct, replace):
    cmp = compare_with_champion(_cand(gpus=new_gpus), _cand(gpus=old_gpus), same_gpu=True, min_improvement_pct=5)
    assert cmp.metric == "num_gpus" and cmp.improvement_pct == pytest.approx(pct) and cmp.replace is replace
    assert (cmp.champion_value, cmp.challenger_value) == (old_gpus, new_gpus)
    assert f"{abs(pct):.1f}% {'more' if pct < 0 else 'less'} than the champion" in cmp.reason


def test_different_gpu_types_compare_dollars_per_million_tokens():
    cmp = compare_with_champion(_cand(gpus=4, usd=21.0), _cand(gpus=16, usd=20.0), same_gpu=False)
    assert cmp.metric == "usd_per_mtok" and not cmp.replace  # fewer GPUs, but dearer ones
    assert cmp.improvement_pct == pytest.approx(-5.0) and "5.0% more" in cmp.reason
    cmp = compare_with_champion(_cand(gpus=16, usd=10.0), _cand(gpus=4, usd=20.0), same_gpu=False)
    assert cmp.replace and cmp.improvement_pct == pytest.approx(50.0)


def test_without_a_price_different_gpu_types_do_not_compare_and_the_champion_stays():
    cmp = compare_with_champion(_cand(gpus=1, usd=None), _cand(gpus=16, usd=20.0), same_gpu=False)
    assert not cmp.replace and cmp.metric == "" and cmp.improvement_pct is None and "do not compare" in cmp.reason


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_the_threshold_must_be_a_finite_non_negative_percentage(bad):
    with pytest.raises(ValueError, match="min_improvement_pct"):
        compare_with_champion(_cand(), _cand(), same_gpu=True, min_improvement_pct=bad)


def test_only_a_feasible_winner_can_challenge():
    with pytest.raises(ValueError, match="infeasible"):
        compare_with_champion(_cand(feasible=False, reason="SLO miss"), _cand(), same_gpu=True)


# ------------------------------------------------------------------------- champions of other worker layouts


@pytest.mark.parametrize("name, gpu, precision, rate", [
    ("deepseek-v3", "p5.48xlarge", "fp8", 1.0),  # p[TP8 PP2]d[DP16 EP16]: pipeline stages and wide EP across nodes
    ("qwen3-30b-a3b", "H100-SXM", "bf16", 50.0),  # p[TP1]d[DP4 EP4]: DP-attention decode on one node
])
def test_a_champion_of_another_layout_is_predicted_as_its_layouts_and_keeps_the_alias_against_itself(
        name, gpu, precision, rate):
    """The champion's pools are evaluated with their own pp / dp / ep and cost their workers' real GPUs
    (tp x dp x pp each): the winner's own spec as the champion costs what the winner costs, so the alias stays
    (``min_improvement_pct`` decides, not a mis-read layout)."""
    m = load_catalog_spec(name)
    r = tune(m, gpu, SLO, WorkloadSpec(request_rate_per_s=rate), precision=precision, parallelism="all")
    assert not r.best.plain_tp
    spec = r.to_deployment_spec(ModelRef(name="x"))
    for perf in (champion_perf(m, spec, r.perf), champion_perf(m, spec)):  # reused and freshly built
        old = evaluate_deployment(perf, spec, r.slo, r.workload, 10_000)
        assert old.feasible, old.reason
        assert (old.label, old.num_gpus) == (r.best.label, r.best.num_gpus)
        assert old.usd_per_mtok == pytest.approx(r.best.usd_per_mtok)
        cmp = compare_with_champion(r.best, old, same_gpu=True)
        assert cmp.improvement_pct == 0.0 and not cmp.replace


def test_a_layout_champion_counts_the_gpus_of_its_workers_against_the_budget():
    m = load_catalog_spec("qwen3-30b-a3b")
    r = tune(m, "H100-SXM", SLO, WorkloadSpec(request_rate_per_s=50.0), parallelism="all")
    spec = r.to_deployment_spec(ModelRef(name="x"))
    assert spec.decode.dp > 1
    old = evaluate_deployment(champion_perf(m, spec, r.perf), spec, r.slo, r.workload, r.best.num_gpus - 1)
    assert not old.feasible and f"= {r.best.num_gpus} GPUs" in old.reason
