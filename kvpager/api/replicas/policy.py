"""The routing decision of the KV-aware router, without Ray: rank replicas for one prompt.

Each replica reports the block hashes its device pool holds (KV events, `core/kv_events.py`); the
ingress hashes the prompt with the same fingerprint-seeded chain. A replica's *match* is the number
of leading blocks of the prompt's chain it holds — exact, not a guess from past request text.

Rule: the replica with the longest match wins unless its queue is longer than the shortest queue
by more than `max_imbalance` requests; then the match is ignored for it. Ties (e.g. a new
conversation, matched nowhere) go to the shorter queue, then to the replica this router has sent
fewer requests to, so new conversations spread over the replicas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_MAX_IMBALANCE = 4


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows of one replica when a request arrives."""

    replica: str
    matched_blocks: int  # leading blocks of the prompt's chain the replica holds
    queue_len: int  # requests running or waiting there
    num_routed: int = 0  # requests this router sent there so far


def rank(views: Sequence[ReplicaView], max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> list[ReplicaView]:
    """The replicas best first (see the module docstring)."""
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
    if not views:
        return []
    shortest = min(view.queue_len for view in views)

    def key(view: ReplicaView) -> tuple[int, int, int, str]:
        usable = view.matched_blocks if view.queue_len - shortest <= max_imbalance else 0
        return (-usable, view.queue_len, view.num_routed, view.replica)

    return sorted(views, key=key)


def hex_chain(chain: Sequence[bytes]) -> list[str]:
    """A chain as the short hex strings replicas report (16 hex digits: 64 bits of each sha256)."""
    return [block_hash[:8].hex() for block_hash in chain]


def matched(chain_hex: Sequence[str], held: Mapping[str, object] | set[str] | frozenset[str]) -> int:
    """Leading entries of `chain_hex` present in `held`."""
    count = 0
    for entry in chain_hex:
        if entry not in held:
            break
        count += 1
    return count
