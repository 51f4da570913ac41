"""Calibration: the pooled least-squares fit is reproducible, stays in bounds, leaves out what the model does
not describe, and its output is importable data looked up per compute class and serving backend."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest

from runtime.modelfiles.catalog import CATALOG_DIR
from runtime.perf import fitted
from runtime.perf.calibration import DEFAULT, compute_class, efficiency_for
import numpy as np

from runtime.perf.fit import (
    MIN_ROWS,
    _arrays,
    deployment,
    fit_pooled,
    _Layout,
    _Obs,
    _predict,
    observations,
    render,
    running_batch,
)
from runtime.tracking.perf_fit import fit_csv, main
from runtime.perf.model import PerfModel
from runtime.perf.gpus import get_gpu
from runtime.modelfiles.load import load_model_spec

SAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "aiconfigurator_sample_rows.csv"
L70 = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json")


def _rows(pred) -> tuple[list[dict], list[str]]:
    with SAMPLE.open() as f:
        reader = csv.DictReader(f)
        return [r for r in reader if pred(r)], reader.fieldnames


@pytest.fixture(scope="module")
def small_csv(tmp_path_factory) -> Path:
    """Real rows: H200 Llama-3.1-70B / Llama-3.1-8B aggregated measurements (vLLM and TensorRT-LLM, fp8)."""
    rows, fields = _rows(lambda r: r["system"] == "h200_sxm" and r["mode"] == "agg"
                         and r["model_path"] in ("meta-llama/Llama-3.1-70B", "nvidia/Llama-3.1-8B-Instruct-FP8"))
    p = tmp_path_factory.mktemp("fit") / "sample.csv"
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    assert len(rows) > MIN_ROWS
    return p


def test_fit_is_deterministic_bounded_and_reports_residuals(small_csv):
    a, ra = fit_csv(small_csv)
    b, rb = fit_csv(small_csv)
    assert a == b and ra == rb
    assert set(a) == {("*", "fp8", "trtllm"), ("*", "fp8", "vllm")}
    vllm, trt = a[("*", "fp8", "vllm")], a[("*", "fp8", "trtllm")]
    for eff in (vllm, trt):
        assert 0 < eff.compute <= 1 and 0 < eff.memory <= 1 and 0 < eff.comm <= 1 and 0 < eff.attention <= 1
        assert eff.decode_step_overhead_s >= 0 and eff.prefill_overhead_s >= 0 and eff.decode_seq_overhead_s >= 0
    # pooled: GEMM, HBM and interconnect factors are shared; overheads and attention kernels are per backend
    shared = ("compute", "memory", "comm", "gemm_half_tokens", "allreduce_latency_s")
    assert [getattr(vllm, k) for k in shared] == [getattr(trt, k) for k in shared]
    assert vllm.attention <= 0.75 and trt.attention <= 0.75  # FlashAttention-3's share of peak at most
    res = ra[("H200-SXM", "fp8", "vllm")]
    assert res["tpot_rows"] > 0 and res["ttft_rows"] > 0
    assert 0 <= res["tpot_median_abs_pct_error"] <= res["tpot_p90_abs_pct_error"]
    assert ra[("*", "*", "*")]["rows"] == sum(s["rows"] for k, s in ra.items() if k != ("*", "*", "*"))


def test_rows_the_model_does_not_describe_are_left_out():
    rows, _ = _rows(lambda r: r["model_path"] == "meta-llama/Llama-3.1-70B" and r["system"] == "h200_sxm"
                    and r["mode"] == "agg")
    row = dict(rows[0])
    assert len(observations(row, L70)) == 2  # steady-state TPOT + TTFT
    assert observations({**row, "attention_dp_size": "4"}, L70) == []  # attention data parallelism
    assert observations({**row, "tp_size": "16"}, L70) == []  # wider than one 8-GPU node
    assert observations({**row, "gemm_quant_mode": "int4_wo"}, L70) == []  # format not modelled


def test_rendered_module_round_trips(small_csv):
    fit, res = fit_csv(small_csv)
    ns: dict = {}
    exec(render(fit, res, small_csv.name), ns)  # noqa: S102 - our own generated data module
    assert ns["FITTED"] == fit and ns["RESIDUALS"] == res


def test_command_writes_the_module(small_csv, tmp_path):
    out = tmp_path / "fitted.py"
    assert main(["--csv", str(small_csv), "--out", str(out), "--measured"]) == 0
    text = out.read_text()
    assert "FITTED" in text and "'trtllm'" in text and "H200-SXM" in text


def test_shipped_fitted_data_covers_every_class_and_backend():
    for cls in ("bf16", "fp8", "fp4"):
        for backend in ("vllm", "sglang", "trtllm"):
            assert ("*", cls, backend) in fitted.FITTED
    for key, stats in fitted.RESIDUALS.items():
        assert stats["rows"] >= 1 and len(key) == 3


def test_compute_class_follows_the_tensor_cores():
    assert compute_class(get_gpu("A100-SXM-80GB"), "fp8") == "bf16"  # no FP8 tensor cores
    assert compute_class(get_gpu("H100-SXM"), "fp4") == "fp8"  # no FP4 tensor cores
    assert compute_class(get_gpu("B200-SXM"), "fp4") == "fp4"
    assert compute_class(get_gpu("L40S"), "fp16") == "bf16"


def test_efficiency_lookup_order():
    assert efficiency_for("H100-SXM", "fp8") == fitted.FITTED[("*", "fp8", "vllm")]
    assert efficiency_for("H100-SXM", "fp8", "trtllm") == fitted.FITTED[("*", "fp8", "trtllm")]
    assert efficiency_for("L40S", "fp8").compute == fitted.FITTED[("*", "fp8", "vllm")].compute
    assert efficiency_for("A100-SXM-80GB", "fp8") == efficiency_for("A100-SXM-80GB", "bf16")
    assert efficiency_for("A100-SXM-80GB", "fp16") == efficiency_for("A100-SXM-80GB", "bf16")
    assert efficiency_for("CPU", "fp32") == fitted.FITTED[("CPU", "fp32", "vllm")]
    assert efficiency_for("CPU", "bf16").source.startswith("defaults for the measured CPU")
    other = efficiency_for("H100-SXM", "fp8", "some-engine")
    assert other.compute == fitted.FITTED[("*", "fp8", "vllm")].compute and "none fitted" in other.source
    assert DEFAULT.memory == 0.8


def test_running_batch_is_what_the_kv_cache_holds():
    pm = PerfModel(L70, get_gpu("H200-SXM"), "fp8")
    cap = pm.kv_capacity_tokens(1)
    assert 300_000 < cap < 400_000  # ~56 GB of 160 KiB fp8 tokens after 70 GB of weights
    # TensorRT-LLM GUARANTEED_NO_EVICT reserves isl + osl per request; vLLM holds isl + osl/2 on average
    assert running_batch(pm, "trtllm", 128, 8192, 1024, 1) == cap // (8192 + 1024)
    assert running_batch(pm, "vllm", 128, 8192, 1024, 1) == int(cap // (8192 + 512))
    assert running_batch(pm, "trtllm", 4, 8192, 1024, 1) == 4  # fits: the whole closed loop runs
    assert running_batch(PerfModel(L70, get_gpu("L4"), "fp8"), "vllm", 8, 1024, 1024, 1) == 1  # floor 1


def test_kv_limited_rows_decode_at_the_running_batch():
    rows, _ = _rows(lambda r: r["model_path"] == "meta-llama/Llama-3.1-70B" and r["system"] == "h200_sxm"
                    and r["mode"] == "agg" and r["backend"] == "trtllm" and r["tp_size"] == "1"
                    and r["batch_size"] == "128" and r["isl"] == "8192")
    tpot, ttft = observations(rows[0], L70)
    # the row's engine sizes the KV cache: TensorRT-LLM gives 0.9 of the FREE memory (model.KV_MEMORY_RULES)
    run = running_batch(PerfModel(L70, get_gpu("H200-SXM"), "fp8", backend="trtllm"), "trtllm", 128, 8192, 1024, 1)
    assert run < 128
    assert run > running_batch(PerfModel(L70, get_gpu("H200-SXM"), "fp8"), "trtllm", 128, 8192, 1024, 1)
    assert tpot.terms[0][9] == run  # per-sequence overheads counted for the running sequences only
    assert ttft.queue_batch == 128 and ttft.queue_running == run


def test_rows_are_sized_by_their_own_engines_memory_rule():
    """DeepSeek-V3 FP8 on 4 B200s: ~168 GB of weights per GPU. vLLM/SGLang-style 0.9 x 178.35 GiB leaves no KV
    space; TensorRT-LLM's 0.9 x (free memory) does, so only the trtllm row is modelled."""
    rows, _ = _rows(lambda r: r["model_path"].startswith("deepseek-ai/DeepSeek-V3") and r["system"] == "b200_sxm"
                    and r["mode"] == "agg" and r["tp_size"] == "4" and r["gemm_quant_mode"] == "fp8"
                    and r["attention_dp_size"] in ("", "1") and r["moe_ep_size"] in ("", "1", "4"))
    by_backend = {r["backend"]: r for r in rows}
    assert {"trtllm", "sglang"} <= set(by_backend)
    dsv3 = load_model_spec(CATALOG_DIR / "deepseek-ai--DeepSeek-V3_config.json")
    assert not PerfModel(dsv3, get_gpu("B200-SXM"), "fp8").fits(4)
    assert PerfModel(dsv3, get_gpu("B200-SXM"), "fp8", backend="trtllm").fits(4)
    assert observations(by_backend["trtllm"], dsv3)
    assert observations(by_backend["sglang"], dsv3) == []


