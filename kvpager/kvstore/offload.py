"""The glue between the device pool and the KV tiers: the `BlockStore` the KV manager talks to.

The pool calls `on_evict(block_id, hash)` before it reuses a cached block (at allocation time, during
`schedule()`, so before the runner's next forward overwrites it): the block's K/V is copied into the
tiers (host first, spilling to disk: `KVTiers` is write-back). A prefix lookup that misses the pool
asks `contains`/`load_into`: the tiers' copy is decoded and written into a fresh device block.
The scheduler and the pool never see a tier; they see a `BlockStore` or nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from kvpager.core.config import EngineConfig
from kvpager.core.hashing import BlockHash
from kvpager.kvstore.codec import get_codec
from kvpager.kvstore.remote import RemoteTier
from kvpager.kvstore.tiers import DiskTier, HostTier, KVTiers, TierStats


class BlockIO(Protocol):
    """Reads and writes one block of the device KV pool (the `ModelRunner`)."""

    def read_block(self, block_id: int) -> torch.Tensor: ...

    def write_block(self, block_id: int, block: torch.Tensor) -> None: ...


@dataclass
class MoveCounters:
    """Blocks moved between the device pool and the tiers, or in and out of the engine (packs)."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class KVTierStats:
    """Everything `engine.kv_tier_stats()` reports (for /metrics and `kvpager bench`).

    `host`/`disk` are the tiers' own counters (None when the tier is off); `offloaded` counts device
    evictions copied into the tiers, `restored` tier blocks copied back into the pool (`bytes` =
    raw device bytes); `exported`/`imported` count KV payloads (`bytes` = payload bytes).
    """

    host: TierStats | None
    disk: TierStats | None
    device_evictions: int
    remote: TierStats | None = None
    offloaded: MoveCounters = field(default_factory=MoveCounters)
    restored: MoveCounters = field(default_factory=MoveCounters)
    exported: MoveCounters = field(default_factory=MoveCounters)
    imported: MoveCounters = field(default_factory=MoveCounters)
    pinned_blocks: int = 0

    def as_dict(self) -> dict[str, float]:
        """Flat `{name: value}` (e.g. `host_hits`, `disk_skipped`, `restored_seconds`) for metrics."""
        flat: dict[str, float] = {"device_evictions": self.device_evictions, "pinned_blocks": self.pinned_blocks}
        for tier_name, tier in (("host", self.host), ("disk", self.disk), ("remote", self.remote)):
            if tier is not None:
                flat.update({f"{tier_name}_{key}": value for key, value in asdict(tier).items()})
        for move_name in ("offloaded", "restored", "exported", "imported"):
            counters = getattr(self, move_name)
            flat.update({f"{move_name}_{key}": value for key, value in asdict(counters).items()})
        return flat

    def summary(self) -> str:
        """One line for benchmark output."""
        parts = [f"device evictions {self.device_evictions}"]
        for name, tier in (("host", self.host), ("disk", self.disk), ("remote", self.remote)):
            if tier is not None:
                parts.append(
                    f"{name} {tier.hits} hits/{tier.misses} misses, {tier.num_blocks} blocks "
                    f"{tier.bytes_held / (1 << 20):.1f} MiB, {tier.evictions} evictions"
                    + (f", {tier.skipped} skipped" if name == "disk" else "")
                )
        parts.append(f"restored {self.restored.blocks} blocks in {self.restored.seconds * 1e3:.1f} ms")
        parts.append(f"offloaded {self.offloaded.blocks} blocks in {self.offloaded.seconds * 1e3:.1f} ms")
        if self.pinned_blocks:
            parts.append(f"pinned {self.pinned_blocks} blocks")
        return "kv tiers: " + "; ".join(parts)


def build_tiers(config: EngineConfig, fingerprint: bytes) -> KVTiers | None:
    """The host, disk and/or remote tiers the config asks for, or None when it asks for none."""
    if config.host_kv_cache_memory is None and config.kv_cache_dir is None and config.kv_cache_remote is None:
        return None
    codec = get_codec(config.kv_codec)
    host = HostTier(config.host_kv_cache_memory, codec) if config.host_kv_cache_memory is not None else None
    disk = None
    if config.kv_cache_dir is not None:
        disk = DiskTier(config.kv_cache_dir, config.resolved_kv_cache_dir_max_bytes, fingerprint, codec)
    remote = None
    if config.kv_cache_remote is not None:
        remote = RemoteTier.from_url(config.kv_cache_remote, fingerprint, codec, config.kv_cache_remote_timeout)
    return KVTiers(host, disk, remote)


class TieredBlockStore:
    """`BlockStore` over `KVTiers`: device evictions go down into the tiers, prefix misses come back up."""

    def __init__(self, tiers: KVTiers, io: BlockIO, device: torch.device | str = "cpu") -> None:
        self.tiers = tiers
        self.io = io
        self.device = device
        self.offloaded = MoveCounters()
        self.restored = MoveCounters()

    def contains(self, block_hash: BlockHash) -> bool:
        return self.tiers.contains(block_hash)

    def load_into(self, block_hash: BlockHash, block_id: int) -> bool:
        """Copy the tiers' block into device block `block_id`; False on a miss or a bad disk record."""
        start = time.perf_counter()
        block = self.tiers.lookup(block_hash, self.device)
        if block is None:
            return False
        self.io.write_block(block_id, block)
        self._count(self.restored, block, start)
        return True

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        """Copy a block the pool is about to reuse into the tiers (its K/V is still intact)."""
        self.put(block_hash, self.io.read_block(block_id))

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> None:
        """Keep `block` ([num_layers, 2, block_size, num_kv_heads, head_dim]) in the tiers."""
        start = time.perf_counter()
        is_new = not self.tiers.contains(block_hash)
        self.tiers.offload(block_hash, block)  # NOTE: a held block is only refreshed (LRU), never rewritten
        if is_new:
            self._count(self.offloaded, block, start)

    def persist(self, cached: Sequence[tuple[BlockHash, int]]) -> int:
        """At shutdown: copy the pool's cached blocks into the tiers, then flush host to disk."""
        for block_hash, block_id in cached:
            if not self.tiers.contains(block_hash):
                self.on_evict(block_id, block_hash)
        return self.tiers.flush()

    def stats(self, device_evictions: int) -> KVTierStats:
        return KVTierStats(
            host=self.tiers.host.stats if self.tiers.host is not None else None,
            disk=self.tiers.disk.stats if self.tiers.disk is not None else None,
            device_evictions=device_evictions,
            remote=self.tiers.remote.stats if self.tiers.remote is not None else None,
            offloaded=MoveCounters(**asdict(self.offloaded)),
            restored=MoveCounters(**asdict(self.restored)),
        )

    @staticmethod
    def _count(counters: MoveCounters, block: torch.Tensor, start: float) -> None:
        counters.blocks += 1
        counters.bytes += block.numel() * block.element_size()
        counters.seconds += time.perf_counter() - start
