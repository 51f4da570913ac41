"""The budget decode workers give a chat request that names none (runtime.server.generation_defaults).

Specification: read once at start-up from the folder the workers load, as vLLM 0.28 with its default
`--generation-config auto` reads it: generation_config.json's `max_new_tokens`, or, only where that file is
missing, config.json's (top level, else its decoder / text sub-config); None where the workers give the context
left (no `max_new_tokens`) and where it is not known here (no folder, an unreadable file or value, worker
arguments that move or override the generation config).
"""

from __future__ import annotations

import json

import pytest

from runtime.server.generation_defaults import chat_default_max_tokens, names_generation_flag


def _write(folder, name: str, data) -> None:
    (folder / name).write_text(json.dumps(data) if not isinstance(data, str) else data)


def test_the_generation_configs_max_new_tokens_is_the_default(tmp_path):
    _write(tmp_path, "generation_config.json", {"max_new_tokens": 256, "temperature": 0.6})
    _write(tmp_path, "config.json", {"max_new_tokens": 9})  # not read: the generation config is there
    assert chat_default_max_tokens(tmp_path) == 256
    assert chat_default_max_tokens(tmp_path, ["--max-num-seqs", "8", "--enforce-eager"]) == 256


@pytest.mark.parametrize("files", [
    {},                                                                  # an empty folder
    {"generation_config.json": {"temperature": 0.6, "max_length": 50}},  # vLLM reads max_new_tokens only
    {"generation_config.json": {"max_new_tokens": None}},
    {"generation_config.json": {}, "config.json": {"max_new_tokens": 9}},  # config.json only without the file
    {"config.json": {"hidden_size": 64}},
])
def test_a_model_without_max_new_tokens_has_no_default(tmp_path, files):
    for name, data in files.items():
        _write(tmp_path, name, data)
    assert chat_default_max_tokens(tmp_path) is None


@pytest.mark.parametrize("config", [{"max_new_tokens": 12}, {"text_config": {"max_new_tokens": 12}}])
def test_without_a_generation_config_the_model_configs_generation_fields_count(tmp_path, config):
    # vLLM falls back to transformers' GenerationConfig.from_model_config(config.json)
    _write(tmp_path, "config.json", {"hidden_size": 64, **config})
    assert chat_default_max_tokens(tmp_path) == 12


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"max_new_tokens": 0}', '{"max_new_tokens": "64"}',
                                  '{"max_new_tokens": true}', '{"max_new_tokens": 1.5}'])
def test_a_file_or_value_vllm_would_not_read_as_a_budget_is_not_known(tmp_path, text):
    _write(tmp_path, "generation_config.json", text)
    assert chat_default_max_tokens(tmp_path) is None


def test_no_folder_is_not_known():
    assert chat_default_max_tokens(None) is None


@pytest.mark.parametrize("args", [
    ["--generation-config", "vllm"], ["--generation-config=/other"], ["--generation_config", "vllm"],
    ["--generation-conf", "vllm"],  # argparse takes an unambiguous abbreviation
    ["--override-generation-config", '{"max_new_tokens": 5}'], ["--override-generation-config.max_new_tokens=5"],
    ["--hf-config-path", "/other"], ["--config", "serve.yaml"],
])
def test_worker_arguments_that_move_or_override_the_generation_config_make_it_unknown(tmp_path, args):
    _write(tmp_path, "generation_config.json", {"max_new_tokens": 256})
    assert names_generation_flag(args)
    assert chat_default_max_tokens(tmp_path, ["--max-num-seqs", "8", *args]) is None


def test_other_worker_arguments_name_no_generation_flag():
    assert not names_generation_flag(["--config-format", "hf", "--hf-token", "x", "--max-model-len", "4096", "-O3"])


# --- where the runtime learns it: its command line, and the local launcher's ---------------------------------

BASE = ["--model-name", "m", "--decode-url", "http://127.0.0.1:1"]


def test_the_runtime_reads_the_folder_the_workers_load_with_the_specs_worker_arguments(tmp_path, monkeypatch):
    from runtime.config import DeploymentSpec, EngineSpec, ModelRef
    from runtime.server.__main__ import SPEC_ENV, chat_default_budget, parse_args

    monkeypatch.delenv(SPEC_ENV, raising=False)
    _write(tmp_path, "generation_config.json", {"max_new_tokens": 256})
    assert chat_default_budget(parse_args([*BASE, "--model-dir", str(tmp_path)])) == 256
    # a tokenizer folder need not hold the workers' generation config
    assert chat_default_budget(parse_args([*BASE, "--tokenizer-dir", str(tmp_path)])) is None
    spec = DeploymentSpec(model=ModelRef(name="m"), engine=EngineSpec(extra_args=["--max-num-seqs", "8"]))
    assert chat_default_budget(parse_args([*BASE, "--model-dir", str(tmp_path), "--deployment-spec",
                                           spec.model_dump_json()])) == 256
    spec = DeploymentSpec(model=ModelRef(name="m"), engine=EngineSpec(extra_args=["--generation-config", "vllm"]))
    monkeypatch.setenv(SPEC_ENV, spec.model_dump_json())  # as the rendered KServe runtime gets it
    assert chat_default_budget(parse_args([*BASE, "--model-dir", str(tmp_path)])) is None


def test_the_local_launcher_points_the_runtime_at_the_workers_folder_unless_their_flags_move_its_config(tmp_path):
    from runtime.config import DeploymentSpec, EngineSpec, ModelRef
    from runtime.server.launch import LocalDeployment

    def model_dirs(extra_args: list[str]) -> list[str]:
        spec = DeploymentSpec(model=ModelRef(name="m"), engine=EngineSpec(extra_args=extra_args))
        args = LocalDeployment(spec, tmp_path, log_dir=tmp_path).runtime.args
        return [args[i + 1] for i, a in enumerate(args) if a == "--model-dir"]

    assert model_dirs([]) == [str(tmp_path)]
    assert model_dirs(["--override-generation-config", '{"max_new_tokens": 5}']) == []
