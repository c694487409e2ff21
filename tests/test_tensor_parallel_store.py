"""The shared KV store and KV packs under tensor parallelism (TP=2, gloo, one torch thread per rank).

Store (a real valkey/redis server on loopback): replica A (TP=2) computes three prefixes and each rank
writes its shard of every block under a key naming its KV heads; a fresh replica B (TP=2) serves the
first prefix from the store with TP=1's cold greedy tokens. For the second, rank 1's records are
garbage (the lookup finds every shard, rank 1's fetch fails its checksum: the MIN all-reduce drops the
block), for the third they are deleted (the lookup finds a shard missing): both are recomputed, the
same tokens, and no cached tokens show a hit (the bad record the load met is deleted). Killing the store while requests run loses none.
Packs: a pack exported at TP=2 holds whole blocks (equal to TP=1's export to float rounding) and,
pinned in a fresh TP=2 engine and in a TP=1 engine, gives TP=1's cold tokens as a prefix hit.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from redis_server import StoreServer

from kvpager.core.config import EngineConfig
from kvpager.core.hashing import hash_prompt_blocks
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine
from kvpager.kvstore.pack import decode_payload
from kvpager.kvstore.shards import KVShard

pytestmark = pytest.mark.slow

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = {
    "served": "She sells sea shells by the sea shore, and the shells she sells are sea shells for sure.",
    "garbled": "Memory management is the heart of serving: every block of the cache is a page of state.",
    "deleted": "A tensor-parallel engine splits the heads of attention over ranks that all reduce twice.",
    "late1": "Peter Piper picked a peck of pickled peppers; where is the peck that Peter Piper picked?",
}
RANK1 = KVShard(1, 1, 2)  # the llama checkpoint's 2 KV heads: rank 0 holds head 0, rank 1 head 1


@pytest.fixture(scope="module")
def llama_dir(llama_checkpoint: Path) -> Path:
    return llama_checkpoint  # 4 heads, 2 KV heads: split over the two ranks


@pytest.fixture(scope="module")
def cold(llama_dir: Path) -> dict[str, list[int]]:
    """TP=1 greedy tokens with no cache to hit: the reference for every prompt."""
    engine = _engine(llama_dir, 1, enable_prefix_caching=False, kernel_backend="torch")
    return {name: _generate(engine, prompt)[0] for name, prompt in PROMPTS.items()}


def _engine(model: Path, tp: int, **fields: object) -> Engine:
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        device="cpu",
        num_threads=1,
        tensor_parallel_size=tp,
        kv_cache_memory=1 << 20,
        **fields,  # type: ignore[arg-type]
    )
    return Engine(config)


def _generate(engine: Engine, prompt: str) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens served from a cache)."""
    engine.add_request(f"r-{time.monotonic_ns()}", prompt, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids), out.num_cached_tokens
    raise AssertionError("the request never finished")


def _hit_tokens(engine: Engine, prompt: str) -> int:
    """The prompt tokens a full prefix hit covers (its full blocks, the last token always computed)."""
    return (len(engine.tokenizer.encode(prompt)) - 1) // BLOCK * BLOCK


def test_tp2_replica_serves_a_prefix_from_the_store_only_when_every_shard_is_good_and_survives_a_killed_store(
    llama_dir: Path, cold: dict[str, list[int]], store_server: StoreServer
) -> None:
    a = _engine(llama_dir, 2, kv_cache_remote=store_server.url)
    try:
        for name in ("served", "garbled", "deleted"):
            assert _generate(a, PROMPTS[name]) == (cold[name], 0)
    finally:
        a.shutdown()  # NOTE: every rank's writer thread writes what it holds before the rank exits
    remote = a.kv_store.tiers.remote if a.kv_store is not None else None
    assert remote is not None
    client = store_server.client()
    hashes = {
        name: hash_prompt_blocks(a.kv_manager.hash_seed, a.tokenizer.encode(PROMPTS[name]), BLOCK)
        for name in ("served", "garbled", "deleted")
    }
    for shard in (KVShard(0, 1, 2), RANK1):
        assert all(client.exists(remote.shard_key(h, shard)) for h in hashes["served"]), f"{shard.tag} not written"
    assert not client.exists(remote.shard_key(hashes["served"][0], None)), "a TP=2 shard is not a whole block"
    for h in hashes["garbled"]:
        client.set(remote.shard_key(h, RANK1), b"not a KV record")
    client.delete(*(remote.shard_key(h, RANK1) for h in hashes["deleted"]))

    b = _engine(llama_dir, 2, kv_cache_remote=store_server.url)  # another replica: nothing on its device
    try:
        assert _generate(b, PROMPTS["served"]) == (cold["served"], _hit_tokens(b, PROMPTS["served"]))
        assert _generate(b, PROMPTS["garbled"]) == (cold["garbled"], 0), "a block with a bad shard was used"
        assert _generate(b, PROMPTS["deleted"]) == (cold["deleted"], 0), "a block missing a shard was used"
        first_bad = client.get(remote.shard_key(hashes["garbled"][0], RANK1))
        assert first_bad != b"not a KV record", "the bad record the load met was not deleted (nor rewritten)"
        stats = b.kv_tier_stats().remote
        assert stats is not None and stats.hits >= len(hashes["served"])

        for i, name in enumerate(("late1", "served")):
            b.add_request(f"{name}-{i}", PROMPTS[name], GREEDY)
        done: dict[str, list[int]] = {}
        steps = 0
        while b.has_unfinished_requests():
            steps += 1
            if steps == 3:
                store_server.kill()  # NOTE: mid-run: lookups, fetches and writes now fail
            for out in b.step():
                if out.finished:
                    done[out.request_id.split("-")[0]] = list(out.outputs[0].token_ids)
        assert steps > 3, "the store was killed after the requests were done"
        assert done == {name: cold[name] for name in ("late1", "served")}
        assert b.dead_reason is None
    finally:
        b.shutdown()


def test_a_pack_exported_at_tp2_holds_whole_blocks_and_loads_at_tp2_and_tp1_as_a_prefix_hit(
    llama_dir: Path, cold: dict[str, list[int]], tmp_path: Path
) -> None:
    prompt = PROMPTS["served"]
    reference = _engine(llama_dir, 1, kernel_backend="torch")
    whole = decode_payload(reference.export_kv(prompt))
    source = _engine(llama_dir, 2)
    try:
        payload = source.export_kv(prompt)
    finally:
        source.shutdown()
    pack = decode_payload(payload)
    assert pack.header.model.num_kv_heads == 2 and len(pack.blocks) == len(whole.blocks) > 0
    for (h, block), (h1, block1) in zip(pack.blocks, whole.blocks, strict=True):
        assert h == h1
        torch.testing.assert_close(block, block1, atol=1e-4, rtol=0)  # NOTE: every head, in the TP=1 order
    path = tmp_path / "served.kvpack"
    path.write_bytes(payload)

    pinned = _engine(llama_dir, 2, kv_packs=(str(path),))
    try:
        assert pinned.kv_tier_stats().pinned_blocks == len(pack.blocks)
        assert _generate(pinned, prompt) == (cold["served"], _hit_tokens(pinned, prompt))
    finally:
        pinned.shutdown()
    tp1 = _engine(llama_dir, 1, kernel_backend="torch", kv_packs=(str(path),))
    assert _generate(tp1, prompt) == (cold["served"], _hit_tokens(tp1, prompt)), "a TP=2 pack is a TP=1 pack too"
