"""Argo objects for batch work (runtime/batch/workflows.py): exact command lines, secrets only by reference,
validation against the vendored Argo Workflow CRD (and that the validator rejects broken objects)."""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from runtime.image import DEFAULT_IMAGE, cpu_image

PDSERVE_IMAGE = cpu_image(DEFAULT_IMAGE)  # what the steps run by default
from runtime.batch import workflow_specs as specs
from runtime.batch.workflow_specs import BatchInferenceWorkflowSpec, RetuneCronWorkflowSpec, check_cron
from runtime.batch.workflow_validation import validate_workflow_objects
from runtime.batch.workflows import batch_inference_workflow, retune_cron_workflow, to_yaml

ENDPOINT = "http://llm8-predictor.pdserve.svc.cluster.local/openai"
SECRET_VALUES = ("AKIA-not-a-real-key-123", "wJalr-not-a-real-secret-456", "mlflow-pw-789")


def batch_spec(**kw) -> BatchInferenceWorkflowSpec:
    args = dict(name="nightly-batch", input_uri="s3://pdserve-batch/in/requests.jsonl",
                output_uri="s3://pdserve-batch/out/results.jsonl", endpoint=ENDPOINT)
    return BatchInferenceWorkflowSpec(**{**args, **kw})


def retune_spec(**kw) -> RetuneCronWorkflowSpec:
    args = dict(name="retune-llama8", model_name="org/llama8", traffic_uri="s3://pdserve-traffic/2026/08/azure.csv",
                registered_model="llama8-pd")
    return RetuneCronWorkflowSpec(**{**args, **kw})


def argv(obj: dict) -> list[str]:
    spec = obj["spec"]["workflowSpec"] if obj["kind"] == "CronWorkflow" else obj["spec"]
    (tpl,) = spec["templates"]
    return tpl["container"]["command"] + tpl["container"]["args"]


def template(obj: dict) -> dict:
    spec = obj["spec"]["workflowSpec"] if obj["kind"] == "CronWorkflow" else obj["spec"]
    (tpl,) = spec["templates"]
    assert spec["entrypoint"] == tpl["name"]
    return tpl


def walk(x, key_path=()):
    if isinstance(x, dict):
        for k, v in x.items():
            yield key_path + (k,), v
            yield from walk(v, key_path + (k,))
    elif isinstance(x, list):
        for v in x:
            yield from walk(v, key_path)


# ------------------------------------------------------------------------------------------ batch inference


def test_batch_workflow_validates_and_runs_exactly_the_runner():
    wf = batch_inference_workflow(batch_spec(model="llama8", concurrency=16, max_retries=5,
                                             s3_endpoint_url="http://minio.minio.svc:9000",
                                             priority_class_name="pdserve-batch-low"))
    assert validate_workflow_objects([wf]) == []
    assert wf["apiVersion"] == "argoproj.io/v1alpha1" and wf["kind"] == "Workflow"
    assert wf["metadata"]["generateName"] == "nightly-batch-" and "name" not in wf["metadata"]
    assert wf["metadata"]["namespace"] == "pdserve"
    assert wf["metadata"]["labels"] == {"app.kubernetes.io/part-of": "pdserve",
                                        "pdserve.io/workload": "batch-inference",
                                        "workflows.argoproj.io/controller-instanceid": "pdserve"}
    assert argv(wf) == ["pdserve", "batch", "run",
                        "--input", "s3://pdserve-batch/in/requests.jsonl",
                        "--output", "s3://pdserve-batch/out/results.jsonl",
                        "--endpoint", ENDPOINT, "--concurrency", "16", "--model", "llama8", "--max-retries", "5",
                        "--no-progress"]
    spec = wf["spec"]
    assert spec["serviceAccountName"] == "pdserve-batch"
    assert spec["podPriorityClassName"] == "pdserve-batch-low"
    assert spec["activeDeadlineSeconds"] == 86400
    assert spec["podMetadata"]["labels"]["pdserve.io/workload"] == "batch-inference"
    tpl = template(wf)
    assert tpl["retryStrategy"] == {"limit": 2, "retryPolicy": "OnError"}
    c = tpl["container"]
    assert c["image"] == PDSERVE_IMAGE
    assert c["envFrom"] == [{"secretRef": {"name": "pdserve-s3", "optional": True}}]  # else the pod's IAM role
    assert {"name": "AWS_ENDPOINT_URL_S3", "value": "http://minio.minio.svc:9000"} in c["env"]
    res = c["resources"]
    assert set(res) == {"requests", "limits"} and set(res["limits"]) == {"cpu", "memory"}  # no GPU


def test_batch_workflow_defaults_and_iam_mode():
    wf = batch_inference_workflow(batch_spec(s3_secret=None, active_deadline_seconds=3600))
    assert validate_workflow_objects([wf]) == []
    args = argv(wf)
    assert "--model" not in args
    assert args[args.index("--concurrency") + 1] == "8" and args[-3:] == ["--max-retries", "3", "--no-progress"]
    c = template(wf)["container"]
    assert "envFrom" not in c
    assert not any(e["name"] == "AWS_ENDPOINT_URL_S3" for e in c.get("env", []))
    assert wf["spec"]["podPriorityClassName"] == "pdserve-batch" and wf["spec"]["activeDeadlineSeconds"] == 3600
    wf = batch_inference_workflow(batch_spec(priority_class_name=None))
    assert "podPriorityClassName" not in wf["spec"]  # None: the cluster's default priority


