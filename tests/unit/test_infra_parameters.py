"""Every name Terraform decides reaches the manifests through infra/k8s/values/cluster.env
(`terraform output -raw cluster_env`): a cluster with another `cluster_name` and other bucket names gets manifests
that carry its names and none of the committed example's; a name written into a manifest instead is reported.
MLflow's database URI is built from the RDS-managed secret at start (infra/k8s/mlflow/start_mlflow.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
V = load_script("infra/validate.py")
needs_kubectl = pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl not installed")

# What only AWS knows at apply time, for a second cluster.
ATTRIBUTES = {
    "aws_fsx_lustre_file_system.models.id": "fs-0fedcba9876543210",
    "aws_fsx_lustre_file_system.models.dns_name": "fs-0fedcba9876543210.fsx.eu-west-1.amazonaws.com",
    "aws_fsx_lustre_file_system.models.mount_name": "zyxwvuts",
    "module.vpc.private_subnets[0]": "subnet-0fedcba9876543210",
    "aws_security_group.fsx.id": "sg-0fedcba9876543210",
    "aws_db_instance.mlflow.endpoint": "acme-prod-mlflow.zzzz.eu-west-1.rds.amazonaws.com:5432",
    "aws_db_instance.mlflow.master_user_secret[0].secret_arn":
        "arn:aws:secretsmanager:eu-west-1:210987654321:secret:rds!db-11111111-2222-3333-4444-555555555555-XyZ",
}
VARIABLES = {"cluster_name": "acme-prod", "region": "eu-west-1", "model_bucket_name": "acme-prod-weights",
             "artifact_bucket_name": "acme-prod-mlflow-artifacts"}


@pytest.fixture(scope="module")
def parsed():
    return V.check_terraform_hcl(REPO)[1]


@pytest.fixture
def tree(tmp_path):
    shutil.copytree(REPO / "infra", tmp_path / "infra", ignore=shutil.ignore_patterns(".terraform*", "__pycache__"))
    shutil.copytree(REPO / "kserve", tmp_path / "kserve")
    return tmp_path


def _objs(built, kind, name=None):
    return [o for objs in built.values() for o in objs
            if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def test_committed_values_have_the_terraform_outputs_keys_and_all_land(parsed):
    assert list(V.read_env(REPO / V.CLUSTER_ENV)) == list(V.cluster_env_template(parsed))
    res = V.check_parameters(REPO, parsed)
    assert res.status in (("PASS",) if shutil.which("kubectl") else ("SKIP",)), res.detail


def test_terraform_output_follows_cluster_name_and_bucket_names(parsed):
    env = V.evaluate_cluster_env(parsed, VARIABLES, ATTRIBUTES)
    assert env["CLUSTER_NAME"] == "acme-prod"
    assert env["KARPENTER_NODE_ROLE"] == "acme-prod-karpenter-node"  # karpenter.tf node_iam_role_name
    assert env["MLFLOW_ARTIFACTS_DESTINATION"] == "s3://acme-prod-mlflow-artifacts/mlflow"
    assert env["AWS_REGION"] == "eu-west-1"
    with pytest.raises(KeyError, match="aws_fsx_lustre_file_system.models.id"):
        V.evaluate_cluster_env(parsed, VARIABLES, {})


@needs_kubectl
def test_every_manifest_follows_another_cluster_and_keeps_no_stale_name(parsed):
    env = V.evaluate_cluster_env(parsed, VARIABLES, ATTRIBUTES)
    built = V.offline_build(REPO, env=env)
    committed = V.read_env(REPO / V.CLUSTER_ENV)
    assert V.parameter_problems(built, env, stale=committed) == []
    (nc,) = _objs(built, "EC2NodeClass")
    assert nc["spec"]["role"] == "acme-prod-karpenter-node"
    tags = [t["tags"]["karpenter.sh/discovery"] for t in nc["spec"]["subnetSelectorTerms"]
            + nc["spec"]["securityGroupSelectorTerms"]]
    assert tags == ["acme-prod", "acme-prod"]
    pvs = _objs(built, "PersistentVolume")
    assert len(pvs) == 3  # pdserve, kubeflow, the profile's
    for pv in pvs:
        assert pv["spec"]["csi"]["volumeHandle"] == "fs-0fedcba9876543210"
        assert pv["spec"]["csi"]["volumeAttributes"] == {"dnsname": ATTRIBUTES[
            "aws_fsx_lustre_file_system.models.dns_name"], "mountname": "zyxwvuts"}
    (dep,) = _objs(built, "Deployment", "mlflow")
    envs = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert envs["MLFLOW_ARTIFACTS_DESTINATION"] == "s3://acme-prod-mlflow-artifacts/mlflow"
    assert envs["MLFLOW_DB_SECRET_ARN"] == ATTRIBUTES["aws_db_instance.mlflow.master_user_secret[0].secret_arn"]
    assert envs["MLFLOW_DB_ENDPOINT"].startswith("acme-prod-mlflow.")
    assert not _objs(built, "ConfigMap", "pdserve-cluster-values")  # local-config: used, not applied
    assert not _objs(built, "Secret")  # no Kubernetes Secret carries the database password


ROLE_TARGET = """      - select:
          kind: EC2NodeClass
        fieldPaths:
          - spec.role
