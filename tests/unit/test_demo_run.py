"""run_demo's own wiring, every step faked at its module: a bad --state-dir fails before any work (StateDirError,
the CLI's `error: --state-dir ...` line and exit 2), worker/runtime logs go to <state-dir>/logs, and summary.json
is strict JSON (a missing TTFT is null, never a bare NaN)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

import pytest

import runtime.demo as demo
from runtime.demo import ChatResult, DemoSettings, run_demo


def test_a_state_dir_that_is_a_file_is_a_clear_error(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(demo.StateDirError) as exc:
        run_demo(DemoSettings(state_dir=f))
    assert str(exc.value) == f"--state-dir {f}: is a file, not a folder"


def test_a_state_dir_below_a_file_is_a_clear_error(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(demo.StateDirError, match=r"^--state-dir .*afile/sub: cannot create .*afile"):
        demo.check_state_dir(f / "sub")


def test_the_cli_exits_2_for_a_state_dir_that_is_a_file_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from runtime.cli import app

    f = tmp_path / "afile"
    f.write_text("x")
    res = CliRunner().invoke(app, ["demo", "--state-dir", str(f)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and res.output == f"error: --state-dir {f}: is a file, not a folder\n", res.output
    assert f.read_text() == "x"


def test_check_state_dir_creates_the_demo_and_logs_folders(tmp_path):
    state = demo.check_state_dir(tmp_path / "new")
    assert state == (tmp_path / "new").resolve()
    assert (state / "demo").is_dir() and (state / "logs").is_dir()


@pytest.fixture
def faked_steps(tmp_path, monkeypatch):
    """Replace each step run_demo imports with a recorder; return what the fakes saw."""
    seen: dict = {}
    model_dir = tmp_path / "fsx" / "models" / "m"

    class FakeS3:
        def __init__(self, path):
            seen["s3_dir"] = path
        endpoint_url, env, ports = "http://127.0.0.1:1", {}, {"s3.port": 1}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen["s3_stopped"] = True
            return None

        def client(self):
            return None

    class FakeDeployment:
        runtime_url, decode_metrics_url = "http://runtime", "http://decode/metrics"

        def __init__(self, spec, model_path, **kwargs):
            seen["deployment_kwargs"] = kwargs
            seen["deployment_tmp"] = (os.environ.get("TMPDIR"), tempfile.gettempdir())

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    spec = types.SimpleNamespace(model=types.SimpleNamespace(path=str(model_dir), name="m"),
                                 prefill=types.SimpleNamespace(tp=1), decode=types.SimpleNamespace(tp=1),
                                 gpu="H100-SXM")
    fakes = {
        "pipelines.stage_tune_promote": dict(compile_pipeline=lambda p: p,
                                             run_local=lambda **kw: seen.update(
                                                 kfp_tmp=(os.environ.get("TMPDIR"), tempfile.gettempdir()))
                                             or {"manifests": "m.yaml"}),
        "runtime.modelfiles.gguf_convert": dict(convert_smollm2=lambda p: p),
        "runtime.server.launch": dict(LocalDeployment=FakeDeployment),
        "runtime.staging.manifest": dict(verify_staged=lambda p, check_digests: None),
        "runtime.staging.s3": dict(upload_folder=lambda *a: None),
        "runtime.staging.seaweed": dict(SeaweedServer=FakeS3),
        "runtime.tracking.mlflow_runs": dict(load_champion=lambda uri, name: ("1", spec)),
    }
    for name, attrs in fakes.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
    counts = iter(["vllm:nixl_xfer_time_seconds_count 1\n", "vllm:nixl_xfer_time_seconds_count 3\n"])
    monkeypatch.setattr(demo.httpx, "get", lambda url, timeout: types.SimpleNamespace(text=next(counts)))
    answers = iter([ChatResult("Paris.", 0.25, 1.0), ChatResult("Red, blue, yellow.", 0.5, 1.5)])
    monkeypatch.setattr(demo, "stream_chat", lambda *a, **kw: next(answers))
    # the pre-flight (real one: tests/unit/test_cli.py) must run before the S3 server starts
    monkeypatch.setattr(demo, "_check_slo_feasible",
                        lambda model_dir, settings, registered: seen.update(preflight_before_s3="s3_dir" not in seen))
    return seen


def test_worker_and_runtime_logs_go_under_the_state_dir(tmp_path, faked_steps):
    state = tmp_path / "state"
    summary = run_demo(DemoSettings(state_dir=state, questions=("q1", "q2")))
    assert faked_steps["deployment_kwargs"]["log_dir"] == state.resolve() / "logs"
    assert summary["ttft_s"] == [0.25, 0.5] and summary["nixl_transfers"] == 2
    assert faked_steps["preflight_before_s3"] is True


def test_the_demo_says_when_it_stops_the_s3_server(tmp_path, faked_steps):
    import io

    from rich.console import Console

    out = io.StringIO()
    run_demo(DemoSettings(state_dir=tmp_path / "state", questions=("q1",)), console=Console(file=out, width=200))
    lines = [line for line in out.getvalue().splitlines() if "stopped the S3-compatible server" in line]
    assert faked_steps["s3_stopped"] and len(lines) == 1 and "http://127.0.0.1:1" in lines[0], out.getvalue()


def test_an_answer_without_a_first_token_is_null_in_summary_json(tmp_path, faked_steps, monkeypatch):
    answers = iter([ChatResult("Paris.", 0.25, 1.0), ChatResult("", None, 0.5)])
    monkeypatch.setattr(demo, "stream_chat", lambda *a, **kw: next(answers))
    state = tmp_path / "state"
    summary = run_demo(DemoSettings(state_dir=state, questions=("q1", "q2")))
    assert summary["ttft_s"] == [0.25, None]
    text = (state / "demo" / "summary.json").read_text()
    assert "NaN" not in text and json.loads(text)["ttft_s"] == [0.25, None]


def test_step_input_filter_drops_only_the_json_body_whatever_the_write_sizes(tmp_path):
    import io

    text = ("    [KFP Executor 2026-12-05 10:00:00,000 INFO]: Got executor_input:\n    {\n        \"inputs\": {\n"
            "            \"parameterValues\": {\"word\": \"x\"}\n        }\n    }\n    step output\n"
            "    [KFP Executor 2026-12-05 10:00:00,001 INFO]: Got executor_input:\n    not json\n    tail")
    for size in (1, 7, len(text)):
        out, log = io.StringIO(), io.StringIO()
        filt = demo._StepInputFilter(out, log)
        for i in range(0, len(text), size):
            filt.write(text[i:i + size])
        filt.close_run()
        assert log.getvalue() == text
        shown = out.getvalue().splitlines()
        assert shown == ["    [KFP Executor 2026-12-05 10:00:00,000 INFO]: executor input: in the log",
                         "    step output",
                         "    [KFP Executor 2026-12-05 10:00:00,001 INFO]: executor input: in the log",
                         "    not json", "    tail"]


@pytest.fixture
def short_dir():
    """A folder with a short path (pytest's tmp_path is too long for a Unix socket below it)."""
    import shutil

    d = Path(tempfile.mkdtemp(prefix="pd-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_demo_and_the_processes_it_starts_keep_temporary_files_under_the_state_dir(short_dir, faked_steps,
                                                                                        monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    state = short_dir / "state"
    (state / "demo" / "tmp").mkdir(parents=True)
    (state / "demo" / "tmp" / "left-by-a-killed-run").write_text("x")
    before = (os.environ.get("TMPDIR"), tempfile.gettempdir())
    run_demo(DemoSettings(state_dir=state, questions=("q1",)))
    tmp = str(state.resolve() / "demo" / "tmp")
    # kfp.local (in this process, and its steps started with this environment) and the workers / runtime
    assert faked_steps["kfp_tmp"] == (tmp, tmp) and faked_steps["deployment_tmp"] == (tmp, tmp)
    assert not (state / "demo" / "tmp").exists()  # removed at the end, with what a killed run left
    assert (os.environ.get("TMPDIR"), tempfile.gettempdir()) == before
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_the_temporary_folder_is_removed_when_a_step_fails(short_dir, faked_steps, monkeypatch):
    def fail(p):
        seen.append(tempfile.gettempdir())
        if seen[0].startswith(str(short_dir)):  # never into the system temp folder
            (Path(seen[0]) / "half-done").write_text("x")
        raise demo.DemoError("the step failed")

    seen: list[str] = []

    monkeypatch.setattr(demo, "_check_slo_feasible", lambda *a: None)
    monkeypatch.setitem(sys.modules["runtime.modelfiles.gguf_convert"].__dict__, "convert_smollm2", fail)
    before = tempfile.gettempdir()
    with pytest.raises(demo.DemoError):
        run_demo(DemoSettings(state_dir=short_dir / "state"))
    assert seen == [str(short_dir.resolve() / "state" / "demo" / "tmp")]
    assert (short_dir / "state" / "demo").is_dir() and not (short_dir / "state" / "demo" / "tmp").exists()
    assert tempfile.gettempdir() == before


def test_a_state_dir_too_long_for_a_socket_path_gets_a_system_temp_folder(tmp_path, monkeypatch):
    long_state = tmp_path / ("x" * 80)
    long_state.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with demo._demo_tmp(long_state) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith("pdserve-demo-") and tmp.is_dir()
        assert os.environ["TMPDIR"] == str(tmp)
    assert not tmp.exists() and not (long_state / "demo" / "tmp").exists()
