"""A checkpoint's precision from its quantization_config / hf_quant_config.json, what each GPU runs it as, and
that memory fit and the tuner size the weights in their stored format."""

import json
from pathlib import Path

import pytest

from runtime.config import ModelRef, SloSpec, WorkloadSpec
from runtime.modelfiles.catalog import load_catalog_spec
from runtime.modelfiles.load import load_model_spec
from runtime.models.quant import BYTES_PER_PARAM, detect_precision
from runtime.models.spec import ModelConfigError, ModelSpec
from runtime.perf.gpus import get_gpu
from runtime.perf.model import PerfModel
from runtime.perf.precision import format_support
from runtime.modelfiles.load import checkpoint_precision
from runtime.tuner.search import TuningError, perf_precisions, tune

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("quant, weights, kv", [
    (None, "bf16", ""),
    ({}, "bf16", ""),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8", ""),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8-block", ""),
    ({"quant_method": "fbgemm_fp8"}, "fp8", ""),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, "mxfp4", ""),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, "fp8", "fp8"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "nvfp4", ""),
    ({"quant_method": "modelopt_fp4"}, "nvfp4", ""),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}},
      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}, "fp8", "fp8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}}, "nvfp4", ""),
])
def test_known_formats_are_detected(quant, weights, kv) -> None:
    p = detect_precision(quant, "m")
    assert (p.weights, p.kv_cache, p.note) == (weights, kv, "")


@pytest.mark.parametrize("quant, named", [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "'W4A8_AWQ'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, "int4 group"),
])
def test_a_precision_that_cannot_be_told_is_said_and_sized_as_bf16(quant, named) -> None:
    p = detect_precision(quant, "org/m")
    assert p.weights == "unknown" and p.perf_precision == "bf16" and not p.quantized
    assert named in p.note and "org/m" in p.note and "sized as bf16" in p.note


def test_bytes_per_param_include_the_scales() -> None:
    assert BYTES_PER_PARAM["mxfp4"] == pytest.approx((32 * 4 + 8) / 32 / 8)  # E8M0 scale per 32 values
    assert BYTES_PER_PARAM["nvfp4"] == pytest.approx((16 * 4 + 8) / 16 / 8)  # FP8 scale per 16 values
    assert 1 < BYTES_PER_PARAM["fp8-block"] < 1.001


def test_a_quantization_config_that_is_not_an_object_is_a_config_error() -> None:
    cfg = json.loads((FIXTURES / "modelopt-fp8-checkpoint" / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="quantization_config must be a JSON object"):
        ModelSpec.from_hf_config({**cfg, "quantization_config": "fp8"}, "m")


def test_the_modelopt_fp8_fixture_folder_is_detected_from_hf_quant_config() -> None:
    folder = FIXTURES / "modelopt-fp8-checkpoint"
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    m = load_model_spec(folder)
    assert (m.quant_method, m.weight_format, m.kv_cache_format) == ("modelopt", "fp8", "fp8")
    assert checkpoint_precision(m) == "fp8"
    assert PerfModel(m, get_gpu("H100-SXM"), *perf_precisions(m, "fp8")[:1]).weight_dtype_bytes == 1.0


def test_an_nvfp4_checkpoint_with_fp8_kv_scales_deploys_an_fp8_kv_cache(tmp_path: Path) -> None:
    cfg = json.loads((FIXTURES / "modelopt-fp8-checkpoint" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}}))
    m = load_model_spec(tmp_path)
    assert (m.weight_format, m.kv_cache_format, checkpoint_precision(m)) == ("nvfp4", "fp8", "fp8")
    assert perf_precisions(m, "fp8") == ("fp4", "fp8") and perf_precisions(m, "bf16") == ("fp4", "bf16")


