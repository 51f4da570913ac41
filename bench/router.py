"""Router benchmark: replay a Mooncake trace through every routing policy on simulated workers.

    .venv/bin/python bench/router.py --trace DATA/traces/mooncake_synthetic_trace.jsonl \
        [--workers 16] [--kv-blocks-per-worker B] [--load 0.8] [--seeds 3] [--cpu-tier-gib G] \
        [--out bench/results/router.json]

Prints ONE JSON line::

    {"trace": ..., "workers": N, "kv_blocks_per_worker": B, "load": L, "arrival_scale": f,
     "policies": {NAME: {"hit_rate", "oracle_hit_rate", "ttft_mean_s", "ttft_p90_s", "imbalance"}},
     "decision_us_p50", "decision_us_p99", "decision_all_us_p50/_p99", "decision_preempted_frac",
     "decision_tokens_us_*", "index_us_p50", "index_us_p99", "index_all_us_*", "index_preempted_frac",
     "dynamo_radix_us_p50", "dynamo_radix_us_p99", "dynamo": {...} | null,
     "tiers": {...} | null, "wall_s"}

* Workers: Llama-3.1-70B, TP8 on 8×H100-SXM each (``--model/--gpu/--tp``), KV capacity from
  ``runtime.perf.model.PerfModel.kv_capacity_tokens(tp, 0.9)`` in 512-token blocks (Mooncake's block).
* ``--load L``: arrival times are scaled so that the trace's total prefill work *without any cache*
  is ``L`` × the cluster's prefill capacity (``arrival_scale`` reported; < 1 compresses the trace).
* The router gets the same performance model's ``prefill_s(isl, cached)`` as its ``prefill_cost`` (as
  the runtime does from the promoted DeploymentSpec), so ``kv_aware`` compares queues in seconds.
* ``kv_aware_approx`` = ``kv_aware`` with workers that publish no KV events: the router learns their
  caches from its own decisions (``approx_ttl_s`` TTL, bounded by the worker's capacity).
* oracle = hit rate of one infinite cache; imbalance = max/mean per-worker prefill busy time.
  Randomised policies (tie-breaks, sampling) are averaged over ``--seeds`` seeds.
* Decision latency: ``Router.route`` for 128-block prompts over 64 workers with a populated index
  (``decision_us``: precomputed block hashes; ``decision_tokens_us``: from 2,048 token ids, including
  hashing at block size 16); ``index_us``: ``PrefixIndex.match`` alone on the same queries. Calls the
  OS preempted (involuntary context switch during the call) are excluded from ``*_us_p50/_p99`` and
  kept in ``*_all_us_*``; each percentile is the median over ``--timing-repeats`` runs (shared machine).
* KV tiers (``--cpu-tier-gib G`` > 0): ``kv_aware`` replayed with every worker holding a CPU offload tier of
  ``G`` GiB (vLLM's OffloadingConnector, modelled in runtime/sim/worker.py: write-through, LRU) against no
  tier. ``tiers`` = ``{"cpu_tier_gib", "cpu_tier_blocks", "cpu_load_s_per_token", "none", "cpu",
  "cpu_blind"}``; each run reports ``gpu_hit_rate`` / ``cpu_hit_rate`` (prompt blocks reused from the GPU /
  loaded from the CPU tier), ``hit_rate`` (their sum) and TTFT. ``cpu``: the router indexes the tier's KV
  events and credits a tier hit by its load time (runtime/kv/tiers.py, PCIe Gen5 x16 link rate, the same
  figure the simulated load uses); ``cpu_blind``: the same tier, the router counting GPU hits only.
* Peers: when NVIDIA Dynamo's ``ai-dynamo-runtime`` is importable here or installed in
  ``.venv-bench-router`` (``--dynamo-python``), the same script runs there as a child and adds policy
  ``dynamo`` (Dynamo's real ``SelectionService`` fed vLLM-format KV events over ZMQ on loopback) and
  ``dynamo_radix_us`` (``RadixTree.find_matches`` on the same queries). Absent → ``"dynamo": null``.
  Set-up of that optional venv (gitignored)::

      python3.11 -m venv .venv-bench-router
      .venv-bench-router/bin/pip install ai-dynamo-runtime==1.6.1 msgspec pydantic pyzmq
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from runtime.sim.replay import SimWorkerSpec, load_scale_factor, replay  # noqa: E402
from runtime.sim.timing import PerfTiming  # noqa: E402
from runtime.sim.trace import (  # noqa: E402
    MOONCAKE_BLOCK_TOKENS,
    TraceError,
    oracle_hit_rate,
    parse_mooncake,
    scale_arrivals,
)

POLICY_NAMES = ("kv_aware", "kv_aware_approx", "dynamo_cost", "least_loaded", "round_robin", "random")
MODEL_FILES = {"Llama-3.1-70B": "meta-llama--Meta-Llama-3.1-70B_config.json",
               "Llama-3.1-8B": "meta-llama--Meta-Llama-3.1-8B_config.json"}
DEFAULT_DYNAMO_PY = REPO / ".venv-bench-router" / "bin" / "python"


# ------------------------------------------------------------------ setup
def build_timing(model: str, gpu: str, tp: int) -> tuple[PerfTiming, int]:
    """PerfTiming for the workers and their KV capacity in 512-token blocks."""
    from runtime.modelfiles.catalog import CATALOG_DIR
    from runtime.models.spec import ModelSpec
    from runtime.perf.gpus import get_gpu
    from runtime.perf.model import PerfModel

    fname = MODEL_FILES.get(model, model)
    cfg = json.loads((CATALOG_DIR / fname).read_text())
    perf = PerfModel(ModelSpec.from_hf_config(cfg, model), get_gpu(gpu))
    blocks = perf.kv_capacity_tokens(tp, 0.9) // MOONCAKE_BLOCK_TOKENS
    if blocks <= 0:
        raise SystemExit(f"{model} does not fit on {gpu} at TP{tp}")
    return PerfTiming(perf, tp), blocks


def metrics(res, oracle: float) -> dict[str, float]:
    return {"hit_rate": res.hit_rate, "oracle_hit_rate": oracle, "ttft_mean_s": res.ttft_mean_s,
            "ttft_p90_s": res.ttft_quantile_s(0.9), "imbalance": res.imbalance}


def mean_metrics(runs: list[dict[str, float]]) -> dict[str, float]:
    out = {k: round(statistics.fmean(r[k] for r in runs), 4) for k in runs[0]}
    if len(runs) > 1:
        out["imbalance_max"] = round(max(r["imbalance"] for r in runs), 4)
    return out


def run_policies(reqs, workers, timing, names, seeds: int) -> dict[str, dict[str, float]]:
    from runtime.config import RouterSpec
    from runtime.router.core import Router

    oracle = oracle_hit_rate(reqs)
    out = {}
    for name in names:
        runs = []
        approx = name == "kv_aware_approx"  # no KV events: learned from decisions, TTL + capacity bound
        for seed in range(1 if name == "round_robin" else seeds):
            router = Router(RouterSpec(policy="kv_aware" if approx else name), MOONCAKE_BLOCK_TOKENS, seed=seed,
                            prefill_cost=timing.prefill_s)
            for w in workers:
                router.add_worker(w.worker_id, w.role, kv_events=not approx,
                                  kv_capacity_blocks=w.capacity_blocks)
            runs.append(metrics(replay(reqs, router, workers, timing, MOONCAKE_BLOCK_TOKENS), oracle))
        out[name] = mean_metrics(runs)
    return out


def run_tiers(reqs, workers, timing, cpu_tier_gib: float, seeds: int) -> dict:
    """``kv_aware`` without an offload tier, with a CPU tier of ``cpu_tier_gib`` GiB per worker credited by
    the router, and with the same tier the router does not credit (see the module docstring)."""
    from dataclasses import replace

    from runtime.config import RouterSpec
    from runtime.kv.tiers import load_s_per_token
    from runtime.router.core import Router

    rank_bytes = timing.perf.kv_bytes_per_token_rank(timing.tp)
    tier_blocks = int(cpu_tier_gib * (1 << 30) // (rank_bytes * timing.tp * MOONCAKE_BLOCK_TOKENS))
    load_s = load_s_per_token(rank_bytes)["CPU"]
    oracle = oracle_hit_rate(reqs)
    out: dict = {"cpu_tier_gib": cpu_tier_gib, "cpu_tier_blocks": tier_blocks, "cpu_load_s_per_token": load_s}
    tiered = [replace(w, offload_capacity_blocks=tier_blocks) for w in workers]
    for name, pool, cost in (("none", workers, None), ("cpu", tiered, {"CPU": load_s}), ("cpu_blind", tiered, None)):
        runs = []
        for seed in range(seeds):
            router = Router(RouterSpec(policy="kv_aware"), MOONCAKE_BLOCK_TOKENS, seed=seed,
                            prefill_cost=timing.prefill_s, tier_load_cost=cost)
            for w in pool:
                router.add_worker(w.worker_id, w.role)
            res = replay(reqs, router, pool, timing, MOONCAKE_BLOCK_TOKENS, offload_load_s_per_token=load_s)
            m = metrics(res, oracle)
            m["gpu_hit_rate"], m["cpu_hit_rate"] = res.hit_rate, res.offload_hit_rate
            m["hit_rate"] = res.hit_rate + res.offload_hit_rate
            runs.append(m)
        out[name] = mean_metrics(runs)
    return out


# ------------------------------------------------------------------ decision latency
def synthetic_index_workload(seed: int = 0, num_workers: int = 64, num_docs: int = 512, prompt_blocks: int = 128,
                             docs_per_worker: int = 16, num_queries: int = 2000):
    """Deterministic index contents and queries shared by our index and Dynamo's RadixTree.

    Returns ``(stored, queries)``: ``stored[w]`` = list of block-id chains held by worker ``w`` (prefixes
    of shared "documents"); ``queries`` = 128-block prompts (a document prefix of random length followed
    by fresh blocks). Ids are positive ints < 2**62 (valid u64 for Dynamo).
    """
    rng = random.Random(seed)
    docs = [[d * 1000 + i + 1 for i in range(prompt_blocks)] for d in range(num_docs)]
    stored = []
    for _ in range(num_workers):
        chains = []
        for d in rng.sample(range(num_docs), docs_per_worker):
            chains.append(docs[d][: rng.randint(prompt_blocks // 8, prompt_blocks)])
        stored.append(chains)
    fresh = 10**9
    queries = []
    for _ in range(num_queries):
        doc = docs[rng.randrange(num_docs)]
        k = rng.randint(0, prompt_blocks)
        q = doc[:k] + list(range(fresh, fresh + prompt_blocks - k))
        fresh += prompt_blocks
        queries.append(q)
    return stored, queries


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else float("nan")


def _nivcsw() -> int:
    """Involuntary context switches of this process so far (all threads)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def timed(samples: list[tuple[float, bool]], fn, *a, **kw):
    """Call ``fn``; append ``(wall µs, preempted)`` where preempted = the OS switched this process out
    involuntarily during the call (another process took the CPU: not the code's own latency)."""
    n0 = _nivcsw()
    t0 = time.perf_counter_ns()
    out = fn(*a, **kw)
    t1 = time.perf_counter_ns()
    samples.append(((t1 - t0) / 1000, _nivcsw() != n0))
    return out


