"""The KV map: a picture of every block, request and tier, for the /kv page and `kvpager kv top`. Torch-free.

Two halves, so the engine thread pays only for copies:
- `capture(scheduler, ...)` runs on the engine thread between two steps (never on a request's path):
  it copies ref counts, hashes, pins, the free queue's order, the block tables and each request's
  counters. O(blocks + tokens of live requests), no decoding, no JSON.
- `KVMapper.render(capture)` runs anywhere else: it classifies the blocks, names their owners,
  decodes their tokens' text (memoised by block hash) and returns the JSON document of
  docs/kv-map.md.

Block states (exactly one each): `free` (ref 0, no hash), `cached` (ref 0 with a hash: evictable,
`lru` = its place in the eviction order, 0 = next to go), `owned` (ref >= 1, held by requests; ref
>= 2 is a shared block), `pinned` (held by the pool itself, e.g. a KV pack; requests may share it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

from kvpager.core.hashing import BlockHash
from kvpager.core.scheduler import Scheduler

SCHEMA_VERSION = 1
HASH_PREFIX_HEX = 16  # hex characters of a block hash shown
MAX_TEXT_CHARS = 80  # decoded text of one block, cut to this
STATES = ("free", "cached", "owned", "pinned")
STATE_CHARS = {"free": ".", "cached": "c", "owned": "o", "pinned": "p"}  # `blocks.state`, one per block
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class RequestView:
    """One live request's counters and block table, as copied between steps."""

    request_id: str
    status: str  # waiting | waiting_for_remote_kvs | running | preempted
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    max_tokens: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # prompt + output, for the text of its blocks


@dataclass(frozen=True, slots=True)
class TierView:
    """One tier's counters. `unit` says what `hits`/`misses` count (tokens for the device pool)."""

    name: str  # device | host | disk | remote
    unit: str
    num_blocks: int
    bytes_held: int
    capacity_bytes: int | None
    hits: int
    misses: int
    bytes_in: int
    bytes_out: int
    evictions: int


@dataclass(frozen=True)
class KVCapture:
    """Everything `capture` copies; `tier_copies` maps a block id to the lower tiers holding its hash."""

    time: float
    block_size: int
    ref_counts: list[int]
    hashes: list[BlockHash | None]
    pins: dict[int, int]
    free_order: list[int]  # the free queue, head first (empty when no block is cached: order is moot then)
    tables: dict[str, tuple[int, ...]]
    requests: list[RequestView]
    prefix_queries: int
    prefix_hits: int
    evictions: int
    num_preemptions: int
    tiers: list[TierView] = field(default_factory=list)
    tier_copies: dict[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)


TierLookup = Callable[[BlockHash], tuple[str, ...]]


def capture(
    scheduler: Scheduler,
    tiers: Sequence[TierView] = (),
    tier_lookup: TierLookup | None = None,
    clock: Callable[[], float] = time.time,
) -> KVCapture:
    """Copy the pool, block tables, requests and tier counters. Call on the engine thread, between steps.

    `tier_lookup(hash)` names the lower tiers holding a copy of a hash (None: no lower tiers).
    """
    manager = scheduler.kv_manager
    pool = manager.block_pool
    hashes = pool.hashes()
    live = [*scheduler.running, *scheduler.waiting, *(r for r, _ in scheduler.loading.values())]
    requests = [_request_view(r, manager.block_ids(r.request_id)) for r in live]
    copies: dict[int, tuple[str, ...]] = {}
    if tier_lookup is not None:
        for block_id, block_hash in enumerate(hashes):
            if block_hash is not None:
                found = tier_lookup(block_hash)
                if found:
                    copies[block_id] = found
    return KVCapture(
        time=clock(),
        block_size=manager.block_size,
        ref_counts=pool.ref_counts(),
        hashes=hashes,
        pins=pool.pins(),
        free_order=pool.free_block_ids() if pool.num_cached_blocks else [],
        tables={str(k): v for k, v in manager.block_tables().items()},
        requests=requests,
        prefix_queries=pool.queries,
        prefix_hits=pool.hits,
        evictions=pool.evictions,
        num_preemptions=scheduler.num_preemptions,
        tiers=list(tiers),
        tier_copies=copies,
    )


