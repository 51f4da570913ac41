"""The pipeline's tune step reads `traffic_trace_uri` from a real S3 server (SeaweedFS on 127.0.0.1) with the
staging step's client (the `s3_endpoint_url` parameter, credentials from the environment only) and logs to a
real sqlite MLflow.

Specification:
* an s3:// trace sizes the champion for the trace's mean ISL/OSL and arrival rate, and the MLflow parent run
  records the URI as the param `traffic_trace_uri`;
* a missing object or wrong credentials fail the step naming the URI, never the secret, with nothing logged;
* objects under a prefix that are not read as trace are named in a warning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.usecases.tune import AUTO_REQUEST_RATE, TuneRequest, tune
from runtime.tracking.traces import TrafficTraceError

pytestmark = pytest.mark.integration

LLAMA_8B = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json"
# 40 requests, mean ISL 2000 (1000/3000), mean OSL 100 (50/150), one every 500 ms: 39 gaps in 19.5 s = 2.0/s
TRACE = "".join(json.dumps({"timestamp": k * 500, "input_length": 1000 + 2000 * (k % 2),
                            "output_length": 50 + 100 * (k % 2)}) + "\n" for k in range(40))


@pytest.fixture
def staged(tmp_path) -> Path:
    from tests.usecase_requests import stage_config

    dest = stage_config(LLAMA_8B, tmp_path / "fsx" / "models" / "llama8", tmp_path)
    return dest


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The server's key pair in the environment (as the pdserve-s3 Secret gives the step), no endpoint: the
    step must use its s3_endpoint_url parameter."""
    import os

    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in s3_server.env.items():
        if k != "AWS_ENDPOINT_URL_S3":
            monkeypatch.setenv(k, v)
    return s3_server


def _tune(staged: Path, db: Path, uri: str, endpoint: str):
    return tune(TuneRequest(
        model_path=str(staged), model_name="llama8", gpu="H100-SXM", precision="bf16", ttft_p90_ms=2000.0,
        itl_p90_ms=50.0, isl_tokens=3000, osl_tokens=150, request_rate_per_s=AUTO_REQUEST_RATE,
        mlflow_tracking_uri=f"sqlite:///{db}", registered_model="llama8-pd", traffic_trace_uri=uri,
        s3_endpoint_url=endpoint, fsx_root=str(staged.parents[1])))


def test_an_s3_trace_sizes_the_champion_and_is_recorded_in_mlflow(s3_env, s3_client, s3_bucket, staged, tmp_path):
    from mlflow.tracking import MlflowClient

    from runtime.tracking.mlflow_runs import load_champion

    s3_client.put_object(Bucket=s3_bucket, Key="traffic/2026-12-01.jsonl", Body=TRACE.encode())
    uri = f"s3://{s3_bucket}/traffic/2026-12-01.jsonl"
    db = tmp_path / "mlflow.db"
    out = _tune(staged, db, uri, s3_env.endpoint_url)

    version, spec = load_champion(f"sqlite:///{db}", "llama8-pd")
    assert out.champion_version == version
    assert (spec.workload.isl_tokens, spec.workload.osl_tokens) == (2000, 100)
    assert spec.workload.request_rate_per_s == pytest.approx(2.0)
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parent.data.params["traffic_trace_uri"] == uri
    assert parent.data.params["isl_tokens"] == "2000" and parent.data.params["request_rate_per_s"] == "2"


def test_a_missing_object_or_wrong_credentials_name_the_uri_not_the_secret(s3_env, s3_bucket, staged, tmp_path,
                                                                          monkeypatch):
    db = tmp_path / "mlflow.db"
    uri = f"s3://{s3_bucket}/traffic/none.jsonl"
    with pytest.raises(TrafficTraceError, match=r"traffic_trace_uri: s3://.*/traffic/none\.jsonl: .*NoSuchKey"):
        _tune(staged, db, uri, s3_env.endpoint_url)

    secret = "wrong-secret-0123456789abcdef"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with pytest.raises(TrafficTraceError) as e:
        _tune(staged, db, uri, s3_env.endpoint_url)
    assert str(e.value).startswith(f"traffic_trace_uri: {uri}: cannot read the object from S3")
    assert secret not in str(e.value) and s3_env.access_key_id not in str(e.value)
    assert not db.exists()  # nothing logged or registered


