"""Checks shared by the KV map tests: a snapshot document against the scheduler's pool and tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpager.core.hashing import BlockHash
from kvpager.core.kv_snapshot import HASH_PREFIX_HEX, STATES
from kvpager.core.scheduler import Scheduler


def check_snapshot(doc: dict[str, Any], scheduler: Scheduler, tiers_of: Callable[[BlockHash], list[str]]) -> None:
    """Every claim of the document, checked against the pool, the KV manager and the lower tiers (`tiers_of`)."""
    manager = scheduler.kv_manager
    pool = manager.block_pool
    counts = doc["counts"]
    assert doc["num_blocks"] == pool.num_blocks == len(doc["blocks"])
    assert sum(counts[s] for s in STATES) == pool.num_blocks
    assert counts["owned"] + counts["pinned"] == pool.num_owned_blocks
    assert counts["free"] + counts["cached"] == pool.num_free_blocks
    assert doc["free_lru"] == pool.free_block_ids()
    owners: dict[int, list[str]] = {}
    live = [*scheduler.running, *scheduler.waiting]
    for request in live:
        for block_id in manager.block_ids(request.request_id):
            owners.setdefault(block_id, []).append(str(request.request_id))
    for block in doc["blocks"]:
        block_id = block["id"]
        block_hash = pool.block_hash(block_id)
        assert block["ref"] == pool.ref_cnt(block_id)
        assert block.get("pins", 0) == pool.num_pins(block_id)
        assert block["ref"] == len(block.get("owners", [])) + pool.num_pins(block_id)
        assert sorted(block.get("owners", [])) == sorted(owners.get(block_id, []))
        assert block.get("hash") == (block_hash.hex()[:HASH_PREFIX_HEX] if block_hash is not None else None)
        want_state = (
            "pinned"
            if pool.num_pins(block_id)
            else "owned"
            if pool.ref_cnt(block_id)
            else ("cached" if block_hash is not None else "free")
        )
        assert block["state"] == want_state
        assert block.get("tiers", []) == (tiers_of(block_hash) if block_hash is not None else [])
    assert counts["shared"] == sum(1 for b in doc["blocks"] if b["state"] == "owned" and b["ref"] >= 2)
    assert [r["id"] for r in doc["requests"]] == [str(r.request_id) for r in live]
    for row, request in zip(doc["requests"], live, strict=True):
        assert row["blocks"] == list(manager.block_ids(request.request_id))
        assert row["computed_tokens"] == request.num_computed_tokens
        assert row["preemptions"] == request.num_preemptions
    assert doc["num_preemptions"] == scheduler.num_preemptions
    assert doc["prefix_cache"]["hits"] == pool.hits and doc["prefix_cache"]["queries"] == pool.queries
