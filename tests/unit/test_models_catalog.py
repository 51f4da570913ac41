"""The built-in model catalog (runtime/modelfiles/catalog.py): every entry loads, holds architecture facts only,
and `pdserve tune` / `pdserve models` take its names."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import DeploymentSpec
from runtime.models import spec as spec_module
from runtime.modelfiles.catalog import (
    CATALOG, CATALOG_DIR, catalog_entries, catalog_path, find_catalog_entry, load_catalog_spec, resolve_model_config,
)
from runtime.models.spec import ModelConfigError

runner = CliRunner()

# published sizes (model cards), billions of parameters: the catalog must describe the models it names
PUBLISHED_B = {"llama-3.1-8b": 8.0, "llama-3.1-70b": 70.6, "llama-3.1-405b": 405.9, "mixtral-8x7b": 46.7,
               "qwen3-235b-a22b": 235.1, "deepseek-v3": 671.0, "gpt-oss-120b": 116.8, "llama-4-scout": 107.8}


def _keys_spec_reads() -> set[str]:
    tree = ast.parse(Path(spec_module.__file__).read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


@pytest.mark.parametrize("entry", catalog_entries(), ids=lambda e: e.name)
def test_every_entry_loads_under_its_hugging_face_id(entry):
    m = load_catalog_spec(entry.name)
    assert m.name == entry.hf_id and m.num_params > 0 and m.max_context_tokens > 0
    if entry.name in PUBLISHED_B:
        assert m.num_params / 1e9 == pytest.approx(PUBLISHED_B[entry.name], rel=0.01)


@pytest.mark.parametrize("entry", catalog_entries(), ids=lambda e: e.name)
def test_entries_hold_only_fields_the_model_spec_reads(entry):
    cfg = json.loads(entry.path.read_text())
    reads = _keys_spec_reads() | {"architectures", "text_config", "quantization_config", "rope_scaling"}
    text = cfg.get("text_config", {})
    assert set(cfg) <= reads and set(text) <= reads, set(cfg) - reads or set(text) - reads


def test_the_catalog_folder_holds_exactly_the_entries():
    files = {p.name for p in CATALOG_DIR.glob("*.json")}
    assert files == {e.path.name for e in catalog_entries()} and len(files) == len(CATALOG)


def test_names_and_ids_resolve_case_insensitively_and_paths_win(tmp_path):
    assert catalog_path("LLAMA-3.1-70B") == catalog_path("meta-llama/meta-llama-3.1-70b")
    assert find_catalog_entry("nope") is None
    own = tmp_path / "llama-3.1-70b"  # a folder named like a catalog model is the user's, not the catalog's
    own.mkdir()
    assert resolve_model_config(str(own)) == own
    assert resolve_model_config("qwen3-8b") == catalog_path("Qwen/Qwen3-8B")


def test_an_unknown_name_is_an_error_that_suggests_close_names():
    with pytest.raises(ModelConfigError, match=r"not a catalog model; did you mean llama-3\.1-8b"):
        resolve_model_config("llama-3.1-8")


def test_the_hubs_current_and_instruct_ids_stand_for_their_catalog_model():
    from runtime.modelfiles.catalog import HUB_ALIASES

    assert catalog_path("meta-llama/Llama-3.1-70B") == catalog_path("llama-3.1-70b")  # the repo's name today
    assert catalog_path("meta-llama/Llama-3.1-8B-Instruct") == catalog_path("llama-3.1-8b")
    assert all(short in CATALOG for short in HUB_ALIASES.values())
    # suggestions are spelled as the Hub spells them (ids are case-sensitive there)
    with pytest.raises(ModelConfigError, match=r"did you mean .*meta-llama/Llama-3\.1-70B"):
        resolve_model_config("meta-llama/Llama-3.1-70")


def test_the_fp8_checkpoint_is_tuned_at_fp8_by_default():
    from runtime.modelfiles.load import checkpoint_precision

    assert checkpoint_precision(load_catalog_spec("llama-3.1-70b-fp8")) == "fp8"
    assert checkpoint_precision(load_catalog_spec("llama-3.1-70b")) == "bf16"


def test_pdserve_models_lists_every_name_and_id():
    res = runner.invoke(app, ["models"])
    assert res.exit_code == 0, res.output
    for name, hf_id in CATALOG.items():
        assert name in res.output and hf_id in res.output


def test_pdserve_tune_takes_a_catalog_name(tmp_path):
    out = tmp_path / "spec.json"
    res = runner.invoke(app, ["tune", "llama-3.1-8b", "--isl", "1000", "--osl", "100", "--out", str(out)])
    assert res.exit_code == 0, res.output
    spec = DeploymentSpec.model_validate_json(out.read_text())
    assert spec.model.name == "meta-llama/Meta-Llama-3.1-8B" and spec.workload.isl_tokens == 1000
    assert "catalog model" in " ".join(res.output.split())  # no folder to serve from: said, not silent


def test_pdserve_tune_refuses_an_unknown_model_naming_close_ones(tmp_path):
    res = runner.invoke(app, ["tune", "mixtral-8x8b", "--out", str(tmp_path / "s.json")])
    assert res.exit_code == 2  # a bad value (tests/unit/test_cli_exit_codes.py)
    assert "did you mean mixtral-8x7b" in " ".join(res.output.split())
    assert not (tmp_path / "s.json").exists()
