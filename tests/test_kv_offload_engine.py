"""Tier I/O off the step: a disk that does not answer never holds a step up, and a request whose prefix
loads from a tier waits in its own state while others keep stepping; tokens stay exact throughout.
The reference is the same engine with prefix caching off (checked against transformers in
tests/test_engine.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from engine_helpers import TINY_BLOCK, cold_greedy, run_greedy, tiny_llama_config
from held_tiers import FILLERS, NUM_NEW, PROMPTS, hold_disk_writes

from kvpager.core.request import RequestStatus
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine
from kvpager.kvstore.tiers import DiskTier

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llama_checkpoint: Path) -> dict[str, list[int]]:
    return cold_greedy(llama_checkpoint, {**PROMPTS, **{f"f{i}": p for i, p in enumerate(FILLERS)}}, NUM_NEW)


def test_steps_go_on_while_the_disk_tier_has_not_written_anything(
    llama_checkpoint: Path, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk_answers, written = hold_disk_writes(monkeypatch)
    engine = Engine(tiny_llama_config(llama_checkpoint, 24, kv_cache_dir=str(tmp_path)))
    assert run_greedy(engine, PROMPTS["a"], NUM_NEW) == (reference["a"], 0)
    for i, prompt in enumerate(FILLERS):  # every one of these steps evicts into a disk that never answers
        assert run_greedy(engine, prompt, NUM_NEW) == (reference[f"f{i}"], 0)
    assert engine.kv_manager.block_pool.evictions >= 10 and written == []
    disk_answers.set()
    assert engine.kv_store is not None
    engine.kv_store.drain()
    assert len(written) >= 10
    assert run_greedy(engine, PROMPTS["b"], NUM_NEW) == (reference["b"], 40)  # a's prefix, back from disk
    stats = engine.kv_tier_stats()
    assert stats.disk is not None and stats.disk.hits >= 10 and stats.dropped == 0


def test_slow_disk_writes_overlap_the_steps(
    llama_checkpoint: Path, reference: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = DiskTier._write_atomic

    def slow_write(self: DiskTier, path: Path, data: bytes) -> None:
        time.sleep(0.5)
        original(self, path, data)

    monkeypatch.setattr(DiskTier, "_write_atomic", slow_write)
    engine = Engine(tiny_llama_config(llama_checkpoint, 24, kv_cache_dir=str(tmp_path)))
    start = time.monotonic()
    run_greedy(engine, PROMPTS["a"], NUM_NEW)
    for i, prompt in enumerate(FILLERS[:2]):
        assert run_greedy(engine, prompt, NUM_NEW) == (reference[f"f{i}"], 0)
    elapsed = time.monotonic() - start
    evictions = engine.kv_manager.block_pool.evictions
    assert evictions >= 4 and elapsed < 0.5 * evictions, "the steps waited for the disk writes"
    assert engine.kv_store is not None
    engine.kv_store.drain()
    assert len(list(tmp_path.rglob("*.kvb"))) == evictions


def test_request_waits_for_its_prefix_load_while_another_keeps_decoding(
    reference: dict, held_host_tier: tuple[Engine, threading.Event]
) -> None:
    engine, host_answers = held_host_tier
    tokens: dict[str, list[int]] = {"other": [], "b": []}
    cached: dict[str, int] = {}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].delta_token_ids)
            cached[out.request_id] = out.num_cached_tokens

    engine.add_request("other", PROMPTS["other"], GREEDY)  # never seen: nothing to load
    step()
    engine.add_request("b", PROMPTS["b"], GREEDY)
    step()
    b = engine.scheduler.requests["b"]
    assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS and engine.stats().num_waiting == 1
    before = len(tokens["other"])
    for _ in range(3):
        step()
    assert len(tokens["other"]) == before + 3 and tokens["b"] == []
    assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    host_answers.set()
    while engine.has_unfinished_requests():
        step()
    assert tokens["other"] == reference["other"]
    assert tokens["b"] == reference["b"] and cached["b"] == 40
    assert engine.stats().num_owned_blocks == 0


def test_export_runs_through_the_scheduler_while_a_request_is_decoding(llama_checkpoint: Path, reference: dict) -> None:
    engine = Engine(tiny_llama_config(llama_checkpoint, 64, max_num_batched_tokens=16))
    engine.add_request("other", PROMPTS["other"], GREEDY)
    before = engine.step() + engine.step()  # 30 tokens in chunks of 16: the first token
    payload = engine.export_kv(PROMPTS["a"])  # 11 full blocks, prefilled in chunks beside "other"
    assert engine.stats().num_running == 1  # only "other": the export request is gone
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    # "other" decoded during the export's steps; those tokens come with the next step's output
    assert len(outputs[0].outputs[0].delta_token_ids) >= 2
    assert sum(len(out.outputs[0].delta_token_ids) for out in before + outputs) == NUM_NEW
    assert outputs[-1].outputs[0].token_ids == reference["other"]
    target = Engine(tiny_llama_config(llama_checkpoint, 64))
    assert target.import_kv(payload) == len(PROMPTS["a"]) // TINY_BLOCK
    assert run_greedy(target, PROMPTS["b"], NUM_NEW) == (reference["b"], 40)
