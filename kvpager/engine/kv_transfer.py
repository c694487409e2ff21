"""Engine-side KV packs and transfer: export a prompt's full blocks, import a payload, pin packs.

The K/V an export needs is computed by the engine's one scheduler (a prefill-only request, see
`Engine.export_kv`); this module only encodes the blocks it is given and inserts decoded ones.

The bytes are the KV pack format (`kvpager.kvstore.pack`, docs/kv-pack-format.md) whether they go to a
file (`kvpager kv save`), over HTTP (`/v1/kv/export`, `/v1/kv/import`) or are pinned at start
(`--kv-pack`). Every import checks the model facts and fingerprint (a mismatch names the field),
and that each block hash equals the hash recomputed from the pack's token ids with this engine's
fingerprint, so a block can only ever land under the key of the tokens it was computed for.
NOTE: not thread-safe; call between engine steps, on the engine's thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpager.core.hashing import BlockHash, hash_prompt_blocks
from kvpager.core.kv_cache_manager import KVCacheManager
from kvpager.kvstore.block_io import BlockIO
from kvpager.kvstore.offload import MoveCounters, TieredBlockStore
from kvpager.kvstore.pack import (
    Pack,
    PackExpectation,
    PackHeader,
    decode_payload,
    encode_payload,
    read_pack,
    regular_file_size,
)


@dataclass(frozen=True)
class PackSource:
    """`BlockSource` over the decoded blocks of a pack (loads always succeed).

    `store` is the engine's tier store: a fresh block may still be copying out the K/V it held
    before it was evicted, so each write waits for the copy-outs first.
    """

    blocks: dict[BlockHash, torch.Tensor]
    io: BlockIO
    store: TieredBlockStore | None = None

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.blocks

    def load_into(self, block_hash: BlockHash, block_id: int) -> bool:
        if self.store is not None:
            self.store.wait_for_copies()
        self.io.write_block(block_id, self.blocks[block_hash])
        return True


class KVPoolBusyError(ValueError):
    """The KV pool has no free blocks for an export's prefill right now; retry later (HTTP 503)."""


class KVTransfer:
    """Moves whole prefixes of KV blocks in and out of one engine's prefix cache."""

    def __init__(
        self,
        kv_manager: KVCacheManager,
        io: BlockIO,
        expectation: PackExpectation,
        store: TieredBlockStore | None = None,
    ) -> None:
        self.kv_manager = kv_manager
        self.io = io
        self.expectation = expectation
        self.seed = bytes.fromhex(expectation.model_fingerprint)
        self.block_size = expectation.model.block_size
        self.store = store
        self.exported = MoveCounters()
        self.imported = MoveCounters()
        self.pinned_block_ids: list[int] = []

    def check_exportable(self, token_ids: Sequence[int]) -> int:
        """The number of full blocks of `token_ids`; ValueError when there is none."""
        num_full = len(token_ids) // self.block_size
        if num_full == 0:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, fewer than one KV block of {self.block_size}; "
                "nothing to export"
            )
        return num_full

    def export(self, token_ids: Sequence[int], block_ids: Sequence[int], codec: str = "lossless") -> bytes:
        """Pack bytes of the full blocks of `token_ids`, whose K/V is in device blocks `block_ids`."""
        start = time.perf_counter()
        num_full = self.check_exportable(token_ids)
        header = PackHeader(self.expectation.model_fingerprint, self.expectation.model, tuple(token_ids))
        hashes = hash_prompt_blocks(self.seed, token_ids, self.block_size)
        blocks = [(h, self.io.read_block(b)) for h, b in zip(hashes, block_ids, strict=True)]
        data = encode_payload(header, blocks, codec)
        self._count(self.exported, num_full, len(data), start)
        return data

    def import_payload(self, data: bytes, max_bytes: int | None = None) -> int:
        """Put a pack payload's blocks into the prefix cache; returns how many were imported.

        Blocks that do not fit in the device pool go to the KV tiers when there are tiers.
        ValueError (nothing imported) on oversize, corruption, another model, or forged hashes.
        """
        start = time.perf_counter()
        return self.insert_payload(self.decode_payload(data, max_bytes), len(data), start)

    def decode_payload(self, data: bytes, max_bytes: int | None = None) -> Pack:
        """Check and decode a payload without touching the engine (safe on any thread).

        ValueError (nothing imported) on oversize, corruption, another model, forged hashes, NaN/Inf
        values, or more token ids than the engine's max_model_len.
        """
        pack = decode_payload(data, self.expectation, max_bytes, device="cpu", source="payload")
        self.check_hashes(pack, "payload")
        return pack

    def insert_payload(self, pack: Pack, num_bytes: int, start: float | None = None) -> int:
        """Put a decoded payload's blocks into the prefix cache (engine thread); returns how many."""
        start = time.perf_counter() if start is None else start
        data_len = num_bytes
        num_imported = len(self._insert(pack, pin=False))
        if self.store is not None:
            for block_hash, block in pack.blocks[num_imported:]:
                self.store.put(block_hash, block)
            num_imported = len(pack.blocks)
        self._count(self.imported, num_imported, data_len, start)
        return num_imported

    def load_pack(self, path: str | os.PathLike[str]) -> int:
        """Load a pack file and pin its blocks in the prefix cache; returns the number of blocks pinned."""
        start = time.perf_counter()
        pack = read_pack(path, self.expectation)
        self.check_hashes(pack, f"pack {path}")
        block_ids = self._insert(pack, pin=True)
        if len(block_ids) < len(pack.blocks):
            self.kv_manager.block_pool.unpin(block_ids)
            raise ValueError(
                f"KV pack {path} has {len(pack.blocks)} blocks but the KV pool had room for {len(block_ids)}; "
                "give the pool more memory (--kv-cache-memory) or load fewer packs"
            )
        self.pinned_block_ids.extend(block_ids)
        self._count(self.imported, len(block_ids), regular_file_size(path), start)
        return len(block_ids)

    def check_hashes(self, pack: Pack, source: str) -> None:
        """ValueError unless every block hash is the hash of its tokens under this engine's fingerprint."""
        expected = hash_prompt_blocks(self.seed, pack.header.token_ids, self.block_size)
        for index, block_hash in enumerate(pack.block_hashes):
            if index >= len(expected) or block_hash != expected[index]:
                raise ValueError(
                    f"KV {source}: block {index}'s hash is not the hash of its token ids under this model's "
                    "fingerprint; the pack is inconsistent and is refused"
                )

    def _insert(self, pack: Pack, *, pin: bool) -> list[int]:
        source = PackSource(dict(pack.blocks), self.io, self.store)
        return self.kv_manager.insert_blocks(pack.block_hashes, source, pin=pin)

    def _count(self, counters: MoveCounters, num_blocks: int, num_bytes: int, start: float) -> None:
        counters.blocks += num_blocks
        counters.bytes += num_bytes
        counters.seconds += time.perf_counter() - start
