"""Host and disk KV tiers: LRU bounds, restart persistence, corruption never loads, atomic writes."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from held_tiers import hold_disk_writes

from kvpager.core.hashing import BlockHash
from kvpager.kvstore.codec import get_codec
from kvpager.kvstore.tiers import DiskTier, HostTier, KVTiers

torch.set_num_threads(1)

SHAPE = (2, 2, 4, 2, 8)  # [num_layers, 2, block_size, num_kv_heads, head_dim]
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4
FP_A = hashlib.sha256(b"model-a").digest()
FP_B = hashlib.sha256(b"model-b").digest()
LOSSLESS = get_codec("lossless")


def block_hash(index: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"block-{index}".encode()).digest())


def block(index: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(index))


def same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and torch.equal(got, want)


def disk(path: Path, max_bytes: int = 10**6, fingerprint: bytes = FP_A) -> DiskTier:
    return DiskTier(path, max_bytes, fingerprint, LOSSLESS)


def record_size(tmp_path: Path) -> int:
    probe = disk(tmp_path / "probe")
    probe.put(block_hash(0), block(0))
    return probe.stats.bytes_held


# --- host tier ---------------------------------------------------------------------------------


def test_host_tier_roundtrips_and_counts_hits_and_misses() -> None:
    host = HostTier(10 * BLOCK_BYTES, LOSSLESS)
    assert host.put(block_hash(1), block(1)) == []
    assert same(host.get(block_hash(1)), block(1))
    assert host.get(block_hash(2)) is None
    stats = host.stats
    assert (stats.hits, stats.misses, stats.num_blocks, stats.bytes_held) == (1, 1, 1, BLOCK_BYTES)
    assert (stats.bytes_in, stats.bytes_out) == (BLOCK_BYTES, BLOCK_BYTES)


def test_host_tier_evicts_least_recently_used_and_returns_it_for_spilling() -> None:
    host = HostTier(3 * BLOCK_BYTES, LOSSLESS)
    for index in (1, 2, 3):
        host.put(block_hash(index), block(index))
    host.get(block_hash(1))  # 1 becomes most recently used; 2 is now the oldest
    spilled = host.put(block_hash(4), block(4))
    assert [h for h, _ in spilled] == [block_hash(2)]
    assert spilled[0][1].payload == LOSSLESS.encode(block(2))
    assert not host.contains(block_hash(2)) and host.contains(block_hash(1))
    assert host.stats.bytes_held == 3 * BLOCK_BYTES and host.stats.evictions == 1


def test_host_tier_never_exceeds_capacity_with_a_compressing_codec() -> None:
    host = HostTier(5 * BLOCK_BYTES // 4, get_codec("int8"))
    for index in range(20):
        host.put(block_hash(index), block(index))
        assert host.stats.bytes_held <= host.capacity_bytes
    assert 4 <= len(host) <= 5


def test_host_tier_returns_a_block_larger_than_its_capacity_unstored() -> None:
    host = HostTier(BLOCK_BYTES - 1, LOSSLESS)
    spilled = host.put(block_hash(1), block(1))
    assert [h for h, _ in spilled] == [block_hash(1)] and len(host) == 0


def test_host_tier_put_of_a_held_hash_does_not_double_count() -> None:
    host = HostTier(10 * BLOCK_BYTES, LOSSLESS)
    host.put(block_hash(1), block(1))
    host.put(block_hash(1), block(1))
    assert host.stats.bytes_held == BLOCK_BYTES and len(host) == 1


# --- disk tier ---------------------------------------------------------------------------------


def test_disk_tier_layout_is_namespaced_by_fingerprint_and_hash(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    assert tier.put(block_hash(1), block(1))
    name = block_hash(1).hex()
    assert (tmp_path / FP_A.hex()[:16] / name[:2] / f"{name}.kvb").is_file()


def test_disk_tier_survives_a_restart_bit_exactly(tmp_path: Path) -> None:
    first = disk(tmp_path)
    for index in range(3):
        first.put(block_hash(index), block(index))
    restarted = disk(tmp_path)
    assert len(restarted) == 3 and restarted.stats.bytes_held == first.stats.bytes_held
    for index in range(3):
        assert same(restarted.get(block_hash(index)), block(index))
    other_model = disk(tmp_path, fingerprint=FP_B)
    assert len(other_model) == 0 and other_model.get(block_hash(0)) is None


def test_disk_tier_keeps_each_records_codec(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6, FP_A, get_codec("int8+zstd"))
    tier.put(block_hash(1), block(1))
    restarted = DiskTier(tmp_path, 10**6, FP_A, LOSSLESS)
    loaded = restarted.get(block_hash(1))
    assert loaded is not None and not same(loaded, block(1))
    assert (loaded - block(1)).abs().max().item() < block(1).abs().max().item() / 127


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped payload byte": lambda path: flip_byte(path, -100),
    "flipped header byte": lambda path: flip_byte(path, 30),
    "flipped magic": lambda path: flip_byte(path, 0),
    "truncated": lambda path: path.write_bytes(path.read_bytes()[:-10]),
    "truncated to nothing": lambda path: path.write_bytes(b""),
    "garbage": lambda path: path.write_bytes(os.urandom(700)),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_disk_tier_skips_and_removes_a_corrupted_record(
    tmp_path: Path, corruption: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = disk(tmp_path)
    tier.put(block_hash(1), block(1))
    tier.put(block_hash(2), block(2))
    path = tier.path_for(block_hash(1))
    CORRUPTIONS[corruption](path)
    restarted = disk(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvpager.kvstore.tiers"):
        assert restarted.get(block_hash(1)) is None
    assert not path.exists() and not restarted.contains(block_hash(1))
    assert restarted.stats.skipped == 1 and restarted.stats.hits == 0
    assert "skipped and removed bad record" in caplog.text and block_hash(1).hex() in caplog.text
    assert same(restarted.get(block_hash(2)), block(2))
    assert restarted.stats.bytes_held == tier.stats.bytes_held // 2


def test_disk_tier_refuses_a_record_copied_from_another_fingerprint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier_a, tier_b = disk(tmp_path), disk(tmp_path, fingerprint=FP_B)
    tier_a.put(block_hash(1), block(1))
    tier_b.put(block_hash(1), block(7))  # same hash, other model: different bytes
    shutil.copyfile(tier_a.path_for(block_hash(1)), tier_b.path_for(block_hash(1)))
    with caplog.at_level(logging.WARNING, logger="kvpager.kvstore.tiers"):
        assert disk(tmp_path, fingerprint=FP_B).get(block_hash(1)) is None
    assert "fingerprint" in caplog.text
    assert same(disk(tmp_path).get(block_hash(1)), block(1))


def test_disk_tier_refuses_a_record_stored_under_another_hash(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    tier.put(block_hash(1), block(1))
    tier.put(block_hash(2), block(2))
    shutil.copyfile(tier.path_for(block_hash(1)), tier.path_for(block_hash(2)))
    restarted = disk(tmp_path)
    assert restarted.get(block_hash(2)) is None and restarted.stats.skipped == 1


def test_disk_tier_never_exceeds_its_budget_and_evicts_oldest_first(tmp_path: Path) -> None:
    size = record_size(tmp_path)
    tier = disk(tmp_path / "cache", max_bytes=3 * size + size // 2)
    for index in range(6):
        assert tier.put(block_hash(index), block(index))
        on_disk = sum(path.stat().st_size for path in tier.root.rglob("*.kvb"))
        assert on_disk == tier.stats.bytes_held <= tier.max_bytes
    assert [tier.contains(block_hash(index)) for index in range(6)] == [False] * 3 + [True] * 3
    assert tier.stats.evictions == 3


def test_disk_tier_hit_refreshes_lru_order_across_a_restart(tmp_path: Path) -> None:
    size = record_size(tmp_path)
    tier = disk(tmp_path / "cache", max_bytes=3 * size)
    for index in range(3):
        tier.put(block_hash(index), block(index))
        os.utime(tier.path_for(block_hash(index)), (1000.0 + index, 1000.0 + index))
    restarted = disk(tmp_path / "cache", max_bytes=3 * size)
    assert restarted.get(block_hash(0)) is not None  # 0 becomes newest; 1 is now the oldest
    restarted.put(block_hash(3), block(3))
    assert not restarted.contains(block_hash(1))
    assert all(restarted.contains(block_hash(index)) for index in (0, 2, 3))
    smaller = disk(tmp_path / "cache", max_bytes=size)  # a lower budget at start evicts down to it
    assert len(smaller) == 1 and smaller.stats.bytes_held <= size


def test_disk_tier_refuses_a_record_bigger_than_the_whole_budget(tmp_path: Path) -> None:
    tier = disk(tmp_path, max_bytes=100)
    assert not tier.put(block_hash(1), block(1))
    assert len(tier) == 0 and not any(tmp_path.rglob("*.kvb"))


def test_disk_write_goes_through_a_tmp_file_in_the_same_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def recording_replace(src: str, dst: str) -> None:
        renames.append((str(src), str(dst)))
        assert not Path(dst).exists()  # nothing visible under the final name before the rename
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    tier = disk(tmp_path)
    tier.put(block_hash(1), block(1))
    [(src, dst)] = renames
    assert Path(src).parent == Path(dst).parent and src.endswith(".tmp") and dst.endswith(".kvb")


def test_crash_during_write_leaves_nothing_loadable_or_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def failing_replace(src: str, dst: str) -> None:
        raise OSError("simulated crash before rename")

    tier = disk(tmp_path)
    monkeypatch.setattr(os, "replace", failing_replace)
    with caplog.at_level(logging.WARNING, logger="kvpager.kvstore.tiers"):
        assert not tier.put(block_hash(1), block(1))
    monkeypatch.undo()
    assert tier.stats.write_errors == 1 and "simulated crash" in caplog.text
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []
    assert not tier.contains(block_hash(1)) and disk(tmp_path).get(block_hash(1)) is None


def test_disk_tier_start_removes_stale_tmp_files_only(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    tier.put(block_hash(1), block(1))
    stale = tier.path_for(block_hash(1)).parent / ".leftover.kvb.abc.tmp"
    fresh = tier.path_for(block_hash(1)).parent / ".inflight.kvb.def.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (1000.0, 1000.0))
    restarted = disk(tmp_path)
    assert not stale.exists() and fresh.exists() and len(restarted) == 1


# --- both tiers ----------------------------------------------------------------------------------


def test_host_evictions_spill_to_disk_and_disk_hits_are_promoted(tmp_path: Path) -> None:
    tiers = KVTiers(HostTier(2 * BLOCK_BYTES, LOSSLESS), disk(tmp_path))
    for index in range(4):
        tiers.offload(block_hash(index), block(index))
    assert tiers.host is not None and tiers.disk is not None
    assert [tiers.disk.contains(block_hash(index)) for index in range(4)] == [True, True, False, False]
    assert same(tiers.lookup(block_hash(0)), block(0))  # from disk, promoted to host
    assert tiers.host.contains(block_hash(0)) and tiers.disk.stats.hits == 1
    assert same(tiers.lookup(block_hash(3)), block(3))  # from host
    assert tiers.lookup(block_hash(99)) is None
    assert all(tiers.contains(block_hash(index)) for index in range(4))


def test_flush_makes_host_blocks_survive_a_restart(tmp_path: Path) -> None:
    tiers = KVTiers(HostTier(10 * BLOCK_BYTES, LOSSLESS), disk(tmp_path))
    for index in range(3):
        tiers.offload(block_hash(index), block(index))
    assert len(disk(tmp_path)) == 0
    assert tiers.flush() == 3 and tiers.flush() == 0
    restarted = KVTiers(None, disk(tmp_path))
    assert all(same(restarted.lookup(block_hash(index)), block(index)) for index in range(3))


def test_without_a_host_tier_offload_writes_to_disk(tmp_path: Path) -> None:
    tiers = KVTiers(None, disk(tmp_path))
    tiers.offload(block_hash(1), block(1))
    assert same(disk(tmp_path).get(block_hash(1)), block(1))


# --- the offload worker (TieredBlockStore) ------------------------------------------------------
class PoolIO:
    """A device pool of 8 blocks for the store to read from and write into."""

    def __init__(self) -> None:
        self.pool = torch.stack([block(100 + i) for i in range(8)], dim=2)  # [layers, 2, 8, ...]

    def read_block(self, block_id: int) -> torch.Tensor:
        return self.pool[:, :, block_id]

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        self.pool[:, :, block_id].copy_(data)


def test_offload_store_copies_out_at_once_and_drops_writes_beyond_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpager.kvstore.offload import TieredBlockStore

    disk_answers, _ = hold_disk_writes(monkeypatch)
    io = PoolIO()
    want = [io.read_block(i).clone() for i in range(5)]
    store = TieredBlockStore(KVTiers(None, disk(tmp_path)), io, max_pending_writes=2)
    for i in range(5):
        store.on_evict(i, block_hash(i))
    store.wait_for_copies()  # returns although the disk has written nothing
    for i in range(5):
        io.write_block(i, block(200 + i))  # the pool reuses the blocks
    disk_answers.set()
    store.drain()
    stats = store.stats(device_evictions=5)
    assert stats.disk is not None and stats.dropped >= 2 and stats.disk.num_blocks + stats.dropped == 5
    kept = [i for i in range(5) if store.contains(block_hash(i))]
    store.start_load(7, [(block_hash(kept[0]), 6)])
    store.drain()
    assert store.finished_loads() == {7: 1} and torch.equal(io.read_block(6), want[kept[0]])
    store.close()
