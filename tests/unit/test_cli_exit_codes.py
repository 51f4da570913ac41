"""Every `pdserve` command exits the same way: 0 success, 1 a failure while running, 2 bad usage or a bad value,
with one error line that names no Python class (runtime/faces/common.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.cli import app

runner = CliRunner()


BAD_VALUES = {  # argv, with {tmp} the test's temporary folder
    "tune: bad SLO": ["tune", "llama-3.1-8b", "--ttft-ms", "-1"],
    "tune: --register without --mlflow-uri": ["tune", "llama-3.1-8b", "--register", "m"],
    "tune: unknown --gpu": ["tune", "llama-3.1-8b", "--gpu", "H100-SMX"],
    "tune: unknown model": ["tune", "llama-9000"],
    "tune: no such config file": ["tune", "{tmp}/none/config.json"],
    "tune: ISL + OSL beyond the model's context": ["tune", "llama-3.1-8b", "--isl", "200000"],
    "tune: --trace-uri without an object key": ["tune", "llama-3.1-8b", "--trace-uri", "s3://bucket"],
    "tune: --trace-uri with a bad bucket": ["tune", "llama-3.1-8b", "--trace-uri", "s3://b/t.jsonl"],
    "tune: --trace-uri of no trace format": ["tune", "llama-3.1-8b", "--trace-uri", "s3://bucket/t.txt"],
    "promote: --skip-if-live without --apply": ["promote", "m", "--skip-if-live"],
    "tune: an --engine-arg the kubelet expands": ["tune", "llama-3.1-8b", "--engine-arg", "hf-overrides={{\"a\": \"$(X)\"}}"],
    "promote: no such database": ["promote", "m", "--mlflow-uri", "sqlite:///{tmp}/none.db"],
    "serve: bad --router": ["serve", "--router", "nope"],
    "stage: bad --concurrency": ["stage", "{tmp}", "{tmp}/dest", "--concurrency", "0"],
    "stage: no such SOURCE folder": ["stage", "{tmp}/none", "{tmp}/dest"],
    "stage: SOURCE of an unknown scheme": ["stage", "ftp://host/model", "{tmp}/dest"],
    "stage: SOURCE with a bad bucket": ["stage", "s3://b/model/", "{tmp}/dest"],
    "stage: DEST inside SOURCE": ["stage", "{tmp}", "{tmp}/dest"],
    "stage: DEST a filesystem root": ["stage", "{tmp}", "/"],
    "compile: a folder as output": ["compile", "{tmp}"],
    "demo: unknown --gpu": ["demo", "--state-dir", "{tmp}", "--gpu", "H100-SMX"],
    "batch run: no input file": ["batch", "run", "--input", "{tmp}/none.jsonl", "--output", "{tmp}/out.jsonl",
                                 "--endpoint", "http://127.0.0.1:9/openai", "--model", "m"],
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_bad_value_exits_2_with_one_error_line(case, tmp_path):
    res = runner.invoke(app, [a.format(tmp=tmp_path) for a in BAD_VALUES[case]], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    assert not re.search(r"\b[A-Z][A-Za-z]+(Error|Exception)\b", errors[0]), errors[0]


BAD_CONFIGS = {  # a model folder's config.json -> what the error line says is wrong with it
    "not JSON": ('{"hidden_size": 4096,', "is not valid JSON"),
    "not an object": ("[4096, 32]", "must be a JSON object"),
    "fields missing": ('{"model_type": "llama", "hidden_size": 4096}', "missing required field(s): num_hidden_layers"),
    "a field of the wrong type": ('{"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, '
                                  '"num_attention_heads": 32, "vocab_size": 128256, "intermediate_size": 14336, '
                                  '"tie_word_embeddings": "no"}', "tie_word_embeddings must be a JSON boolean"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_malformed_model_config_exits_2_naming_the_file_before_any_search(case, tmp_path):
    text, problem = BAD_CONFIGS[case]
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    out = tmp_path / "spec.json"
    # --ttft-ms -1 is refused in the same line: every bad value at once, as before any search
    res = runner.invoke(app, ["tune", str(folder), "--ttft-ms", "-1", "--out", str(out),
                              "--state-dir", str(tmp_path / "state")], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    assert str(folder / "config.json") in errors[0] and problem in errors[0] and "--ttft-ms" in errors[0], errors[0]
    assert not re.search(r"\b[A-Z][A-Za-z]+(Error|Exception)\b", errors[0]), errors[0]
    assert not out.exists()


def test_a_failure_while_running_exits_1(tmp_path):
    res = runner.invoke(app, ["show-summary", "--state-dir", str(tmp_path)])  # nothing to show: a run-time failure
    assert res.exit_code == 1 and res.output.startswith("error:"), res.output


def test_success_exits_0():
    assert runner.invoke(app, ["models"]).exit_code == 0


@pytest.mark.parametrize("option,value", [("--namespace", "BAD_NS"), ("--pvc", "Bad_Claim"), ("--image", "bad image")])
def test_promote_names_a_bad_target_option_before_reading_mlflow(option, value, tmp_path):
    # the database does not exist either: the option is named first, as a bad value, not after the champion is read
    res = runner.invoke(app, ["promote", "m", option, value, "--mlflow-uri", f"sqlite:///{tmp_path}/none.db"],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: {option}: "), res.output


@pytest.mark.parametrize("option,value,problem", [
    ("--out", "{tmp}", "is a folder"),
    ("--out", "{tmp}/file/manifests.yaml", "{tmp}/file is not a folder"),
    ("--out", "{tmp}/file/sub/manifests.yaml", "{tmp}/file is not a folder"),
    ("--traffic-upload", "s3://", "is not a valid S3 bucket name"),
    ("--traffic-upload", "s3://bucket/prefix", "must end in '/'"),
])
def test_promote_names_a_bad_output_option_before_reading_mlflow(option, value, problem, tmp_path):
    (tmp_path / "file").write_text("keep")
    res = runner.invoke(app, ["promote", "m", option, value.format(tmp=tmp_path),
                              "--mlflow-uri", f"sqlite:///{tmp_path}/none.db"], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: {option} ") and problem.format(tmp=tmp_path) in res.output, res.output
    assert (tmp_path / "file").read_text() == "keep"


OUTPUT_UNDER_A_FILE = {  # argv writing to {out}, a path two levels below the file {tmp}/file
    "tune --out": ["tune", "llama-3.1-8b", "--out", "{out}"],
    "tune --decision-values": ["tune", "llama-3.1-8b", "--mlflow-uri", "sqlite:///{tmp}/m.db", "--register", "m",
                               "--decision-values", "{out}"],
    "compile OUT": ["compile", "{out}"],
    "serve --traffic-log": ["serve", "--model-dir", "{tmp}", "--traffic-log", "{out}.jsonl"],
    "batch workflow --out": ["batch", "workflow", "--input", "s3://bkt/in.jsonl", "--output", "s3://bkt/out.jsonl",
                             "--endpoint", "http://isvc-predictor.pdserve.svc.cluster.local/openai", "--out", "{out}"],
}


@pytest.mark.parametrize("case", list(OUTPUT_UNDER_A_FILE))
def test_an_output_path_below_a_file_exits_2_naming_the_file_before_any_work(case, tmp_path):
    (tmp_path / "file").write_text("keep")
    out = tmp_path / "file" / "sub" / "x.yaml"
    res = runner.invoke(app, [a.format(tmp=tmp_path, out=out) for a in OUTPUT_UNDER_A_FILE[case]],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{tmp_path / 'file'} is not a folder" in errors[0], res.output
    assert (tmp_path / "file").read_text() == "keep" and not (tmp_path / "m.db").exists()


def test_a_library_error_of_several_lines_is_printed_as_one(tmp_path):
    not_a_db = tmp_path / "notes.db"
    not_a_db.write_text("not sqlite\n")  # SQLAlchemy's error adds a "[SQL: ...]" and a "(Background ...)" line
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--mlflow-uri", f"sqlite:///{not_a_db}"],
                        env={"COLUMNS": "2000"})
    assert res.exit_code == 1, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "file is not a database" in errors[0], res.output
    tail = res.output[res.output.index("error:"):].strip()
    assert "\n" not in tail and not_a_db.read_text() == "not sqlite\n", tail


@pytest.mark.parametrize("source", ["", "  "])
def test_stage_refuses_an_empty_source_instead_of_staging_the_current_folder(source, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")  # a model-looking current folder
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["stage", source, str(tmp_path / "dest")], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and res.output.startswith("error: source ") and "empty" in res.output, res.output
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("extra, problem", [([], "no weight file"), (["--include", "*.gguf"], "no file matches")])
def test_stage_refuses_a_source_without_weights_as_a_bad_value(extra, problem, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("config.json", "tokenizer.json"):  # a model folder whose weights were never copied
        (src / name).write_text("{}")
    res = runner.invoke(app, ["stage", str(src), str(tmp_path / "dest"), *extra], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and problem in errors[0], res.output
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("args, named", [
    (["", "--expect-version", "1"], "REGISTERED_MODEL: registered model name '': must not be empty"),
    (["org/m"], "REGISTERED_MODEL: registered model name 'org/m': MLflow model names cannot contain"),
    (["m", "--expect-version", " 1"], "--expect-version ' 1': must be a model version number"),
    (["m", "--expect-version", "v1"], "--expect-version 'v1': must be a model version number"),
])
def test_promote_names_a_bad_model_name_or_version_before_reading_mlflow(args, named, tmp_path):
    res = runner.invoke(app, ["promote", *args, "--mlflow-uri", f"sqlite:///{tmp_path}/none.db"],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2 and res.output.startswith(f"error: {named}"), res.output


@pytest.mark.parametrize("uri, problem", [
    ("bogus://host/db", "unsupported scheme 'bogus'"),
    ("{tmp}/mlflow.db", "names MLflow's file store"),  # sqlite:/// forgotten
    ("file://{tmp}/mlruns", "names MLflow's file store"),
])
@pytest.mark.parametrize("command", ["tune", "promote"])
def test_an_mlflow_uri_mlflow_cannot_open_exits_2_before_any_work(command, uri, problem, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out = tmp_path / "out"
    out.write_text("keep")
    argv = {"tune": ["tune", "llama-3.1-8b", "--out", str(out)], "promote": ["promote", "m", "--out", str(out)]}
    res = runner.invoke(app, [*argv[command], "--mlflow-uri", uri.format(tmp=tmp_path)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and res.output.startswith("error: --mlflow-uri ") and problem in res.output, res.output
    assert out.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_mlflows_file_store_is_taken_where_mlflow_is_told_to_allow_it():
    from runtime.tracking.mlflow_runs import check_tracking_uri

    assert check_tracking_uri("/srv/mlruns", {"MLFLOW_ALLOW_FILE_STORE": "true"}) == "/srv/mlruns"
    assert check_tracking_uri("postgresql+psycopg2://u@db/mlflow", {}) == "postgresql+psycopg2://u@db/mlflow"
    with pytest.raises(ValueError, match="file store"):
        check_tracking_uri("/srv/mlruns", {})


def test_mlflow_uris_are_checked_against_mlflows_own_registry_plugins_included():
    """Bare `databricks` and a scheme an installed plugin registers (SageMaker's managed MLflow takes the
    tracking server's ARN through the sagemaker-mlflow plugin) are MLflow's to open, not refused."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    from runtime.tracking.mlflow_runs import check_tracking_uri

    arn = "arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/pdserve"
    assert check_tracking_uri("databricks", {}) == "databricks"
    with pytest.raises(ValueError, match="unsupported scheme 'arn'"):
        check_tracking_uri(arn, {})
    _tracking_store_registry.register("arn", lambda store_uri=None, artifact_uri=None: None)
    try:
        assert check_tracking_uri(arn, {}) == arn
    finally:
        del _tracking_store_registry._registry["arn"]


def _inputs(tmp_path):
    """A model folder, a trace, a price file and an MLflow database holding a champion, as the commands read them."""
    from runtime.modelfiles.catalog import resolve_model_config

    (tmp_path / "llama8").mkdir()
    (tmp_path / "llama8" / "config.json").write_text(resolve_model_config(Path("llama-3.1-8b")).read_text())
    (tmp_path / "trace.jsonl").write_text("".join(f'{{"timestamp": {t}, "input_length": 100, "output_length": 10}}\n'
                                                  for t in (0, 1000, 2000)))
    (tmp_path / "prices.json").write_text('{"H100-SXM": 3.0}')
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert runner.invoke(app, ["tune", "llama-3.1-8b", "--mlflow-uri", db, "--register", "m"]).exit_code == 0
    return db


OVERWRITES = {  # argv whose output option names a file the same command reads
    "tune --out = the model's config.json": ["tune", "{tmp}/llama8", "--out", "{tmp}/llama8/config.json"],
    "tune --out = the trace": ["tune", "llama-3.1-8b", "--trace", "{tmp}/trace.jsonl", "--out", "{tmp}/trace.jsonl"],
    "tune --out = the price file": ["tune", "llama-3.1-8b", "--price-file", "{tmp}/prices.json",
                                    "--out", "{tmp}/prices.json"],
    "tune --out = the MLflow database": ["tune", "llama-3.1-8b", "--mlflow-uri", "{db}", "--register", "m",
                                         "--out", "{tmp}/mlflow.db"],
    "tune --decision-out = --out": ["tune", "llama-3.1-8b", "--mlflow-uri", "{db}", "--register", "m",
                                    "--out", "{tmp}/prices.json", "--decision-out", "{tmp}/prices.json"],
    "promote --out = the MLflow database": ["promote", "m", "--mlflow-uri", "{db}", "--allow-unstaged",
                                            "--out", "{tmp}/mlflow.db"],
}


@pytest.mark.parametrize("case", list(OVERWRITES))
def test_an_output_never_replaces_what_the_command_reads(case, tmp_path):
    db = _inputs(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    res = runner.invoke(app, [a.format(tmp=tmp_path, db=db) for a in OVERWRITES[case]], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: --") and ("would replace or add to" in res.output
                                                   or "is the MLflow database" in res.output), res.output
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


S3_READERS = {  # argv reading s3://bkt/... first, with {tmp} the test's temporary folder
    "batch run": ["batch", "run", "-i", "s3://bkt/in.jsonl", "-o", "{tmp}/out.jsonl", "--endpoint",
                  "http://127.0.0.1:8080/openai"],
    "tune --trace-uri": ["tune", "llama-3.1-8b", "--trace-uri", "s3://bkt/t.jsonl"],
    "stage": ["stage", "s3://bkt/model/", "{tmp}/dest"],
}


@pytest.mark.parametrize("case", sorted(S3_READERS))
def test_an_s3_endpoint_that_cannot_be_reached_is_a_failure_while_running_in_every_command(case, tmp_path,
                                                                                             monkeypatch):
    """Nothing listens at the endpoint: exit 1 (the same command may succeed later), not 2 (a bad value), in
    every command that reads S3; one error line that names the endpoint; nothing written."""
    import functools
    import socket

    import runtime.staging.s3 as s3_mod

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # one attempt per request: botocore's retries of a refused connection only make the test slow
    monkeypatch.setattr(s3_mod, "make_client", functools.partial(s3_mod.make_client, max_attempts=1))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in S3_READERS[case]]
    res = runner.invoke(app, argv, env={"COLUMNS": "300"})
    assert res.exit_code == 1, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], res.output
    # nothing written (stage's lock file beside DEST stays, as after any stage)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".pdserve-lock")] == []


