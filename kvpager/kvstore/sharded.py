"""KV tiers under tensor parallelism: every rank keeps its own shard of each block in its own tiers.

Each rank's pool holds its KV heads of every block (the same block ids everywhere), so a block
offloaded to the host tier is N shards, one per rank, each in that rank's host RAM. Rank 0 (the
scheduler) decides: `ShardedTierStore` is its `BlockStore`. It queues the pool's evictions and the
KV manager's prefix loads as plain data (`TierOps`), which go out in the step message
(`core/step_codec.py`); every rank, rank 0 included, then runs them with `run_tier_ops`
(`shard_ops.py`) before the step's forward: copy the evicted blocks' shards out, fill the loaded
blocks' shards in. A load's result is the smallest count of leading blocks any rank filled (one MIN
all-reduce), so a rank whose tier lost a block costs a recompute, never a wrong block.

Synchronous by design: the tier I/O of a step runs on each rank's step thread, in the same order on
every rank, so the ranks' tiers (same capacity, same block sizes, same operations) hold the same
hashes. Each rank's disk tier is a directory of its own under --kv-cache-dir (`rank_cache_dir`),
flushed at shutdown by every rank (a flush op rank 0 sends).

The shared store (--kv-cache-remote): each rank stores its shard under a key naming its KV heads
(`shards.py`, `remote.py`). Rank 0 asks the store, on a lookup thread of its own (never the step),
whether every distinct shard of a chain's blocks is there; a load then fetches each rank's shard on
its step thread (bounded by --kv-cache-remote-timeout; the MIN decides). Publishing: after a forward
rank 0 sends the fresh blocks in a tier-only message and each rank copies its shard to its own
writer thread (`publisher.RemoteWriter`), which writes it; an evicted block is written through the same way.

KV packs are whole blocks whatever the layout: `ShardedBlockIO` is rank 0's `BlockIO` for them, a
block read is an all-gather of every rank's shard, a block write a broadcast each rank takes its heads from.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvpager.core.config import EngineConfig
from kvpager.core.hashing import BlockHash
from kvpager.core.kv_cache_manager import HINT_JOB
from kvpager.core.step_codec import TierOps
from kvpager.kvstore.offload import build_tiers, run_worker
from kvpager.kvstore.publisher import RemoteWriter
from kvpager.kvstore.shard_ops import RankKV, ShardIO, TierResult, run_tier_ops
from kvpager.kvstore.shards import distinct_shards, shard_of, writes_shard
from kvpager.kvstore.tier_stats import KVTierStats, MoveCounters
from kvpager.model.parallel import TensorParallel

logger = logging.getLogger("kvpager.kvstore.sharded")

__all__ = ["RankKV", "ShardIO", "ShardedBlockIO", "ShardedTierStore", "build_rank_kv", "rank_cache_dir"]


def rank_cache_dir(kv_cache_dir: str, rank: int, world_size: int) -> str:
    """The disk tier directory of one rank: its shards only, never mixed with another layout's."""
    return str(Path(kv_cache_dir) / f"tp{world_size}-rank{rank}")


def build_rank_kv(config: EngineConfig, fingerprint: bytes, io: ShardIO, parallel: TensorParallel) -> RankKV:
    """This rank's tiers (host and/or disk, each bounded per rank as the flags say; its shard's records in
    the shared store, rank 0 looking up every shard), and its writer when it writes its shard."""
    rank, layout = parallel.rank, parallel.layout
    if config.kv_cache_dir is not None:
        directory = rank_cache_dir(config.kv_cache_dir, rank, config.tensor_parallel_size)
        config = dataclasses.replace(config, kv_cache_dir=directory)
    lookup = distinct_shards(layout) if rank == 0 else ()
    tiers = build_tiers(config, fingerprint, shard=shard_of(layout, rank), lookup_shards=lookup)
    writer = None
    if tiers is not None and tiers.remote is not None and writes_shard(layout, rank):
        writer = RemoteWriter(tiers.remote)
    return RankKV(tiers, io, parallel, writer)


