"""KVCacheManager: block tables, prefix-cache hits (capped at num_tokens - 1), registration at allocation."""

from __future__ import annotations

from types import SimpleNamespace

from kvpager.core.hashing import RequestId, hash_prompt_blocks
from kvpager.core.kv_cache_manager import KVCacheManager
from kvpager.core.request import Request

SEED = b"\x01" * 32
BS = 4


def make_request(request_id: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(RequestId(request_id), list(tokens), SimpleNamespace(max_tokens=max_tokens))


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does at admission: prefix lookup, allocate, count the hit tokens as computed."""
    blocks, num_cached = kv.get_computed_blocks(request)
    n = request.num_tokens - num_cached if num_new is None else num_new
    new = kv.allocate_slots(request, n, blocks)
    if new is not None:
        request.num_computed_tokens = num_cached
    return new


def test_cold_prompt_gets_fresh_blocks_and_registers_its_full_blocks() -> None:
    kv = KVCacheManager(BS, 8, hash_seed=SEED)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    assert kv.block_ids(a.request_id) == (0, 1, 2)
    assert kv.block_hashes(a.request_id) == hash_prompt_blocks(SEED, list(range(10)), BS)
    assert kv.block_pool.num_cached_blocks == 2  # the partial third block is not cached
    assert kv.usage == 3 / 8


def test_identical_prompt_in_the_same_step_hits_the_blocks_being_computed() -> None:
    kv = KVCacheManager(BS, 8, hash_seed=SEED)
    a, b = make_request("a", list(range(10))), make_request("b", list(range(10)))
    admit(kv, a)  # a's K/V is not computed yet: it is written by the same forward b reads in
    assert kv.get_computed_blocks(b) == ([0, 1], 8)
    assert admit(kv, b) == [3]
    assert kv.block_ids(b.request_id) == (0, 1, 3)
    assert b.num_computed_tokens == 8
    assert [kv.block_pool.ref_cnt(i) for i in range(4)] == [2, 2, 1, 1]
    assert (kv.block_pool.queries, kv.block_pool.hits) == (20, 8)


def test_hits_stop_before_the_last_token() -> None:
    kv = KVCacheManager(BS, 8, hash_seed=SEED)
    admit(kv, make_request("a", list(range(12))))
    # 8 tokens = 2 full cached blocks, but the 8th token must be computed: only 1 block may hit.
    assert kv.get_computed_blocks(make_request("b", list(range(8)))) == ([0], 4)
    assert kv.get_computed_blocks(make_request("c", list(range(9)))) == ([0, 1], 8)
    assert kv.get_computed_blocks(make_request("d", [0, 1, 2, 9, 4, 5, 6, 7, 8])) == ([], 0)


def test_allocation_failure_returns_none_and_changes_nothing() -> None:
    kv = KVCacheManager(BS, 3, hash_seed=SEED)
    admit(kv, make_request("a", list(range(8))))
    b = make_request("b", list(range(100, 108)))
    assert kv.can_allocate(b, 8) is False
    assert kv.allocate_slots(b, 8) is None
    assert kv.block_ids(b.request_id) == ()
    assert kv.block_pool.num_free_blocks == 1 and kv.block_pool.queries == 8


def test_free_releases_tail_first_and_cached_blocks_survive_for_the_next_request() -> None:
    kv = KVCacheManager(BS, 3, hash_seed=SEED)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.block_pool.free_block_ids() == [2, 1, 0]
    assert kv.block_ids(a.request_id) == () and kv.block_pool.num_owned_blocks == 0
    # 12 tokens: blocks 0 and 1 hit (revived from the free queue), 1 more block is needed.
    b = make_request("b", list(range(8)) + [50, 51, 52, 53])
    assert kv.num_blocks_needed(b, 4, [0, 1]) == 3
    assert admit(kv, b) == [2]
    assert kv.block_ids(b.request_id) == (0, 1, 2) and kv.block_pool.evictions == 0


def test_revived_blocks_count_against_the_free_blocks() -> None:
    kv = KVCacheManager(BS, 3, hash_seed=SEED)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    c = make_request("c", list(range(8)) + list(range(50, 58)))  # 2 hits + 2 new = 4 > 3
    assert admit(kv, c) is None
    assert kv.block_pool.free_block_ids() == [2, 1, 0] and kv.block_pool.num_cached_blocks == 2


def test_decode_registers_a_block_once_output_tokens_fill_it() -> None:
    kv = KVCacheManager(BS, 8, hash_seed=SEED)
    a = make_request("a", [5, 6, 7])
    admit(kv, a)
    a.num_computed_tokens = 3
    a.append_output_token(8)  # 4 tokens known; position 3 is computed next step
    assert kv.allocate_slots(a, 1) == []
    assert kv.block_pool.num_cached_blocks == 1
    assert kv.block_hashes(a.request_id) == hash_prompt_blocks(SEED, [5, 6, 7, 8], BS)
    a.num_computed_tokens = 4
    a.append_output_token(9)
    assert kv.allocate_slots(a, 1) == [1]


def test_chunked_prefill_registers_only_blocks_full_after_this_chunk() -> None:
    kv = KVCacheManager(BS, 8, hash_seed=SEED)
    a = make_request("a", list(range(10)))
    assert admit(kv, a, num_new=5) == [0, 1]
    assert kv.block_pool.num_cached_blocks == 1
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 5) == [2]
    assert kv.block_pool.num_cached_blocks == 2


def test_caching_disabled_means_no_hits_and_no_hashes() -> None:
    kv = KVCacheManager(BS, 8, enable_caching=False, hash_seed=SEED)
    a, b = make_request("a", list(range(10))), make_request("b", list(range(10)))
    admit(kv, a)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert admit(kv, b) == [3, 4, 5]
    assert kv.block_hashes(a.request_id) == [] and kv.block_pool.num_cached_blocks == 0
    assert kv.block_pool.queries == 0


def test_eviction_hook_sees_the_block_and_hash_before_reuse() -> None:
    seen: list[tuple[int, bytes]] = []
    kv = KVCacheManager(BS, 2, hash_seed=SEED, on_evict=lambda block_id, h: seen.append((block_id, h)))
    a = make_request("a", list(range(8)))
    admit(kv, a)
    hashes = kv.block_hashes(a.request_id)
    kv.free(a)  # free queue: 1, 0
    admit(kv, make_request("b", list(range(100, 104))))
    assert seen == [(1, hashes[1])]
    assert kv.get_cached_block(hashes[0]) == 0 and kv.get_cached_block(hashes[1]) is None
