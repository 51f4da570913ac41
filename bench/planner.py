"""Planner benchmark: replay an Azure-format trace on the fleet simulator with perf-model engines
and compare planners. Prints ONE JSON line; ``--out`` also writes it to a file.

    .venv/bin/python bench/planner.py --trace ../shared/data/traces/azure2023_conv.csv \
        [--model Llama-3.1-70B --gpu H100-SXM --rate-scale 10 --prefill-tp 2 --decode-tp 4]

``--rate-scale K`` replays each request K times with uniform sub-second jitter (seeded), so the
hour keeps its shape and bursts while the cluster grows to tens of GPUs. Planners:
``pdserve_sla`` (runtime.planner SLA mode, burst_quantile predictor), ``pdserve_load`` (load mode),
``dynamo_sla`` (Dynamo's published throughput-based replica formula, runtime.planner.dynamo_baseline,
ticking at its default 180 s), ``dynamo_sla_load`` (the same plus Dynamo 1.x's load-based +-1 steps as
the throughput result's upper layer, on a 10-s tick like its ``load_adjustment_interval``),
``static_peak`` (the oracle's per-window maximum of each pool, all hour); ``--extra-predictors``
adds ``pdserve_sla_<predictor>`` runs; ``--ablations`` adds ``ablation_<name>`` runs of
``pdserve_sla`` with one of this session's changes undone each (see ``ABLATIONS``). Every planner starts from the same warm fleet (the oracle's
first window) and ticks every ``--interval-s`` (Dynamo: its default 180 s). ``oracle_gpu_hours``:
hindsight per-window minimum (runtime.sim.fleet.oracle_gpu_seconds).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.models.spec import ModelSpec  # noqa: E402
from runtime.perf.gpus import get_gpu  # noqa: E402
from runtime.perf.model import PerfModel  # noqa: E402
from runtime.planner.dynamo_baseline import DynamoSlaBaseline  # noqa: E402
from runtime.planner.profiles import build_profile  # noqa: E402
from runtime.planner.state_machine import PlannerStateMachine  # noqa: E402
from runtime.planner.types import PlannerConfig  # noqa: E402
from runtime.sim.fleet import FleetConfig, Trace, oracle_gpu_seconds, simulate, static_controller  # noqa: E402

MODELS_DIR = ROOT.parent / "shared" / "data" / "models"
DYNAMO_LOAD_TICK_S = 10.0  # Dynamo load_adjustment_interval_seconds choices are 5 or 10

# pdserve_sla with one change undone (PlannerConfig overrides): what each change buys
ABLATIONS: dict[str, dict] = {
    "previous_defaults": dict(size_on_peak=False, ttft_correction_max=2.0, scale_down_delay_s=180.0,
                              cooldown_s=120.0, decode_scale_down_delay_s=None),
    "no_peak_sizing": dict(size_on_peak=False),
    "symmetric_scale_down_180s": dict(scale_down_delay_s=180.0, cooldown_s=120.0, decode_scale_down_delay_s=None),
    "symmetric_scale_down_60s": dict(decode_scale_down_delay_s=None),
    "token_rate_predictors": dict(size_on_tokens=True),
    "residual_quantile_predictor": dict(predictor="residual_quantile", predictor_window_ticks=40),
    "target_utilization_1": dict(target_utilization=1.0),
}


def load_azure_trace(path: Path, rate_scale: int, seed: int) -> Trace:
    """Read ``TIMESTAMP, ContextTokens, GeneratedTokens``; raises SystemExit naming a missing column."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        missing = need - set(reader.fieldnames or [])
        if missing:
            raise SystemExit(f"{path}: missing column(s) {sorted(missing)}")
        ts, isl, osl = [], [], []
        for row in reader:
            ts.append(datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp())
            isl.append(int(row["ContextTokens"]))
            osl.append(int(row["GeneratedTokens"]))
    t = np.asarray(ts) - min(ts)
    rng = np.random.default_rng(seed)
    k = max(int(rate_scale), 1)
    arr = np.concatenate([t + (rng.uniform(0, 1, len(t)) if k > 1 else 0.0) for _ in range(k)])
    isl_a = np.maximum(np.tile(isl, k), 1)
    osl_a = np.maximum(np.tile(osl, k), 1)
    order = np.argsort(arr, kind="stable")
    return Trace(arr[order] - arr[order][0], isl_a[order], osl_a[order])