"""
VALUES = "infra/k8s/values/kustomization.yaml"


def _edit(root: Path, path: str, old: str, new: str) -> None:
    f = root / path
    assert old in f.read_text(), (old, path)
    f.write_text(f.read_text().replace(old, new, 1))


@needs_kubectl
@pytest.mark.parametrize("edits,expect", [
    # a replacement target dropped: the manifest keeps the key
    ([(VALUES, ROLE_TARGET, ROLE_TARGET.replace("EC2NodeClass", "NodeClass"))],
     "spec.role is still the placeholder KARPENTER_NODE_ROLE"),
    # ... or a name written in its place
    ([(VALUES, ROLE_TARGET, ROLE_TARGET.replace("EC2NodeClass", "NodeClass")), ("infra/k8s/karpenter/ec2nodeclass.yaml", "role: KARPENTER_NODE_ROLE",
                                  "role: pdserve-karpenter-node")],
     "role 'pdserve-karpenter-node' != KARPENTER_NODE_ROLE 'acme-prod-karpenter-node'"),
    ([(VALUES, "          - spec.securityGroupSelectorTerms.*.tags.[karpenter.sh/discovery]\n", "")],
     "karpenter.sh/discovery 'CLUSTER_NAME' != CLUSTER_NAME 'acme-prod'"),
    # a name of the committed example written where no replacement reaches
    ([("infra/k8s/mlflow/deployment.yaml", "            - --serve-artifacts\n",
       "            - --serve-artifacts\n            - --artifacts-destination=s3://example-pdserve-mlflow/mlflow\n")],
     "holds MLFLOW_ARTIFACTS_DESTINATION of another cluster ('s3://example-pdserve-mlflow/mlflow')"),
    ([("infra/k8s/storage/pv.yaml", "  name: pdserve-models-fsx\n",
       "  name: pdserve-models-fsx\n  labels:\n    fsx: fs-0123456789abcdef0\n")],
     "holds FSX_FILE_SYSTEM_ID of another cluster"),
])
def test_a_name_not_taken_from_the_values_is_reported(tree, parsed, edits, expect):
    for path, old, new in edits:
        _edit(tree, path, old, new)
    env = V.evaluate_cluster_env(parsed, VARIABLES, ATTRIBUTES)
    problems = V.parameter_problems(V.offline_build(tree, env=env), env, stale=V.read_env(REPO / V.CLUSTER_ENV))
    assert any(expect in p for p in problems), problems


@needs_kubectl
def test_a_replacement_into_a_missing_field_fails_the_build(tree, parsed):
    _edit(tree, VALUES, "          - spec.csi.volumeAttributes.dnsname\n", "          - spec.csi.volumeAttributes.dns\n")
    res = V.check_parameters(tree, parsed)
    assert res.status == "FAIL" and "unable to find field" in res.detail, res.detail


@needs_kubectl
def test_a_value_that_lands_nowhere_is_reported(tree, parsed):
    _edit(tree, "infra/k8s/mlflow/deployment.yaml", "            - name: AWS_REGION\n              value: AWS_REGION\n", "")
    text = (tree / VALUES).read_text()
    i = text.index("  - source:\n      kind: ConfigMap\n      name: pdserve-cluster-values\n      fieldPath: data.AWS_REGION")
    j = text.find("  - source:", i + 1)
    (tree / VALUES).write_text(text[:i] + (text[j:] if j > 0 else ""))
    res = V.check_parameters(tree, parsed)
    assert res.status == "FAIL" and "AWS_REGION of infra/k8s/values/cluster.env lands in no manifest" in res.detail


def test_values_file_without_a_key_of_the_terraform_output_fails(tree):
    f = tree / V.CLUSTER_ENV
    f.write_text("".join(line for line in f.read_text().splitlines(True) if not line.startswith("AWS_REGION=")))
    res = V.check_parameters(tree, V.check_terraform_hcl(tree)[1])
    assert res.status == "FAIL" and "keys" in res.detail and "AWS_REGION" in res.detail


START = load_script("infra/k8s/mlflow/start_mlflow.py")


def test_mlflow_database_uri_from_the_rds_secret_quotes_user_and_password():
    secret = json.dumps({"username": "mlflow", "password": "p@ss:w/rd%?#"})
    uri = START.backend_store_uri(secret, "db.example:5432", "mlflow")
    assert uri == "postgresql://mlflow:p%40ss%3Aw%2Frd%25%3F%23@db.example:5432/mlflow"
    from sqlalchemy.engine import make_url

    url = make_url(uri)  # what MLflow's SQLAlchemy store parses
    assert (url.username, url.password, url.host, url.port, url.database) == (
        "mlflow", "p@ss:w/rd%?#", "db.example", 5432, "mlflow")


@pytest.mark.parametrize("secret", ["not json", "[]", '{"username": "u"}', '{"username": "", "password": "p"}'])
def test_mlflow_database_secret_without_credentials_is_refused(secret):
    with pytest.raises(ValueError, match="secret"):
        START.backend_store_uri(secret, "db:5432", "mlflow")


def test_the_mlflow_pod_runs_the_start_script_it_mounts():
    import yaml

    dep = yaml.safe_load((REPO / "infra/k8s/mlflow/deployment.yaml").read_text())
    c = dep["spec"]["template"]["spec"]["containers"][0]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "start")
    assert c["command"] == ["python", f"{mount['mountPath']}/start_mlflow.py"]
    kust = yaml.safe_load((REPO / "infra/k8s/mlflow/kustomization.yaml").read_text())
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "start")
    assert {"name": vol["configMap"]["name"], "files": ["start_mlflow.py"]}.items() <= kust["configMapGenerator"][0].items()
