"""The progress bar of `pdserve batch run` (runtime.batch.run._run_loop) counts the whole batch: a resumed run
starts with the answers kept from the earlier run completed (like tqdm's ``initial``), so a run with half the
answers kept starts at 2/4, and one with every answer kept reads 4/4, never 0/0."""

from __future__ import annotations

import json

import pytest
from rich import progress as rich_progress
from typer.testing import CliRunner

import runtime.batch.run as batch_run
from runtime.batch.requests import output_line
from runtime.cli import app

runner = CliRunner()
BODY = {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


@pytest.fixture
def bar_starts(monkeypatch):
    """Each progress task's (completed, total) when it was added."""
    starts: list[tuple[float, float]] = []
    add_task = rich_progress.Progress.add_task

    def recording(self, *args, **kwargs):
        task = add_task(self, *args, **kwargs)
        t = self._tasks[task]
        starts.append((t.completed, t.total))
        return task

    monkeypatch.setattr(rich_progress.Progress, "add_task", recording)
    return starts


def _send_all(sent: list[str]):
    async def send_all(requests, write, **_):
        for req in requests:
            sent.append(req.custom_id)
            write(output_line(req.custom_id, status_code=200, body=BODY), req, BODY)
    return send_all


def test_a_resumed_run_counts_the_kept_answers_as_completed(tmp_path, monkeypatch, bar_starts):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]}})
                           + "\n" for i in range(4)))
    argv = ["batch", "run", "-i", str(src), "-o", str(out), "--endpoint", "http://127.0.0.1:9/openai"]
    sent: list[str] = []
    monkeypatch.setattr(batch_run, "send_all", _send_all(sent))

    def run() -> str:
        res = runner.invoke(app, argv, env={"COLUMNS": "120"})
        assert res.exit_code == 0, res.output
        return res.stderr

    assert "4/4" in run() and bar_starts[-1] == (0, 4) and len(sent) == 4
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))  # an interrupted run's output
    sent.clear()
    stderr = run()
    assert sent == ["q2", "q3"]
    assert bar_starts[-1] == (2, 4)  # the bar starts where the earlier run stopped
    assert "4/4" in stderr and "0/0" not in stderr and "2/2" not in stderr
    sent.clear()
    stderr = run()  # nothing left to send
    assert sent == [] and bar_starts[-1] == (4, 4)
    assert "4/4" in stderr and "0/0" not in stderr
