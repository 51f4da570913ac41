"""Bench scripts refuse bad arguments at parse time (exit 2, message naming the flag), before their long
work, and bench/perf_model_aic.py prints its result before writing --out, so a write error loses nothing."""

import json
import sys
import types
from pathlib import Path

import pytest

from runtime.modelfiles.catalog import CATALOG_DIR
from tests.scripts import load_script



@pytest.fixture(autouse=True)
def _logging_back_on():
    """bench/perf_model_aic.py's main() mutes logging process-wide (a script's choice); the benches run
    in-process here, so switch it back on for the tests that follow (their caplog assertions)."""
    import logging

    yield
    logging.disable(logging.NOTSET)


def _load(name: str):
    return load_script(f"bench/{name}.py")


def _refused(main, argv, capsys, *words):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    for w in words:
        assert w in err, err
    return err


# ------------------------------------------------------------------ bench/perf_model_aic.py
@pytest.fixture
def aic(monkeypatch):
    """bench/perf_model_aic.py with a stand-in aiconfigurator whose every estimate fails (rows not covered)."""
    def cli_estimate(*a, **kw):
        raise RuntimeError("stand-in")

    api = types.ModuleType("aiconfigurator.cli.api")
    api.cli_estimate = cli_estimate
    for name, mod in (("aiconfigurator", types.ModuleType("aiconfigurator")),
                      ("aiconfigurator.cli", types.ModuleType("aiconfigurator.cli")),
                      ("aiconfigurator.cli.api", api)):
        monkeypatch.setitem(sys.modules, name, mod)
    return _load("perf_model_aic")


def _table(tmp_path: Path) -> Path:
    p = tmp_path / "table.csv"
    p.write_text("source,trtllm_version,model,gpu,precision,tp,pp,num_gpus,isl,osl,total_output_tok_s,"
                 "per_gpu_output_tok_s\nt,0.14.0,LLaMA v3 70B,H200-SXM-141GB,FP8,1,1,1,1000,1000,2594.22,2594.22\n")
    return p


@pytest.mark.parametrize("args,words", [
    (["--stride", "0"], ["--stride", ">= 1"]),
    (["--stride", "-3"], ["--stride"]),
    (["--budget-s", "0"], ["--budget-s"]),
    (["--budget-s", "nan"], ["--budget-s"]),
])
def test_aic_bad_numbers_are_refused_at_parse_time(aic, tmp_path, capsys, args, words):
    _refused(aic.main, ["--table", str(_table(tmp_path)), "--models", str(CATALOG_DIR), "--out", str(tmp_path / "o.json"), *args], capsys, *words)


def test_aic_an_out_under_a_file_is_refused_at_parse_time(aic, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    _refused(aic.main, ["--table", str(_table(tmp_path)), "--models", str(CATALOG_DIR), "--out", str(tmp_path / "file" / "o.json")], capsys,
             "--out", "cannot create its folder")


def test_aic_an_out_that_is_a_folder_is_refused_at_parse_time(aic, tmp_path, capsys):
    _refused(aic.main, ["--table", str(_table(tmp_path)), "--models", str(CATALOG_DIR), "--out", str(tmp_path)], capsys, "--out", "is a folder")


def test_aic_prints_the_result_then_writes_out(aic, tmp_path, capsys):
    out = tmp_path / "sub" / "o.json"
    assert aic.main(["--table", str(_table(tmp_path)), "--models", str(CATALOG_DIR), "--out", str(out), "--stride", "1"]) == 0
    line = json.loads(capsys.readouterr().out.strip())
    assert line["rows"] == 1 and line["covered"] == 0 and "details" not in line
    assert json.loads(out.read_text())["details"][0]["why"].startswith("RuntimeError")


def test_aic_a_failed_write_still_leaves_the_result_on_stdout_and_stderr(aic, tmp_path, capsys, monkeypatch):
    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(aic, "write_text_atomically", full)
    assert aic.main(["--table", str(_table(tmp_path)), "--models", str(CATALOG_DIR), "--out", str(tmp_path / "o.json")]) == 1
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip())["rows"] == 1
    assert "No space left on device" in cap.err and '"details"' in cap.err


# ------------------------------------------------------------------ bench/planner.py
def test_planner_unknown_planner_names_are_refused_before_any_work(tmp_path, capsys):
    bench = _load("planner")
    # the trace does not exist: reaching the oracle work would fail on it instead
    err = _refused(bench.main, ["--trace", str(tmp_path / "missing.csv"), "--planners", "pdserve_sla,bogus"],
                   capsys, "--planners", "bogus")
    assert "pdserve_sla'" not in err  # only the unknown one is named as unknown


@pytest.mark.parametrize("value", ["0", "1", "1.5", "nan"])
def test_planner_target_attainment_outside_0_1_is_refused_before_any_work(tmp_path, capsys, value):
    bench = _load("planner")
    _refused(bench.main, ["--trace", str(tmp_path / "missing.csv"), "--dynamo-matched", "--target-attainment", value],
             capsys, "--target-attainment")


def test_planner_known_names_pass_the_check(tmp_path):
    bench = _load("planner")
    with pytest.raises(SystemExit, match="--model 'no-such-model'"):  # got past the argument checks
        bench.main(["--trace", str(tmp_path / "missing.csv"), "--model", "no-such-model",
                    "--planners", "pdserve_sla,static_peak,pdserve_sla_moving_average,ablation_"
                    + next(iter(bench.ABLATIONS))])


# ------------------------------------------------------------------ bench/router.py
@pytest.mark.parametrize("args,words", [
    (["--policies", "kv_aware,bogus"], ["--policies", "bogus"]),
    (["--policies", ""], ["--policies"]),
    (["--seeds", "0"], ["--seeds", ">= 1"]),
    (["--timing-repeats", "0"], ["--timing-repeats"]),
    (["--decision-queries", "-1"], ["--decision-queries"]),
])
def test_router_bad_arguments_are_refused_at_parse_time(tmp_path, capsys, args, words):
    _refused(_load("router").parse_args, ["--trace", str(tmp_path / "t.jsonl"), *args], capsys, *words)


def test_router_every_default_policy_passes_the_check(tmp_path):
    bench = _load("router")
    args = bench.parse_args(["--trace", str(tmp_path / "t.jsonl")])
    assert args.policies.split(",") == list(bench.POLICY_NAMES)


# ------------------------------------------------------------------ bench/staging.py
@pytest.mark.parametrize("flag", ["--size-mb", "--repeat", "--concurrency", "--part-size-mb"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_staging_sizes_and_counts_below_one_are_refused_at_parse_time(tmp_path, capsys, flag, value):
    _refused(_load("staging").main, ["--workdir", str(tmp_path), flag, value], capsys, flag, ">= 1")
    assert list(tmp_path.iterdir()) == []  # no scratch folder, no dataset written