def _request_view(request: Any, block_ids: tuple[int, ...]) -> RequestView:
    return RequestView(
        request_id=str(request.request_id),
        status=request.status.value,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        max_tokens=request.max_tokens,
        block_ids=block_ids,
        token_ids=tuple(request.all_token_ids),
    )


class KVMapper:
    """Turns captures into the JSON document; remembers each hash's text (bounded) and a short history.

    The text of a cached-but-free block is known only if the block was seen owned in an earlier
    capture (a hash does not reveal its tokens); otherwise it is absent.
    """

    def __init__(
        self,
        decode: Decode | None = None,
        planner: dict[str, Any] | None = None,
        history_len: int = 600,
        max_memo: int = 1 << 16,
    ) -> None:
        self.decode = decode
        self.planner = planner
        self.history: list[dict[str, Any]] = []
        self.history_len = history_len
        self.max_memo = max_memo
        self._text: OrderedDict[BlockHash, str] = OrderedDict()

    def render(self, cap: KVCapture) -> dict[str, Any]:
        """The snapshot document (docs/kv-map.md); appends one point to `history`.

        NOTE: blocks are columns: one state character per block, and ref counts, hashes, owners, pins,
        text and tier copies keyed by block id only where they apply, so the document grows with the
        blocks in use, not with the pool (one object per block was ten times slower to build and send).
        """
        pins, refs, hashes = cap.pins, cap.ref_counts, cap.hashes
        ids = range(cap.num_blocks)
        # NOTE: compress() walks the columns in C; Python code runs only for blocks in use.
        owned_ids = list(compress(ids, refs))
        hashed_ids = list(compress(ids, hashes))
        states = bytearray(b"." * cap.num_blocks)
        for block_id in hashed_ids:
            states[block_id] = ord("c")
        num_shared = 0
        for block_id in owned_ids:
            if block_id in pins:
                states[block_id] = ord("p")
            else:
                states[block_id] = ord("o")
                num_shared += refs[block_id] >= 2
        used_refs = {str(block_id): refs[block_id] for block_id in owned_ids}
        used_hashes = {str(block_id): bytes(hashes[block_id] or b"").hex()[:HASH_PREFIX_HEX] for block_id in hashed_ids}
        state_text = states.decode("ascii")
        counts = {name: states.count(ord(char)) for name, char in STATE_CHARS.items()}
        counts["shared"] = num_shared
        where = _owner_positions(cap)
        texts = self._texts(cap, where) if self.decode is not None else {}
        queries, hits = cap.prefix_queries, cap.prefix_hits
        point = {
            "t": cap.time,
            "usage": (counts["owned"] + counts["pinned"]) / cap.num_blocks if cap.num_blocks else 0.0,
            "prefix_queries": queries,
            "prefix_hits": hits,
            **{name: counts[name] for name in (*STATES, "shared")},
            "running": sum(1 for r in cap.requests if r.status == "running"),
            "waiting": sum(1 for r in cap.requests if r.status != "running"),
            "tiers": {t.name: _tier_point(t) for t in cap.tiers},
        }
        self.history.append(point)
        del self.history[: -self.history_len]
        return {
            "version": SCHEMA_VERSION,
            "time": cap.time,
            "block_size": cap.block_size,
            "num_blocks": cap.num_blocks,
            "counts": counts,
            "prefix_cache": {
                "queries": queries,
                "hits": hits,
                "hit_rate": hits / queries if queries else None,
                "evictions": cap.evictions,
            },
            "num_preemptions": cap.num_preemptions,
            "evict_order": [b for b in cap.free_order if cap.hashes[b] is not None],
            "blocks": {
                "state": state_text,
                "ref": used_refs,
                "hash": used_hashes,
                "owners": {str(block_id): owner[0] for block_id, owner in where.items()},
                "pins": {str(block_id): n for block_id, n in pins.items()},
                "text": texts,
                "tiers": {str(block_id): list(found) for block_id, found in cap.tier_copies.items()},
            },
            "requests": [self._request(r) for r in cap.requests],
            "tiers": [_tier_json(t) for t in cap.tiers],
            "planner": self.planner,
            "point": point,
        }

    def _texts(self, cap: KVCapture, where: dict[int, tuple[list[str], str, int]]) -> dict[str, str]:
        """Text of every owned block, and of every cached block whose hash was seen owned before."""
        by_id = {r.request_id: r for r in cap.requests}
        texts: dict[str, str] = {}
        for block_id, owner in where.items():
            text = self._text_of(cap, cap.hashes[block_id], owner, by_id)
            if text is not None:
                texts[str(block_id)] = text
        for block_id in cap.free_order:
            h = cap.hashes[block_id]
            if h is not None and h in self._text:
                texts[str(block_id)] = self._text[h]
        return texts

    def _text_of(
        self,
        cap: KVCapture,
        block_hash: BlockHash | None,
        owner: tuple[list[str], str, int],
        by_id: dict[str, RequestView],
    ) -> str | None:
        """An owned block's text: memoised by hash for full blocks, decoded from its first owner otherwise."""
        assert self.decode is not None
        if block_hash is not None and block_hash in self._text:
            self._text.move_to_end(block_hash)
            return self._text[block_hash]
        _, request_id, index = owner
        request = by_id.get(request_id)
        if request is None:  # a table outside the scheduler (e.g. an export between steps)
            return None
        start = index * cap.block_size
        tokens = request.token_ids[start : start + cap.block_size]
        text = self.decode(tokens)[:MAX_TEXT_CHARS]
        if block_hash is not None and len(tokens) == cap.block_size:
            self._text[block_hash] = text
            while len(self._text) > self.max_memo:
                self._text.popitem(last=False)
        return text

    @staticmethod
    def _request(r: RequestView) -> dict[str, Any]:
        return {
            "id": r.request_id,
            "status": r.status,
            "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": r.num_output_tokens,
            "computed_tokens": r.num_computed_tokens,
            "cached_tokens": r.num_cached_tokens,
            "preemptions": r.num_preemptions,
            "max_tokens": r.max_tokens,
            "blocks": list(r.block_ids),
        }