def test_no_secret_values_in_any_object(monkeypatch):
    # Credentials present in the building process's environment must not leak into the objects.
    for k, v in zip(("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD"), SECRET_VALUES):
        monkeypatch.setenv(k, v)
    objs = [batch_inference_workflow(batch_spec(s3_endpoint_url="https://s3.example.com")),
            retune_cron_workflow(retune_spec(s3_endpoint_url="https://s3.example.com", s3_secret="pdserve-s3"))]
    text = to_yaml(objs)
    assert not any(v in text for v in SECRET_VALUES)
    for obj in objs:
        for path, v in walk(obj):
            if path[-1] in ("env",):
                names = {e["name"] for e in v}
                assert not names & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_USERNAME",
                                    "MLFLOW_TRACKING_PASSWORD"}, names
            if path[-1] == "envFrom":
                assert all(set(e) == {"secretRef"} and set(e["secretRef"]) <= {"name", "optional"} for e in v)
            if path[-1] in ("accessKeySecret", "secretKeySecret"):
                assert set(v) == {"name", "key"}  # a selector, never a value
    art = template(objs[1])["inputs"]["artifacts"][0]["s3"]
    assert art["accessKeySecret"] == {"name": "pdserve-s3", "key": "AWS_ACCESS_KEY_ID"}
    assert art["secretKeySecret"] == {"name": "pdserve-s3", "key": "AWS_SECRET_ACCESS_KEY"}
    # by default the traffic is read with the pod's IAM role: infra/ creates no pdserve-s3 Secret, and a missing
    # Secret would fail the artifact (it is not optional there)
    default = template(retune_cron_workflow(retune_spec()))["inputs"]["artifacts"][0]["s3"]
    assert default.get("useSDKCreds") is True and "accessKeySecret" not in default


# ------------------------------------------------------------------------------------------ re-tuning


def test_retune_cron_validates_and_runs_exactly_tune():
    cron = retune_cron_workflow(retune_spec(gpu="H200-SXM", ttft_ms=1500, itl_ms=35.5, rate=12.5, gpu_budget=16))
    assert validate_workflow_objects([cron]) == []
    assert cron["kind"] == "CronWorkflow" and cron["metadata"]["name"] == "retune-llama8"
    assert cron["metadata"]["labels"]["pdserve.io/workload"] == "retune"
    spec = cron["spec"]
    assert spec["schedules"] == ["0 3 * * 0"] and "schedule" not in spec
    assert (spec["timezone"], spec["concurrencyPolicy"]) == ("UTC", "Forbid")
    assert spec["startingDeadlineSeconds"] >= 0
    assert spec["successfulJobsHistoryLimit"] >= 0 and spec["failedJobsHistoryLimit"] >= 0
    assert argv(cron) == ["pdserve", "tune", "/fsx/models/org/llama8/config.json", "--like", "llama8-pd",
                          "--gpu", "H200-SXM", "--ttft-ms", "1500", "--itl-ms", "35.5", "--rate", "12.5",
                          "--gpu-budget", "16", "--trace", "/work/traffic/azure.csv",
                          "--trace-uri", "s3://pdserve-traffic/2026/08/azure.csv",
                          "--mlflow-uri", "http://mlflow.mlflow.svc:5000",
                          "--register", "llama8-pd", "--out", "/work/winner.json"]
    tpl = template(cron)
    (art,) = tpl["inputs"]["artifacts"]
    assert art["path"] == "/work/traffic/azure.csv"
    assert (art["s3"]["bucket"], art["s3"]["key"]) == ("pdserve-traffic", "2026/08/azure.csv")
    c = tpl["container"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/fsx"]["readOnly"] is True and not mounts["/work"].get("readOnly")
    vols = {v["name"]: v for v in tpl["volumes"]}
    assert vols[mounts["/fsx"]["name"]]["persistentVolumeClaim"] == {"claimName": "fsx-claim", "readOnly": True}
    assert vols[mounts["/work"]["name"]]["emptyDir"] == {}
    assert c["envFrom"] == [{"secretRef": {"name": "pdserve-mlflow", "optional": True}}]
    assert c["image"] == PDSERVE_IMAGE and "nvidia.com/gpu" not in str(c["resources"])
    assert spec["workflowSpec"]["serviceAccountName"] == "pdserve-batch"


def test_retune_options_jsonl_trace_minio_and_iam():
    cron = retune_cron_workflow(retune_spec(
        traffic_uri="s3://traces/mooncake/day1.jsonl", s3_endpoint_url="http://minio.minio.svc:9000",
        s3_secret=None, mlflow_secret=None, pvc_name="fsx-other", schedule="*/30 1-5 * JAN-MAR MON-FRI",
        timezone="Europe/Paris", concurrency_policy="Replace", priority_class_name="batch-low"))
    assert validate_workflow_objects([cron]) == []
    tpl = template(cron)
    s3 = tpl["inputs"]["artifacts"][0]["s3"]
    assert s3 == {"bucket": "traces", "endpoint": "minio.minio.svc:9000", "insecure": True,
                  "key": "mooncake/day1.jsonl", "useSDKCreds": True}
    args = argv(cron)
    assert args[args.index("--trace") + 1] == "/work/traffic/day1.jsonl"
    assert "envFrom" not in tpl["container"]
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "fsx-other" for v in tpl["volumes"])
    assert cron["spec"]["workflowSpec"]["podPriorityClassName"] == "batch-low"
    assert (cron["spec"]["timezone"], cron["spec"]["concurrencyPolicy"]) == ("Europe/Paris", "Replace")


