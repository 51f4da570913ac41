"""Planner robustness benchmark: ``pdserve_sla`` against each ``bench/planner.py`` ablation on synthetic
ramps and on the Azure trace restarted mid-hour, the cases one trace's hour does not cover. Prints ONE
JSON line; ``--out`` also writes it to a file.

    .venv/bin/python bench/planner_ramps.py [--ablations launch_on_tick,no_decode_band] [--seeds 2]

Scenarios (same engines, SLO and planner settings as bench/planner.py: Llama-3.1-70B on H100,
prefill TP2 / decode TP4, TTFT p90 2 s, ITL p90 50 ms, 30 s ticks, 60 s worker start):

* ``poisson_*``: a Poisson arrival rate that climbs linearly from the planner's first tick, then holds;
  prompt lengths drawn from the Azure conversation trace, output lengths uniform in a range; the fleet
  starts small (a cold start, or a restart on a smaller fleet).
* ``clumped_*``: the same ramp, but each arrival is replayed 10 times within a second, as
  ``bench/planner.py --rate-scale 10`` replays the trace (over-dispersed per-tick rates).
* ``azure_x10_from_<min>``: the Azure trace at ``--rate-scale 10`` from that minute on, as a planner
  restarted mid-traffic sees it, on a fleet 4 prefill / 1 decode workers short of the oracle's.

Output: ``{"scenarios": {NAME: {"pdserve_sla": [[attainment, gpu_hours] per seed], "ablation_<a>":
[...]}}, "summary": {"ablation_<a>": {"runs", "attainment_lower", "attainment_higher",
"gpu_hours_saved_by_pdserve_sla", "worst_attainment_loss_pp"}}, ...}``: for each ablation, over all runs,
how often ``pdserve_sla`` (today's rules) attains less or more than the ablation and what it saves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from planner import ABLATIONS, find_model_config, load_trace, summarize  # noqa: E402

from runtime.models.spec import ModelSpec  # noqa: E402
from runtime.paths import print_json_line  # noqa: E402
from runtime.perf.gpus import get_gpu  # noqa: E402
from runtime.perf.model import PerfModel  # noqa: E402
from runtime.planner.profiles import build_profile  # noqa: E402
from runtime.planner.state_machine import PlannerStateMachine  # noqa: E402
from runtime.planner.types import PlannerConfig  # noqa: E402
from runtime.sim.fleet import FleetConfig, Trace, simulate  # noqa: E402

TTFT_S, ITL_S, INTERVAL_S, START_S, PREFILL_TP, DECODE_TP = 2.0, 0.05, 30.0, 60.0, 2, 4
CLUMP = 10  # replays of each arrival in a clumped ramp, as bench/planner.py's default --rate-scale


@dataclass(frozen=True)
class Ramp:
    """A linear ramp from ``start_rps`` to ``end_rps`` requests/s over ``ramp_s``, then ``hold_s`` at the end
    rate; outputs uniform in ``[osl_lo, osl_hi]`` tokens; the fleet starts at ``prefill``/``decode`` workers."""

    start_rps: float
    end_rps: float
    ramp_s: float
    hold_s: float
    osl_lo: int
    osl_hi: int
    prefill: int
    decode: int
    clumped: bool = False


RAMPS: dict[str, Ramp] = {
    "poisson_1_to_20_over_5min_osl_1k_4k": Ramp(1, 20, 300, 1800, 1000, 4000, 2, 1),
    "poisson_1_to_40_over_5min_osl_500_1500": Ramp(1, 40, 300, 1800, 500, 1500, 2, 1),
    "poisson_1_to_10_over_3min_osl_1k_4k": Ramp(1, 10, 180, 1800, 1000, 4000, 2, 1),
    "poisson_restart_10_to_30_over_10min": Ramp(10, 30, 600, 1200, 1000, 4000, 5, 3),
    "poisson_restart_steady_15": Ramp(15, 15, 1, 1800, 1000, 4000, 4, 2),
    "clumped_1_to_20_over_5min_osl_1k_4k": Ramp(1, 20, 300, 1200, 1000, 4000, 2, 1, clumped=True),
    "clumped_5_to_40_over_10min_osl_200_1500": Ramp(5, 40, 600, 900, 200, 1500, 2, 1, clumped=True),
}
# minute of the Azure trace a restarted planner starts at, and the oracle's fleet in that minute's window
# (bench/results/planner.json pdserve_sla_by_window at --rate-scale 10: [oracle prefill, oracle decode, ...]);
# the restart runs 4 prefill / 1 decode workers short of it
AZURE_RESTARTS = {20: (12, 3), 25: (17, 3), 40: (8, 3)}


def ramp_trace(r: Ramp, prompt_lengths: np.ndarray, seed: int) -> Trace:
    """Arrivals per second ~ Poisson(rate(t)) (clumped: Poisson(rate / CLUMP) arrivals, each replayed CLUMP
    times within the next second), prompts drawn from ``prompt_lengths``. Pure given the seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(r.ramp_s + r.hold_s), dtype=float)
    rate = r.start_rps + (r.end_rps - r.start_rps) * np.minimum(t / r.ramp_s, 1.0)
    k = CLUMP if r.clumped else 1
    counts = rng.poisson(rate / k)
    base = np.repeat(t, counts) + rng.uniform(0.0, 1.0, int(counts.sum()))
    arr = np.sort(np.repeat(base, k) + (rng.uniform(0.0, 1.0, base.size * k) if k > 1 else 0.0))
    n = arr.size
    return Trace(arr - arr[0], rng.choice(prompt_lengths, n), rng.integers(r.osl_lo, r.osl_hi + 1, n))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ablations", default="launch_on_tick,no_decode_band,"
                    "no_dispersion,fixed_beta",
                    help=f"comma list of bench/planner.py ABLATIONS to compare with (default %(default)s; "
                         f"known: {', '.join(ABLATIONS)})")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per synthetic ramp (default %(default)s)")
    ap.add_argument("--scenarios", default="",
                    help="comma list of scenario names to run (default: all; known: "
                         f"{', '.join(list(RAMPS) + [f'azure_x10_from_min{m}' for m in AZURE_RESTARTS])})")
    ap.add_argument("--trace", type=Path, required=True,
                    help="Azure-format trace for the restarts and prompt lengths, e.g. the Azure LLM inference "
                         "trace 2023 conversation CSV (docs/benchmarks.md)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    names = [n for n in a.ablations.split(",") if n]
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        ap.error(f"--ablations: unknown {unknown} (known: {', '.join(ABLATIONS)})")
    if a.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {a.seeds}")
    known = list(RAMPS) + [f"azure_x10_from_min{m}" for m in AZURE_RESTARTS]
    wanted = [n for n in a.scenarios.split(",") if n] or known
    if set(wanted) - set(known):
        ap.error(f"--scenarios: unknown {sorted(set(wanted) - set(known))} (known: {', '.join(known)})")
    t_start = time.time()
    trace_path = a.trace
    cfg_path = find_model_config("Llama-3.1-70B")
    model = ModelSpec.from_hf_config(json.loads(cfg_path.read_text()), "Llama-3.1-70B")
    profile = build_profile(PerfModel(model, get_gpu("H100-SXM")), PREFILL_TP, DECODE_TP)
    azure = load_trace(trace_path, 10, 0)
    prompts = load_trace(trace_path, 1, 0).isl_tokens

    def run(trace: Trace, prefill: int, decode: int, overrides: dict) -> list[float]:
        fleet = FleetConfig(prefill_tp=PREFILL_TP, decode_tp=DECODE_TP, interval_s=INTERVAL_S, worker_start_s=START_S,
                            prefill_order="length", initial_prefill=prefill, initial_decode=decode)
        cfg = PlannerConfig(**(dict(
            mode="sla", prefill_tp=PREFILL_TP, decode_tp=DECODE_TP, min_prefill=1, max_prefill=128, min_decode=1,
            max_decode=128, gpu_budget=256, ttft_target_s=TTFT_S, itl_target_s=ITL_S, interval_s=INTERVAL_S,
            predictor="burst_quantile", worker_start_s=START_S) | overrides))
        sm = PlannerStateMachine(cfg, profile, initial_prefill=prefill, initial_decode=decode)
        s = summarize(simulate(trace, profile, fleet, sm.on_tick), TTFT_S, ITL_S)
        return [s["slo_attainment"], s["gpu_hours"]]

    cases: list[tuple[str, Trace, int, int]] = []
    for name, r in RAMPS.items():
        if name in wanted:
            cases += [(name, ramp_trace(r, prompts, seed), r.prefill, r.decode) for seed in range(a.seeds)]
    for minute, (p, d) in AZURE_RESTARTS.items():
        if f"azure_x10_from_min{minute}" not in wanted:
            continue
        keep = azure.arrival_s >= 60.0 * minute
        cut = Trace(azure.arrival_s[keep] - azure.arrival_s[keep][0], azure.isl_tokens[keep], azure.osl_tokens[keep])
        cases.append((f"azure_x10_from_min{minute}", cut, max(p - 4, 1), max(d - 1, 1)))

    variants = {"pdserve_sla": {}} | {f"ablation_{n}": ABLATIONS[n] for n in names}
    scenarios: dict[str, dict[str, list]] = {}
    for name, trace, p, d in cases:
        for v, ov in variants.items():
            scenarios.setdefault(name, {}).setdefault(v, []).append(run(trace, p, d, ov))
    summary = {}
    for v in variants:
        if v == "pdserve_sla":
            continue
        pairs = [(ours, theirs) for s in scenarios.values() for ours, theirs in zip(s["pdserve_sla"], s[v])]
        summary[v] = {
            "runs": len(pairs),
            "attainment_lower": sum(o[0] < t[0] for o, t in pairs),
            "attainment_higher": sum(o[0] > t[0] for o, t in pairs),
            "gpu_hours_saved_by_pdserve_sla": round(sum(t[1] - o[1] for o, t in pairs), 3),
            "worst_attainment_loss_pp": round(max([100 * (t[0] - o[0]) for o, t in pairs] + [0.0]), 2),
        }
    out = {"bench": "planner_ramps", "model": "Llama-3.1-70B", "gpu": "H100-SXM", "prefill_tp": PREFILL_TP,
           "decode_tp": DECODE_TP, "slo": {"ttft_p90_s": TTFT_S, "itl_p90_s": ITL_S}, "seeds": a.seeds,
           "scenarios": scenarios, "summary": summary, "wall_s": round(time.time() - t_start, 1)}
    print_json_line(out, a.out)
    return out


if __name__ == "__main__":
    main()
