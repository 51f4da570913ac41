"""Adapter: the built-in model catalog (package data under ``runtime/modelfiles/catalog/``).

Each entry is a Hugging Face ``config.json`` reduced to the fields :class:`~runtime.models.spec.ModelSpec`
reads (``catalog/README.md`` gives the sources). A catalog name (``llama-3.1-70b``) or the Hugging Face id
(``meta-llama/Meta-Llama-3.1-70B``) stands for the model's config wherever a command takes a model: users can
size a deployment before they have downloaded anything, and the tests need no data from outside the project.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from runtime.models.spec import ModelConfigError, ModelSpec

CATALOG_DIR = Path(__file__).resolve().parent / "catalog"

# catalog name -> Hugging Face id; the file is CATALOG_DIR / "<org>--<model>_config.json"
CATALOG: dict[str, str] = {
    "llama-3.1-8b": "meta-llama/Meta-Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Meta-Llama-3.1-70B",
    "llama-3.1-70b-fp8": "nvidia/Llama-3.1-70B-Instruct-FP8",
    "llama-3.1-405b": "meta-llama/Meta-Llama-3.1-405B",
    "llama-4-scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "llama-4-maverick": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "mixtral-8x22b": "mistralai/Mixtral-8x22B-v0.1",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "deepseek-r1": "deepseek-ai/DeepSeek-R1",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b",
}


# Hugging Face ids that stand for a catalog model: the Hub's current names of renamed repos (meta-llama's
# Meta-Llama-3.1-* are Llama-3.1-* today, the old names redirect) and the instruct or refreshed releases whose
# config.json has the catalog model's architecture (they differ in weights and generation settings only)
HUB_ALIASES: dict[str, str] = {
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Llama-3.1-70B": "llama-3.1-70b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Meta-Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Llama-3.1-405B": "llama-3.1-405b",
    "meta-llama/Llama-3.1-405B-Instruct": "llama-3.1-405b",
    "meta-llama/Meta-Llama-3.1-405B-Instruct": "llama-3.1-405b",
    "mistralai/Mistral-7B-Instruct-v0.1": "mistral-7b",
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b",
    "mistralai/Mixtral-8x22B-Instruct-v0.1": "mixtral-8x22b",
    "deepseek-ai/DeepSeek-V3-0324": "deepseek-v3",
    "deepseek-ai/DeepSeek-R1-0528": "deepseek-r1",
}


@dataclass(frozen=True)
class CatalogEntry:
    """One catalog model: its short ``name``, Hugging Face ``hf_id`` and the ``path`` of its config file."""

    name: str
    hf_id: str
    path: Path


def _entry(name: str) -> CatalogEntry:
    hf_id = CATALOG[name]
    return CatalogEntry(name, hf_id, CATALOG_DIR / f"{hf_id.replace('/', '--')}_config.json")


def catalog_entries() -> list[CatalogEntry]:
    """Every catalog model, in catalog order."""
    return [_entry(n) for n in CATALOG]


def find_catalog_entry(name: str) -> CatalogEntry | None:
    """The entry whose catalog name or Hugging Face id (``CATALOG``, ``HUB_ALIASES``) is ``name``
    (case-insensitive), else None."""
    key = name.strip().lower()
    for short, hf_id in CATALOG.items():
        if key in (short, hf_id.lower()):
            return _entry(short)
    for hf_id, short in HUB_ALIASES.items():
        if key == hf_id.lower():
            return _entry(short)
    return None


def catalog_path(name: str) -> Path:
    """The config file of catalog model ``name`` (catalog name or Hugging Face id).

    Raises:
        ModelConfigError: ``name`` is not in the catalog; the message suggests the closest names.
    """
    entry = find_catalog_entry(name)
    if entry is None:
        raise ModelConfigError(_unknown(name))
    return entry.path


def resolve_model_config(model: str | Path) -> Path:
    """Where the config of ``model`` lives: an existing file or folder as given, else the catalog's file.

    Args:
        model: a ``config.json`` path, a model folder holding one, a catalog name (``llama-3.1-70b``) or a
            Hugging Face id in the catalog (``meta-llama/Meta-Llama-3.1-70B``).

    Raises:
        ModelConfigError: neither an existing path nor a catalog model; the message says both were tried and
            suggests the closest catalog names.
    """
    path = Path(model)
    if path.exists():
        return path
    entry = find_catalog_entry(str(model))
    if entry is None:
        raise ModelConfigError(f"{model}: no such file or folder, and " + _unknown(str(model)))
    return entry.path


def load_catalog_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of catalog model ``name``, named by its Hugging Face id.

    Raises:
        ModelConfigError: ``name`` is not in the catalog.
    """
    from runtime.modelfiles.load import load_model_spec

    return load_model_spec(catalog_path(name))


def _unknown(name: str) -> str:
    choices = list(CATALOG) + list(CATALOG.values()) + list(HUB_ALIASES)
    spelled = {c.lower(): c for c in choices}  # suggested as spelled: Hub ids are case-sensitive
    close = difflib.get_close_matches(name.strip().lower(), list(spelled), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(spelled[c] for c in close)}?" if close else ""
    return f"{name!r} is not a catalog model{hint} (`pdserve models` lists the catalog)"
