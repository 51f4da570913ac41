"""FSx for Lustre as infra/ sets it up is usable: the FSx CSI driver can create a file system through the
StorageClass (it refuses one without the subnet and security groups to put it in), and the file system's security
group lets its file servers reach each other on every Lustre port."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"
V = load_script("infra/validate.py")

# StorageClass parameters the FSx CSI driver requires for dynamic provisioning (kubernetes-sigs/aws-fsx-csi-driver,
# docs/options.md "Common Parameters": Required: Yes); CreateFileSystem has nowhere to put the file system without.
FSX_CSI_REQUIRED_PARAMETERS = ("subnetId", "securityGroupIds")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_fsx_storage_class_names_where_to_create_the_file_system():
    parsed = V.check_terraform_hcl(REPO)[1]
    template = V.cluster_env_template(parsed)
    fs = V._tf_blocks(parsed, "resource", "aws_fsx_lustre_file_system")["models"]
    classes = [d for d in _docs(K8S / "storage" / "storageclass.yaml")
               if d["kind"] == "StorageClass" and d["provisioner"] == "fsx.csi.aws.com"]
    assert classes
    replaced = {}  # placeholder key -> fieldPaths of StorageClass it is replaced into
    for r in _docs(K8S / "values" / "kustomization.yaml")[0]["replacements"]:
        key = r["source"]["fieldPath"].removeprefix("data.")
        for t in r["targets"]:
            if t["select"].get("kind") == "StorageClass":
                replaced.setdefault(key, []).extend(t["fieldPaths"])
    for sc in classes:
        params = sc["parameters"]
        for name in FSX_CSI_REQUIRED_PARAMETERS:
            assert name in params, (sc["metadata"]["name"], name)
            key = params[name]
            # a key of the cluster values (Terraform decides the subnet and the group), replaced into this field
            assert key in template, (name, key)
            assert f"parameters.{name}" in replaced.get(key, []), (name, key)
        # the same subnet and security group as the Terraform-made file system: the group admits the nodes
        assert template[params["subnetId"]] in fs["subnet_ids"]
        assert template[params["securityGroupIds"]] in fs["security_group_ids"]


def _admits_itself(rules: list[dict], port: int) -> bool:
    return any(r.get("self") is True and r["from_port"] <= port <= r["to_port"] and r["protocol"].strip('"') in (
        "tcp", "-1") for r in rules)


def test_the_fsx_security_group_admits_lustre_between_its_file_servers():
    """AWS FSx for Lustre user guide (File system access control with Amazon VPC; cannot-create-fs.html): the file
    system's group must allow inbound TCP 988 and 1018-1023 from itself (and from the clients)."""
    parsed = V.check_terraform_hcl(REPO)[1]
    fs = V._tf_blocks(parsed, "resource", "aws_fsx_lustre_file_system")["models"]
    assert fs["security_group_ids"] == ["${aws_security_group.fsx.id}"]
    ingress = V._tf_blocks(parsed, "resource", "aws_security_group")["fsx"]["ingress"]
    for port in (988, *range(1018, 1024)):
        assert _admits_itself(ingress, port), port
        assert any("${module.eks.node_security_group_id}" in r.get("security_groups", [])
                   and r["from_port"] <= port <= r["to_port"] for r in ingress), port
