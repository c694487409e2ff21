"""KV tiers under tensor parallelism: every rank keeps its own shard of each block in its own tiers.

Each rank's pool holds its KV heads of every block (the same block ids everywhere), so a block
offloaded to the host tier is N shards, one per rank, each in that rank's host RAM. Rank 0 (the
scheduler) decides: `ShardedTierStore` is its `BlockStore`. It queues the pool's evictions and the
KV manager's prefix loads as plain data (`TierOps`), which go out in the step message
(`core/step_codec.py`); every rank, rank 0 included, then runs them with `run_tier_ops` before the
step's forward: copy the evicted blocks' shards out, fill the loaded blocks' shards in. A load's
result is the smallest count of leading blocks any rank filled (one MIN all-reduce), so a rank whose
tier lost a block (different compressed sizes, a failed read) costs a recompute, never a wrong block.

Synchronous by design: the tier I/O of a step runs on each rank's step thread, in the same order on
every rank, so the ranks' tiers (same capacity, same block sizes, same operations) hold the same
hashes. The host and disk tiers are supported: each rank's disk tier is a directory of its own under
--kv-cache-dir (`rank_cache_dir`), flushed at shutdown by every rank (a flush op rank 0 sends). The
shared store and packs are not (EngineConfig refuses them with N > 1).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from kvpager.core.config import EngineConfig
from kvpager.core.hashing import BlockHash
from kvpager.core.step_codec import TierOps
from kvpager.kvstore.offload import build_tiers
from kvpager.kvstore.tier_stats import KVTierStats, MoveCounters
from kvpager.kvstore.tiers import KVTiers
from kvpager.model.parallel import TensorParallel

logger = logging.getLogger("kvpager.kvstore.sharded")


def rank_cache_dir(kv_cache_dir: str, rank: int, world_size: int) -> str:
    """The disk tier directory of one rank: its shards only, never mixed with another layout's."""
    return str(Path(kv_cache_dir) / f"tp{world_size}-rank{rank}")


def build_rank_tiers(config: EngineConfig, fingerprint: bytes, rank: int) -> KVTiers | None:
    """This rank's tiers (host and/or disk, each bounded per rank as the flags say), or None."""
    if config.kv_cache_dir is not None:
        directory = rank_cache_dir(config.kv_cache_dir, rank, config.tensor_parallel_size)
        config = dataclasses.replace(config, kv_cache_dir=directory)
    return build_tiers(config, fingerprint)


class ShardIO(Protocol):
    """Reads and writes this rank's shard of one block of the KV pool (the `ModelRunner`)."""

    def read_shard(self, block_id: int) -> torch.Tensor: ...

    def write_shard(self, block_id: int, block: torch.Tensor) -> None: ...


def run_tier_ops(
    tiers: KVTiers,
    io: ShardIO,
    ops: TierOps,
    parallel: TensorParallel,
    offloaded: MoveCounters | None = None,
    restored: MoveCounters | None = None,
) -> tuple[dict[int, int], int]:
    """Run one step's tier operations on this rank; returns (load job id -> leading blocks every rank
    filled, blocks this rank's flush wrote to disk).

    Every rank calls it with the same `ops` at the same point of the step (the MIN all-reduce pairs up).
    Offloads go first: a block loaded in the same step may be one just evicted.
    """
    for block_id, block_hash in ops.offloads:
        start = time.perf_counter()
        block = io.read_shard(block_id).to("cpu", copy=True)
        try:
            tiers.offload(block_hash, block)
        except Exception:  # NOTE: a failed write loses a cache entry (the load's MIN covers it), never the step
            logger.exception("KV tiers: could not store the shard of block %s", block_hash.hex()[:16])
            continue
        _count(offloaded, block, start)
    counts = [_load(tiers, io, blocks, parallel.device, restored) for _, blocks in ops.loads]
    flushed = tiers.flush() if ops.flush else 0
    if not counts:
        return {}, flushed
    agreed = torch.tensor(counts, dtype=torch.int64, device=parallel.device)
    parallel.all_reduce(agreed, dist.ReduceOp.MIN)
    return {job_id: int(n) for (job_id, _), n in zip(ops.loads, agreed.tolist(), strict=True)}, flushed


def _load(
    tiers: KVTiers,
    io: ShardIO,
    blocks: Sequence[tuple[BlockHash, int]],
    device: torch.device,
    restored: MoveCounters | None,
) -> int:
    """Fill the blocks' shards from the tiers, in order; the count filled before the first miss."""
    for index, (block_hash, block_id) in enumerate(blocks):
        start = time.perf_counter()
        try:
            block = tiers.lookup(block_hash, device)
        except Exception:
            logger.exception("KV tiers: could not load the shard of block %s", block_hash.hex()[:16])
            return index
        if block is None:
            return index
        io.write_shard(block_id, block)
        _count(restored, block, start)
    return len(blocks)


