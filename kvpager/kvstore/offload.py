"""The glue between the device pool and the KV tiers: the `BlockStore` the KV manager talks to.

Tier I/O runs off the scheduling path, on two background threads:
- copy-out: the pool calls `on_evict(block_id, hash)` when it reuses a cached block (during
  `schedule()`); that only queues the block, and the copy thread copies its K/V out of the device
  pool into a host tensor. A block being copied out stays valid on the device until its copy
  completes: the engine calls `wait_for_copies()` before the runner's forward writes into the
  blocks of the step, and a load into a block waits for that block's copy-out.
- tier I/O: copied blocks are encoded and written into the tiers (host first, spilling to disk:
  write-back) by the I/O thread, from a bounded queue (`max_pending_writes`; a copy-out finding it
  full drops its block, counted in `dropped`: a cache may forget, a step must not wait for a disk).
  Prefix loads (`start_load`) run on the same thread in the same FIFO order, so a block evicted
  before a load was asked for is found by it; the request waits as WAITING_FOR_REMOTE_KVS meanwhile.
- lookup: with a remote tier, which blocks of a chain the store holds is only known after a round
  trip. `start_lookup` hands the chain to a third thread (one pipelined EXISTS, `RemoteTier.lookup`)
  and the request waits for it like for a load; a load of the blocks found follows. The lookup
  thread is its own so that it never queues behind slow remote writes.
The scheduler and the pool never see a tier or a thread; they see a `BlockStore` or nothing.
NOTE: device blocks are read and written from the worker threads: see the fences above; a block
being loaded is owned by the waiting request, so it is in no batch.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvpager.core.config import EngineConfig
from kvpager.core.hashing import BlockHash
from kvpager.core.kv_cache_manager import HINT_JOB
from kvpager.kvstore.block_io import BlockIO, host_copy
from kvpager.kvstore.codec import get_codec
from kvpager.kvstore.remote import RemoteTier
from kvpager.kvstore.shards import KVShard
from kvpager.kvstore.tier_stats import KVTierStats, MoveCounters
from kvpager.kvstore.tiers import DiskTier, HostTier, KVTiers

__all__ = ["KVTierStats", "MoveCounters", "TieredBlockStore", "build_tiers", "run_worker"]

logger = logging.getLogger("kvpager.kvstore.offload")

DEFAULT_MAX_PENDING_WRITES = 256  # copied-out blocks waiting for the I/O thread
IDLE_CHECK_S = 1.0  # how often an idle worker thread checks whether its store still exists


def run_worker(
    ref: weakref.ReferenceType[TieredBlockStore], cond: threading.Condition, work: deque[Any], step: str
) -> None:
    """A worker thread: wait for `work`, run `store.<step>()`; ends when it returns False or the store is gone.

    NOTE: it holds the store only while it works, so a store dropped without close() is collected.
    """
    while True:
        with cond:
            if not work:
                cond.wait(IDLE_CHECK_S)
        store = ref()
        if store is None:
            return
        try:
            if not getattr(store, step)():
                return
        except Exception:  # NOTE: a failed job loses its work, never the thread (drain() must end)
            logger.exception("KV tiers: background %s failed", step)
        del store


def build_tiers(
    config: EngineConfig,
    fingerprint: bytes,
    shard: KVShard | None = None,
    lookup_shards: Sequence[KVShard] = (),
) -> KVTiers | None:
    """The host, disk and/or remote tiers the config asks for, or None when it asks for none.

    `shard` / `lookup_shards`: a tensor-parallel rank's KV heads and what its lookups require (`RemoteTier`).
    """
    if config.host_kv_cache_memory is None and config.kv_cache_dir is None and config.kv_cache_remote is None:
        return None
    codec = get_codec(config.kv_codec)
    host = HostTier(config.host_kv_cache_memory, codec) if config.host_kv_cache_memory is not None else None
    disk = None
    if config.kv_cache_dir is not None:
        disk = DiskTier(config.kv_cache_dir, config.resolved_kv_cache_dir_max_bytes, fingerprint, codec)
    remote = None
    if config.kv_cache_remote is not None:
        remote = RemoteTier.from_url(
            config.kv_cache_remote,
            fingerprint,
            codec,
            config.kv_cache_remote_timeout,
            shard=shard,
            lookup_shards=lookup_shards,
        )
    return KVTiers(host, disk, remote)


@dataclass(frozen=True, slots=True)
class _Store:
    block_hash: BlockHash
    block: torch.Tensor  # a host copy
    start: float  # when its copy-out began (for `offloaded.seconds`)


@dataclass(frozen=True, slots=True)
class _Load:
    job_id: int
    blocks: list[tuple[BlockHash, int]]


@dataclass(frozen=True, slots=True)
class _Lookup:
    job_id: int
    hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class _Flush:
    result: list[int]  # receives the number of blocks written


_Job = _Store | _Load | _Flush


class TieredBlockStore:
    """`BlockStore` over `KVTiers`: device evictions go down into the tiers, prefix misses come back up."""

    def __init__(
        self,
        tiers: KVTiers,
        io: BlockIO,
        device: torch.device | str = "cpu",
        *,
        max_pending_writes: int = DEFAULT_MAX_PENDING_WRITES,
    ) -> None:
        if max_pending_writes < 1:
            raise ValueError(f"max_pending_writes must be >= 1, got {max_pending_writes}")
        self.tiers = tiers
        self.io = io
        self.device = device
        self.max_pending_writes = max_pending_writes
        self.offloaded = MoveCounters()
        self.restored = MoveCounters()
        self.dropped = 0
        self._cond = threading.Condition()
        self._copies: deque[tuple[int, BlockHash]] = deque()
        self._copying: dict[int, BlockHash] = {}  # block id -> hash, until its copy-out is done
        self._staged: set[BlockHash] = set()  # queued for copy-out or writing
        self._jobs: deque[_Job] = deque()  # the I/O thread's FIFO
        self._lookups: deque[_Lookup] = deque()  # the lookup thread's FIFO
        self._lookup_busy = False
        self._num_writes = 0  # store jobs in `_jobs`
        self._io_busy = False
        self._finished: dict[int, int] = {}
        self._closed = False
        # NOTE: the threads hold the store weakly between jobs, so a store (and the KV pool its
        # `io` holds) that is dropped without close() is still collected; the threads then end.
        ref = weakref.ref(self)
        self._threads = [
            threading.Thread(
                target=run_worker, args=(ref, self._cond, self._copies, "_copy_once"), name="kvpager-kv-copy"
            ),
            threading.Thread(target=run_worker, args=(ref, self._cond, self._jobs, "_io_once"), name="kvpager-kv-io"),
        ]
        if tiers.remote is not None:
            self._threads.append(
                threading.Thread(
                    target=run_worker, args=(ref, self._cond, self._lookups, "_lookup_once"), name="kvpager-kv-lookup"
                )
            )
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    # ---- BlockStore (called on the engine thread; none waits for tier I/O) ---------------------
    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._staged or self.tiers.contains(block_hash)

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        """Queue the copy-out of a block the pool is reusing (its K/V is intact until the next write)."""
        with self._cond:
            if block_hash in self._staged or self.tiers.contains(block_hash):
                return  # NOTE: a held block is never rewritten
            self._staged.add(block_hash)
            closed = self._closed
            if not closed:
                self._copying[block_id] = block_hash
                self._copies.append((block_id, block_hash))
                self._cond.notify_all()
        if closed:  # NOTE: after close() (e.g. a step after shutdown), inline
            self._store(block_hash, host_copy(self.io, block_id), time.perf_counter())

    def wait_for_copies(self) -> None:
        """Return once every queued copy-out has read its block (device-to-host copies, never disk I/O).

        The engine calls it before the runner's forward, which may write into reused blocks.
        """
        with self._cond:
            while self._copying:
                self._cond.wait()

    def start_load(self, job_id: int, blocks: Sequence[tuple[BlockHash, int]]) -> None:
        self._submit(_Load(job_id, list(blocks)))

    def start_lookup(self, job_id: int, hashes: Sequence[BlockHash]) -> bool:
        """Start asking the remote store about the chain past what the local tiers hold; False when
        `contains` can answer for it now (no remote tier, store down, or every answer still known)."""
        chain = self.tiers.remote_lookup_chain(hashes, self._staged)
        if chain is None:
            return False
        lookup = _Lookup(job_id, chain)
        with self._cond:
            if not self._closed:
                self._lookups.append(lookup)
                self._cond.notify_all()
                return True
        self._run_lookup(lookup)  # NOTE: after close(), inline
        return True

    def finished_loads(self) -> dict[int, int]:
        with self._cond:
            finished, self._finished = self._finished, {}
        return finished

    def wait_for_loads(self, timeout: float) -> None:
        with self._cond:
            if not self._finished:
                self._cond.wait(timeout)

    # ---- engine-side calls ---------------------------------------------------------------------
    def put(self, block_hash: BlockHash, block: torch.Tensor) -> None:
        """Keep a host `block` ([num_layers, 2, block_size, num_kv_heads, head_dim]) in the tiers
        (an imported block that did not fit the pool); written in the background, never dropped."""
        with self._cond:
            if block_hash in self._staged:
                return
            self._staged.add(block_hash)
        self._submit(_Store(block_hash, block, time.perf_counter()))

    def persist(self, cached: Sequence[tuple[BlockHash, int]]) -> int:
        """At shutdown: copy the pool's cached blocks into the tiers, then flush host to disk.

        Waits for all of it; returns the number of blocks the flush wrote to disk.
        """
        for block_hash, block_id in cached:
            self.on_evict(block_id, block_hash)
        self.drain()
        flushed: list[int] = []
        self._submit(_Flush(flushed))
        self.drain()
        return flushed[0] if flushed else 0

    def drain(self) -> None:
        """Wait until every copy-out, write and load asked for so far has completed."""
        with self._cond:
            while self._copying or self._jobs or self._io_busy or self._lookups or self._lookup_busy:
                self._cond.wait()

    def close(self) -> None:
        """Drain, then stop the threads; later calls run their I/O inline on the caller's thread."""
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def stats(self, device_evictions: int) -> KVTierStats:
        return KVTierStats(
            host=self.tiers.host.stats if self.tiers.host is not None else None,
            disk=self.tiers.disk.stats if self.tiers.disk is not None else None,
            device_evictions=device_evictions,
            remote=self.tiers.remote.stats if self.tiers.remote is not None else None,
            offloaded=MoveCounters(**asdict(self.offloaded)),
            restored=MoveCounters(**asdict(self.restored)),
            dropped=self.dropped,
        )

    # ---- the worker threads ----------------------------------------------------------------------
    def _submit(self, job: _Job) -> None:
        with self._cond:
            if not self._closed:
                self._jobs.append(job)
                self._num_writes += isinstance(job, _Store)
                self._cond.notify_all()
                return
        self._run_job(job)  # NOTE: after close() (e.g. a step after shutdown), inline

    def _copy_once(self) -> bool:
        """Copy out one queued block, if any; False once closed and idle."""
        with self._cond:
            if not self._copies:
                return not self._closed
            block_id, block_hash = self._copies.popleft()
        start = time.perf_counter()
        block: torch.Tensor | None = None
        try:
            block = host_copy(self.io, block_id)
        except Exception:  # NOTE: lose this cache entry; never leave wait_for_copies() hanging
            logger.exception("KV tiers: could not copy out block %d", block_id)
        with self._cond:
            del self._copying[block_id]
            if block is None:
                self._staged.discard(block_hash)
            elif self._num_writes < self.max_pending_writes:
                self._jobs.append(_Store(block_hash, block, start))
                self._num_writes += 1
            else:
                self._staged.discard(block_hash)
                self.dropped += 1
            self._cond.notify_all()
        return True

    def _io_once(self) -> bool:
        """Run one queued I/O job, if any; False once closed and idle."""
        with self._cond:
            if not self._jobs:
                return not self._closed
            job = self._jobs.popleft()
            self._num_writes -= isinstance(job, _Store)
            self._io_busy = True
        try:
            self._run_job(job)
        finally:
            with self._cond:
                self._io_busy = False
                self._cond.notify_all()
        return True

    def _lookup_once(self) -> bool:
        """Run one queued lookup, if any; False once closed and idle."""
        with self._cond:
            if not self._lookups:
                return not self._closed
            lookup = self._lookups.popleft()
            self._lookup_busy = True
        try:
            self._run_lookup(lookup)
        finally:
            with self._cond:
                self._lookup_busy = False
                self._cond.notify_all()
        return True

    def _run_lookup(self, lookup: _Lookup) -> None:
        try:
            assert self.tiers.remote is not None
            self.tiers.remote.lookup(lookup.hashes)
        except Exception:  # NOTE: a failed lookup is a miss; the request still gets its answer
            logger.exception("KV tiers: remote lookup failed")
        with self._cond:
            if lookup.job_id != HINT_JOB:  # a hint's answers are kept by the store; nobody waits for it
                self._finished[lookup.job_id] = 0
            self._cond.notify_all()

    def _run_job(self, job: _Job) -> None:
        if isinstance(job, _Store):
            self._store(job.block_hash, job.block, job.start)
        elif isinstance(job, _Load):
            num_loaded = self._load(job.blocks)
            with self._cond:
                self._finished[job.job_id] = num_loaded
                self._cond.notify_all()
        else:
            job.result.append(self.tiers.flush())

    def _store(self, block_hash: BlockHash, block: torch.Tensor, start: float) -> None:
        try:
            is_new = not self.tiers.contains(block_hash)
            self.tiers.offload(block_hash, block)  # NOTE: a held block is only refreshed (LRU), never rewritten
            if is_new:
                self._count(self.offloaded, block, start)
        except Exception:  # NOTE: a failed write loses a cache entry, never the engine
            logger.exception("KV tiers: could not store block %s", block_hash.hex()[:16])
        finally:
            with self._cond:
                self._staged.discard(block_hash)

    def _load(self, blocks: list[tuple[BlockHash, int]]) -> int:
        """Copy the tiers' blocks into their device blocks, in order; stops at the first miss."""
        remote = self.tiers.remote
        if remote is not None:  # NOTE: the blocks the local tiers lack come in a few round trips, not one each
            remote.prefetch([h for h, _ in blocks if not self.tiers.contains_locally(h)])
        try:
            return self._load_blocks(blocks)
        finally:
            if remote is not None:
                remote.drop_prefetched([h for h, _ in blocks])

    def _load_blocks(self, blocks: list[tuple[BlockHash, int]]) -> int:
        for index, (block_hash, block_id) in enumerate(blocks):
            start = time.perf_counter()
            try:
                block = self.tiers.lookup(block_hash, self.device)
                if block is None:
                    return index
                with self._cond:  # NOTE: the fresh block may still be copying out what it held
                    while block_id in self._copying:
                        self._cond.wait()
                self.io.write_block(block_id, block)
            except Exception:
                logger.exception("KV tiers: could not load block %s", block_hash.hex()[:16])
                return index
            self._count(self.restored, block, start)
        return len(blocks)

    @staticmethod
    def _count(counters: MoveCounters, block: torch.Tensor, start: float) -> None:
        counters.blocks += 1
        counters.bytes += block.numel() * block.element_size()
        counters.seconds += time.perf_counter() - start