class ShardedTierStore:
    """Rank 0's `BlockStore` under tensor parallelism: queues tier operations for the next step message.

    The engine takes them with `take_ops` when it broadcasts a step and runs rank 0's part with
    `run`; the loads it ran are reported by `finished_loads` (at the next `schedule()`). With a shared
    store, lookups run on a thread of their own and finish like loads of no blocks.
    """

    def __init__(self, rank: RankKV, send: Callable[[TierOps], None]) -> None:
        if rank.tiers is None:
            raise ValueError("a sharded tier store needs tiers")
        self.rank = rank
        self.tiers = rank.tiers
        self.send = send  # broadcasts tier work alone (no step): publishes, pack blocks, the persist at shutdown
        self._offloads: list[tuple[int, BlockHash]] = []
        self._staged: set[BlockHash] = set()  # evicted, to be offloaded by the next step
        self._loads: list[tuple[int, tuple[tuple[BlockHash, int], ...]]] = []
        self._cond = threading.Condition()  # guards `_finished` and the lookup queue (the lookup thread)
        self._finished: dict[int, int] = {}
        self._lookups: deque[tuple[int, list[BlockHash]]] = deque()
        self._lookup_busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.tiers.remote is not None:
            self._thread = threading.Thread(
                target=run_worker,
                args=(weakref.ref(self), self._cond, self._lookups, "_lookup_once"),
                name="kvpager-kv-lookup",
                daemon=True,
            )
            self._thread.start()

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
        """Ask the shared store (on the lookup thread) about the chain past what the tiers are known to
        hold; False when `contains` answers for it now (no store, store down, answers still known)."""
        chain = self.tiers.remote_lookup_chain(hashes, self._staged)
        if chain is None:
            return False
        with self._cond:
            if self._closed:
                return False
            self._lookups.append((job_id, chain))
            self._cond.notify_all()
        return True

    def finished_loads(self) -> dict[int, int]:
        with self._cond:
            finished, self._finished = self._finished, {}
        return finished

    def wait_for_loads(self, timeout: float) -> None:
        """Wait for a lookup to come back; a load runs in the step that broadcasts it, before this is asked."""
        with self._cond:
            if not self._finished and (self._lookups or self._lookup_busy):
                self._cond.wait(timeout)

    # ---- the engine's side ----------------------------------------------------------------------
    def take_ops(self) -> TierOps:
        """The operations queued since the last step, for the step message (the queue is emptied)."""
        ops = TierOps(offloads=tuple(self._offloads), loads=tuple(self._loads))
        self._offloads, self._loads = [], []
        return ops

    def run(self, ops: TierOps, fill: torch.Tensor | None = None) -> TierResult:
        """Rank 0's part of `ops` (after broadcasting them): its shards, and the loads' agreed counts."""
        try:
            result = run_tier_ops(self.rank, ops, fill)
        finally:
            self._staged.difference_update(block_hash for _, block_hash in ops.offloads)
        remote = self.tiers.remote
        if remote is not None:  # NOTE: a rank lacked a shard: the store is asked again next time
            for job_id, blocks in ops.loads:
                remote.forget([h for h, _ in blocks[result.loaded[job_id] :]])
        with self._cond:
            self._finished.update(result.loaded)
            self._cond.notify_all()
        return result

    def publish(self, blocks: list[tuple[BlockHash, int]]) -> None:
        """Every rank writes its shard of these freshly computed blocks to the shared store (the
        `RemotePublisher`'s sink, on the engine thread after the forward): one tier-only message."""
        ops = dataclasses.replace(self.take_ops(), publishes=tuple((b, h) for h, b in blocks))
        self.send(ops)
        self.run(ops)

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
            return self.run(ops).flushed
        except Exception:  # NOTE: a cache that is not persisted is recomputed next time; shutdown goes on
            logger.exception("KV tiers: the tensor-parallel persist at shutdown failed")
            return 0

    def close(self) -> None:
        """Stop the lookup thread; write what rank 0's writer has queued."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self.rank.writer is not None:
            self.rank.writer.close()

    def stats(self, device_evictions: int) -> KVTierStats:
        """Rank 0's tier counters (every rank moves the same blocks, each its own shard of them)."""
        host, disk, remote = self.tiers.host, self.tiers.disk, self.tiers.remote
        offloaded, restored = self.rank.offloaded, self.rank.restored
        return KVTierStats(
            host=host.stats if host is not None else None,
            disk=disk.stats if disk is not None else None,
            device_evictions=device_evictions,
            remote=remote.stats if remote is not None else None,
            offloaded=MoveCounters(offloaded.blocks, offloaded.bytes, offloaded.seconds),
            restored=MoveCounters(restored.blocks, restored.bytes, restored.seconds),
        )

    # ---- the lookup thread ----------------------------------------------------------------------
    def _lookup_once(self) -> bool:
        """Run one queued lookup, if any; False once closed and idle."""
        with self._cond:
            if not self._lookups:
                return not self._closed
            job_id, hashes = self._lookups.popleft()
            self._lookup_busy = True
        try:
            assert self.tiers.remote is not None
            self.tiers.remote.lookup(hashes)
        except Exception:  # NOTE: a failed lookup is a miss; the request still gets its answer
            logger.exception("KV tiers: remote lookup failed")
        finally:
            with self._cond:
                if job_id != HINT_JOB:  # a hint's answers are kept by the store; nobody waits for it
                    self._finished[job_id] = 0
                self._lookup_busy = False
                self._cond.notify_all()
        return True


class ShardedBlockIO:
    """Rank 0's `BlockIO` for KV packs and imports under tensor parallelism: whole blocks, whatever the layout.

    `read_block` gathers every rank's shard of a block (a fresh CPU tensor, not a view of the pool);
    `write_block` broadcasts a whole block and each rank writes its heads. Each is one tier-only
    message; the tier work the store has queued goes first in it (an evicted block is copied out
    before a pack's block overwrites it).
    """

    def __init__(self, rank: RankKV, send: Callable[[TierOps], None], store: ShardedTierStore | None) -> None:
        self.rank = rank
        self.send = send
        self.store = store

    def read_block(self, block_id: int) -> torch.Tensor:
        gathered = self._run(TierOps(gathers=(block_id,))).gathered
        assert gathered is not None
        return gathered[0]

    def write_block(self, block_id: int, block: torch.Tensor) -> None:
        layout = self.rank.parallel.layout
        if block.dim() < 2 or block.shape[-2] != layout.num_kv_heads:
            raise ValueError(f"a whole KV block has {layout.num_kv_heads} KV heads, got shape {tuple(block.shape)}")
        self._run(TierOps(fills=(block_id,)), block.unsqueeze(0))

    def _run(self, ops: TierOps, fill: torch.Tensor | None = None) -> TierResult:
        if self.store is not None:
            ops = dataclasses.replace(self.store.take_ops(), fills=ops.fills, gathers=ops.gathers)
        self.send(ops)
        if self.store is not None:
            return self.store.run(ops, fill)
        return run_tier_ops(self.rank, ops, fill)
