"""The remote tier never holds an engine step: a store that answers every reply 200 ms late (a proxy
in front of a real Redis/Valkey) slows the requests that wait on it, not the decode steps of the
others, and every output stays exact; the publisher's bounded queue drops its oldest block when full."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from engine_helpers import run_greedy, tiny_llama_config
from redis_server import DelayProxy, StoreServer
from test_kv_remote import NUM_NEW, OTHERS, PROMPTS, reference, remote_engine  # noqa: F401

from kvpager.core.block_pool import BlockPool
from kvpager.core.hashing import BlockHash
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine
from kvpager.kvstore.publisher import RemotePublisher

DELAY_S = 0.2
LONG_TOKENS = 30


def test_a_slow_store_does_not_slow_the_decode_steps_of_other_requests(
    llama_checkpoint: Path,
    reference: dict,  # noqa: F811
    store_server: StoreServer,
) -> None:
    long_prompt = OTHERS[3]
    cold = Engine(tiny_llama_config(llama_checkpoint, 64, enable_prefix_caching=False))
    long_reference = run_greedy(cold, long_prompt, LONG_TOKENS)[0]
    writer = remote_engine(llama_checkpoint, store_server.url)
    assert run_greedy(writer, PROMPTS["a"], NUM_NEW) == (reference["a"], 0)
    assert writer.kv_publisher is not None
    writer.kv_publisher.drain()

    proxy = DelayProxy(store_server.port, DELAY_S)
    try:
        engine = Engine(tiny_llama_config(llama_checkpoint, 64, kv_cache_remote=proxy.url, kv_cache_remote_timeout=3))
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
        engine.add_request(
            "long", long_prompt, SamplingParams(temperature=0.0, max_tokens=LONG_TOKENS, ignore_eos=True)
        )
        finished: dict[str, tuple[list[int], int]] = {}
        step_times: list[float] = []
        added = False
        for _ in range(2000):
            start = time.monotonic()
            outs = engine.step()
            running = "long" not in finished and engine.scheduler.num_running > 0
            if added and running:
                step_times.append(time.monotonic() - start)
            for out in outs:
                if out.finished:
                    finished[out.request_id] = (out.outputs[0].token_ids, out.num_cached_tokens)
            if not added and any(r.request_id == "long" and r.outputs[0].token_ids for r in outs):
                engine.add_request("b", PROMPTS["b"], params)  # its 40-token prefix is in the store
                engine.add_request("o1", OTHERS[1], params)  # in no tier: a lookup, then a recompute
                added = True
            if not engine.has_unfinished_requests():
                break
        remote = engine.kv_tier_stats().remote
    finally:
        proxy.close()
    assert finished == {
        "long": (long_reference, 0),
        "b": (reference["b"], 40),
        "o1": (reference["o1"], 0),
    }
    assert remote is not None and remote.lookups >= 2 and remote.hits >= 10
    assert len(step_times) >= 10
    assert max(step_times) < DELAY_S, f"a step waited for the store: {max(step_times):.3f} s"


class _SlowStore:
    """The part of `RemoteTier` the publisher uses; `put` waits until `release` is set."""

    available = True

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written: list[BlockHash] = []
        self.counters: dict[str, int] = {}

    def knows(self, block_hash: BlockHash) -> bool:
        return False

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> bool:
        self.release.wait(10)
        self.written.append(block_hash)
        return True

    def count(self, name: str, value: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value


class _Blocks:
    def read_block(self, block_id: int) -> torch.Tensor:
        return torch.full((1, 2, 4, 1, 2), float(block_id))


def test_a_full_publisher_queue_drops_its_oldest_block_and_never_waits() -> None:
    pool = BlockPool(16, enable_caching=True)
    slow = _SlowStore()
    publisher = RemotePublisher(slow, pool, _Blocks(), max_pending=3)  # type: ignore[arg-type]
    hashes = [BlockHash(bytes([i]) * 32) for i in range(9)]
    block_ids = pool.allocate(9)
    pool.cache_block(block_ids[0], hashes[0])
    assert publisher.flush() == 1
    deadline = time.monotonic() + 10
    while not publisher.writer._busy and time.monotonic() < deadline:  # the thread is now stuck in `put`
        time.sleep(0.01)
    for block_id, block_hash in zip(block_ids[1:], hashes[1:], strict=True):
        pool.cache_block(block_id, block_hash)
    start = time.monotonic()
    assert publisher.flush() == 8
    assert time.monotonic() - start < 1.0, "flush never waits for the store"
    slow.release.set()
    publisher.close()
    assert slow.written == [hashes[0], *hashes[6:]], "the oldest queued blocks were dropped"
    assert slow.counters == {"publish_dropped": 5, "published": 4}
