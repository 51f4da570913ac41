"""`pdserve models` shows the format each checkpoint stores its weights in, the one `tune` costs them in
(ModelSpec.weight_format): mxfp4 for gpt-oss, fp8-block for DeepSeek-V3, not the deployment precision."""

from __future__ import annotations

from typer.testing import CliRunner

from runtime.cli import app

runner = CliRunner()


def _rows() -> dict[str, list[str]]:
    res = runner.invoke(app, ["models"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("name"))
    assert "weights" in header.split() and "prec" not in header.split()
    return {line.split()[0]: line.split() for line in lines if line.split() and "-" in line.split()[0]}


def test_the_weights_column_is_the_checkpoints_own_format():
    rows = _rows()
    assert "mxfp4" in rows["gpt-oss-20b"] and "mxfp4" in rows["gpt-oss-120b"]
    assert "fp8-block" in rows["deepseek-v3"] and "fp8" in rows["llama-3.1-70b-fp8"]
    assert "bf16" in rows["llama-3.1-8b"]


def test_a_format_pdserve_does_not_model_is_named_by_its_method():
    from runtime.faces.misc import checkpoint_weights

    class M:
        weight_format, quant_method = "unknown", "awq"

    assert checkpoint_weights(M()) == "awq"


def test_the_help_names_every_column_and_that_tune_takes_the_id():
    table = runner.invoke(app, ["models"]).output  # a pipe: every column, ids included
    assert "kind" in table and "Hugging Face id" in table and "meta-llama/Meta-Llama-3.1-8B" in table
    res = runner.invoke(app, ["models", "--help"], env={"COLUMNS": "300"}, terminal_width=300)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.replace("│", " ").split())
    for column in ("the catalog name", "the kind (dense or MoE, +MLA", "parameters active per token", "layers",
                   "KV cache per token", "the format the checkpoint stores its weights in", "the Hugging Face id"):
        assert column in text, column
    assert "which `tune` takes in place of the name" in text


def test_in_a_narrow_terminal_every_name_and_number_stays_whole(monkeypatch):
    """A terminal narrower than the table without ids (about 75 columns) gets every cell whole, as
    `print_table` lays it out, never an elided "…" cell."""
    import io

    from rich.console import Console

    from runtime.faces import misc
    from runtime.modelfiles.catalog import catalog_entries

    buf = io.StringIO()
    monkeypatch.setattr(misc, "console", Console(file=buf, width=50, force_terminal=True, color_system=None))
    res = runner.invoke(app, ["models"])
    assert res.exit_code == 0, res.output
    text = buf.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 50
    words = set(text.replace("│", " ").split())
    for e in catalog_entries():
        assert e.name in words, e.name
    assert {"mxfp4", "fp8-block", "bf16"} <= words
