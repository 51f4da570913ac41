"""EngineSpec.dtype holds only values vLLM's --dtype accepts (vllm/config/model.py ModelDType), so a bad
value fails at the config edge instead of when a worker starts."""

import typing

import pytest
from pydantic import ValidationError

from runtime.config import DeploymentSpec, EngineSpec

VLLM_DTYPES = ("auto", "bfloat16", "float", "float16", "float32", "half")


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp16", "BFLOAT16", "", "int8"])
def test_dtypes_vllm_refuses_are_refused_naming_the_field(dtype):
    with pytest.raises(ValidationError) as exc:
        EngineSpec(dtype=dtype)
    err = exc.value.errors()[0]
    assert err["loc"] == ("dtype",) and err["input"] == dtype
    assert "'bfloat16'" in err["msg"] and "'float32'" in err["msg"]


@pytest.mark.parametrize("dtype", VLLM_DTYPES)
def test_every_vllm_dtype_is_accepted(dtype):
    assert EngineSpec(dtype=dtype).dtype == dtype


def test_a_deployment_spec_with_a_bad_engine_dtype_names_engine_dtype():
    with pytest.raises(ValidationError, match=r"engine\.dtype"):
        DeploymentSpec.model_validate({"model": {"name": "m"}, "engine": {"dtype": "bf16"}})


def test_the_choices_match_vllm_when_vllm_is_installed():
    model = pytest.importorskip("vllm.config.model")
    assert set(typing.get_args(model.ModelDType)) == set(VLLM_DTYPES)
