"""Writes each block the device pool caches to the remote tier, from its own thread.

The pool announces a cached block at allocation (`BlockStored`, a KV event), before the forward;
`flush()` runs on the engine thread after the forward and copies the blocks still cached under the
same hash and not yet known to the store into host tensors (a device-to-host copy, no network). The
publisher thread then encodes them and writes them (`RemoteTier.put`: SET NX), so a slow or dead
store never holds a step. The queue between the two is bounded (`max_pending`): when it is full the
oldest block is dropped, counted in `publish_dropped` (a device eviction writes it through later).
While the store is marked down nothing is copied: the blocks are dropped here for the same reason.

The thread and its queue are a `RemoteWriter` of their own: under tensor parallelism every rank has
one for its shards, and rank 0's publisher hands the blocks to announce to `publish` (the sharded
store sends them to every rank in a step message, and each rank copies its shard into its writer).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence

import torch

from kvpager.core.block_pool import BlockPool
from kvpager.core.hashing import BlockHash
from kvpager.core.kv_events import BlockStored, KVEvent
from kvpager.kvstore.block_io import BlockReader, host_copy
from kvpager.kvstore.offload import run_worker
from kvpager.kvstore.remote import RemoteTier

logger = logging.getLogger("kvpager.kvstore.remote")

DEFAULT_MAX_PENDING = 1024  # copied blocks waiting for the publisher thread


class RemoteWriter:
    """A thread writing host blocks to the remote tier from a bounded queue (the oldest dropped when full).

    `close()` writes what is queued, then stops the thread.
    """

    def __init__(self, remote: RemoteTier, *, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.remote = remote
        self.max_pending = max_pending
        self._cond = threading.Condition()
        self._queue: deque[tuple[BlockHash, torch.Tensor]] = deque()
        self._busy = False
        self._writing: BlockHash | None = None  # the block being written (listed by `queued`)
        self._closed = False
        # NOTE: the thread holds the writer weakly between writes, so one dropped without close() is
        # still collected; the thread then ends.
        self._thread = threading.Thread(
            target=run_worker,
            args=(weakref.ref(self), self._cond, self._queue, "_write_once"),
            name="kvpager-kv-publish",
            daemon=True,
        )
        self._thread.start()

    def submit(self, copies: Sequence[tuple[BlockHash, torch.Tensor]]) -> int:
        """Queue host copies for writing (never waits for the store); returns how many were queued."""
        dropped = 0
        with self._cond:
            if self._closed:
                return 0
            for item in copies:
                if len(self._queue) >= self.max_pending:
                    self._queue.popleft()
                    dropped += 1
                self._queue.append(item)
            self._cond.notify_all()
        if dropped:
            self.remote.count("publish_dropped", dropped)
        return len(copies)

    def queued(self) -> list[BlockHash]:
        """The hashes waiting to be written or being written, newest first."""
        with self._cond:
            queued = [block_hash for block_hash, _ in reversed(self._queue)]
            return queued + ([self._writing] if self._writing is not None else [])

    def drain(self) -> None:
        """Wait until every queued block was written (or dropped because the store went down)."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()

    def close(self) -> None:
        """Write what is queued, then stop the thread (idempotent)."""
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _write_once(self) -> bool:
        """Write one queued block, if any; False once closed and idle."""
        with self._cond:
            if not self._queue:
                return not self._closed
            block_hash, block = self._queue.popleft()
            self._busy, self._writing = True, block_hash
        try:
            if self.remote.available and self.remote.put(block_hash, block):
                self.remote.count("published")
        except Exception:  # NOTE: a failed write loses a cache entry, never the thread
            logger.exception("KV store: could not publish block %s", block_hash.hex()[:16])
        finally:
            with self._cond:
                self._busy, self._writing = False, None
                self._cond.notify_all()
        return True


Publish = Callable[[list[tuple[BlockHash, int]]], None]  # (hash, device block id) of blocks to write


class RemotePublisher:
    """See the module docstring. `close()` writes what is queued, then stops the writer's thread.

    `publish`: where the blocks to announce go (under tensor parallelism, the sharded store); by
    default host copies into this publisher's own `writer`.
    """

    def __init__(
        self,
        remote: RemoteTier,
        pool: BlockPool,
        io: BlockReader | None,
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
        publish: Publish | None = None,
    ) -> None:
        self.remote = remote
        self.pool = pool
        self.io = io
        self.writer = RemoteWriter(remote, max_pending=max_pending) if publish is None else None
        self._publish = publish if publish is not None else self._copy_to_writer
        self._announced: list[tuple[BlockHash, int]] = []
        pool.add_listener(self._on_event)

    def _on_event(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._announced.extend(zip(event.block_hashes, event.block_ids, strict=True))

    def flush(self) -> int:
        """Publish the blocks announced since the last flush that are still cached and not known to the
        store (engine thread, after the forward); returns how many. Never waits for the store."""
        announced, self._announced = self._announced, []
        if not announced or not self.remote.available:
            return 0
        fresh = [
            (block_hash, block_id)
            for block_hash, block_id in announced
            if not self.remote.knows(block_hash) and self.pool.get_cached_block(block_hash) == block_id
        ]
        if fresh:
            self._publish(fresh)
        return len(fresh)

    def pending(self) -> list[BlockHash]:
        """The hashes announced or queued for writing and not yet written, newest first.

        NOTE: any thread: the announced list is copied first (one atomic step in CPython) and the
        writer's queue is read under its lock."""
        announced = list(self._announced)
        queued = self.writer.queued() if self.writer is not None else []
        return [block_hash for block_hash, _ in reversed(announced)] + queued

    def _copy_to_writer(self, blocks: list[tuple[BlockHash, int]]) -> None:
        assert self.writer is not None and self.io is not None
        io = self.io
        self.writer.submit([(block_hash, host_copy(io, block_id)) for block_hash, block_id in blocks])

    def drain(self) -> None:
        """Wait until every queued block was written (or dropped because the store went down)."""
        if self.writer is not None:
            self.writer.drain()

    def close(self) -> None:
        """Write what is queued, then stop the writer's thread (idempotent)."""
        if self.writer is not None:
            self.writer.close()