def _count(counters: MoveCounters | None, block: torch.Tensor, start: float) -> None:
    if counters is not None:
        counters.blocks += 1
        counters.bytes += block.numel() * block.element_size()
        counters.seconds += time.perf_counter() - start


class ShardedTierStore:
    """Rank 0's `BlockStore` under tensor parallelism: queues tier operations for the next step message.

    The engine takes them with `take_ops` when it broadcasts a step and runs rank 0's part with
    `run`; the loads it ran are reported by `finished_loads` (at the next `schedule()`).
    """

    def __init__(self, tiers: KVTiers, io: ShardIO, parallel: TensorParallel, send: Callable[[TierOps], None]) -> None:
        if tiers.remote is not None:
            raise ValueError("the shared KV store (--kv-cache-remote) is not supported with tensor parallelism")
        self.tiers = tiers
        self.io = io
        self.parallel = parallel
        self.send = send  # broadcasts tier work alone (no step): the persist at shutdown
        self.offloaded = MoveCounters()
        self.restored = MoveCounters()
        self._offloads: list[tuple[int, BlockHash]] = []
        self._staged: set[BlockHash] = set()  # evicted, to be offloaded by the next step
        self._loads: list[tuple[int, tuple[tuple[BlockHash, int], ...]]] = []
        self._finished: dict[int, int] = {}

    # ---- BlockStore (engine thread) -------------------------------------------------------------
    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._staged or self.tiers.contains(block_hash)

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        """Queue the offload of a block the pool reuses; its K/V stays intact until the step's forward,
        before which every rank copies its shard out."""
        if block_hash in self._staged or self.tiers.contains(block_hash):
            return  # NOTE: a held block is never rewritten (as TieredBlockStore)
        self._staged.add(block_hash)
        self._offloads.append((block_id, block_hash))

    def start_load(self, job_id: int, blocks: Sequence[tuple[BlockHash, int]]) -> None:
        self._loads.append((job_id, tuple(blocks)))

    def start_lookup(self, job_id: int, hashes: Sequence[BlockHash]) -> bool:
        return False  # NOTE: no remote tier: `contains` answers

    def finished_loads(self) -> dict[int, int]:
        finished, self._finished = self._finished, {}
        return finished

    def wait_for_loads(self, timeout: float) -> None:
        """Nothing to wait for: a load runs in the step that broadcasts it, before this is asked."""

    # ---- the engine's side ----------------------------------------------------------------------
    def take_ops(self) -> TierOps:
        """The operations queued since the last step, for the step message (the queue is emptied)."""
        ops = TierOps(tuple(self._offloads), tuple(self._loads))
        self._offloads, self._loads = [], []
        return ops

    def run(self, ops: TierOps) -> int:
        """Rank 0's part of `ops` (after broadcasting them): its shards, and the loads' agreed counts.
        Returns the blocks its flush wrote (0 without one)."""
        try:
            loaded, flushed = run_tier_ops(self.tiers, self.io, ops, self.parallel, self.offloaded, self.restored)
        finally:
            self._staged.difference_update(block_hash for _, block_hash in ops.offloads)
        self._finished.update(loaded)
        return flushed

    def wait_for_copies(self) -> None:
        """Nothing to wait for: evicted blocks are copied out by the step itself, before its forward."""

    def persist(self, cached: Sequence[tuple[BlockHash, int]]) -> int:
        """At shutdown (the workers still up): every rank copies the pool's cached blocks' shards into its
        tiers, then flushes its host tier to its disk tier. Returns the blocks rank 0's flush wrote."""
        for block_hash, block_id in cached:
            self.on_evict(block_id, block_hash)
        ops = dataclasses.replace(self.take_ops(), flush=self.tiers.disk is not None)
        if ops.is_empty:
            return 0
        try:
            self.send(ops)
            return self.run(ops)
        except Exception:  # NOTE: a cache that is not persisted is recomputed next time; shutdown goes on
            logger.exception("KV tiers: the tensor-parallel persist at shutdown failed")
            return 0

    def close(self) -> None:
        """No threads to stop."""

    def stats(self, device_evictions: int) -> KVTierStats:
        """Rank 0's tier counters (every rank moves the same blocks, each its own shard of them)."""
        host, disk = self.tiers.host, self.tiers.disk
        return KVTierStats(
            host=host.stats if host is not None else None,
            disk=disk.stats if disk is not None else None,
            device_evictions=device_evictions,
            offloaded=MoveCounters(self.offloaded.blocks, self.offloaded.bytes, self.offloaded.seconds),
            restored=MoveCounters(self.restored.blocks, self.restored.bytes, self.restored.seconds),
        )