def test_unset_constraints_are_inherited_from_the_champion_and_constants_match_the_pipeline():
    """Without gpu/ttft/itl/budget/planner the step passes none of them: `tune --like` takes the champion's."""
    spec = retune_spec()
    assert (spec.gpu, spec.ttft_ms, spec.itl_ms, spec.gpu_budget, spec.planner) == (None,) * 5
    args = argv(retune_cron_workflow(spec))
    assert args[:5] == ["pdserve", "tune", "/fsx/models/org/llama8/config.json", "--like", "llama8-pd"]
    assert args[args.index("--register") + 1] == "llama8-pd"
    for opt in ("--gpu", "--ttft-ms", "--itl-ms", "--gpu-budget", "--planner", "--precision",
                "--min-improvement-pct"):
        assert opt not in args
    args = argv(retune_cron_workflow(retune_spec(itl_ms=40, min_improvement_pct=10)))
    assert args[args.index("--itl-ms") + 1] == "40" and args[args.index("--min-improvement-pct") + 1] == "10"
    assert "--ttft-ms" not in args and "--gpu" not in args
    src = Path(__file__).resolve().parents[2] / "pipelines" / "stage_tune_promote.py"
    consts = {t.id: n.value.value for n in ast.parse(src.read_text()).body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    assert (consts["FSX_PVC"], consts["S3_SECRET"], consts["MLFLOW_SECRET"]) == (
        specs.FSX_PVC, specs.S3_SECRET, specs.MLFLOW_SECRET)


# ------------------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("build, field, bad", [
    (batch_spec, "input_uri", "s3://pdserve-batch"),
    (batch_spec, "input_uri", "s3://pdserve-batch/"),
    (batch_spec, "output_uri", "/tmp/out.jsonl"),
    (batch_spec, "endpoint", "llm8-predictor.pdserve.svc/openai"),
    (batch_spec, "name", "Nightly"),
    (batch_spec, "name", "x" * 58),
    (batch_spec, "namespace", "pd_serve"),
    (batch_spec, "concurrency", 0),
    (batch_spec, "max_retries", -1),
    (batch_spec, "active_deadline_seconds", 0),
    (batch_spec, "s3_endpoint_url", "minio:9000"),
    (batch_spec, "priority_class_name", "Low"),
    (retune_spec, "schedule", "0 3 * *"),
    (retune_spec, "schedule", "0 24 * * *"),
    (retune_spec, "timezone", "Mars/Olympus"),
    (retune_spec, "concurrency_policy", "Sometimes"),
    (retune_spec, "name", "r" * 53),
    (retune_spec, "model_name", "../etc"),
    (retune_spec, "model_name", "org/../llama8"),
    (retune_spec, "model_name", "/abs/llama8"),
    (retune_spec, "traffic_uri", "s3://pdserve-traffic/trace.parquet"),
    (retune_spec, "traffic_uri", "s3://pdserve-traffic"),
    (retune_spec, "traffic_uri", "s3://pdserve-traffic/"),
    (retune_spec, "traffic_uri", "s3://Bad_Bucket/traffic/"),
    (retune_spec, "traffic_uri", "s3://pdserve-traffic/../"),
    (retune_spec, "traffic_uri", "s3://pdserve-traffic/a/./b.jsonl"),
    (retune_spec, "traffic_uri", "s3://pdserve-traffic/$(HOME)/"),
    (retune_spec, "traffic_uri", "s3://pdserve-traffic/$(HOME).jsonl"),
    (retune_spec, "mlflow_uri", "mlflow.mlflow.svc:5000"),
    (retune_spec, "registered_model", "a/b"),
    (retune_spec, "ttft_ms", 0),
    (retune_spec, "ttft_ms", float("inf")),  # `pdserve tune` in the pod would refuse it at every run
    (retune_spec, "itl_ms", float("inf")),
    (retune_spec, "rate", float("inf")),
    (retune_spec, "rate", -1.0),
    (retune_spec, "gpu_budget", 0),
    (retune_spec, "min_improvement_pct", -1.0),
    (retune_spec, "gpu", "H100 SXM"),
    (retune_spec, "pvc_name", "FSx"),
    (retune_spec, "starting_deadline_seconds", -5),
])
def test_bad_inputs_name_the_field(build, field, bad):
    with pytest.raises(ValidationError) as ei:
        build(**{field: bad})
    errs = ei.value.errors()
    assert len(errs) == 1 and errs[0]["loc"] == (field,), errs
    assert field in str(ei.value)


def test_unknown_option_and_same_input_output_are_refused():
    with pytest.raises(ValidationError, match="extra"):
        batch_spec(concurency=4)
    with pytest.raises(ValidationError, match="output_uri.*must differ from input_uri"):
        batch_spec(output_uri="s3://pdserve-batch/in/requests.jsonl")


@pytest.mark.parametrize("expr", ["0 3 * * 0", "*/15 0-6 1,15 * *", "0 0 ? JAN-MAR MON-FRI", "59 23 31 12 6"])
def test_check_cron_accepts(expr):
    assert check_cron(expr) == expr


@pytest.mark.parametrize("expr, why", [("0 3 * * * *", "5 fields"), ("60 * * * *", "minute"),
                                       ("0 3 0 * *", "day of month"), ("0 3 * 13 *", "month"),
                                       ("0 3 * * 7", "day of week"), ("5-1 * * * *", "reversed"),
                                       ("*/0 * * * *", "step"), ("a * * * *", "minute")])
def test_check_cron_refuses(expr, why):
    with pytest.raises(ValueError, match=why):
        check_cron(expr)


# ------------------------------------------------------------------------------------------ the validator bites


@pytest.fixture(scope="module")
def good():
    return [batch_inference_workflow(batch_spec()), retune_cron_workflow(retune_spec())]


def _tpl(obj):
    return (obj["spec"]["workflowSpec"] if obj["kind"] == "CronWorkflow" else obj["spec"])["templates"][0]