def test_a_prefix_of_shipped_traffic_is_one_trace(s3_env, s3_client, s3_bucket, staged, tmp_path):
    """traffic_trace_uri s3://bucket/prefix/ reads what `pdserve promote --traffic-upload` ships there (a folder
    per runtime pod, one object per shipment) as one trace: both pods' requests and their merged arrival rate;
    an empty prefix says so, naming the URI."""
    pod_a = "".join(json.dumps({"timestamp": 1_764_000_000_000 + k * 1000, "input_length": 1000,
                                "output_length": 50}) + "\n" for k in range(20))
    pod_b = "".join(json.dumps({"timestamp": 1_764_000_000_500 + k * 1000, "input_length": 3000,
                                "output_length": 150}) + "\n" for k in range(20))
    s3_client.put_object(Bucket=s3_bucket, Key="traffic/llama8/pod-a/1-0-9.jsonl", Body=pod_a.encode())
    s3_client.put_object(Bucket=s3_bucket, Key="traffic/llama8/pod-b/1-0-9.jsonl", Body=pod_b.encode())
    s3_client.put_object(Bucket=s3_bucket, Key="traffic/llama8/README.txt", Body=b"not a trace")
    s3_client.put_object(Bucket=s3_bucket, Key="traffic/other/pod-c/1-0-9.jsonl", Body=pod_a.encode())  # not ours
    outcome = _tune(staged, tmp_path / "mlflow.db", f"s3://{s3_bucket}/traffic/llama8/", s3_env.endpoint_url)
    assert outcome.notes[:2] == [  # said, not skipped silently; then the workload as `pdserve tune` says it
        f"traffic_trace_uri: 1 file(s) under s3://{s3_bucket}/traffic/llama8/ not read as trace: README.txt (not "
        ".jsonl, .json or .csv)",
        f"workload: s3://{s3_bucket}/traffic/llama8/: 40 requests over 19.5 s (40 sampled), mean ISL 2000, mean "
        "OSL 100 tokens, at 2 requests/s"]
    from runtime.tracking.mlflow_runs import load_champion

    _, spec = load_champion(f"sqlite:///{tmp_path / 'mlflow.db'}", "llama8-pd")
    assert (spec.workload.isl_tokens, spec.workload.osl_tokens) == (2000, 100)
    assert spec.workload.request_rate_per_s == pytest.approx(39 / 19.5)  # 40 arrivals of both pods in 19.5 s
    with pytest.raises(TrafficTraceError, match=rf"traffic_trace_uri: s3://{s3_bucket}/traffic/none/: no .jsonl"):
        _tune(staged, tmp_path / "mlflow2.db", f"s3://{s3_bucket}/traffic/none/", s3_env.endpoint_url)


@pytest.mark.parametrize("objects", [
    {"t/a.jsonl": b""},  # a pod that shipped an empty object: no trace file in the folder
    {"t/a.jsonl": TRACE.encode(), "t/b.csv": b"ContextTokens,GeneratedTokens\n1,1\n"},  # two formats
    {"t/a.jsonl": b'{"timestamp": 1, "input_length": 0, "output_length": 0}\n'},  # no valid request
])
def test_a_bad_prefix_is_named_by_its_uri_never_by_the_temporary_folder(s3_client, s3_bucket, objects):
    from runtime.tracking.traces import fetch_trace_workload

    for key, body in objects.items():
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=body)
    with pytest.raises(TrafficTraceError) as e:
        fetch_trace_workload(f"s3://{s3_bucket}/t/", s3_client=s3_client)
    assert f"s3://{s3_bucket}/t/" in str(e.value) and "pdserve-trace-" not in str(e.value)
