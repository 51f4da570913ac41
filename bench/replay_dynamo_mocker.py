"""pdserve's trace replay next to NVIDIA Dynamo's mocker replay: the same requests, workers and hardware.

    .venv/bin/python bench/replay_dynamo_mocker.py [--shape poisson_agentic --requests 50000 | --trace FILE] \
        [--workers 64] [--load 0.7] [--seed 0] [--dynamo-python .venv-bench-dynamo/bin/python] \
        [--out bench/results/replay_dynamo_mocker.json]

Prints ONE JSON line::

    {"trace", "requests", "workers", "model", "gpu", "tp", "kv_blocks_per_worker", "load", "arrival_scale",
     "fixed_latency_ms", "oracle_hit_rate",
     "pdserve": {"wall_s", "cpu_s", "completed", "sim_s", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99",
                 "tpot_ms_mean", "tpot_ms_p90", "hit_rate", "imbalance"},
     "dynamo": {the same keys, "wall_ms_native", "version", "engine"} | {"error": ...} | null,
     "wall_ratio_dynamo_over_pdserve", "cpu_ratio_dynamo_over_pdserve", "wall_s"}

* Requests: the seeded synthetic shape ``--shape`` (runtime/sim/shapes.py ``generate_requests``, prompt block ids
  in 512-token blocks, sessions' shared prefixes for the ``agentic`` mix) at the rate scale that draws about
  ``--requests`` requests in an hour; or a Mooncake JSONL ``--trace``. Arrivals are then scaled so the trace's
  prefill work without any cache is ``--load`` × the workers' prefill capacity
  (``runtime.sim.replay.load_scale_factor``), as bench/router.py does.
* Workers: ``--workers`` aggregated workers of ``--model`` at TP ``--tp`` on ``--gpu``; KV capacity and timing
  from runtime/perf (``bench/router.py:build_timing``).
* pdserve: ``runtime.router.core.Router`` (policy kv_aware, the performance model's prefill time as its cost,
  KV events from every worker) on the discrete-event replay ``runtime/sim/replay.py`` (one prefill at a time
  per worker, decode as a whole at the batch it joins). TTFT includes the model's fixed API-side latency
  (``fixed_latency_ms``).
* Dynamo: ``dynamo.replay.run_trace_replay`` (ai-dynamo 1.6.1, offline mode: virtual clock, in one process, no
  etcd/NATS) with ``router_mode="kv_router"`` (Dynamo's KV router, its default config) over ``--workers`` mocker
  engines (vLLM scheduler model: continuous batching, chunked prefill of 8,192 tokens, 256 sequences, prefix
  cache in 64-token blocks, the same KV capacity in tokens; ``--dynamo-engine`` sets others). Their timing is
  runtime/perf's, handed to the mocker as its ``dynamo_profile`` table (``prefill_isl`` → ``prefill_ttft_ms``;
  ``decode_itl`` over active KV tokens × context length), so both replays simulate the same hardware. The
  mocker looks the table up by the tokens a step prefills: a chunk of a long prompt costs what a prompt of the
  chunk's size would, without its attention over the chunks before it (a 65,536-token prompt: 3.37 s in the
  mocker, 7.98 s in runtime/perf, Llama-3.1-70B on 8 × H100). It runs in the interpreter
  ``--dynamo-python`` (a separate, git-ignored venv) on a temporary Mooncake file of exactly the requests
  pdserve replays. Set-up of that venv (``ai-dynamo``'s ``aisimulate`` requirement comes only from
  pypi.nvidia.com and is not needed by the offline replay)::

      python3.11 -m venv .venv-bench-dynamo
      .venv-bench-dynamo/bin/pip install ai-dynamo-runtime==1.6.1
      .venv-bench-dynamo/bin/pip install --no-deps ai-dynamo==1.6.1
      .venv-bench-dynamo/bin/pip install aiohttp msgspec prometheus-client pyzmq tqdm zstandard pydantic

  Absent → ``"dynamo": null``.
* Metrics: ``hit_rate``: pdserve, prompt blocks found in the prefilling worker's cache / prompt blocks;
  Dynamo, its ``prefix_cache_reused_ratio`` (prompt tokens reused / prompt tokens). ``tpot_ms``: per request,
  decode time / output tokens (Dynamo: its TPOT). ``sim_s``: simulated time to the last completion.
  ``wall_s``: wall time of the replay call alone (trace generation and file writing excluded); Dynamo's own
  ``wall_time_ms`` (its runtime construction and execution) is ``wall_ms_native``; ``cpu_s``: CPU time of the
  process over the same call, every thread (the development machine is shared: wall time includes other
  processes' turns, CPU time does not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO, REPO / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

DEFAULT_DYNAMO_PY = REPO / ".venv-bench-dynamo" / "bin" / "python"
DYNAMO_BLOCK_TOKENS = 64  # the mocker's default KV block (vLLM's prefix-cache granularity in the mocker)
PROFILE_GRID = 512  # points per axis of the timing table (the mocker looks up the nearest grid point)


# ------------------------------------------------------------------ Dynamo side (runs in the Dynamo venv)
def dynamo_child(a: argparse.Namespace) -> dict:
    """Dynamo's offline mocker replay of ``a.trace_file``; stdlib and ``dynamo`` only."""
    from importlib.metadata import version

    from dynamo.replay import run_trace_replay  # type: ignore[import-not-found]

    engine = json.loads(Path(a.engine_file).read_text())
    t0, c0 = time.perf_counter(), time.process_time()
    rep = run_trace_replay(a.trace_file, extra_engine_args=engine, num_workers=a.workers, router_mode="kv_router",
                           trace_block_size=a.trace_block_tokens)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = rep.summary
    timing = engine["engine"]["timing_model"]
    engine["engine"]["timing_model"] = {"type": timing["type"], "provider": timing["provider"]}  # not the tmp path
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "wall_ms_native": round(s["wall_time_ms"], 1),
            "completed": s["completed_requests"], "sim_s": round(s["duration_ms"] / 1e3, 2),
            "ttft_ms_mean": round(s["mean_ttft_ms"], 2), "ttft_ms_p50": round(s["median_ttft_ms"], 2),
            "ttft_ms_p90": round(s["p90_ttft_ms"], 2), "ttft_ms_p99": round(s["p99_ttft_ms"], 2),
            "tpot_ms_mean": round(s["mean_tpot_ms"], 3), "tpot_ms_p90": round(s["p90_tpot_ms"], 3),
            "hit_rate": round(s["prefix_cache_reused_ratio"], 4), "imbalance": None,
            "version": version("ai-dynamo"), "engine": engine["engine"]}