@pytest.mark.parametrize("which, breaker, expect", [
    (0, lambda o: _tpl(o)["container"].pop("image"), "Workflow/nightly-batch-: spec.templates[0].container.image"),
    (0, lambda o: o["spec"].update(activeDeadlineSeconds="x"), "spec.activeDeadlineSeconds"),
    (0, lambda o: _tpl(o)["container"].update(imagePullPolcy="Always"), "imagePullPolcy"),
    (0, lambda o: _tpl(o)["retryStrategy"].update(limit=[2]), "retryStrategy.limit"),
    (0, lambda o: o["spec"].update(entrypoint="nope"), "spec.entrypoint"),
    (0, lambda o: o.update(metadata={"generateName": "Bad-"}), "metadata.name"),
    (0, lambda o: o.update(kind="Job"), "not an argoproj.io/v1alpha1 Workflow"),
    (1, lambda o: o["spec"].update(schedules=["0 3 * *"]), "spec.schedules[0]"),
    (1, lambda o: o["spec"].update(schedules=[]), "spec.schedules"),
    (1, lambda o: o["spec"].update(schedule="0 3 * * 0"), "spec.schedule: removed"),
    (1, lambda o: o["spec"].update(concurrencyPolicy="Sometimes"), "spec.concurrencyPolicy"),
    (1, lambda o: o["spec"].update(startingDeadlineSeconds=-1), "spec.startingDeadlineSeconds"),
    (1, lambda o: o["spec"].update(timezone="Nowhere/Land"), "spec.timezone"),
    (1, lambda o: o["spec"].update(paralelism=1), "spec.paralelism"),
    (1, lambda o: o["spec"]["workflowSpec"].update(activeDeadlineSeconds="x"),
     "CronWorkflow/retune-llama8: spec.workflowSpec.activeDeadlineSeconds"),
    (1, lambda o: _tpl(o)["inputs"]["artifacts"][0]["s3"].update(bucket=7), "s3.bucket"),
    (1, lambda o: _tpl(o)["container"]["volumeMounts"][0].update(name="fsxx"), "volumeMounts[0].name"),
    (1, lambda o: _tpl(o)["container"].pop("image"), "spec.workflowSpec.templates[0].container.image"),
    (1, lambda o: o["spec"].pop("workflowSpec"), "spec.workflowSpec: required"),
    (1, lambda o: o["metadata"].update(name="c" * 53), "metadata.name"),
])
def test_validator_reports_broken_objects(good, which, breaker, expect):
    assert validate_workflow_objects(good) == []
    obj = copy.deepcopy(good[which])
    breaker(obj)
    problems = validate_workflow_objects([obj])
    assert problems and any(expect in p for p in problems), problems
    assert validate_workflow_objects([good[which]]) == []  # the original is untouched


def test_to_yaml_round_trips(good):
    text = to_yaml(good)
    assert text.count("\n---\n") == 1
    assert list(yaml.safe_load_all(text)) == good
    assert text.index("apiVersion") < text.index("kind") < text.index("metadata")  # build order, not sorted


# ------------------------------------------------------------------------------------------ the step/CLI contract


def test_the_steps_command_lines_parse_with_the_real_clis(tmp_path, monkeypatch):
    """The container args must be what the image's CLIs accept: a renamed or removed option would otherwise only
    fail on the cluster. Each command line is run up to the point where it reads its inputs (which do not exist
    here): a usage error (exit 2 with 'No such option' / 'Missing option') would mean a broken contract."""
    from typer.testing import CliRunner

    from runtime.cli import app as pdserve_app

    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    local = tmp_path / "requests.jsonl"
    local.write_text("{not json\n")  # the runner parses it, finds it malformed, sends nothing
    args = argv(batch_inference_workflow(batch_spec()))[1:]
    args[args.index("--input") + 1] = str(local)
    args[args.index("--output") + 1] = str(tmp_path / "out.jsonl")
    res = CliRunner().invoke(pdserve_app, args)
    assert res.exit_code == 2 and "line 1: not JSON" in " ".join(res.output.split()), res.output

    tune_args = argv(retune_cron_workflow(retune_spec(gpu="H200-SXM", ttft_ms=1500, itl_ms=30, rate=2,
                                                      gpu_budget=16, planner="sla", min_improvement_pct=7.5)))[1:]
    tune_args[tune_args.index("--trace") + 1] = str(tmp_path / "absent.csv")
    # a real (sqlite) MLflow without the registered model: --like stops the run after every option was accepted
    tune_args[tune_args.index("--mlflow-uri") + 1] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = CliRunner().invoke(pdserve_app, tune_args)
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and "--like llama8-pd:" in out and "no such registered model" in out, res.output


def test_the_defaults_name_objects_infra_k8s_creates():
    """The default service account and PriorityClass exist in infra/k8s/batch (and it is part of infra/k8s), and
    the service account may create and patch WorkflowTaskResults (Argo's emissary executor needs nothing more)."""
    import yaml

    from runtime.paths import REPO_ROOT

    root = REPO_ROOT / "infra" / "k8s"
    assert "batch" in yaml.safe_load((root / "kustomization.yaml").read_text())["resources"]
    objs = [o for f in sorted((root / "batch").glob("*.yaml")) if f.name != "kustomization.yaml"
            for o in yaml.safe_load_all(f.read_text())]
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    spec = batch_spec()
    sa = by_kind[("ServiceAccount", spec.service_account)]
    assert sa["metadata"]["namespace"] == spec.namespace
    pc = by_kind[("PriorityClass", spec.priority_class_name)]
    assert pc["value"] < 0 and pc["preemptionPolicy"] == "Never" and not pc["globalDefault"]
    binding = next(o for o in objs if o["kind"] == "RoleBinding")
    assert {"kind": "ServiceAccount", "name": spec.service_account, "namespace": spec.namespace} in binding["subjects"]
    role = by_kind[("Role", binding["roleRef"]["name"])]
    assert role["rules"] == [{"apiGroups": ["argoproj.io"], "resources": ["workflowtaskresults"],
                              "verbs": ["create", "patch"]}]


