"""One tensor-parallel rank's part of a step's KV tier work (`TierOps`, decided by rank 0).

Every rank, rank 0 included, runs `run_tier_ops` with the same operations at the same point (before
the step's forward, or in a tier-only message), so its collectives pair up across the ranks:
1. offloads: copy each evicted block's shard out into this rank's host/disk tiers; with a shared
   store, a rank that writes its shard (`shards.writes_shard`) also queues it to its `RemoteWriter`;
2. publishes: copy each freshly computed block's shard into the writer (shared store only);
3. loads: fill the blocks' shards from the tiers (host, disk, then the shared store, prefetched in
   a few round trips), in order, up to the first miss;
4. fills (a KV pack's blocks): rank 0 broadcasts whole blocks, each rank keeps its heads;
5. gathers (a KV pack export): every rank's shards go to every rank (all-gather); rank 0 joins them
   into whole blocks;
6. flush (at shutdown): host tier to disk tier;
then one MIN all-reduce of the loads' counts: a block is kept only when every rank filled its shard,
so a shard a rank lacks (another compressed size, a failed read, a record missing in the store)
costs a recompute, never a wrong block.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from kvpager.core.hashing import BlockHash
from kvpager.core.step_codec import TierOps
from kvpager.kvstore.publisher import RemoteWriter
from kvpager.kvstore.shards import assemble, split
from kvpager.kvstore.tier_stats import MoveCounters
from kvpager.kvstore.tiers import KVTiers
from kvpager.model.parallel import TensorParallel

logger = logging.getLogger("kvpager.kvstore.sharded")


class ShardIO(Protocol):
    """Reads and writes this rank's shard of one block of the KV pool (the `ModelRunner`)."""

    def read_shard(self, block_id: int) -> torch.Tensor: ...

    def write_shard(self, block_id: int, block: torch.Tensor) -> None: ...


@dataclass
class RankKV:
    """What one rank moves KV with: its tiers (None without any), its pool, its group, and its writer
    to the shared store (None unless it has one and writes its shard)."""

    tiers: KVTiers | None
    io: ShardIO
    parallel: TensorParallel
    writer: RemoteWriter | None = None
    offloaded: MoveCounters = field(default_factory=MoveCounters)
    restored: MoveCounters = field(default_factory=MoveCounters)


@dataclass
class TierResult:
    """What `run_tier_ops` did: load job id -> leading blocks every rank filled, blocks the flush wrote,
    and (rank 0, with gathers) the gathered whole blocks [n, num_layers, 2, block_size, num_kv_heads, head_dim]."""

    loaded: dict[int, int]
    flushed: int = 0
    gathered: torch.Tensor | None = None


def run_tier_ops(rank: RankKV, ops: TierOps, fill: torch.Tensor | None = None) -> TierResult:
    """Run one step's tier operations on this rank (see the module docstring for the order).

    `fill`: rank 0's whole blocks for `ops.fills` ([n, num_layers, 2, block_size, num_kv_heads, head_dim]).
    """
    tiers, io = rank.tiers, rank.io
    for block_id, block_hash in ops.offloads:
        start = time.perf_counter()
        block = io.read_shard(block_id).to("cpu", copy=True)
        _publish(rank, [(block_hash, block)])
        if tiers is None:
            continue
        try:
            tiers.offload(block_hash, block, write_remote=False)
        except Exception:  # NOTE: a failed write loses a cache entry (the load's MIN covers it), never the step
            logger.exception("KV tiers: could not store the shard of block %s", block_hash.hex()[:16])
            continue
        _count(rank.offloaded, block, start)
    if ops.publishes:
        _publish(rank, [(h, io.read_shard(block_id).to("cpu", copy=True)) for block_id, h in ops.publishes])
    counts = [_load(tiers, io, blocks, rank.parallel.device, rank.restored) for _, blocks in ops.loads]
    if ops.fills:
        _fill(rank, ops.fills, fill)
    gathered = _gather(rank, ops.gathers) if ops.gathers else None
    flushed = tiers.flush() if ops.flush and tiers is not None else 0
    if not counts:
        return TierResult({}, flushed, gathered)
    agreed = torch.tensor(counts, dtype=torch.int64, device=rank.parallel.device)
    rank.parallel.all_reduce(agreed, dist.ReduceOp.MIN)
    loaded = {job_id: int(n) for (job_id, _), n in zip(ops.loads, agreed.tolist(), strict=True)}
    return TierResult(loaded, flushed, gathered)


def _publish(rank: RankKV, copies: list[tuple[BlockHash, torch.Tensor]]) -> None:
    """Queue the shards the shared store does not hold yet to this rank's writer (none without one)."""
    if rank.writer is None:
        return
    remote = rank.writer.remote
    fresh = [(h, block) for h, block in copies if not remote.knows(h)]
    if fresh and remote.available:
        rank.writer.submit(fresh)


def _load(
    tiers: KVTiers | None,
    io: ShardIO,
    blocks: Sequence[tuple[BlockHash, int]],
    device: torch.device,
    restored: MoveCounters,
) -> int:
    """Fill the blocks' shards from the tiers, in order; the count filled before the first miss."""
    if tiers is None:
        return 0
    remote = tiers.remote
    if remote is not None:  # NOTE: the shards the local tiers lack come in a few round trips, not one each
        remote.prefetch([h for h, _ in blocks if not tiers.contains_locally(h)])
    try:
        for index, (block_hash, block_id) in enumerate(blocks):
            start = time.perf_counter()
            try:
                block = tiers.lookup(block_hash, device)
                if block is None:
                    return index
                io.write_shard(block_id, block)
            except Exception:
                logger.exception("KV tiers: could not load the shard of block %s", block_hash.hex()[:16])
                return index
            _count(restored, block, start)
        return len(blocks)
    finally:
        if remote is not None:
            remote.drop_prefetched([h for h, _ in blocks])


def _fill(rank: RankKV, block_ids: Sequence[int], fill: torch.Tensor | None) -> None:
    """Rank 0 broadcasts whole blocks; every rank writes its heads of them into its pool."""
    parallel = rank.parallel
    shard = rank.io.read_shard(block_ids[0])
    shape = (len(block_ids), *shard.shape[:-2], parallel.layout.num_kv_heads, shard.shape[-1])
    if parallel.rank == 0:
        assert fill is not None and tuple(fill.shape) == shape, f"fill of shape {shape} expected"
        whole = fill.to(parallel.device, shard.dtype).contiguous()
    else:
        whole = torch.empty(shape, dtype=shard.dtype, device=parallel.device)
    parallel.broadcast(whole)
    for index, block_id in enumerate(block_ids):
        rank.io.write_shard(block_id, split(parallel.layout, parallel.rank, whole[index]))


def _gather(rank: RankKV, block_ids: Sequence[int]) -> torch.Tensor | None:
    """Every rank's shards of the blocks to every rank; rank 0 returns them as whole blocks (on the CPU)."""
    parallel = rank.parallel
    local = torch.stack([rank.io.read_shard(block_id) for block_id in block_ids])
    parts = parallel.all_gather(local)
    return assemble(parallel.layout, parts).cpu() if parallel.rank == 0 else None


def _count(counters: MoveCounters, block: torch.Tensor, start: float) -> None:
    counters.blocks += 1
    counters.bytes += block.numel() * block.element_size()
    counters.seconds += time.perf_counter() - start
