"""Help text reflows at the terminal's width: a command's docstring keeps no hard line break inside a paragraph
(runtime.faces.common.reflow_help, applied by ReflowGroup to every command), so `--help` at 80 or 120 columns
leaves no fragment of a line; paragraphs and list items keep their breaks."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from runtime.cli import app
from runtime.faces.common import reflow_help

runner = CliRunner()


def _commands() -> list[list[str]]:
    root = typer.main.get_command(app)
    out = []

    def walk(cmd, path, parent):
        ctx = typer.Context(cmd, info_name=path[-1] if path else "pdserve", parent=parent)
        out.append(path)
        if hasattr(cmd, "list_commands"):
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), [*path, name], ctx)

    walk(root, [], None)
    return out


def test_paragraphs_join_and_breaks_lists_and_indented_lines_stay():
    text = """First line
    goes on.

    A paragraph
    over two lines.

    - an item
    - another item
      continued
    1. numbered"""
    assert reflow_help(text) == ("First line goes on.\n\nA paragraph over two lines.\n\n- an item\n- another item\n"
                                 "  continued\n1. numbered")
    assert reflow_help(None) is None


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "pdserve")
def test_no_help_description_line_breaks_before_the_width(command, columns):
    res = runner.invoke(app, [*command, "--help"], env={"COLUMNS": str(columns)}, terminal_width=columns)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    start = next(i for i, line in enumerate(lines) if "Usage:" in line) + 1
    end = next((i for i, line in enumerate(lines) if line.startswith("╭")), len(lines))
    text = [line.rstrip() for line in lines[start:end]]
    for line, after in zip(text, text[1:]):
        if line and after:  # the next word would have fitted on this line: a hard break, not a wrap
            word = after.split()[0]
            assert len(line) + 1 + len(word) > columns - 1, f"{line!r} / {after!r}"


def test_every_docstring_is_reflowed_on_the_click_command():
    root = typer.main.get_command(app)
    tune = root.get_command(typer.Context(root), "tune")
    assert not re.search(r"[^\n]\n[^\n]", tune.help)  # no single line break left
