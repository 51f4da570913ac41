"""Benchmark: what the front door costs — the pdserve runtime vs direct access vs `vllm-router`, per request.

    python bench/frontend.py [--rates 25,50,100,200,400] [--duration-s 6] [--max-tokens 16]
                             [--token-interval-ms 5] [--added-p99-bound-ms 50] [--vllm-router PATH]
                             [--replicas N] [--out bench/results/frontend.json]

Starts, each in its own process on 127.0.0.1: one prefill and one decode engine stand-in
(bench/engine_standin.py: answers at once, streams `--max-tokens` tokens one every `--token-interval-ms`,
speaks vLLM's P/D `kv_transfer_params` protocol), the pdserve runtime in front of them (`python -m
runtime.server`, fixed pairing, access log off) and, when the `vllm-router` binary is found (`--vllm-router`,
else PATH; `pip install vllm-router` into any venv), vLLM's Rust router in P/D mode in front of the same two
stand-ins (log level warning: neither front end writes a line per request).

An open-loop load generator (Poisson arrivals, streamed chat completions) runs each rate of `--rates` for
`--duration-s` against each target in turn — direct (the decode stand-in itself, no prefill leg), direct_pd
(the load generator makes the P/D legs itself: the prefill call with the runtime's own worker client, then
the decode stream with the `kv_transfer_params` it returned), pdserve, vllm_router — so all see the same
machine state. Per target and rate it records TTFT and inter-token
time (ITL) of every request, errors, and the CPU seconds the front-end process spent (/proc/PID/stat utime +
stime, all its threads).

Prints ONE JSON line:
* `outputs_equal`: every target returned the direct answer's text (a correctness gate: the numbers below mean
  nothing otherwise); `prefills` / `remote_decodes`: P/D legs the stand-ins served (equal when every front
  end passed each prefill's `kv_transfer_params` on to a decode);
* per front end (`pdserve`, `vllm_router`): `capacity_rps` — the highest rate of `--rates` it sustained (no
  error, ≥ 95 % of the offered requests done in the window + drain, added TTFT p99 over direct ≤
  `--added-p99-bound-ms`); `requests_per_cpu_s` at that rate (requests per CPU-second of the front-end
  process: requests/s per core, independent of what else the machine runs); and, at the rate of `--rates`
  nearest half its capacity, added TTFT p50/p99 and added ITL p50/p99 in ms over direct at the same rate,
  and `added_ttft_over_pd_p50_ms` / `_p99_ms` over direct_pd: the front end's own work on the way to the first
  token, without the prefill leg that disaggregation costs any client (both front ends make that leg);
* `pdserve_vs_vllm_router_rps_per_core`: the ratio of the two requests_per_cpu_s;
* `pdserve_replicas` (with `--replicas N` > 1; else null): N more runtime processes in front of the same
  stand-ins, each request to the next one in turn (an even balancer, as a Kubernetes Service is), CPU summed
  over the N: the same summary as `pdserve`, `capacity_vs_one` (its sustained rate over one process's) and
  `requests_per_cpu_s_vs_one_by_rate`. Equal requests per CPU-second means the replicas add no per-request
  work, so throughput grows with the cores they are given; whether the capacity itself grows depends on the
  cores the machine has left beside the stand-ins and the load generator;
  `..._by_rate`: the same ratio at each offered rate both front ends ran (requests per CPU-second grow with
  the rate, so the ratio at capacity moves with which rates each sustained);
* `load_avg_1m`: the machine is shared; read absolute numbers against it, ratios less so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.paths import print_json_line  # noqa: E402
from runtime.engines.client import BackendError, VllmClient  # noqa: E402
from runtime.procs import stop_process  # noqa: E402

MODEL = "standin"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used: /proc/PID/stat fields 14 and 15."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f} s")


async def _one(client: httpx.AsyncClient, url: str, max_tokens: int, i: int,
               prefill: VllmClient | None = None) -> dict:
    """One streamed chat completion to `url`; with `prefill`, the client makes the P/D legs itself: the
    prefill call (the runtime's own worker client and request, `VllmClient.prefill`) and then the stream to
    `url` (a decode worker) with the `kv_transfer_params` it returned. TTFT counts from before the first leg."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {i} says hello to the router"}],
            "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    try:
        if prefill is not None:
            body["kv_transfer_params"] = await prefill.prefill("/v1/chat/completions", body, f"pd-{i}")
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"ok": False, "status": r.status_code}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for c in json.loads(line[6:]).get("choices") or []:
                    piece = (c.get("delta") or {}).get("content")
                    if piece:
                        times.append(time.perf_counter())
                        text.append(piece)
    except (httpx.HTTPError, BackendError) as exc:
        return {"ok": False, "status": type(exc).__name__}
    if not times:
        return {"ok": False, "status": "no tokens"}
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"ok": True, "ttft": times[0] - t0, "itl": itl, "text": "".join(text)}