def summarize(prefix: str, samples: list[tuple[float, bool]]) -> dict[str, float]:
    """``{prefix}_us_p50/_p99`` over calls that were not preempted, ``{prefix}_all_us_p50/_p99`` over all
    calls, and the preempted fraction."""
    clean = [us for us, pre in samples if not pre]
    every = [us for us, _ in samples]
    return {f"{prefix}_us_p50": _pct(clean, 0.5), f"{prefix}_us_p99": _pct(clean, 0.99),
            f"{prefix}_all_us_p50": _pct(every, 0.5), f"{prefix}_all_us_p99": _pct(every, 0.99),
            f"{prefix}_preempted_frac": round(1 - len(clean) / len(every), 4) if every else 0.0}


def time_decisions(seed: int = 0, num_queries: int = 2000) -> dict[str, float]:
    """p50/p99 µs of Router.route (hashes and tokens) and of PrefixIndex.match, 64 workers, 128 blocks.

    Wall-clock (``perf_counter_ns``) per call. The headline ``*_us_p50/_p99`` exclude calls during which
    the OS preempted the process (``getrusage`` involuntary context switches changed): on a shared
    2-core machine those measure the neighbours, not the router; ``*_all_us_*`` keep every call and
    ``*_preempted_frac`` says how many were excluded. Garbage-collector pauses are *not* excluded (they
    are the router's own cost); ``gc.freeze()`` after set-up moves the index out of the collector's
    reach, as a long-running server would after start.
    """
    import gc

    from runtime.config import RouterSpec
    from runtime.kv.events import BlockStored
    from runtime.router.core import Router

    bs = 16
    stored, queries = synthetic_index_workload(seed, num_queries=num_queries)
    router = Router(RouterSpec(policy="kv_aware"), bs, seed=seed)
    for w, chains in enumerate(stored):
        router.add_worker(f"w{w}", "both")
        for chain in chains:
            router.apply_kv_events(f"w{w}", [BlockStored(tuple(chain), None, None, bs)], 0.0)
    token_prompts = [[t % 50000 for t in range(i * 4096, i * 4096 + len(q) * bs)] for i, q in enumerate(queries)]
    gc.collect()
    gc.freeze()
    dec: list[tuple[float, bool]] = []
    dec_tok: list[tuple[float, bool]] = []
    idx: list[tuple[float, bool]] = []
    window: list[str] = []
    for i, q in enumerate(queries):
        timed(dec, router.route, f"h{i}", block_hashes=q, num_prompt_tokens=len(q) * bs, now_s=float(i))
        window.append(f"h{i}")
        timed(dec_tok, router.route, f"t{i}", token_ids=token_prompts[i], now_s=float(i))
        window.append(f"t{i}")
        timed(idx, router.index.match, q)
        while len(window) > 256:  # keep ~128 requests in flight per kind, like a busy cluster
            rid = window.pop(0)
            router.on_first_token(rid)
            router.on_complete(rid)
    gc.unfreeze()
    return {**summarize("decision", dec), **summarize("decision_tokens", dec_tok), **summarize("index", idx)}


