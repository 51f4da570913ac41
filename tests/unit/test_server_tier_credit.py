"""The running runtime's router credits KV offload tiers (runtime.server.routing.tier_credit_costs).

Specification: a deployment whose engine has a CPU KV tier (`engine.kv_offload.cpu_gib > 0`), with the
model's config.json known, gives the runtime router the perf model's prefill seconds as its prefill cost and
the tier's load seconds per token (`load_s_per_token` of the prefill TP's per-rank KV bytes; the disk tier
too when `disk_path` is set), so that a hit in a worker's CPU tier is credited; without a tier, or without the
model's config, the router is built as before (uncached tokens, tier hits indexed but not credited).
`python -m runtime.server --router kv` builds them from `--deployment-spec` and `--model-config`.
"""

from __future__ import annotations

import json

import pytest

from runtime.config import DeploymentSpec, EngineSpec, KvOffloadSpec, ModelRef, RouterSpec
from runtime.kv.events import BlockStored
from runtime.kv.tiers import load_s_per_token
from runtime.server.__main__ import parse_args, router_costs
from runtime.server.planner_loop import spec_perf
from runtime.server.routing import RouterPairing, WorkerEndpoint, tier_credit_costs

SMOL = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
BS = 16
BLOCKS = 256
PROMPT = list(range(100, 100 + BLOCKS * BS))  # 4,096 tokens: long enough that computing them costs more than loading


def _spec(**offload) -> DeploymentSpec:
    return DeploymentSpec(model=ModelRef(name="smol"), gpu="H100-SXM", engine=EngineSpec(kv_offload=KvOffloadSpec(**offload)))


def test_costs_come_from_the_perf_model_only_with_a_cpu_tier_and_a_model_config():
    assert tier_credit_costs(_spec(), SMOL) == {}  # no tier
    assert tier_credit_costs(_spec(cpu_gib=8), None) == {}  # no model config
    spec = _spec(cpu_gib=8)
    costs = tier_credit_costs(spec, SMOL)
    rank_bytes = spec_perf(spec, SMOL).kv_bytes_per_token_rank(spec.prefill.tp)
    assert costs["tier_load_cost"] == {"CPU": pytest.approx(load_s_per_token(rank_bytes)["CPU"])}
    full, mostly_cached = costs["prefill_cost"](4096, 0), costs["prefill_cost"](4096, 3584)
    assert 0 < mostly_cached < full < 10  # seconds
    disk = tier_credit_costs(_spec(cpu_gib=8, disk_path="/var/cache/kv"), SMOL)
    assert set(disk["tier_load_cost"]) == {"CPU", "STORAGE"}
    assert disk["tier_load_cost"]["STORAGE"] > disk["tier_load_cost"]["CPU"]


def _route(costs: dict):
    workers = [WorkerEndpoint(w, "both", f"http://127.0.0.1:{i + 1}", f"tcp://127.0.0.1:{5557 + i}")  # KV events
               for i, w in enumerate("AB")]
    p = RouterPairing(RouterSpec(policy="kv_aware", balance_weight=0.0), BS, workers, **costs)
    # A holds the first block on the GPU and the others in its CPU tier; B holds nothing
    p.router.apply_kv_events("A", [BlockStored((11,), None, tuple(PROMPT[:BS]), BS),
                                   BlockStored(tuple(range(12, 11 + BLOCKS)), 11, tuple(PROMPT[BS:]), BS, medium="CPU")], 0.0)
    return p.router.route("q", token_ids=PROMPT, now_s=0.0)


def test_the_runtime_router_credits_a_cpu_tier_hit_with_the_costs():
    credited = _route(tier_credit_costs(_spec(cpu_gib=8), SMOL))
    assert credited.decode_worker == "A" and credited.offload_blocks > 0
    blind = _route({})
    assert blind.offload_blocks == 0


def test_the_server_builds_the_costs_from_its_deployment_spec(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMOL))
    base = ["--model-name", "smol", "--decode-url", "http://127.0.0.1:1", "--router", "kv",
            "--tokenizer-dir", str(tmp_path)]
    tiered = _spec(cpu_gib=8).model_dump_json()
    costs = router_costs(parse_args([*base, "--deployment-spec", tiered]))  # config.json of --tokenizer-dir
    assert costs is not None and set(costs["tier_load_cost"]) == {"CPU"}
    assert router_costs(parse_args([*base, "--deployment-spec", _spec().model_dump_json()])) is None
    cfg.unlink()
    assert router_costs(parse_args([*base, "--deployment-spec", tiered])) is None
    assert "without crediting them" in capsys.readouterr().err
    assert router_costs(parse_args(["--model-name", "smol", "--decode-url", "http://127.0.0.1:1",
                                    "--deployment-spec", tiered])) is None  # round-robin pairing: no router


def test_the_server_hands_the_costs_to_its_router():
    from runtime.server.app import build_router_pairing

    costs = tier_credit_costs(_spec(cpu_gib=8), SMOL)
    p = build_router_pairing(RouterSpec(policy="kv_aware"), block_size_tokens=BS, prefill_urls=[],
                             decode_urls=["http://127.0.0.1:1"], costs=costs)
    assert p.router.prefill_cost is costs["prefill_cost"] and set(p.router._credited) == {"CPU"}
    assert not build_router_pairing(RouterSpec(policy="kv_aware"), block_size_tokens=BS, prefill_urls=[],
                                    decode_urls=["http://127.0.0.1:1"]).router._credited
