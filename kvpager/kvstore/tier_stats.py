"""Counters of the KV tiers and of the blocks moved between them and the device pool (for /metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvpager.kvstore.tiers import TierStats


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
    blocks copied into the tiers, `restored` tier blocks copied back into the pool (`bytes` = raw
    device bytes); `exported`/`imported` count KV payloads (`bytes` = payload bytes); `dropped`
    counts copied-out blocks not written because the write queue was full. Taken without waiting
    for the background I/O in flight (`TieredBlockStore.drain` settles it).
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
    dropped: int = 0

    def as_dict(self) -> dict[str, float]:
        """Flat `{name: value}` (e.g. `host_hits`, `disk_skipped`, `restored_seconds`) for metrics."""
        flat: dict[str, float] = {
            "device_evictions": self.device_evictions,
            "pinned_blocks": self.pinned_blocks,
            "dropped": self.dropped,
        }
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
