"""KVCacheManager: per-request block tables on top of the BlockPool, with prefix caching. Torch-free.

A request's block table covers its computed positions plus the ones scheduled this step. Full blocks
whose tokens are known are hashed and registered in the cache when they are *allocated* (like vLLM
v1), not when the forward has run: a request admitted in the same step then hits them, which is
exact because every layer writes all new K/V before any sequence attends (docs/internals.md).

Blocks missing from the device pool may come from a `BlockSource` (a loaded KV pack, an imported
payload: `insert_blocks` copies them in at once) or from a `BlockStore` (the KV tiers below the pool,
read by a background worker): `start_load` continues a waiting request's hash chain into the store,
takes fresh device blocks and asks the store to fill them; the request waits aside
(WAITING_FOR_REMOTE_KVS) until `poll_loads` registers the loaded blocks, and is then admitted with
them as ordinary prefix-cache hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpager.core.block_pool import BlockPool, EvictCallback
from kvpager.core.hashing import BlockHash, RequestId, extend_block_hashes
from kvpager.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockSource(Protocol):
    """Where a block missing from the device pool may be found, by hash (KV tiers, a loaded pack)."""

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether `load_into` may succeed (cheap; no data is read)."""
        ...

    def load_into(self, block_hash: BlockHash, block_id: int) -> bool:
        """Write the block's K/V into device block `block_id`; False when it cannot (e.g. a bad record)."""
        ...


class BlockStore(Protocol):
    """The KV tiers below the pool, behind an asynchronous worker (`kvpager.kvstore.offload`).

    None of these calls waits for tier I/O (except `wait_for_loads`, which says so).
    """

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether a load of `block_hash` may succeed (an in-memory index; no data is read)."""
        ...

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        """The pool is reusing the block: start copying its K/V out (see `BlockPool.on_evict`)."""
        ...

    def start_load(self, job_id: int, blocks: Sequence[tuple[BlockHash, int]]) -> None:
        """Fill each device block with the K/V stored under its hash, in the background, in order."""
        ...

    def start_lookup(self, job_id: int, hashes: Sequence[BlockHash]) -> bool:
        """Start finding out (in the background) which of `hashes` a remote store holds; False when
        `contains` answers for them now. A started lookup finishes like a load of 0 blocks.
        `job_id` HINT_JOB: nobody waits for it (`finished_loads` never reports it)."""
        ...

    def finished_loads(self) -> dict[int, int]:
        """Loads completed since the last call: job id -> number of leading blocks filled."""
        ...

    def wait_for_loads(self, timeout: float) -> None:
        """Block until some load completes or `timeout` seconds pass (the engine has nothing to run)."""
        ...


# The job id of a lookup started ahead of scheduling (`KVCacheManager.hint_lookup`): only its answers are kept.
HINT_JOB = -1


@dataclass(slots=True)
class _Load:
    """One request's prefix load: the device hits it holds, and the fresh blocks being filled."""

    request_id: RequestId
    held: list[int]  # device hits, referenced so they survive the wait
    hashes: list[BlockHash]
    block_ids: list[int]  # fresh blocks, one per hash, filled by the store
    cancelled: bool = False
    done: bool = False
    kept: list[int] = field(default_factory=list)  # after completion: held + loaded blocks


