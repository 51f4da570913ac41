"""`--engine-arg KEY=VALUE` is checked against the installed (pinned) vLLM's own engine-argument parser: known
arguments become vLLM flags in the spec and the worker command lines; unknown ones, bad values and the flags
pdserve sets itself are refused with a message that says why."""

from __future__ import annotations

import pytest

from runtime.config import DeploymentSpec, ModelRef, PoolSpec, WorkloadSpec
from runtime.deploy.target import ClusterTarget
from runtime.deploy.workers import vllm_args
from runtime.engines.engine_args import engine_arg_flags, vllm_engine_parser, with_engine_overrides

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def parser():
    pytest.importorskip("vllm")
    return vllm_engine_parser()  # the real parser (importing vLLM takes tens of seconds on a busy CPU)


def test_known_arguments_become_vllm_flags(parser):
    flags = engine_arg_flags(["max_num_seqs=64", "--max-num-batched-tokens=8192", "enforce-eager=true",
                              "enable-chunked-prefill=false", "kv-cache-dtype=fp8"], parser)
    assert flags == ["--max-num-seqs=64", "--max-num-batched-tokens=8192", "--enforce-eager",
                     "--no-enable-chunked-prefill", "--kv-cache-dtype=fp8"]
    assert vars(parser.parse_args(flags))["max_num_seqs"] == 64


def test_a_later_value_for_the_same_argument_wins(parser):
    assert engine_arg_flags(["max-num-seqs=8", "max_num_seqs=16"], parser) == ["--max-num-seqs=16"]
    assert engine_arg_flags(["enforce-eager=true", "no-enforce-eager=true"], parser) == ["--no-enforce-eager"]


@pytest.mark.parametrize("item,needle", [
    ("max-num-seq=64", "not an engine argument of the installed vLLM (did you mean --max-num-seqs"),
    ("max-num-seqs=many", "vLLM refuses --max-num-seqs=many: argument --max-num-seqs: invalid int value: 'many'"),
    ("kv-cache-dtype=int3", "vLLM refuses --kv-cache-dtype=int3: argument --kv-cache-dtype: invalid choice"),
    ('compilation-config={"no_such_field": 0}', "validation error for CompilationConfig"),
    ("enforce-eager=maybe", "--enforce-eager is a switch: VALUE must be true or false"),
    ("max-model-len=9000", "pdserve sets --max-model-len itself from --max-model-len"),
    ("tensor_parallel_size=8", "pdserve sets --tensor-parallel-size itself from the tuner's TP"),
    ("no-enable-prefix-caching=true", "pdserve sets --enable-prefix-caching itself"),
    ("kv-transfer-config={}", "engine.kv_backends"),
    ("max-num-seqs", "expected KEY=VALUE"),
    ("max-num-seqs=-1", "vLLM refuses --max-num-seqs=-1: max_num_seqs must be >= 1 (SchedulerConfig.max_num_seqs)"),
    ("gpu-memory-utilization=1.5", "pdserve sets --gpu-memory-utilization"),
    ("max-num-batched-tokens=0", "max_num_batched_tokens must be >= 1"),
])
def test_bad_engine_arguments_are_refused_with_the_reason(parser, item, needle):
    with pytest.raises(ValueError) as e:
        engine_arg_flags([item], parser)
    assert needle in str(e.value), str(e.value)


def test_engine_arguments_are_recorded_in_the_spec_and_rendered_into_the_workers(parser):
    spec = DeploymentSpec(model=ModelRef(name="m"), gpu="H100-SXM", prefill=PoolSpec(tp=1, replicas=1),
                          decode=PoolSpec(tp=1, replicas=1), workload=WorkloadSpec(isl_tokens=100, osl_tokens=10))
    spec = spec.model_copy(update={"engine": spec.engine.model_copy(
        update={"extra_args": ["--max-num-seqs", "32", "--seed=4"]})})
    out = with_engine_overrides(spec, engine_args=["max-num-seqs=128", "enforce-eager=true"],
                                max_model_len_tokens=4096, parser=parser)
    assert out.engine.extra_args == ["--seed=4", "--max-num-seqs=128", "--enforce-eager"]
    assert DeploymentSpec.model_validate_json(out.model_dump_json()).engine.extra_args == out.engine.extra_args
    args = vllm_args(out, out.decode, target=ClusterTarget(), gpu=True, efa=False)
    assert args[-3:] == ["--seed=4", "--max-num-seqs=128", "--enforce-eager"]
    assert args[args.index("--max-model-len") + 1] == "4096"
    vars(parser.parse_args([a for a in args if a not in ("--host", "0.0.0.0", "--port", "8000")]))
