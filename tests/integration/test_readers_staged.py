"""Readers of a staged model refuse a folder without a valid staging marker:

* the `promote` step (and `pdserve promote`) refuses a champion whose model path is not a verified staged
  copy, before writing anything, against a real sqlite-backed MLflow registry;
* the runtime started with `--require-staged` (as the rendered KServe runtime is) exits at once naming the
  folder; without the flag a prepared HF folder (the local demo/e2e runs) is still served;
* the tune use case refuses a winner that needs more GPUs than planner.gpu_budget before logging anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.config import ModelRef, SloSpec, WorkloadSpec
from runtime.modelfiles.load import load_model_spec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.staging.manifest import MARKER_NAME, StagingError
from runtime.staging.stage import stage_model

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
LLAMA_70B = CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json"


def _hf_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(LLAMA_70B.read_text())
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {}}}))
    (path / "model.safetensors").write_bytes(b"\0" * 16)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("readers")
    src = _hf_folder(root / "prepared")  # like convert_smollm2's output: no marker
    staged = root / "fsx" / "models" / "llama70b"
    stage_model(str(src), staged, progress=False)
    return {"prepared": src, "staged": staged}


@pytest.fixture(scope="module")
def registry(tmp_path_factory, folders) -> str:
    """A real sqlite MLflow with two registered models: one tuned on the staged copy, one on the raw folder."""
    from runtime.tracking.mlflow_runs import log_tuning
    from runtime.tuner.search import tune

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    result = tune(load_model_spec(LLAMA_70B), "H100-SXM", SloSpec(), WorkloadSpec())
    for name, folder in (("staged", folders["staged"]), ("prepared", folders["prepared"])):
        log_tuning(result, tracking_uri=uri, experiment=f"readers-{name}", registered_model=name,
                   model_ref=ModelRef(name="llama70b", path=str(folder)))
    return uri


def _promote(uri: str, registered: str, out: Path, **kw):
    from runtime.usecases.promote import PromoteRequest, promote

    return promote(PromoteRequest(registered_model=registered, mlflow_tracking_uri=uri, out_path=str(out),
                                  image="img:1", **kw)).metadata()


def test_promote_renders_a_champion_tuned_on_a_staged_copy(registry, tmp_path):
    info = _promote(registry, "staged", tmp_path / "m.yaml")
    assert info["num_objects"] > 0 and (tmp_path / "m.yaml").stat().st_size > 0


def test_promote_refuses_a_champion_whose_folder_has_no_marker_and_writes_nothing(registry, folders, tmp_path):
    with pytest.raises(StagingError, match=f"{folders['prepared']}.*{MARKER_NAME}"):
        _promote(registry, "prepared", tmp_path / "m.yaml")
    assert not (tmp_path / "m.yaml").exists()
    assert _promote(registry, "prepared", tmp_path / "m.yaml", require_staged=False)["num_objects"] > 0


def test_promote_refuses_a_staged_copy_that_lost_a_file(registry, folders, tmp_path):
    broken = folders["staged"].parent / "broken"
    stage_model(str(folders["prepared"]), broken, progress=False)
    from runtime.tracking.mlflow_runs import log_tuning
    from runtime.tuner.search import tune

    result = tune(load_model_spec(LLAMA_70B), "H100-SXM", SloSpec(), WorkloadSpec())
    log_tuning(result, tracking_uri=registry, experiment="readers-broken", registered_model="broken",
               model_ref=ModelRef(name="llama70b", path=str(broken)))
    (broken / "tokenizer.json").unlink()
    with pytest.raises(StagingError, match="tokenizer.json"):
        _promote(registry, "broken", tmp_path / "m.yaml")


def test_pdserve_promote_names_the_folder_and_offers_allow_unstaged(registry, folders, tmp_path):
    from runtime.cli import app

    runner = CliRunner()
    out = tmp_path / "m.yaml"
    res = runner.invoke(app, ["promote", "prepared", "--mlflow-uri", registry, "--out", str(out)],
                        env={"COLUMNS": "400"})
    assert res.exit_code == 1
    assert "StagingError" not in res.output and "not a verified staged copy" in res.output and str(folders["prepared"]) in " ".join(res.output.split())
    assert "--allow-unstaged" in res.output  # the way out is named
    assert not out.exists()
    res = runner.invoke(app, ["promote", "prepared", "--mlflow-uri", registry, "--out", str(out), "--allow-unstaged"],
                        env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert out.exists()


def test_pdserve_promote_traffic_upload_makes_the_endpoint_record_and_ship_its_traffic(registry, tmp_path):
    """`pdserve promote --traffic-upload s3://…/` renders the runtime with a traffic log on an emptyDir shipped
    under <prefix><InferenceService>/; a bad URI is refused before anything is written."""
    import yaml

    from runtime.cli import app

    runner = CliRunner()
    out = tmp_path / "m.yaml"
    res = runner.invoke(app, ["promote", "staged", "--mlflow-uri", registry, "--out", str(out), "--traffic-upload",
                              "s3://pdserve-traffic/online"], env={"COLUMNS": "400"})
    assert res.exit_code == 2 and "must end in '/'" in " ".join(res.output.split()) and not out.exists()
    res = runner.invoke(app, ["promote", "staged", "--mlflow-uri", registry, "--out", str(out), "--traffic-upload",
                              "s3://pdserve-traffic/online/"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    isvc = next(o for o in yaml.safe_load_all(out.read_text()) if o and o["kind"] == "InferenceService")
    args = isvc["spec"]["predictor"]["model"]["args"]
    assert f"--traffic-upload=s3://pdserve-traffic/online/{isvc['metadata']['name']}/" in args
    assert any(a.startswith("--traffic-log=") for a in args)


def _runtime(*args: str) -> subprocess.CompletedProcess:
    from runtime.engines.vllm_worker import free_port  # the runtime exits before binding it

    return subprocess.run([sys.executable, "-m", "runtime.server", "--model-name", "m",
                           "--decode-url", "http://127.0.0.1:9", "--http-port", str(free_port()), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_runtime_with_require_staged_exits_naming_a_folder_without_marker(folders):
    res = _runtime("--require-staged", "--model-dir", str(folders["prepared"]))
    assert res.returncode == 1
    assert f"--model-dir {folders['prepared']} is not a verified staged model folder" in res.stderr
    assert MARKER_NAME in res.stderr
    res = _runtime("--require-staged", "--router", "kv", "--tokenizer-dir", str(folders["prepared"]))
    assert res.returncode == 1 and f"--tokenizer-dir {folders['prepared']}" in res.stderr
    res = _runtime("--require-staged")
    assert res.returncode == 1 and "--require-staged needs --model-dir or --tokenizer-dir" in res.stderr


def test_runtime_check_accepts_a_staged_folder_and_ignores_markers_without_the_flag(folders):
    from runtime.server.__main__ import check_staged, parse_args

    staged = parse_args(["--model-name", "m", "--decode-url", "http://127.0.0.1:1", "--require-staged",
                         "--model-dir", str(folders["staged"]), "--tokenizer-dir", str(folders["staged"])])
    assert check_staged(staged) == [folders["staged"], folders["staged"]]
    local = parse_args(["--model-name", "m", "--decode-url", "http://127.0.0.1:1", "--tokenizer-dir", str(folders["prepared"])])
    assert check_staged(local) == []  # local runs on a prepared HF folder need no marker


def test_tune_refuses_a_winner_over_the_gpu_budget_before_logging(folders, tmp_path):
    from runtime.deploy.budget import GpuBudgetError
    from runtime.usecases.tune import tune
    from tests.usecase_requests import tune_request

    db = tmp_path / "mlflow.db"
    with pytest.raises(GpuBudgetError, match=r"needs (\d+) GPUs .* planner.gpu_budget is 64 GPUs"):
        tune(tune_request(folders["staged"], "llama70b", "H100-SXM", "bf16", 2000.0, 50.0, 3000, 150, 100.0,
                          f"sqlite:///{db}", "over-budget"))
    assert not db.exists()  # nothing logged or registered
