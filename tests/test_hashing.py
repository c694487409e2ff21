"""Block hashes: portable bytes, chained from the model fingerprint, independent of the process."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import kvpager
from kvpager.core.hashing import hash_block, hash_prompt_blocks, model_fingerprint, token_bytes


def components(
    architecture: str = "LlamaForCausalLM",
    weights: str = "w" * 64,
    dtype: str = "float32",
    block_size: int = 4,
    tokenizer: str = "t" * 64,
) -> list[tuple[str, str]]:
    """Fingerprint components of the form the engine uses (kvpager.engine.loading)."""
    return [
        ("architecture", architecture),
        ("weights", weights),
        ("kv_cache_dtype", dtype),
        ("block_size", str(block_size)),
        ("tokenizer", tokenizer),
    ]


SEED = model_fingerprint(components())


def test_hash_block_is_sha256_of_parent_tokens_and_extra() -> None:
    expected = hashlib.sha256(SEED + struct.pack("<3I", 1, 2, 70000) + b"lora").digest()
    assert hash_block(SEED, [1, 2, 70000], extra=b"lora") == expected


def test_token_bytes_are_fixed_width_little_endian() -> None:
    assert token_bytes([1, 256, 2**32 - 1]) == b"\x01\x00\x00\x00\x00\x01\x00\x00\xff\xff\xff\xff"


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_ids_outside_uint32_are_rejected(bad: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        hash_block(SEED, [0, bad])


def test_prompt_hashes_chain_over_full_blocks_only() -> None:
    tokens = list(range(10))  # block size 4: two full blocks, a partial tail of 2
    hashes = hash_prompt_blocks(SEED, tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(SEED, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])


def test_same_block_with_different_prefix_hashes_differently() -> None:
    a = hash_prompt_blocks(SEED, [9, 9, 9, 9, 5, 5, 5, 5], 4)
    b = hash_prompt_blocks(SEED, [8, 9, 9, 9, 5, 5, 5, 5], 4)
    assert a[0] != b[0]
    assert a[1] != b[1]  # identical tokens, different parent


def test_fingerprint_changes_with_every_field() -> None:
    base = components("LlamaForCausalLM", "w1", "float32", 16, "tok1")
    variants = [
        components("Qwen2ForCausalLM", "w1", "float32", 16, "tok1"),
        components("LlamaForCausalLM", "w2", "float32", 16, "tok1"),
        components("LlamaForCausalLM", "w1", "bfloat16", 16, "tok1"),
        components("LlamaForCausalLM", "w1", "float32", 32, "tok1"),
        components("LlamaForCausalLM", "w1", "float32", 16, "tok2"),
    ]
    digests = {model_fingerprint(base)} | {model_fingerprint(v) for v in variants}
    assert len(digests) == 6
    assert len(model_fingerprint(base)) == 32
    assert model_fingerprint(list(reversed(base))) == model_fingerprint(base)  # order does not matter
    with pytest.raises(ValueError, match="distinct names"):
        model_fingerprint([*base, base[0]])


def test_hashes_are_identical_in_another_process() -> None:
    code = (
        "from kvpager.core.hashing import hash_prompt_blocks, model_fingerprint;"
        f"s = model_fingerprint({components()!r});"
        "print(hash_prompt_blocks(s, list(range(12)), 4)[-1].hex())"
    )
    # the tree under test, not whichever kvpager the interpreter would find by itself
    env = {"PYTHONHASHSEED": "12345", "PATH": "", "PYTHONPATH": str(Path(kvpager.__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == hash_prompt_blocks(SEED, list(range(12)), 4)[-1].hex()


def test_hashing_does_not_import_torch() -> None:
    code = "import sys, kvpager.core.scheduler, kvpager.core.kv_cache_manager; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