def _owner_positions(cap: KVCapture) -> dict[int, tuple[list[str], str, int]]:
    """block id -> (every owning request id, the first owner, the block's index in that owner's table)."""
    where: dict[int, tuple[list[str], str, int]] = {}
    for request_id, table in cap.tables.items():
        for index, block_id in enumerate(table):
            found = where.get(block_id)
            if found is None:
                where[block_id] = ([request_id], request_id, index)
            else:
                found[0].append(request_id)
    return where


def _tier_json(t: TierView) -> dict[str, Any]:
    return {
        "name": t.name,
        "unit": t.unit,
        "num_blocks": t.num_blocks,
        "bytes_held": t.bytes_held,
        "capacity_bytes": t.capacity_bytes,
        "occupancy": t.bytes_held / t.capacity_bytes if t.capacity_bytes else None,
        "hits": t.hits,
        "misses": t.misses,
        "bytes_in": t.bytes_in,
        "bytes_out": t.bytes_out,
        "evictions": t.evictions,
    }


def _tier_point(t: TierView) -> dict[str, Any]:
    return {
        "num_blocks": t.num_blocks,
        "bytes_held": t.bytes_held,
        "hits": t.hits,
        "misses": t.misses,
        "bytes_in": t.bytes_in,
        "bytes_out": t.bytes_out,
        "evictions": t.evictions,
    }