def test_closed_loop_ttft_waits_for_kv_slots_by_hand():
    """TTFT = prefill + step + M/D/1 wait + (B / running - 1) * request time (Little's law)."""
    zero = [0.0] * 17
    prefill, step = list(zero), list(zero)
    for t in (prefill, step):
        t[3] = t[4] = t[12] = 1.0  # GEMM row counts (unused: no FLOPs)
    prefill[8] = 1.0  # one prefill overhead
    step[7] = 1.0  # one decode-step overhead
    obs = [_Obs("ttft", "trtllm", 1.0, [tuple(prefill), tuple(step)], queue_batch=8, queue_osl=10,
                queue_running=2, cls="bf16")]
    lay = _Layout(obs)
    shared = [1.0, 1.0, 0.0, 0.0, 1.0]  # memory, comm, gemm_half_tokens, all-reduce latency, fused MoE
    per_class, per_backend = [1.0], [0.01, 0.01, 0.0, 1.0, 0.5]  # compute; o_d = o_p = 10 ms, o_s, kv, attn
    theta = np.array(shared + per_class + per_backend)
    assert len(theta) == lay.n
    got = _predict(theta, lay, _arrays(obs, lay))[0]
    request_s = 10 * 0.01 + 0.01  # osl decode steps + the prefill
    rho = 2 / request_s * 0.01
    expected = 0.01 + 0.01 + rho * 0.01 / (2 * (1 - rho)) + (8 / 2 - 1) * request_s
    assert expected == pytest.approx(0.351111, rel=1e-5)
    assert got == pytest.approx(expected)


