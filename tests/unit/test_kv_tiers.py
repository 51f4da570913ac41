"""KV offload tiers: per-medium indexing of KV events, the blocks a worker would load, and the router's credit.

Specification:
* ``KvEventApplier(tiers=...)`` sends each event to the index of its medium (each medium holds exactly its
  stored minus removed copies, property-tested); a CPU copy's parent may be known on the GPU only; removing
  the CPU copy leaves the GPU block; ``AllBlocksCleared`` clears every tier.
* ``offload_hits`` = the run of blocks right after the GPU prefix that some tier holds, each charged to the
  fastest medium holding it (property-tested against a set model).
* the router credits a tier hit by its load cost, never more blocks than the worker can reuse
  (property-tested): a cheap load wins over a full prefill, a load dearer than recomputing does not;
  without a cost (or with cache-blind/Dynamo policies) tiers are not credited.
* the simulator's CPU tier (write-through, LRU) and the replay that loads from it.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import RouterSpec
from runtime.kv.apply import KvEventApplier
from runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from runtime.kv.hashing import block_hashes
from runtime.kv.index import PrefixIndex
from runtime.kv.tiers import (
    PCIE_GEN4_X4_BYTES_PER_S,
    PCIE_GEN5_X16_BYTES_PER_S,
    TIER_BANDWIDTH_BYTES_PER_S,
    load_s_per_token,
    offload_hits,
)
from runtime.router.core import Router

BS = 4
PROMPT = tuple(range(100, 116))  # 4 full blocks
OURS = block_hashes(PROMPT, BS)


def _tiered(*workers):
    gpu, cpu, disk = PrefixIndex(), PrefixIndex(), PrefixIndex()
    for w in workers:
        for idx in (gpu, cpu, disk):
            idx.add_worker(w)
    return gpu, cpu, disk, KvEventApplier(gpu, BS, tiers={"CPU": cpu, "STORAGE": disk})


# ----------------------------------------------------------------------------------------- applying
def test_cpu_copies_are_indexed_apart_and_chain_from_a_gpu_parent():
    gpu, cpu, disk, ap = _tiered("A")
    ap.apply("A", [BlockStored((11, 12), None, PROMPT[:8], BS, medium="GPU")])
    # the connector offloads blocks 3-4 as one chunk whose parent (12) it never reported itself
    stats = ap.apply("A", [BlockStored((13, 14), 12, PROMPT[8:], BS, medium="CPU")])
    assert stats.num_stored_blocks == 2 and stats.num_orphan_blocks == 0
    assert gpu.match(OURS) == {"A": 2}
    assert [cpu.holds("A", h) for h in OURS] == [False, False, True, True]
    ap.apply("A", [BlockRemoved((12,), medium="CPU")])  # no CPU copy of 12: nothing to drop anywhere
    assert gpu.match(OURS) == {"A": 2}
    ap.apply("A", [BlockRemoved((13,), medium="CPU")])
    assert not cpu.holds("A", OURS[2]) and cpu.holds("A", OURS[3])
    assert gpu.match(OURS) == {"A": 2}


def test_a_gpu_removal_leaves_the_offloaded_copy():
    gpu, cpu, _, ap = _tiered("A")
    ap.apply("A", [BlockStored((11,), None, PROMPT[:4], BS, medium=None),
                   BlockStored((11,), None, PROMPT[:4], BS, medium="CPU"),
                   BlockRemoved((11,), medium=None)])
    assert gpu.num_blocks("A") == 0 and cpu.holds("A", OURS[0])


def test_clear_drops_every_tier_and_unknown_media_are_skipped():
    gpu, cpu, disk, ap = _tiered("A")
    ap.apply("A", [BlockStored((11,), None, PROMPT[:4], BS), BlockStored((11,), None, PROMPT[:4], BS, medium="CPU"),
                   BlockStored((11,), None, PROMPT[:4], BS, medium="STORAGE")])
    stats = ap.apply("A", [BlockStored((11,), None, PROMPT[:4], BS, medium="TAPE"), AllBlocksCleared()])
    assert stats.num_skipped_events == 1
    assert (gpu.num_blocks("A"), cpu.num_blocks("A"), disk.num_blocks("A")) == (0, 0, 0)
    # and the translation tables went too: a CPU child of the cleared block is an orphan now
    assert ap.apply("A", [BlockStored((12,), 11, PROMPT[4:8], BS, medium="CPU")]).num_orphan_blocks == 1


# ----------------------------------------------------------------------------------------- matching
def test_offload_hits_continue_the_gpu_prefix_fastest_tier_first():
    gpu, cpu, disk, _ = _tiered("A", "B")
    gpu.store("A", [1, 2])
    cpu.store("A", [3, 4])
    disk.store("A", [4, 5, 7])
    cpu.store("B", [2, 3])  # B: no GPU block 1, so its CPU blocks are no prefix continuation
    hashes = [1, 2, 3, 4, 5, 6, 7]
    device = gpu.match(hashes)
    assert offload_hits({"CPU": cpu, "STORAGE": disk}, hashes, device, ["A", "B"]) == {
        "A": {"CPU": 2, "STORAGE": 1}}
    disk.store("B", [1])
    assert offload_hits({"CPU": cpu, "STORAGE": disk}, hashes, device, ["A", "B"])["B"] == {"STORAGE": 1, "CPU": 2}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["GPU", "CPU", "STORAGE"]), st.integers(0, 7)), max_size=30),
       st.lists(st.integers(0, 7), max_size=8, unique=True))
def test_offload_hits_match_a_set_model(stores, prompt):
    gpu, cpu, disk, _ = _tiered("A")
    held = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    for medium, h in stores:
        {"GPU": gpu, "CPU": cpu, "STORAGE": disk}[medium].store("A", [h])
        held[medium].add(h)
    device = gpu.match(prompt)
    got = offload_hits({"CPU": cpu, "STORAGE": disk}, prompt, device, ["A"]).get("A", {})
    g = 0
    while g < len(prompt) and prompt[g] in held["GPU"]:
        g += 1
    assert device.get("A", 0) == g
    want: dict[str, int] = {}
    for h in prompt[g:]:
        m = "CPU" if h in held["CPU"] else "STORAGE" if h in held["STORAGE"] else None
        if m is None:
            break
        want[m] = want.get(m, 0) + 1
    assert got == want


# ----------------------------------------------------------------------------------------- load cost
def test_load_cost_is_bytes_over_the_link_rate():
    assert PCIE_GEN5_X16_BYTES_PER_S == pytest.approx(63.0e9, rel=1e-3)
    assert PCIE_GEN4_X4_BYTES_PER_S == pytest.approx(7.877e9, rel=1e-3)
    per = load_s_per_token(40960.0)  # Llama-3.1-70B bf16 KV per token / TP8 = 320 KiB / 8
    assert per == {m: pytest.approx(40960.0 / bw) for m, bw in TIER_BANDWIDTH_BYTES_PER_S.items()}
    assert per["STORAGE"] > per["CPU"]
    assert load_s_per_token(100.0, {"CPU": 50.0}) == {"CPU": 2.0}
    with pytest.raises(ValueError, match="kv_bytes_per_token_rank"):
        load_s_per_token(0)
    with pytest.raises(ValueError, match="'CPU'"):
        load_s_per_token(1.0, {"CPU": 0.0})


# ----------------------------------------------------------------------------------------- routing
def _router(policy="kv_aware", cost=None):
    r = Router(RouterSpec(policy=policy, balance_weight=0.0), BS, tier_load_cost=cost)
    r.add_worker("A", "both")
    r.add_worker("B", "both")
    # A holds the first block on the GPU and the rest in its CPU tier; B holds nothing
    r.apply_kv_events("A", [BlockStored((11,), None, PROMPT[:4], BS),
                            BlockStored((12, 13, 14), 11, PROMPT[4:], BS, medium="CPU")], 0.0)
    return r


def test_a_cheap_tier_hit_wins_and_is_charged_its_load():
    r = _router(cost={"CPU": 0.1})  # loading a token costs a tenth of computing one (tokens unit)
    d = r.route("q", token_ids=list(PROMPT), now_s=0.0)
    # 15 of 16 tokens reusable (the last token is recomputed): 1 GPU block + 2 CPU blocks (cap)
    assert (d.decode_worker, d.overlap_blocks, d.offload_blocks, d.uncached_tokens) == ("A", 3, 2, 4)
    assert r.workers["A"].prefill_work == pytest.approx(4 + 3 * BS * 0.1 * 2 / 3)


def test_a_load_dearer_than_recomputing_is_not_preferred():
    r = _router(cost={"CPU": 2.0})
    r.workers["A"].prefill_work = 3.0  # A queues 3 tokens of work
    d = r.route("q", token_ids=list(PROMPT), now_s=0.0)
    # A's GPU hit alone would win (3 + 12 uncached < B's 16), but vLLM loads whatever its tier holds:
    # 3 + 0 uncached + 3 CPU blocks x 4 tokens x 2 = 27 > 16
    assert d.decode_worker == "B" and d.offload_blocks == 0


@pytest.mark.parametrize("policy,cost", [("kv_aware", None), ("dynamo_cost", {"CPU": 0.1})])
def test_without_a_cost_or_with_a_tier_blind_policy_only_device_hits_count(policy, cost):
    r = _router(policy, cost)
    d = r.route("q", token_ids=list(PROMPT), now_s=0.0)
    assert d.offload_blocks == 0 and d.overlap_blocks == (1 if d.decode_worker == "A" else 0)
    assert r.tiers["CPU"].num_blocks("A") == 3  # the tier is indexed all the same


def test_tier_costs_name_known_media_and_removed_workers_leave_the_tiers():
    with pytest.raises(ValueError, match="'TAPE'"):
        Router(RouterSpec(), BS, tier_load_cost={"TAPE": 1.0})
    with pytest.raises(ValueError, match="'CPU'"):
        Router(RouterSpec(), BS, tier_load_cost={"CPU": -1.0})
    r = _router(cost={"CPU": 0.1})
    r.remove_worker("A")
    assert "A" not in r.tiers["CPU"].workers


# ----------------------------------------------------------------------------------------- simulator
def test_sim_cache_writes_through_to_the_tier_and_loads_an_evicted_prefix_back():
    from runtime.sim.worker import SimKvCache

    c = SimKvCache(2, 512, offload_capacity_blocks=3)
    hit, loaded, events = c.acquire_tiered([1, 2])
    assert (hit, loaded) == (0, 0)
    assert events == [BlockStored((1, 2), None, None, 512), BlockStored((1, 2), None, None, 512, medium="CPU")]
    c.release([1, 2])
    _, _, events = c.acquire_tiered([3, 4])  # the GPU evicts 1-2; the tier keeps them and evicts nothing yet
    assert BlockRemoved((2, 1)) in events  # freed tail first, so the tail goes first
    assert BlockRemoved((1,), "CPU") in events  # tier of 3: 1 (least recent) makes room for 3, 4
    c.release([3, 4])
    hit, loaded, _ = c.acquire_tiered([2, 3])  # block 2 is no prefix start: nothing loads past a GPU miss
    assert (hit, loaded) == (0, 2) and c.offload_holds(2)
    plain = SimKvCache(2, 512)
    plain.acquire([1, 2])
    assert all(ev.medium is None for ev in plain.acquire([3])[1])


def test_replay_with_a_cpu_tier_loads_what_the_gpu_evicted_and_the_router_learns_it():
    from runtime.sim.replay import SimWorkerSpec, replay
    from runtime.sim.trace import TraceRequest

    class Timing:  # prefill 1 ms per uncached token
        fixed_latency_s = 0.0

        def prefill_s(self, isl, cached=0):
            return 1e-3 * (isl - min(cached, isl - 1))

        def decode_s(self, *a):
            return 0.0

    reqs = [TraceRequest(f"r{i}", float(i), 4 * 512, 1, tuple(range(100 * (i % 3), 100 * (i % 3) + 4)))
            for i in range(9)]
    routers = []

    def run(tier, cost):
        r = Router(RouterSpec(policy="kv_aware"), 512, tier_load_cost=cost)
        r.add_worker("w", "both")
        routers.append(r)
        return replay(reqs, r, [SimWorkerSpec("w", "both", 4, tier)], Timing(), 512, offload_load_s_per_token=1e-4)

    none, cpu = run(0, None), run(12, {"CPU": 1e-4})
    assert none.offload_hit_blocks == 0 and none.hit_blocks == 0  # 3 prompts of 4 blocks thrash 4 GPU blocks
    assert cpu.offload_hit_blocks == 6 * 4 and cpu.hit_blocks == 0
    assert cpu.ttft_mean_s < none.ttft_mean_s
    assert routers[1].tiers["CPU"].num_blocks("w") == 12


def test_an_offloaded_copy_takes_the_gpu_translation_so_a_salted_prefix_stays_salted():
    from runtime.kv.hashing import request_extra_keys

    gpu, cpu, _, ap = _tiered("A")
    salted = block_hashes(PROMPT, BS, extra_keys=request_extra_keys(4, "tenant-1"))
    ap.apply("A", [BlockStored((11, 12, 13, 14), None, PROMPT, BS,
                               extra_keys=(("tenant-1",), None, None, None))])
    # vLLM 0.28's offloading events carry no extra keys: the engine hashes say which (salted) blocks these are
    ap.apply("A", [BlockStored((11, 12), None, PROMPT[:8], BS, medium="CPU")])
    assert [cpu.holds("A", h) for h in salted] == [True, True, False, False]
    assert not any(cpu.holds("A", h) for h in OURS)  # an unsalted prompt finds no CPU copy
    # a block whose GPU entry already left is hashed from its tokens, chained to its known parent
    ap.apply("A", [BlockRemoved((13,)), BlockStored((13,), 12, PROMPT[8:12], BS, medium="CPU")])
    assert cpu.holds("A", salted[2])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.sampled_from(["store", "remove"]), st.sampled_from([None, "GPU", "CPU", "STORAGE"]),
              st.integers(0, 5)),
    st.just(("clear", None, 0))), max_size=40))
def test_each_medium_holds_exactly_its_stored_minus_removed_copies(ops):
    gpu, cpu, disk, ap = _tiered("A")
    indexes = {"GPU": gpu, "CPU": cpu, "STORAGE": disk}
    copies = {m: {} for m in indexes}  # the model: medium -> block -> copies
    for op, medium, h in ops:
        m = medium or "GPU"
        if op == "store":
            ap.apply("A", [BlockStored((h,), None, None, BS, medium=medium)])  # simulator form: hash = id
            copies[m][h] = copies[m].get(h, 0) + 1
        elif op == "remove":
            ap.apply("A", [BlockRemoved((h,), medium=medium)])
            if copies[m].get(h):
                copies[m][h] -= 1
        else:
            ap.apply("A", [AllBlocksCleared()])
            copies = {m: {} for m in indexes}
        for med, idx in indexes.items():
            assert {b for b in range(6) if idx.holds("A", b)} == {b for b, n in copies[med].items() if n > 0}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["GPU", "CPU", "STORAGE"]), st.integers(0, 7)), max_size=30),
       st.integers(1, 8))
def test_the_router_never_credits_more_than_the_worker_can_reuse(stores, prompt_blocks):
    r = Router(RouterSpec(policy="kv_aware"), 512, tier_load_cost={"CPU": 0.01, "STORAGE": 0.02})
    r.add_worker("A", "both")
    held = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    for medium, h in stores:
        r.apply_kv_events("A", [BlockStored((h,), None, None, 512, medium=medium)], 0.0)
        held[medium].add(h)
    prompt = list(range(prompt_blocks))
    d = r.route("q", block_hashes=prompt, now_s=0.0)
    g = 0
    while g < len(prompt) and prompt[g] in held["GPU"]:
        g += 1
    t = g
    while t < len(prompt) and (prompt[t] in held["CPU"] or prompt[t] in held["STORAGE"]):
        t += 1
    cap = (prompt_blocks * 512 - 1) // 512  # vLLM recomputes the last prompt token
    assert d.overlap_blocks == min(t, cap)
    assert d.offload_blocks == max(0, min(t, cap) - g)
    assert d.uncached_tokens == prompt_blocks * 512 - d.overlap_blocks * 512


def test_vllms_own_offloading_events_decode_with_their_medium_and_index_per_tier():
    """Events built with vLLM 0.28's classes and encoded as its ZMQ publisher does (msgspec msgpack)."""
    pytest.importorskip("vllm")
    import msgspec
    from vllm.distributed.kv_events import (
        MEDIUM_CPU,
        MEDIUM_GPU,
        MEDIUM_STORAGE,
        KVEventBatch,
    )
    from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VBlockStored

    from runtime.kv.events import OFFLOAD_MEDIA, decode_payload

    assert (MEDIUM_CPU, MEDIUM_STORAGE) == OFFLOAD_MEDIA and MEDIUM_GPU == "GPU"

    def stored(hashes, parent, tokens, medium):
        return VBlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                            block_size=BS, lora_id=None, medium=medium, lora_name=None, group_idx=0,
                            locality="LOCAL")

    batch = KVEventBatch(ts=1.0, events=[
        stored([11, 12], None, PROMPT[:8], MEDIUM_GPU),
        stored([13, 14], 12, PROMPT[8:], MEDIUM_CPU),  # a self-describing offloaded chunk
        stored([11], None, PROMPT[:4], MEDIUM_STORAGE),
        VBlockStored(block_hashes=[99], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                     medium=MEDIUM_CPU, lora_name=None),  # the placeholder of a non-self-describing connector
        VBlockRemoved(block_hashes=[14], medium=MEDIUM_CPU, group_idx=0)])
    got = decode_payload(msgspec.msgpack.Encoder().encode(batch))
    assert got.num_skipped_events == 1 and [ev.medium for ev in got.events] == ["GPU", "CPU", "STORAGE", "CPU"]
    gpu, cpu, disk, ap = _tiered("A")
    ap.apply("A", got.events)
    assert gpu.match(OURS) == {"A": 2}
    assert offload_hits({"CPU": cpu, "STORAGE": disk}, OURS, gpu.match(OURS), ["A"]) == {"A": {"CPU": 1}}
    assert disk.holds("A", OURS[0])
