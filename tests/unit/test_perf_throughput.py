"""Aggregated max-throughput model (used by bench/perf_model.py) and KV sizing rules."""

from __future__ import annotations

from runtime.modelfiles.load import load_model_spec
from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.perf.gpus import get_gpu
from runtime.perf.model import PerfModel
import math

import pytest

from runtime.perf.throughput import (
    agg_throughput,
    bench_cycle_s,
    max_agg_throughput,
    trtllm_bench_throughput,
    trtllm_kv_capacity_tokens,
)

L8 = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json")
L70 = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json")


def test_best_batch_respects_kv_and_token_limits():
    pm = PerfModel(L8, get_gpu("H100-SXM"), "fp8")
    best = max_agg_throughput(pm, 2048, 128, 1, max_batch=4096, max_num_tokens=8192)
    assert best is not None
    assert best.batch * (2048 + 128) <= pm.kv_capacity_tokens(1)
    assert best.batch * (1 + 2048 / 128) <= 8192
    for b in (1, 2, 8, best.batch):
        assert agg_throughput(pm, 2048, 128, 1, b).output_tokens_per_s <= best.output_tokens_per_s + 1e-9


def test_throughput_grows_with_batch_until_compute_bound():
    pm = PerfModel(L8, get_gpu("H100-SXM"), "bf16")
    t = [agg_throughput(pm, 128, 128, 1, b).output_tokens_per_s for b in (1, 4, 16, 64)]
    assert t == sorted(t)


def test_no_point_when_weights_do_not_fit():
    pm = PerfModel(L70, get_gpu("H100-SXM"), "bf16")
    assert max_agg_throughput(pm, 128, 128, 1) is None
    assert trtllm_kv_capacity_tokens(pm, 1) == 0
    assert trtllm_kv_capacity_tokens(pm, 2) > pm.kv_capacity_tokens(2)  # 0.9 of free vs 0.9 of total


def test_trtllm_bench_settings_by_hand():
    """tensorrt_llm/bench/build/tuning.py: requests in 95% of (memory - weights) at ISL+OSL, capped at 4096,
    rounded up; max tokens = batch * (1 + isl/osl), capped at 32768, rounded up (min 2048)."""
    from runtime.perf.throughput import trtllm_bench_settings

    pm = PerfModel(L8, get_gpu("H100-SXM"), "fp8")
    kv_per_token = 2 * 32 * 8 * 128 * 1  # fp8 KV
    free = 81559 * 2**20 - L8.num_params * 1  # tuning.py get_device_memory(): the CUDA device total
    requests = free * 0.95 / (kv_per_token * 256)
    assert requests > 4096
    assert trtllm_bench_settings(pm, 128, 128, 1) == (4096, 8192)
    raw = free * 0.95 / (kv_per_token * 22000)
    assert 32 < raw < 64  # ~51 requests of 22,000 tokens fit
    assert trtllm_bench_settings(pm, 20000, 2000, 1) == (64, 2048)  # minimum batch 64, minimum tokens 2048
    assert trtllm_bench_settings(PerfModel(L70, get_gpu("H100-SXM"), "bf16"), 128, 128, 1) == (0, 0)


def test_bench_cycle_prefills_in_chunks_then_decodes_by_hand():
    """Generation tokens first, context chunks fill the rest of max_num_tokens: 16 prompts of 1000 tokens
    need ceil(16000 / (2048 - 16)) = 8 mixed iterations, then 1000 - 8 generation-only iterations."""
    pm = PerfModel(L8, get_gpu("H100-SXM"), "fp8")
    ctx = 1000 + 500
    mixed = pm.mixed_step_breakdown(16, ctx, 16000 / 8, 1000, 1).total_s
    decode = pm.decode_breakdown(16, ctx, 1).total_s
    assert bench_cycle_s(pm, 1000, 1000, 1, 16, 2048) == pytest.approx(8 * mixed + 992 * decode, rel=1e-12)
    # context-bound: 64 prompts of 2048 tokens in 1984-token chunks = 67 iterations > 8 output tokens; each
    # iteration then carries 64 * 8 / 67 ~ 8 generation tokens
    k = math.ceil(64 * 2048 / (2048 - 64))
    assert k == 67
    want = k * pm.mixed_step_breakdown(8, 2048 + 4, 64 * 2048 / k, 2048, 1).total_s
    assert bench_cycle_s(pm, 2048, 8, 1, 64, 2048) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="max_num_tokens"):
        bench_cycle_s(pm, 128, 128, 1, 2048, 2048)


def test_bench_run_of_finite_requests_by_hand():
    """3000 identical requests with room for 1280 at once: two full cycles and one of 440."""
    pm = PerfModel(L8, get_gpu("H100-SXM"), "fp8")
    cap = 1280 * (128 + 2048)
    pt = trtllm_bench_throughput(pm, 128, 2048, 1, max_batch=4096, max_num_tokens=8192, kv_capacity_tokens=cap,
                                 num_requests=3000)
    assert pt.batch == 1280
    total = 2 * bench_cycle_s(pm, 128, 2048, 1, 1280, 8192) + bench_cycle_s(pm, 128, 2048, 1, 440, 8192)
    assert pt.output_tokens_per_s == pytest.approx(3000 * 2048 / total, rel=1e-12)
    assert pt.output_tokens_per_s_per_gpu == pt.output_tokens_per_s
    endless = trtllm_bench_throughput(pm, 128, 2048, 1, 4096, 8192, cap)
    assert endless.output_tokens_per_s > pt.output_tokens_per_s  # the half-empty last cycle costs throughput
    # fewer requests than slots: all of them run at once
    few = trtllm_bench_throughput(pm, 128, 2048, 1, 4096, 8192, cap, num_requests=100)
    assert few.batch == 100
    assert few.output_tokens_per_s == pytest.approx(100 * 2048 / bench_cycle_s(pm, 128, 2048, 1, 100, 8192))
    # the batch also respects max_batch_size and the per-iteration token budget
    assert trtllm_bench_throughput(pm, 128, 2048, 1, 64, 8192, cap).batch == 64
    assert trtllm_bench_throughput(pm, 2048, 128, 1, 4096, 2048, cap).batch == int(2048 / (1 + 2048 / 128))
    assert trtllm_bench_throughput(pm, 128, 2048, 1, 4096, 8192, 2000) is None  # not one request's KV fits
    with pytest.raises(ValueError, match="num_requests"):
        trtllm_bench_throughput(pm, 128, 2048, 1, 4096, 8192, cap, num_requests=0)