def test_shipped_fit_has_per_backend_attention_kernels():
    trt, vllm = fitted.FITTED[("*", "fp8", "trtllm")], fitted.FITTED[("*", "fp8", "vllm")]
    assert trt.compute == vllm.compute and trt.comm == vllm.comm
    assert (trt.kv_memory, trt.attention) != (vllm.kv_memory, vllm.attention)
    assert all(0 < e.attention <= 0.75 for k, e in fitted.FITTED.items() if k[0] == "*")


def test_gpu_fits_respect_kernel_bounds_and_the_cpu_entry_does_not_need_them():
    for key, e in fitted.FITTED.items():
        if key[0] == "*":
            assert e.gemm_half_tokens >= 64  # smallest tensor-core tile: 64 rows
            assert e.attention <= 0.75  # FlashAttention-3's share of peak
            assert 0 < e.moe <= 1  # routing / permutation only add work
    cpu = fitted.FITTED[("CPU", "fp32", "vllm")]
    assert cpu.gemm_half_tokens < 64  # no tensor-core tiles on the CPU
    lay = _Layout([_Obs("tpot", "vllm", 1.0, [], cls="fp32")])
    _, lo_gpu, hi_gpu = lay.x0_bounds(True)
    _, lo_cpu, hi_cpu = lay.x0_bounds(False)
    assert lo_gpu[2] == 64 and lo_cpu[2] == 0
    assert hi_gpu[-1] == 0.75 and hi_cpu[-1] == 1.0