def timing_table(timing, max_isl: int, kv_tokens: int, max_context: int, path: Path) -> None:
    """Write runtime/perf's timing as the mocker's ``dynamo_profile`` NPZ (the keys and grid meaning of
    dynamo/mocker/utils/planner_profiler_perf_data_converter.py): prefill time (ms) over prompt tokens, decode
    step time (ms) over (active KV tokens of the batch, mean context length), batch = active / context."""
    import numpy as np

    isl = np.linspace(1, max_isl, PROFILE_GRID)
    ttft = np.array([timing.prefill_s(int(round(x))) * 1e3 for x in isl])
    kv = np.linspace(0, kv_tokens, PROFILE_GRID // 4)
    ctx = np.linspace(1, max_context, PROFILE_GRID // 4)
    perf, tp = timing.perf, timing.tp
    itl = np.array([[perf.decode_step_time_s(max(1, int(k // c)), max(1, int(c)), tp) * 1e3 for c in ctx]
                    for k in kv])
    np.savez(path, prefill_isl=isl, prefill_ttft_ms=ttft, decode_active_kv_tokens=kv, decode_context_length=ctx,
             decode_itl=itl)


def run_dynamo(a: argparse.Namespace, reqs, timing, capacity_blocks: int, block_tokens: int) -> dict | None:
    """Dynamo's mocker replay of ``reqs`` in the ``--dynamo-python`` interpreter; None when it is absent."""
    py = Path(a.dynamo_python)
    if not py.exists():
        return None
    kv_tokens = capacity_blocks * block_tokens
    max_isl = max(r.input_tokens for r in reqs)
    with tempfile.TemporaryDirectory(prefix="pdserve-mocker-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        with trace.open("w") as f:
            for r in reqs:
                f.write(json.dumps({"timestamp": r.arrival_s * 1e3, "input_length": r.input_tokens,
                                    "output_length": r.output_tokens, "hash_ids": list(r.hash_ids)}) + "\n")
        table = Path(tmp) / "perf_data.npz"
        timing_table(timing, max_isl, kv_tokens, max(r.input_tokens + r.output_tokens for r in reqs), table)
        engine = {"engine": {"num_gpu_blocks": kv_tokens // DYNAMO_BLOCK_TOKENS, "block_size": DYNAMO_BLOCK_TOKENS,
                             "max_model_len": max(max_isl + max(r.output_tokens for r in reqs), 1),
                             "timing_model": {"type": "external", "provider": "dynamo_profile",
                                              "config": {"path": str(table)}}, **a.dynamo_engine}}
        (Path(tmp) / "engine.json").write_text(json.dumps(engine))
        cmd = [str(py), str(Path(__file__).resolve()), "--dynamo-child", "--trace-file", str(trace),
               "--engine-file", str(Path(tmp) / "engine.json"), "--workers", str(a.workers),
               "--trace-block-tokens", str(block_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.dynamo_timeout_s,
                              env=dict(os.environ, RUST_LOG="error", DYN_LOG="error"))
    if proc.returncode != 0:
        return {"error": f"dynamo child failed (rc {proc.returncode}): {proc.stderr.strip()[-800:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ pdserve side
def load_requests(a: argparse.Namespace):
    from runtime.sim import shapes
    from runtime.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceError, parse_mooncake

    if a.trace is not None:
        try:
            reqs = parse_mooncake(Path(a.trace).read_text(encoding="utf-8").splitlines(), str(a.trace))
        except (OSError, TraceError) as exc:
            raise SystemExit(f"--trace {a.trace}: {exc}") from exc
        if not reqs:
            raise SystemExit(f"--trace {a.trace}: the trace has no requests")
        return reqs, Path(a.trace).name  # the file's name: where it lies is the caller's business
    rate_scale = a.requests / (shapes.BASE_RATE_PER_S * shapes.DURATION_S)
    try:
        reqs = shapes.generate_requests(a.shape, rate_scale, a.seed, shapes.DURATION_S, MOONCAKE_BLOCK_TOKENS)
    except ValueError as exc:
        raise SystemExit(f"--shape: {exc}") from exc
    return reqs, f"{a.shape} seed {a.seed}"


def run_pdserve(reqs, workers, timing, block_tokens: int, seed: int) -> dict:
    import numpy as np

    from runtime.config import RouterSpec
    from runtime.router.core import Router
    from runtime.sim.replay import replay

    router = Router(RouterSpec(policy="kv_aware"), block_tokens, seed=seed, prefill_cost=timing.prefill_s)
    for w in workers:
        router.add_worker(w.worker_id, w.role, kv_events=True, kv_capacity_blocks=w.capacity_blocks)
    t0, c0 = time.perf_counter(), time.process_time()
    res = replay(reqs, router, workers, timing, block_tokens)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ttft = np.asarray(res.ttft_s) * 1e3
    tpot = np.asarray(res.tpot_s) * 1e3

    def q(xs, p):
        return round(float(np.quantile(xs, p)), 2) if len(xs) else 0.0

    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "completed": len(res.ttft_s),
            "sim_s": round(res.end_s, 2),
            "ttft_ms_mean": round(float(ttft.mean()), 2), "ttft_ms_p50": q(ttft, 0.5), "ttft_ms_p90": q(ttft, 0.9),
            "ttft_ms_p99": q(ttft, 0.99), "tpot_ms_mean": round(float(tpot.mean()), 3) if len(tpot) else 0.0,
            "tpot_ms_p90": q(tpot, 0.9), "hit_rate": round(res.hit_rate, 4), "imbalance": round(res.imbalance, 4)}


def _json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {type(v).__name__}")
    return v


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL trace (instead of --shape)")
    ap.add_argument("--shape", default="poisson_agentic", help="runtime/sim/shapes.py shape (<arrivals>_<mix>)")
    ap.add_argument("--requests", type=int, default=50_000, help="about this many requests of --shape")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--load", type=float, default=0.7, help="no-cache prefill work / prefill capacity, (0, 10]")
    ap.add_argument("--model", default="Llama-3.1-70B")
    ap.add_argument("--gpu", default="H100-SXM")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--dynamo-python", default=str(DEFAULT_DYNAMO_PY))
    ap.add_argument("--dynamo-engine", type=_json_object, default={},
                    help="JSON object of mocker engine settings over the defaults, e.g. "
                         "'{\"enable_chunked_prefill\": false, \"max_num_batched_tokens\": 262144}'")
    ap.add_argument("--dynamo-timeout-s", type=float, default=3600.0)
    ap.add_argument("--no-dynamo", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    ap.add_argument("--dynamo-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace-file", help=argparse.SUPPRESS)
    ap.add_argument("--engine-file", help=argparse.SUPPRESS)
    ap.add_argument("--trace-block-tokens", type=int, default=512, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    problems = []
    if a.workers < 1:
        problems.append(f"--workers must be >= 1, got {a.workers}")
    if a.requests < 1:
        problems.append(f"--requests must be >= 1, got {a.requests}")
    if not 0 < a.load <= 10:
        problems.append(f"--load must be in (0, 10], got {a.load}")
    if problems:
        ap.error("; ".join(problems))
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    if a.dynamo_child:
        out = dynamo_child(a)
        print(json.dumps(out))
        return out
    t_start = time.perf_counter()
    from router import build_timing  # bench/router.py: the workers' timing and KV capacity

    from runtime.sim.replay import SimWorkerSpec, load_scale_factor
    from runtime.sim.trace import MOONCAKE_BLOCK_TOKENS, oracle_hit_rate, scale_arrivals

    reqs, name = load_requests(a)
    timing, capacity = build_timing(a.model, a.gpu, a.tp)
    try:
        factor = load_scale_factor(reqs, timing, a.workers, a.load)
    except ValueError as exc:
        raise SystemExit(f"{name}: {exc}") from exc
    reqs = scale_arrivals(reqs, factor)
    workers = [SimWorkerSpec(f"w{i}", "both", capacity) for i in range(a.workers)]
    out: dict = {"trace": name, "requests": len(reqs), "workers": a.workers, "model": a.model, "gpu": a.gpu,
                 "tp": a.tp, "kv_blocks_per_worker": capacity, "block_tokens": MOONCAKE_BLOCK_TOKENS,
                 "load": a.load, "arrival_scale": round(factor, 5),
                 "fixed_latency_ms": round(timing.fixed_latency_s * 1e3, 2),
                 "oracle_hit_rate": round(oracle_hit_rate(reqs), 4)}
    out["pdserve"] = run_pdserve(reqs, workers, timing, MOONCAKE_BLOCK_TOKENS, a.seed)
    dyn = None if a.no_dynamo else run_dynamo(a, reqs, timing, capacity, MOONCAKE_BLOCK_TOKENS)
    out["dynamo"] = dyn
    if dyn and "wall_s" in dyn:
        for k in ("wall", "cpu"):
            mine = out["pdserve"][f"{k}_s"]
            out[f"{k}_ratio_dynamo_over_pdserve"] = round(dyn[f"{k}_s"] / mine, 3) if mine > 0 else None
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    from runtime.paths import print_json_line  # the parent side only: the Dynamo child runs without pdserve

    print_json_line(out, a.out)
    return out


if __name__ == "__main__":
    main()
