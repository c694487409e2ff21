"""Tensor-parallel layout: which heads, MLP columns and vocabulary rows each rank holds. Torch-free.

Megatron-style (as vLLM): attention heads and the MLP's intermediate features are split evenly over
the ranks; KV heads are split when the rank count divides them and replicated when there are fewer
KV heads than ranks (each rank then holds the one KV head its query heads use); the vocabulary is
split in equal row ranges, the last padded. The planner and the loader both read this layout, so
the per-rank KV bytes (and so the block count) agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallelLayout:
    """The shard sizes of a model over `world_size` ranks (validated by `tensor_parallel_layout`)."""

    world_size: int
    num_heads: int  # the model's
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def kv_heads_replicated(self) -> bool:
        return self.num_kv_heads < self.world_size

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding / lm_head each rank holds (the last rank's padded with zeros)."""
        return -(-self.vocab_size // self.world_size)

    def head_start(self, rank: int) -> int:
        return rank * self.heads_per_rank

    def kv_head_start(self, rank: int) -> int:
        """The first KV head of `rank` (replicated: the KV head its query heads share)."""
        if self.kv_heads_replicated:
            return rank * self.num_kv_heads // self.world_size
        return rank * self.kv_heads_per_rank

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """The vocabulary rows [start, end) that `rank` holds (end - start may be short on the last rank)."""
        start = min(self.vocab_size, rank * self.vocab_per_rank)
        return start, min(self.vocab_size, start + self.vocab_per_rank)


def tensor_parallel_layout(
    num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, world_size: int
) -> TensorParallelLayout:
    """The layout, or a ValueError naming what does not divide (and what would)."""
    n = world_size
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
    if num_heads % n:
        raise ValueError(
            f"tensor_parallel_size {n} must divide the model's {num_heads} attention heads; "
            f"use one of {_divisors(num_heads)}"
        )
    if num_kv_heads >= n and num_kv_heads % n:
        raise ValueError(
            f"tensor_parallel_size {n} must divide the model's {num_kv_heads} KV heads (or be a multiple of "
            f"them, to replicate them); use one of {_divisors(num_kv_heads)} or a multiple of {num_kv_heads}"
        )
    if num_kv_heads < n and n % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {n} is above the model's {num_kv_heads} KV heads and not a multiple of "
            f"them, so they cannot be replicated evenly; use a multiple of {num_kv_heads}"
        )
    if intermediate_size % n:
        raise ValueError(f"tensor_parallel_size {n} must divide the model's intermediate_size {intermediate_size}")
    return TensorParallelLayout(n, num_heads, num_kv_heads, intermediate_size, vocab_size)


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]