def test_ttft_observations_carry_their_deployment_and_tpot_does_not():
    rows, _ = _rows(lambda r: r["model_path"] == "meta-llama/Llama-3.1-70B" and r["system"] == "h200_sxm"
                    and r["mode"] == "agg" and r["backend"] == "trtllm")
    row = rows[0]
    tpot, ttft = observations(row, L70)
    assert tpot.kind == "tpot" and tpot.deployment == ""
    assert ttft.kind == "ttft"
    assert ttft.deployment == f"meta-llama/Llama-3.1-70B|h200_sxm|trtllm|{row['backend_version']}"
    assert deployment({**row, "backend_version": "9.9"}) != ttft.deployment


def _term16(**kw) -> tuple[float, ...]:
    """A roofline term (see ``_Obs``) with huge GEMM row counts (g(M) = 1) and the given fields set."""
    names = ("dense", "expert", "attn", "mt", "me", "m", "k", "nd", "np", "ns", "kv", "lm", "ml", "nar", "lll", "lls",
             "act")
    t = dict.fromkeys(names, 0.0) | {"mt": 1e12, "me": 1e12, "ml": 1e12} | kw
    return tuple(t[n] for n in names)


def test_a_deployments_latency_replaces_the_prefill_overhead_by_hand():
    """TTFT = roofline + the deployment's constant; without a deployment: roofline + prefill overhead."""
    term = _term16(m=0.1, np=1.0)  # 0.1 s of weights at 100% HBM, one prefill overhead
    with_dep = _Obs("ttft", "trtllm", 1.0, [term], cls="fp8", deployment="m|gpu|trtllm|1")
    without = _Obs("ttft", "trtllm", 1.0, [term], cls="fp8")
    lay = _Layout([with_dep, without])
    assert lay.deployments == ["m|gpu|trtllm|1"] and lay.n == lay.n_core + 1
    shared = [0.5, 1.0, 64.0, 0.0, 1.0]  # memory 0.5, comm, gemm_half_tokens, all-reduce latency, fused MoE
    theta = np.array(shared + [0.4] + [0.0, 0.01, 0.0, 1.0, 0.5] + [0.3])  # o_p = 10 ms; deployment 0.3 s
    got = _predict(theta, lay, _arrays([with_dep, without], lay))
    assert got == pytest.approx([0.1 / 0.5 + 0.3, 0.1 / 0.5 + 0.01])


