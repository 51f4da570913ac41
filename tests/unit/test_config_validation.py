"""DeploymentSpec refuses at the edge what the runtime would only reject after its workers started.

Invariants: no float field accepts Infinity or NaN (JSON cannot carry them back); planner.predictor names a
registered predictor; every pool starts within its planner bounds; model.name is a clean relative name;
every top-level field documents itself in the JSON schema.
"""

import pytest
from pydantic import ValidationError

from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, PoolSpec
from runtime.planner.predictors import PREDICTORS


def _float_fields():
    """(section, field) of every float-typed field of the spec tree, read from the JSON schema."""
    schema = DeploymentSpec.model_json_schema()
    defs = schema["$defs"]
    out = []
    for section, prop in schema["properties"].items():
        ref = prop.get("$ref") or next((a["$ref"] for a in prop.get("allOf", []) if "$ref" in a), None)
        if not ref:
            continue
        for name, f in defs[ref.rsplit("/", 1)[1]]["properties"].items():
            types = {f.get("type")} | {a.get("type") for a in f.get("anyOf", [])}
            if "number" in types:
                out.append((section, name))
    return out


FLOAT_FIELDS = _float_fields()


def test_the_float_field_list_covers_every_section_with_floats():
    assert {s for s, _ in FLOAT_FIELDS} == {"slo", "workload", "engine", "router", "planner", "overload"}
    assert len(FLOAT_FIELDS) > 20


@pytest.mark.parametrize("section,field", FLOAT_FIELDS)
@pytest.mark.parametrize("literal,value", [("Infinity", float("inf")), ("-Infinity", float("-inf")),
                                           ("NaN", float("nan"))])
def test_non_finite_floats_are_refused_for_every_float_field(section, field, literal, value):
    text = '{"model": {"name": "m"}, "%s": {"%s": %s}}' % (section, field, literal)
    with pytest.raises(ValidationError, match=field):
        DeploymentSpec.model_validate_json(text)  # a spec file
    with pytest.raises(ValidationError, match=field):
        DeploymentSpec.model_validate({"model": {"name": "m"}, section: {field: value}})  # Python callers


def test_a_valid_spec_survives_the_json_round_trip():
    spec = DeploymentSpec(model=ModelRef(name="org/llama8"), planner=PlannerSpec(predictor="burst_quantile"))
    assert DeploymentSpec.model_validate_json(spec.model_dump_json()) == spec


def test_unknown_planner_predictor_is_refused_naming_the_choices():
    with pytest.raises(ValidationError, match=r"unknown planner\.predictor 'bogus'; choose one of \["):
        PlannerSpec(predictor="bogus")


@pytest.mark.parametrize("hold_s, ok", [(0.0, True), (600.0, True), (3600.0, True), (3601.0, False), (-1.0, False)])
def test_the_window_hold_is_refused_outside_zero_to_an_hour(hold_s, ok):
    # each tick replays the arrivals of the span: a day of them would cost the planner minutes per tick
    if ok:
        assert PlannerSpec(window_hold_s=hold_s).window_hold_s == hold_s
    else:
        with pytest.raises(ValidationError, match="window_hold_s"):
            PlannerSpec(window_hold_s=hold_s)


@pytest.mark.parametrize("name", sorted(PREDICTORS))
def test_every_registered_predictor_is_accepted(name):
    assert PlannerSpec(predictor=name).predictor == name


@pytest.mark.parametrize("pool", [dict(replicas=20, max_replicas=8), dict(replicas=1, min_replicas=3),
                                  dict(replicas=0, min_replicas=1)])
def test_replicas_outside_the_planner_bounds_are_refused(pool):
    with pytest.raises(ValidationError, match=r"replicas \d+ is outside \[min_replicas \d+, max_replicas \d+\]"):
        PoolSpec(**pool)


@pytest.mark.parametrize("pool", [dict(replicas=0, min_replicas=0), dict(replicas=8, max_replicas=8),
                                  dict(replicas=3, min_replicas=3, max_replicas=3)])
def test_replicas_on_the_bounds_are_accepted(pool):
    assert PoolSpec(**pool).replicas == pool["replicas"]


