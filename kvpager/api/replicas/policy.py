"""The routing decision of the KV-aware router, without Ray: rank replicas for one prompt.

Each replica reports the block hashes its device pool holds (KV events, `core/kv_events.py`); the
ingress hashes the prompt with the same fingerprint-seeded chain. A replica's *match* is the number
of leading blocks of the prompt's chain it holds — exact, not a guess from past request text.

With a shared KV store (`--kv-cache-remote`) every replica can also restore the blocks the store
holds: `store_blocks` is the number of leading blocks of the chain the store holds, the same for
every replica. Those favour no replica, so a replica's *own* blocks are its match beyond them:
`max(match - store_blocks, 0)`. Without a store `store_blocks` is 0 and own blocks are the match.

Rule, in order:
1. the most own blocks wins, unless the replica's queue is longer than the shortest queue by more
   than `max_imbalance` requests (then its own blocks count 0);
2. then the shorter queue (a prefix the store covers never outweighs even one queued request);
3. then the replica holding more of the store-covered prefix on its device (it skips the fetch, so
   a conversation stays where it is when the queues are equal);
4. then the replica this router has sent fewer requests to (new conversations spread), then its id.
Without a store key 3 is 0 for every replica: the ranking is the device-only rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_MAX_IMBALANCE = 4

Held = Mapping[str, object] | set[str] | frozenset[str]


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows of one replica when a request arrives."""

    replica: str
    matched_blocks: int  # leading blocks of the prompt's chain the replica holds
    queue_len: int  # requests running or waiting there
    num_routed: int = 0  # requests this router sent there so far


def own_blocks(view: ReplicaView, store_blocks: int) -> int:
    """The replica's match beyond the prefix the shared store gives every replica."""
    return max(view.matched_blocks - store_blocks, 0)


def rank(
    views: Sequence[ReplicaView], max_imbalance: int = DEFAULT_MAX_IMBALANCE, store_blocks: int = 0
) -> list[ReplicaView]:
    """The replicas best first (see the module docstring)."""
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
    if store_blocks < 0:
        raise ValueError(f"store_blocks must be >= 0, got {store_blocks}")
    if not views:
        return []
    shortest = min(view.queue_len for view in views)

    def key(view: ReplicaView) -> tuple[int, int, int, int, str]:
        usable = own_blocks(view, store_blocks) if view.queue_len - shortest <= max_imbalance else 0
        on_device = min(view.matched_blocks, store_blocks)
        return (-usable, view.queue_len, -on_device, view.num_routed, view.replica)

    return sorted(views, key=key)


def hex_chain(chain: Sequence[bytes]) -> list[str]:
    """A chain as the short hex strings replicas report (16 hex digits: 64 bits of each sha256)."""
    return [block_hash[:8].hex() for block_hash in chain]


def matched(chain_hex: Sequence[str], held: Held) -> int:
    """Leading entries of `chain_hex` present in `held`."""
    count = 0
    for entry in chain_hex:
        if entry not in held:
            break
        count += 1
    return count


def matched_in_any(chain_hex: Sequence[str], helds: Iterable[Held]) -> int:
    """Leading entries of `chain_hex` present in at least one of `helds` (the store as the union of
    what each replica reports of it)."""
    sets = list(helds)
    count = 0
    for entry in chain_hex:
        if not any(entry in held for held in sets):
            break
        count += 1
    return count