def test_fit_separates_deployment_latencies_from_compute():
    """Synthetic TTFTs: compute-bound prefills (time ~ ISL) on three deployments with very different fixed
    latencies, plus weight-bound TPOTs. The fit recovers the compute and memory efficiencies and each
    deployment's constant, and reports the median constant as the backend's prefill overhead."""
    lats = {"a|gpu|trtllm|1": 0.05, "b|gpu|trtllm|1": 0.4, "c|gpu|trtllm|1": 0.1}
    obs = [_Obs("ttft", "trtllm", 1.0, [_term16(dense=0.05 * k)], cls="fp8", deployment=d)
           for d in lats for k in (1, 2, 4, 8)]
    obs += [_Obs("tpot", "trtllm", 1.0, [_term16(m=0.002 * k, nd=1.0)], cls="fp8") for k in (1, 2, 3, 5)]
    lay = _Layout(obs)
    true = np.array([0.8, 0.7, 64.0, 0.0, 0.8] + [0.45] + [0.001, 0.0, 0.0, 0.8, 0.5] + [lats[d] for d in lay.deployments])
    measured = _predict(true, lay, _arrays(obs, lay))
    obs = [replace(o, measured_s=float(t)) for o, t in zip(obs, measured)]
    lay, x, _ = fit_pooled(obs)
    eff = lay.efficiency(x, "fp8", "trtllm", "test")
    assert eff.compute == pytest.approx(0.45, rel=1e-3)
    assert eff.memory == pytest.approx(0.8, rel=1e-3)
    assert [round(float(v), 4) for v in x[lay.n_core:]] == [lats[d] for d in lay.deployments]
    assert eff.prefill_overhead_s == pytest.approx(0.1, abs=1e-4)  # median of 0.05, 0.1, 0.4


def test_pcie_gpus_keep_the_default_comm_efficiency():
    """The pooled comm is fitted on NVLink systems only; PCIe GPUs keep ``DEFAULT.comm``."""
    fit = fitted.FITTED[("*", "fp8", "trtllm")]
    assert fit.comm != DEFAULT.comm
    assert efficiency_for("H100-SXM", "fp8", "trtllm").comm == fit.comm
    l40s = efficiency_for("L40S", "fp8", "trtllm")
    assert l40s.comm == DEFAULT.comm and "PCIe" in l40s.source
    assert l40s.compute == fit.compute and l40s.memory == fit.memory
    assert efficiency_for("A100-PCIe-80GB", "bf16").comm == DEFAULT.comm
    assert efficiency_for("A100-SXM-80GB", "bf16").comm == fitted.FITTED[("*", "bf16", "vllm")].comm


def test_fit_charges_activation_traffic_at_the_memory_efficiency_by_hand():
    """The element-wise activation term (``act``, s at 100% HBM) runs in its own kernels: it adds ``act /
    memory`` to the weight-vs-GEMM roofline, it is not hidden under it."""
    obs = _Obs("tpot", "trtllm", 1.0, [_term16(m=0.1, dense=0.05, act=0.02)], cls="fp8")
    lay = _Layout([obs])
    theta = np.array([0.5, 1.0, 64.0, 0.0, 1.0] + [0.5] + [0.0, 0.0, 0.0, 1.0, 0.5])
    got = _predict(theta, lay, _arrays([obs], lay))
    assert got == pytest.approx([max(0.05 / 0.5, 0.1 / 0.5) + 0.02 / 0.5])


def test_observations_carry_the_models_activation_traffic():
    """A silicon row's decode term holds ``PerfModel``'s element-wise traffic at the row's batch."""
    l70 = load_model_spec(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-70B_config.json")
    row = {"system": "h100_sxm", "gemm_quant_mode": "fp8", "backend": "vllm", "isl": "1000", "osl": "500",
           "silicon_ttft_ms": "100", "silicon_tpot_ms": "20", "mode": "disagg", "decode_tp_size": "4",
           "decode_batch_size": "16", "decode_attention_dp_size": "1", "decode_moe_ep_size": "1",
           "model_path": "meta-llama/Llama-3.1-70B", "backend_version": "x"}
    (obs,) = observations(row, l70)
    pm = PerfModel(l70, get_gpu("H100-SXM"), "fp8")
    assert obs.terms[0][16] == pytest.approx(16 * pm.activation_bytes_per_token(4) / 3350e9, rel=1e-9)
