"""KV pool sizing: the one place where bytes become blocks.

Both the engine (at start-up) and the planner (`kvpager plan`) call these functions, so the
planner's block count is the engine's block count by construction. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVShape:
    """What one token position costs in the paged pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        # K and V, every layer, every KV head.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


@dataclass(frozen=True)
class PoolSize:
    """The pool the engine preallocates for a budget."""

    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def max_concurrency(self, tokens_per_seq: int) -> int:
        """Sequences of `tokens_per_seq` positions that fit at once (each needs whole blocks)."""
        blocks_per_seq = -(-tokens_per_seq // self.block_size)
        return self.num_blocks // blocks_per_seq if blocks_per_seq else 0


def pool_size(shape: KVShape, block_size: int, budget_bytes: int) -> PoolSize:
    """Number of whole blocks that fit in `budget_bytes`."""
    per_block = shape.bytes_per_block(block_size)
    return PoolSize(num_blocks=budget_bytes // per_block, block_size=block_size, bytes_per_block=per_block)


def default_cpu_kv_budget(available_ram_bytes: int, weight_bytes: int, fraction: float) -> int:
    """Default KV budget on CPU: `fraction` of the RAM left after the weights."""
    return max(0, int((available_ram_bytes - weight_bytes) * fraction))


def default_cuda_kv_budget(free_bytes: int, total_bytes: int, utilization: float, activation_reserve: int) -> int:
    """Default KV budget on CUDA: vLLM's rule, `utilization` of total memory minus what is already used."""
    used = total_bytes - free_bytes
    return max(0, int(total_bytes * utilization) - used - activation_reserve)
