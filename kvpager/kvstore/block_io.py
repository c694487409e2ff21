"""How the KV store layer reads and writes blocks of the device KV pool (the `ModelRunner` does it).

`read_block` returns a view of the pool, which the next forward writing into that block changes;
whatever keeps a block past that point (the tiers' copy-out, the remote publisher) takes a host
copy with `host_copy`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class BlockReader(Protocol):
    """Reads one block of the device KV pool."""

    def read_block(self, block_id: int) -> torch.Tensor: ...


class BlockIO(BlockReader, Protocol):
    """Reads and writes one block of the device KV pool."""

    def write_block(self, block_id: int, block: torch.Tensor) -> None: ...


def host_copy(io: BlockReader, block_id: int) -> torch.Tensor:
    """A host (CPU) copy of device block `block_id`, independent of the pool (always a copy, also on CPU)."""
    return io.read_block(block_id).to("cpu", copy=True)
