"""Worker layouts beyond single-node TP: TP+EP, DP-attention+EP (one node or across nodes), TP x PP across nodes;
the NixlConnector pair rules; the arithmetic of pipelined and data-parallel workers and of MoE traffic."""

import pytest

from runtime.config import ModelRef, SloSpec, WorkloadSpec
from runtime.modelfiles.catalog import load_catalog_spec
from runtime.perf.gpus import get_gpu
from runtime.perf.instances import get_instance
from runtime.perf.model import ACT_BYTES, PerfModel
from runtime.perf.worker import Layout, WorkerPerf
from runtime.modelfiles.load import checkpoint_precision
from runtime.tuner.layouts import check_parallelism, layout_problem, layouts, pair_problem
from runtime.tuner.search import ModelDoesNotFitError, NotDeployableError, tune

DSV3 = load_catalog_spec("deepseek-v3")
L70 = load_catalog_spec("llama-3.1-70b")
MIXTRAL = load_catalog_spec("mixtral-8x7b")
GPT_OSS = load_catalog_spec("gpt-oss-120b")
H100 = get_gpu("H100-SXM")
TPS = (1, 2, 4, 8)


def test_layout_names_gpus_and_nodes() -> None:
    assert (Layout(8).label, Layout(8, ep=True).label, Layout(1, dp=16, ep=True).label, Layout(8, pp=2).label) == (
        "TP8", "TP8 EP8", "DP16 EP16", "TP8 PP2")
    assert Layout(8, pp=2).gpus == 16 and Layout(8, pp=2).nodes(8) == 2 and Layout(1, dp=16, ep=True).nodes(8) == 2
    assert Layout(4).plain and not Layout(4, ep=True).plain
    with pytest.raises(ValueError, match="Layout.tp"):
        Layout(0)
    with pytest.raises(ValueError, match="pipeline stages"):
        Layout(1, dp=2, pp=2)


def test_search_space_per_parallelism_and_pool() -> None:
    assert layouts(DSV3, TPS, "tp", 8, True, "decode") == [Layout(t) for t in TPS]
    pre = layouts(DSV3, TPS, "all", 8, True, "prefill")
    dec = layouts(DSV3, TPS, "all", 8, True, "decode")
    assert Layout(8, ep=True) in dec and Layout(1, dp=32, ep=True) in dec and Layout(8, pp=2) in pre
    assert all(lay.pp == 1 for lay in dec)  # decode workers are never pipelined
    assert not any(lay.gpus > 8 for lay in layouts(DSV3, TPS, "all", 8, False, "prefill"))  # no network known
    dense = layouts(L70, TPS, "all", 8, True, "prefill")
    assert not any(lay.ep or lay.dp > 1 for lay in dense) and Layout(8, pp=4) in dense
    with pytest.raises(ValueError, match="parallelism 'ep'"):
        check_parallelism("ep")


def test_layout_and_pair_rules_are_named() -> None:
    assert "hybrid KV cache" in layout_problem(GPT_OSS, Layout(8, pp=2), 8)  # sliding-window layers
    assert "does not divide 8 experts" in layout_problem(MIXTRAL, Layout(1, dp=16, ep=True), 8)
    assert "TP 16 > 8 GPUs per node" in layout_problem(L70, Layout(16), 8)
    assert layout_problem(DSV3, Layout(1, dp=16, ep=True), 8) == ""
    assert "refuse pipeline_parallel_size > 1" in pair_problem(L70, Layout(8), Layout(8, pp=2))
    assert "prefill TP > decode TP" in pair_problem(L70, Layout(8), Layout(1, dp=8, ep=True))
    assert pair_problem(DSV3, Layout(8, pp=2), Layout(1, dp=16, ep=True)) == ""  # MLA: any attention TP pair


