"""One tune use case for every face: `pdserve tune --register` and the pipeline's tune step (the KFP component's
own function, `components/tune.py`), given the same inputs in the same order, pick the same winner, register the
same spec and move (or keep) the `champion` alias the same way (runtime/usecases/tune.py, champion.py).
Real MLflow on sqlite, one registry per face."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec
from runtime.modelfiles.catalog import catalog_path
from runtime.tracking.mlflow_runs import champion_version, load_champion


@dataclass(frozen=True)
class Case:
    """Successive tunings of one model: request rates (requests/s) and the champion expected after each."""

    rates: list[float]
    champions: list[str]
    gpu: str = "H100-SXM"
    min_improvement_pct: float | None = None  # None: the default on both faces
    planner_mode: str = "off"
    gpu_budget: int | None = None
    extra: dict = field(default_factory=dict)


CASES = {
    # 40 -> 41: the same deployment, so the first champion stays (not 5 % cheaper); 41 -> 5: a third of the GPUs
    "kept-then-replaced": Case([40.0, 41.0, 5.0], ["1", "1", "3"]),
    # threshold 0: a winner exactly as cheap as the champion takes the alias
    "zero-threshold-replaces-a-tie": Case([40.0, 41.0], ["1", "2"], min_improvement_pct=0.0),
    # a huge threshold: even a third of the GPUs keeps the first champion
    "high-threshold-keeps": Case([40.0, 5.0], ["1", "1"], min_improvement_pct=90.0),
    # an instance type bounds TP by its GPU count; planner mode and budget reach the spec
    "instance-type-planner-budget": Case([10.0], ["1"], gpu="p5.48xlarge", planner_mode="sla", gpu_budget=32),
}


@pytest.fixture
def staged(tmp_path):
    from tests.usecase_requests import stage_config

    return stage_config(catalog_path("llama-3.1-8b"), tmp_path / "fsx" / "models" / "m", tmp_path)


def _cli(case: Case, staged, uri: str, rate: float, out_dir) -> tuple[dict, DeploymentSpec]:
    spec, decision = out_dir / f"spec-{rate}.json", out_dir / f"decision-{rate}.json"
    argv = ["tune", str(staged), "--fsx-root", str(staged.parent.parent), "--gpu", case.gpu, "--precision", "bf16",
            "--isl", "3000", "--osl", "150", "--rate", str(rate), "--planner", case.planner_mode, "--mlflow-uri",
            uri, "--register", "m-pd", "--out", str(spec), "--decision-out", str(decision)]
    if case.min_improvement_pct is not None:
        argv += ["--min-improvement-pct", str(case.min_improvement_pct)]
    if case.gpu_budget is not None:
        argv += ["--gpu-budget", str(case.gpu_budget)]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, res.output
    return json.loads(decision.read_text()), DeploymentSpec.model_validate_json(spec.read_text())


class _Metrics(dict):
    def log_metric(self, metric: str, value: float) -> None:
        self[metric] = value


def _kfp_step(case: Case, staged, uri: str, rate: float, out_dir):
    """The pipeline's tune-tp component function itself, with KFP's artifacts replaced by plain objects."""
    from components.tune import tune_tp

    metrics = _Metrics()
    kw = {} if case.min_improvement_pct is None else {"min_improvement_pct": case.min_improvement_pct}
    outputs = tune_tp.python_func(
        model=SimpleNamespace(metadata={"path": str(staged), "name": "m"}), gpu=case.gpu, precision="bf16",
        ttft_p90_ms=2000.0, itl_p90_ms=50.0, isl_tokens=3000, osl_tokens=150, request_rate_per_s=rate,
        gpu_budget=case.gpu_budget if case.gpu_budget is not None else 64, mlflow_tracking_uri=uri,
        registered_model="m-pd", metrics=metrics, table=SimpleNamespace(path=str(out_dir / f"table-{rate}.md")),
        plot=SimpleNamespace(path=str(out_dir / f"plot-{rate}.html")), fsx_root=str(staged.parent.parent),
        planner_mode=case.planner_mode, **kw)
    return outputs, metrics


@pytest.mark.parametrize("name", list(CASES))
def test_the_cli_and_the_pipeline_step_reach_the_same_outcome(name, staged, tmp_path):
    case = CASES[name]
    cli_uri, step_uri = f"sqlite:///{tmp_path / 'cli.db'}", f"sqlite:///{tmp_path / 'step.db'}"
    cli_champions, step_champions = [], []
    for k, rate in enumerate(case.rates):
        decision, cli_spec = _cli(case, staged, cli_uri, rate, tmp_path)
        out, metrics = _kfp_step(case, staged, step_uri, rate, tmp_path)
        cli_champions.append(decision["champion_version"])
        step_champions.append(out.champion_version)
        assert out.champion_version == champion_version(step_uri, "m-pd")  # the output names the live alias
        # the winner: same TP pair, and the step's metrics are the winner's
        assert (out.prefill_tp, out.decode_tp) == (cli_spec.prefill.tp, cli_spec.decode.tp)
        assert (metrics["prefill_tp"], metrics["decode_tp"]) == (cli_spec.prefill.tp, cli_spec.decode.tp)
        # the alias decision: both registered version k+1; it took the alias on both faces or on neither
        assert decision["registered_version"] == str(k + 1)
        assert decision["replaced"] == (out.champion_version == str(k + 1))
        # the spec: the champions of both registries are the same deployment
        (cv, cli_champ), (sv, step_champ) = load_champion(cli_uri, "m-pd"), load_champion(step_uri, "m-pd")
        assert cv == sv
        assert cli_champ.model_dump(exclude={"model"}) == step_champ.model_dump(exclude={"model"})
        assert (cli_champ.model.name, cli_champ.model.path) == (step_champ.model.name, step_champ.model.path)
        if decision["replaced"]:  # what --out wrote is what was registered
            assert cli_spec.model_dump() == cli_champ.model_dump()
    assert cli_champions == step_champions == case.champions
    if case.planner_mode != "off" or case.gpu_budget is not None:
        _, spec = load_champion(step_uri, "m-pd")
        assert (spec.planner.mode, spec.planner.gpu_budget) == (case.planner_mode, case.gpu_budget)


def test_the_pipeline_step_refuses_a_bad_min_improvement_pct_before_anything(staged, tmp_path):
    from runtime.usecases.tune import tune
    from tests.usecase_requests import tune_request

    uri = f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(ValueError, match="min_improvement_pct"):
        tune(tune_request(staged, "m", "H100-SXM", "bf16", 2000.0, 50.0, 3000, 150, 10.0, uri, "m-pd",
                          min_improvement_pct=-1.0))
    assert not (tmp_path / "x.db").exists()
