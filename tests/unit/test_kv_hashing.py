"""Chained block hashes: only full blocks, prefix property, chaining, and independence of PYTHONHASHSEED."""

import os
import subprocess
import sys

import pytest

from runtime.kv.hashing import ROOT_HASH, block_hashes, num_full_blocks


def test_only_full_blocks_get_hashes():
    assert len(block_hashes(list(range(35)), 16)) == 2
    assert len(block_hashes(list(range(32)), 16)) == 2
    assert block_hashes(list(range(15)), 16) == []
    assert num_full_blocks(35, 16) == 2 and num_full_blocks(0, 16) == 0


def test_first_block_hash_is_hash_of_root_and_tokens():
    toks = list(range(100, 116))
    assert block_hashes(toks, 16) == [hash((ROOT_HASH, tuple(toks)))]


def test_equal_prefixes_give_equal_hashes_and_a_longer_prompt_extends_them():
    a = list(range(64))
    b = a + [7] * 40
    assert block_hashes(b, 16)[:4] == block_hashes(a, 16)


def test_same_block_after_a_different_prefix_hashes_differently():
    blk = [5] * 16
    h1 = block_hashes([1] * 16 + blk, 16)
    h2 = block_hashes([2] * 16 + blk, 16)
    assert h1[1] != h2[1]


def test_continuing_from_a_parent_equals_hashing_the_whole_sequence():
    toks = list(range(64))
    first = block_hashes(toks[:32], 16)
    rest = block_hashes(toks[32:], 16, parent_hash=first[-1])
    assert first + rest == block_hashes(toks, 16)


def test_non_positive_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size_tokens"):
        block_hashes([1, 2, 3], 0)


def test_hashes_do_not_depend_on_pythonhashseed():
    code = "from runtime.kv.hashing import block_hashes; print(block_hashes(list(range(48)), 16))"
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == str(block_hashes(list(range(48)), 16))


def test_request_extra_keys_salt_only_the_first_block_like_vllm():
    from runtime.kv.hashing import request_extra_keys

    assert request_extra_keys(3, "s") == [("s",), None, None]
    assert request_extra_keys(3, None) is None and request_extra_keys(3, "") is None
    assert request_extra_keys(0, "s") is None


def test_salting_the_first_block_changes_every_hash_of_the_chain():
    from runtime.kv.hashing import block_hashes, request_extra_keys

    tokens = list(range(64))
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, extra_keys=request_extra_keys(4, "s"))
    assert len(salted) == 4 and all(a != b for a, b in zip(plain, salted))
    assert salted == block_hashes(tokens, 16, extra_keys=[["s"], None, None, None])  # as msgpack decodes it
    assert salted != block_hashes(tokens, 16, extra_keys=request_extra_keys(4, "t"))
