"""The engine's side of the KV map: what `kvpager.core.kv_snapshot.capture` needs from the engine.

`capture_engine(engine)` must run on the engine thread between steps (`AsyncEngine.run_in_engine`):
it adds the device pool's and the lower tiers' counters and, per hashed block, which lower tiers
hold a copy. `planner_prediction(engine)` is computed once: what `kvpager plan` predicts for this
model, KV dtype, block size and budget, next to the pool the engine built.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpager.core.hashing import BlockHash
from kvpager.core.kv_snapshot import KVCapture, TierLookup, TierView, capture

logger = logging.getLogger("kvpager.engine.kv_map")


def tier_views(engine: Any) -> list[TierView]:
    """Device pool first, then host and disk when present (their own counters)."""
    pool = engine.kv_manager.block_pool
    stats = engine.kv_tier_stats()
    bytes_per_block = int(engine.pool.bytes_per_block)
    owned = pool.num_owned_blocks
    device = TierView(
        name="device",
        unit="tokens",
        num_blocks=owned,
        bytes_held=owned * bytes_per_block,
        capacity_bytes=int(engine.pool.num_bytes),
        hits=pool.hits,
        misses=pool.queries - pool.hits,
        bytes_in=stats.restored.bytes + stats.imported.bytes,
        bytes_out=stats.offloaded.bytes + stats.exported.bytes,
        evictions=pool.evictions,
    )
    views = [device]
    config = engine.config
    capacities = {"host": config.host_kv_cache_memory, "disk": config.resolved_kv_cache_dir_max_bytes}
    for name, tier in (("host", stats.host), ("disk", stats.disk)):
        if tier is not None:
            views.append(
                TierView(
                    name=name,
                    unit="blocks",
                    num_blocks=tier.num_blocks,
                    bytes_held=tier.bytes_held,
                    capacity_bytes=capacities[name],
                    hits=tier.hits,
                    misses=tier.misses,
                    bytes_in=tier.bytes_in,
                    bytes_out=tier.bytes_out,
                    evictions=tier.evictions,
                )
            )
    return views


def tier_lookup(engine: Any) -> TierLookup | None:
    """hash -> names of the lower tiers holding it (membership only: no LRU touch, no counters)."""
    store = engine.kv_store
    if store is None:
        return None
    tiers = store.tiers
    present = [(name, tier) for name, tier in (("host", tiers.host), ("disk", tiers.disk)) if tier is not None]

    def lookup(block_hash: BlockHash) -> tuple[str, ...]:
        return tuple(name for name, tier in present if block_hash in tier)

    return lookup


def capture_engine(engine: Any) -> KVCapture:
    """The KV map's raw copy of `engine` (an `Engine`). Engine thread only, between steps."""
    return capture(engine.scheduler, tier_views(engine), tier_lookup(engine))


def planner_prediction(engine: Any) -> dict[str, Any] | None:
    """The planner's blocks and max concurrency for this config, beside the measured pool; None if it cannot plan."""
    from kvpager.planner import PlanOptions, load_model_facts, make_plan

    config, pool = engine.config, engine.pool
    budget = config.kv_cache_memory if config.kv_cache_memory is not None else int(pool.num_bytes)
    try:
        facts = load_model_facts(str(engine.loaded.model_dir))
        options = PlanOptions(
            kv_dtype=config.resolved_kv_cache_dtype,
            block_size=config.block_size,
            kv_cache_memory=budget,
            max_model_len=engine.max_model_len,
            context=engine.max_model_len,
        )
        plan = make_plan(facts, options, None)
    except (ValueError, OSError, KeyError) as error:
        logger.info("KV map: no planner prediction for this model: %s", error)
        return None
    return {
        "kv_budget_bytes": budget,
        "budget_source": "--kv-cache-memory" if config.kv_cache_memory is not None else "the pool's bytes",
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "max_model_len": plan.max_model_len,
        "num_blocks": plan.engine_num_blocks,
        "max_concurrency": plan.engine_max_concurrency,
        "measured_num_blocks": int(pool.num_blocks),
        "measured_max_concurrency": int(pool.max_concurrency(engine.max_model_len)),
    }
