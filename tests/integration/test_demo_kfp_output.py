"""`make demo` shows kfp.local's run without each step's ExecutorInput JSON, which goes to the pipeline log.

Specification (runtime.demo._filtered_stdout around a real kfp.local run of a one-step pipeline):
* the console keeps kfp's own records and the step's own output, and gets one line naming the log in place
  of each ``Got executor_input:`` record's JSON body;
* the log holds everything, the JSON body included.
"""

import pytest  # no `from __future__ import annotations`: kfp reads the component's annotations as types

pytestmark = pytest.mark.integration


def test_step_inputs_go_to_the_log_not_the_console(tmp_path, capsys):
    from kfp import dsl, local

    from runtime.demo import _filtered_stdout

    @dsl.component(base_image="python:3.11")
    def shout(word: str) -> str:
        print(f"step says {word.upper()}")
        return word

    @dsl.pipeline(name="one-step")
    def one_step(word: str) -> str:
        return shout(word=word).output

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"),
               raise_on_error=True)
    with _filtered_stdout(tmp_path / "logs" / "kfp.log") as log_path:
        result = one_step(word="needle-7f3a")
    assert result.output == "needle-7f3a"
    console = capsys.readouterr().out
    log = log_path.read_text()
    assert "Got executor_input:" in log and '"parameterValues"' in log and "needle-7f3a" in log
    assert "step says NEEDLE-7F3A" in console and "step says NEEDLE-7F3A" in log
    assert '"parameterValues"' not in console and "Got executor_input:" not in console
    assert f"executor input: in {log_path}" in console
    # kfp's records after the input still reach the console
    assert "[KFP Executor" in console and "Wrote executor output file" in console
