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

from runtime.faces.batch import app
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
    with pytest.raises(BatchRunError, match=r"^--output 's3://bucket-only/': needs an object key after the bucket"):
        run_batch(str(inp), "s3://bucket-only/", endpoint="http://h/openai", progress=False)
    with pytest.raises(BatchRunError, match="^--input 's3://b/in.jsonl': bucket 'b' is not a valid"):
        run_batch("s3://b/in.jsonl", str(tmp_path / "o.jsonl"), endpoint="http://h/openai", progress=False)
    for option, args in (("--input", ("", str(tmp_path / "o.jsonl"))), ("--output", (str(inp), " "))):
        with pytest.raises(BatchRunError, match=f"^{option}: empty"):  # not the current folder
            run_batch(*args, endpoint="http://h/openai", progress=False)
    for same in (str(inp), str(tmp_path / "." / "in.jsonl"), str(tmp_path / "sub" / ".." / "in.jsonl")):
        with pytest.raises(BatchRunError, match="is the input file"):
            run_batch(str(inp), same, endpoint="http://h/openai", progress=False)
    link = tmp_path / "link.jsonl"
    link.symlink_to(inp)
    with pytest.raises(BatchRunError, match="is the input file"):
        run_batch(str(inp), str(link), endpoint="http://h/openai", progress=False)
    assert json.loads(inp.read_text())["custom_id"] == "r0"  # the input survived every attempt
    for endpoint in ["http://127.0.0.1:99999/openai", "http://[::1/openai"]:
        with pytest.raises(BatchRunError, match="not a URL"):
            run_batch(str(inp), str(tmp_path / "o.jsonl"), endpoint=endpoint, progress=False)
    with pytest.raises(BatchRunError, match="must not carry credentials") as e:
        run_batch(str(inp), str(tmp_path / "o.jsonl"), endpoint="http://user:hunter2@h/openai", progress=False)
    assert "hunter2" not in str(e.value)
    res = runner.invoke(app, ["run", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o.jsonl"),
                              "--endpoint", "http://h/openai"])
    assert res.exit_code == 2 and "No such file" in " ".join(res.output.split())  # rich wraps at 80 columns


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
    assert res.exit_code == 2 and "PDSERVE_TEST_KEY: the environment variable is not set" in " ".join(
        res.output.split())


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


def test_answers_that_are_not_openai_responses_are_failures_and_never_stop_the_run(standin, tmp_path):
    inp = _write_batch(tmp_path / "in.jsonl", ["html", "bad-gzip", "nan", "fine"])
    out = tmp_path / "out.jsonl"
    s = run_batch(str(inp), str(out), endpoint=standin.url, model="m", max_retries=0, progress=False)
    assert (s.succeeded, s.failed) == (1, 3)
    recs = _out(out)  # every line is valid JSON (no NaN)
    assert recs["r0"]["error"]["code"] == "invalid_response" and recs["r0"]["response"]["status_code"] == 200
    assert recs["r1"]["error"]["code"] == "request_failed" and "Decoding" in recs["r1"]["error"]["message"]
    assert recs["r2"]["error"]["code"] == "invalid_response" and "NaN" in recs["r2"]["error"]["message"]
    assert recs["r3"]["error"] is None
    standin.requests.clear()
    run_batch(str(inp), str(out), endpoint=standin.url, model="m", max_retries=0, progress=False)
    assert sorted(r["body"]["prompt"] for r in standin.requests) == ["bad-gzip", "html", "nan"]  # resume retries


def test_the_output_is_written_in_place_keeping_links_and_permissions(standin, tmp_path):
    import os
    import stat

    inp = _write_batch(tmp_path / "in.jsonl", ["a", "b"])
    real = tmp_path / "results" / "real.jsonl"
    real.parent.mkdir()
    real.write_text("")
    real.chmod(0o600)
    link = tmp_path / "out.jsonl"
    link.symlink_to(real)
    run_batch(str(inp), str(link), endpoint=standin.url, model="m", progress=False)
    assert link.is_symlink() and len(real.read_text().splitlines()) == 2
    assert stat.S_IMODE(real.stat().st_mode) == 0o600
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(BatchRunError, match="not a regular file"):
        run_batch(str(inp), str(fifo), endpoint=standin.url, model="m", progress=False)
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_an_output_of_another_batch_is_refused_untouched(standin, tmp_path):
    out = tmp_path / "out.jsonl"
    run_batch(str(_write_batch(tmp_path / "a.jsonl", ["x", "y", "z"])), str(out), endpoint=standin.url, model="m",
              progress=False)
    before = out.read_text()
    other = tmp_path / "b.jsonl"
    other.write_text(json.dumps({"custom_id": "only", "url": "/v1/completions", "body": {"model": "m",
                                                                                     "prompt": "p"}}) + "\n")
    standin.requests.clear()
    res = runner.invoke(app, ["run", "-i", str(other), "-o", str(out), "--endpoint", standin.url, "--no-progress"])
    assert res.exit_code == 2 and "not in this input" in " ".join(res.output.split())
    assert out.read_text() == before and standin.requests == []


