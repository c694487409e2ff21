"""Tensor parallelism over torch.distributed: one rank's place in the layout and its collectives.

`TensorParallel` is what the model, loader and runner see of the process group: the rank, the
layout (kvpager/core/tensor_parallel.py), the all-reduce after a row-parallel linear, the
vocab-parallel embedding lookup and the gather of the vocab-parallel logits, plus the byte
broadcast that carries each step's plain-data message from rank 0 (a length, then a uint8 tensor).
Device-agnostic: gloo on CPU, nccl on CUDA (the tensors live on `device`). The group is an object of
its own (`join_group`: a TCPStore rendezvous and a ProcessGroup), never torch's default group, so
nothing process-wide is set and several engines may live in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvpager.core.tensor_parallel import TensorParallelLayout, tensor_parallel_layout
from kvpager.model.spec import ModelSpec


def join_group(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    device: torch.device,
    connect_timeout_s: float,
    op_timeout_s: float | None = None,
) -> Any:
    """Rendezvous at host:port (rank 0 serves the store) and return (store, process group).

    `connect_timeout_s` bounds the rendezvous (reaching the store, every rank joining);
    `op_timeout_s` (default: the same) bounds each collective afterwards.
    """
    timeout = timedelta(seconds=connect_timeout_s)
    op_timeout = timedelta(seconds=op_timeout_s if op_timeout_s is not None else connect_timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("kvpager-tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = op_timeout
        return store, dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    group = dist.ProcessGroupGloo(prefixed, rank, world_size, op_timeout)
    return store, group


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank in a process group of `layout.world_size` ranks (`join_group`)."""

    rank: int
    layout: TensorParallelLayout
    device: torch.device
    group: Any  # torch.distributed ProcessGroup (gloo or nccl)
    store: Any = None  # the rendezvous TCPStore, kept alive with the group

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def all_reduce(self, x: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Sum (or `op`) `x` over the ranks, in place; returned for chaining."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM if op is None else op  # type: ignore[assignment]
        self.group.allreduce([x], options).wait()
        return x

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows for the ids it holds, zeros for the rest, summed."""
        start, end = self.layout.vocab_range(self.rank)
        mine = (input_ids >= start) & (input_ids < end)
        local = torch.where(mine, input_ids - start, torch.zeros_like(input_ids))
        x = weight.index_select(0, local) * mine.unsqueeze(1).to(weight.dtype)  # [T, hidden]
        return self.all_reduce(x)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[S, vocab_per_rank] on each rank -> [S, vocab] on every rank (all-gather, padding dropped)."""
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self.group.allgather([parts], [local.contiguous()]).wait()
        return torch.cat(parts, dim=1)[:, : self.layout.vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the block count all ranks can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0 sends `payload`; every rank returns it. Its length goes first, then the bytes."""
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        if self.rank == 0:
            assert payload is not None
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(data)
        return payload if payload is not None else data.cpu().numpy().tobytes()

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype everywhere), in place; returned."""
        self._broadcast(t)
        return t

    def all_gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `local` (the same shape on each), in rank order, on every rank."""
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self.group.allgather([parts], [local.contiguous()]).wait()
        return parts

    def _broadcast(self, t: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([t], options).wait()


def layout_for(spec: ModelSpec, world_size: int) -> TensorParallelLayout:
    """The layout of `spec` over `world_size` ranks (ValueError naming what does not divide)."""
    return tensor_parallel_layout(
        spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size, world_size
    )


def shard_spec(spec: ModelSpec, layout: TensorParallelLayout) -> ModelSpec:
    """The spec of one rank's shard: its heads, KV heads, MLP features and vocabulary rows.

    NOTE: the shard's vocab_size is the padded per-rank row count; the model's is `layout.vocab_size`.
    """
    return replace(
        spec,
        num_heads=layout.heads_per_rank,
        num_kv_heads=layout.kv_heads_per_rank,
        intermediate_size=layout.intermediate_per_rank,
        vocab_size=layout.vocab_per_rank,
    )