class KVCacheManager:
    """Block tables per request. `hash_seed` is the model fingerprint (root of every hash chain)."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        hash_seed: bytes = b"",
        on_evict: EvictCallback | None = None,
        store: BlockStore | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if store is not None:
            if on_evict is not None:
                raise ValueError("pass either on_evict or store (whose on_evict is used), not both")
            on_evict = store.on_evict
        self.store = store
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_seed = hash_seed
        self.block_pool = BlockPool(num_blocks, enable_caching, on_evict)
        self._loads: dict[int, _Load] = {}  # job id -> load (in flight, or done and held)
        self._load_of: dict[RequestId, int] = {}
        self._next_job_id = 0
        self._req_to_blocks: dict[RequestId, list[int]] = {}
        self._req_to_hashes: dict[RequestId, list[BlockHash]] = {}
        # Leading blocks of each table already offered to the cache (registered or duplicates).
        self._req_to_num_cached_blocks: dict[RequestId, int] = {}

    @property
    def usage(self) -> float:
        """Fraction of the pool owned by requests or pins (0.0 .. 1.0)."""
        return self.block_pool.num_owned_blocks / self.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever hold: the pool minus pinned blocks (e.g. KV packs)."""
        return self.num_blocks - self.block_pool.num_pinned_blocks

    def block_ids(self, request_id: RequestId) -> tuple[int, ...]:
        """The request's whole block table (empty when it holds none)."""
        return tuple(self._req_to_blocks.get(request_id, ()))

    def block_tables(self) -> dict[RequestId, tuple[int, ...]]:
        """Every request's block table (a copy; for read-only views such as the KV map).

        A request waiting for a prefix load is listed with the blocks the load holds for it.
        """
        tables = {request_id: tuple(blocks) for request_id, blocks in self._req_to_blocks.items()}
        for request_id in self._load_of:
            tables[request_id] = tables.get(request_id, ()) + self.loading_block_ids(request_id)
        return tables

    def block_hashes(self, request_id: RequestId) -> list[BlockHash]:
        """Hashes of the request's full, scheduled blocks, aligned with `block_ids(request_id)`.

        Empty without caching or for an unknown request. (A block may hold its hash without being the
        cache's copy of it when another block registered the same hash first.)
        """
        num_full = self._req_to_num_cached_blocks.get(request_id, 0)
        return list(self._req_to_hashes.get(request_id, [])[:num_full])

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block id holding `block_hash` in the device pool, or None."""
        return self.block_pool.get_cached_block(block_hash)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest prefix of full blocks cached on the device: (block ids, number of tokens they hold).

        NOTE: hits stop at num_tokens - 1: the last known token is always computed, because its
        logits are needed to sample the next one (a prefill-only request samples nothing).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        block_ids = []
        for block_hash in self._hashes(request)[: self._max_hit_blocks(request)]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def _max_hit_blocks(self, request: Request) -> int:
        num_tokens = request.num_tokens if request.prefill_only else request.num_tokens - 1
        return num_tokens // self.block_size

    # ---- prefix loads from the store (KV tiers) ------------------------------------------------
    def start_load(self, request: Request, computed_blocks: Sequence[int]) -> bool:
        """Start loading the blocks after `computed_blocks` that the store holds; False when none.

        The device hits and the fresh blocks are referenced until the request is admitted (or
        freed), so neither is evicted while it waits. At most one load per admission. When only a round
        trip to a remote store can tell what it holds, a lookup (a load of no blocks) goes first.
        """
        if self.store is None or not self.enable_caching:
            return False
        looked_up = False
        if (job_id := self._load_of.get(request.request_id)) is not None:
            if self._loads[job_id].block_ids or not self._loads[job_id].done:
                return False
            self._drop_load(job_id)  # NOTE: its lookup is back: `store.contains` now answers
            looked_up = True
        hashes = self._hashes(request)[len(computed_blocks) : self._max_hit_blocks(request)]
        if hashes and not looked_up and self.store.start_lookup(self._next_job_id, hashes):
            self.block_pool.touch(computed_blocks)
            self._loads[self._next_job_id] = _Load(request.request_id, list(computed_blocks), [], [])
            self._load_of[request.request_id] = self._next_job_id
            self._next_job_id += 1
            return True
        # NOTE: keep one block free beyond the load and the revived hits, so the request can be admitted.
        num_revived = sum(1 for block_id in computed_blocks if self.block_pool.ref_cnt(block_id) == 0)
        room = self.block_pool.num_free_blocks - num_revived - 1
        found: list[BlockHash] = []
        for block_hash in hashes:
            if len(found) >= room or not self.store.contains(block_hash):
                break
            found.append(block_hash)
        if not found:
            return False
        self.block_pool.touch(computed_blocks)
        block_ids = self.block_pool.allocate(len(found))
        job_id, self._next_job_id = self._next_job_id, self._next_job_id + 1
        self._loads[job_id] = _Load(request.request_id, list(computed_blocks), found, block_ids)
        self._load_of[request.request_id] = job_id
        self.store.start_load(job_id, list(zip(found, block_ids, strict=True)))
        return True

    def poll_loads(self) -> list[RequestId]:
        """Register the blocks of completed loads; returns the requests that may now be admitted."""
        if self.store is None or not self._loads:
            return []
        ready: list[RequestId] = []
        for job_id, num_loaded in self.store.finished_loads().items():
            load = self._loads[job_id]
            load.done = True
            for block_id, block_hash in zip(load.block_ids[:num_loaded], load.hashes, strict=False):
                self.block_pool.cache_block(block_id, block_hash)
            self.block_pool.free_unused(load.block_ids[num_loaded:])  # a failed tail is recomputed
            load.kept = load.held + load.block_ids[:num_loaded]
            if load.cancelled:
                self._drop_load(job_id)
            else:
                ready.append(load.request_id)
        return ready

    def loading_block_ids(self, request_id: RequestId) -> tuple[int, ...]:
        """The blocks a load holds for `request_id` (its device hits, then the loaded blocks); empty without one."""
        job_id = self._load_of.get(request_id)
        if job_id is None:
            return ()
        load = self._loads[job_id]
        return tuple(load.kept if load.done else load.held + load.block_ids)

    def has_load(self, request_id: RequestId) -> bool:
        """Whether a load (in flight, or completed and not yet released) holds blocks for `request_id`."""
        return request_id in self._load_of

    def held_references(self) -> list[int]:
        """Every block reference the manager holds, one entry per reference: block tables, then loads
        (cancelled ones too, until the store has finished writing them). With the pool's pins they
        account for every block's ref count (`kvpager.core.invariants`)."""
        refs = [block_id for blocks in self._req_to_blocks.values() for block_id in blocks]
        for load in self._loads.values():
            refs.extend(load.kept if load.done else load.held + load.block_ids)
        return refs

    def has_pending_loads(self) -> bool:
        return any(not load.done for load in self._loads.values())

    def wait_for_loads(self, timeout: float) -> None:
        """Wait (at most `timeout` s) for a load in flight to complete; returns at once without one."""
        if self.store is not None and self.has_pending_loads():
            self.store.wait_for_loads(timeout)

    def release_completed_load(self, request_id: RequestId) -> bool:
        """Drop the references a *completed* load holds for a request not yet admitted; False when none.

        Its blocks stay in the prefix cache as free blocks (hits again, unless reused first). A load
        still in flight is left alone: the store is writing its blocks.
        """
        job_id = self._load_of.get(request_id)
        if job_id is None or not self._loads[job_id].done:
            return False
        self._drop_load(job_id)
        return True

    def _release_load(self, request_id: RequestId) -> None:
        """Drop the references a load holds for `request_id` (after admission or on free)."""
        job_id = self._load_of.get(request_id)
        if job_id is None:
            return
        load = self._loads[job_id]
        if not load.done:
            load.cancelled = True  # NOTE: the store is still writing its blocks; freed when it finishes
            del self._load_of[request_id]
            return
        self._drop_load(job_id)

    def _drop_load(self, job_id: int) -> None:
        load = self._loads.pop(job_id)
        if self._load_of.get(load.request_id) == job_id:
            del self._load_of[load.request_id]
        self.block_pool.free(load.kept)

    def acquire_blocks(self, block_hashes: Sequence[BlockHash], source: BlockSource) -> list[int]:
        """Take one reference on the block of each hash of a chain, in order; returns their ids.

        Synchronous: for in-memory sources (a decoded pack or payload), between engine steps.

        A hash missing from the device pool is loaded from `source` into a fresh block, which is then
        registered under it. Stops at the first hash found nowhere, a failed load, or an empty free
        queue. NOTE: references are held while the chain is built, so loading a later block can
        never evict an earlier one. Release them with `block_pool.free` (or keep them as pins).
        """
        block_ids: list[int] = []
        for block_hash in block_hashes:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is not None:
                self.block_pool.touch([block_id])
            elif not self.block_pool.num_free_blocks or not source.contains(block_hash):
                break
            else:
                block_id = self.block_pool.allocate(1)[0]
                if not source.load_into(block_hash, block_id):
                    self.block_pool.free([block_id])
                    break
                self.block_pool.cache_block(block_id, block_hash)
            block_ids.append(block_id)
        return block_ids

    def insert_blocks(self, block_hashes: Sequence[BlockHash], source: BlockSource, *, pin: bool = False) -> list[int]:
        """Put a chain of blocks (an imported payload, a KV pack) into the prefix cache.

        Returns the device block ids of the leading hashes that fit. With `pin`, they stay owned by the
        pool (never evicted) until `block_pool.unpin`; otherwise they are free cached blocks, most
        recently used.
        """
        if not self.enable_caching:
            raise ValueError("KV blocks can only be imported with prefix caching enabled")
        block_ids = self.acquire_blocks(block_hashes, source)
        if pin:
            self.block_pool.pin(block_ids)
        self.block_pool.free(block_ids)
        return block_ids

    def num_blocks_needed(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()) -> int:
        """Free blocks that `allocate_slots` would consume (including reviving cached free blocks)."""
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_held = len(self._req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_new = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - num_held)
        num_revived = sum(1 for block_id in new_computed_blocks if self.block_pool.ref_cnt(block_id) == 0)
        return num_new + num_revived

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()) -> bool:
        return self.num_blocks_needed(request, num_new_tokens, new_computed_blocks) <= self.block_pool.num_free_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow the block table to hold `num_new_tokens` more positions; None if blocks are short.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` (first allocation
        only); the caller then sets `request.num_computed_tokens` to include them. Returns the newly
        allocated block ids. NOTE: when it returns None nothing has changed.
        """
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return None
        request_id = request.request_id
        is_new = request_id not in self._req_to_blocks
        blocks = self._req_to_blocks.setdefault(request_id, [])
        if is_new and self.enable_caching:
            self.block_pool.record_prefix_query(request.num_tokens, len(new_computed_blocks) * self.block_size)
        self.block_pool.touch(new_computed_blocks)
        self._release_load(request_id)
        blocks.extend(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        new_block_ids = self.block_pool.allocate(
            max(0, cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks))
        )
        blocks.extend(new_block_ids)
        self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks tail-first (chain ends are evicted first) and forget it."""
        request_id = request.request_id
        self._release_load(request_id)
        self.block_pool.free(self._req_to_blocks.pop(request_id, []))
        self._req_to_hashes.pop(request_id, None)
        self._req_to_num_cached_blocks.pop(request_id, None)

    def hint_lookup(self, token_ids: Sequence[int]) -> None:
        """Ask the remote store about a prompt's chain before the request reaches the scheduler.

        Called where a request arrives (the API's thread), so the store's answer is usually back by
        the step that schedules it, which then loads or computes at once instead of waiting a step as
        WAITING_FOR_REMOTE_KVS. Reads only immutable state (the hash seed, the block size) and calls the
        store's thread-safe `start_lookup`; does nothing without a store or prefix caching.
        """
        if self.store is None or not self.enable_caching or len(token_ids) <= self.block_size:
            return
        hashes: list[BlockHash] = []
        extend_block_hashes(self.hash_seed, hashes, list(token_ids[: len(token_ids) - 1]), self.block_size)
        self.store.start_lookup(HINT_JOB, hashes)

    def _hashes(self, request: Request) -> list[BlockHash]:
        if not self.enable_caching:
            return []
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(self.hash_seed, hashes, request.all_token_ids, self.block_size)
        return hashes

    def _cache_full_blocks(self, request: Request, num_filled_tokens: int) -> None:
        """Register the blocks that are full once `num_filled_tokens` positions are computed."""
        if not self.enable_caching:
            return
        num_full = num_filled_tokens // self.block_size
        start = self._req_to_num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request)
        blocks = self._req_to_blocks[request.request_id]
        for index in range(start, num_full):
            self.block_pool.cache_block(blocks[index], hashes[index])
        self._req_to_num_cached_blocks[request.request_id] = num_full
