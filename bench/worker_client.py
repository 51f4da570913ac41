"""Benchmark: the runtime's worker client (runtime/engines/client.py over runtime/engines/h1.py) against aiohttp's
client doing the same P/D legs, side by side in one process against one engine stand-in.

    python bench/worker_client.py [--pairs 4000] [--concurrency 8] [--repeats 5] [--max-tokens 16]
                                  [--out bench/results/worker_client.json]

Starts one engine stand-in (bench/engine_standin.py, tokens 0.2 ms apart: the stand-in must not be what the
calls wait for) on 127.0.0.1. Each round runs `--pairs` request pairs, `--concurrency` at a time, with each
client in turn: a prefill (non-streaming POST, `kv_transfer_params` read from the JSON answer) and a streamed
decode of `--max-tokens` tokens carrying them, every SSE event parsed into its JSON object, the body read to
its end after `data: [DONE]` so that the connection is reused. The baseline is an aiohttp `ClientSession`
(keep-alive, no connection cap, no cookie jar, orjson) reading the stream with `iter_any`, the same line
splitting and the runtime client's own event check (`_stream_chunk`), so the two differ in the HTTP layer;
it sets no read timeout (the runtime's client keeps one per answer), so it is a lower bound on what an aiohttp
client doing the runtime's work spends.

Prints ONE JSON line: per client the CPU seconds of this process per 1,000 pairs in each round (the median is
the figure), `runtime_vs_aiohttp_cpu` (the ratio of the medians; below 1 is less CPU), and `outputs_equal`
(both clients read the same tokens in every pair: a correctness gate).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.engines.client import CHAT_PATH, VllmClient, _stream_chunk  # noqa: E402
from runtime.paths import print_json_line  # noqa: E402
from runtime.ports import free_port  # noqa: E402
from runtime.procs import stop_process  # noqa: E402


def _body(max_tokens: int) -> dict:
    return {"model": "standin", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "stream": True}


async def _runtime_client(url: str, pairs: int, concurrency: int, max_tokens: int) -> tuple[float, list[str]]:
    body = _body(max_tokens)
    async with VllmClient(url) as client:
        async def pair(i: int) -> str:
            kv = await client.prefill(CHAT_PATH, body, f"r{i}")
            return "".join([(c["choices"][0]["delta"].get("content") or "") if c.get("choices") else ""
                            async for _, c in client.stream_events(CHAT_PATH, body, f"r{i}", kv)])

        return await _timed(pair, pairs, concurrency)


async def _aiohttp_client(url: str, pairs: int, concurrency: int, max_tokens: int) -> tuple[float, list[str]]:
    import aiohttp

    body = _body(max_tokens)
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                     auto_decompress=False) as session:
        async def pair(i: int) -> str:
            prefill = {**body, "max_tokens": 1, "stream": False,
                       "kv_transfer_params": {"do_remote_decode": True}}
            async with session.post(url + CHAT_PATH, data=orjson.dumps(prefill),
                                    headers={**headers, "X-Request-Id": f"r{i}"}) as resp:
                kv = orjson.loads(await resp.read()).get("kv_transfer_params")
            text, buf, done = [], b"", False
            async with session.post(url + CHAT_PATH, data=orjson.dumps({**body, "kv_transfer_params": kv}),
                                    headers={**headers, "X-Request-Id": f"r{i}"}) as resp:
                async for piece in resp.content.iter_any():
                    if done:
                        continue  # the end of the body, read so that the connection is reused
                    buf += piece
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        if line.startswith(b"data:"):
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                done = True
                                break
                            chunk = _stream_chunk(url, data)  # the runtime client's own event check
                            if chunk.get("choices"):
                                text.append(chunk["choices"][0]["delta"].get("content") or "")
            return "".join(text)

        return await _timed(pair, pairs, concurrency)


async def _timed(pair, pairs: int, concurrency: int) -> tuple[float, list[str]]:
    await asyncio.gather(*(pair(i) for i in range(2 * concurrency)))  # connections made, code paths warm
    sem = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> str:
        async with sem:
            return await pair(i)

    c0 = time.process_time()
    texts = await asyncio.gather(*(limited(i) for i in range(pairs)))
    return time.process_time() - c0, texts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4000, help="prefill + decode pairs per client and round")
    ap.add_argument("--concurrency", type=int, default=8, help="pairs in flight at once")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; the clients alternate within each")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens each decode streams")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    args = ap.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    run = uvloop.run if uvloop is not None else asyncio.run  # the runtime's own loop when installed

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "engine_standin.py"), "--port", str(port),
                             "--token-interval-ms", "0.2", "--model", "standin"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the engine stand-in did not start") from None
                time.sleep(0.2)
        cpu: dict[str, list[float]] = {"runtime": [], "aiohttp": []}
        equal = True
        for _ in range(args.repeats):
            texts = {}
            for name, fn in (("runtime", _runtime_client), ("aiohttp", _aiohttp_client)):
                spent, texts[name] = run(fn(url, args.pairs, args.concurrency, args.max_tokens))
                cpu[name].append(round(1000 * spent / args.pairs, 4))
            equal = equal and texts["runtime"] == texts["aiohttp"] and all(texts["runtime"])
    finally:
        stop_process(proc, 5.0)
    out = {"bench": "worker_client", "pairs": args.pairs, "concurrency": args.concurrency,
           "max_tokens": args.max_tokens, "outputs_equal": equal,
           "cpu_s_per_1000_pairs": cpu,
           "runtime_vs_aiohttp_cpu": round(statistics.median(cpu["runtime"]) / statistics.median(cpu["aiohttp"]), 3)}
    print_json_line(out, args.out)
    return out


if __name__ == "__main__":
    main()
