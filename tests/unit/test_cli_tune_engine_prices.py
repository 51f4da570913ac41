"""`pdserve tune` / `promote` engine and price options: --max-model-len and --engine-arg reach the written spec
(and the promote request), bad values exit 2 with one line, --usd-per-gpu-hour / --price-file change the
table's $/Mtok, --parallelism all labels pool layouts; the use-case requests carry the same settings."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec
from runtime.modelfiles.catalog import CATALOG_DIR

runner = CliRunner()
LLAMA_70B = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json"
DEEPSEEK_V3 = CATALOG_DIR / "deepseek-ai--DeepSeek-V3_config.json"
REPO = Path(__file__).resolve().parents[2]


def _winner_usd(output: str) -> float:
    """$/Mtok of the starred (winning) row of the tune table."""
    row = next(line for line in output.splitlines() if "★" in line)
    return float(re.findall(r"\d+\.\d\d", row)[-1])


def test_max_model_len_reaches_the_written_spec(tmp_path):
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--out", str(out), "--max-model-len", "8192"])
    assert res.exit_code == 0, res.output
    assert DeploymentSpec.model_validate_json(out.read_text()).engine.max_model_len_tokens == 8192


@pytest.mark.parametrize("value", ["0", "-5"])
def test_non_positive_max_model_len_exits_2_with_one_line(value):
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--max-model-len", value])
    assert res.exit_code == 2
    assert "--max-model-len: must be a positive number of tokens" in res.output
    assert "Traceback" not in res.output


def test_max_model_len_below_the_workload_exits_2_naming_the_option(tmp_path):
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--out", str(out), "--max-model-len", "1000"])
    assert res.exit_code == 2, res.output
    assert "--max-model-len 1000:" in res.output and not out.exists()


def test_max_model_len_below_the_workload_is_refused_before_the_search(tmp_path):
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--max-model-len", "10"], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: --max-model-len 10: max_model_len 10 < the workload's ISL + OSL (3150 "
                                 "tokens)"), res.output
    assert "winner:" not in res.output and "┏" not in res.output  # no table: nothing was searched
    trace = tmp_path / "t.jsonl"  # with a trace, its mean lengths are the workload's
    trace.write_text("".join(f'{{"timestamp": {i * 100}, "input_length": 1000, "output_length": 200}}\n'
                             for i in range(4)))
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--trace", str(trace), "--max-model-len", "1100"],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "(1200 tokens)" in res.output and "winner:" not in res.output, res.output


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the pinned vLLM")
def test_engine_arg_shows_pdserves_error_without_vllms_log_lines():
    # a fresh process: vLLM logs its platform INFO / WARNING lines (Triton, ...) when first imported
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "COLUMNS")}
    res = subprocess.run([sys.executable, "-m", "runtime.cli", "tune", "llama-3.1-8b", "--engine-arg", "foo=bar"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert out.strip() == "error: --engine-arg 'foo=bar': --foo is not an engine argument of the installed vLLM", out


def test_vllm_logs_quiet_restores_the_level_and_leaves_verbose_and_the_users_level_alone(monkeypatch):
    import logging

    from runtime.faces.common import vllm_logs_quiet

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    log = logging.getLogger("vllm")
    before = log.level
    with vllm_logs_quiet(False):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and log.level == logging.ERROR
    assert "VLLM_LOGGING_LEVEL" not in os.environ and log.level == before
    with vllm_logs_quiet(True):  # pdserve -v
        assert "VLLM_LOGGING_LEVEL" not in os.environ and log.level == before
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    with vllm_logs_quiet(False):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG" and log.level == before
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_usd_per_gpu_hour_changes_the_tables_usd_per_mtok():
    base = runner.invoke(app, ["tune", str(LLAMA_70B)], env={"COLUMNS": "200"})
    cheap = runner.invoke(app, ["tune", str(LLAMA_70B), "--usd-per-gpu-hour", "H100-SXM=1.0"], env={"COLUMNS": "200"})
    assert base.exit_code == 0 and cheap.exit_code == 0, cheap.output
    assert _winner_usd(cheap.output) < _winner_usd(base.output)


def test_price_file_prices_and_an_item_wins_over_it(tmp_path):
    f = tmp_path / "prices.yaml"
    f.write_text("H100-SXM: 2.0\n")
    from_file = runner.invoke(app, ["tune", str(LLAMA_70B), "--price-file", str(f)], env={"COLUMNS": "200"})
    both = runner.invoke(app, ["tune", str(LLAMA_70B), "--price-file", str(f), "--usd-per-gpu-hour", "H100=1.0"],
                         env={"COLUMNS": "200"})
    assert from_file.exit_code == 0 and both.exit_code == 0, both.output
    assert _winner_usd(both.output) == pytest.approx(_winner_usd(from_file.output) / 2, rel=0.02)


@pytest.mark.parametrize("args, words", [
    (["--usd-per-gpu-hour", "H100-SXM"], "expected GPU=USD_PER_GPU_HOUR"),
    (["--usd-per-gpu-hour", "NOPE=1"], "--usd-per-gpu-hour 'NOPE=1'"),
    (["--usd-per-gpu-hour", "H100-SXM=-1"], "finite USD per GPU-hour"),
    (["--price-file", "/nonexistent/prices.yaml"], "--price-file /nonexistent/prices.yaml"),
    (["--parallelism", "ep"], "--parallelism"),
])
def test_bad_price_and_parallelism_values_exit_2(args, words):
    res = runner.invoke(app, ["tune", str(LLAMA_70B), *args], env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    assert words in res.output and "Traceback" not in res.output


def test_parallelism_all_labels_pool_layouts_and_counts_their_gpus(tmp_path):
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(DEEPSEEK_V3), "--gpu", "H200-SXM", "--precision", "fp8",
                              "--parallelism", "all", "--out", str(out), "--gpu-budget", "512"],
                        env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "layout" in res.output and re.search(r"(DP|EP|PP)\d+", res.output)
    assert "note: searched:" in res.output  # TuneResult.notes are printed
    spec = DeploymentSpec.model_validate_json(out.read_text())
    row = next(line for line in res.output.splitlines() if "★" in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert str(spec.prefill.gpus * spec.prefill.replicas + spec.decode.gpus * spec.decode.replicas) in cells


def test_engine_arg_with_an_unknown_key_exits_2_naming_a_close_match(tmp_path):
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", str(LLAMA_70B), "--out", str(out), "--engine-arg", "max-num-seq=64"])
    assert res.exit_code == 2, res.output
    assert "--max-num-seqs" in res.output and not out.exists()
    ok = runner.invoke(app, ["tune", str(LLAMA_70B), "--out", str(out), "--engine-arg", "max_num_seqs=64"])
    assert ok.exit_code == 0, ok.output
    assert "--max-num-seqs=64" in DeploymentSpec.model_validate_json(out.read_text()).engine.extra_args


def test_promote_refuses_a_bad_max_model_len_and_skip_if_live_with_overrides(tmp_path):
    res = runner.invoke(app, ["promote", "m", "--max-model-len", "0"])
    assert res.exit_code == 2 and "--max-model-len: must be a positive" in res.output
    res = runner.invoke(app, ["promote", "m", "--apply", "--kube-context", "k", "--skip-if-live",
                              "--max-model-len", "8192"])
    assert res.exit_code == 2 and "--skip-if-live: not with --max-model-len" in res.output


def test_promote_passes_the_overrides_to_the_request(monkeypatch, tmp_path):
    import runtime.usecases.promote as uc

    seen = {}

    def fake(request):  # the use case itself needs MLflow; here only the option -> request mapping is checked
        seen["request"] = request
        raise ValueError("stop")

    monkeypatch.setattr(uc, "promote", fake)
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")
    res = runner.invoke(app, ["promote", "m", "--mlflow-uri", f"sqlite:///{db}", "--max-model-len", "8192"])
    assert res.exit_code == 1 and "stop" in res.output
    assert seen["request"].max_model_len_tokens == 8192 and seen["request"].engine_args == []


def test_tune_request_checks_the_new_settings():
    from runtime.usecases.tune import TuneSettings, check_tune_settings

    base = dict(gpu="H100-SXM", ttft_p90_ms=2000.0, itl_p90_ms=50.0, isl_tokens=3000, osl_tokens=150,
                registered_model="m")
    p = check_tune_settings(TuneSettings(**base, parallelism="ALL", usd_per_gpu_hour=["H100=1.5"],
                                         max_model_len_tokens=8192))
    assert (p.parallelism, p.prices, p.max_model_len_tokens, p.engine_args) == ("all", {"H100-SXM": 1.5}, 8192, ())
    assert check_tune_settings(TuneSettings(**base)).prices is None
    with pytest.raises(ValueError) as e:
        check_tune_settings(TuneSettings(**base, parallelism="ep", usd_per_gpu_hour=["X=1"], max_model_len_tokens=0))
    assert "parallelism 'ep'" in str(e.value) and "--usd-per-gpu-hour 'X=1'" in str(e.value)
    assert "max_model_len_tokens" in str(e.value)


def test_champion_comparison_uses_the_same_prices():
    from runtime.config import ModelRef, SloSpec, WorkloadSpec
    from runtime.modelfiles.load import load_model_spec
    from runtime.tuner.search import tune
    from runtime.usecases.champion import ChampionPolicy, check_against_champion

    model = load_model_spec(LLAMA_70B)
    slo, wl = SloSpec(ttft_p90_ms=2000, itl_p90_ms=50), WorkloadSpec(isl_tokens=3000, osl_tokens=150)
    theirs = tune(model, "A100-SXM-80GB", slo, wl).to_deployment_spec(ModelRef(name="x", path=""))
    prices = {"H100-SXM": 1.0, "A100-SXM-80GB": 1.0}
    result = tune(model, "H100-SXM", slo, wl, prices=prices)
    spec = result.to_deployment_spec(ModelRef(name="x", path=""))
    plain = check_against_champion(result, spec, "m", ChampionPolicy(), lambda n: ("1", theirs))
    priced = check_against_champion(result, spec, "m", ChampionPolicy(), lambda n: ("1", theirs), prices=prices)
    assert priced.comparison.metric == "usd_per_mtok"
    assert priced.comparison.champion.usd_per_mtok != plain.comparison.champion.usd_per_mtok


def test_promote_names_a_max_model_len_below_the_champions_workload_as_a_bad_value(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # a real champion: tuned for ISL 3000 + OSL 150
    reg = runner.invoke(app, ["tune", "llama-3.1-8b", "--mlflow-uri", uri, "--register", "m"])
    assert reg.exit_code == 0, reg.output
    out = tmp_path / "m.yaml"
    res = runner.invoke(app, ["promote", "m", "--mlflow-uri", uri, "--allow-unstaged", "--max-model-len", "1000",
                              "--out", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: --max-model-len: max_model_len 1000 < the workload's ISL + OSL (3150")
    assert not out.exists()


def test_promote_refuses_a_max_model_len_beyond_the_staged_models_context(tmp_path):
    from runtime.modelfiles.catalog import resolve_model_config

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(resolve_model_config(Path("llama-3.1-8b")).read_text())  # 131072 tokens
    (src / "model.safetensors").write_bytes(b"\0" * 16)
    fsx = tmp_path / "fsx"
    assert runner.invoke(app, ["stage", str(src), str(fsx / "models" / "llama8")]).exit_code == 0
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reg = runner.invoke(app, ["tune", str(fsx / "models" / "llama8"), "--fsx-root", str(fsx), "--mlflow-uri", uri,
                              "--register", "m"])
    assert reg.exit_code == 0, reg.output
    out = tmp_path / "m.yaml"
    res = runner.invoke(app, ["promote", "m", "--mlflow-uri", uri, "--max-model-len", "131073", "--out", str(out)],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: --max-model-len: max_model_len 131073 > the model's context window (131072")
    assert not out.exists()
    ok = runner.invoke(app, ["promote", "m", "--mlflow-uri", uri, "--max-model-len", "131072", "--out", str(out)])
    assert ok.exit_code == 0 and out.exists(), ok.output  # the context itself is a valid limit
