"""One table of options per command (runtime/command_options.py): every entry is an option of the real `pdserve`
command, every use-case request field has an option or is listed as having none, and the Argo workflows' command
lines use only options from the table (or the CLI-only ones named here)."""

from __future__ import annotations

import typer.main

from runtime.cli import app
from runtime.command_options import PROMOTE_OPTIONS, PROMOTE_WITHOUT_OPTION, TUNE_OPTIONS, TUNE_WITHOUT_OPTION
from runtime.usecases.promote import PromoteRequest
from runtime.usecases.tune import TuneRequest


def _options(command: str) -> set[str]:
    cmd = typer.main.get_command(app).commands[command]
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def test_every_table_entry_is_an_option_of_the_real_command():
    assert set(TUNE_OPTIONS.values()) <= _options("tune")
    assert set(PROMOTE_OPTIONS.values()) <= _options("promote")


def test_every_request_field_has_an_option_or_is_listed_without_one():
    assert set(TuneRequest.model_fields) == set(TUNE_OPTIONS) | TUNE_WITHOUT_OPTION
    assert set(PromoteRequest.model_fields) == set(PROMOTE_OPTIONS) | PROMOTE_WITHOUT_OPTION


def test_the_workflow_command_lines_use_the_tables():
    from runtime.batch.workflows import promote_argv, retune_argv
    from tests.unit.test_batch_workflows import TRAFFIC_PREFIX, retune_spec

    spec = retune_spec(traffic_uri=TRAFFIC_PREFIX, promote=True, gpu="H100-SXM", precision="bf16", ttft_ms=900.0,
                       itl_ms=40.0, rate=3.0, gpu_budget=16, planner="sla", min_improvement_pct=2.0,
                       promote_traffic_upload="s3://pdserve-traffic/up/")
    cli_only_tune = {"--like", "--trace", "--out", "--decision-out", "--decision-values"}
    tune_opts = {a for a in retune_argv(spec) if a.startswith("--")}
    assert tune_opts <= set(TUNE_OPTIONS.values()) | cli_only_tune and tune_opts <= _options("tune")
    promote_opts = {a for a in promote_argv(spec) if a.startswith("--")}
    assert promote_opts <= set(PROMOTE_OPTIONS.values())
