"""What a tuning records about a winner whose workers are not plain TP (real MLflow on sqlite): the fields named
``tp`` hold vLLM's --tensor-parallel-size, the worker's layout and GPUs are recorded beside them."""

from __future__ import annotations

import pytest

from runtime.config import ModelRef, SloSpec, WorkloadSpec
from runtime.modelfiles.catalog import load_catalog_spec
from runtime.tuner.search import tune
from runtime.usecases.tune import TuneDecision, TuneOutcome, deployment_for, kfp_tune_outputs, register_tuning


@pytest.fixture(scope="module")
def tuned():
    """Qwen3-30B-A3B at 50 requests/s on H100: p[TP1]d[DP4 EP4], decode workers of TP 1 on 4 GPUs each."""
    r = tune(load_catalog_spec("qwen3-30b-a3b"), "H100-SXM", SloSpec(), WorkloadSpec(request_rate_per_s=50.0),
             parallelism="all")
    assert (r.best.decode.tp, r.best.decode.dp, r.best.decode.gpus) == (1, 4, 4)
    return r, deployment_for(r, ModelRef(name="q"), gpu_budget=64, planner_mode="off")


def test_version_tags_and_metrics_hold_tp_degrees_and_the_layouts(tuned, tmp_path):
    from mlflow.tracking import MlflowClient

    r, spec = tuned
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reg = register_tuning(r, spec, tracking_uri=uri, registered_model="q")
    b = r.best
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    mv = client.get_model_version("q", reg.decision.registered_version)
    assert (mv.tags["prefill_tp"], mv.tags["decode_tp"]) == (str(spec.prefill.tp), str(spec.decode.tp)) == (
        str(b.prefill.tp), "1")
    assert (mv.tags["prefill_layout"], mv.tags["decode_layout"]) == (b.prefill.label, "DP4 EP4")
    assert (mv.tags["prefill_worker_gpus"], mv.tags["decode_worker_gpus"]) == (str(b.prefill.gpus), "4")
    parent = client.get_run(mv.run_id).data
    assert (parent.metrics["best_prefill_tp"], parent.metrics["best_decode_tp"]) == (b.prefill.tp, 1.0)
    assert parent.metrics["best_decode_worker_gpus"] == 4.0
    assert "decode_tp" not in parent.params and parent.params["decode_layout"] == "DP4 EP4"
    exp = client.get_experiment(client.get_run(mv.run_id).info.experiment_id)
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{mv.run_id}'", max_results=500)
    winner = [c.data for c in children if c.data.tags["champion"] == "true"]
    assert len(winner) == 1
    assert (winner[0].params["decode_tp"], winner[0].params["decode_worker_gpus"]) == ("1", "4")


def test_the_pipeline_steps_tp_outputs_are_tp_degrees(tuned):
    r, spec = tuned
    decision = TuneDecision("q", "1", None, "1", True, "first version of q")
    out = kfp_tune_outputs(TuneOutcome(r, spec, r.workload, "bf16", decision))
    assert (out.prefill_tp, out.decode_tp) == (spec.prefill.tp, spec.decode.tp) == (r.best.prefill.tp, 1)


def test_kv_capacity_metrics_say_whether_they_are_a_worker_or_one_engine(tuned, tmp_path):
    """The winner's decode worker holds all its DP ranks' KV; the spec's engine.kv_capacity_tokens is one engine
    (the smaller of one prefill and one decode DP rank): each is recorded under its own name."""
    from mlflow.tracking import MlflowClient

    r, spec = tuned
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reg = register_tuning(r, spec, tracking_uri=uri, registered_model="q")
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    run_id = client.get_model_version("q", reg.decision.registered_version).run_id
    metrics = client.get_run(run_id).data.metrics
    assert "best_kv_capacity_tokens" not in metrics
    assert metrics["best_decode_worker_kv_capacity_tokens"] == r.best.kv_capacity_tokens
    assert metrics["best_engine_kv_capacity_tokens"] == spec.engine.kv_capacity_tokens == r.engine_kv_capacity_tokens
    assert spec.engine.kv_capacity_tokens <= r.best.kv_capacity_tokens // 4  # DP4: one rank of four
