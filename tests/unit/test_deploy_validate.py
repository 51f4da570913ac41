"""Specification of runtime.deploy.validate: a broken object is rejected with Kind/name and field path."""

from __future__ import annotations

import copy
import json

import pytest

from runtime.config import DeploymentSpec, ModelRef, PoolSpec
from runtime.deploy import crd_schemas
from runtime.deploy.render import find, render_all
from runtime.deploy.validate import KUBERNETES_VERSION, ManifestError, validate_object, validate_objects

NAME = "smollm2"


@pytest.fixture(scope="module")
def objs():
    spec = DeploymentSpec(model=ModelRef(name="smollm2-135m-instruct"), prefill=PoolSpec(tp=1),
                          decode=PoolSpec(tp=2))
    return render_all(spec, name=NAME, namespace="pdserve", image="img:1", pvc_name="fsx-claim", validate=False)


def broken(objs, kind, name, mutate):
    obj = copy.deepcopy(find(objs, kind, name))
    mutate(obj)
    return obj


def test_rendered_objects_are_valid(objs):
    assert validate_objects(objs) == len(objs)
    assert validate_object(find(objs, "Deployment", f"{NAME}-prefill")) == f"kubernetes {KUBERNETES_VERSION}"
    assert "kserve" in validate_object(find(objs, "InferenceService", NAME))


def test_unknown_field_in_inference_service_is_named(objs):
    def typo(o):
        m = o["spec"]["predictor"]["model"]
        m["storageURI"] = m.pop("storageUri")
    with pytest.raises(ManifestError) as e:
        validate_object(broken(objs, "InferenceService", NAME, typo))
    assert str(e.value).startswith(f"InferenceService/{NAME}: spec.predictor.model.storageURI:")


def test_wrong_type_in_inference_service_is_named(objs):
    def as_string(o):
        o["spec"]["predictor"]["canaryTrafficPercent"] = "10"
    with pytest.raises(ManifestError, match=r"InferenceService/smollm2: spec\.predictor\.canaryTrafficPercent: "):
        validate_object(broken(objs, "InferenceService", NAME, as_string))


def test_cluster_serving_runtime_requires_containers(objs):
    with pytest.raises(ManifestError, match=r"ClusterServingRuntime/pdserve: spec\.containers: .*required"):
        validate_object(broken(objs, "ClusterServingRuntime", "pdserve", lambda o: o["spec"].pop("containers")))


def test_servicemonitor_enum_is_checked(objs):
    def bad_scheme(o):
        o["spec"]["endpoints"][0]["scheme"] = "ftp"
    with pytest.raises(ManifestError, match=r"ServiceMonitor/smollm2-workers: spec\.endpoints\[0\]\.scheme: "):
        validate_object(broken(objs, "ServiceMonitor", f"{NAME}-workers", bad_scheme))


def test_builtin_kind_wrong_type_is_named(objs):
    def replicas(o):
        o["spec"]["replicas"] = "two"
    with pytest.raises(ManifestError, match=r"^Deployment/smollm2-prefill: spec\.replicas: "):
        validate_object(broken(objs, "Deployment", f"{NAME}-prefill", replicas))


def test_builtin_kind_unknown_field_is_rejected_strictly(objs):
    def gpus(o):
        o["spec"]["template"]["spec"]["containers"][0]["gpus"] = 2
    with pytest.raises(ManifestError, match=r"spec\.template\.spec\.containers\[0\]\.gpus: "):
        validate_object(broken(objs, "Deployment", f"{NAME}-decode", gpus))


def test_builtin_kind_missing_required_field_is_named(objs):
    with pytest.raises(ManifestError, match=r"Deployment/smollm2-decode: spec\.selector: "):
        validate_object(broken(objs, "Deployment", f"{NAME}-decode", lambda o: o["spec"].pop("selector")))


def test_custom_resource_name_must_be_dns_subdomain(objs):
    def upper(o):
        o["metadata"]["name"] = "Smollm2"
    with pytest.raises(ManifestError, match=r"InferenceService/Smollm2: metadata\.name: "):
        validate_object(broken(objs, "InferenceService", NAME, upper))


def test_unknown_kind_is_an_error_not_a_silent_pass():
    obj = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    with pytest.raises(ManifestError, match=r"Widget/w: apiVersion example.com/v1 kind Widget: no schema"):
        validate_object(obj)


def test_duplicates_and_non_mappings_are_rejected(objs):
    with pytest.raises(ManifestError, match="duplicate"):
        validate_objects([objs[0], copy.deepcopy(objs[0])])
    with pytest.raises(ManifestError, match="not a mapping"):
        validate_object(["not", "an", "object"])  # type: ignore[arg-type]
    with pytest.raises(ManifestError, match="apiVersion and kind"):
        validate_object({"metadata": {"name": "x"}})


def test_vendored_schemas_carry_source_and_version_and_stay_small():
    kinds = {k for _, k in crd_schemas.known_kinds()}
    assert {"InferenceService", "ClusterServingRuntime", "NodePool", "EC2NodeClass", "ServiceMonitor"} <= kinds
    for p in crd_schemas.SCHEMA_DIR.glob("*.json"):
        assert p.stat().st_size < 1_000_000, p
        rec = json.loads(p.read_text())
        assert rec["source"] and rec["source_version"] and rec["openAPIV3Schema"]["type"] == "object"


def test_vendoring_a_crd_keeps_each_served_versions_schema_and_its_source(tmp_path):
    import yaml

    schema = {"type": "object", "properties": {"spec": {"type": "object", "required": ["size"],
                                                        "properties": {"size": {"type": "integer"}}}}}
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "spec": {"group": "example.dev", "names": {"kind": "Widget"}, "scope": "Namespaced",
                    "versions": [{"name": "v1", "served": True, "schema": {"openAPIV3Schema": schema}},
                                 {"name": "v0", "served": False, "schema": {"openAPIV3Schema": {}}}]}}
    src = tmp_path / "crd.yaml"
    src.write_text(yaml.safe_dump(crd))
    (written,) = crd_schemas.vendor(src, source="example CRD", source_version="1.0", out_dir=tmp_path)
    rec = json.loads(written.read_text())
    assert written.name == "example.dev_v1_widget.json"  # the unserved v0 is left out
    assert (rec["kind"], rec["source"], rec["source_version"]) == ("Widget", "example CRD", "1.0")
    assert rec["openAPIV3Schema"] == schema


def test_cached_builtin_validation_agrees_with_kubernetes_validate(objs):
    import kubernetes_validate

    dep = find(objs, "Deployment", f"{NAME}-decode")
    assert kubernetes_validate.validate(dep, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
    bad = broken(objs, "Deployment", f"{NAME}-decode", lambda o: o["spec"].update(replicas="two"))
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    with pytest.raises(ManifestError):
        validate_object(bad)
