"""Specification: object keys that could escape the model folder are refused, naming the key;
file selection takes safetensors + config + tokenizer by default and drops duplicate .bin weights."""

from __future__ import annotations

import pytest

from runtime.staging.keys import UnsafeKeyError, relative_path, select_paths
from runtime.staging.manifest import StagingError


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("models/m/../../etc/passwd", "'..'"),
        ("models/m/..", "'..'"),
        ("models/m/./config.json", "'.'"),
        ("models/m//etc/passwd", "absolute"),
        ("models/m/a\\..\\b", "backslash"),
        ("models/m/nul\x00.safetensors", "NUL"),
        ("models/m/a//b", "empty path segment"),
        ("models/m/.pdserve-staged.json", "reserved"),
        ("models/m/.pdserve-staged.json.tmp", "reserved"),
        ("models/m/.pdserve-journal/verified.jsonl", "reserved"),
        ("models/m/.pdserve-journal/x.safetensors", "reserved"),
        ("models/m/sub/w.safetensors.pdserve-part", "reserved"),
        ("other/config.json", "not under prefix"),
    ],
)
def test_unsafe_keys_are_rejected_with_the_key_in_the_message(key: str, reason: str) -> None:
    with pytest.raises(UnsafeKeyError) as exc:
        relative_path(key, "models/m/")
    assert repr(key) in str(exc.value)
    assert reason in str(exc.value)
    assert isinstance(exc.value, StagingError)


@pytest.mark.parametrize(
    ("key", "rel"),
    [
        ("models/m/config.json", "config.json"),
        ("models/m/sub/dir/model-00001-of-00002.safetensors", "sub/dir/model-00001-of-00002.safetensors"),
        ("models/m/..hidden", "..hidden"),  # a name starting with dots is not a parent reference
    ],
)
def test_safe_keys_map_to_relative_paths(key: str, rel: str) -> None:
    assert relative_path(key, "models/m/") == rel


HF_REPO = [
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "consolidated.pth",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
    "original/params.json",
    ".gitattributes",
]


def test_default_selection_takes_safetensors_config_tokenizer_and_skips_duplicate_bin() -> None:
    assert select_paths(HF_REPO) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_bin_weights_are_taken_when_no_safetensors_exist() -> None:
    repo = ["config.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "tokenizer.json"]
    assert select_paths(repo) == sorted(repo)


def test_include_and_exclude_globs() -> None:
    assert select_paths(HF_REPO, include=["*"], exclude=["*.md", ".git*", "original/*"], prefer_safetensors=False) == sorted(
        p for p in HF_REPO if p not in ("README.md", ".gitattributes", "original/params.json")
    )
    assert select_paths(HF_REPO, include=["original/*.json"]) == ["original/params.json"]
    assert select_paths(HF_REPO, include=["*.safetensors"], exclude=["model-00002-*"]) == ["model-00001-of-00002.safetensors"]
