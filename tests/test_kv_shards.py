"""KV shards under tensor parallelism, without processes: which heads each rank's store record holds and
under which key, whole blocks from shards and back, and the shared store's rule that a block is held only
when the record of every shard is (a real valkey/redis server on loopback)."""

from __future__ import annotations

import pytest
import torch
from redis_server import StoreServer

from kvpager.core.hashing import BlockHash
from kvpager.core.tensor_parallel import tensor_parallel_layout
from kvpager.kvstore.codec import get_codec
from kvpager.kvstore.remote import RemoteTier, connect
from kvpager.kvstore.shards import KVShard, assemble, distinct_shards, shard_of, split, writes_shard

FINGERPRINT = bytes(range(32))


def test_split_kv_heads_key_each_ranks_shard_by_its_heads() -> None:
    layout = tensor_parallel_layout(8, 4, 64, 100, 2)
    assert [shard_of(layout, r) for r in (0, 1)] == [KVShard(0, 2, 4), KVShard(2, 2, 4)]
    assert [shard_of(layout, r).tag for r in (0, 1)] == ["kvh0-2of4", "kvh2-4of4"]
    assert distinct_shards(layout) == (KVShard(0, 2, 4), KVShard(2, 2, 4))
    assert writes_shard(layout, 0) and writes_shard(layout, 1)
    fingerprints = {shard_of(layout, r).record_fingerprint(FINGERPRINT) for r in (0, 1)}
    assert len(fingerprints) == 2 and FINGERPRINT not in fingerprints, "a shard record names its heads"


def test_replicated_kv_heads_share_one_record_written_by_the_lowest_rank() -> None:
    layout = tensor_parallel_layout(8, 2, 64, 100, 4)  # 2 KV heads over 4 ranks: each head on two ranks
    assert [shard_of(layout, r).first for r in range(4)] == [0, 0, 1, 1]
    assert distinct_shards(layout) == (KVShard(0, 1, 2), KVShard(1, 1, 2))
    assert [writes_shard(layout, r) for r in range(4)] == [True, False, True, False]
    one_head = tensor_parallel_layout(4, 1, 64, 100, 2)  # 1 KV head on both ranks: the whole block
    assert shard_of(one_head, 1).is_whole and shard_of(one_head, 1).tag == ""
    assert shard_of(one_head, 1).record_fingerprint(FINGERPRINT) == FINGERPRINT, "the TP=1 record"


@pytest.mark.parametrize(("kv_heads", "world_size"), [(4, 2), (2, 4), (1, 2)])
def test_whole_blocks_assembled_from_shards_split_back_into_them(kv_heads: int, world_size: int) -> None:
    layout = tensor_parallel_layout(8, kv_heads, 64, 100, world_size)
    whole = torch.randn(3, 2, 2, 4, kv_heads, 8)  # [blocks, layers, K/V, block_size, KV heads, head_dim]
    shards = [split(layout, rank, whole) for rank in range(world_size)]
    assert all(s.shape[-2] == layout.kv_heads_per_rank for s in shards)
    assert torch.equal(assemble(layout, shards), whole)
    with pytest.raises(ValueError, match="whole block has"):
        split(layout, 0, whole[..., :1, :] if kv_heads > 1 else torch.cat([whole, whole], dim=-2))


def test_a_block_is_held_only_when_every_shards_record_is(store_server: StoreServer) -> None:
    layout = tensor_parallel_layout(8, 4, 64, 100, 2)
    codec = get_codec("lossless")
    shards = distinct_shards(layout)
    ranks = [
        RemoteTier(connect(store_server.url, 1.0), FINGERPRINT, codec, shard=s, lookup_shards=shards if r == 0 else ())
        for r, s in enumerate(shards)
    ]
    both, only_rank0 = BlockHash(b"\x01" * 32), BlockHash(b"\x02" * 32)
    block = torch.randn(2, 2, 4, 2, 8)
    for tier in ranks:
        assert tier.put(both, block)
    assert ranks[0].put(only_rank0, block)
    replica = RemoteTier(connect(store_server.url, 1.0), FINGERPRINT, codec, shard=shards[0], lookup_shards=shards)
    assert replica.needs_lookup(both) and replica.needs_lookup(only_rank0)
    assert replica.lookup([both, only_rank0]) == 1
    assert replica.contains(both) and not replica.contains(only_rank0), "rank 1's shard of it is missing"
    replica.forget([both])
    assert replica.needs_lookup(both), "a forgotten block is asked about again"
    loaded = ranks[1].get(both)
    assert loaded is not None and torch.equal(loaded, block)
    client = store_server.client()
    client.set(ranks[0].key(both), client.get(ranks[1].key(both)))  # rank 1's record under rank 0's key
    assert ranks[0].get(both) is None and ranks[0].stats.skipped == 1, "a record of other heads is refused"
