"""Aggregated max-throughput model (used by bench/perf_model.py) and KV sizing rules."""

from __future__ import annotations

from runtime.models.load import load_model_spec
from runtime.paths import data_dir
from runtime.perf.gpus import get_gpu
from runtime.perf.model import PerfModel
from runtime.perf.throughput import agg_throughput, max_agg_throughput, trtllm_kv_capacity_tokens

L8 = load_model_spec(data_dir() / "models" / "meta-llama--Meta-Llama-3.1-8B_config.json")
L70 = load_model_spec(data_dir() / "models" / "meta-llama--Meta-Llama-3.1-70B_config.json")


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
    free = 85899345920 - L8.num_params * 1
    requests = free * 0.95 / (kv_per_token * 256)
    assert requests > 4096
    assert trtllm_bench_settings(pm, 128, 128, 1) == (4096, 8192)
    raw = free * 0.95 / (kv_per_token * 22000)
    assert 32 < raw < 64  # ~51 requests of 22,000 tokens fit
    assert trtllm_bench_settings(pm, 20000, 2000, 1) == (64, 2048)  # minimum batch 64, minimum tokens 2048
    assert trtllm_bench_settings(PerfModel(L70, get_gpu("H100-SXM"), "bf16"), 128, 128, 1) == (0, 0)
