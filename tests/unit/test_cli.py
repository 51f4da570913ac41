"""`pdserve` command line: help explains every command; `tune` prints candidates, writes a valid spec, and
fails clearly (exit 1, message) on an impossible SLO or a broken config.json."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec
from runtime.modelfiles.catalog import CATALOG_DIR

runner = CliRunner()
LLAMA_70B = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json"


def test_help_lists_every_command():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    assert runner.invoke(app, ["-h"]).output == res.output
    assert runner.invoke(app, ["stage", "-h"]).exit_code == 0
    for cmd in ("demo", "stage", "tune", "promote", "serve", "compile", "prepare-model"):
        assert cmd in res.output


def test_help_states_the_exit_statuses_every_command_uses():
    from runtime.faces.common import RUNTIME, USAGE

    text = " ".join(runner.invoke(app, ["--help"], env={"COLUMNS": "300"}, terminal_width=300).output.split())
    assert f"0 success, {RUNTIME} a failure while running, {USAGE} bad usage or a bad value" in text


@pytest.mark.parametrize("command", ["demo", "tune", "serve", "show-summary"])
def test_state_dir_help_names_the_variable_that_sets_its_default(command, tmp_path, monkeypatch):
    import typer

    from runtime.paths import state_dir

    params = typer.main.get_command(app).commands[command].params
    state_help = " ".join(next(p.help for p in params if "--state-dir" in p.opts).split())
    assert "default: $PDSERVE_HOME, else .pdserve in the checkout" in state_help
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))  # what the help says is what sets it
    assert state_dir() == tmp_path


def test_tune_writes_a_valid_deployment_spec(tmp_path):
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--gpu", "H100-SXM", "--out", str(out)],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    spec = DeploymentSpec.model_validate_json(out.read_text())
    assert spec.prefill.tp <= spec.decode.tp
    assert spec.decode.tp >= 2  # 70B bf16 (141 GB of weights) cannot fit one 80 GB H100
    assert "★" in res.output


def test_tune_table_fits_an_80_column_terminal_with_numbered_reasons():
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--gpu", "H100-SXM"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    table = [ln for ln in lines if ln[:1] in "┏┃┡│└"]
    assert table and max(len(ln) for ln in table) <= 80
    assert not any("…" in ln for ln in table)  # no header or cell cut short
    rows = [ln for ln in table if ln.startswith("│")]
    assert len(rows) == 16 and any("[1]" in ln for ln in rows)  # 4 x 4 TP pairs, infeasible ones keyed
    keys = {ln.split("│")[-2].strip() for ln in rows} - {""}
    notes = [ln for ln in lines if ln.startswith("[")]
    assert keys == {ln.split(" ", 1)[0] for ln in notes}  # every key used in the table is explained below it
    assert any(ln.endswith("prefill TP > decode TP (NixlConnector, non-MLA)") for ln in notes)
    assert any("weights do not fit at TP 1" in ln for ln in notes)


def test_tune_impossible_slo_exits_with_the_best_achievable(tmp_path):
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--ttft-ms", "0.01", "--itl-ms", "0.01"])
    assert res.exit_code == 1
    assert "TTFT" in res.output and "ITL" in res.output


def test_tune_config_missing_field_is_named(tmp_path):
    cfg = json.loads(LLAMA_70B.read_text())
    del cfg["num_hidden_layers"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    res = runner.invoke(app, ["tune", str(p)])
    assert res.exit_code == 2  # a bad value (tests/unit/test_cli_exit_codes.py)
    assert "num_hidden_layers" in res.output


def test_tune_measure_needs_a_model_folder_with_weights(tmp_path):
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--measure"])
    assert res.exit_code == 2
    assert "--measure needs a model folder" in " ".join(res.output.split())


def test_tune_measure_refuses_to_write_a_deployable_spec(tmp_path):
    res = runner.invoke(app, ["tune", str(tmp_path), "--measure", "--out", str(tmp_path / "s.json")])
    assert res.exit_code == 2
    assert "not a deployable GPU spec" in " ".join(res.output.split())  # rich wraps long lines
    assert not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("refused", [["--out", "spec.json"], ["--register", "m"], ["--like", "m"],
                                     ["--parallelism", "all"], ["--max-model-len", "4096"],
                                     ["--engine-arg", "max-num-seqs=8"], ["--gpu", "H200-SXM"],
                                     ["--precision", "fp8"]], ids=lambda r: r[0])
def test_tune_measure_help_names_every_option_measure_refuses(tmp_path, refused):
    import typer

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(LLAMA_70B.read_text())
    (model / "model.safetensors").write_bytes(b"")  # refused before any weight is read
    value = str(tmp_path / refused[1]) if refused[0] == "--out" else refused[1]
    res = runner.invoke(app, ["tune", str(model), "--measure", refused[0], value])
    assert res.exit_code == 2, res.output
    assert refused[0] in _flat(res.output)
    tune = typer.main.get_command(app).commands["tune"]
    measure_help = " ".join(next(p.help for p in tune.params if p.name == "measure").split())
    assert refused[0] in measure_help


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def test_error_messages_are_printed_verbatim_not_as_rich_markup(tmp_path):
    state = tmp_path / "run[/x]" / "[x]"
    res = runner.invoke(app, ["show-summary", "--state-dir", str(state)], env={"COLUMNS": "300"})
    assert res.exit_code == 1
    assert res.exception is None or isinstance(res.exception, SystemExit)  # no MarkupError
    assert f"{state / 'demo' / 'summary.json'} does not exist" in _flat(res.output)


def test_stage_errors_with_brackets_keep_them(tmp_path):
    res = runner.invoke(app, ["stage", "hf://onlyorg", str(tmp_path / "out")], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output  # a malformed SOURCE is a bad value
    assert "[/subfolder]" in res.output and "hf://onlyorg" in res.output  # was: rich MarkupError traceback
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    res = runner.invoke(app, ["stage", str(src), str(tmp_path / "out"), "--include", "nomatch[x]"],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2  # a glob that selects nothing is a bad value too
    assert "nomatch[x]" in res.output
    assert not (tmp_path / "out").exists()


def test_stage_prints_its_summary_once_and_leaves_concurrency_to_stage_options(tmp_path):
    import typer.main

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "tokenizer.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"\0" * 16)
    res = runner.invoke(app, ["stage", str(src), str(tmp_path / "out")], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert res.output.count("3 files") == 1, res.output
    assert (tmp_path / "out" / "config.json").read_text() == (src / "config.json").read_text()
    stage_cmd = typer.main.get_command(app).commands["stage"]
    (conc,) = [p for p in stage_cmd.params if p.name == "concurrency"]
    assert conc.default is None  # nothing passed → StageOptions' own default (4 per CPU within 16..64)


def test_stage_bad_concurrency_names_the_option_before_touching_the_destination(tmp_path):
    res = runner.invoke(app, ["stage", str(tmp_path), str(tmp_path / "out"), "--concurrency", "0"],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert "--concurrency: Input should be greater than or equal to 1" in res.output
    assert "pydantic.dev" not in res.output
    assert not (tmp_path / "out").exists()


def test_tune_bad_options_name_the_cli_options_not_the_fields():
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--ttft-ms", "-5", "--rate", "0"], env={"COLUMNS": "300"})
    assert res.exit_code == 2
    out = _flat(res.output)
    assert "--ttft-ms: Input should be greater than 0, got -5.0" in out
    assert "--rate: Input should be greater than 0, got 0.0" in out
    assert "ttft_p90_ms" not in out and "request_rate_per_s" not in out and "pydantic.dev" not in out
    assert "★" not in out  # failed before tuning


def test_demo_bad_slo_fails_before_starting_anything(tmp_path):
    res = runner.invoke(app, ["demo", "--state-dir", str(tmp_path), "--itl-ms", "0"], env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert "--itl-ms: Input should be greater than 0" in res.output
    assert list(tmp_path.iterdir()) == []  # no model prepared, no S3 server, no demo folder


def test_tune_out_creates_missing_parent_folders(tmp_path):
    out = tmp_path / "st" / "deep" / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--out", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert DeploymentSpec.model_validate_json(out.read_text()).decode.tp >= 2
    assert [p.name for p in out.parent.iterdir()] == ["spec.json"]  # no temporary file left


def test_tune_out_under_a_file_fails_before_tuning(tmp_path):
    (tmp_path / "f").write_text("x")
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--out", str(tmp_path / "f" / "spec.json")],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert "is not a folder" in res.output and "★" not in res.output
    assert (tmp_path / "f").read_text() == "x"


def test_tune_winner_over_the_gpu_budget_fails_and_names_both_numbers(tmp_path):
    import re

    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--rate", "100", "--out", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 1
    msg = _flat(res.output)
    need = int(re.search(r"needs (\d+) GPUs", msg).group(1))
    assert need > 64 and "planner.gpu_budget is 64 GPUs" in msg and "--rate" in msg
    assert not out.exists()
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--rate", "100", "--gpu-budget", str(need), "--out", str(out)],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    spec = DeploymentSpec.model_validate_json(out.read_text())
    assert spec.planner.gpu_budget == need
    assert spec.prefill.replicas * spec.prefill.tp + spec.decode.replicas * spec.decode.tp == need


def test_tune_huge_rate_is_refused_not_written(tmp_path):
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--rate", "1e9", "--out", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 1
    assert "but planner.gpu_budget is 64 GPUs" in _flat(res.output)
    assert not out.exists()


def test_serve_unreadable_spec_is_named_before_starting_workers(tmp_path):
    res = runner.invoke(app, ["serve", "--spec", str(tmp_path / "missing.json"), "--state-dir", str(tmp_path)],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert f"--spec {tmp_path / 'missing.json'}" in _flat(res.output)
    (tmp_path / "bad.json").write_text(json.dumps({"model": {"name": "m"}, "prefill": {"tp": 3}}))
    res = runner.invoke(app, ["serve", "--spec", str(tmp_path / "bad.json"), "--state-dir", str(tmp_path)],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert "prefill.tp" in res.output and "pydantic.dev" not in res.output


def test_serve_an_hf_config_as_spec_is_named_for_what_it_is(tmp_path):
    res = runner.invoke(app, ["serve", "--spec", str(LLAMA_70B), "--state-dir", str(tmp_path)],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert "this is a Hugging Face model config.json, not a DeploymentSpec" in _flat(res.output)
    assert "Extra inputs" not in res.output


def test_serve_a_busy_port_fails_before_any_worker_starts(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = runner.invoke(app, ["serve", "--port", str(port), "--model-dir", str(tmp_path / "nothing"),
                                  "--state-dir", str(tmp_path)], env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in _flat(res.output)
    assert list(tmp_path.iterdir()) == []  # checked first: no model prepared, no logs, no workers


def test_stage_transport_options_reach_stage_model_and_bad_ones_name_the_option(tmp_path, monkeypatch):
    import runtime.staging.stage as stage_mod

    res = runner.invoke(app, ["stage", str(tmp_path), str(tmp_path / "out"), "--s3-transport", "curl"],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2
    assert "--s3-transport: Input should be 'auto', 'http' or 'botocore', got 'curl'" in _flat(res.output)
    assert not (tmp_path / "out").exists()

    seen = {}
    monkeypatch.setattr(stage_mod, "stage_model", lambda source, dest, **kw: seen.update(kw))
    res = runner.invoke(app, ["stage", str(tmp_path), str(tmp_path / "out"), "--s3-transport", "botocore",
                              "--no-direct-io"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert seen["s3_transport"] == "botocore" and seen["direct_io"] is False


def test_promote_apply_needs_a_kube_context_before_anything_is_written(tmp_path):
    out = tmp_path / "m.yaml"
    res = runner.invoke(app, ["promote", "x", "--apply", "--out", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "--apply needs --kube-context" in res.output
    assert not out.exists()


KUBECONFIG_ONE_CONTEXT = """apiVersion: v1
kind: Config
clusters:
- name: c1
  cluster: {server: "https://127.0.0.1:1"}
