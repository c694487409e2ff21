"""`KVAwareRequestRouter`: Ray Serve's RequestRouter API, routing by the replicas' exact prefix-cache state.

Every engine replica reports, through Ray Serve's `record_routing_stats` (polled every
`request_routing_stats_period_s`), the hashes its device pool holds (from its KV events) and its
queue length; with a shared KV store also `kv_store_blocks`, the hashes it knows the store holds or
is writing there (bounded, `deployment.store_blocks_of`). The ingress passes each request's
block-hash chain (`kv_chain`, hashed with the same fingerprint-seeded chain) as a keyword argument;
the router ranks the replicas with `policy.rank`, the store's part of the chain being the leading
blocks held in the union of every candidate's store report (`store_aware=False`: ignored, the
device-only rule). The router never talks to the store itself.

The router also counts the chains it has just sent to a replica as held there (they are being
prefilled there) and, when that replica reports a store, as held in the store (it publishes what it
computes), so the next turn of a conversation that arrives before the replica reports those blocks
still finds its replica. A guessed hash lasts until a report holds it (from then on the reports say
whether it is still there) or until `guess_ttl_s` after it was sent: a report taken before the
replica prefilled the request, delivered after it was sent, must not erase it.
A request with `metrics_slot=i` goes to the i-th replica (by id), so the ingress can reach each one.

The "fewer requests" tie-break counts what each replica reports it has received (`num_requests`)
plus what this router sent it that the reports do not show yet: every caller holds its own router
(the ingress, and each decode replica calling the prefill pool), so counting only its own sends would
make every caller start new prompts on the same replica. A send counts until the replica's count has
grown past it (a report taken before it arrived leaves it counted) or `guess_ttl_s` has passed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvpager.api.replicas.policy import DEFAULT_MAX_IMBALANCE, ReplicaView, matched, matched_in_any, rank

logger = logging.getLogger("ray.serve")  # NOTE: Ray Serve writes this logger to the process's Serve log

MAX_DECISIONS = 1024
GUESS_TTL_S = 30.0  # NOTE: queue wait + prefill + report period + delivery, with a wide margin


@dataclass(frozen=True, slots=True)
class _Report:
    seq: int
    held: frozenset[str]  # device pool
    stored: frozenset[str] | None  # shared store (None: the replica has none)


class KVAwareRequestRouter(RequestRouter):
    """Prefers the replica holding the longest prefix of the prompt, balanced against queue length."""

    def initialize_state(
        self,
        max_imbalance: int = DEFAULT_MAX_IMBALANCE,
        store_aware: bool = False,
        guess_ttl_s: float = GUESS_TTL_S,
        **_: Any,
    ) -> None:
        self.max_imbalance = max_imbalance
        self.store_aware = store_aware
        self.guess_ttl_s = guess_ttl_s
        self.clock = time.monotonic
        self._reports: dict[str, _Report] = {}
        # NOTE: replica -> hash -> when it was sent there; device and store guesses end separately
        self._held_guesses: dict[str, dict[str, float]] = {}
        self._stored_guesses: dict[str, dict[str, float]] = {}
        self._unreported_sends: dict[str, deque[float]] = {}  # replica -> when, oldest first
        self._reported_requests: dict[str, int] = {}
        self._chains: dict[str, list[str]] = {}  # request id -> chain, until it is routed
        self.decisions: deque[dict[str, Any]] = deque(maxlen=MAX_DECISIONS)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        slot = kwargs.get("metrics_slot")
        if isinstance(slot, int):
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return [[ordered[slot % len(ordered)]]]
        chain = [str(h) for h in kwargs.get("kv_chain") or ()]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._view(replica, chain) for replica in candidate_replicas]
        store_blocks = self._store_blocks(chain, list(by_id)) if self.store_aware else 0
        ranked = rank(views, self.max_imbalance, store_blocks)
        best = ranked[0]
        if pending_request is not None:
            self._chains[pending_request.metadata.request_id] = chain
        self.decisions.append(
            {
                "replica": best.replica,
                "matched_blocks": best.matched_blocks,
                "store_blocks": store_blocks,
                "chain_blocks": len(chain),
            }
        )
        logger.info(
            "kvpager router: %d/%d blocks of the prompt held on replica %s (%d in the store; queue %d); others: %s",
            best.matched_blocks,
            len(chain),
            best.replica,
            store_blocks,
            best.queue_len,
            ", ".join(f"{v.replica}={v.matched_blocks}/q{v.queue_len}" for v in ranked[1:]) or "none",
        )
        return [[by_id[view.replica]] for view in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        replica = replica_id.unique_id
        now = self.clock()
        self._unreported_sends.setdefault(replica, deque()).append(now)
        chain = self._chains.pop(pending_request.metadata.request_id, None)
        if chain:
            self._held_guesses.setdefault(replica, {}).update(dict.fromkeys(chain, now))
            report = self._reports.get(replica)
            if self.store_aware and report is not None and report.stored is not None:
                self._stored_guesses.setdefault(replica, {}).update(dict.fromkeys(chain, now))

    def _report(self, replica: RunningReplica) -> _Report:
        """The replica's last report (cached per report: a new one ends the guesses it confirms)."""
        replica_key = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        seq = int(stats.get("seq", -1))
        report = self._reports.get(replica_key)
        if report is None or report.seq != seq:
            stored = stats.get("kv_store_blocks")
            report = _Report(
                seq, frozenset(stats.get("kv_blocks", ())), frozenset(stored) if stored is not None else None
            )
            self._reports[replica_key] = report
            self._confirm(self._held_guesses, replica_key, report.held)
            self._confirm(self._stored_guesses, replica_key, report.stored or frozenset())
            received = int(stats.get("num_requests", 0))
            grown = received - self._reported_requests.get(replica_key, 0)
            self._reported_requests[replica_key] = received
            sends = self._unreported_sends.get(replica_key)
            if sends:
                for _ in range(min(max(grown, 0), len(sends))):
                    sends.popleft()
        return report

    def _guessed(self, guesses: dict[str, dict[str, float]], replica_key: str) -> set[str]:
        """The hashes guessed on `replica_key` that are younger than `guess_ttl_s` (older ones dropped)."""
        sent = guesses.get(replica_key)
        if not sent:
            return set()
        oldest = self.clock() - self.guess_ttl_s
        for hash_hex in [h for h, at in sent.items() if at < oldest]:
            del sent[hash_hex]
        return set(sent)

    def _unshown_sends(self, replica_key: str) -> int:
        """This router's sends to `replica_key` that its reports do not count yet (expired ones dropped)."""
        sends = self._unreported_sends.get(replica_key)
        if not sends:
            return 0
        oldest = self.clock() - self.guess_ttl_s
        while sends and sends[0] < oldest:
            sends.popleft()
        return len(sends)

    def _confirm(self, guesses: dict[str, dict[str, float]], replica_key: str, reported: frozenset[str]) -> None:
        """Ends the guesses a report holds (from now on the reports say whether they are there) and the expired."""
        sent = guesses.get(replica_key)
        if sent:
            for hash_hex in reported.intersection(sent):
                del sent[hash_hex]
            self._guessed(guesses, replica_key)

    def _view(self, replica: RunningReplica, chain: list[str]) -> ReplicaView:
        replica_key = replica.replica_id.unique_id
        report = self._report(replica)
        held: set[str] | frozenset[str] = report.held
        guessed = self._guessed(self._held_guesses, replica_key)
        if guessed:
            held = report.held | guessed
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        if queue_len is None:
            queue_len = int((replica.routing_stats or {}).get("queue_len", 0))
        num_requests = self._reported_requests.get(replica_key, 0) + self._unshown_sends(replica_key)
        return ReplicaView(replica_key, matched(chain, held), int(queue_len), num_requests)

    def _store_blocks(self, chain: list[str], replicas: list[str]) -> int:
        """Leading blocks of `chain` in the shared store, as the candidates report it (0 without one)."""
        helds: list[set[str] | frozenset[str]] = []
        for replica in replicas:
            report = self._reports.get(replica)
            if report is None or report.stored is None:
                continue
            helds.append(report.stored)
            guessed = self._guessed(self._stored_guesses, replica)
            if guessed:
                helds.append(guessed)
        return matched_in_any(chain, helds) if helds else 0
