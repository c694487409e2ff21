"""`KVAwareRequestRouter`: Ray Serve's RequestRouter API, routing by the replicas' exact prefix-cache state.

Every engine replica reports, through Ray Serve's `record_routing_stats` (polled every
`request_routing_stats_period_s`), the hashes its device pool holds (from its KV events) and its
queue length. The ingress passes each request's block-hash chain (`kv_chain`, hashed with the same
fingerprint-seeded chain) as a keyword argument; the router ranks the replicas with `policy.rank`.

Between two reports the router also counts the chains it has just sent to a replica as held there
(they are being prefilled there), so the next turn of a conversation that arrives before the next
report still finds its replica; the next report replaces that guess with the replica's real state.
A request with `metrics_slot=i` goes to the i-th replica (by id), so the ingress can reach each one.

The "fewer requests" tie-break counts what each replica reports it has handled (`num_requests`) plus
what this router sent it since that report: every caller holds its own router (the ingress, and each
decode replica calling the prefill pool), so counting only its own sends would make every caller
start new prompts on the same replica.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvpager.api.replicas.policy import DEFAULT_MAX_IMBALANCE, ReplicaView, matched, rank

logger = logging.getLogger("ray.serve")  # NOTE: Ray Serve writes this logger to the process's Serve log

MAX_DECISIONS = 1024


class KVAwareRequestRouter(RequestRouter):
    """Prefers the replica holding the longest prefix of the prompt, balanced against queue length."""

    def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE, **_: Any) -> None:
        self.max_imbalance = max_imbalance
        self._held: dict[str, tuple[int, frozenset[str]]] = {}  # replica -> (report seq, hashes)
        self._routed_since_report: dict[str, set[str]] = {}
        self._sent_since_report: Counter[str] = Counter()
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
        ranked = rank(views, self.max_imbalance)
        best = ranked[0]
        if pending_request is not None:
            self._chains[pending_request.metadata.request_id] = chain
        self.decisions.append(
            {"replica": best.replica, "matched_blocks": best.matched_blocks, "chain_blocks": len(chain)}
        )
        logger.info(
            "kvpager router: %d/%d blocks of the prompt held on replica %s (queue %d); others: %s",
            best.matched_blocks,
            len(chain),
            best.replica,
            best.queue_len,
            ", ".join(f"{v.replica}={v.matched_blocks}/q{v.queue_len}" for v in ranked[1:]) or "none",
        )
        return [[by_id[view.replica]] for view in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        replica = replica_id.unique_id
        self._sent_since_report[replica] += 1
        chain = self._chains.pop(pending_request.metadata.request_id, None)
        if chain:
            self._routed_since_report.setdefault(replica, set()).update(chain)

    def _view(self, replica: RunningReplica, chain: list[str]) -> ReplicaView:
        replica_key = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        seq = int(stats.get("seq", -1))
        cached = self._held.get(replica_key)
        if cached is None or cached[0] != seq:
            cached = (seq, frozenset(stats.get("kv_blocks", ())))
            self._held[replica_key] = cached
            self._routed_since_report.pop(replica_key, None)  # NOTE: the report is the replica's truth
            self._sent_since_report.pop(replica_key, None)
        held: set[str] | frozenset[str] = cached[1]
        guessed = self._routed_since_report.get(replica_key)
        if guessed:
            held = cached[1] | guessed
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        if queue_len is None:
            queue_len = int(stats.get("queue_len", 0))
        num_requests = int(stats.get("num_requests", 0)) + self._sent_since_report[replica_key]
        return ReplicaView(replica_key, matched(chain, held), int(queue_len), num_requests)