users:
- name: u1
  user: {token: not-a-secret}
contexts:
- name: good
  context: {cluster: c1, user: u1}
current-context: good
"""


def test_promote_apply_refuses_a_context_the_kubeconfig_lacks_before_anything_is_written(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG_ONE_CONTEXT)
    out = tmp_path / "m.yaml"
    res = runner.invoke(app, ["promote", "x", "--apply", "--kube-context", "nosuch", "--out", str(out)],
                        env={"COLUMNS": "300", "KUBECONFIG": str(kubeconfig)})
    assert res.exit_code == 2, res.output
    assert "--kube-context nosuch" in res.output and "nosuch" in res.output.split("--kube-context nosuch", 1)[1]
    assert not out.exists()


def test_promote_apply_names_a_kubeconfig_that_is_not_yaml(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nclusters: [\n  - {name: a\n")
    out = tmp_path / "m.yaml"
    res = runner.invoke(app, ["promote", "x", "--apply", "--kube-context", "good", "--out", str(out)],
                        env={"COLUMNS": "300", "KUBECONFIG": str(kubeconfig)})
    assert res.exit_code == 2, res.output
    assert "not valid YAML" in res.output and "kubeconfig" in res.output and "Traceback" not in res.output
    assert not out.exists()


def test_promote_use_case_refuses_a_missing_context_before_reading_mlflow(tmp_path, monkeypatch):
    from runtime.deploy.errors import KubeconfigError
    from runtime.usecases.promote import PromoteRequest, promote

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG_ONE_CONTEXT)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    out = tmp_path / "m.yaml"
    with pytest.raises(KubeconfigError, match="nosuch"):
        promote(PromoteRequest(registered_model="x", mlflow_tracking_uri=f"sqlite:///{tmp_path / 'none.db'}",
                               out_path=str(out), image="img:1", apply=True, kube_context="nosuch"))
    assert not out.exists() and not (tmp_path / "none.db").exists()


def test_promote_refuses_a_missing_sqlite_database_instead_of_creating_one(tmp_path):
    db = tmp_path / "typo.db"
    res = runner.invoke(app, ["promote", "x", "--mlflow-uri", f"sqlite:///{db}"], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "no such database file" in res.output
    assert not db.exists()


def test_written_specs_are_readable_by_others_under_the_umask(tmp_path):
    import os
    import stat

    from runtime.paths import write_text_atomically

    old = os.umask(0o022)
    try:
        p = write_text_atomically(tmp_path / "spec.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


def test_an_output_that_is_a_link_is_written_through_and_the_link_stays(tmp_path):
    from runtime.paths import write_text_atomically

    real = tmp_path / "specs" / "spec.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "spec.json"
    link.symlink_to(real)
    write_text_atomically(link, "new")
    assert link.is_symlink() and real.read_text() == "new" and link.read_text() == "new"
    dangling = tmp_path / "later.json"
    dangling.symlink_to(tmp_path / "made" / "later.json")  # a link to a file (and folder) not yet there
    write_text_atomically(dangling, "x")
    assert dangling.is_symlink() and (tmp_path / "made" / "later.json").read_text() == "x"


def test_tune_on_a_bare_config_file_records_no_model_folder(tmp_path):
    import json

    out = tmp_path / "s.json"
    bare = tmp_path / "llama_config.json"
    bare.write_text(LLAMA_70B.read_text())
    res = runner.invoke(app, ["tune", str(bare), "--out", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "bare config file" in res.output
    assert json.loads(out.read_text())["model"]["path"] == ""
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--out", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 0 and "is a catalog model" in res.output  # the catalog's own file: said so
    assert json.loads(out.read_text())["model"]["path"] == ""


def test_stage_names_a_file_given_as_the_source_folder(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    res = runner.invoke(app, ["stage", str(f), str(tmp_path / "out")], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "is a file, not a folder" in res.output


def test_compile_to_an_existing_folder_is_one_error_line(tmp_path):
    res = runner.invoke(app, ["compile", str(tmp_path)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.exception
    assert res.output.startswith("error:") and "is a folder" in res.output and "Traceback" not in res.output
    assert list(tmp_path.iterdir()) == []


def test_compile_under_a_file_is_one_error_line(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    res = runner.invoke(app, ["compile", str(blocker / "sub" / "p.yaml")], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.exception  # a bad value, found first
    assert res.output.startswith("error:") and f"{blocker} is not a folder" in res.output
    assert "Traceback" not in res.output and blocker.read_text() == "x"


MLFLOW_FAST_FAIL = {"COLUMNS": "300", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def test_promote_with_unreachable_mlflow_says_so_and_hides_the_password(tmp_path):
    from runtime.ports import free_port

    uri = f"http://alice:s3cret-pw@127.0.0.1:{free_port()}"  # nothing listens there
    res = runner.invoke(app, ["promote", "m", "--mlflow-uri", uri, "--out", str(tmp_path / "m.yaml")],
                        env=MLFLOW_FAST_FAIL)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.exception
    assert "s3cret-pw" not in res.output and "alice" not in res.output
    assert "http://***@127.0.0.1" in res.output
    assert "cannot read alias 'champion'" in res.output and "has no 'champion' version" not in res.output
    assert not (tmp_path / "m.yaml").exists()


def test_tune_with_unreachable_mlflow_hides_the_password(tmp_path):
    from runtime.ports import free_port

    uri = f"http://alice:s3cret-pw@127.0.0.1:{free_port()}"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--mlflow-uri", uri], env=MLFLOW_FAST_FAIL)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.exception
    assert "s3cret-pw" not in res.output and "logging the tuning failed" in res.output


def test_redact_userinfo_keeps_host_and_path():
    from runtime.redact import redact_userinfo

    assert redact_userinfo("to http://u:p@h:5000/api?x=a@b and 'https://tok@h2' s3://b/k@v") == (
        "to http://***@h:5000/api?x=a@b and 'https://***@h2' s3://b/k@v")
    assert redact_userinfo("mysql://u:p@ss@db/m") == "mysql://***@db/m"


def test_cli_mlflow_http_defaults_fail_fast_but_keep_what_the_user_set():
    from runtime.cli import MLFLOW_CLI_ENV_DEFAULTS, apply_mlflow_cli_defaults

    env = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "300"}
    added = apply_mlflow_cli_defaults(env)
    assert added == {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": MLFLOW_CLI_ENV_DEFAULTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]}
    assert env["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300"
    assert int(env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) < 7  # MLflow's own default retries for minutes


def test_demo_slo_no_candidate_meets_fails_before_uploading_anything(tmp_path):
    # the model is prepared (its config.json is what the tune step reads), then the tune step's own check
    # refuses the SLO: no S3 server, no pipeline, a one-line error with the best TTFT achievable
    res = runner.invoke(app, ["demo", "--state-dir", str(tmp_path), "--ttft-ms", "1"], env={"COLUMNS": "300"})
    assert res.exit_code == 1, res.output
    out = _flat(res.output)
    assert "error: the tune step would fail:" in out and "TTFT" in out
    assert "Traceback" not in res.output
    assert not (tmp_path / "s3").exists() and not (tmp_path / "kfp").exists()


def test_demo_preflight_passes_the_demo_defaults_and_names_a_bad_gpu(tmp_path):
    import shutil

    import pytest

    from runtime.demo import DemoError, DemoSettings, _check_slo_feasible

    shutil.copy(CATALOG_DIR / "Qwen--Qwen3-0.6B_config.json", tmp_path / "config.json")
    _check_slo_feasible(tmp_path, DemoSettings(state_dir=tmp_path), "m-pd")  # the defaults are feasible
    with pytest.raises(DemoError, match="would fail: .*TTFT"):
        _check_slo_feasible(tmp_path, DemoSettings(state_dir=tmp_path, ttft_p90_ms=0.5), "m-pd")
    # feasible SLO, but the fleet for the demo's workload exceeds the spec's GPU budget: the tune step's
    # GpuBudgetError, found here too (a breaker's case: the CPU catalog entry at a loose SLO)
    with pytest.raises(DemoError, match="would fail: .*but planner.gpu_budget is 64 GPUs"):
        _check_slo_feasible(tmp_path, DemoSettings(state_dir=tmp_path, gpu="CPU", ttft_p90_ms=60_000,
                                                   itl_p90_ms=1000), "m-pd")


def test_stage_help_gives_the_concurrency_range_and_default_without_internal_names():
    import typer.main

    option = next(p for p in typer.main.get_command(app).commands["stage"].params if p.name == "concurrency")
    assert "1 to 256" in option.help and "4 per CPU" in option.help and "StageOptions" not in option.help


def test_compile_refuses_an_output_without_a_yaml_suffix_and_keeps_the_file(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep")
    res = runner.invoke(app, ["compile", str(notes)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "must end in .yaml or .yml" in res.output, res.output
    assert "--image" not in res.output and notes.read_text() == "keep"


def test_compile_replaces_its_own_package_but_no_other_yaml_without_force(tmp_path):
    pytest.importorskip("kfp")
    manifest = tmp_path / "deploy.yaml"
    manifest.write_text("apiVersion: v1\nkind: ConfigMap\n")
    res = runner.invoke(app, ["compile", str(manifest)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "is not the stage-tune-promote pipeline package" in res.output, res.output
    assert "--force" in res.output and manifest.read_text() == "apiVersion: v1\nkind: ConfigMap\n"
    package = tmp_path / "p.yml"
    assert runner.invoke(app, ["compile", str(package)]).exit_code == 0
    assert runner.invoke(app, ["compile", str(package), "--image", "r.example/x:2"]).exit_code == 0  # its own
    assert "r.example/x:2-cpu" in package.read_text()
    res = runner.invoke(app, ["compile", str(manifest), "--force"])
    assert res.exit_code == 0, res.output
    assert "pipelineInfo" in manifest.read_text()


def test_a_failed_compile_leaves_the_existing_package_as_it_was(tmp_path):
    pytest.importorskip("kfp")
    package = tmp_path / "p.yaml"
    assert runner.invoke(app, ["compile", str(package)]).exit_code == 0
    before = package.read_text()
    res = runner.invoke(app, ["compile", str(package), "--image", "r.example/x@sha256:" + "c" * 64])
    assert res.exit_code == 2 and "--steps-image" in res.output
    assert package.read_text() == before
