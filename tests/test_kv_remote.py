"""The remote KV tier on a real Redis/Valkey server on loopback: a prefix computed by one engine is a
verified hit on another (greedy tokens equal transformers' and a cold engine's), bad records are
deleted and never loaded, and a store that is killed, down or slow only costs a recompute."""

from __future__ import annotations

import logging
import random
import socket
import time
from pathlib import Path

import pytest
from checkpoints import random_ids
from engine_helpers import TINY_BLOCK, cold_greedy, run_greedy, tiny_llama_config
from redis_server import StoreServer, free_port
from test_engine import hf_greedy

from kvpager.core.config import EngineConfig
from kvpager.core.hashing import hash_prompt_blocks
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine
from kvpager.kvstore.remote import RemoteTier

NUM_NEW = 6
RNG = random.Random(11)
SHARED = [RNG.randrange(3, 384) for _ in range(40)]  # 10 full blocks of 4


PROMPTS = {"a": SHARED + random_ids(7, 1), "b": SHARED + random_ids(5, 2), "c": SHARED[:22] + random_ids(9, 3)}
OTHERS = [random_ids(17, 100 + i) for i in range(4)]


def remote_engine(checkpoint: Path, url: str, **kv: object) -> Engine:
    return Engine(tiny_llama_config(checkpoint, 24, kv_cache_remote=url, **kv))


@pytest.fixture(scope="module")
def reference(llama_checkpoint: Path) -> dict[str, list[int]]:
    """Greedy tokens of a cold engine (no prefix caching) for every prompt used here."""
    return cold_greedy(llama_checkpoint, {**PROMPTS, **{f"o{i}": p for i, p in enumerate(OTHERS)}}, NUM_NEW)


def test_second_engine_serves_the_first_engines_prefix_from_the_store(
    llama_checkpoint: Path, reference: dict, store_server: StoreServer
) -> None:
    assert reference["b"] == hf_greedy(llama_checkpoint, PROMPTS["b"], NUM_NEW)
    first = remote_engine(llama_checkpoint, store_server.url)
    assert run_greedy(first, PROMPTS["a"], NUM_NEW) == (reference["a"], 0)
    assert first.kv_publisher is not None
    first.kv_publisher.drain()  # NOTE: the publisher writes from its own thread
    first_stats = first.kv_tier_stats().remote
    assert first_stats is not None and first_stats.published >= 10, "computed blocks are written after the step"

    second = remote_engine(llama_checkpoint, store_server.url)  # another replica: nothing on its device
    assert run_greedy(second, PROMPTS["b"], NUM_NEW) == (reference["b"], 40)
    later = remote_engine(llama_checkpoint, store_server.url, host_kv_cache_memory=1 << 20)  # started later, with host
    assert run_greedy(later, PROMPTS["c"], NUM_NEW) == (reference["c"], 20)
    stats = second.kv_tier_stats()
    assert stats.remote is not None and stats.remote.hits >= 10 and stats.remote.skipped == 0
    assert stats.restored.blocks >= 10
    keys = store_server.client().keys("kvpager:v1:*")
    assert len(keys) >= 10 and all(
        k.startswith(b"kvpager:v1:" + first.loaded.fingerprint.hex()[:16].encode()) for k in keys
    )


