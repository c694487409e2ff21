"""Shared by the KV map tests: a snapshot document checked against the pool and tables; a threaded server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvpager.core.hashing import BlockHash
from kvpager.core.kv_snapshot import HASH_PREFIX_HEX, STATE_CHARS, STATES
from kvpager.core.scheduler import Scheduler


def blocks_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The document's block columns as one dict per block (the keys of docs/kv-map.md's columns)."""
    names = {char: name for name, char in STATE_CHARS.items()}
    columns = doc["blocks"]
    out = []
    for block_id, char in enumerate(columns["state"]):
        key = str(block_id)
        block: dict[str, Any] = {"id": block_id, "state": names[char], "ref": columns["ref"].get(key, 0)}
        for name in ("hash", "owners", "pins", "text", "tiers"):
            if key in columns[name]:
                block[name] = columns[name][key]
        out.append(block)
    return out


def check_snapshot(doc: dict[str, Any], scheduler: Scheduler, tiers_of: Callable[[BlockHash], list[str]]) -> None:
    """Every claim of the document, checked against the pool, the KV manager and the lower tiers (`tiers_of`)."""
    manager = scheduler.kv_manager
    pool = manager.block_pool
    counts = doc["counts"]
    blocks = blocks_of(doc)
    assert doc["num_blocks"] == pool.num_blocks == len(blocks)
    assert sum(counts[s] for s in STATES) == pool.num_blocks
    assert counts["owned"] + counts["pinned"] == pool.num_owned_blocks
    assert counts["free"] + counts["cached"] == pool.num_free_blocks
    assert doc["evict_order"] == [b for b in pool.free_block_ids() if pool.block_hash(b) is not None]
    owners: dict[int, list[str]] = {}
    live = [*scheduler.running, *scheduler.waiting, *(r for r, _ in scheduler.loading.values())]
    for request in live:  # NOTE: a prefix load from a tier holds its blocks for its request
        for block_id in manager.block_ids(request.request_id) + manager.loading_block_ids(request.request_id):
            owners.setdefault(block_id, []).append(str(request.request_id))
    for block in blocks:
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
    assert counts["shared"] == sum(1 for b in blocks if b["state"] == "owned" and b["ref"] >= 2)
    assert [r["id"] for r in doc["requests"]] == [str(r.request_id) for r in live]
    for row, request in zip(doc["requests"], live, strict=True):
        assert row["blocks"] == list(manager.block_ids(request.request_id))
        assert row["computed_tokens"] == request.num_computed_tokens
        assert row["preemptions"] == request.num_preemptions
    assert doc["num_preemptions"] == scheduler.num_preemptions
    assert doc["prefix_cache"]["hits"] == pool.hits and doc["prefix_cache"]["queries"] == pool.queries


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run `app` with uvicorn on a free local port in a thread (lifespan included); yields its URL."""
    import uvicorn
    from server_harness import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
