"""Specification of `python -m runtime.staging`, the stager's one-shot entry point (Jobs, init
containers, bench/staging.py): one JSON line on success, exit 1 with the error on stderr and the
destination untouched on a staging failure, exit 2 naming the option on bad arguments, and for a bad
SOURCE or DEST the exit status and `error:` line of `pdserve stage`. Each check runs the module in a
fresh interpreter, as a container would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.staging.__main__ import build_parser, main
from runtime.staging.manifest import read_marker

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "runtime.staging", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    d = tmp_path / "src"
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 64}')
    (d / "model.safetensors").write_bytes(os.urandom(200_000))
    (d / "pytorch_model.bin").write_bytes(os.urandom(1000))
    (d / "notes.txt").write_text("not a model file")
    return d


def test_stages_and_prints_one_json_line(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "fsx" / "models" / "m"
    r = _run(str(src), str(dest), "--part-size-mib", "1", "--concurrency", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["path"] == str(dest) and out["files"] == 2 and out["unchanged"] is False
    assert out["bytes"] == out["fetched_bytes"] == 200_000 + len('{"hidden_size": 64}')
    m = read_marker(dest)  # published with a valid marker; default selection skips .bin and notes
    assert sorted(f.path for f in m.files) == ["config.json", "model.safetensors"]
    assert (dest / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()

    again = json.loads(_run(str(src), str(dest)).stdout)
    assert again["unchanged"] is True and again["fetched_bytes"] == 0


def test_include_exclude_and_record_sha256(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    r = _run(str(src), str(dest), "--include", "*", "--exclude", "*.bin", "--record-sha256", "--no-fsync")
    assert r.returncode == 0, r.stderr
    m = read_marker(dest)
    assert sorted(f.path for f in m.files) == ["config.json", "model.safetensors", "notes.txt"]
    assert all(f.sha256 and len(f.sha256) == 64 for f in m.files)


def _cli_error(*args: str) -> tuple[int, list[str]]:
    """`pdserve stage ARGS`: its exit status and its `error:` lines."""
    from typer.testing import CliRunner

    from runtime.cli import app

    res = CliRunner().invoke(app, ["stage", *args], env={"COLUMNS": "1000"})
    return res.exit_code, [line for line in res.output.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize(("files", "extra", "code", "problem"), [
    (("config.json", "tokenizer.json"), [], 2, "no weight file"),  # a model folder whose weights were never copied
    (("config.json", "tokenizer.json"), ["--include", "*.gguf"], 2, "no file matches"),
    (None, [], 2, "local folder does not exist"),
    ((), [], 2, "folder holds no files"),  # an empty source: nothing to stage, a bad value
])
def test_a_source_without_weights_exits_as_pdserve_stage_does_with_its_message(
        tmp_path: Path, files: tuple[str, ...] | None, extra: list[str], code: int, problem: str) -> None:
    src = tmp_path / "src"
    if files is not None:
        src.mkdir()
        for name in files:
            (src / name).write_text("{}")
    dest = tmp_path / "m"
    r = _run(str(src), str(dest), *extra)
    assert r.returncode == code, r.stderr
    assert r.stdout == "" and not dest.exists()
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: source {src}: ") and problem in lines[0], r.stderr
    assert _cli_error(str(src), str(dest), *extra) == (code, lines)


def test_refuses_a_folder_that_was_not_staged_as_pdserve_stage_does(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "precious.txt").write_text("keep me")
    r = _run(str(src), str(dest))
    assert r.returncode == 2 and "not a pdserve-staged folder" in r.stderr
    assert (dest / "precious.txt").read_text() == "keep me"
    assert _cli_error(str(src), str(dest)) == (2, r.stderr.splitlines())


def test_progress_bar_goes_to_stderr_and_stdout_keeps_one_json_line(src: Path, tmp_path: Path) -> None:
    r = _run(str(src), str(tmp_path / "m"), "--progress")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 1 and json.loads(r.stdout)["files"] == 2
    assert "stage" in r.stderr  # the bar


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_unwritable_stdout_after_publishing_exits_3_not_1(src: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "runtime.staging", str(src), str(tmp_path / "m")], stdout=full,
                           stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 3
    assert "staged" in r.stderr and "Traceback" not in r.stderr
    assert read_marker(tmp_path / "m").files  # published all the same


def test_destination_errors_are_one_line_not_a_traceback(src: Path, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        r = _run(str(src), str(ro / "m"))
    finally:
        ro.chmod(0o755)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


@pytest.mark.parametrize(("args", "named"), [
    (["--concurrency", "0"], "--concurrency"),
    (["--part-size-mib", "0"], "--part-size-mib"),
    (["--s3-transport", "carrier-pigeon"], "--s3-transport"),
    (["--concurrency", "many"], "--concurrency"),
    (["--concurrency", "300"], "--concurrency"),
    (["--endpoint-url", "notaurl"], "--endpoint-url"),
    (["--endpoint-url", "http://[::1"], "--endpoint-url"),
    (["--read-timeout-s", "0"], "--read-timeout-s"),
    (["--free-space-margin-mib", "-1"], "--free-space-margin-mib"),
])
def test_bad_options_exit_2_naming_the_option(src: Path, tmp_path: Path, args: list[str], named: str) -> None:
    r = _run(str(src), str(tmp_path / "m"), *args)
    assert r.returncode == 2
    assert named in r.stderr and "usage:" in r.stderr
    assert not (tmp_path / "m").exists()


def test_empty_destination_is_a_usage_error(src: Path) -> None:
    r = _run(str(src), "")
    assert r.returncode == 2 and "empty destination" in r.stderr


def test_main_in_process_returns_status_and_help_explains_every_option(src: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert main([str(src), str(tmp_path / "m"), "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == 2
    assert main([str(tmp_path / "missing"), str(tmp_path / "m2")]) == 2
    for action in build_parser()._actions:
        assert action.help, f"{action.dest} has no help text"


def test_oserror_on_the_destination_side_is_reported_not_raised(src: Path, tmp_path: Path, capsys,  # noqa: ANN001
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.staging.stage as stage_mod

    def refuse(self):  # noqa: ANN001, ANN202 - what a read-only FSx mount answers
        raise OSError(30, "Read-only file system", str(tmp_path / ".m.pdserve-lock"))

    monkeypatch.setattr(stage_mod.Stager, "run", refuse)
    assert main([str(src), str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Read-only file system" in err and ".m.pdserve-lock" in err


def test_an_endpoint_that_never_answers_fails_with_warnings_per_attempt(tmp_path: Path) -> None:
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # accepts and never answers
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1",
                   PYTHONPATH=str(REPO))
        r = subprocess.run([sys.executable, "-m", "runtime.staging", "s3://bkt/m/", str(tmp_path / "m"),
                            "--endpoint-url", f"http://127.0.0.1:{srv.getsockname()[1]}", "--read-timeout-s", "0.3"],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    finally:
        stop.set()
        t.join(5)
        for c in held:
            c.close()
        srv.close()
    assert r.returncode == 1 and "error: " in r.stderr
    assert "ListObjectsV2 attempt 1 of 8 failed" in r.stderr and "retrying" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "m").exists()
