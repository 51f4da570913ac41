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