def test_the_cli_renders_valid_yaml_and_names_a_bad_option(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from runtime.cli import app

    runner = CliRunner()
    out = tmp_path / "wf.yaml"
    res = runner.invoke(app, ["batch", "workflow", "--input", "s3://pdserve-batch/in.jsonl", "--output",
                              "s3://pdserve-batch/out.jsonl", "--endpoint", ENDPOINT, "--priority-class", "none",
                              "--s3-secret", "none", "--out", str(out)])
    assert res.exit_code == 0, res.output
    (wf,) = yaml.safe_load_all(out.read_text())
    assert validate_workflow_objects([wf]) == [] and "podPriorityClassName" not in wf["spec"]
    assert "envFrom" not in template(wf)["container"]
    res = runner.invoke(app, ["batch", "retune-schedule", "--model-name", "org/llama8", "--traffic",
                              "s3://pdserve-traffic/llama8/traffic.jsonl", "--registered-model", "llama8-pd"])
    assert res.exit_code == 0, res.output
    (cron,) = yaml.safe_load_all(res.stdout)
    assert cron["kind"] == "CronWorkflow" and cron["metadata"]["name"] == "retune-org-llama8"
    assert validate_workflow_objects([cron]) == []
    res = runner.invoke(app, ["batch", "workflow", "--input", "s3://pdserve-batch/in.jsonl", "--output",
                              "s3://pdserve-batch/in.jsonl", "--endpoint", "ftp://x", "--concurrency", "0"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2
    assert "--endpoint:" in text and "--concurrency:" in text


@pytest.mark.parametrize("field, value, why", [
    ("endpoint", "http://h/openai?x=1", "must be an http"),
    ("endpoint", "http://user:pw@h/openai", "must not carry credentials"),
    ("s3_endpoint_url", "http://key:secret@minio:9000", "must not carry credentials"),
    ("output_uri", "s3://pdserve-batch/out/{{workflow.name}}.jsonl", "Argo would substitute"),
    ("model", "{{inputs.parameters.x}}", "Argo would substitute"),
    ("model", "m$(AWS_SECRET_ACCESS_KEY)", "Kubernetes expands"),
    ("input_uri", "s3://pdserve-batch/$(HOME).jsonl", "Kubernetes expands"),
])
def test_values_the_pod_would_reject_or_argo_would_rewrite_are_refused(field, value, why):
    with pytest.raises(ValidationError, match=why) as e:
        batch_spec(**{field: value})
    msgs = " ".join(x["msg"] for x in e.value.errors())  # what `pdserve batch workflow` prints
    assert "pw@" not in msgs and "secret@" not in msgs


def test_the_default_cron_name_of_a_long_model_name_is_valid():
    from typer.testing import CliRunner

    from runtime.cli import app

    for model in ["org/" + "a" * 40 + "-" + "b" * 20, "org/" + "a" * 44 + "." + "b"]:
        res = CliRunner().invoke(app, ["batch", "retune-schedule", "--model-name", model, "--traffic",
                                       "s3://pdserve-traffic/t.jsonl", "--registered-model", "m1"])
        assert res.exit_code == 0, res.output
        (cron,) = __import__("yaml").safe_load_all(res.stdout)
        name = cron["metadata"]["name"]
        assert len(name) <= 52 and not name.endswith("-") and validate_workflow_objects([cron]) == []



def test_without_a_rate_the_retune_sizes_for_the_recorded_arrival_rate():
    args = argv(retune_cron_workflow(retune_spec()))
    assert "--rate" not in args and args[args.index("--trace") + 1] == "/work/traffic/azure.csv"


def test_a_traffic_prefix_is_downloaded_as_a_folder_and_tuned_as_one_trace(tmp_path, monkeypatch):
    """s3://bucket/prefix/ (one traffic log per runtime replica): the artifact key names the prefix WITHOUT the
    trailing '/' (a zero-byte S3-console "folder" object under that exact name would otherwise be fetched as the
    trace), the artifact lands as a folder, and the real `pdserve tune` reads that folder as one trace."""
    import json

    from typer.testing import CliRunner

    from runtime.cli import app as pdserve_app

    cron = retune_cron_workflow(retune_spec(traffic_uri="s3://pdserve-traffic/traffic/llama8/"))
    assert validate_workflow_objects([cron]) == []
    (art,) = template(cron)["inputs"]["artifacts"]
    assert (art["s3"]["bucket"], art["s3"]["key"], art["path"]) == (
        "pdserve-traffic", "traffic/llama8", "/work/traffic/llama8")
    tune_args = argv(cron)[1:]
    assert tune_args[tune_args.index("--trace") + 1] == "/work/traffic/llama8"
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    folder = tmp_path / "llama8"  # what Argo's S3 driver leaves: the objects under the prefix
    folder.mkdir()
    for pod, start in (("pdserve-a", 0), ("pdserve-b", 500)):
        (folder / f"{pod}.jsonl").write_text("".join(
            json.dumps({"timestamp": 1_764_000_000_000 + start + 1000 * i, "input_length": 700,
                        "output_length": 70}) + "\n" for i in range(5)))
    tune_args[tune_args.index("--trace") + 1] = str(folder)
    assert tune_args[:2] == ["tune", "/fsx/models/org/llama8/config.json"]
    tune_args[1] = str(__import__("runtime.modelfiles.catalog", fromlist=["CATALOG_DIR"]).CATALOG_DIR
                       / "meta-llama--Meta-Llama-3.1-8B_config.json")
    out = tmp_path / "spec.json"
    for opt in ("--mlflow-uri", "--register", "--like"):  # no MLflow here: the run stops at the spec
        i = tune_args.index(opt)
        del tune_args[i:i + 2]
    tune_args[tune_args.index("--out") + 1] = str(out)
    res = CliRunner().invoke(pdserve_app, tune_args)
    assert res.exit_code == 0, res.output
    from runtime.config import DeploymentSpec

    w = DeploymentSpec.model_validate_json(out.read_text()).workload
    assert (w.isl_tokens, w.osl_tokens) == (700, 70) and w.request_rate_per_s == 9 / 4.5  # both pods' arrivals



def test_the_retune_keeps_the_planner_mode_it_is_given():
    args = argv(retune_cron_workflow(retune_spec(planner="sla")))
    assert args[args.index("--planner") + 1] == "sla"
    with pytest.raises(ValidationError):
        retune_spec(planner="auto")


# ------------------------------------------------------------------------------------------ controller


def test_workflows_carry_the_instance_id_of_the_pdserve_controller_only_on_the_workflow_objects():
    """infra/k8s/argo runs a controller with instanceID 'pdserve' that acts only on objects labelled
    workflows.argoproj.io/controller-instanceid=pdserve: the Workflow, the CronWorkflow and the Workflows it
    creates (spec.workflowMetadata) carry the label; pods get it from the controller, not from podMetadata."""
    label = "workflows.argoproj.io/controller-instanceid"
    wf = batch_inference_workflow(batch_spec())
    cron = retune_cron_workflow(retune_spec())
    assert validate_workflow_objects([wf, cron]) == []
    assert wf["metadata"]["labels"][label] == "pdserve"
    assert cron["metadata"]["labels"][label] == "pdserve"
    assert label not in wf["spec"]["podMetadata"]["labels"]
    assert label not in cron["spec"]["workflowSpec"]["podMetadata"]["labels"]
    # a cluster whose own Argo controller has no instanceID: no label at all
    for obj in (batch_inference_workflow(batch_spec(controller_instance_id=None)),
                retune_cron_workflow(retune_spec(controller_instance_id=None))):
        assert not any(label in (v or {}) for path, v in walk(obj) if path[-1] == "labels")
    with pytest.raises(ValueError, match="controller_instance_id"):
        batch_spec(controller_instance_id="not a label value")


# ------------------------------------------------------------------------------------------ retune + promote

TRAFFIC_PREFIX = "s3://pdserve-traffic/traffic/llama8-pd/"  # what `promote --traffic-upload s3://…/traffic/` ships


def promote_cron(**kw) -> dict:
    return retune_cron_workflow(retune_spec(traffic_uri=TRAFFIC_PREFIX, promote=True, **kw))


def templates(obj: dict) -> dict[str, dict]:
    return {t["name"]: t for t in obj["spec"]["workflowSpec"]["templates"]}


def test_without_promote_the_cron_is_one_tune_step_that_reports_nothing():
    cron = retune_cron_workflow(retune_spec(traffic_uri=TRAFFIC_PREFIX))
    tpl = template(cron)  # exactly one template, the entrypoint
    assert "outputs" not in tpl and "serviceAccountName" not in tpl
    assert not {"--decision-out", "--decision-values"} & set(argv(cron))
    assert "promote" not in str(cron)


def test_with_promote_the_promote_step_promotes_the_champion_unless_it_already_serves():
    """No `when` on `replaced`: a retried tune whose first attempt moved the alias writes replaced=false (it keeps
    its own version), so the new champion would never be promoted; promote runs after every tune, for the version
    alias champion names, and --skip-if-live applies nothing when that revision already serves."""
    cron = promote_cron()
    assert validate_workflow_objects([cron]) == []
    wfspec = cron["spec"]["workflowSpec"]
    tpls = templates(cron)
    assert set(tpls) == {"retune", "tune", "promote"} and wfspec["entrypoint"] == "retune"
    (tune_group, promote_group) = tpls["retune"]["steps"]  # two sequential groups of one step each
    assert tune_group == [{"name": "tune", "template": "tune"}]
    (step,) = promote_group
    assert step["template"] == "promote"
    assert "when" not in step
    assert step["arguments"]["parameters"] == [
        {"name": "version", "value": "{{steps.tune.outputs.parameters.champion_version}}"}]
    # tune writes its decision where the output parameters read it
    tune_args = tpls["tune"]["container"]["command"] + tpls["tune"]["container"]["args"]
    assert tune_args[-4:] == ["--decision-out", "/work/decision.json", "--decision-values", "/work/decision"]
    assert tpls["tune"]["outputs"]["parameters"] == [
        {"name": "replaced", "valueFrom": {"path": "/work/decision/replaced"}},
        {"name": "registered_version", "valueFrom": {"path": "/work/decision/registered_version"}},
        {"name": "champion_version", "valueFrom": {"path": "/work/decision/champion_version"}}]
    c = tpls["promote"]["container"]
    assert c["command"] + c["args"] == [
        "pdserve", "promote", "llama8-pd", "--apply", "--skip-if-live", "--expect-version",
        "{{inputs.parameters.version}}",
        "--mlflow-uri", "http://mlflow.mlflow.svc:5000", "--namespace", "pdserve", "--image", DEFAULT_IMAGE,
        "--pvc", "fsx-claim", "--out", "/work/manifests.yaml", "--traffic-upload", "s3://pdserve-traffic/traffic/"]
    assert tpls["promote"]["inputs"]["parameters"] == [{"name": "version"}]
    # only the promote pod may apply: its own service account; tune keeps the workflow's
    assert tpls["promote"]["serviceAccountName"] == "pdserve-promoter"
    assert "serviceAccountName" not in tpls["tune"] and wfspec["serviceAccountName"] == "pdserve-batch"
    assert "retryStrategy" not in tpls["promote"]  # a rolled-back canary is not retried within the run
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/fsx"]["readOnly"] is True and "/work" in mounts  # staged-copy check; --out
    assert c["envFrom"] == [{"secretRef": {"name": "pdserve-mlflow", "optional": True}}]


def test_the_files_tune_writes_are_the_ones_the_output_parameters_read(tmp_path):
    """The contract between `tune --decision-values DIR` (the real writer) and the tune template's valueFrom paths:
    each parameter's file exists and holds what the promote step's --expect-version expects."""
    from runtime.faces.tune import _write_decision

    tpl = templates(promote_cron())["tune"]
    args = tpl["container"]["args"]
    folder = args[args.index("--decision-values") + 1]
    decision = {"registered_model": "llama8-pd", "registered_version": "7", "previous_champion_version": "6",
                "champion_version": "7", "replaced": True, "reason": "r"}
    _write_decision(decision, tmp_path / "d.json", tmp_path)
    read = {p["name"]: (tmp_path / Path(p["valueFrom"]["path"]).relative_to(folder)).read_text()
            for p in tpl["outputs"]["parameters"]}
    assert read == {"replaced": "true", "registered_version": "7", "champion_version": "7"}
    _write_decision({**decision, "replaced": False, "champion_version": "6"}, None, tmp_path)
    assert (tmp_path / "champion_version").read_text() == "6"  # kept: promote 6 (nothing applied if it serves)


@pytest.mark.parametrize("kw, upload", [
    ({}, "s3://pdserve-traffic/traffic/"),  # derived: the endpoint ships under <prefix><InferenceService>/
    ({"traffic_uri": "s3://pdserve-traffic/llama8-pd/"}, "s3://pdserve-traffic/"),
    ({"promote_traffic_upload": "s3://other/logs/"}, "s3://other/logs/"),
    ({"promote_traffic_upload": "none"}, None),
])
def test_the_promoted_revision_keeps_shipping_traffic(kw, upload):
    args = templates(retune_cron_workflow(retune_spec(**{"traffic_uri": TRAFFIC_PREFIX, "promote": True, **kw})))[
        "promote"]["container"]["args"]
    assert (args[args.index("--traffic-upload") + 1] if "--traffic-upload" in args else None) == upload


def test_promote_options_are_passed_through():
    cron = promote_cron(promote_namespace="serving", promote_image="registry/pdserve:2", pvc_name="fsx2",
                        promote_service_account="promoter2", mlflow_uri="http://mlflow:5000")
    tpl = templates(cron)["promote"]
    args = tpl["container"]["args"]
    assert [args[args.index(o) + 1] for o in ("--namespace", "--image", "--pvc", "--mlflow-uri")] == [
        "serving", "registry/pdserve:2", "fsx2", "http://mlflow:5000"]
    assert tpl["serviceAccountName"] == "promoter2" and validate_workflow_objects([cron]) == []


@pytest.mark.parametrize("kw, why", [
    ({"promote_namespace": "serving"}, "promote_namespace: only used with promote"),
    ({"promote": True, "traffic_uri": "s3://pdserve-traffic/t.csv"}, "upload prefix of the promoted endpoint"),
    ({"promote": True, "traffic_uri": "s3://pdserve-traffic/traffic/other/"}, "'llama8-pd'"),
    ({"promote": True, "promote_traffic_upload": "s3://bkt/no-slash"}, "must end in '/'"),
    ({"promote": True, "promote_image": "img:{{workflow.name}}"}, "Argo would substitute"),
    ({"promote": True, "promote_service_account": "Bad_SA"}, "DNS-1123"),
])
def test_bad_promote_options_are_refused(kw, why):
    with pytest.raises(ValidationError, match=re.escape(why)):
        retune_spec(**kw)


@pytest.mark.parametrize("breaker, expect", [
    (lambda t: t["retune"]["steps"][1][0].update(when="{{steps.tune.outputs.parameters.replace}} == true"),
     "steps.tune.outputs.parameters.replace is not an output parameter of an earlier step"),
    (lambda t: t["tune"].pop("outputs"), "steps.tune.outputs.parameters.champion_version is not an output "
                                          "parameter"),
    (lambda t: t["retune"]["steps"][1][0].pop("arguments"), "input parameter 'version' of template 'promote'"),
    (lambda t: t["promote"]["container"]["args"].__setitem__(4, "{{steps.tune.outputs.parameters.x}}"),
     "refers to steps./tasks. outputs"),
    (lambda t: t["retune"]["steps"][1][0].update(template="promot"), "'promot' names no template"),
    (lambda t: t["retune"]["steps"].reverse(), "not an output parameter of an earlier step"),
])
def test_the_validator_checks_what_the_steps_refer_to(breaker, expect):
    cron = promote_cron()
    broken = copy.deepcopy(cron)
    breaker(templates(broken))  # the same dicts as in `broken`
    problems = validate_workflow_objects([broken])
    assert any(expect in p for p in problems), problems


def test_the_promote_steps_command_line_parses_with_the_real_cli(tmp_path, monkeypatch):
    """As test_the_steps_command_lines_parse_with_the_real_clis: the promote args (the version Argo substitutes,
    and a local MLflow database that does not exist) get as far as looking for that database."""
    from typer.testing import CliRunner

    from runtime.cli import app as pdserve_app

    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    tpls = templates(promote_cron(promote_namespace="serving"))
    args = [a.replace("{{inputs.parameters.version}}", "3") for a in tpls["promote"]["container"]["args"]]
    db = tmp_path / "mlflow.db"
    args[args.index("--mlflow-uri") + 1] = f"sqlite:///{db}"
    args[args.index("--out") + 1] = str(tmp_path / "m.yaml")
    args.remove("--apply")  # outside a pod --apply stops first, before the other options are used
    args.remove("--skip-if-live")  # (and it only applies with --apply)
    res = CliRunner().invoke(pdserve_app, args)
    out = " ".join(res.output.split())
    # exit 2 for the bad --mlflow-uri value, not for the command line's shape: no click usage error
    assert res.exit_code == 2 and "no such database file" in out and "Usage:" not in out and not db.exists(), \
        res.output
    # the tune side: the decision options are accepted (the run then stops at --like, as above)
    tune_args = tpls["tune"]["container"]["args"]
    tune_args[tune_args.index("--trace") + 1] = str(tmp_path / "absent")
    tune_args[tune_args.index("--mlflow-uri") + 1] = f"sqlite:///{tmp_path / 't.db'}"
    for opt, name in (("--out", "w.json"), ("--decision-out", "d.json"), ("--decision-values", "d")):
        tune_args[tune_args.index(opt) + 1] = str(tmp_path / name)
    res = CliRunner().invoke(pdserve_app, tune_args)
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and "--like llama8-pd:" in out and "no such registered model" in out, res.output


def test_the_cli_wires_the_promote_options(tmp_path):
    from typer.testing import CliRunner

    from runtime.cli import app

    base = ["batch", "retune-schedule", "--model-name", "org/llama8", "--traffic", TRAFFIC_PREFIX,
            "--registered-model", "llama8-pd"]
    res = CliRunner().invoke(app, [*base, "--promote", "--promote-namespace", "serving", "--promote-image",
                                   "registry/pdserve:2", "--promote-service-account", "promoter2",
                                   "--promote-traffic-upload", "s3://other/logs/"])
    assert res.exit_code == 0, res.output
    (cron,) = yaml.safe_load_all(res.stdout)
    tpl = templates(cron)["promote"]
    args = tpl["container"]["args"]
    assert [args[args.index(o) + 1] for o in ("--namespace", "--image", "--traffic-upload")] == [
        "serving", "registry/pdserve:2", "s3://other/logs/"]
    assert tpl["serviceAccountName"] == "promoter2" and validate_workflow_objects([cron]) == []
    res = CliRunner().invoke(app, [*base, "--promote-namespace", "serving"])
    assert res.exit_code == 2 and "--promote-namespace: only used with promote" in " ".join(res.output.split())
    res = CliRunner().invoke(app, [*base[:5], "s3://pdserve-traffic/t.csv", *base[6:], "--promote"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "--promote-traffic-upload: traffic_uri" in text


def test_a_windowed_retune_reads_s3_itself_instead_of_downloading_the_prefix():
    """trace_window_h: no Argo artifact (it would download every object under the prefix); the step runs
    `pdserve tune --trace-window-h H --trace-uri s3://…/` with the S3 secret by envFrom (or IAM), the endpoint
    and region in its env. Without it, the artifact stays."""
    cron = retune_cron_workflow(retune_spec(traffic_uri="s3://pdserve-traffic/traffic/llama8/", trace_window_h=24,
                                            s3_endpoint_url="http://minio.minio.svc:9000", s3_region="eu-west-1",
                                            s3_secret="pdserve-s3"))
    assert validate_workflow_objects([cron]) == []
    tpl = template(cron)
    assert "inputs" not in tpl
    args = argv(cron)
    assert "--trace" not in args and args[args.index("--trace-window-h") + 1] == "24"
    assert args[args.index("--trace-uri") + 1] == "s3://pdserve-traffic/traffic/llama8/"
    c = tpl["container"]
    assert {"name": "pdserve-s3", "optional": True} in [e["secretRef"] for e in c["envFrom"]]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert (env["AWS_ENDPOINT_URL_S3"], env["AWS_REGION"]) == ("http://minio.minio.svc:9000", "eu-west-1")
    assert not any(v in str(cron) for v in SECRET_VALUES)
    iam = template(retune_cron_workflow(retune_spec(trace_window_h=0.5, s3_secret=None)))
    assert [e["secretRef"]["name"] for e in iam["container"]["envFrom"]] == ["pdserve-mlflow"]
    assert "--trace-window-h" not in argv(retune_cron_workflow(retune_spec()))
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="trace_window_h"):
            retune_spec(trace_window_h=bad)
    from typer.testing import CliRunner

    from runtime.cli import app

    res = CliRunner().invoke(app, ["batch", "retune-schedule", "--model-name", "llama8", "--traffic",
                                   "s3://pdserve-traffic/traffic/llama8/", "--registered-model", "m1",
                                   "--trace-window-h", "168"])
    assert res.exit_code == 0, res.output
    (cron,) = yaml.safe_load_all(res.stdout)
    assert argv(cron)[argv(cron).index("--trace-window-h") + 1] == "168" and "inputs" not in template(cron)


def test_presigned_traffic_uris_are_refused_without_echoing_the_signature():
    for kw in ({"traffic_uri": "s3://pdserve-traffic/p/x.jsonl?X-Amz-Signature=SECRET"},
               {"traffic_uri": "s3://pdserve-traffic/p/#SECRET"},
               {"promote": True, "promote_traffic_upload": "s3://b/traffic/?X-Amz-Signature=SECRET/"}):
        with pytest.raises(ValidationError, match="must not carry a query string or fragment") as e:
            retune_spec(**kw)
        assert "SECRET" not in " ".join(x["msg"] for x in e.value.errors())  # what the CLI prints
    from typer.testing import CliRunner

    from runtime.cli import app

    res = CliRunner().invoke(app, ["batch", "retune-schedule", "--model-name", "llama8", "--traffic",
                                   "s3://pdserve-traffic/p/x.jsonl?X-Amz-Signature=SECRET", "--registered-model", "m"])
    assert res.exit_code == 2 and "SECRET" not in res.output and "query string" in " ".join(res.output.split())
    from runtime.s3uri import check_upload_uri

    with pytest.raises(ValueError, match="presigned") as e:
        check_upload_uri("s3://b/traffic/?X-Amz-Credential=SECRET")
    assert "SECRET" not in str(e.value)


def test_the_gpu_is_checked_against_the_catalog_when_rendering_not_at_the_first_run():
    with pytest.raises(ValidationError, match="gpu 'H900': neither a GPU catalog name nor a known AWS instance"):
        retune_spec(gpu="H900")
    assert "--gpu" in argv(retune_cron_workflow(retune_spec(gpu="g6e.12xlarge")))
    assert "--gpu" in argv(retune_cron_workflow(retune_spec(gpu="h100-sxm")))  # an alias tune accepts too


def test_precision_is_passed_only_when_given_and_the_promote_image_defaults_to_the_steps_image():
    args = argv(retune_cron_workflow(retune_spec(precision="fp8")))
    assert args[args.index("--precision") + 1] == "fp8"
    assert "--precision" not in argv(retune_cron_workflow(retune_spec()))
    with pytest.raises(ValidationError, match="precision"):
        retune_spec(precision="fp4")
    tpl = templates(promote_cron(image="123.dkr.ecr.us-east-1.amazonaws.com/pdserve:1.2"))["promote"]
    args = tpl["container"]["args"]
    assert args[args.index("--image") + 1] == "123.dkr.ecr.us-east-1.amazonaws.com/pdserve:1.2"


@pytest.mark.parametrize("args, option", [
    (["batch", "workflow", "--input", "s3://pdserve-batch/in.jsonl", "--output", "s3://pdserve-batch/out.jsonl",
      "--endpoint", "http://isvc-predictor.pdserve.svc.cluster.local/openai", "--model", "m$(AWS_SECRET_ACCESS_KEY)"],
     "--model"),
    (["batch", "retune-schedule", "--model-name", "llama8", "--traffic", "s3://pdserve-traffic/t.jsonl",
      "--registered-model", "m1", "--gpu", "$(GPU)"], "--gpu"),
])
def test_a_value_the_kubelet_would_expand_is_refused_naming_its_option(args, option):
    from typer.testing import CliRunner

    from runtime.cli import app

    res = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert res.exit_code == 2 and res.output.startswith(f"error: {option}: "), res.output
    assert "must not contain '$'" in res.output
