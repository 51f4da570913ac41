"""Resuming `pdserve batch run` after the input was edited (runtime.batch.run, runtime.batch.requests), against a
real OpenAI stand-in on 127.0.0.1 (tests/integration/openai_standin.py: stdlib HTTP, answers in milliseconds).

Specification: each output line records the hash of the url and body it answers; a resumed run sends again every
request whose url or body (the model filled in by --model included) differs from the one answered, counts them as
``changed`` in the summary and says so on stderr, and drops the old answer: the output then holds exactly one line
per custom_id, the new answer for an edited request and the kept answers, byte for byte, for the others. A line
without the hash (an output written without it) is still resumed by custom_id alone.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from runtime.batch.run import run_batch
from runtime.faces.batch import app
from tests.integration.openai_standin import OpenAIStandin

runner = CliRunner()
HASH = "request_sha256"  # spelled out: the output format is a contract with the files earlier runs wrote


@pytest.fixture
def standin():
    s = OpenAIStandin(delay_s=0.0).start()
    try:
        yield s
    finally:
        s.stop()


def _req(cid, prompt, max_tokens=3, url="/v1/completions", **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, **extra}
    if url == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **extra}
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _write(path, reqs):
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return path


def _lines(path):
    """``{custom_id: raw line}``; fails when a custom_id has more than one line."""
    raw = path.read_text().splitlines()
    by_id = {json.loads(line)["custom_id"]: line for line in raw}
    assert len(by_id) == len(raw), raw
    return by_id


def _text(line):
    return json.loads(line)["response"]["body"]["choices"][0]["text"]


def _run(inp, out, url, *extra):
    return runner.invoke(app, ["run", "-i", str(inp), "-o", str(out), "--endpoint", url, "--model", "m",
                               "--max-retries", "0", "--no-progress", *extra])


@pytest.mark.parametrize("edit", [
    pytest.param({"max_tokens": 5}, id="max_tokens"),
    pytest.param({"prompt": "two words"}, id="prompt"),
    pytest.param({"model": "other"}, id="model"),
    pytest.param({"url": "/v1/chat/completions"}, id="url"),
])
def test_an_edited_request_is_sent_again_and_its_new_answer_replaces_the_old(standin, tmp_path, edit):
    reqs = [_req(f"r{i}", f"p{i}") for i in range(4)]
    inp, out = _write(tmp_path / "in.jsonl", reqs), tmp_path / "out.jsonl"
    res = _run(inp, out, standin.url)
    assert res.exit_code == 0, res.output
    first = _lines(out)
    assert sorted(first) == ["r0", "r1", "r2", "r3"]

    url = edit.get("url", "/v1/completions")
    body = {k: v for k, v in edit.items() if k != "url"}
    reqs[2] = _req("r2", body.pop("prompt", "p2"), body.pop("max_tokens", 3), url=url, **body)
    _write(inp, reqs)
    standin.requests.clear()
    res = _run(inp, out, standin.url)
    assert res.exit_code == 0, res.output
    assert len(standin.requests) == 1  # only the edited one, as edited
    sent = standin.requests[0]
    assert sent["path"] == "/openai" + url and sent["body"] == {**reqs[2]["body"], "model": reqs[2]["body"].get(
        "model", "m")}
    summary = json.loads(res.stdout.splitlines()[-1])
    assert (summary["requests"], summary["resumed"], summary["changed"], summary["succeeded"]) == (4, 3, 1, 1)
    assert "1 request(s) had been edited in the input" in res.stderr
    assert all(len(json.loads(line)[HASH]) == 64 for line in first.values())

    after = _lines(out)  # exactly one line per custom_id: the stale answer is gone
    assert sorted(after) == ["r0", "r1", "r2", "r3"]
    assert {cid: after[cid] for cid in ("r0", "r1", "r3")} == {cid: first[cid] for cid in ("r0", "r1", "r3")}
    assert after["r2"] != first["r2"]
    assert _text(after["r2"]) == " ok" * reqs[2]["body"]["max_tokens"]
    assert json.loads(after["r2"])[HASH] != json.loads(first["r2"])[HASH]

    standin.requests.clear()  # and a third run finds every answer current
    res = _run(inp, out, standin.url)
    summary = json.loads(res.stdout.splitlines()[-1])
    assert res.exit_code == 0 and standin.requests == [] and (summary["resumed"], summary["changed"]) == (4, 0)
    assert _lines(out) == after


def test_another_default_model_resends_only_the_lines_that_name_none(standin, tmp_path):
    inp = _write(tmp_path / "in.jsonl", [_req("a", "x"), _req("b", "y", model="own")])
    out = tmp_path / "out.jsonl"
    assert _run(inp, out, standin.url).exit_code == 0
    standin.requests.clear()
    res = _run(inp, out, standin.url, "--model", "m2")  # the last --model wins
    assert res.exit_code == 0, res.output
    assert [(r["body"]["prompt"], r["body"]["model"]) for r in standin.requests] == [("x", "m2")]
    assert json.loads(res.stdout.splitlines()[-1])["changed"] == 1
    assert json.loads(_lines(out)["a"])["response"]["body"]["model"] == "m2"


def test_the_stale_answer_is_dropped_even_when_the_edited_request_fails(standin, tmp_path):
    """The failed resend leaves a failed line, never the old 2xx answer beside it or in its place."""
    reqs = [_req("a", "x"), _req("b", "y")]
    inp, out = _write(tmp_path / "in.jsonl", reqs), tmp_path / "out.jsonl"
    assert run_batch(str(inp), str(out), endpoint=standin.url, model="m", progress=False).succeeded == 2
    _write(inp, [reqs[0], _req("b", "bad")])  # the stand-in answers 400 to this prompt
    s = run_batch(str(inp), str(out), endpoint=standin.url, model="m", max_retries=0, progress=False)
    after = _lines(out)
    assert sorted(after) == ["a", "b"] and json.loads(after["b"])["error"]["code"] == "http_400"
    assert (s.resumed, s.changed, s.succeeded, s.failed) == (1, 1, 0, 1)


def test_lines_without_the_hash_are_resumed_by_custom_id(standin, tmp_path):
    """An output written without the hash cannot tell an edited request: its answers are kept as they are."""
    reqs = [_req("a", "x"), _req("b", "y")]
    inp, out = _write(tmp_path / "in.jsonl", reqs), tmp_path / "out.jsonl"
    assert run_batch(str(inp), str(out), endpoint=standin.url, model="m", progress=False).succeeded == 2
    old = []
    for line in out.read_text().splitlines():
        rec = json.loads(line)
        del rec[HASH]
        old.append(json.dumps(rec))
    out.write_text("\n".join(old) + "\n")
    _write(inp, [reqs[0], _req("b", "y", max_tokens=7)])
    standin.requests.clear()
    s = run_batch(str(inp), str(out), endpoint=standin.url, model="m", progress=False)
    assert standin.requests == [] and (s.resumed, s.changed) == (2, 0)
    assert sorted(_lines(out)) == ["a", "b"]