@pytest.mark.parametrize("text", ["notes: keep me\nsecond line\n", '{"custom_id": "r0", "method": "POST"}\n'])
def test_an_output_that_is_no_batch_output_is_refused_untouched(standin, tmp_path, text):
    out = tmp_path / "notes.txt"  # e.g. the input's neighbour named by mistake: resuming would rewrite it
    out.write_text(text)
    res = runner.invoke(app, ["run", "-i", str(_write_batch(tmp_path / "a.jsonl", ["x"])), "-o", str(out),
                              "--endpoint", standin.url, "--model", "m", "--no-progress"])
    assert res.exit_code == 2 and "line 1 is not a batch output line" in " ".join(res.output.split()), res.output
    assert out.read_text() == text and standin.requests == []


def test_an_api_key_from_a_file_secret_has_its_newline_dropped_and_a_bad_one_is_refused(standin, tmp_path,
                                                                                       monkeypatch):
    inp = _write_batch(tmp_path / "in.jsonl", ["a"])
    monkeypatch.setenv("K", "sk-from-file\n")
    res = runner.invoke(app, ["run", "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "--endpoint", standin.url,
                              "--model", "m", "--api-key-env", "K"])
    assert res.exit_code == 0 and [r["auth"] for r in standin.requests] == ["Bearer sk-from-file"]
    monkeypatch.setenv("K", "sk-a b")
    res = runner.invoke(app, ["run", "-i", str(inp), "-o", str(tmp_path / "o2.jsonl"), "--endpoint", standin.url,
                              "--model", "m", "--api-key-env", "K"])
    assert res.exit_code == 2 and "whitespace" in " ".join(res.output.split()) and "sk-a" not in res.output


def test_an_s3_input_splits_lines_like_a_local_file(standin, s3_client, s3_bucket, tmp_path):
    line = json.dumps({"custom_id": "u", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "a\u2028b\x85c"}}, ensure_ascii=False)
    local = tmp_path / "in.jsonl"
    local.write_text(line + "\n", encoding="utf-8")
    s3_client.upload_file(str(local), s3_bucket, "in.jsonl")
    s = run_batch(f"s3://{s3_bucket}/in.jsonl", str(tmp_path / "o.jsonl"), endpoint=standin.url,
                  s3_client=s3_client, progress=False)
    assert s.succeeded == 1 and standin.requests[0]["body"]["prompt"] == "a\u2028b\x85c"


class _FailingUploads:
    """A real S3 client whose uploads fail from the ``fail_from``-th on (fault injection on the real server)."""

    def __init__(self, client, fail_from: int) -> None:
        self._c, self.fail_from, self.uploads = client, fail_from, 0

    def upload_file(self, *a, **kw):
        self.uploads += 1
        if self.uploads >= self.fail_from:
            raise RuntimeError("AccessDenied (injected)")
        return self._c.upload_file(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._c, name)


