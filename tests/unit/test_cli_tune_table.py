"""`pdserve tune > file` (stdout a pipe or a file: a CI log) prints the candidate table whole: no cell elided
("50.…") at rich's 80 columns, so TTFT, ITL, $/Mtok and the footnote markers can be read from the log; in a
terminal narrower than the table every cell is kept too, each number on one line: wrapped between words, else one
record per row (runtime.faces.common.print_table)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from runtime.faces import common

REPO = Path(__file__).resolve().parents[2]


def test_the_table_in_a_pipe_keeps_every_number_and_footnote_marker(tmp_path):
    # --parallelism all labels each pool's layout (TP2 / TP4): wider than 80 columns
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    res = subprocess.run([sys.executable, "-m", "runtime.cli", "tune", "llama-3.1-70b", "--parallelism", "all",
                          "--state-dir", str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout, res.stdout
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in res.stdout.splitlines() if line.startswith("│")]
    assert rows and all(len(r) == 9 for r in rows), res.stdout
    feasible = [r for r in rows if r[5] != "-"]
    assert feasible and any(r[0] == "★" for r in feasible)
    for r in feasible:  # TTFT, ITL, goodput, workers P:D, GPUs, $/Mtok: each number whole
        assert re.fullmatch(r"\d+\.\d", r[2]) and re.fullmatch(r"\d+\.\d\d", r[3]), r
        assert re.fullmatch(r"\d+\.\d{3}", r[4]) and re.fullmatch(r"\d+:\d+", r[5]), r
        assert re.fullmatch(r"\d+", r[6]) and re.fullmatch(r"\d+\.\d\d", r[7]), r
    markers = {r[8] for r in rows if r[5] == "-"}
    assert markers and all(re.fullmatch(r"\[\d+\]", m) for m in markers), markers
    for m in markers:  # each marker's reason is listed under the table
        assert any(line.startswith(m + " ") for line in res.stdout.splitlines()), m


# ---- a terminal narrower than the table: every cell whole, no number split (print_table, fitted_table) ----


def _terminal(table: Table, width: int) -> str:
    """``table`` as print_table prints it on stdout when stdout is a terminal ``width`` columns wide."""
    buf = io.StringIO()
    with mock.patch.object(common, "console", Console(file=buf, width=width, force_terminal=True, color_system=None)):
        common.print_table(table)
    return buf.getvalue()


def _words(cell: object) -> list[str]:
    return (Text.from_markup(cell) if isinstance(cell, str) else cell).plain.split()


def _table_columns(out: str, bar: str) -> list[list[str]]:
    """The words of each column of the box lines whose border is ``bar`` (┃ the header, │ the body), top to
    bottom: a cell wrapped over several lines reads back as its words in order."""
    columns: list[list[str]] = []
    for line in out.splitlines():
        if line.startswith(bar):
            for i, piece in enumerate(line.split(bar)[1:-1]):
                columns += [[] for _ in range(i + 1 - len(columns))]
                columns[i] += piece.split()
    return columns


def _check_whole(table: Table, out: str, width: int) -> str:
    """Assert that ``out`` (``table`` printed ``width`` columns wide) keeps every cell, each word unbroken;
    returns the layout: "table" or "records"."""
    assert "…" not in out and all(cell_len(line) <= width for line in out.splitlines()), out
    assert out.split()[:len(_words(table.title))] == _words(table.title), out
    if "┃" in out:  # a table: each column reads back as its header's, then its cells' words
        assert _table_columns(out, "┃") == [_words(c.header) for c in table.columns], out
        assert _table_columns(out, "│") == [[w for cell in c.cells for w in _words(cell)] for c in table.columns], out
        return "table"
    expected = _words(table.title)  # then "header: value" for each non-empty cell, row after row
    for cells in zip(*(c.cells for c in table.columns)):
        for c, cell in zip(table.columns, cells):
            if _words(cell):
                expected += [*_words(c.header)[:-1], *[w + ":" for w in _words(c.header)[-1:]], *_words(cell)]
    assert out.split() == expected, out
    return "records"


def _wide_table() -> Table:
    table = Table(title="a table of long numbers wider than the terminal")
    for header in ("layout\nP / D", "prefill\nTTFT ms", "decode\nITL ms", "goodput\nreq/s/GPU", "tokens\nper s",
                   "cost\nUSD/Mtok", "GPUs", "why\nnot", "note"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_row("TP8 PP4 / TP8", "123456.789", "0.000123", "98765.4321", "1234567", "73.90", "58", "[1]",
                  "weights do not fit at TP 1")
    table.add_row("TP1 / TP1", "-", "-", "0.000", "-", "-", "-", "", "")
    table.add_row("TP4xEP8 / TP4", "1502.7", "29.41", "0.183", "6:23", "1000000.01", "1024", "[12]",
                  "prefill TP > decode TP (Nixl, non-MLA)")
    return table


@pytest.mark.parametrize(("width", "layout"), [(100, "table"), (80, "table"), (60, "records"), (30, "records")])
def test_a_table_wider_than_the_terminal_keeps_every_number_whole(width, layout):
    table = _wide_table()
    assert cell_len(_terminal(table, 1000).splitlines()[1]) > 100  # wider than every terminal here
    assert _check_whole(table, _terminal(table, width), width) == layout


def test_a_table_that_fits_prints_as_it_would_without_fitting():
    table = _wide_table()
    plain = io.StringIO()
    Console(file=plain, width=200, force_terminal=True, color_system=None).print(table)
    assert _terminal(table, 200) == plain.getvalue()


@pytest.mark.parametrize("width", [80, 60, 40])
def test_the_tune_table_in_a_narrow_terminal_keeps_every_cell(width, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import runtime.faces.tune as tune_face
    from runtime.cli import app

    tables: list[Table] = []
    monkeypatch.setattr(tune_face, "print_table", tables.append)
    res = CliRunner().invoke(app, ["tune", "llama-3.1-70b", "--parallelism", "all", "--state-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    # the table's longest words and its borders take 57 columns: narrower, one record per row
    assert _check_whole(tables[-1], _terminal(tables[-1], width), width) == ("records" if width < 57 else "table")