@pytest.mark.parametrize("argv", [
    ["batch", "workflow", "--input", "s3://bkt/in.jsonl", "--output", "s3://bkt/out.jsonl", "--endpoint",
     "http://isvc-predictor.pdserve.svc.cluster.local/openai", "--name", ""],
    ["batch", "retune-schedule", "--model-name", "org/llama8", "--traffic", "s3://bkt/logs/", "--registered-model",
     "llama8-pd", "--name", ""],
], ids=["batch workflow", "batch retune-schedule"])
def test_an_empty_workflow_name_is_refused_not_replaced_by_the_default(argv):
    res = runner.invoke(app, argv, env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--name" in errors[0] and "kind: " not in res.output, res.output


def test_tune_refuses_an_empty_model_instead_of_tuning_the_current_folder(tmp_path, monkeypatch):
    import shutil

    from runtime.modelfiles.catalog import CATALOG_DIR

    config = sorted(Path(CATALOG_DIR).glob("*config.json"))[0]
    shutil.copy(config, tmp_path / "config.json")  # the current folder is a model folder: "" must not pick it
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["tune", "", "--out", str(tmp_path / "spec.json")], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "MODEL: empty" in res.output, res.output
    assert not (tmp_path / "spec.json").exists()


@pytest.mark.parametrize("folder", ["m with space", "-m"])
def test_tune_refuses_a_folder_whose_name_can_never_be_deployed_before_any_search(folder, tmp_path):
    import shutil

    from runtime.modelfiles.catalog import CATALOG_DIR

    model = tmp_path / folder
    model.mkdir()
    shutil.copy(sorted(Path(CATALOG_DIR).glob("*config.json"))[0], model / "config.json")
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(model), "--out", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "rename the folder" in res.output, res.output
    assert not out.exists()
