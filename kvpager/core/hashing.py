"""Content-addressed block hashes: the portable key of a full KV block. Torch-free.

A full block's hash is ``sha256(parent_hash || token ids as little-endian uint32 || extra)``. The
chain starts at the model fingerprint, so a block persisted to disk or shipped to another engine can
only ever match the same weights, dtype, block size and tokenizer. Nothing here uses Python's
``hash()``: the bytes are identical in every process and on every machine.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
RequestId = NewType("RequestId", str)

# NOTE: bumping this string invalidates every persisted block hash (it is part of the fingerprint).
HASH_SCHEME = "kvpager-block-hash-v1"
MAX_TOKEN_ID = 2**32 - 1


FingerprintComponent = tuple[str, str]  # (name, value): one thing the KV contents depend on


def model_fingerprint(components: Sequence[FingerprintComponent]) -> bytes:
    """The root of every block-hash chain: sha256 over the named components (order does not matter;
    each name at most once). Blocks, packs and disk records match only under the same fingerprint.

    The engine's components are kvpager.engine.loading.base_fingerprint_components (architecture,
    config, weights, dtypes, block size, tokenizer; a loader may append its own)."""
    names = [name for name, _ in components]
    if len(set(names)) != len(names):
        raise ValueError(f"fingerprint components must have distinct names, got {names}")
    fields = {"scheme": HASH_SCHEME, "components": {name: str(value) for name, value in components}}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")).digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as fixed-width little-endian uint32 bytes; ValueError for ids outside [0, 2**32)."""
    for token_id in token_ids:
        if not 0 <= token_id <= MAX_TOKEN_ID:
            raise ValueError(f"token id {token_id} is out of range: token ids must be in [0, {MAX_TOKEN_ID}]")
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one block given its parent's hash (or the model fingerprint for the first block).

    NOTE: the encoding has no length fields. It is unambiguous because the parent is a 32-byte digest
    and every hashed block holds exactly `block_size` tokens (block size is in the fingerprint).
    """
    digest = hashlib.sha256()
    digest.update(parent)
    digest.update(token_bytes(token_ids))
    digest.update(extra)
    return BlockHash(digest.digest())


def extend_block_hashes(
    seed: bytes, hashes: list[BlockHash], token_ids: Sequence[int], block_size: int
) -> list[BlockHash]:
    """Append to `hashes` (the chain so far for `token_ids`) the hashes of newly full blocks.

    Returns `hashes`, mutated in place, so callers can keep one growing chain per sequence.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else seed
        hashes.append(hash_block(parent, token_ids[index * block_size : (index + 1) * block_size]))
    return hashes


def hash_prompt_blocks(seed: bytes, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, chained from `seed`; a partial tail is not hashed."""
    return extend_block_hashes(seed, [], token_ids, block_size)