def test_deepseek_v3_on_p5_tunes_across_nodes_with_its_arithmetic() -> None:
    prec = checkpoint_precision(DSV3)
    with pytest.raises(ModelDoesNotFitError, match="multi-node layouts were not searched"):
        tune(DSV3, "p5.48xlarge", SloSpec(), WorkloadSpec(), precision=prec)  # the default: tp
    res = tune(DSV3, "p5.48xlarge", SloSpec(), WorkloadSpec(), precision=prec, parallelism="auto")
    b = res.best
    assert res.parallelism == "all" and b.feasible and not b.plain_tp
    assert b.prefill.gpus > 8 or b.decode.gpus > 8 or b.prefill.ep or b.decode.ep
    assert b.num_gpus == b.prefill_replicas * b.prefill.gpus + b.decode_replicas * b.decode.gpus
    arithmetic = [n for n in res.notes if n.startswith(("prefill ", "decode "))]
    assert len(arithmetic) == 2 and all("weights" in n and "KV tokens per worker" in n for n in arithmetic)
    assert any("p5.48xlarge, 50 GB/s network per GPU" in n for n in res.notes)
    spec = res.to_deployment_spec(ModelRef(name="ds"))  # the layouts as DeploymentSpec pools
    for pool, lay in ((spec.prefill, b.prefill), (spec.decode, b.decode)):
        assert (pool.tp, pool.pp, pool.dp, pool.ep, pool.gpus) == (lay.tp, lay.pp, lay.dp, lay.ep, lay.gpus)
        assert pool.nodes == lay.nodes(8)
    assert spec.prefill.nodes > 1 or spec.decode.nodes > 1
    assert not res.plain_tp_feasible


def test_expert_parallel_search_can_beat_plain_tp_for_a_moe_model() -> None:
    tp = tune(GPT_OSS, "H100-SXM", SloSpec(), WorkloadSpec(), parallelism="tp")
    every = tune(GPT_OSS, "H100-SXM", SloSpec(), WorkloadSpec(), parallelism="all")
    assert len(every.candidates) > len(tp.candidates)
    assert every.best.num_gpus <= tp.best.num_gpus  # plain TP is part of the wider search
    spec = every.to_deployment_spec(ModelRef(name="gpt-oss"))  # every winner's layout is a spec
    assert (spec.decode.tp, spec.decode.dp, spec.decode.ep) == (every.best.decode.tp, every.best.decode.dp,
                                                                every.best.decode.ep)


def test_a_layout_a_pool_refuses_is_not_deployable_by_name() -> None:
    from dataclasses import replace

    res = tune(GPT_OSS, "H100-SXM", SloSpec(), WorkloadSpec(), parallelism="all")
    res.best = replace(res.best, decode_layout=Layout(tp=1, dp=4, ep=False))  # DP attention without EP
    with pytest.raises(NotDeployableError, match="decode workers DP4 .*without ep"):
        res.to_deployment_spec(ModelRef(name="gpt-oss"))


def test_pipelined_worker_by_hand() -> None:
    pm = PerfModel(L70, H100, "bf16")
    w = WorkerPerf(pm, Layout(8, pp=2), 50e9)
    one = pm.memory_breakdown(8)
    assert w.memory_breakdown().weights_bytes == pytest.approx(one.weights_bytes / 2)
    assert w.kv_bytes_per_token_rank() == pytest.approx(pm.kv_bytes_per_token_rank(8) / 2)
    hand = (8192 * 3000 * 2 / 8) / 50e9 + WorkerPerf.STAGE_HANDOFF_LATENCY_S
    assert w.prefill_time_s(3000) == pytest.approx(pm.prefill_time_s(3000, 8) + hand)
    assert w.prefill_busy_s(3000) == pytest.approx((pm.prefill_busy_s(3000, 8) + hand) / 2)
    with pytest.raises(ValueError, match="decode with pipeline stages"):
        w.decode_step_time_s(1, 100)
    with pytest.raises(ValueError, match="network bandwidth"):
        WorkerPerf(pm, Layout(8, pp=2))
    with pytest.raises(ValueError, match="does not match layout"):
        WorkerPerf(PerfModel(MIXTRAL, H100, "bf16"), Layout(8, ep=True))


def test_data_parallel_prefill_runs_one_prompt_per_rank() -> None:
    pm = PerfModel(DSV3, H100, "fp8", expert_parallel=True, attention_dp=True)
    w = WorkerPerf(pm, Layout(1, dp=8, ep=True))
    assert w.prefill_time_s(2000) == pytest.approx(pm.prefill_time_s(2000, 8, batch=8))
    assert w.prefill_busy_s(2000) == pytest.approx(pm.prefill_busy_s(2000, 8, batch=8) / 8)