def test_an_unwritable_s3_output_is_found_before_sending_and_a_failed_last_upload_keeps_the_answers(
        standin, s3_client, s3_bucket, tmp_path, monkeypatch):
    local = _write_batch(tmp_path / "in.jsonl", ["a", "b"])
    s3_client.upload_file(str(local), s3_bucket, "in.jsonl")
    src, dst = f"s3://{s3_bucket}/in.jsonl", f"s3://{s3_bucket}/out.jsonl"
    with pytest.raises(BatchRunError, match="upload failed"):
        run_batch(src, dst, endpoint=standin.url, model="m", s3_client=_FailingUploads(s3_client, 1), progress=False)
    assert standin.requests == []  # refused before the first request

    monkeypatch.chdir(tmp_path)
    res_err = None
    try:
        run_batch(src, dst, endpoint=standin.url, model="m", s3_client=_FailingUploads(s3_client, 2), progress=False)
    except BatchRunError as e:
        res_err = e
    from runtime.batch.run import BatchUploadError

    assert isinstance(res_err, BatchUploadError) and len(standin.requests) == 2
    kept = tmp_path / "pdserve-batch-out.jsonl"
    assert str(kept) in str(res_err) and sorted(_out(kept)) == ["r0", "r1"]
    standin.requests.clear()  # resuming from the kept file sends nothing again
    s = run_batch(src, str(kept), endpoint=standin.url, model="m", s3_client=s3_client, progress=False)
    assert s.resumed == 2 and standin.requests == []


def test_sigterm_mid_run_uploads_the_finished_answers_and_a_rerun_completes(standin, s3_server, s3_client, s3_bucket,
                                                                            tmp_path):
    """What a pod eviction does: the S3 output keeps every answer finished before SIGTERM; no work folder stays."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from runtime.procs import stop_process

    local = _write_batch(tmp_path / "in.jsonl", ["quick"] + [f"slow {i}" for i in range(8)])
    s3_client.upload_file(str(local), s3_bucket, "in.jsonl")
    dst = f"s3://{s3_bucket}/out.jsonl"
    env = {**os.environ, **s3_server.env, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "batch", "run", "-i", f"s3://{s3_bucket}/in.jsonl",
                             "-o", dst, "--endpoint", standin.url, "--model", "m", "--concurrency", "1", "--no-progress"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(standin.requests) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        stop_process(proc, 10)
    assert proc.returncode == 128 + signal.SIGTERM
    got = s3_client.get_object(Bucket=s3_bucket, Key="out.jsonl")["Body"].read().decode().splitlines()
    assert 2 <= len(got) <= 3 and json.loads(got[0])["custom_id"] == "r0"
    assert not list(tmp_path.glob("pdserve-batch-*"))  # the work folder is gone
    s = run_batch(f"s3://{s3_bucket}/in.jsonl", dst, endpoint=standin.url, model="m", s3_client=s3_client,
                  progress=False)
    assert s.resumed == len(got) and s.succeeded == 9 - len(got) and s.failed == 0


def test_the_cli_restores_the_callers_sigterm_handler(standin, tmp_path):
    import signal

    mine = lambda *a: None  # noqa: E731
    old = signal.signal(signal.SIGTERM, mine)
    try:
        res = runner.invoke(app, ["run", "-i", str(_write_batch(tmp_path / "in.jsonl", ["a"])), "-o",
                                  str(tmp_path / "o.jsonl"), "--endpoint", standin.url, "--model", "m"])
        assert res.exit_code == 0 and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


def test_every_404_says_whether_the_model_or_the_endpoint_is_wrong(standin, tmp_path):
    inp = _write_batch(tmp_path / "in.jsonl", ["a", "b"])
    res = runner.invoke(app, ["run", "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "--endpoint", standin.url,
                              "--model", "unknown"])
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and "does not serve that model" in text and "/openai/openai" not in text
    res = runner.invoke(app, ["run", "-i", str(inp), "-o", str(tmp_path / "o2.jsonl"), "--endpoint",
                              standin.url.removesuffix("/openai"), "--model", "m"])
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and f"e.g. {standin.url}?" in text, text


def test_a_non_ascii_api_key_is_refused_and_a_full_disk_keeps_the_answers_for_a_rerun(standin, tmp_path,
                                                                                      monkeypatch):
    import runtime.batch.run as run_mod

    inp = _write_batch(tmp_path / "in.jsonl", ["a"])
    monkeypatch.setenv("K", "sk-ключ-1")
    res = runner.invoke(app, ["run", "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "--endpoint", standin.url,
                              "--model", "m", "--api-key-env", "K"])
    assert res.exit_code == 2 and "non-ASCII" in " ".join(res.output.split()) and "ключ" not in res.output

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_mod, "_run_loop", full)
    with pytest.raises(BatchRunError, match="cannot write: No space left on device; the answers written before "
                                            "are kept"):
        run_batch(str(inp), str(tmp_path / "o3.jsonl"), endpoint=standin.url, model="m", progress=False)
