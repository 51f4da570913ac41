"""An interrupted `pdserve batch run` (Ctrl-C, SIGTERM) prints the JSON summary of what it did so far and how to
resume, and exits 128 + the signal (130, 143); the finished answers stay in the output and a rerun sends the rest."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import runtime.batch.run as batch_run
from runtime.batch.requests import output_line
from runtime.cli import app

runner = CliRunner()
BODY = {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


def _input(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]}})
                           + "\n" for i in range(3)))
    return src


def _answering(stop: BaseException | None, sent: list[str]):
    async def send_all(requests, write, **_):
        for req in requests:
            if stop is not None and sent:
                raise stop
            sent.append(req.custom_id)
            write(output_line(req.custom_id, status_code=200, body=BODY), req, BODY)
    return send_all


@pytest.mark.parametrize("stop,status,name", [(KeyboardInterrupt(), 130, "SIGINT"), (SystemExit(143), 143, "SIGTERM")])
def test_an_interrupted_run_prints_its_summary_and_a_rerun_sends_the_rest(tmp_path, monkeypatch, stop, status, name):
    src, out = _input(tmp_path), tmp_path / "out.jsonl"
    argv = ["batch", "run", "-i", str(src), "-o", str(out), "--endpoint", "http://127.0.0.1:9/openai",
            "--no-progress"]
    sent: list[str] = []
    monkeypatch.setattr(batch_run, "send_all", _answering(stop, sent))
    res = runner.invoke(app, argv, env={"COLUMNS": "300"})
    assert res.exit_code == status, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["interrupted"] == name and summary["succeeded"] == 1 and summary["requests"] == 3
    assert f"interrupted by {name}" in res.stderr and "run the same command again to send the rest" in res.stderr
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == ["q0"]
    sent.clear()
    monkeypatch.setattr(batch_run, "send_all", _answering(None, sent))
    res = runner.invoke(app, argv)
    assert res.exit_code == 0, res.output
    assert sent == ["q1", "q2"] and json.loads(res.stdout.strip().splitlines()[-1])["resumed"] == 1
    assert "interrupted" not in json.loads(res.stdout.strip().splitlines()[-1])
