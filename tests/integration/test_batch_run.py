"""The batch runner (runtime.batch.run, `pdserve batch run`) against a real HTTP server on 127.0.0.1 and a
real S3 server (SeaweedFS).

Specification: every request gets exactly one output line, sent to the configured endpoint + its allow-listed
path; at most `concurrency` requests are in flight; 429/5xx and connection errors are retried (a 400 is not);
a run with failures exits 1 and a second run sends only the failed requests again; a malformed input sends
nothing and leaves an existing output untouched (exit 2); an API key is sent but never printed or written;
S3 input and output work, and an S3 output resumes like a local one.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from runtime.batch.__main__ import app
from runtime.batch.run import BatchRunError, run_batch
from tests.integration.openai_standin import OpenAIStandin

pytestmark = pytest.mark.integration
runner = CliRunner()


@pytest.fixture
def standin():
    s = OpenAIStandin().start()
    try:
        yield s
    finally:
        s.stop()


def _write_batch(path, prompts, url="/v1/completions"):
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url,
                                        "body": {"prompt": p, "max_tokens": 3}}) + "\n" for i, p in enumerate(prompts)))
    return path


def _out(path):
    return {rec["custom_id"]: rec for rec in map(json.loads, path.read_text().splitlines())}


def test_every_request_gets_one_line_within_the_concurrency_bound(standin, tmp_path):
    inp = _write_batch(tmp_path / "in.jsonl", [f"hello world {i}" for i in range(12)])
    out = tmp_path / "sub" / "out.jsonl"
    s = run_batch(str(inp), str(out), endpoint=standin.url + "/", model="smol", concurrency=3, progress=False)
    lines = _out(out)
    assert sorted(lines) == sorted(f"r{i}" for i in range(12)) and len(out.read_text().splitlines()) == 12
    assert all(rec["response"]["status_code"] == 200 and rec["error"] is None for rec in lines.values())
    assert {r["path"] for r in standin.requests} == {"/openai/v1/completions"}
    assert {r["body"]["model"] for r in standin.requests} == {"smol"}  # the default model filled in
    assert 2 <= standin.max_in_flight <= 3
    assert (s.requests, s.succeeded, s.failed, s.resumed) == (12, 12, 0, 0)
    assert (s.prompt_tokens, s.completion_tokens) == (36, 36)


def test_throttling_is_retried_a_client_error_is_not_and_a_rerun_sends_only_the_failures(standin, tmp_path):
    inp = _write_batch(tmp_path / "in.jsonl", ["fine", "fail-2 then fine", "always-503", "bad"])
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "-i", str(inp), "-o", str(out), "--endpoint", standin.url, "--model", "m",
                              "--max-retries", "2", "--no-progress"])
    assert res.exit_code == 1, res.output
    summary = json.loads(res.stdout.splitlines()[-1])
    assert (summary["succeeded"], summary["failed"]) == (2, 2)
    assert standin.tries == {"fine": 1, "fail-2 then fine": 3, "always-503": 3, "bad": 1}
    lines = _out(out)
    assert lines["r1"]["response"]["status_code"] == 200
    assert lines["r2"]["error"]["code"] == "http_503" and lines["r2"]["response"]["status_code"] == 503
    assert lines["r3"]["error"] == {"code": "http_400", "message": "max_tokens must be positive"}

    standin.requests.clear()
    res = runner.invoke(app, ["run", "-i", str(inp), "-o", str(out), "--endpoint", standin.url, "--model", "m",
                              "--max-retries", "0", "--no-progress"])
    assert res.exit_code == 1
    assert sorted(r["body"]["prompt"] for r in standin.requests) == ["always-503", "bad"]
    again = json.loads(res.stdout.splitlines()[-1])
    assert (again["resumed"], again["succeeded"], again["failed"]) == (2, 0, 2)
    assert len(out.read_text().splitlines()) == 4 and sorted(_out(out)) == ["r0", "r1", "r2", "r3"]


def test_an_unreachable_endpoint_is_recorded_per_request(tmp_path):
    from runtime.engines.vllm_worker import free_port

    inp = _write_batch(tmp_path / "in.jsonl", ["a", "b"])
    out = tmp_path / "out.jsonl"
    s = run_batch(str(inp), str(out), endpoint=f"http://127.0.0.1:{free_port()}/openai", model="m", max_retries=1,
                  progress=False, backoff_s=0.01)
    assert s.failed == 2
    recs = _out(out)
    assert all(r["response"] is None and r["error"]["code"] == "request_failed" and "Connect" in r["error"]["message"]
               for r in recs.values())


def test_a_malformed_input_sends_nothing_and_leaves_the_output_untouched(standin, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "url": "http://10.0.0.1/v1/completions", "body": {"model": "m"}})
                   + "\n{oops\n")
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    res = runner.invoke(app, ["run", "-i", str(inp), "-o", str(out), "--endpoint", standin.url, "--no-progress"])
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert "line 1: url must be one of" in text and "line 2: not JSON" in text and "nothing sent" in text
    assert standin.requests == [] and out.read_text() == "earlier results\n"


def test_bad_options_are_refused_before_anything_is_read(tmp_path):
    inp = _write_batch(tmp_path / "in.jsonl", ["a"])
    for endpoint in ["ftp://host/openai", "http:///openai", "http://h/openai?x=1", "localhost:8080"]:
        with pytest.raises(BatchRunError, match="--endpoint must be an http"):
            run_batch(str(inp), str(tmp_path / "o.jsonl"), endpoint=endpoint, progress=False)
    with pytest.raises(BatchRunError, match=r"needs an object key after the bucket \(s3://bucket/key\)"):
        run_batch(str(inp), "s3://bucket-only/", endpoint="http://h/openai", progress=False)
    with pytest.raises(BatchRunError, match="must not be the input"):
        run_batch(str(inp), str(inp), endpoint="http://h/openai", progress=False)
    res = runner.invoke(app, ["run", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o.jsonl"),
                              "--endpoint", "http://h/openai"])
    assert res.exit_code == 2 and "No such file" in res.output


def test_the_api_key_is_sent_but_never_printed_or_written(standin, tmp_path, monkeypatch):
    secret = "sk-batch-very-secret-123"
    monkeypatch.setenv("PDSERVE_TEST_KEY", secret)
    inp = _write_batch(tmp_path / "in.jsonl", ["a", "always-503"])
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["run", "-i", str(inp), "-o", str(out), "--endpoint", standin.url, "--model", "m",
                              "--api-key-env", "PDSERVE_TEST_KEY", "--max-retries", "0"])
    assert {r["auth"] for r in standin.requests} == {f"Bearer {secret}"}
    assert secret not in res.output and secret not in out.read_text()
    monkeypatch.delenv("PDSERVE_TEST_KEY")
    res = runner.invoke(app, ["run", "-i", str(inp), "-o", str(out), "--endpoint", standin.url,
                              "--api-key-env", "PDSERVE_TEST_KEY"])
    assert res.exit_code == 2 and "PDSERVE_TEST_KEY: the environment variable is not set" in res.output


def test_s3_input_and_output_and_an_s3_resume(standin, s3_client, s3_bucket, tmp_path):
    local = _write_batch(tmp_path / "in.jsonl", ["x one", "fail-9 busy", "y two"])
    s3_client.upload_file(str(local), s3_bucket, "batches/in.jsonl")
    src, dst = f"s3://{s3_bucket}/batches/in.jsonl", f"s3://{s3_bucket}/results/out.jsonl"
    s = run_batch(src, dst, endpoint=standin.url, model="m", max_retries=0, s3_client=s3_client, progress=False)
    assert (s.succeeded, s.failed) == (2, 1)
    got = s3_client.get_object(Bucket=s3_bucket, Key="results/out.jsonl")["Body"].read().decode()
    assert sorted(json.loads(x)["custom_id"] for x in got.splitlines()) == ["r0", "r1", "r2"]

    standin.requests.clear()
    s = run_batch(src, dst, endpoint=standin.url, model="m", max_retries=9, s3_client=s3_client, progress=False,
                  backoff_s=0.01)
    assert (s.resumed, s.succeeded, s.failed) == (2, 1, 0)
    assert [r["body"]["prompt"] for r in standin.requests][-1] == "fail-9 busy"
    got = s3_client.get_object(Bucket=s3_bucket, Key="results/out.jsonl")["Body"].read().decode()
    recs = {json.loads(x)["custom_id"]: json.loads(x) for x in got.splitlines()}
    assert len(got.splitlines()) == 3 and all(r["response"]["status_code"] == 200 for r in recs.values())
    with pytest.raises(BatchRunError, match="no such object"):
        run_batch(f"s3://{s3_bucket}/batches/missing.jsonl", dst, endpoint=standin.url, s3_client=s3_client,
                  progress=False)
