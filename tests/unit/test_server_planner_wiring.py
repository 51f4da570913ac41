"""The planner's wiring into the runtime, checked without starting the server.

Specification: the sub-tick peak (`TickInput.peak_prefill_tokens_per_s`) is the 0.9 quantile of prompt
tokens per 1-s bin of the interval, as the fleet simulator computes it; the request window measures it over
the time since its last drain; the runtime's `--planner` flags become build_planner settings or a clear error
naming the missing flag; LocalDeployment passes the planner flags to the runtime; the local planner's
actuator manages only the workers beyond the configured ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runtime.config import DeploymentSpec, ModelRef, PlannerSpec
from runtime.planner.types import ScalingDecision
from runtime.server.__main__ import parse_args, planner_settings
from runtime.server.actuators import LocalActuator
from runtime.server.launch import LocalDeployment
from runtime.server.planner_loop import RequestWindow, peak_tokens_per_s
from runtime.server.planner_runtime import ExtraWorkersActuator


def test_peak_is_the_p90_of_prompt_tokens_per_one_second_bin_by_hand():
    # bins over [0, 4): [100 + 100, 50, 0, 400] -> sorted [0, 50, 200, 400]; p90 at rank 0.9 * 3 = 2.7
    # -> 200 + 0.7 * (400 - 200) = 340 (numpy's linear quantile)
    arrivals, tokens = [0.1, 0.2, 1.5, 3.9], [100, 100, 50, 400]
    assert peak_tokens_per_s(arrivals, tokens, 0.0, 4.0) == pytest.approx(340.0)
    assert peak_tokens_per_s(arrivals, tokens, 0.0, 4.0, quantile=1.0) == pytest.approx(400.0)
    # a 1-s interval has one bin: the peak is every token of the interval
    assert peak_tokens_per_s([10.2, 10.7], [30, 70], 10.0, 11.0) == pytest.approx(100.0)
    # an arrival stamped after the interval's end counts in the last bin (never dropped)
    assert peak_tokens_per_s([0.5, 2.4], [10, 20], 0.0, 2.0, quantile=1.0) == pytest.approx(20.0)
    assert peak_tokens_per_s([], [], 0.0, 30.0) is None


def test_peak_matches_the_simulators_binning_on_random_arrivals():
    rng = np.random.default_rng(7)
    t0, interval_s = 100.0, 30.0
    arr = np.sort(rng.uniform(t0, t0 + interval_s, 200))
    isl = rng.integers(10, 4000, 200)
    # runtime/sim/fleet.py _peak_tokens_per_s, written out
    per_s = np.bincount(np.clip((arr - t0).astype(int), 0, 29), weights=isl, minlength=30)
    assert peak_tokens_per_s(arr, isl, t0, t0 + interval_s) == pytest.approx(float(np.quantile(per_s, 0.9)))


def test_peak_rejects_bad_input_naming_it():
    with pytest.raises(ValueError, match="tokens"):
        peak_tokens_per_s([0.1, 0.2], [5], 0.0, 1.0)
    with pytest.raises(ValueError, match="quantile"):
        peak_tokens_per_s([0.1], [5], 0.0, 1.0, quantile=0.0)


def test_request_window_measures_the_peak_since_its_last_drain():
    now = [0.0]
    w = RequestWindow(clock=lambda: now[0])
    for t, isl in ((0.5, 100), (0.6, 300), (2.5, 50)):
        now[0] = t
        w.record_arrival(isl)
    now[0] = 3.0
    first = w.drain()  # [0, 3): bins 400, 0, 50 -> p90 = 50 + 0.8 * 350 = 330
    assert first.num_requests == 3 and first.peak_prefill_tokens_per_s == pytest.approx(330.0)
    now[0] = 3.2
    w.record_arrival(70)
    now[0] = 4.0
    second = w.drain()  # [3, 4): one bin with 70
    assert second.peak_prefill_tokens_per_s == pytest.approx(70.0)
    now[0] = 5.0
    assert w.drain().peak_prefill_tokens_per_s is None


def test_request_window_bins_a_late_recorded_request_by_its_arrival_time():
    now = [0.0]
    w = RequestWindow(clock=lambda: now[0])
    now[0] = 0.5
    w.record_arrival(100)
    now[0] = 2.6  # a request that arrived at 0.6 s, recorded when it finished
    w.record_arrival(300, ago_s=2.0)
    now[0] = 3.0
    # both in the first bin: [400, 0, 0] -> sorted [0, 0, 400], p90 = 0 + 0.8 * 400 = 320
    # (binned at 2.6 s it would be [100, 0, 300] -> 100 + 0.8 * 200 = 260)
    assert w.drain().peak_prefill_tokens_per_s == pytest.approx(320.0)


def _args(*extra: str):
    return parse_args(["--model-name", "m", "--decode-url", "http://127.0.0.1:1", *extra])


def test_planner_off_builds_nothing_and_sla_mode_needs_the_model_config(tmp_path):
    assert planner_settings(_args()) is None
    with pytest.raises(SystemExit, match="--model-config"):
        planner_settings(_args("--planner", "dry-run"))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3"}))
    s = planner_settings(_args("--planner", "dry-run", "--planner-interval-s", "2", "--model-config", str(cfg)))
    assert s["kind"] == "dry-run" and s["interval_s"] == 2.0 and s["model_config"] == {"model_type": "qwen3"}
    assert s["spec"].model.name == "m"


def test_planner_flags_are_checked_naming_the_flag(tmp_path, capsys):
    load = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(mode="load")).model_dump_json()
    s = planner_settings(_args("--planner", "dry-run", "--deployment-spec", load))
    assert s["spec"].planner.mode == "load" and s["model_config"] is None  # load mode needs no perf model
    with pytest.raises(SystemExit, match="--deployment-spec"):
        planner_settings(_args("--planner", "dry-run", "--deployment-spec", '{"gpu": 3}'))
    with pytest.raises(SystemExit, match="--prefill-deployment"):
        planner_settings(_args("--planner", "kubernetes", "--deployment-spec", load))
    with pytest.raises(SystemExit, match="--model-dir"):
        planner_settings(_args("--planner", "local", "--deployment-spec", load))
    with pytest.raises(SystemExit) as exc:  # refused at parse time (argparse error naming the flag, exit 2)
        _args("--planner", "dry-run", "--deployment-spec", load, "--planner-interval-s", "0")
    assert exc.value.code == 2 and "argument --planner-interval-s" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("--planner", "magic")
    k = planner_settings(_args("--planner", "kubernetes", "--deployment-spec", load, "--namespace", "llm",
                               "--prefill-deployment", "m-prefill", "--decode-deployment", "m-decode"))
    assert (k["namespace"], k["prefill_deployment"], k["decode_deployment"]) == ("llm", "m-prefill", "m-decode")


def _flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_local_deployment_passes_the_planner_flags(tmp_path):
    spec = DeploymentSpec(model=ModelRef(name="tiny", path="/m"))
    dep = LocalDeployment(spec, Path("/models/tiny"), log_dir=tmp_path, planner="local", planner_interval_s=5,
                          planner_max_workers=2)
    args = dep.runtime.args
    assert _flag_values(args, "--planner") == ["local"]
    assert _flag_values(args, "--planner-interval-s") == ["5"]
    assert _flag_values(args, "--planner-max-workers") == ["2"]
    assert _flag_values(args, "--model-dir") == ["/models/tiny"]
    assert DeploymentSpec.model_validate_json(_flag_values(args, "--deployment-spec")[0]) == spec
    parsed = parse_args(args[3:])  # what the runtime will read: [python, -m, runtime.server, ...]
    assert parsed.planner == "local" and parsed.planner_interval_s == 5.0
    assert "--planner" not in LocalDeployment(spec, Path("/m"), log_dir=tmp_path).runtime.args
    with pytest.raises(ValueError, match="planner"):
        LocalDeployment(spec, Path("/m"), planner="kubernetes")


class _Worker:
    """In-process stand-in with WorkerProcess's interface (no process: the actuator's arithmetic only)."""

    def __init__(self, role: str, index: int) -> None:
        self.role, self.index, self.running = role, index, False

    base_url = property(lambda self: f"http://127.0.0.1:{9000 + self.index}")

    def start(self):
        self.running = True
        return self

    def stop(self, timeout_s: float = 30.0):
        self.running = False
        return 0

    def alive(self) -> bool:
        return self.running

    def wait_ready(self, timeout_s: float = 600.0, poll_interval_s: float = 1.0) -> None:
        return None


def test_extra_workers_actuator_manages_only_workers_beyond_the_configured_ones():
    inner = LocalActuator(_Worker, max_workers=2, min_decode=0)
    act = ExtraWorkersActuator(inner, base_prefill=1, base_decode=1)
    assert act.current() == (1, 1)
    d = lambda p, q: ScalingDecision(now_s=0.0, prefill_replicas=p, decode_replicas=q)  # noqa: E731
    assert act.apply(d(1, 1)).changed is False and inner.current() == (0, 0)
    a = act.apply(d(2, 2))
    assert a.changed and (a.prefill_replicas, a.decode_replicas) == (2, 2) and inner.current() == (1, 1)
    a = act.apply(d(5, 5))  # cap of 2 extra workers: decode first
    assert inner.current() == (0, 2) and act.current() == (1, 3)
    act.apply(d(0, 0))  # below the configured pools: the extra ones go, the configured stay
    assert inner.current() == (0, 0) and act.current() == (1, 1)
    with pytest.raises(ValueError, match="min_decode"):
        LocalActuator(_Worker, min_decode=2)


def test_pdserve_serve_offers_planner_and_router_and_rejects_unknown_values():
    from typer.testing import CliRunner

    from runtime.cli import app

    runner = CliRunner()
    help_text = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "--planner" in help_text and "--router" in help_text
    bad = runner.invoke(app, ["serve", "--planner", "magic"])
    assert bad.exit_code != 0 and "--planner" in bad.output
    bad = runner.invoke(app, ["serve", "--router", "magic"])
    assert bad.exit_code != 0 and "--router" in bad.output


def test_the_loop_feeds_the_planner_the_means_the_simulator_feeds_it():
    """TTFT, ITL and request-duration means of the answered requests reach TickInput (the SLA planner's
    backlog and admission-wait terms use the observed mean ITL; without it they fall back to the target)."""
    import httpx
    from prometheus_client import CollectorRegistry

    from runtime.planner.profiles import analytic_profile
    from runtime.planner.state_machine import PlannerStateMachine
    from runtime.planner.types import PlannerConfig
    from runtime.server.actuators import DryRunActuator
    from runtime.server.planner_loop import PlannerLoop

    prof = analytic_profile(prefill_s_per_token=1e-4, decode_base_s=0.01, decode_s_per_seq=1e-4,
                            kv_capacity_tokens=100_000)
    machine = PlannerStateMachine(PlannerConfig(mode="sla", interval_s=30.0, predictor="constant"), prof)
    seen = []
    on_tick = machine.on_tick
    machine.on_tick = lambda t: (seen.append(t), on_tick(t))[1]
    now = [0.0]
    window = RequestWindow(clock=lambda: now[0])
    for ttft, itl, duration in ((0.2, 0.010, 4.0), (0.4, 0.014, 6.0), (None, None, 9.0)):
        window.record_arrival(100)
        if ttft is not None:
            window.record_first_token(ttft)
        window.record_finish(400, itl, duration)
    now[0] = 30.0
    with httpx.Client() as http:
        loop = PlannerLoop(machine, DryRunActuator(prefill=1, decode=1), window, client=http,
                           registry=CollectorRegistry(), metrics_urls=lambda: {"prefill": [], "decode": []})
        loop.tick(now_s=30.0)
    t = seen[0]
    assert (t.observed_ttft_mean_s, t.observed_itl_mean_s) == (pytest.approx(0.3), pytest.approx(0.012))
    assert t.mean_request_duration_s == pytest.approx(19.0 / 3)
    assert t.observed_ttft_p90_s == pytest.approx(0.38)  # the request whose first token was not seen is left out
