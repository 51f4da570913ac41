"""The SLO planner inside the running runtime, with real processes on 127.0.0.1.

`python -m runtime.server --planner dry-run --planner-interval-s 1` fronts one decode worker. The worker is a
small stand-in HTTP server (no vLLM: the planner reads only /metrics and /health, and the runtime only needs
an OpenAI answer with `usage`) whose /metrics carries vLLM's gauge names with known values.

Specification: while requests arrive at a steady pace, every tick reads the worker's /metrics and the
runtime's request window, and the runtime's own /metrics shows the planner's gauges with sane values —
ticks counted, replicas within the spec's [min, max], the observed request rate and the peak second of
prompt tokens bounded by what was sent, a positive predicted rate.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from runtime.engines.metrics import sample_sum
from runtime.engines.vllm_worker import free_port

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

PROMPT_TOKENS = 100  # what the stand-in reports per request (usage.prompt_tokens)

STANDIN = r'''
import sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

PORT = int(sys.argv[1])
METRICS = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
"""

async def chat(request):
    await request.json()
    return JSONResponse({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103}})

async def health(request):
    return JSONResponse({})

async def metrics(request):
    return PlainTextResponse(METRICS)

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health),
                        Route("/metrics", metrics)])
uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
'''

QWEN3_0_6B = {  # config.json of Qwen/Qwen3-0.6B (the fields the perf model reads)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "hidden_size": 1024,
    "intermediate_size": 3072, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "vocab_size": 151936, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def test_dry_run_planner_exports_gauges_on_the_runtime_metrics(tmp_path):
    from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, PoolSpec
    from runtime.server.launch import RuntimeProcess

    port = free_port()
    worker = subprocess.Popen([sys.executable, "-c", STANDIN, str(port)])
    rt = None
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
        spec = DeploymentSpec(model=ModelRef(name="m"), gpu="H100-SXM",
                              prefill=PoolSpec(replicas=1, min_replicas=1, max_replicas=4),
                              decode=PoolSpec(replicas=1, min_replicas=1, max_replicas=4),
                              planner=PlannerSpec(mode="sla", predictor="constant"))
        rt = RuntimeProcess("m", prefill_urls=[], decode_urls=[f"http://127.0.0.1:{port}"],
                            log_path=tmp_path / "runtime.log",
                            extra_args=["--planner", "dry-run", "--planner-interval-s", "1",
                                        "--deployment-spec", spec.model_dump_json(),
                                        "--model-config", str(tmp_path / "config.json")])
        rt.start()
        rt.wait_ready(180)
        body = {"model": "m", "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 3}
        seen: dict[str, list[float]] = {}
        num_sent = 0
        deadline = time.monotonic() + 5.0
        with httpx.Client(timeout=30) as c:
            while time.monotonic() < deadline:  # ~4 requests/s for 5 s, reading /metrics as we go
                assert c.post(f"{rt.url}/openai/v1/chat/completions", json=body).status_code == 200
                num_sent += 1
                time.sleep(0.25)
                text = c.get(f"{rt.url}/metrics").text
                if "pdserve_planner_ticks_total" not in text or sample_sum(text, "pdserve_planner_ticks_total") < 1:
                    continue  # gauges read 0 until the first tick
                for name in ("ticks_total", "decode_replicas", "prefill_replicas", "observed_rate_per_second",
                             "observed_peak_prefill_tokens_per_second", "predicted_rate_per_second",
                             "predicted_isl_tokens", "aggregated"):
                    seen.setdefault(name, []).append(sample_sum(text, f"pdserve_planner_{name}"))
        assert seen.get("ticks_total") and max(seen["ticks_total"]) >= 2, rt._tail()
        assert all(1 <= v <= 4 for v in seen["decode_replicas"])
        assert all(0 <= v <= 4 for v in seen["prefill_replicas"])
        assert set(seen["aggregated"]) <= {0.0, 1.0}
        # each tick covers 1 s; at most every request sent arrived in one tick
        assert 0 < max(seen["observed_rate_per_second"]) <= num_sent
        peak = max(seen["observed_peak_prefill_tokens_per_second"])
        assert PROMPT_TOKENS <= peak <= PROMPT_TOKENS * num_sent
        assert max(seen["predicted_rate_per_second"]) > 0
        assert PROMPT_TOKENS - 1 <= max(seen["predicted_isl_tokens"]) <= PROMPT_TOKENS + 1
    finally:
        if rt is not None:
            rt.stop()
        _stop(worker)