def time_decisions_repeated(repeats: int, num_queries: int = 2000) -> dict[str, float]:
    """Median over ``repeats`` runs of each percentile of :func:`time_decisions` (damps bursts of load
    from other processes on a shared machine; every run uses the same queries)."""
    runs = [time_decisions(num_queries=num_queries) for _ in range(max(1, repeats))]
    out = {k: round(statistics.median(r[k] for r in runs), 4 if k.endswith("frac") else 2) for k in runs[0]}
    out["timing_repeats"] = len(runs)
    return out


# ------------------------------------------------------------------ dynamo peer
def dynamo_importable() -> bool:
    try:
        import dynamo._core  # noqa: F401
    except Exception:
        return False
    return True


def run_dynamo_peer(args: argparse.Namespace) -> dict | None:
    """Dynamo results from this interpreter or the bench venv's; None when Dynamo is absent."""
    if dynamo_importable():
        from bench.router_dynamo_peer import dynamo_results  # type: ignore[import-not-found]
        return dynamo_results(args)
    py = Path(args.dynamo_python)
    if not py.exists():
        return None
    cmd = [str(py), str(Path(__file__).resolve()), "--dynamo-child", "--trace", str(args.trace),
           "--workers", str(args.workers), "--load", str(args.load), "--model", args.model, "--gpu", args.gpu,
           "--tp", str(args.tp), "--dynamo-seeds", str(args.dynamo_seeds),
           "--timing-repeats", str(args.timing_repeats)]
    if args.kv_blocks_per_worker:
        cmd += ["--kv-blocks-per-worker", str(args.kv_blocks_per_worker)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                          env=dict(os.environ, RUST_LOG="error", DYN_LOG="error"))
    if proc.returncode != 0:
        return {"error": f"dynamo child failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ main
def prepare(args: argparse.Namespace):
    lines = Path(args.trace).read_text(encoding="utf-8").splitlines()
    try:
        reqs = parse_mooncake(lines)
    except TraceError as exc:
        raise SystemExit(f"--trace {args.trace}: {exc}") from exc
    if not reqs:
        raise SystemExit(f"--trace {args.trace}: the trace has no requests")
    timing, capacity = build_timing(args.model, args.gpu, args.tp)
    capacity = args.kv_blocks_per_worker or capacity
    try:
        factor = load_scale_factor(reqs, timing, args.workers, args.load)
    except ValueError as exc:  # e.g. every request arrives at the same instant
        raise SystemExit(f"--trace {args.trace}: {exc}") from exc
    reqs = scale_arrivals(reqs, factor)
    workers = [SimWorkerSpec(f"w{i}", "both", capacity) for i in range(args.workers)]
    return reqs, workers, timing, capacity, factor


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="Mooncake JSONL trace")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--kv-blocks-per-worker", type=int, default=0, help="0 = from runtime/perf")
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--model", default="Llama-3.1-70B")
    ap.add_argument("--gpu", default="H100-SXM")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--timing-repeats", type=int, default=5, help="decision-latency runs (median reported)")
    ap.add_argument("--decision-queries", type=int, default=2000, help="128-block queries per timing run")
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--dynamo-python", default=str(DEFAULT_DYNAMO_PY))
    ap.add_argument("--dynamo-seeds", type=int, default=3, help="Dynamo breaks ties randomly: runs averaged")
    ap.add_argument("--no-dynamo", action="store_true")
    ap.add_argument("--cpu-tier-gib", type=float, default=0.0,
                    help="also replay kv_aware with a CPU KV tier of this many GiB per worker (0 = skip)")
    ap.add_argument("--out", default="", help="also write the JSON line to this file")
    ap.add_argument("--dynamo-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    # checked here, before prepare() and minutes of replay
    from runtime.router.policies import POLICIES

    known = set(POLICIES) | {"kv_aware_approx"}
    names = args.policies.split(",")
    bad = [n for n in names if n not in known]
    if bad or not names:
        ap.error(f"--policies: unknown {bad} (comma list of {', '.join(sorted(known))})")
    if not args.cpu_tier_gib >= 0:
        ap.error(f"--cpu-tier-gib must be >= 0, got {args.cpu_tier_gib}")
    for flag, v in (("--seeds", args.seeds), ("--timing-repeats", args.timing_repeats),
                    ("--decision-queries", args.decision_queries)):
        if v < 1:
            ap.error(f"{flag} must be >= 1, got {v}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(args.trace).is_file():
        raise SystemExit(f"--trace {args.trace}: no such file")
    if args.workers < 1 or not 0 < args.load <= 10:
        raise SystemExit("--workers must be >= 1 and --load in (0, 10]")
    if args.dynamo_child:
        from bench.router_dynamo_peer import dynamo_results  # type: ignore[import-not-found]
        print(json.dumps(dynamo_results(args)))
        return 0
    t0 = time.time()
    reqs, workers, timing, capacity, factor = prepare(args)
    names = [n for n in args.policies.split(",") if n]
    out = {"trace": Path(args.trace).name, "workers": args.workers, "kv_blocks_per_worker": capacity,
           "load": args.load, "arrival_scale": round(factor, 5), "model": args.model, "gpu": args.gpu,
           "tp": args.tp, "seeds": args.seeds,
           "policies": run_policies(reqs, workers, timing, names, args.seeds)}
    out["tiers"] = run_tiers(reqs, workers, timing, args.cpu_tier_gib, args.seeds) if args.cpu_tier_gib else None
    out.update(time_decisions_repeated(args.timing_repeats, args.decision_queries))
    dyn = None if args.no_dynamo else run_dynamo_peer(args)
    out["dynamo"] = dyn
    if dyn and "policy" in dyn:
        out["policies"]["dynamo"] = dyn["policy"]
    if dyn:
        for k in ("radix_us_p50", "radix_us_p99", "radix_all_us_p99", "radix_preempted_frac"):
            out[f"dynamo_{k}"] = dyn.get(k)
    out["wall_s"] = round(time.time() - t0, 1)
    line = json.dumps(out)
    print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    from runtime.procs import install_sigterm_handler

    install_sigterm_handler()  # SIGTERM stops the servers/subprocesses this run started, like Ctrl-C
    sys.exit(main())
