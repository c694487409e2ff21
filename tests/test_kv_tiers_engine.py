"""Host and disk KV tiers inside the engine: greedy tokens are exact whether a prefix is recomputed,
restored from host RAM, or read from disk after a restart; bad disk records are skipped, never loaded.
The reference is the same engine with prefix caching off (itself checked against transformers in
tests/test_engine.py)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
from checkpoints import random_ids
from engine_helpers import TINY_BLOCK, TINY_BLOCK_BYTES, cold_greedy, run_greedy, tiny_llama_config

from kvpager.core.config import KV_CODECS, EngineConfig
from kvpager.core.hashing import hash_prompt_blocks
from kvpager.engine.args import add_engine_args, config_from_args
from kvpager.engine.engine import Engine
from kvpager.kvstore.codec import available_codecs

BLOCK = TINY_BLOCK
BLOCK_BYTES = TINY_BLOCK_BYTES
NUM_NEW = 6
RNG = random.Random(7)
SHARED = [RNG.randrange(3, 384) for _ in range(40)]  # 10 full blocks


PROMPTS = {
    "a": SHARED + random_ids(7, 1),
    "b": SHARED + random_ids(5, 2),  # same 10 blocks as "a"
    "c": SHARED[:22] + random_ids(9, 3),  # shares 5 whole blocks and 2 tokens of the 6th
    "exact": SHARED,  # 40 tokens: at most 9 blocks may be reused (the last token is computed)
}
FILLERS = [random_ids(30, 100 + i) for i in range(6)]  # unrelated prompts that push "a" out of the pool


def config(checkpoint: Path, num_blocks: int = 24, **kv: object) -> EngineConfig:
    return tiny_llama_config(checkpoint, num_blocks, **kv)


def greedy(engine: Engine, prompt: list[int], max_tokens: int = NUM_NEW) -> tuple[list[int], int]:
    return run_greedy(engine, prompt, max_tokens)


@pytest.fixture(scope="module")
def reference(llama_checkpoint: Path) -> dict[str, list[int]]:
    return cold_greedy(llama_checkpoint, {**PROMPTS, **{f"f{i}": p for i, p in enumerate(FILLERS)}}, NUM_NEW)


def run_fillers(engine: Engine, reference: dict[str, list[int]]) -> None:
    for i, prompt in enumerate(FILLERS):
        assert greedy(engine, prompt)[0] == reference[f"f{i}"]


def on_device(engine: Engine, prompt: list[int]) -> bool:
    first = hash_prompt_blocks(engine.kv_manager.hash_seed, prompt, BLOCK)[0]
    return engine.kv_manager.get_cached_block(first) is not None


def test_host_tier_restores_an_evicted_prefix_with_exact_tokens(llama_checkpoint: Path, reference: dict) -> None:
    engine = Engine(config(llama_checkpoint, host_kv_cache_memory=1 << 20))
    assert greedy(engine, PROMPTS["a"]) == (reference["a"], 0)
    run_fillers(engine, reference)
    assert not on_device(engine, PROMPTS["a"]), "the fillers should have evicted the shared prefix"
    assert greedy(engine, PROMPTS["b"]) == (reference["b"], 40)
    assert greedy(engine, PROMPTS["c"]) == (reference["c"], 20)
    assert greedy(engine, PROMPTS["exact"]) == (reference["exact"], 36)
    stats = engine.kv_tier_stats()
    assert stats.host is not None and stats.host.hits >= 10
    assert stats.restored.blocks >= 10 and stats.offloaded.blocks > 0
    assert stats.device_evictions > 0
    assert engine.stats().num_owned_blocks == 0


@pytest.mark.parametrize("host", [None, 1 << 20], ids=["disk-only", "host-then-disk"])
def test_restarted_engine_serves_a_prefix_from_disk(
    llama_checkpoint: Path, reference: dict, tmp_path: Path, host: int | None
) -> None:
    kv = {"kv_cache_dir": str(tmp_path), "host_kv_cache_memory": host}
    first = Engine(config(llama_checkpoint, **kv))
    assert greedy(first, PROMPTS["a"]) == (reference["a"], 0)
    first.shutdown()  # device-cached blocks (and the host tier) are written to disk
    assert list(tmp_path.rglob("*.kvb")), "shutdown wrote no disk records"

    second = Engine(config(llama_checkpoint, **kv))
    assert greedy(second, PROMPTS["c"]) == (reference["c"], 20)
    assert greedy(second, PROMPTS["b"]) == (reference["b"], 40)
    stats = second.kv_tier_stats()
    assert stats.disk is not None and stats.disk.hits >= 10 and stats.disk.skipped == 0


def test_bad_disk_records_are_skipped_logged_and_never_loaded(
    llama_checkpoint: Path, reference: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    victims = [FILLERS[0], FILLERS[1], FILLERS[2]]
    writer = Engine(config(llama_checkpoint, kv_cache_dir=str(tmp_path)))
    for prompt in victims:
        greedy(writer, prompt)
    writer.shutdown()
    other = Engine(config(llama_checkpoint, kv_cache_dir=str(tmp_path), block_size=8))  # another fingerprint
    greedy(other, FILLERS[3])
    other.shutdown()
    assert other.kv_store is not None and writer.kv_store is not None
    disk = writer.kv_store.tiers.disk
    assert disk is not None
    paths = [disk.path_for(hash_prompt_blocks(writer.kv_manager.hash_seed, p, BLOCK)[0]) for p in victims]
    flipped = bytearray(paths[0].read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    paths[0].write_bytes(bytes(flipped))
    paths[1].write_bytes(paths[1].read_bytes()[:-50])
    foreign = next(p for p in tmp_path.rglob("*.kvb") if disk.root not in p.parents)
    paths[2].write_bytes(foreign.read_bytes())

    reader = Engine(config(llama_checkpoint, kv_cache_dir=str(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="kvpager.kvstore.tiers"):
        for i, prompt in enumerate(victims):
            assert greedy(reader, prompt) == (reference[f"f{i}"], 0)
    stats = reader.kv_tier_stats()
    assert stats.disk is not None and stats.disk.skipped == 3
    assert stats.restored.blocks == 0
    assert not any(p.exists() for p in paths), "bad records must be removed"
    reasons = " ".join(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    assert "checksum" in reasons and "fingerprint" in reasons


def test_disk_budget_is_enforced_while_serving(llama_checkpoint: Path, reference: dict, tmp_path: Path) -> None:
    budget = 12 * (BLOCK_BYTES + 400)  # about a dozen records (payload + header + checksum)
    engine = Engine(config(llama_checkpoint, kv_cache_dir=str(tmp_path), kv_cache_dir_max_bytes=budget))
    run_fillers(engine, reference)
    assert greedy(engine, PROMPTS["a"]) == (reference["a"], 0)
    engine.shutdown()
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.kvb")) <= budget
    stats = engine.kv_tier_stats()
    assert stats.disk is not None and stats.disk.evictions > 0 and stats.disk.bytes_held <= budget


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_lossy_host_tier_keeps_serving_close_to_lossless(llama_checkpoint: Path, reference: dict, codec: str) -> None:
    """Lossy tiers are opt-in; the restored prefix still predicts the same first token here."""
    engine = Engine(config(llama_checkpoint, host_kv_cache_memory=1 << 20, kv_codec=codec))
    greedy(engine, PROMPTS["a"])
    run_fillers(engine, reference)
    tokens, num_cached = greedy(engine, PROMPTS["b"])
    assert num_cached == 40
    assert tokens[0] == reference["b"][0]
    stats = engine.kv_tier_stats()
    assert stats.host is not None and stats.host.bytes_held < stats.offloaded.bytes / 3


def test_tier_config_is_validated_and_flags_reach_the_config() -> None:
    assert sorted(KV_CODECS) == sorted(available_codecs())
    with pytest.raises(ValueError, match="kv_codec"):
        EngineConfig(kv_codec="int3")
    with pytest.raises(ValueError, match="kv_cache_dir"):
        EngineConfig(kv_cache_dir_max_bytes=1 << 20)
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(host_kv_cache_memory=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="host_kv_cache_memory"):
        EngineConfig(host_kv_cache_memory=0)
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        "--host-kv-cache-memory 2GiB --kv-cache-dir /tmp/x --kv-cache-dir-max-bytes 1GB --kv-codec int8+zstd "
        "--kv-pack a.kvpack --kv-pack b.kvpack".split()
    )
    cfg = config_from_args(args)
    assert cfg.host_kv_cache_memory == 2 << 30 and cfg.kv_cache_dir == "/tmp/x"
    assert cfg.resolved_kv_cache_dir_max_bytes == 10**9 and cfg.kv_codec == "int8+zstd"
    assert cfg.kv_packs == ("a.kvpack", "b.kvpack")
    assert EngineConfig(kv_cache_dir="/tmp/x").resolved_kv_cache_dir_max_bytes == 10 << 30