async def _single(url: str, max_tokens: int, prefill_url: str | None = None) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client, _prefill_client(prefill_url) as pre:
        return await _one(client, url, max_tokens, 0, pre)


@contextlib.asynccontextmanager
async def _prefill_client(url: str | None) -> AsyncIterator[VllmClient | None]:
    if url is None:
        yield None
        return
    async with VllmClient(url, timeout_s=60.0) as client:
        yield client


async def _run_rate(urls: list[str], rate: float, duration_s: float, max_tokens: int, seed: int,
                    prefill_url: str | None = None) -> list[dict]:
    """Open loop: Poisson arrivals at `rate` req/s for `duration_s`, request i to `urls[i % len(urls)]` (an even
    balancer in front of replicas, as a Kubernetes Service is); waits for every request to end. With
    `prefill_url` the client makes each request's prefill leg there first (`_one`)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=1024)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0)) as client, \
            _prefill_client(prefill_url) as pre:
        tasks, t, i = [], 0.0, 0
        start = time.perf_counter()
        while True:
            t += rng.expovariate(rate)
            if t > duration_s:
                break
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, urls[i % len(urls)], max_tokens, i, pre)))
            i += 1
        return list(await asyncio.gather(*tasks))


def _pcts(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    return float(np.percentile(xs, 50)), float(np.percentile(xs, 99))


def _summary(results: list[dict], offered: int, cpu_s: float | None) -> dict:
    ok = [r for r in results if r["ok"]]
    t50, t99 = _pcts([r["ttft"] for r in ok])
    i50, i99 = _pcts([r["itl"] for r in ok])
    return {"offered": offered, "done": len(ok), "errors": len(results) - len(ok),
            "ttft_p50_s": t50, "ttft_p99_s": t99, "itl_p50_s": i50, "itl_p99_s": i99,
            "cpu_s": cpu_s, "requests_per_cpu_s": (len(ok) / cpu_s) if cpu_s else None}


class _Procs:
    """Every process the bench starts, stopped by its own handle on exit (terminate, wait, kill)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], log: Path) -> subprocess.Popen:
        with log.open("w") as f:
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop_process(p, 10.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="25,50,100,200,400", help="offered request rates, req/s, ascending")
    ap.add_argument("--duration-s", type=float, default=6.0, help="arrival window per target and rate (s)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens each streamed answer has")
    ap.add_argument("--token-interval-ms", type=float, default=5.0, help="stand-ins' time between tokens (ms)")
    ap.add_argument("--added-p99-bound-ms", type=float, default=50.0,
                    help="a rate is sustained while added TTFT p99 over direct stays within this (ms)")
    ap.add_argument("--vllm-router", default=None, help="path of the vllm-router binary (default: PATH)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="also run N runtime processes side by side (target pdserve_xN, requests spread evenly) "
                    "to compare with one; 1: only one")
    ap.add_argument("--logs", type=Path, default=None, help="folder for the processes' logs (default: temp)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    if not rates or rates != sorted(rates) or rates[0] <= 0:
        ap.error("--rates must be positive and ascending, e.g. 25,50,100")
    logs = args.logs or Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-frontend-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    if args.vllm_router and not os.access(args.vllm_router, os.X_OK):
        ap.error(f"--vllm-router {args.vllm_router}: no such executable")
    router_bin = args.vllm_router or shutil.which("vllm-router")
    if args.replicas < 1:
        ap.error("--replicas must be >= 1")

    procs = _Procs()
    try:
        ports = {k: _free_port() for k in ("prefill", "decode", "vllm_router")}
        standin = [sys.executable, str(ROOT / "bench" / "engine_standin.py"), "--model", MODEL,
                   "--token-interval-ms", str(args.token_interval_ms)]
        for role in ("prefill", "decode"):
            p = procs.start([*standin, "--port", str(ports[role]), "--engine-id", role], logs / f"{role}.log")
            _wait_http(f"http://127.0.0.1:{ports[role]}/health", p)
        prefill, decode = (f"http://127.0.0.1:{ports[r]}" for r in ("prefill", "decode"))
        # name -> (URLs the load is spread over, front-end processes whose CPU is counted)
        targets: dict[str, tuple[list[str], list[subprocess.Popen]]] = {
            "direct": ([f"{decode}/v1/chat/completions"], []),
            "direct_pd": ([f"{decode}/v1/chat/completions"], [])}
        # the references whose client makes its prefill leg itself
        prefill_of = {"direct_pd": prefill}
        references = {"direct", "direct_pd"}

        def runtimes(name: str, n: int) -> None:
            urls, rts = [], []
            for j in range(n):
                port = _free_port()
                rts.append(procs.start([sys.executable, "-m", "runtime.server", "--model-name", MODEL,
                                        "--prefill-url", prefill, "--decode-url", decode, "--host", "127.0.0.1",
                                        "--http-port", str(port), "--no-access-log"], logs / f"{name}-{j}.log"))
                _wait_http(f"http://127.0.0.1:{port}/v2/health/ready", rts[-1])
                urls.append(f"http://127.0.0.1:{port}/openai/v1/chat/completions")
            targets[name] = (urls, rts)

        runtimes("pdserve", 1)
        replicas_name = f"pdserve_x{args.replicas}" if args.replicas > 1 else None
        if replicas_name:
            runtimes(replicas_name, args.replicas)
        if router_bin:
            vr = procs.start([router_bin, "--host", "127.0.0.1", "--port", str(ports["vllm_router"]),
                              "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                              "--policy", "round_robin", "--log-level", "warning",
                              "--max-concurrent-requests", "4096", "--queue-size", "4096"],
                             logs / "vllm_router.log")
            _wait_http(f"http://127.0.0.1:{ports['vllm_router']}/health", vr)
            targets["vllm_router"] = ([f"http://127.0.0.1:{ports['vllm_router']}/v1/chat/completions"], [vr])

        # correctness gate: every front end returns the direct answer
        answers = [asyncio.run(_single(url, args.max_tokens, prefill_of.get(name)))
                   for name, (urls, _) in targets.items() for url in urls]
        outputs_equal = all(a["ok"] for a in answers) and len({a["text"] for a in answers}) == 1

        per: dict[str, dict[float, dict]] = {name: {} for name in targets}
        live = set(targets)
        for k, rate in enumerate(rates):
            for name in [n for n in targets if n in live]:
                urls, fronts = targets[name]
                cpu0 = sum(_cpu_s(p.pid) for p in fronts)
                res = asyncio.run(_run_rate(urls, rate, args.duration_s, args.max_tokens, seed=k,
                                            prefill_url=prefill_of.get(name)))
                cpu = (sum(_cpu_s(p.pid) for p in fronts) - cpu0) if fronts else None
                per[name][rate] = _summary(res, len(res), cpu)
            for name in list(live - references):
                if not _sustained(per[name][rate], per["direct"][rate], args.added_p99_bound_ms / 1000.0):
                    live.discard(name)
            if live == references:
                break

        line: dict = {"bench": "frontend", "outputs_equal": outputs_equal, "rates": rates,
                      "duration_s": args.duration_s, "max_tokens": args.max_tokens,
                      "token_interval_ms": args.token_interval_ms, "added_p99_bound_ms": args.added_p99_bound_ms}
        for name in ("pdserve", "vllm_router"):
            line[name] = (_front_end_summary(per[name], per["direct"], args.added_p99_bound_ms / 1000.0,
                                             per["direct_pd"])
                          if name in targets else None)
        a = line["pdserve"].get("requests_per_cpu_s")
        b = line["vllm_router"].get("requests_per_cpu_s") if router_bin else None
        line["pdserve_vs_vllm_router_rps_per_core"] = round(a / b, 3) if a and b else None
        line["pdserve_vs_vllm_router_rps_per_core_by_rate"] = _ratio_by_rate(per) if router_bin else None
        line["pdserve_replicas"] = None
        if replicas_name:
            many = _front_end_summary(per[replicas_name], per["direct"], args.added_p99_bound_ms / 1000.0,
                                      per["direct_pd"])
            one = line["pdserve"]
            line["pdserve_replicas"] = many | {
                "replicas": args.replicas,
                "capacity_vs_one": round(many["capacity_rps"] / one["capacity_rps"], 3) if one["capacity_rps"] else None,
                "requests_per_cpu_s_vs_one_by_rate": _ratio_by_rate(per, replicas_name, "pdserve")}
        stats = [httpx.get(f"{u}/stats", timeout=5.0).json() for u in (prefill, decode)]
        line["prefills"], line["remote_decodes"] = stats[0]["prefills"], stats[1]["remote_decodes"]
        line["per_rate"] = {n: {str(r): v for r, v in d.items()} for n, d in per.items()}
        line["load_avg_1m"] = os.getloadavg()[0]
        print_json_line(line)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(line, indent=1) + "\n")
    finally:
        procs.stop()


