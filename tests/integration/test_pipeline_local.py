"""The KFP pipeline `stage_tune_promote` runs through kfp.local against a real S3 server (SeaweedFS on
127.0.0.1) and real MLflow (sqlite), with a tiny random-weight Llama model.

Specification:
* the staged folder is a verified copy of the S3 prefix (marker + manifest);
* MLflow holds one parent run and one child run per candidate, and the registry's `champion` is the version
  the pipeline returned;
* promote writes schema-valid KServe/Kubernetes YAML naming the tuned TPs;
* an SLO no candidate meets fails the pipeline, naming the best candidate's predicted TTFT/ITL, and registers
  nothing;
* a missing bucket fails the pipeline and leaves nothing under the FSx path;
* a parameter tune would refuse (unknown GPU, bad registered model name, a traffic_trace_uri that is neither an
  s3:// object URI nor an absolute path) fails before anything is staged.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from runtime.modelfiles.gguf_convert import convert_smollm2, make_tiny_random_model
    from runtime.paths import state_dir

    tokenizer_dir = convert_smollm2(state_dir() / "models" / "smollm2-135m-instruct")
    return make_tiny_random_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", tokenizer_dir=tokenizer_dir)


@pytest.fixture
def s3_env(s3_server):
    """The server's credentials as env for kfp.local's step subprocesses (never pipeline parameters)."""
    old = {k: os.environ.get(k) for k in s3_server.env}
    os.environ.update(s3_server.env)
    yield s3_server
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _run(tmp_path: Path, s3_server, source_uri: str, **overrides):
    from pipelines.stage_tune_promote import run_local

    args = dict(
        source_uri=source_uri, model_name="tiny-llama", fsx_root=str(tmp_path / "fsx"),
        s3_endpoint_url=s3_server.endpoint_url, mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        registered_model="tiny-llama-pd",
        isl_tokens=1500,  # the tiny model's context is 2048 tokens (the tuner refuses ISL + OSL beyond it)
    )
    args.update(overrides)
    return run_local(pipeline_root=tmp_path / "kfp", **args)


def test_pipeline_stages_tunes_registers_and_promotes(tmp_path, s3_env, s3_client, s3_bucket, tiny_model):
    from mlflow.tracking import MlflowClient

    from runtime.deploy.validate import validate_objects
    from runtime.staging.manifest import verify_staged
    from runtime.staging.s3 import upload_folder
    from runtime.tracking.mlflow_runs import load_champion

    upload_folder(tiny_model, s3_bucket, "tiny-llama/", s3_client)
    out = _run(tmp_path, s3_env, f"s3://{s3_bucket}/tiny-llama/")

    staged = tmp_path / "fsx" / "models" / "tiny-llama"
    manifest = verify_staged(staged)
    assert {f.path for f in manifest.files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert (staged / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    version, spec = load_champion(uri, "tiny-llama-pd")
    assert out["champion_version"] == version
    assert spec.model.path == str(staged)
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1
    assert len(children) == 16  # prefill TP × decode TP in {1,2,4,8}², infeasible ones included

    objs = list(yaml.safe_load_all(Path(out["manifests"]).read_text()))
    validate_objects(objs)
    kinds = {o["kind"] for o in objs}
    assert {"ClusterServingRuntime", "InferenceService", "Deployment"} <= kinds
    tps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    assert any("prefill" in n for n in tps) and any("decode" in n for n in tps)


def test_infeasible_slo_fails_the_pipeline_and_names_the_best(tmp_path, s3_env, s3_client, s3_bucket, tiny_model,
                                                               capfd):
    from runtime.staging.s3 import upload_folder

    upload_folder(tiny_model, s3_bucket, "tiny-llama/", s3_client)
    with pytest.raises(RuntimeError):
        _run(tmp_path, s3_env, f"s3://{s3_bucket}/tiny-llama/", ttft_p90_ms=0.001, itl_p90_ms=0.001)
    logs = capfd.readouterr()
    text = logs.out + logs.err
    assert "InfeasibleSLOError" in text
    assert "TTFT" in text and "ITL" in text


def test_missing_bucket_fails_and_leaves_nothing(tmp_path, s3_env):
    with pytest.raises(RuntimeError):
        _run(tmp_path, s3_env, "s3://no-such-bucket-pdserve/tiny-llama/")
    fsx = tmp_path / "fsx"
    assert not (fsx / "models" / "tiny-llama").exists()
    # Only the stagers' advisory lock file may remain (fcntl locks are never unlinked, to stay race-free).
    leftovers = [p for p in fsx.rglob("*") if p.is_file() and not p.name.endswith(".pdserve-lock")] if fsx.exists() else []
    assert leftovers == []


@pytest.mark.parametrize("bad", [{"gpu": "H100-SMX"}, {"registered_model": "bad/name?"}, {"precision": "fp16"},
                                 {"traffic_trace_uri": "traces/traffic.jsonl"}])
def test_bad_cheap_parameter_fails_before_staging(tmp_path, capfd, bad):
    from pipelines.stage_tune_promote import run_local
    from runtime.modelfiles.catalog import CATALOG_DIR

    src = tmp_path / "src"  # a local source: staging it would succeed, so only the order can keep fsx empty
    src.mkdir()
    (src / "config.json").write_text((CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json").read_text())
    (src / "model.safetensors").write_bytes(b"\0" * (1 << 20))  # stands for tens of GB of weights

    args = dict(source_uri=str(src), model_name="m", fsx_root=str(tmp_path / "fsx"),
                mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", registered_model="m-pd") | bad
    with pytest.raises(RuntimeError):
        run_local(pipeline_root=tmp_path / "kfp", **args)
    logs = capfd.readouterr()
    assert next(iter(bad.values())) in logs.out + logs.err  # the step's error names the bad value
    assert not (tmp_path / "fsx" / "models" / "m").exists()


def test_pipeline_sizes_the_champion_for_a_traffic_trace_under_fsx_root(tmp_path):
    """traffic_trace_uri (a path under fsx_root; the s3:// form: test_steps_tune_trace_s3.py) reaches tune-tp
    through the compiled wiring: the champion records the trace's mean lengths and arrival rate (request_rate_per_s
    left at its default, 0: not chosen) and the MLflow parent run the URI."""
    import json

    from mlflow.tracking import MlflowClient

    from pipelines.stage_tune_promote import run_local
    from runtime.modelfiles.catalog import CATALOG_DIR
    from runtime.tracking.mlflow_runs import load_champion

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json").read_text())
    (src / "model.safetensors").write_bytes(b"\0" * 16)
    trace = tmp_path / "fsx" / "traces" / "traffic.jsonl"  # mean ISL 1500, OSL 100; 29 gaps of 1 s: 1.0/s
    trace.parent.mkdir(parents=True)
    trace.write_text("".join(json.dumps({"timestamp": k * 1000, "input_length": 1000 + 1000 * (k % 2),
                                         "output_length": 100}) + "\n" for k in range(30)))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = run_local(pipeline_root=tmp_path / "kfp", source_uri=str(src), model_name="m",
                    fsx_root=str(tmp_path / "fsx"), mlflow_tracking_uri=uri, registered_model="m-pd",
                    traffic_trace_uri=str(trace))
    version, spec = load_champion(uri, "m-pd")
    assert out["champion_version"] == version
    assert (spec.workload.isl_tokens, spec.workload.osl_tokens, spec.workload.request_rate_per_s) == (1500, 100, 1.0)
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parent.data.params["traffic_trace_uri"] == str(trace)
