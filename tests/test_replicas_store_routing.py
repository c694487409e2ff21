"""Store-aware routing: a prefix the shared KV store holds favours no replica (queue length decides),
blocks only one replica's device holds still win, and without a store the ranking is the device-only
rule. A replica reports a bounded set of the store's hashes, and the Ray router ranks by it."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from engine_helpers import TINY_BLOCK, tiny_llama_config
from redis_server import StoreServer

from kvpager.api.replicas.deployment import EngineReplica, store_blocks_of
from kvpager.api.replicas.policy import ReplicaView, hex_chain, matched, matched_in_any, own_blocks, rank
from kvpager.api.server.app import ServerSettings
from kvpager.core.hashing import hash_prompt_blocks


def order(views: list[ReplicaView], **kw: int) -> list[str]:
    return [view.replica for view in rank(views, **kw)]


def test_a_store_covered_prefix_no_longer_outweighs_a_queue_difference() -> None:
    views = [ReplicaView("a", 10, 3), ReplicaView("b", 0, 1)]
    assert order(views) == ["a", "b"]  # device-only: a's 10 blocks beat a queue 2 longer
    assert order(views, store_blocks=10) == ["b", "a"]  # b restores the 10 blocks from the store
    assert order(views, store_blocks=12) == ["b", "a"]  # the store holds more than a's device
    assert own_blocks(views[0], 10) == 0 and own_blocks(views[0], 4) == 6


def test_blocks_only_one_device_holds_still_win_over_a_shorter_queue() -> None:
    views = [ReplicaView("a", 12, 3), ReplicaView("b", 0, 1), ReplicaView("c", 11, 2)]
    assert order(views, store_blocks=10) == ["a", "c", "b"]  # own blocks 2 > 1 > 0
    crowded = [ReplicaView("a", 12, 9), ReplicaView("b", 0, 1)]  # beyond max_imbalance: the queue decides
    assert order(crowded, store_blocks=10, max_imbalance=4) == ["b", "a"]


def test_equal_queues_keep_the_replica_holding_the_store_covered_prefix() -> None:
    views = [ReplicaView("a", 10, 2, num_routed=5), ReplicaView("b", 0, 2, num_routed=0)]
    assert order(views, store_blocks=10) == ["a", "b"]  # a skips the fetch
    assert order([ReplicaView("a", 0, 2, 5), ReplicaView("b", 0, 2, 0)], store_blocks=10) == ["b", "a"]
    with pytest.raises(ValueError, match="store_blocks"):
        rank(views, store_blocks=-1)


def test_without_a_store_the_ranking_is_the_device_only_rule() -> None:
    def device_only(views: list[ReplicaView], max_imbalance: int) -> list[str]:
        shortest = min(v.queue_len for v in views)

        def key(v: ReplicaView) -> tuple[int, int, int, str]:
            usable = v.matched_blocks if v.queue_len - shortest <= max_imbalance else 0
            return (-usable, v.queue_len, v.num_routed, v.replica)

        return [v.replica for v in sorted(views, key=key)]

    rng = random.Random(5)
    for _ in range(500):
        views = [
            ReplicaView(name, rng.randrange(6), rng.randrange(8), rng.randrange(4))
            for name in "abcd"[: rng.randint(1, 4)]
        ]
        imbalance = rng.randrange(6)
        assert order(views, max_imbalance=imbalance, store_blocks=0) == device_only(views, imbalance)


def test_the_store_prefix_is_the_leading_run_of_the_union_of_reports() -> None:
    chain = [f"{i:016x}" for i in range(6)]
    assert matched_in_any(chain, [set(chain[:2]), set(chain[2:4])]) == 4  # blocks written by two replicas
    assert matched_in_any(chain, [set(chain[1:])]) == 0  # a gap at block 0: nothing usable
    assert matched_in_any(chain, []) == 0


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


def fake_router(**state: Any) -> Any:
    """A `KVAwareRequestRouter` without a running Serve controller (only its routing state)."""
    pytest.importorskip("ray.serve.request_router", reason="Ray Serve is not installed")
    from ray.serve._private.request_router.common import ReplicaQueueLengthCache

    from kvpager.api.replicas.router import KVAwareRequestRouter

    router = object.__new__(KVAwareRequestRouter)
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    router.initialize_state(**({"store_aware": True} | state))  # the rule under test, unless told otherwise
    return router


def replica(name: str, report: dict[str, Any]) -> Any:
    return SimpleNamespace(replica_id=FakeReplicaID(name), routing_stats=report)


def choose(router: Any, replicas: list[Any], chain: list[str]) -> list[str]:
    request = SimpleNamespace(kwargs={"kv_chain": chain}, metadata=SimpleNamespace(request_id="r"))
    ranked = asyncio.run(router.choose_replicas(replicas, request))
    return [group[0].replica_id.unique_id for group in ranked]


def test_the_router_ranks_by_the_store_the_replicas_report() -> None:
    chain = [f"{i:016x}" for i in range(8)]
    a = {"seq": 1, "kv_blocks": chain, "queue_len": 3, "kv_store_blocks": chain[:4]}
    b = {"seq": 1, "kv_blocks": [], "queue_len": 1, "kv_store_blocks": chain[4:]}  # b wrote the later blocks
    assert choose(fake_router(), [replica("a", a), replica("b", b)], chain) == ["b", "a"]
    router = fake_router(store_aware=False)  # the device-only rule, for comparison
    assert choose(router, [replica("a", a), replica("b", b)], chain) == ["a", "b"]
    partial = {**b, "kv_store_blocks": chain[4:6]}  # the union covers 6 blocks: a keeps 2 of its own
    assert choose(fake_router(), [replica("a", a), replica("b", partial)], chain) == ["a", "b"]
    no_store = {k: v for k, v in b.items() if k != "kv_store_blocks"}
    assert choose(fake_router(), [replica("a", {**a, "kv_store_blocks": None}), replica("b", no_store)], chain) == [
        "a",
        "b",
    ]


def test_a_chain_routed_to_a_store_backed_replica_counts_in_the_store_until_a_report_holds_it() -> None:
    chain = [f"{i:016x}" for i in range(4)]
    router = fake_router()
    now = [100.0]
    router.clock = lambda: now[0]
    a = replica("a", {"seq": 1, "kv_blocks": [], "queue_len": 1, "kv_store_blocks": []})
    b = replica("b", {"seq": 1, "kv_blocks": [], "queue_len": 0, "kv_store_blocks": []})
    request = SimpleNamespace(kwargs={"kv_chain": chain}, metadata=SimpleNamespace(request_id="r"))
    asyncio.run(router.choose_replicas([a, b], request))
    router.on_request_routed(request, FakeReplicaID("a"), None)  # e.g. b was full: it went to a
    assert router._store_blocks(chain, ["a", "b"]) == 4  # a publishes what it prefills
    b.routing_stats = {**b.routing_stats, "queue_len": 2}
    assert choose(router, [a, b], chain) == ["a", "b"]  # then queue length decides
    # a report taken before a wrote the blocks (delivered after the send) keeps the guess
    a.routing_stats = {**a.routing_stats, "seq": 2, "num_requests": 1}
    choose(router, [a, b], chain)  # NOTE: the router reads a replica's new report when it ranks it
    assert router.decisions[-1]["store_blocks"] == 4
    # a report holding them ends the guess: a later report without them means they left the store
    a.routing_stats = {**a.routing_stats, "seq": 3, "kv_blocks": chain, "kv_store_blocks": chain}
    assert choose(router, [a, b], chain) == ["a", "b"] and router.decisions[-1]["store_blocks"] == 4
    a.routing_stats = {**a.routing_stats, "seq": 4, "kv_blocks": [], "kv_store_blocks": []}
    b.routing_stats = {**b.routing_stats, "queue_len": 1}
    assert choose(router, [a, b], chain) == ["b", "a"]  # equal queues: b has fewer requests
    assert router._store_blocks(chain, ["a", "b"]) == 0 and router.decisions[-1]["store_blocks"] == 0


def test_a_routed_chain_counts_as_held_until_a_report_holds_it_or_the_guess_expires() -> None:
    chain = [f"{i:016x}" for i in range(4)]
    router = fake_router(store_aware=False, guess_ttl_s=10.0)
    now = [100.0]
    router.clock = lambda: now[0]
    a = replica("a", {"seq": 1, "kv_blocks": [], "queue_len": 0, "num_requests": 0})
    b = replica("b", {"seq": 1, "kv_blocks": [], "queue_len": 0, "num_requests": 0})
    request = SimpleNamespace(kwargs={"kv_chain": chain}, metadata=SimpleNamespace(request_id="r"))
    asyncio.run(router.choose_replicas([a, b], request))
    router.on_request_routed(request, FakeReplicaID("b"), None)
    turn = chain[:3] + ["ffffffffffffffff"]  # the next turn shares 3 blocks
    assert choose(router, [a, b], turn)[0] == "b" and router.decisions[-1]["matched_blocks"] == 3
    # b's report was taken before b prefilled the chain and delivered after the send: still b's
    b.routing_stats = {**b.routing_stats, "seq": 2, "num_requests": 1}
    assert choose(router, [a, b], turn)[0] == "b" and router.decisions[-1]["matched_blocks"] == 3
    # a report holding the blocks takes over from the guess; one without them means b evicted them
    b.routing_stats = {**b.routing_stats, "seq": 3, "kv_blocks": chain}
    assert choose(router, [a, b], turn)[0] == "b" and router.decisions[-1]["matched_blocks"] == 3
    b.routing_stats = {**b.routing_stats, "seq": 4, "kv_blocks": []}
    assert router.decisions[-1]["matched_blocks"] == 3
    choose(router, [a, b], turn)
    assert router.decisions[-1]["matched_blocks"] == 0, "evicted blocks are not held on the guess"
    # a guess no report ever confirms (an aborted request) ends guess_ttl_s after its send
    request = SimpleNamespace(kwargs={"kv_chain": turn}, metadata=SimpleNamespace(request_id="r2"))
    asyncio.run(router.choose_replicas([a, b], request))
    router.on_request_routed(request, FakeReplicaID("a"), None)
    now[0] += 9.0
    choose(router, [a, b], turn)
    assert router.decisions[-1] == {"replica": "a", "matched_blocks": 4, "store_blocks": 0, "chain_blocks": 4}
    now[0] += 2.0
    choose(router, [a, b], turn)
    assert router.decisions[-1]["matched_blocks"] == 0 and not router._held_guesses["a"]


def test_a_send_counts_for_the_fewer_requests_tie_break_until_the_replicas_count_shows_it() -> None:
    router = fake_router(store_aware=False, guess_ttl_s=10.0)
    now = [100.0]
    router.clock = lambda: now[0]
    a = replica("a", {"seq": 1, "kv_blocks": [], "queue_len": 0, "num_requests": 0})
    b = replica("b", {"seq": 1, "kv_blocks": [], "queue_len": 0, "num_requests": 0})
    assert choose(router, [a, b], []) == ["a", "b"]  # a tie: the first by id
    router.on_request_routed(SimpleNamespace(metadata=SimpleNamespace(request_id="r")), FakeReplicaID("a"), None)
    assert choose(router, [a, b], []) == ["b", "a"]  # a new conversation goes to the other replica
    a.routing_stats = {**a.routing_stats, "seq": 2}  # taken before the request reached a: still counted
    assert choose(router, [a, b], []) == ["b", "a"]
    a.routing_stats = {**a.routing_stats, "seq": 3, "num_requests": 1}  # the count shows it: not twice
    b.routing_stats = {**b.routing_stats, "seq": 2, "num_requests": 1}  # another caller's request on b
    assert choose(router, [a, b], []) == ["a", "b"]
    router.on_request_routed(SimpleNamespace(metadata=SimpleNamespace(request_id="s")), FakeReplicaID("a"), None)
    assert choose(router, [a, b], []) == ["b", "a"]
    now[0] += 11.0  # a send the replica never counted ends with the guesses
    assert choose(router, [a, b], []) == ["a", "b"]


def test_a_replica_reports_a_bounded_set_of_the_stores_hashes(
    llama_checkpoint: Path, store_server: StoreServer
) -> None:
    settings = ServerSettings(served_model_names=["tiny"])
    plain = EngineReplica(tiny_llama_config(llama_checkpoint, 32), settings)
    backed = EngineReplica(
        tiny_llama_config(llama_checkpoint, 32, kv_cache_remote=store_server.url), settings, report_store_blocks=True
    )
    prompt = list(range(3, 40))  # 9 full blocks
    expected = hex_chain(hash_prompt_blocks(backed.fingerprint, prompt, TINY_BLOCK))

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        from kvpager.core.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        async for _ in backed.engine.generate(prompt, params, "q"):
            pass
        return await plain.record_routing_stats(), await backed.record_routing_stats()

    try:
        without, stats = asyncio.run(run())
        assert "kv_store_blocks" not in without  # no store: nothing claimed
        assert matched(expected, set(stats["kv_store_blocks"])) == len(expected)  # written or on its way
        backed.engine.engine.kv_publisher.drain()
        written = store_blocks_of(backed.engine.engine)
        assert written is not None and matched(expected, set(written)) == len(expected)
        newest = store_blocks_of(backed.engine.engine, limit=3)
        assert newest is not None and len(newest) == 3 and set(newest) <= set(written)
        keys = store_server.client().keys("kvpager:*")
        assert len(keys) >= len(expected)  # the claims are the store's real content
        # the reports feed the router: the plain replica, with the shorter queue, restores the prefix
        reports = [replica("backed", {**stats, "queue_len": 3}), replica("plain", {**without, "queue_len": 1})]
        router = fake_router()
        assert choose(router, reports, expected) == ["plain", "backed"]
        assert router.decisions[-1]["store_blocks"] == len(expected)
        assert choose(fake_router(store_aware=False), reports, expected) == ["backed", "plain"]
    finally:
        plain.engine.shutdown()
        backed.engine.shutdown()


def test_the_default_kv_aware_router_is_the_device_only_rule() -> None:
    from kvpager.api.replicas.launch import request_router_kwargs

    assert request_router_kwargs("kv-aware", 4) == {"max_imbalance": 4, "store_aware": False}
    assert request_router_kwargs("kv-aware-store", 2) == {"max_imbalance": 2, "store_aware": True}
