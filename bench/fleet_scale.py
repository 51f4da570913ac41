"""An hour of traffic on a ~1,000-GPU fleet, with the code the runtime runs: its SLA planner and its KV router.

    .venv/bin/python bench/fleet_scale.py [--gpus 1000] [--shape poisson_agentic] [--load 0.7] \
        [--duration-s 3600] [--out bench/results/fleet_scale.json]

Prints ONE JSON line::

    {"gpus", "shape", "rate_scale", "requests", "mean_rate_per_s",
     "planner": {"slo_attainment", "slo_attainment_achievable", "ttft_attainment", "itl_attainment",
                 "ttft_p90_s", "itl_p90_s", "gpu_hours", "peak_gpus", "initial_gpus", "ticks", "tick_ms_p50", "tick_ms_p99", "tick_ms_max", "tick_wall_ms_p50/_p99",
                 "wall_s"},
     "router": {"workers", "tp", "ttft_attainment", "ttft_mean_s", "ttft_p90_s", "hit_rate", "imbalance",
                "gpu_hours", "route_us_p50", "route_us_p99", "route_wall_us_p50/_p99", "routes", "wall_s"},
     "wall_s"}

* Traffic: the seeded synthetic shape `--shape` (runtime/sim/shapes.py; the same draws as `generate` and, with
  prompt block ids, `generate_requests`) for `--duration-s` seconds, at the rate scale whose mean load the SLA
  planner's own sizing (`PlannerStateMachine.size_for_load` at the shape's mean prompt and output lengths)
  serves with `--load` × `--gpus` GPUs: the fleet has headroom for the shape's bursts.
* Planner: `runtime.planner.state_machine.PlannerStateMachine` (SLA mode, its defaults) on the fleet
  simulator `runtime/sim/fleet.py`, `--gpus` as its GPU budget, prefill TP `--prefill-tp` and decode TP
  `--decode-tp` of `--model` on `--gpu` (runtime.perf, profile from runtime.planner.profiles.build_profile),
  `--interval-s` ticks, `--worker-start-s` worker start, starting from the fleet its sizing gives the first
  minute's rate. Attainment: the share of requests within the TTFT target, the ITL target, and both;
  "achievable" counts each request against max(TTFT target, its own uncontended prefill + 2 ITL), as
  bench/planner.py does (no fleet serves a prompt whose prefill alone exceeds the target in time).
  Tick cost: CPU time of this thread in each `on_tick` call (the planner's whole decision, rule 11's replay
  included); `tick_wall_ms_*` adds the time the OS ran other processes (the development machine is shared).
* Router: `runtime.router.core.Router` (`--policy`, default kv_aware, the performance model's prefill time as
  its cost) on the discrete-event replay `runtime/sim/replay.py` with `--gpus // --router-tp` workers of TP
  `--router-tp`, each prefilling and decoding, KV capacity from the performance model in 512-token blocks. It
  replays the same requests (the replay times prefill, so its TTFT has no decode admission in it); route cost:
  CPU time of each `Router.route` call with the index and load of a live hour (`route_wall_us_*`: wall time,
  including preemption by other processes).
* Wall times are of this process; every part runs on one core.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO, REPO / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from runtime.sim.trace import MOONCAKE_BLOCK_TOKENS  # noqa: E402

MODEL_FILES = {"Llama-3.1-70B": "meta-llama--Meta-Llama-3.1-70B_config.json",
               "Llama-3.1-8B": "meta-llama--Meta-Llama-3.1-8B_config.json"}


def _pct(xs: list[float] | np.ndarray, q: float) -> float:
    return float(np.quantile(np.asarray(xs, float), q)) if len(xs) else 0.0


def perf_model(model: str, gpu: str):
    from runtime.modelfiles.catalog import CATALOG_DIR
    from runtime.models.spec import ModelSpec
    from runtime.perf.gpus import get_gpu
    from runtime.perf.model import PerfModel

    path = CATALOG_DIR / MODEL_FILES.get(model, model)
    if not path.is_file():
        raise SystemExit(f"--model {model!r}: no config {path}")
    return PerfModel(ModelSpec.from_hf_config(json.loads(path.read_text()), model), get_gpu(gpu))


def planner_config(a: argparse.Namespace):
    from runtime.planner.types import PlannerConfig

    max_rep = max(a.gpus // min(a.prefill_tp, a.decode_tp), 1)
    return PlannerConfig(mode="sla", prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, min_prefill=1,
                         max_prefill=max_rep, min_decode=1, max_decode=max_rep, gpu_budget=a.gpus,
                         ttft_target_s=a.ttft_s, itl_target_s=a.itl_s, interval_s=a.interval_s,
                         worker_start_s=a.worker_start_s)


def rate_for_gpus(machine, gpus: float, isl: float, osl: float, tp: tuple[int, int]) -> float:
    """The request rate (req/s) whose sizing (`size_for_load`, disaggregated) needs about `gpus` GPUs."""
    def need(rate: float) -> int:
        s = machine.size_for_load(rate, isl, osl, with_agg=False)
        return s.prefill * tp[0] + s.decode * tp[1]

    lo, hi = 0.0, 1.0
    while need(hi) < gpus:
        lo, hi = hi, hi * 2
        if hi > 1e7:
            raise SystemExit(f"no request rate needs {gpus} GPUs (sizing saturates)")
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if need(mid) < gpus else (lo, mid)
    return hi


def run_planner(a, trace, profile, cfg) -> dict:
    from runtime.planner.state_machine import PlannerStateMachine
    from runtime.sim.fleet import FleetConfig, FleetSim

    first = trace.window(0.0, 60.0)
    sizer = PlannerStateMachine(cfg, profile)
    s = sizer.size_for_load(len(first) / 60.0, float(np.mean(first.isl_tokens)), float(np.mean(first.osl_tokens)),
                            with_agg=False)
    fleet = FleetConfig(prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, interval_s=a.interval_s,
                        worker_start_s=a.worker_start_s, initial_prefill=max(s.prefill, 1),
                        initial_decode=max(s.decode, 1))
    machine = PlannerStateMachine(cfg, profile, initial_prefill=fleet.initial_prefill,
                                  initial_decode=fleet.initial_decode)
    tick_s: list[float] = []
    tick_cpu_s: list[float] = []
    peak = [0]

    def controller(tick):
        t0, c0 = time.perf_counter(), time.thread_time()
        d = machine.on_tick(tick)
        tick_cpu_s.append(time.thread_time() - c0)
        tick_s.append(time.perf_counter() - t0)
        peak[0] = max(peak[0], d.num_gpus(a.prefill_tp, a.decode_tp))
        return d

    t0 = time.perf_counter()
    res = FleetSim(trace, profile, fleet).run(controller)
    wall = time.perf_counter() - t0
    from planner import achievable_ttft_s  # bench/planner.py: the same "achievable" as the planner bench

    ach = achievable_ttft_s(trace, profile, a.ttft_s, a.itl_s)
    ttft_ok = np.nan_to_num(res.ttft_s, nan=np.inf) <= a.ttft_s
    itl_ok = np.nan_to_num(res.itl_s, nan=np.inf) <= a.itl_s
    ms, cpu_ms = np.asarray(tick_s) * 1e3, np.asarray(tick_cpu_s) * 1e3
    return {"slo_attainment": round(res.slo_attainment(a.ttft_s, a.itl_s), 5),
            "slo_attainment_achievable": round(res.slo_attainment(ach, a.itl_s), 5),
            "ttft_attainment": round(float(np.mean(ttft_ok)), 5), "itl_attainment": round(float(np.mean(itl_ok)), 5),
            "ttft_p90_s": round(res.p90("ttft"), 4), "itl_p90_s": round(res.p90("itl"), 5),
            "gpu_hours": round(res.gpu_hours, 2), "peak_gpus": peak[0], "initial_gpus":
            fleet.initial_prefill * a.prefill_tp + fleet.initial_decode * a.decode_tp, "ticks": len(tick_s),
            "tick_ms_p50": round(_pct(cpu_ms, 0.5), 3), "tick_ms_p99": round(_pct(cpu_ms, 0.99), 3),
            "tick_ms_max": round(float(cpu_ms.max()) if len(cpu_ms) else 0.0, 3),
            "tick_wall_ms_p50": round(_pct(ms, 0.5), 3), "tick_wall_ms_p99": round(_pct(ms, 0.99), 3),
            "wall_s": round(wall, 1)}


class TimedRouter:
    """The runtime's Router with the wall time of every `route` call recorded (the replay's RouterLike)."""

    def __init__(self, router) -> None:
        self.router = router
        self.route_s: list[float] = []
        self.route_cpu_s: list[float] = []

    def route(self, request_id, *, now_s, block_hashes, num_prompt_tokens):
        t0, c0 = time.perf_counter(), time.thread_time()
        d = self.router.route(request_id, now_s=now_s, block_hashes=block_hashes, num_prompt_tokens=num_prompt_tokens)
        self.route_cpu_s.append(time.thread_time() - c0)
        self.route_s.append(time.perf_counter() - t0)
        return d

    def on_first_token(self, request_id):
        return self.router.on_first_token(request_id)

    def on_complete(self, request_id):
        return self.router.on_complete(request_id)

    def apply_kv_events(self, worker_id, events, now_s):
        return self.router.apply_kv_events(worker_id, events, now_s)


def run_router(a, reqs, perf) -> dict:
    from runtime.config import RouterSpec
    from runtime.router.core import Router
    from runtime.sim.replay import SimWorkerSpec, replay
    from runtime.sim.timing import PerfTiming

    if not perf.fits(a.router_tp):
        raise SystemExit(f"--router-tp {a.router_tp}: {a.model} does not fit on {a.gpu}")
    timing = PerfTiming(perf, a.router_tp)
    blocks = perf.kv_capacity_tokens(a.router_tp, 0.9) // MOONCAKE_BLOCK_TOKENS
    n = a.gpus // a.router_tp
    workers = [SimWorkerSpec(f"w{i}", "both", blocks) for i in range(n)]
    router = Router(RouterSpec(policy=a.policy), MOONCAKE_BLOCK_TOKENS, seed=a.seed, prefill_cost=timing.prefill_s)
    for w in workers:
        router.add_worker(w.worker_id, w.role, kv_events=True, kv_capacity_blocks=w.capacity_blocks)
    timed = TimedRouter(router)
    t0 = time.perf_counter()
    res = replay(reqs, timed, workers, timing, MOONCAKE_BLOCK_TOKENS)
    wall = time.perf_counter() - t0
    us, cpu_us = np.asarray(timed.route_s) * 1e6, np.asarray(timed.route_cpu_s) * 1e6
    ttft = np.asarray(res.ttft_s, float)
    span_h = (reqs[-1].arrival_s - reqs[0].arrival_s) / 3600.0 if reqs else 0.0
    return {"workers": n, "tp": a.router_tp, "policy": a.policy,
            "ttft_attainment": round(float(np.mean(ttft <= a.ttft_s)), 5) if len(ttft) else 0.0,
            "ttft_mean_s": round(res.ttft_mean_s, 4), "ttft_p90_s": round(res.ttft_quantile_s(0.9), 4),
            "hit_rate": round(res.hit_rate, 4), "imbalance": round(res.imbalance, 4),
            "gpu_hours": round(n * a.router_tp * span_h, 2), "routes": len(us),
            "route_us_p50": round(_pct(cpu_us, 0.5), 2), "route_us_p99": round(_pct(cpu_us, 0.99), 2),
            "route_wall_us_p50": round(_pct(us, 0.5), 2), "route_wall_us_p99": round(_pct(us, 0.99), 2),
            "wall_s": round(wall, 1)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1000, help="GPU budget of the planner and the router's fleet")
    ap.add_argument("--shape", default="poisson_agentic", help="runtime/sim/shapes.py shape (<arrivals>_<mix>)")
    ap.add_argument("--load", type=float, default=0.7,
                    help="the mean rate is what the planner's sizing serves on this share of --gpus (0, 1]")
    ap.add_argument("--duration-s", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="Llama-3.1-70B")
    ap.add_argument("--gpu", default="H100-SXM")
    ap.add_argument("--prefill-tp", type=int, default=4,
                    help="prefill TP (4: a 70B prefill of the agentic mix's median 10k-token prompt takes ~1 s on "
                         "H100)")
    ap.add_argument("--decode-tp", type=int, default=4)
    ap.add_argument("--router-tp", type=int, default=8)
    ap.add_argument("--policy", default="kv_aware", help="the router's policy (RouterSpec.policy)")
    ap.add_argument("--ttft-s", type=float, default=2.0)
    ap.add_argument("--itl-s", type=float, default=0.05)
    ap.add_argument("--interval-s", type=float, default=30.0)
    ap.add_argument("--worker-start-s", type=float, default=60.0)
    ap.add_argument("--skip", choices=("planner", "router"), default=None, help="run only the other half")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    a = ap.parse_args(argv)
    problems = []
    if a.gpus < max(a.prefill_tp + a.decode_tp, a.router_tp):
        problems.append(f"--gpus {a.gpus} holds not even one prefill and one decode worker, or one router worker")
    if not 0 < a.load <= 1:
        problems.append(f"--load must be in (0, 1], got {a.load}")
    if not a.duration_s > 60:
        problems.append(f"--duration-s must be > 60, got {a.duration_s}")
    if problems:
        ap.error("; ".join(problems))
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    t_start = time.perf_counter()
    from runtime.planner.profiles import build_profile
    from runtime.planner.state_machine import PlannerStateMachine
    from runtime.sim import shapes

    perf = perf_model(a.model, a.gpu)
    for tp, what in ((a.prefill_tp, "--prefill-tp"), (a.decode_tp, "--decode-tp")):
        if not perf.fits(tp):
            raise SystemExit(f"{what} {tp}: {a.model} does not fit on {a.gpu}")
    profile = build_profile(perf, a.prefill_tp, a.decode_tp)
    cfg = planner_config(a)
    try:
        base = shapes.generate(a.shape, 1.0, a.seed, a.duration_s)
    except ValueError as exc:
        raise SystemExit(f"--shape: {exc}") from exc
    isl, osl = float(np.mean(base.isl_tokens)), float(np.mean(base.osl_tokens))
    rate = rate_for_gpus(PlannerStateMachine(cfg, profile), a.load * a.gpus, isl, osl, (a.prefill_tp, a.decode_tp))
    rate_scale = rate / shapes.BASE_RATE_PER_S
    out: dict = {"gpus": a.gpus, "shape": a.shape, "model": a.model, "gpu": a.gpu, "load": a.load,
                 "duration_s": a.duration_s, "rate_scale": round(rate_scale, 3)}
    if a.skip != "planner":
        trace = shapes.generate(a.shape, rate_scale, a.seed, a.duration_s)
        out.update(requests=len(trace), mean_rate_per_s=round(len(trace) / a.duration_s, 2))
        out["planner"] = {"prefill_tp": a.prefill_tp, "decode_tp": a.decode_tp,
                          **run_planner(a, trace, profile, cfg)}
        del trace
    if a.skip != "router":
        reqs = shapes.generate_requests(a.shape, rate_scale, a.seed, a.duration_s, MOONCAKE_BLOCK_TOKENS)
        # the trace is the replay's input, not the router's state: keep the collector from scanning it
        # during route calls (a runtime holds no trace)
        gc.collect()
        gc.freeze()
        out.setdefault("requests", len(reqs))
        out["router"] = run_router(a, reqs, perf)
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    line = json.dumps(out)
    print(line)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(line + "\n")
    return out


if __name__ == "__main__":
    main()
