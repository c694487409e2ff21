"""BlockPool: ref counts, the LRU free queue and the prefix cache's hash -> block map. Torch-free.

The pool knows block ids only, never tensors. Every block is in exactly one place:
- the free queue (ref count 0; it may still hold a cached hash and be revived by a prefix hit), or
- owned (ref count >= 1: by requests and/or by the pool's own pins).
The free queue's order is the eviction order: `allocate` takes blocks from its head.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvpager.core.hashing import BlockHash
from kvpager.core.kv_events import BlockRemoved, BlockStored, KVEventListener

# Called with (block_id, block_hash) just before a cached block's hash is dropped for reuse, so a
# KV tier can copy the block's bytes out first (it may do so in the background, as long as the copy
# completes before anything writes into the block: see `kvpager.kvstore.offload`).
EvictCallback = Callable[[int, BlockHash], None]


@dataclass(slots=True, eq=False)
class Block:
    """One physical block. `prev`/`next` link it into the free queue while its ref count is 0."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev: Block | None = None
    next: Block | None = None


class FreeBlockQueue:
    """Doubly linked queue of free blocks with O(1) append, popleft and removal from the middle."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(block_id=-1)  # sentinels: never handed out
        self._tail = Block(block_id=-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        block.prev, block.next = last, self._tail
        last.next = block
        self._tail.prev = block
        self.num_blocks += 1

    def appendleft(self, block: Block) -> None:
        first = self._head.next
        assert first is not None
        block.prev, block.next = self._head, first
        first.prev = block
        self._head.next = block
        self.num_blocks += 1

    def popleft(self) -> Block:
        first = self._head.next
        if first is None or first is self._tail:
            raise ValueError("no free blocks left; check num_free_blocks before allocating")
        self.remove(first)
        return first

    def remove(self, block: Block) -> None:
        if block.prev is None or block.next is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_blocks -= 1

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next


class BlockPool:
    """Owns `num_blocks` block ids: allocation, sharing by ref count, and the prefix cache.

    Counters: `evictions` (cached hashes dropped for reuse), and the prefix cache's `queries` and
    `hits`, both in tokens (recorded by the KV manager through `record_prefix_query`).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, on_evict: EvictCallback | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}; give the KV pool more memory")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        self._blocks = [Block(block_id=i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self._blocks)
        self._hash_to_block_id: dict[BlockHash, int] = {}
        self._block_id_to_pins: dict[int, int] = {}
        self.evictions = 0
        self.queries = 0
        self.hits = 0
        self._listeners: list[KVEventListener] = []

    def add_listener(self, listener: KVEventListener) -> None:
        """Call `listener` with a `BlockStored`/`BlockRemoved` event for every hash cached or evicted."""
        self._listeners.append(listener)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached or not): what `allocate` can hand out."""
        return self._free.num_blocks

    @property
    def num_owned_blocks(self) -> int:
        """Blocks with ref count >= 1."""
        return self.num_blocks - self._free.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash (owned or free)."""
        return len(self._hash_to_block_id)

    def ref_cnt(self, block_id: int) -> int:
        return self._blocks[block_id].ref_cnt

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._blocks[block_id].block_hash

    def free_block_ids(self) -> list[int]:
        """The free queue, head first: the order in which `allocate` will reuse (and evict) blocks."""
        return [block.block_id for block in self._free]

    def cached_blocks(self) -> list[tuple[BlockHash, int]]:
        """Every (hash, block id) in the prefix cache, owned or free (e.g. to persist them at shutdown)."""
        return list(self._hash_to_block_id.items())

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`, or None. Does not change ref counts (see `touch`)."""
        if not self.enable_caching:
            return None
        return self._hash_to_block_id.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block; a free (cached) block leaves the free queue."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue (LRU first), each with ref count 1.

        A taken block that still holds a cached hash is evicted: `on_evict` sees it, then the hash
        is dropped. ValueError when fewer than `num_blocks` are free (nothing is changed then).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} are free")
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block = self._free.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            block_ids.append(block.block_id)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block of a block table, releasing it tail-first.

        NOTE: blocks reaching ref 0 are appended to the free queue in reverse table order, so a
        chain's last block is evicted before its first (the first is the most shareable prefix).
        """
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            if block.ref_cnt < 1:
                raise ValueError(f"block {block_id} is already free; a block table was freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)

    def free_unused(self, block_ids: Sequence[int]) -> None:
        """Return blocks that were allocated but never filled (a failed load) to the free queue's head.

        They hold nothing worth keeping, so they are reused before any cached block is evicted.
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise ValueError(f"block {block_id} is shared or cached; release it with free()")
            block.ref_cnt = 0
            self._free.appendleft(block)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register an owned, full block under `block_hash`. Returns False when not registered.

        It is not registered when caching is off or another block already holds the hash (the
        first one stays the cache's copy; this one is freed as an uncached block later).
        """
        block = self._blocks[block_id]
        if block.ref_cnt < 1:
            raise ValueError(f"block {block_id} is free; only owned (filled) blocks can be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return True
        if not self.enable_caching or block_hash in self._hash_to_block_id:
            return False
        block.block_hash = block_hash
        self._hash_to_block_id[block_hash] = block_id
        for listener in self._listeners:
            listener(BlockStored((block_hash,), (block_id,)))
        return True

    def pin(self, block_ids: Sequence[int]) -> None:
        """Hold a reference owned by the pool itself (e.g. blocks of a loaded KV pack)."""
        self.touch(block_ids)
        for block_id in block_ids:
            self._block_id_to_pins[block_id] = self._block_id_to_pins.get(block_id, 0) + 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Release references taken by `pin`; ValueError for a block that is not pinned."""
        for block_id, count in Counter(block_ids).items():
            if self._block_id_to_pins.get(block_id, 0) < count:
                raise ValueError(f"block {block_id} is not pinned {count} time(s); unpin only what was pinned")
        for block_id in block_ids:
            self._block_id_to_pins[block_id] -= 1
            if self._block_id_to_pins[block_id] == 0:
                del self._block_id_to_pins[block_id]
        self.free(block_ids)

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins (not available to requests)."""
        return len(self._block_id_to_pins)

    def num_pins(self, block_id: int) -> int:
        return self._block_id_to_pins.get(block_id, 0)

    # ---- read-only views (the KV map, docs/kv-map.md); copies, O(blocks) ----------------------
    def ref_counts(self) -> list[int]:
        """Every block's ref count, indexed by block id."""
        return [block.ref_cnt for block in self._blocks]

    def hashes(self) -> list[BlockHash | None]:
        """Every block's cached hash (None when it holds none), indexed by block id."""
        return [block.block_hash for block in self._blocks]

    def pins(self) -> dict[int, int]:
        """Pinned block id -> number of pins."""
        return dict(self._block_id_to_pins)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup, in tokens."""
        self.queries += num_query_tokens
        self.hits += num_hit_tokens

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        if self.on_evict is not None:
            self.on_evict(block.block_id, block.block_hash)
        del self._hash_to_block_id[block.block_hash]
        for listener in self._listeners:
            listener(BlockRemoved((block.block_hash,)))
        block.block_hash = None
        self.evictions += 1