def test_moe_traffic_on_and_off_the_node_by_hand() -> None:
    net = get_instance("p5.48xlarge").network_bw_per_gpu_bytes_per_s
    assert net == pytest.approx(50e9)
    row = DSV3.hidden_size * ACT_BYTES
    ag = PerfModel(DSV3, H100, "fp8", expert_parallel=True, attention_dp=True, inter_node_bw_bytes_per_s=net)
    on, off = ag.expert_traffic_bytes(1600, 16)
    assert on + off == pytest.approx(15 / 16 * 1600 * row) and off / (on + off) == pytest.approx(8 / 15)
    assert ag.expert_traffic_s(1600, 16) == pytest.approx(max(on / H100.allreduce_bus_bw_bytes_per_s, off / net))
    assert ag.expert_traffic_bytes(1600, 8)[1] == 0  # one node: all NVLink
    dc = PerfModel(DSV3, H100, "fp8", expert_parallel=True, attention_dp=True, all2all="dispatch_combine",
                   inter_node_bw_bytes_per_s=net)
    peers = 15 * (1 - (1 - 1 / 16) ** 8)  # ranks holding one of a token's 8 experts, besides its own
    fp8_pair = DSV3.hidden_size * ((1 + 4 / 128) + 2) / 2  # FP8 dispatch with scales, bf16 combine
    assert sum(dc.expert_traffic_bytes(1600, 16)) == pytest.approx(1600 / 16 * peers * fp8_pair)
    assert dc.decode_step_time_s(256, 2000, 16) < ag.decode_step_time_s(256, 2000, 16)
    with pytest.raises(ValueError, match="inter_node_bw_bytes_per_s"):
        PerfModel(DSV3, H100, "fp8", expert_parallel=True, attention_dp=True).decode_step_time_s(64, 1000, 16)
    with pytest.raises(ValueError, match="unknown all2all"):
        PerfModel(DSV3, H100, "fp8", all2all="ring")


def test_mlflow_candidate_params_name_the_layouts_of_a_wider_search() -> None:
    from runtime.tracking.mlflow_runs import _candidate_params

    res = tune(DSV3, "p5.48xlarge", SloSpec(), WorkloadSpec(), precision="bf16", parallelism="auto")
    params = _candidate_params(res, res.best)
    assert params["parallelism"] == "all" and params["weight_precision"] == "fp8"  # FP8 weights, bf16 KV
    assert (params["prefill_layout"], params["decode_layout"]) == (res.best.prefill.label, res.best.decode.label)
    plain = tune(L70, "H100-SXM", SloSpec(), WorkloadSpec(), parallelism="tp")
    assert "prefill_layout" not in _candidate_params(plain, plain.best)


def test_a_dense_model_no_node_holds_is_refused_with_the_decode_rule() -> None:
    l405 = load_catalog_spec("llama-3.1-405b")
    with pytest.raises(ModelDoesNotFitError, match="decode workers span nodes only through wide expert parallelism"):
        tune(l405, "H100-SXM", SloSpec(), WorkloadSpec(), precision="bf16", parallelism="auto")


def test_a_data_parallel_decode_worker_batches_up_to_max_num_seqs_per_rank() -> None:
    from runtime.tuner.search import MAX_DECODE_BATCH, evaluate_layout_pair

    node_net = get_instance("p5.48xlarge").network_bw_per_gpu_bytes_per_s

    def perf_for(lay):
        return PerfModel(DSV3, H100, "fp8", expert_parallel=lay.ep, attention_dp=lay.dp > 1,
                         inter_node_bw_bytes_per_s=node_net)

    loose = SloSpec(ttft_p90_ms=60_000, itl_p90_ms=2_000)
    c = evaluate_layout_pair(perf_for, Layout(1, dp=32, ep=True), Layout(1, dp=32, ep=True), loose,
                             WorkloadSpec(isl_tokens=200, osl_tokens=50), gpus_per_node=8,
                             network_bw_per_gpu_bytes_per_s=node_net)
    assert c.feasible and MAX_DECODE_BATCH < c.decode_batch <= 32 * MAX_DECODE_BATCH
