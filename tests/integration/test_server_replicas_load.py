"""Load spread across three runtime replicas keeps the balance of one router.

Real processes on 127.0.0.1: a prefill and two decode engine stand-ins (bench/engine_standin.py; /metrics
with vLLM's request gauges, /stats with the decodes each has served) and three
`python -m runtime.server --router kv` replicas (least-loaded policy, a small word-level tokenizer written
here) that read the workers' gauges every 0.1 s (runtime.server.engine_load).

The load is a deterministic staircase, so the outcome does not depend on timing noise: equal long streams
(each outlives the whole staircase), one at a time, request i to replica i % 3, each sent `GAP_S` after the
previous one — several gauge reads later, so every replica has seen it. A router with an exact view of the
workers' load then keeps the two decode workers' request counts within one of each other after every
request, which is what one replica alone achieves with this load. A replica that sees only its own requests
cannot: its first request finds both workers idle in its view, wherever the other replicas' went (and the
replicas' tie-breaking RNGs start from the same seed, so they even agree on the worker). Specification: after
every request of the staircase the decode workers' served counts differ by at most one.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from runtime.engines.metrics import sample_sum
from runtime.engines.vllm_worker import free_port
from runtime.paths import REPO_ROOT
from tests.integration.test_server_planner import _stop, _wait_http

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

WORDS = 500
#: requests in the staircase (four per replica) and seconds between two of them: five gauge reads (0.1 s)
#: apart, so a replica's view includes the previous request even on a loaded machine
STEPS, GAP_S = 12, 0.5
TOKEN_INTERVAL_MS = 20
#: tokens per stream: the stream lasts 8 s at TOKEN_INTERVAL_MS, longer than the STEPS × GAP_S staircase
MAX_TOKENS = 400


def _tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(folder))


async def _staircase(urls: list[str], decodes: list[str]) -> tuple[list[tuple[int, int]], int]:
    """Send the staircase (request i to urls[i % len(urls)]); returns the decode workers' served counts
    read `GAP_S` after each request (one pair per request) and the number of failed requests."""
    async with httpx.AsyncClient(timeout=60) as c:
        async def stats() -> tuple[int, int]:
            pages = await asyncio.gather(*(c.get(f"{u}/stats") for u in decodes))
            a, b = (p.json()["remote_decodes"] for p in pages)
            return a, b

        async def one(i: int) -> int:
            body = {"model": "m", "prompt": " ".join(f"w{(7 * i + j) % WORDS}" for j in range(64)),
                    "max_tokens": MAX_TOKENS, "stream": True}
            try:
                async with c.stream("POST", f"{urls[i % len(urls)]}/openai/v1/completions", json=body) as r:
                    text = "".join([line async for line in r.aiter_lines()])
                return 0 if r.status_code == 200 and "[DONE]" in text else 1
            except httpx.HTTPError:
                return 1

        base = await stats()
        tasks, counts = [], []
        for i in range(STEPS):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(GAP_S)
            a, b = await stats()
            counts.append((a - base[0], b - base[1]))
        return counts, sum(await asyncio.gather(*tasks))


def test_load_spread_over_three_replicas_is_as_balanced_as_one_router(tmp_path):
    from runtime.server.launch import RuntimeProcess

    _tokenizer(tmp_path / "tok")
    ports = [free_port() for _ in range(3)]
    workers = [subprocess.Popen([sys.executable, str(REPO_ROOT / "bench/engine_standin.py"), "--port", str(p),
                                 "--model", "m", "--engine-id", f"w{i}",
                                 "--token-interval-ms", str(TOKEN_INTERVAL_MS)])
               for i, p in enumerate(ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rts = [RuntimeProcess("m", prefill_urls=urls[:1], decode_urls=urls[1:], log_path=tmp_path / f"runtime-{i}.log",
                          extra_args=["--router", "kv", "--tokenizer-dir", str(tmp_path / "tok"),
                                      "--router-spec", '{"policy": "least_loaded", "disagg_min_uncached_tokens": 0}',
                                      "--engine-load-interval-s", "0.1", "--no-access-log"])
           for i in range(3)]
    try:
        for u in urls:
            _wait_http(f"{u}/health")
        for rt in rts:
            rt.start()
        for rt in rts:
            rt.wait_ready(180)
        counts, errors = asyncio.run(_staircase([rt.url for rt in rts], urls[1:]))
        assert errors == 0
        assert [a + b for a, b in counts] == list(range(1, STEPS + 1)), counts  # each request decoded once
        assert max(abs(a - b) for a, b in counts) <= 1, counts
        with httpx.Client(timeout=5) as c:  # every replica served its share
            served = [sample_sum(c.get(f"{rt.url}/metrics").text, "pdserve_requests_total") for rt in rts]
        assert served == [STEPS // 3] * 3, served
    finally:
        for rt in rts:
            rt.stop()
        for w in workers:
            _stop(w)