def _ratio_by_rate(per: dict[str, dict[float, dict]], a: str = "pdserve", b: str = "vllm_router") -> dict[str, float]:
    """`a`'s requests per CPU-second over `b`'s at each rate both ran, sustained or not: the ratio at capacity
    compares two rates when the front ends sustain different ones on a noisy machine."""
    out = {}
    for rate, s in per[a].items():
        v = per[b].get(rate)
        if v and s["requests_per_cpu_s"] and v["requests_per_cpu_s"]:
            out[str(rate)] = round(s["requests_per_cpu_s"] / v["requests_per_cpu_s"], 3)
    return out


def _sustained(s: dict, direct: dict, bound_s: float) -> bool:
    return (s["errors"] == 0 and s["done"] >= 0.95 * s["offered"]
            and s["ttft_p99_s"] - direct["ttft_p99_s"] <= bound_s)


def _front_end_summary(per: dict[float, dict], direct: dict[float, dict], bound_s: float,
                       direct_pd: dict[float, dict]) -> dict:
    ok = [r for r, s in per.items() if _sustained(s, direct[r], bound_s)]
    if not ok:
        return {"capacity_rps": 0.0}
    cap = max(ok)
    half = min(ok, key=lambda r: abs(r - cap / 2))
    s, d, pd = per[half], direct[half], direct_pd[half]
    ms = 1000.0
    return {"capacity_rps": cap, "requests_per_cpu_s": round(per[cap]["requests_per_cpu_s"], 1),
            "at_rps": half,
            "added_ttft_p50_ms": round((s["ttft_p50_s"] - d["ttft_p50_s"]) * ms, 2),
            "added_ttft_p99_ms": round((s["ttft_p99_s"] - d["ttft_p99_s"]) * ms, 2),
            "added_itl_p50_ms": round((s["itl_p50_s"] - d["itl_p50_s"]) * ms, 3),
            "added_itl_p99_ms": round((s["itl_p99_s"] - d["itl_p99_s"]) * ms, 3),
            "added_ttft_over_pd_p50_ms": round((s["ttft_p50_s"] - pd["ttft_p50_s"]) * ms, 2),
            "added_ttft_over_pd_p99_ms": round((s["ttft_p99_s"] - pd["ttft_p99_s"]) * ms, 2)}


if __name__ == "__main__":
    main()
