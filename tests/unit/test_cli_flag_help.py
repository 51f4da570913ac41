"""`--help` shows an on/off flag bare (`--force`), as click and argparse do, not as `--force <bool>`: typer's
rich help prints a type beside every option (runtime.faces.common.plain_flags, FlagCommand, ReflowGroup)."""

from __future__ import annotations

import re

import pytest
import typer
from typer.core import TyperOption
from typer.testing import CliRunner

from runtime.cli import app

runner = CliRunner()


def _commands() -> list[tuple[list[str], object, object]]:
    root = typer.main.get_command(app)
    out = []

    def walk(cmd, path, parent):
        ctx = typer.Context(cmd, info_name=path[-1] if path else "pdserve", parent=parent)
        out.append((path, cmd, ctx))
        if hasattr(cmd, "list_commands"):
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), [*path, name], ctx)

    walk(root, [], None)
    return out


COMMANDS = _commands()


@pytest.mark.parametrize("command", [c[0] for c in COMMANDS], ids=lambda c: " ".join(c) or "pdserve")
def test_flags_show_no_type_in_help(command):
    res = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "<bool>" not in res.output
    help_line = next(line for line in res.output.splitlines() if re.match(r"│\s+--help\s", line))
    assert "-h" in help_line and "<" not in help_line and "Show this message" in help_line


def test_value_options_keep_their_type():
    res = runner.invoke(app, ["promote", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    lines = res.output.splitlines()
    assert "<str>" in " ".join(next(line for line in lines if re.match(r"│\s+--kube-context\s", line)).split()[:3])
    force = next(line for line in lines if re.match(r"│\s+--force\s", line))
    assert force.split()[2] == "Replace"


@pytest.mark.parametrize("entry", COMMANDS, ids=lambda c: " ".join(c[0]) or "pdserve")
def test_every_command_uses_a_flag_class(entry):
    from runtime.faces.common import FlagCommand, ReflowGroup

    path, cmd, ctx = entry
    assert isinstance(cmd, (FlagCommand, ReflowGroup)), f"{' '.join(path)}: register it with cls=FlagCommand"
    for param in cmd.get_params(ctx):
        if isinstance(param, TyperOption) and param.is_flag and not param.count:
            assert param.display_type_rich(ctx) == "", param.opts


@pytest.mark.parametrize("command, option, field", [
    (["batch", "retune-schedule"], "--mlflow-uri", "mlflow_uri"),
    (["batch", "retune-schedule"], "--pvc", "pvc_name"),
    (["batch", "retune-schedule"], "--service-account", "service_account"),
    (["batch", "workflow"], "--service-account", "service_account"),
])
def test_batch_help_shows_the_default_the_render_applies(command, option, field):
    from runtime.batch.workflow_specs import BatchInferenceWorkflowSpec, RetuneCronWorkflowSpec

    spec = RetuneCronWorkflowSpec if command[-1] == "retune-schedule" else BatchInferenceWorkflowSpec
    res = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "300"}, terminal_width=300)
    assert res.exit_code == 0, res.output
    line = next(line for line in res.output.splitlines() if re.match(rf"│\s+{option}\s", line))
    assert f"[default: {spec.model_fields[field].default}]" in line, line