def test_gpt_oss_120b_is_sized_in_mxfp4() -> None:
    m = load_catalog_spec("gpt-oss-120b")
    assert m.weight_format == "mxfp4"
    h100 = get_gpu("H100-SXM")
    weights, kv = perf_precisions(m, "bf16")  # the deployment's KV stays bf16, the weights stay MXFP4
    assert (weights, kv) == ("fp4", "bf16")
    mx = PerfModel(m, h100, weights, kv_precision=kv)
    assert 60e9 < mx.weight_bytes_per_rank(1) < 66e9  # the published checkpoint is ~65 GB, not 4 x that
    assert PerfModel(m, h100, "bf16").weight_bytes_per_rank(1) > 230e9
    assert mx.kv_dtype_bytes == 2.0 and mx.compute_precision == "bf16"  # W4A16 on Hopper
    assert mx.fits(1)  # one 80 GB GPU holds it
    res = tune(m, "H100-SXM", SloSpec(), WorkloadSpec(), precision="bf16", parallelism="tp")
    wide = tune(m, "H100-SXM", SloSpec(), WorkloadSpec(), perf=PerfModel(m, h100, "bf16"))
    assert res.weight_precision == "fp4" and res.precision == "bf16"
    assert res.best.num_gpus < wide.best.num_gpus
    assert any("mxfp4 checkpoint" in n and "weight-only" in n for n in res.notes)
    assert res.to_deployment_spec(ModelRef(name="gpt-oss")).precision == "bf16"


def test_each_gpu_runs_each_format_natively_weight_only_or_not_at_all() -> None:
    h100, b200, a100, cpu = (get_gpu(n) for n in ("H100-SXM", "B200-SXM", "A100-SXM-80GB", "CPU"))
    assert (format_support(b200, "mxfp4").mode, format_support(b200, "mxfp4").compute_precision) == ("native", "fp8")
    assert (format_support(h100, "mxfp4").mode, format_support(h100, "mxfp4").compute_precision) == (
        "weight-only", "bf16")
    assert format_support(b200, "nvfp4").compute_precision == "fp4"
    assert format_support(h100, "nvfp4").mode == "weight-only"
    assert format_support(h100, "fp8-block").mode == "native"
    assert format_support(a100, "fp8").mode == "weight-only" and "Marlin" in format_support(a100, "fp8").kernel
    assert not format_support(cpu, "nvfp4").supported and not format_support(cpu, "fp8").supported
    with pytest.raises(ValueError, match="unknown weight format"):
        format_support(h100, "int3")


def test_a_format_the_gpu_cannot_run_is_refused_by_name() -> None:
    m = load_catalog_spec("llama-3.1-70b-fp8")
    with pytest.raises(TuningError, match="fp8 weights cannot run on CPU"):
        tune(m, "CPU", SloSpec(), WorkloadSpec(isl_tokens=100, osl_tokens=10), precision="bf16")


def test_kv_precision_is_separate_from_the_weights() -> None:
    m = load_catalog_spec("llama-3.1-8b")
    h100 = get_gpu("H100-SXM")
    assert PerfModel(m, h100, "fp8").kv_dtype_bytes == 1.0
    assert PerfModel(m, h100, "fp8", kv_precision="bf16").kv_dtype_bytes == 2.0
    assert PerfModel(m, h100, "fp8", kv_precision="bf16").kv_capacity_tokens(1) < PerfModel(
        m, h100, "fp8").kv_capacity_tokens(1)
    with pytest.raises(ValueError, match="unknown KV precision"):
        PerfModel(m, h100, "bf16", kv_precision="int3")


def test_the_champion_comparison_and_the_runtime_planner_size_the_checkpoint_as_the_tuner() -> None:
    from runtime.tuner.champion import champion_perf
    from runtime.tuner.search import deployment_perf

    m = load_catalog_spec("gpt-oss-120b")
    res = tune(m, "H100-SXM", SloSpec(), WorkloadSpec(), precision="bf16", parallelism="tp")
    spec = res.to_deployment_spec(ModelRef(name="gpt-oss"))
    champ = champion_perf(m, spec)
    assert (champ.precision, champ.kv_dtype_bytes) == ("fp4", 2.0)
    assert champion_perf(m, spec, res.perf) is res.perf  # the same sizing: reused
    assert deployment_perf(m, get_gpu("H100-SXM"), "bf16").weight_bytes_per_rank(1) == pytest.approx(
        champ.weight_bytes_per_rank(1))
