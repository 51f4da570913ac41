"""The compiled KFP pipeline: every step mounts the FSx claim the `pvc_name` parameter names (the
InferenceService rendered by promote uses that parameter too, so the two can never point at different
claims), at the /fsx path the steps read."""

from __future__ import annotations

import pytest
import yaml

pytest.importorskip("kfp")

from pipelines.stage_tune_promote import FSX_MOUNT, compile_pipeline  # noqa: E402


def test_every_step_mounts_the_claim_named_by_the_pvc_name_parameter(tmp_path):
    docs = list(yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml").read_text()))
    platform = next(d for d in docs if "platforms" in d)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == {"exec-stage-weights", "exec-tune-tp", "exec-promote"}
    for name, ex in executors.items():
        (mount,) = ex["pvcMount"]
        assert mount["mountPath"] == FSX_MOUNT, name
        assert mount["pvcNameParameter"] == {"componentInputParameter": "pvc_name"}, name


def _root_and_dag(tmp_path):
    doc = next(yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml").read_text()))
    return doc["root"]["inputDefinitions"]["parameters"], doc["root"]["dag"]["tasks"]


def test_gpu_budget_and_precision_defaults_match_pdserve_tune(tmp_path):
    from runtime.config import PlannerSpec

    params, tasks = _root_and_dag(tmp_path)
    assert params["gpu_budget"]["defaultValue"] == PlannerSpec.model_fields["gpu_budget"].default
    assert params["precision"]["defaultValue"] == "auto"  # the checkpoint's own, as `pdserve tune`'s default
    tune_inputs = tasks["tune-tp"]["inputs"]["parameters"]
    assert tune_inputs["gpu_budget"] == {"componentInputParameter": "gpu_budget"}


def test_parameters_are_validated_before_staging(tmp_path):
    _, tasks = _root_and_dag(tmp_path)
    assert tasks["stage-weights"]["dependentTasks"] == ["validate-parameters"]
    checked = set(tasks["validate-parameters"]["inputs"]["parameters"])
    assert checked >= {"model_name", "gpu", "precision", "ttft_p90_ms", "itl_p90_ms", "isl_tokens", "osl_tokens",
                       "request_rate_per_s", "gpu_budget", "registered_model"}
    assert not tasks["validate-parameters"].get("dependentTasks")


def test_traffic_trace_uri_reaches_validate_and_tune_and_the_rate_defaults_to_not_chosen(tmp_path):
    from pipelines.stage_tune_promote import S3_SECRET
    from runtime.usecases.tune import AUTO_REQUEST_RATE

    params, tasks = _root_and_dag(tmp_path)
    assert params["traffic_trace_uri"]["defaultValue"] == ""  # no trace: isl_tokens/osl_tokens as before
    assert params["request_rate_per_s"]["defaultValue"] == AUTO_REQUEST_RATE == 0.0  # the trace's rate, else 10/s
    for task in ("validate-parameters", "tune-tp"):
        inputs = tasks[task]["inputs"]["parameters"]
        assert inputs["traffic_trace_uri"] == {"componentInputParameter": "traffic_trace_uri"}, task
        assert inputs["fsx_root"] == {"componentInputParameter": "fsx_root"}, task
    assert tasks["tune-tp"]["inputs"]["parameters"]["s3_endpoint_url"] == {"componentInputParameter": "s3_endpoint_url"}
    docs = list(yaml.safe_load_all(compile_pipeline(tmp_path / "p2.yaml").read_text()))
    executors = next(d for d in docs if "platforms" in d)["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    secrets = {s.get("secretName") or s.get("secretNameParameter", {}).get("runtimeValue", {}).get("constant")
               for s in executors["exec-tune-tp"]["secretAsEnv"]}
    assert S3_SECRET in secrets  # an s3:// trace is read with the staging step's credentials


def test_traffic_upload_uri_reaches_validate_and_promote(tmp_path):
    params, tasks = _root_and_dag(tmp_path)
    assert params["traffic_upload_uri"]["defaultValue"] == ""  # off: the endpoint records nothing
    for task in ("validate-parameters", "promote"):
        inputs = tasks[task]["inputs"]["parameters"]
        assert inputs["traffic_upload_uri"] == {"componentInputParameter": "traffic_upload_uri"}, task


def _validate(**kw):
    from runtime.usecases.validate import ValidateRequest, validate

    base = dict(model_name="m", gpu="H100-SXM", precision="auto", ttft_p90_ms=2000.0, itl_p90_ms=50.0, isl_tokens=3000,
                osl_tokens=150, request_rate_per_s=0.0, gpu_budget=64, registered_model="m-pd")
    return validate(ValidateRequest(**(base | kw)))


def test_a_bad_traffic_upload_uri_fails_validation_with_the_other_problems():

    with pytest.raises(ValueError) as e:
        _validate(gpu="H100-SMX", traffic_upload_uri="s3://pdserve-traffic/online")
    msg = str(e.value)
    assert "traffic_upload_uri 's3://pdserve-traffic/online'" in msg and "must end in '/'" in msg
    assert "H100-SMX" in msg  # named together with the other bad parameter
    _validate(traffic_upload_uri="s3://pdserve-traffic/online/")


def test_planner_mode_reaches_validate_and_tune_and_a_bad_one_fails_validation(tmp_path):
    params, tasks = _root_and_dag(tmp_path)
    assert params["planner_mode"]["defaultValue"] == "off"
    for task in ("validate-parameters", "tune-tp"):
        assert tasks[task]["inputs"]["parameters"]["planner_mode"] == {"componentInputParameter": "planner_mode"}
    with pytest.raises(ValueError, match="planner_mode: must be one of off, sla, load, got 'auto'"):
        _validate(planner_mode="auto")


def _definitions(node: dict) -> dict:
    """name -> definition of every input and output parameter / artifact of a compiled component or root."""
    out = {}
    for side in ("inputDefinitions", "outputDefinitions"):
        for kind in ("parameters", "artifacts"):
            out.update({f"{side}.{name}": d for name, d in node.get(side, {}).get(kind, {}).items()})
    return out


def test_every_pipeline_and_component_parameter_has_its_description_for_the_kfp_ui(tmp_path):
    from components.params import PARAM_DOCS

    doc = next(yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml").read_text()))
    root = doc["root"]["inputDefinitions"]["parameters"]
    assert {n: d.get("description") for n, d in root.items()} == {n: PARAM_DOCS[n] for n in root}
    checked = 0
    for comp_name, comp in doc["components"].items():
        for name, d in _definitions(comp).items():
            assert d.get("description"), f"{comp_name} {name}: no description"
            checked += 1
    assert checked >= 45
    assert doc["components"]["comp-tune-tp"]["outputDefinitions"]["parameters"]["decode_tp"]["description"] == \
        PARAM_DOCS["decode_tp"]
    # the components still embed their own source, without the decorator (KFP drops decorator lines)
    for ex in doc["deploymentSpec"]["executors"].values():
        assert "@documented" not in " ".join(ex["container"]["command"])


def test_documented_names_the_parameters_it_has_no_description_for():
    from components.params import documented

    def step(gpu: str, warp_factor: int, flux: float = 1.0):
        """A step."""

    with pytest.raises(KeyError, match="step: no description for parameter.s. warp_factor, flux"):
        documented(step)
    assert documented(step, warp_factor="w", flux="f") is step
    assert "Args:\n    gpu: GPU catalog name" in step.__doc__ and "    flux: f" in step.__doc__
