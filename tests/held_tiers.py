"""KV tiers that answer only when the test says so, and the prompts the tier tests run through them.

`hold_host_lookups` gates every tier lookup (`KVTiers.lookup`: host, then disk, then remote) on an
event, `hold_disk_writes` every disk write (`DiskTier._write_atomic`); the tests release them to
check what the engine and the store did meanwhile. conftest.py's `held_host_tier` fixture builds the
engine whose host tier holds PROMPTS["a"]'s prefix behind a held lookup.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
from checkpoints import random_ids
from engine_helpers import run_greedy, tiny_llama_config

from kvpager.engine.engine import Engine
from kvpager.kvstore.tiers import DiskTier, KVTiers

NUM_NEW = 6
RNG = random.Random(5)
SHARED = [RNG.randrange(3, 384) for _ in range(40)]  # 10 full blocks


PROMPTS = {"a": SHARED + random_ids(7, 1), "b": SHARED + random_ids(5, 2), "other": random_ids(30, 300)}
FILLERS = [random_ids(30, 200 + i) for i in range(6)]  # unrelated prompts that push "a" out of the pool


def hold_host_lookups(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make every tier lookup wait until the returned event is set (at most 60 s, then it fails)."""
    host_answers = threading.Event()
    original = KVTiers.lookup

    def held_lookup(self: KVTiers, block_hash: Any, device: Any = "cpu") -> Any:
        assert host_answers.wait(timeout=60), "the test never released the host tier"
        return original(self, block_hash, device)

    monkeypatch.setattr(KVTiers, "lookup", held_lookup)
    return host_answers


def hold_disk_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[Path]]:
    """Make every disk-tier write wait until the returned event is set; the list gets each path written."""
    disk_answers = threading.Event()
    written: list[Path] = []
    original = DiskTier._write_atomic

    def stuck_write(self: DiskTier, path: Path, data: bytes) -> None:
        assert disk_answers.wait(timeout=60), "the test never released the disk"
        original(self, path, data)
        written.append(path)

    monkeypatch.setattr(DiskTier, "_write_atomic", stuck_write)
    return disk_answers, written


def engine_with_a_held_host_tier(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Engine, threading.Event]:
    """An engine whose host tier holds PROMPTS["a"]'s prefix and answers lookups only once the event is set."""
    host_answers = hold_host_lookups(monkeypatch)
    engine = Engine(tiny_llama_config(checkpoint, 24, host_kv_cache_memory=1 << 20))
    run_greedy(engine, PROMPTS["a"], NUM_NEW)
    for prompt in FILLERS:  # push a's blocks out of the pool into the host tier
        run_greedy(engine, prompt, NUM_NEW)
    return engine, host_answers
