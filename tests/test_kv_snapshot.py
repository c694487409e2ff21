"""The KV map (kvpager.core.kv_snapshot) against the block pool's own state, after every step of a
workload with shared prefixes, preemption, pinned blocks and blocks moving to a lower tier and back.

Torch-free: the scheduler and KV manager are driven by a fake runner; the lower tier is a dict store.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from kv_map_checks import blocks_of, check_snapshot

from kvpager.core.hashing import BlockHash, RequestId, hash_prompt_blocks
from kvpager.core.kv_cache_manager import KVCacheManager
from kvpager.core.kv_snapshot import KVMapper, TierView, capture
from kvpager.core.request import Request, RequestStatus
from kvpager.core.scheduler import Scheduler, SchedulerConfig

SEED = b"\x03" * 32
BLOCK = 4


class DictStore:
    """A lower tier: keeps what the pool evicts (by hash), hands it back on a prefix miss."""

    def __init__(self) -> None:
        self.held: set[BlockHash] = set()
        self.finished: dict[int, int] = {}
        self.hits = 0
        self.misses = 0

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.held

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        self.held.add(block_hash)

    def start_load(self, job_id: int, blocks: Sequence[tuple[BlockHash, int]]) -> None:
        """Loads complete at once; the scheduler sees them at its next step."""
        num_loaded = 0
        for block_hash, _block_id in blocks:
            if block_hash not in self.held:
                self.misses += 1
                break
            self.hits += 1
            num_loaded += 1
        self.finished[job_id] = num_loaded

    def start_lookup(self, job_id: int, hashes: Sequence[BlockHash]) -> bool:
        return False  # NOTE: an in-memory store answers `contains` at once

    def finished_loads(self) -> dict[int, int]:
        finished, self.finished = self.finished, {}
        return finished

    def wait_for_loads(self, timeout: float) -> None:
        pass

    def view(self) -> TierView:
        return TierView("host", "blocks", len(self.held), len(self.held) * 64, None, self.hits, self.misses, 0, 0, 0)


def decode(tokens: Any) -> str:
    return " ".join(f"t{t}" for t in tokens)


def test_snapshot_matches_the_pool_after_every_step_of_a_sharing_preempting_tiered_workload() -> None:
    store = DictStore()
    manager = KVCacheManager(BLOCK, 13, enable_caching=True, hash_seed=SEED, store=store)
    scheduler = Scheduler(SchedulerConfig(4, 64, None, BLOCK), manager, clock=lambda: 0.0)
    pinned = list(range(200, 208))  # two full blocks pinned as a KV pack would be
    pinned_ids = manager.insert_blocks(hash_prompt_blocks(SEED, pinned, BLOCK), store_all(pinned), pin=True)
    assert len(pinned_ids) == 2
    shared = list(range(1, 13))  # three full blocks every "s" request shares
    prompts = {
        "s0": shared + [50, 51],
        "s1": shared + [60],
        "s2": shared + [70, 71, 72],
        "p0": pinned + [80],  # starts with the pinned prefix: shares the pinned blocks
        "f0": list(range(300, 318)),  # unrelated: pushes cached blocks out to the store
        "s3": shared + [90],  # comes back after the eviction: its prefix returns from the store
    }
    mapper = KVMapper(decode=decode)
    seen = {"shared": 0, "preempted": 0, "tier_copies": 0, "pinned_shared": 0}
    for name, prompt in prompts.items():
        scheduler.add_request(Request(RequestId(name), prompt, SimpleNamespace(max_tokens=10)))
    for step in range(200):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        doc = mapper.render(capture(scheduler, [store.view()], lambda h: ("host",) if store.contains(h) else ()))
        check_snapshot(doc, scheduler, lambda h: ["host"] if store.contains(h) else [])
        seen["shared"] = max(seen["shared"], doc["counts"]["shared"])
        seen["preempted"] = max(seen["preempted"], doc["num_preemptions"])
        seen["tier_copies"] = max(seen["tier_copies"], len(doc["blocks"]["tiers"]))
        seen["pinned_shared"] = max(
            seen["pinned_shared"], sum(1 for b in blocks_of(doc) if b["state"] == "pinned" and b.get("owners"))
        )
        sampled = {s.request_id: 7 + step for s in out.scheduled if s.needs_sample}
        for request in scheduler.update_from_output(out, sampled):
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    assert not scheduler.has_unfinished()
    assert seen["shared"] >= 3, seen  # the shared prefix was held by several requests at once
    assert seen["preempted"] >= 1, seen  # 13 blocks are too few for four requests at once
    assert seen["tier_copies"] >= 1 and store.hits >= 1, seen  # blocks went down to the store and came back
    assert seen["pinned_shared"] == 2, seen
    final = mapper.render(capture(scheduler))
    assert final["counts"]["pinned"] == 2 and final["counts"]["owned"] == 0 and final["requests"] == []
    assert final["counts"]["cached"] > 0
    assert len(mapper.history) == step + 1


def store_all(tokens: list[int]) -> Any:
    """A block source holding every block of `tokens` (what a loaded KV pack is)."""
    hashes = set(hash_prompt_blocks(SEED, tokens, BLOCK))
    return SimpleNamespace(contains=hashes.__contains__, load_into=lambda h, _block_id: h in hashes)


def test_block_text_comes_from_its_owner_and_stays_known_after_the_block_is_freed() -> None:
    manager = KVCacheManager(BLOCK, 8, enable_caching=True, hash_seed=SEED)
    scheduler = Scheduler(SchedulerConfig(4, 64, None, BLOCK), manager, clock=lambda: 0.0)
    request = Request(RequestId("a"), [5, 6, 7, 8, 9, 10], SimpleNamespace(max_tokens=4))
    scheduler.add_request(request)
    mapper = KVMapper(decode=decode)
    scheduler.schedule()
    blocks = blocks_of(mapper.render(capture(scheduler)))
    table = manager.block_ids(RequestId("a"))
    assert blocks[table[0]]["text"] == "t5 t6 t7 t8"
    assert blocks[table[1]]["text"] == "t9 t10"  # the partial last block: its tokens so far
    assert blocks[table[0]]["owners"] == ["a"]
    scheduler.finish_request(RequestId("a"), RequestStatus.FINISHED_ABORTED)
    doc = mapper.render(capture(scheduler))
    blocks = blocks_of(doc)
    first = blocks[table[0]]
    assert first["state"] == "cached" and first["text"] == "t5 t6 t7 t8" and "owners" not in first
    assert blocks[table[1]]["state"] == "free" and "text" not in blocks[table[1]]
    assert doc["evict_order"] == [table[0]]  # the one cached block: next to go