def find_model_config(name: str) -> Path:
    hits = sorted(p for p in MODELS_DIR.glob("*_config.json") if name.lower() in p.name.lower())
    if not hits:
        raise SystemExit(f"--model {name!r}: no config in {MODELS_DIR}")
    return hits[0]


def summarize(res, ttft_s: float, itl_s: float) -> dict:
    return {
        "slo_attainment": round(res.slo_attainment(ttft_s, itl_s), 5),
        "ttft_p90_s": round(res.p90("ttft"), 4),
        "itl_p90_s": round(res.p90("itl"), 5),
        "gpu_hours": round(res.gpu_hours, 3),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--model", default="Llama-3.1-70B")
    ap.add_argument("--gpu", default="H100-SXM")
    ap.add_argument("--rate-scale", type=int, default=10)
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=4)
    ap.add_argument("--ttft-s", type=float, default=2.0)
    ap.add_argument("--itl-s", type=float, default=0.05)
    ap.add_argument("--worker-start-s", type=float, default=60.0)
    ap.add_argument("--interval-s", type=float, default=30.0)
    ap.add_argument("--gpu-budget", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--planners", default="pdserve_sla,pdserve_load,dynamo_sla,dynamo_sla_load,static_peak")
    ap.add_argument("--ablations", action="store_true", help="also run every ABLATIONS variant of pdserve_sla")
    ap.add_argument("--extra-predictors", default="",
                    help="comma list (constant,moving_average,arima): also run pdserve_sla_<predictor>")
    a = ap.parse_args(argv)
    t_start = time.time()

    cfg_path = find_model_config(a.model)
    model = ModelSpec.from_hf_config(json.loads(cfg_path.read_text()), a.model)
    perf = PerfModel(model, get_gpu(a.gpu))
    for tp, what in ((a.prefill_tp, "--prefill-tp"), (a.decode_tp, "--decode-tp")):
        if not perf.fits(tp):
            raise SystemExit(f"{what} {tp}: {a.model} does not fit on {a.gpu}")
    profile = build_profile(perf, a.prefill_tp, a.decode_tp)
    trace = load_azure_trace(a.trace, a.rate_scale, a.seed)
    fleet = FleetConfig(prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, interval_s=a.interval_s, worker_start_s=a.worker_start_s)
    max_rep = max(a.gpu_budget // min(a.prefill_tp, a.decode_tp), 1)

    oracle_s, plan = oracle_gpu_seconds(trace, profile, fleet, ttft_target_s=a.ttft_s, itl_target_s=a.itl_s, interval_s=60.0, max_replicas=64)
    peak_p, peak_d = max(p for p, _ in plan), max(d for _, d in plan)
    span_s = float(trace.arrival_s[-1])
    hold_s = 0.0
    for i in range(len(plan)):
        near = plan[max(i - 1, 0): i + 2]
        hold_s += (max(p for p, _ in near) * a.prefill_tp + max(d for _, d in near) * a.decode_tp) * min(
            60.0, span_s - 60.0 * i)
    # every planner starts from the same warm fleet: the oracle's first window
    init_p, init_d = plan[0]
    fleet = replace(fleet, initial_prefill=init_p, initial_decode=init_d)

    def pd_cfg(mode: str, predictor: str = "burst_quantile", **overrides: object) -> PlannerConfig:
        kw: dict = dict(
            mode=mode, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, min_prefill=1, max_prefill=max_rep,
            min_decode=1, max_decode=max_rep, gpu_budget=a.gpu_budget, ttft_target_s=a.ttft_s,
            itl_target_s=a.itl_s, interval_s=a.interval_s, predictor=predictor,
            worker_start_s=a.worker_start_s,
        )
        return PlannerConfig(**(kw | overrides))

    results: dict[str, dict] = {}
    timelines: dict[str, list] = {}
    wanted = a.planners.split(",") + [f"pdserve_sla_{p}" for p in a.extra_predictors.split(",") if p]
    wanted += [f"ablation_{k}" for k in ABLATIONS] if a.ablations else []
    for name in wanted:
        t0 = time.time()
        if name.startswith("ablation_"):
            sm = PlannerStateMachine(pd_cfg("sla", **ABLATIONS[name.removeprefix("ablation_")]), profile,
                                     initial_prefill=init_p, initial_decode=init_d)
            res = simulate(trace, profile, fleet, sm.on_tick)
        elif name.startswith("pdserve_sla_"):
            sm = PlannerStateMachine(pd_cfg("sla", name.removeprefix("pdserve_sla_")), profile,
                                     initial_prefill=init_p, initial_decode=init_d)
            res = simulate(trace, profile, fleet, sm.on_tick)
        elif name == "pdserve_sla":
            sm = PlannerStateMachine(pd_cfg("sla"), profile, initial_prefill=init_p, initial_decode=init_d)
            res = simulate(trace, profile, fleet, sm.on_tick)
        elif name == "pdserve_load":
            sm = PlannerStateMachine(pd_cfg("load"), None, initial_prefill=init_p, initial_decode=init_d)
            res = simulate(trace, profile, fleet, sm.on_tick)
        elif name == "dynamo_sla":
            dyn = DynamoSlaBaseline(profile, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, ttft_target_s=a.ttft_s,
                                    itl_target_s=a.itl_s, gpu_budget=a.gpu_budget)
            res = simulate(trace, profile, fleet, dyn.on_tick)
        elif name == "dynamo_sla_load":
            dyn = DynamoSlaBaseline(profile, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, ttft_target_s=a.ttft_s,
                                    itl_target_s=a.itl_s, gpu_budget=a.gpu_budget, load_scaling=True)
            res = simulate(trace, profile, replace(fleet, interval_s=DYNAMO_LOAD_TICK_S), dyn.on_tick)
        elif name == "static_peak":
            res = simulate(trace, profile, replace(fleet, initial_prefill=peak_p, initial_decode=peak_d),
                           static_controller(peak_p, peak_d))
        else:
            raise SystemExit(f"--planners: unknown planner {name!r}")
        results[name] = summarize(res, a.ttft_s, a.itl_s) | {"sim_wall_s": round(time.time() - t0, 1)}
        timelines[name] = res.timeline
    span_h = float(trace.arrival_s[-1]) / 3600.0
    static_h = (peak_p * a.prefill_tp + peak_d * a.decode_tp) * span_h
    out = {
        "bench": "planner",
        "trace": a.trace.name,
        "model": a.model,
        "gpu": a.gpu,
        "rate_scale": a.rate_scale,
        "num_requests": len(trace),
        "span_h": round(span_h, 4),
        "prefill_tp": a.prefill_tp,
        "decode_tp": a.decode_tp,
        "slo": {"ttft_s": a.ttft_s, "itl_s": a.itl_s},
        "worker_start_s": a.worker_start_s,
        "planners": results,
        "static_peak_gpu_hours": round(static_h, 3),
        "static_peak_replicas": {"prefill": peak_p, "decode": peak_d},
        "oracle_gpu_hours": round(oracle_s / 3600.0, 3),
        # the oracle's plan held one window either side (perfect forecast, but a worker must be
        # launched a start-time ahead and is kept a window after): a reference for causal planners
        "oracle_hold_1window_gpu_hours": round(hold_s / 3600.0, 3),
        "pdserve_sla_vs_oracle": round(results["pdserve_sla"]["gpu_hours"] / (oracle_s / 3600.0), 3)
        if "pdserve_sla" in results and oracle_s else None,
        "pdserve_sla_saving_vs_static_peak": round(1.0 - results["pdserve_sla"]["gpu_hours"] / static_h, 3)
        if "pdserve_sla" in results and static_h else None,
        "profile": {
            "prefill_s_at_mean_isl": round(float(profile.prefill.prefill_time_s(float(np.mean(trace.isl_tokens)))), 4),
            "decode_step_s_batch64": round(profile.decode.step_s(64, float(np.mean(trace.isl_tokens))), 5),
            "decode_kv_capacity_tokens": profile.decode.kv_capacity_tokens,
        },
        "initial_replicas": {"prefill": init_p, "decode": init_d},
        "wall_s": round(time.time() - t_start, 1),
    }
    line = json.dumps(out)
    print(line)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(line + "\n")
    return out


if __name__ == "__main__":
    main()
