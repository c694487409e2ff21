"""KV events: the block hashes a pool stores and evicts, for listeners outside the engine. Torch-free.

The `BlockPool` emits `BlockStored` when a full block is registered in the prefix cache (at
allocation, before the step's forward writes it: a listener that needs the bytes reads them after
the step) and `BlockRemoved` when a cached block's hash is dropped for reuse. Hashes are the portable
hash chain seeded by the model fingerprint (`core/hashing.py`), so the events of two replicas of the
same model are comparable: a router can hash a prompt itself and ask which replica holds the longest
prefix of it (`PrefixIndex`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvpager.core.hashing import BlockHash

DEVICE_MEDIUM = "device"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly held in the prefix cache under these hashes (`block_ids[i]` holds `block_hashes[i]`)."""

    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    medium: str = DEVICE_MEDIUM


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Hashes no longer held in the prefix cache (the blocks are being reused)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = DEVICE_MEDIUM


KVEvent = BlockStored | BlockRemoved
KVEventListener = Callable[[KVEvent], None]


class KVEventLog:
    """A listener that keeps the set of held hashes and the events not yet drained.

    `held` is the exact prefix-cache state as far as the events tell (what a router compares a
    prompt's chain against); `drain()` hands the pending events to a publisher. `max_pending` bounds
    the pending list: when nobody drains it, the oldest events are dropped (`held` stays exact).
    """

    def __init__(self, max_pending: int = 65536) -> None:
        if max_pending < 0:
            raise ValueError(f"max_pending must be >= 0, got {max_pending}")
        self.max_pending = max_pending
        self.held: set[BlockHash] = set()
        self.num_stored = 0
        self.num_removed = 0
        self.num_dropped = 0
        self._pending: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.held.update(event.block_hashes)
            self.num_stored += len(event.block_hashes)
        else:
            self.held.difference_update(event.block_hashes)
            self.num_removed += len(event.block_hashes)
        self._pending.append(event)
        if len(self._pending) > self.max_pending:
            excess = len(self._pending) - self.max_pending
            del self._pending[:excess]
            self.num_dropped += excess

    def drain(self) -> list[KVEvent]:
        """The events since the last drain, oldest first."""
        events, self._pending = self._pending, []
        return events


def longest_prefix(chain: Sequence[BlockHash], held: set[BlockHash] | frozenset[BlockHash]) -> int:
    """How many leading hashes of `chain` are in `held` (a chain is only usable up to its first gap)."""
    count = 0
    for block_hash in chain:
        if block_hash not in held:
            break
        count += 1
    return count


class PrefixIndex:
    """Which replica holds which hashes, built from each replica's events or snapshots.

    `match(chain)` gives, per replica, the number of leading blocks of `chain` it holds: exact,
    because both sides hash with the same fingerprint-seeded chain.
    """

    def __init__(self) -> None:
        self._held: dict[str, set[BlockHash]] = {}

    @property
    def replicas(self) -> list[str]:
        return list(self._held)

    def apply(self, replica: str, events: Iterable[KVEvent]) -> None:
        held = self._held.setdefault(replica, set())
        for event in events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            else:
                held.difference_update(event.block_hashes)

    def replace(self, replica: str, hashes: Iterable[BlockHash]) -> None:
        """Set a replica's state from a full snapshot (e.g. a periodic report)."""
        self._held[replica] = set(hashes)

    def remove(self, replica: str) -> None:
        self._held.pop(replica, None)

    def match(self, chain: Sequence[BlockHash]) -> dict[str, int]:
        return {replica: longest_prefix(chain, held) for replica, held in self._held.items()}