def test_bad_records_in_the_store_are_deleted_and_never_loaded(
    llama_checkpoint: Path, reference: dict, store_server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    writer = remote_engine(llama_checkpoint, store_server.url)
    for prompt in OTHERS[:3]:
        run_greedy(writer, prompt, NUM_NEW)
    assert writer.kv_publisher is not None
    writer.kv_publisher.drain()
    remote = writer.kv_store.tiers.remote if writer.kv_store is not None else None
    assert remote is not None
    client = store_server.client()
    keys = [remote.key(hash_prompt_blocks(writer.kv_manager.hash_seed, p, TINY_BLOCK)[0]) for p in OTHERS[:3]]
    flipped = bytearray(client.get(keys[0]))
    flipped[len(flipped) // 2] ^= 0xFF
    client.set(keys[0], bytes(flipped))
    client.set(keys[1], client.get(keys[1])[:-40])
    client.set(keys[2], client.get(keys[0]))  # a valid-looking record of another block

    reader = remote_engine(llama_checkpoint, store_server.url)
    with caplog.at_level(logging.WARNING, logger="kvpager.kvstore.remote"):
        for i, prompt in enumerate(OTHERS[:3]):
            assert run_greedy(reader, prompt, NUM_NEW) == (reference[f"o{i}"], 0)
    stats = reader.kv_tier_stats()
    assert stats.remote is not None and stats.remote.skipped == 3 and stats.restored.blocks == 0
    reasons = " ".join(r.getMessage() for r in caplog.records)
    assert "checksum" in reasons and "truncated" in reasons
    # NOTE: the reader deleted the bad ones, then wrote its own recomputed (good) blocks back.
    fresh = remote_engine(llama_checkpoint, store_server.url)
    assert run_greedy(fresh, OTHERS[0], NUM_NEW) == (reference["o0"], 16)


def test_killing_the_store_mid_run_loses_no_request(
    llama_checkpoint: Path, reference: dict, store_server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    engine = remote_engine(llama_checkpoint, store_server.url, kv_cache_remote_timeout=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    names = ["a", "o0", "o1", "o2"]
    for name in names:
        engine.add_request(name, PROMPTS.get(name) or OTHERS[int(name[1])], params)
    finished: dict[str, list[int]] = {}
    with caplog.at_level(logging.WARNING, logger="kvpager.kvstore.remote"):
        for step in range(200):
            if step == 2:
                store_server.kill()
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
            if not engine.has_unfinished_requests():
                break
        assert finished == {name: reference[name] for name in names}
        start = time.monotonic()
        cold = remote_engine(llama_checkpoint, store_server.url, kv_cache_remote_timeout=0.3)  # the store is gone
        assert run_greedy(cold, PROMPTS["b"], NUM_NEW) == (reference["b"], 0)
        assert time.monotonic() - start < 10
    assert any("prefixes are recomputed" in r.getMessage() for r in caplog.records)
    stats = engine.kv_tier_stats().remote
    assert stats is not None and stats.errors >= 1


def test_a_store_that_never_answers_times_out_into_a_recompute(
    llama_checkpoint: Path, reference: dict, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as silent:  # accepts connections (backlog) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}"
        with caplog.at_level(logging.WARNING, logger="kvpager.kvstore.remote"):
            start = time.monotonic()
            engine = remote_engine(llama_checkpoint, url, kv_cache_remote_timeout=0.2)
            assert run_greedy(engine, PROMPTS["a"], NUM_NEW) == (reference["a"], 0)
            assert run_greedy(engine, PROMPTS["b"], NUM_NEW) == (reference["b"], 40)  # the device pool still hits
            elapsed = time.monotonic() - start
    assert elapsed < 5, f"one timeout then back-off expected, took {elapsed:.1f} s"
    assert any("Timeout" in r.getMessage() for r in caplog.records)


def test_the_store_comes_back_after_the_retry_interval(llama_checkpoint: Path, reference: dict, tmp_path: Path) -> None:
    port = free_port()
    engine = remote_engine(llama_checkpoint, f"redis://127.0.0.1:{port}", kv_cache_remote_timeout=0.2)
    remote = engine.kv_store.tiers.remote if engine.kv_store is not None else None
    assert remote is not None
    remote.retry_interval_s = 0.2
    assert run_greedy(engine, OTHERS[0], NUM_NEW) == (reference["o0"], 0)  # nothing listens yet
    assert not remote.available or remote.stats.errors >= 1
    server = StoreServer(tmp_path, port=port)
    try:
        time.sleep(0.3)
        assert run_greedy(engine, OTHERS[1], NUM_NEW) == (reference["o1"], 0)
        assert engine.kv_publisher is not None
        engine.kv_publisher.drain()
        assert remote.stats.published >= 4 and server.client().dbsize() >= 4
    finally:
        server.stop()


def test_the_eviction_policy_is_checked(store_server: StoreServer) -> None:
    from kvpager.kvstore.codec import get_codec

    tier = RemoteTier.from_url(store_server.url, b"\x01" * 32, get_codec("lossless"))
    assert tier.check_eviction_policy() is None  # maxmemory 64mb + allkeys-lru
    store_server.client().config_set("maxmemory-policy", "noeviction")
    assert "noeviction" in (tier.check_eviction_policy() or "")
    store_server.client().config_set("maxmemory", 0)
    assert "without bound" in (tier.check_eviction_policy() or "")


def test_remote_config_is_validated() -> None:
    for url in ("http://h:1", "redis://", "redis://h:99999", "h:6379"):
        with pytest.raises(ValueError, match="kv-cache-remote"):
            EngineConfig(kv_cache_remote=url)
    with pytest.raises(ValueError, match="timeout"):
        EngineConfig(kv_cache_remote="redis://h:1", kv_cache_remote_timeout=0)
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(kv_cache_remote="redis://h:1", enable_prefix_caching=False)
    import argparse

    from kvpager.engine.args import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = config_from_args(
        parser.parse_args("--kv-cache-remote redis://10.0.0.5:6379/2 --kv-cache-remote-timeout 0.5".split())
    )
    assert cfg.kv_cache_remote == "redis://10.0.0.5:6379/2" and cfg.kv_cache_remote_timeout == 0.5
