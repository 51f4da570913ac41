"""Operator overrides that reach the spec and the tuner's cost: an explicit max_model_len within what vLLM
starts with, GPU prices replacing the on-demand ones (they decide champions across GPU types), and the vLLM
flags pdserve sets itself, which `--engine-arg` may not repeat (runtime/engines/engine_args.py RESERVED).
The `--engine-arg` checks against vLLM's own parser are in tests/integration/test_engine_args_vllm.py."""

from __future__ import annotations

import json

import pytest

from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, PoolSpec, SloSpec, WorkloadSpec
from runtime.deploy.target import ClusterTarget
from runtime.deploy.workers import precision_args, vllm_args
from runtime.engines.engine_args import RESERVED, with_engine_overrides
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.modelfiles.load import load_model_spec
from runtime.perf.instances import parse_price_file, parse_price_overrides, usd_per_gpu_hour
from runtime.tuner.champion import champion_perf, evaluate_deployment
from runtime.tuner.search import tune

SLO = SloSpec(ttft_p90_ms=5000, itl_p90_ms=200)
WORKLOAD = WorkloadSpec(isl_tokens=2000, osl_tokens=200, request_rate_per_s=1)


@pytest.fixture(scope="module")
def llama70b_h100():
    # Llama-3.1-70B: 131072-token context; on H100 the winner's prefill worker holds fewer KV tokens than that
    return tune(load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json"), "H100-SXM", SLO, WORKLOAD)


def test_derived_max_model_len_is_the_context_capped_by_kv(llama70b_h100):
    r = llama70b_h100
    derived = r.max_model_len_tokens()
    assert 2200 <= derived < r.model.max_context_tokens == 131072
    assert r.to_deployment_spec(ModelRef(name="m")).engine.max_model_len_tokens == derived


def test_an_explicit_max_model_len_reaches_the_spec_and_the_worker_args(llama70b_h100):
    spec = llama70b_h100.to_deployment_spec(ModelRef(name="m"), max_model_len_tokens=4096)
    assert spec.engine.max_model_len_tokens == 4096
    args = vllm_args(spec, spec.decode, target=ClusterTarget(), gpu=True, efa=False)
    assert args[args.index("--max-model-len") + 1] == "4096"


@pytest.mark.parametrize("value,needle", [
    (2199, "< the workload's ISL + OSL (2200 tokens)"),
    (200_000, "> the model's context window (131072 tokens)"),
    (0, "positive number of tokens"),
    (True, "positive number of tokens"),
])
def test_a_max_model_len_vllm_would_refuse_or_that_refuses_the_workload_is_refused(llama70b_h100, value, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        llama70b_h100.to_deployment_spec(ModelRef(name="m"), max_model_len_tokens=value)


def test_a_max_model_len_beyond_one_workers_kv_capacity_is_refused(llama70b_h100):
    derived = llama70b_h100.max_model_len_tokens()  # capped by KV here, not by the context
    assert llama70b_h100.max_model_len_tokens(derived) == derived
    with pytest.raises(ValueError, match=r"KV capacity of one worker \(\d+ tokens"):
        llama70b_h100.max_model_len_tokens(derived + 1)


def _spec(**kw):
    return DeploymentSpec(model=ModelRef(name="m"), gpu="H100-SXM", prefill=PoolSpec(tp=1, replicas=1),
                          decode=PoolSpec(tp=1, replicas=1), workload=WORKLOAD, **kw)


def test_an_existing_spec_takes_a_max_model_len_override_without_touching_the_rest():
    spec = _spec()
    out = with_engine_overrides(spec, max_model_len_tokens=8192)
    assert out.engine.max_model_len_tokens == 8192 and spec.engine.max_model_len_tokens != 8192
    assert out.model_dump(exclude={"engine"}) == spec.model_dump(exclude={"engine"})
    assert with_engine_overrides(spec) is spec
    with pytest.raises(ValueError, match="ISL \\+ OSL"):
        with_engine_overrides(spec, max_model_len_tokens=100)


def test_promote_holds_max_model_len_to_the_context_tune_recorded_when_the_folder_is_unreadable(
        llama70b_h100, tmp_path):
    from runtime.usecases.promote import _model_context

    spec = llama70b_h100.to_deployment_spec(ModelRef(name="m", path=str(tmp_path / "on-the-cluster-only")))
    assert spec.model.context_tokens == 131072  # tune read it from config.json
    assert _model_context(spec) == 131072
    with pytest.raises(ValueError, match=r"> the model's context window \(131072 tokens\)"):
        with_engine_overrides(spec, max_model_len_tokens=200_000, context_tokens=_model_context(spec))
    assert _model_context(spec.model_copy(update={"model": spec.model.model_copy(
        update={"context_tokens": 0})})) is None  # a spec recorded without it: unchecked, as vLLM will check


def test_promote_refuses_a_max_model_len_beyond_the_kv_capacity_tune_recorded(llama70b_h100):
    spec = llama70b_h100.to_deployment_spec(ModelRef(name="m"))
    cap = spec.engine.kv_capacity_tokens
    assert cap == spec.engine.max_model_len_tokens < 131072  # the derived limit is the KV's here
    assert with_engine_overrides(spec, max_model_len_tokens=cap).engine.max_model_len_tokens == cap
    with pytest.raises(ValueError, match=rf"> the KV capacity of one engine \({cap} tokens"):
        with_engine_overrides(spec, max_model_len_tokens=cap + 1, context_tokens=131072)
    # a spec recorded without it (0): unchecked here, as vLLM will check
    unknown = spec.model_copy(update={"engine": spec.engine.model_copy(update={"kv_capacity_tokens": 0})})
    assert with_engine_overrides(unknown, max_model_len_tokens=cap + 1).engine.max_model_len_tokens == cap + 1


def test_every_flag_pdserve_renders_is_reserved_from_engine_args():
    spec = _spec(precision="fp8", planner=PlannerSpec(mode="off"))
    for gpu, efa in ((True, True), (False, False)):
        for role in ("prefill", "decode"):
            args = vllm_args(spec, spec.prefill, target=ClusterTarget(), gpu=gpu, efa=efa, role=role)
            own = set(precision_args(spec, gpu=gpu))  # fp8 flags: engine args may replace them (documented)
            flags = {a[2:].split("=", 1)[0] for a in args if a.startswith("--") and a not in own}
            assert flags <= RESERVED.keys(), flags - RESERVED.keys()


def test_price_overrides_take_gpu_names_and_aliases():
    assert parse_price_overrides(["H100-SXM=3.2", "l40s=1.5", "H100-SXM=2.9"]) == {"H100-SXM": 2.9, "L40S": 1.5}
    assert usd_per_gpu_hour("H100-SXM", 2, {"H100-SXM": 2.9}) == 2.9
    assert usd_per_gpu_hour("H100-SXM", 2, {"L40S": 1.5}) == usd_per_gpu_hour("H100-SXM", 2)
    assert usd_per_gpu_hour("GH200") is None and usd_per_gpu_hour("GH200", 1, {"GH200": 3.0}) == 3.0


@pytest.mark.parametrize("items,needle", [
    (["H100-SXM"], "expected GPU=USD_PER_GPU_HOUR"),
    (["=3"], "expected GPU=USD_PER_GPU_HOUR"),
    (["H900=3"], "H900"),
    (["H100-SXM=cheap"], "must be a number"),
    (["H100-SXM=-1"], ">= 0"),
    (["H100-SXM=nan"], "finite"),
])
def test_bad_price_overrides_are_refused(items, needle):
    with pytest.raises(ValueError, match=needle):
        parse_price_overrides(items)


def test_a_price_file_is_json_or_yaml():
    assert parse_price_file(json.dumps({"H100-SXM": 3.2, "A10G": 0.6})) == {"H100-SXM": 3.2, "A10G": 0.6}
    assert parse_price_file("H200-SXM: 4.1\nL4: 0.5\n") == {"H200-SXM": 4.1, "L4": 0.5}
    for text, needle in (("[1, 2]", "expected a mapping"), ("", "expected a mapping"), ("{a: [", "not JSON or YAML"),
                         ("H100-SXM: 1\nh100-sxm: 2\n", "priced twice"), ("H100-SXM: yes", "must be a number")):
        with pytest.raises(ValueError, match=needle):
            parse_price_file(text, "prices.yaml")


def test_prices_decide_the_tuners_cost_and_the_champions(llama70b_h100):
    base = llama70b_h100.best
    model = llama70b_h100.model
    on_demand = usd_per_gpu_hour("H100-SXM", base.prefill_tp)
    cheap = tune(model, "H100-SXM", SLO, WORKLOAD, prices={"H100-SXM": on_demand / 2})
    assert cheap.best.label == base.label  # the price scales the cost; it does not change the physics
    assert cheap.best.usd_per_mtok == pytest.approx(base.usd_per_mtok / 2)
    spec = llama70b_h100.to_deployment_spec(ModelRef(name="m"))
    perf = champion_perf(model, spec)
    champ = evaluate_deployment(perf, spec, SLO, WORKLOAD, 64)
    champ_cheap = evaluate_deployment(perf, spec, SLO, WORKLOAD, 64, prices={"H100-SXM": on_demand / 2})
    assert champ_cheap.usd_per_mtok == pytest.approx(champ.usd_per_mtok / 2)


@pytest.mark.parametrize("item", ["hf-token=hf_SECRET789", "api-key=sk-SECRET789"])
def test_an_engine_argument_that_carries_a_credential_is_refused_without_showing_it(item):
    from runtime.engines.engine_args import engine_arg_flags

    with pytest.raises(ValueError, match="a credential") as e:
        engine_arg_flags([item])
    assert "SECRET" not in str(e.value)


def test_engine_args_cannot_change_what_the_precision_sized():
    """The tuner sized weights and KV for the spec's precision: quantization is pdserve's, and a KV cache dtype
    of another width would make the recorded KV capacity (and the planner's batch) wrong."""
    with pytest.raises(ValueError, match=r"pdserve sets --quantization itself"):
        with_engine_overrides(_spec(precision="fp8"), engine_args=["quantization=awq"])
    with pytest.raises(ValueError, match=r"tuned for precision fp8 \(1-byte.*auto stores 2-byte"):
        with_engine_overrides(_spec(precision="fp8"), engine_args=["kv-cache-dtype=auto"])
    with pytest.raises(ValueError, match=r"tuned for precision bf16 \(2-byte.*fp8 stores 1-byte"):
        with_engine_overrides(_spec(), engine_args=["kv-cache-dtype=fp8"])
    with pytest.raises(ValueError, match=r"sizes KV caches of 1 or 2 bytes"):
        with_engine_overrides(_spec(precision="fp8"), engine_args=["kv-cache-dtype=nvfp4"])
    same_width = with_engine_overrides(_spec(precision="fp8"), engine_args=["kv-cache-dtype=fp8_e5m2"])
    assert same_width.engine.extra_args == ["--kv-cache-dtype=fp8_e5m2"]