@pytest.mark.parametrize("mode", ["sla", "load"])
def test_planner_without_aggregated_serving_needs_a_prefill_minimum(mode):
    # prefill 0 workers = the decode workers prefill = aggregated serving, which the spec turned off
    pool = PoolSpec(replicas=1, min_replicas=0)
    with pytest.raises(ValidationError, match=r"prefill.min_replicas 0 .* planner.allow_aggregated is false"):
        DeploymentSpec(model=ModelRef(name="m"), prefill=pool, planner=PlannerSpec(mode=mode, allow_aggregated=False))
    assert DeploymentSpec(model=ModelRef(name="m"), prefill=pool,
                          planner=PlannerSpec(mode=mode, allow_aggregated=True)).prefill.min_replicas == 0
    # aggregated serving is off unless asked for
    with pytest.raises(ValidationError, match="allow_aggregated"):
        DeploymentSpec(model=ModelRef(name="m"), prefill=pool, planner=PlannerSpec(mode=mode))
    # no planner: the pool's size is what it was given, allow_aggregated plays no part
    off = DeploymentSpec(model=ModelRef(name="m"), prefill=PoolSpec(replicas=0, min_replicas=0),
                         planner=PlannerSpec(mode="off", allow_aggregated=False))
    assert off.prefill.replicas == 0


@pytest.mark.parametrize("name", ["", "..", "a/../b", "/abs", "a//b", "./m", "a\\b", "m\0"])
def test_empty_or_path_like_model_names_are_refused(name):
    with pytest.raises(ValidationError, match="model|name|least 1"):
        ModelRef(name=name)


@pytest.mark.parametrize("name", ["m with space", "m\tx", "-m", "m$(AWS_SECRET_ACCESS_KEY)", "org/ m"])
def test_model_names_the_renderer_cannot_deploy_are_refused_where_they_are_made(name):
    """The same names render_all refuses (container arguments): refused by the spec itself, so tune --out and
    stage cannot make what promote can never deploy."""
    from runtime.deploy.errors import ManifestError
    from runtime.deploy.render import render_all

    with pytest.raises(ValidationError, match="model.name"):
        ModelRef(name=name)
    spec = DeploymentSpec(model=ModelRef(name="m"))
    spec.model.name = name  # (assignment is not validated): the renderer's own check agrees
    with pytest.raises(ManifestError, match="spec.model.name"):
        render_all(spec, name="m", namespace="pdserve", image="img:1", pvc_name="fsx-claim", validate=False)


@pytest.mark.parametrize("name", ["m", "smollm2-135m-instruct", "meta-llama/Llama-3.1-8B"])
def test_plain_and_org_model_names_are_accepted(name):
    assert ModelRef(name=name).name == name


def test_every_top_level_field_has_a_description():
    props = DeploymentSpec.model_json_schema()["properties"]
    assert sorted(k for k, v in props.items() if not v.get("description")) == []


def test_a_drain_cap_below_the_kv_lease_is_refused_naming_both():
    # a draining prefill worker holds for its lease so that every handoff it made is read or expired
    from runtime.config import DEFAULT_KV_LEASE_S, DeploymentSpec, EngineSpec, ModelRef, PlannerSpec

    with pytest.raises(ValidationError, match=r"drain_cap_s \(20 s\) is below .* KV lease \(30 s"):
        DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(drain_cap_s=20))
    with pytest.raises(ValidationError, match=r"KV lease \(90 s"):
        DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(drain_cap_s=60), engine=EngineSpec(kv_lease_s=90))
    ok = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(drain_cap_s=12), engine=EngineSpec(kv_lease_s=12))
    assert ok.planner.drain_cap_s == 12 and DeploymentSpec(model=ModelRef(name="m")).planner.drain_cap_s > DEFAULT_KV_LEASE_S


def test_an_unknown_gpu_is_refused_by_the_spec_not_by_the_planner_once_it_runs():
    from pydantic import ValidationError

    from runtime.config import DeploymentSpec, ModelRef

    with pytest.raises(ValidationError, match=r"unknown GPU 'FOO'; known: .*H100-SXM"):
        DeploymentSpec(model=ModelRef(name="m"), gpu="FOO")
    assert DeploymentSpec(model=ModelRef(name="m"), gpu="CPU").gpu == "CPU"
