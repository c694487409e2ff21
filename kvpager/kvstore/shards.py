"""Which KV heads of a block each tensor-parallel rank holds, and whole blocks from (and to) shards.

Under `--tensor-parallel-size N` rank r's pool holds KV heads [first, first + count) of every block
(`core/tensor_parallel.py`): split evenly when N divides the KV heads, replicated when there are
fewer KV heads than ranks (several ranks then hold the same head). A `KVShard` names that range.

- The shared store keys a shard record by it (`remote.py`): a record holds exactly the K/V of the
  heads its key names, so ranks holding the same heads (replicated KV heads) share one record, written
  by the lowest of them (`writes_shard`), and a shard holding every head (TP=1, or one KV head
  replicated on every rank) is the whole block under the TP=1 key.
- A shard record's checksummed header carries a fingerprint bound to the head range
  (`record_fingerprint`), so a record copied under another shard's key fails its check.
- KV packs hold whole blocks whatever the layout: `assemble` joins the ranks' shards (gathered to
  rank 0) into whole blocks, `split` takes a rank's heads out of a whole block.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvpager.core.tensor_parallel import TensorParallelLayout

HEAD_DIM_AXIS = -2  # [..., block_size, num_kv_heads, head_dim]


@dataclass(frozen=True, slots=True)
class KVShard:
    """KV heads [first, first + count) of the model's `total`."""

    first: int
    count: int
    total: int

    def __post_init__(self) -> None:
        if not (0 <= self.first and 1 <= self.count and self.first + self.count <= self.total):
            raise ValueError(f"KV heads [{self.first}, {self.first + self.count}) are not within 0..{self.total}")

    @property
    def is_whole(self) -> bool:
        return self.count == self.total

    @property
    def tag(self) -> str:
        """What the shard adds to a store key: "" for the whole block, else e.g. "kvh1-2of2"."""
        return "" if self.is_whole else f"kvh{self.first}-{self.first + self.count}of{self.total}"

    def record_fingerprint(self, fingerprint: bytes) -> bytes:
        """The fingerprint a shard record carries: the model's for a whole block, else bound to the heads."""
        if self.is_whole:
            return fingerprint
        return hashlib.sha256(fingerprint + b"\x00kv-heads:" + self.tag.encode()).digest()


def shard_of(layout: TensorParallelLayout, rank: int) -> KVShard:
    return KVShard(layout.kv_head_start(rank), layout.kv_heads_per_rank, layout.num_kv_heads)


def distinct_ranks(layout: TensorParallelLayout) -> list[int]:
    """The first rank holding each distinct head range, in head order (every head exactly once)."""
    seen: dict[KVShard, int] = {}
    for rank in range(layout.world_size):
        seen.setdefault(shard_of(layout, rank), rank)
    return [rank for shard, rank in sorted(seen.items(), key=lambda item: item[0].first)]


def distinct_shards(layout: TensorParallelLayout) -> tuple[KVShard, ...]:
    """Every distinct head range, in head order: what a block needs to be whole."""
    return tuple(shard_of(layout, rank) for rank in distinct_ranks(layout))


def writes_shard(layout: TensorParallelLayout, rank: int) -> bool:
    """Whether `rank` writes its shard to the shared store (the lowest rank holding its heads does)."""
    return rank in distinct_ranks(layout)


def assemble(layout: TensorParallelLayout, shards: list[torch.Tensor]) -> torch.Tensor:
    """Whole blocks from every rank's shards ([..., heads here, head_dim] each, in rank order)."""
    return torch.cat([shards[rank] for rank in distinct_ranks(layout)], dim=HEAD_DIM_AXIS)


def split(layout: TensorParallelLayout, rank: int, whole: torch.Tensor) -> torch.Tensor:
    """`rank`'s heads of whole blocks ([..., num_kv_heads, head_dim]): a view."""
    shard = shard_of(layout, rank)
    if whole.shape[HEAD_DIM_AXIS] != shard.total:
        raise ValueError(f"a whole block has {shard.total} KV heads, got {whole.shape[HEAD_DIM_AXIS]}")
    return whole.narrow(HEAD_DIM_AXIS, shard.first, shard.count)
