"""BlockPool: ref counts, LRU free queue (eviction order), prefix cache map, pins, eviction hook."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpager.core.block_pool import BlockPool
from kvpager.core.hashing import BlockHash, hash_prompt_blocks

SEED = b"\x00" * 32
BS = 2


def h(tag: int) -> BlockHash:
    return hash_prompt_blocks(SEED, [tag, tag], BS)[0]


def test_fresh_pool_hands_out_blocks_in_id_order() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert (pool.num_free_blocks, pool.num_owned_blocks) == (1, 3)
    assert [pool.ref_cnt(b) for b in range(4)] == [1, 1, 1, 0]


def test_free_releases_tail_first_so_chain_ends_are_evicted_first() -> None:
    pool = BlockPool(6)
    table = pool.allocate(4)  # [0, 1, 2, 3]
    pool.free(table)
    assert pool.free_block_ids() == [4, 5, 3, 2, 1, 0]
    assert pool.allocate(3) == [4, 5, 3]


def test_unused_blocks_go_back_to_the_head_so_no_cached_block_is_evicted_for_them() -> None:
    pool = BlockPool(4)
    first = pool.allocate(2)  # [0, 1]
    pool.cache_block(0, h(1))
    pool.free(first)  # queue: 2, 3, 1, 0 (0 holds h(1))
    unused = pool.allocate(3)  # [2, 3, 1]: blocks for a load that fails
    pool.free_unused(unused)
    assert set(pool.free_block_ids()[:3]) == {1, 2, 3} and pool.free_block_ids()[3] == 0
    assert len(pool.allocate(3)) == 3 and pool.get_cached_block(h(1)) == 0 and pool.evictions == 0
    other = BlockPool(1)
    (block,) = other.allocate(1)
    other.cache_block(block, h(2))
    with pytest.raises(ValueError, match="cached"):
        other.free_unused([block])


def test_allocating_a_cached_free_block_evicts_its_hash_and_calls_the_hook() -> None:
    evicted: list[tuple[int, BlockHash]] = []
    pool = BlockPool(2, on_evict=lambda block_id, block_hash: evicted.append((block_id, block_hash)))
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(1)) and pool.cache_block(b, h(2))
    pool.free([a, b])  # free queue: b, a
    assert pool.num_cached_blocks == 2 and pool.get_cached_block(h(1)) == a
    assert pool.allocate(1) == [b]
    assert evicted == [(b, h(2))]
    assert pool.get_cached_block(h(2)) is None and pool.block_hash(b) is None
    assert pool.get_cached_block(h(1)) == a and pool.evictions == 1


def test_touch_revives_a_cached_free_block_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[1], h(7))
    pool.free(blocks)  # queue: 2, 1, 0
    pool.touch([pool.get_cached_block(h(7)) or 0])
    assert pool.free_block_ids() == [2, 0]
    assert pool.ref_cnt(1) == 1 and pool.num_owned_blocks == 1
    assert pool.evictions == 0 and pool.get_cached_block(h(7)) == 1


def test_shared_block_returns_to_the_queue_only_when_the_last_owner_frees_it() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.touch([a])
    pool.free([a])
    assert pool.ref_cnt(a) == 1 and a not in pool.free_block_ids()
    pool.free([a])
    assert pool.free_block_ids() == [1, a]
    with pytest.raises(ValueError, match="already free"):
        pool.free([a])


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_duplicate_hash_keeps_the_first_block_as_the_cached_copy() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(3)) is True
    assert pool.cache_block(b, h(3)) is False
    assert pool.get_cached_block(h(3)) == a and pool.block_hash(b) is None


def test_caching_disabled_never_registers_or_finds_blocks() -> None:
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    assert pool.cache_block(a, h(3)) is False
    assert pool.get_cached_block(h(3)) is None and pool.num_cached_blocks == 0


def test_pins_hold_a_reference_until_unpinned() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], h(5))
    pool.pin([blocks[0]])
    pool.free(blocks)
    assert pool.ref_cnt(blocks[0]) == 1 and pool.num_pins(blocks[0]) == 1
    assert pool.allocate(2) == [2, blocks[1]]  # the pinned block is never evicted
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin([blocks[1]])
    pool.unpin([blocks[0]])
    assert pool.free_block_ids() == [blocks[0]] and pool.get_cached_block(h(5)) == blocks[0]


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / share (prefix hit) / free / pin sequences against a plain-Python model."""

    def __init__(self) -> None:
        super().__init__()
        self.num_blocks = 8
        self.evicted: list[int] = []
        self.pool = BlockPool(self.num_blocks, on_evict=lambda block_id, _h: self.evicted.append(block_id))
        self.model_free = list(range(self.num_blocks))  # the expected free queue, head first
        self.req_blocks: dict[int, list[int]] = {}
        self.pins: Counter[int] = Counter()
        self.block_prefix: dict[int, list[int]] = {}  # tokens from sequence start to block end
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=4 * BS))
    def add_request(self, tokens: list[int]) -> None:
        hashes = hash_prompt_blocks(SEED, tokens, BS)
        hits: list[int] = []
        for block_hash in hashes:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        num_new = -(-len(tokens) // BS) - len(hits)
        revived = [b for b in hits if b in self.model_free]
        if num_new > len(self.model_free) - len(revived):
            return
        self.pool.touch(hits)
        self.model_free = [b for b in self.model_free if b not in hits]
        expected_victims = [b for b in self.model_free[:num_new] if self.pool.block_hash(b) is not None]
        self.evicted.clear()
        new = self.pool.allocate(num_new)
        assert new == self.model_free[:num_new]  # NOTE: LRU: the head of the queue goes first
        assert self.evicted == expected_victims
        del self.model_free[:num_new]
        table = hits + new
        for index in range(len(hits), len(hashes)):
            self.pool.cache_block(table[index], hashes[index])
        for index, block_id in enumerate(table):
            self.block_prefix[block_id] = tokens[: (index + 1) * BS]
        self.req_blocks[self.next_id] = table
        self.next_id += 1

    @precondition(lambda self: self.req_blocks)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.req_blocks)))
        table = self.req_blocks.pop(request_id)
        self.pool.free(table)
        self._release(table)

    @precondition(lambda self: any(self.req_blocks.values()))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        owned = sorted({b for table in self.req_blocks.values() for b in table})
        block_id = data.draw(st.sampled_from(owned))
        self.pool.pin([block_id])
        self.pins[block_id] += 1

    @precondition(lambda self: +self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(sorted(+self.pins)))
        self.pool.unpin([block_id])
        self.pins[block_id] -= 1
        self._release([block_id])

    def _release(self, table: list[int]) -> None:
        for block_id in reversed(table):
            if self._expected_ref(block_id) == 0:
                self.model_free.append(block_id)

    def _expected_ref(self, block_id: int) -> int:
        owners = sum(table.count(block_id) for table in self.req_blocks.values())
        return owners + self.pins[block_id]

    @invariant()
    def every_block_is_in_exactly_one_place(self) -> None:
        free = self.pool.free_block_ids()
        assert free == self.model_free
        assert len(set(free)) == len(free)
        for block_id in range(self.num_blocks):
            ref = self.pool.ref_cnt(block_id)
            assert ref == self._expected_ref(block_id)
            assert (ref == 0) == (block_id in free)
        assert self.pool.num_owned_blocks == self.num_blocks - len(free)

    @invariant()
    def cached_hashes_match_the_tokens_held(self) -> None:
        num_cached = 0
        for block_id in range(self.num_blocks):
            block_hash = self.pool.block_hash(block_id)
            if block_hash is None:
                continue
            num_cached += 1
            assert self.pool.get_cached_block(block_hash) == block_id
            assert hash_prompt_blocks(SEED, self.block_prefix[block_id], BS)[-1] == block_hash
        assert num_cached == self.pool.num_cached_blocks

    def teardown(self) -> None:
        for table in self.req_blocks.values():
            self.pool.free(table)
        for block_id, count in self.pins.items():
            self.pool.unpin([block_id] * count)
        assert self.pool.num_owned_blocks == 0
        assert self.pool.num_free_blocks == self.num_blocks


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
