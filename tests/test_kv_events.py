"""KV events: the pool announces every hash it caches and evicts; the event log's view equals the
pool's own prefix cache at every step, and two managers seeded with the same fingerprint produce
events a router can compare against a prompt it hashes itself."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpager.core.block_pool import BlockPool
from kvpager.core.hashing import RequestId, hash_prompt_blocks
from kvpager.core.kv_cache_manager import KVCacheManager
from kvpager.core.kv_events import BlockRemoved, BlockStored, KVEventLog, PrefixIndex, longest_prefix
from kvpager.core.request import Request
from kvpager.core.sampling_params import SamplingParams

SEED = b"\x07" * 32
BS = 4


def test_pool_emits_stored_on_cache_and_removed_on_eviction() -> None:
    pool = BlockPool(2)
    events: list[object] = []
    pool.add_listener(events.append)
    a, b = hash_prompt_blocks(SEED, list(range(8)), BS)
    ids = pool.allocate(2)
    assert pool.cache_block(ids[0], a) and pool.cache_block(ids[1], b)
    assert pool.cache_block(ids[1], b)  # re-caching the same hash is not a new event
    pool.free(ids)
    pool.allocate(1)  # reuses the chain's tail first: evicts b
    assert events == [BlockStored((a,), (ids[0],)), BlockStored((b,), (ids[1],)), BlockRemoved((b,))]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 14), st.booleans()), min_size=1, max_size=30))
def test_event_log_tracks_the_prefix_cache_exactly(ops: list[tuple[int, int, bool]]) -> None:
    manager = KVCacheManager(BS, num_blocks=8, hash_seed=SEED)
    log = KVEventLog()
    manager.block_pool.add_listener(log)
    live: dict[str, Request] = {}
    for step, (prompt_seed, length, finish) in enumerate(ops):
        rid = f"r{step}"
        rng = random.Random(prompt_seed)
        prompt = [rng.randrange(1, 50) for _ in range(length)]
        request = Request(RequestId(rid), prompt, SamplingParams(max_tokens=1))
        hits, num_hit = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, request.num_tokens - num_hit, hits) is not None:
            request.num_computed_tokens = request.num_tokens
            live[rid] = request
        if finish and live:
            manager.free(live.pop(next(iter(live))))
        assert log.held == {h for h, _ in manager.block_pool.cached_blocks()}


def test_events_of_two_replicas_are_comparable_with_a_prompt_hashed_elsewhere() -> None:
    shared = list(range(3, 3 + 12))  # 3 full blocks
    index = PrefixIndex()
    for name, prompt in (("r0", shared + [90, 91, 92, 93, 94]), ("r1", shared[:4] + [70] * 9)):
        manager = KVCacheManager(BS, num_blocks=16, hash_seed=SEED)
        log = KVEventLog()
        manager.block_pool.add_listener(log)
        request = Request(RequestId("x"), prompt, SamplingParams(max_tokens=1))
        manager.allocate_slots(request, request.num_tokens)
        index.apply(name, log.drain())
        assert log.drain() == []
    chain = hash_prompt_blocks(SEED, shared + [1, 2, 3, 4, 5], BS)  # the router's own hashing
    assert index.match(chain) == {"r0": 3, "r1": 1}
    assert longest_prefix(chain, set()) == 0
    other_model = hash_prompt_blocks(b"\x08" * 32, shared, BS)  # another fingerprint never matches
    assert index.match(other_model) == {"r0": 0, "r1": 0}
    index.remove("r1")
    assert index.replicas == ["r0"]


def test_event_log_bounds_its_pending_list_but_keeps_the_held_set() -> None:
    log = KVEventLog(max_pending=2)
    hashes = hash_prompt_blocks(SEED, list(range(12)), BS)
    for i, block_hash in enumerate(hashes):
        log(BlockStored((block_hash,), (i,)))
    assert len(log.drain()) == 2 and log.num_dropped == 1 and log.held == set(hashes)
