"""Chained KV-block hashes over token ids (pure).

A prompt of ``n`` tokens covers ``n // block_size_tokens`` *full* KV blocks; only full blocks are cached
by vLLM's prefix cache (vLLM ``v1/core/kv_cache_utils.py: hash_request_tokens``), so a trailing partial
block never gets a hash. Block ``i``'s hash depends on block ``i-1``'s hash and on block ``i``'s token ids,
so equal hashes mean equal *prefixes*, not just equal blocks (the same chaining vLLM, SGLang and Dynamo use).

The router computes these hashes itself — both for incoming prompts and from the ``token_ids`` carried by
vLLM ``BlockStored`` events — instead of trusting the engine's hashes: vLLM seeds its hash with
``PYTHONHASHSEED``/a random value and may use sha256 or a builtin hash, so comparing engine hashes with
router-side hashes would silently zero every score when the seeds differ.

Hash function: CPython's ``hash()`` of a ``(parent_hash, tokens_tuple)`` tuple. For tuples of ints it is
deterministic (xxHash-style tuple combine over integer hashes; ``PYTHONHASHSEED`` only randomises
str/bytes), 64-bit, and ~40x faster than hashlib on 16-token blocks. Blocks with string extra keys (a
cache salt, a LoRA name) hash differently in each process (``PYTHONHASHSEED``), which is fine: the hashes
only need to agree inside one router process, so cryptographic strength is not needed; a collision would make the router
over-estimate one worker's overlap (a scoring error, never a correctness error in the engine).
"""

from __future__ import annotations

from collections.abc import Sequence

#: Parent hash of the first block of every sequence (any fixed int works; chosen to be non-zero).
ROOT_HASH = 0x9E3779B97F4A7C15


def _freeze(value: object) -> object:
    """Lists (as msgpack decodes tuples) → tuples, recursively, so that extra keys are hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def block_hashes(
    token_ids: Sequence[int], block_size_tokens: int, parent_hash: int | None = None,
    extra_keys: Sequence[object | None] | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``.

    Args:
        token_ids: prompt tokens, length ``n``.
        block_size_tokens: KV block size in tokens (vLLM ``--block-size``), > 0.
        parent_hash: hash of the block preceding ``token_ids[0]``; ``None`` = start of a sequence.
        extra_keys: optional per-block extra hash inputs (vLLM ``BlockStored.extra_keys``: cache salt,
            multimodal hashes, LoRA name); a block with a non-None entry hashes differently from the
            same tokens without it, so salted/multimodal blocks never match a plain-token prompt.

    Returns:
        ``n // block_size_tokens`` ints; element ``i`` identifies the prefix
        ``token_ids[: (i + 1) * block_size_tokens]`` (given the same ``parent_hash``).

    Raises:
        ValueError: when ``block_size_tokens`` is not positive.
    """
    if block_size_tokens <= 0:
        raise ValueError(f"block_size_tokens must be > 0, got {block_size_tokens}")
    parent = ROOT_HASH if parent_hash is None else parent_hash
    out: list[int] = []
    tokens = tuple(token_ids)
    for i, start in enumerate(range(0, len(tokens) - block_size_tokens + 1, block_size_tokens)):
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        if extra is None:
            parent = hash((parent, tokens[start : start + block_size_tokens]))
        else:
            parent = hash((parent, tokens[start : start + block_size_tokens], _freeze(extra)))
        out.append(parent)
    return out


def request_extra_keys(num_blocks: int, cache_salt: str | None = None) -> list[tuple[str, ...] | None] | None:
    """Per-block extra keys of a text prompt, as vLLM puts them in its ``BlockStored.extra_keys``.

    vLLM (``v1/core/kv_cache_utils.py: generate_block_hash_extra_keys``) salts only the *first* block of a
    prompt with the request's ``cache_salt`` (the chain carries it into every later block) and adds the
    LoRA name and multimodal hashes, which a text prompt to a worker without LoRA does not have. Hashing a
    prompt with these keys gives the hashes the router's index holds for the blocks that same request
    left on a worker (runtime.kv.apply hashes events with their ``extra_keys``); without them a salted
    prompt would match other tenants' unsalted blocks and never its own.

    Args:
        num_blocks: full blocks of the prompt (>= 0).
        cache_salt: the request's ``cache_salt`` (vLLM OpenAI API field; a non-empty string), or None.

    Returns:
        None when nothing is salted (plain hashing), else a list of ``num_blocks`` entries: ``(cache_salt,)``
        for block 0, None for the rest.
    """
    if not cache_salt or num_blocks <= 0:
        return None
    return [(cache_salt,)] + [None] * (num_blocks - 1)


def num_full_blocks(num_tokens: int, block_size_tokens: int) -> int:
    """Number of full KV blocks in ``num_tokens`` tokens (only full blocks are cached)."""
    if block_size_tokens <= 0:
        raise ValueError(f"block_size_tokens must be > 0, got {block_size_tokens}")
    return max(0, num_tokens) // block_size_tokens
