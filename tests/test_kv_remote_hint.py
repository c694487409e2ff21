"""A request's shared-store lookup can start where it arrives (`KVCacheManager.hint_lookup`, called by
the async engine with `--kv-cache-remote`): when the answer is back before the step that schedules the
request, that step starts the load at once, one step sooner than a lookup the scheduler has to start,
and the tokens are the same."""

from __future__ import annotations

import time
from pathlib import Path

from engine_helpers import tiny_llama_config
from redis_server import StoreServer
from test_kv_remote import NUM_NEW, PROMPTS, reference, remote_engine  # noqa: F401

from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.engine import Engine


def _steps_to_first_token(engine: Engine, prompt: list[int]) -> tuple[int, list[int], int]:
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    steps, first, final = 0, None, None
    for _ in range(500):
        outs = engine.step()
        steps += 1
        for out in outs:
            if first is None and out.outputs[0].token_ids:
                first = steps
            if out.finished:
                final = out
        if not engine.has_unfinished_requests():
            break
        if not outs:
            time.sleep(0.005)  # a lookup or load in flight: give the tier threads the core
    assert first is not None and final is not None
    return first, list(final.outputs[0].token_ids), final.num_cached_tokens


def _wait_for_lookups(engine: Engine, count: int) -> None:
    for _ in range(400):
        stats = engine.kv_tier_stats().remote
        assert stats is not None
        if stats.lookups >= count:
            time.sleep(0.05)  # its answers are stored right after the round trip is counted
            return
        time.sleep(0.01)
    raise AssertionError("the hinted lookup never ran")


def test_a_hinted_lookup_saves_the_scheduler_a_step_and_changes_no_token(
    llama_checkpoint: Path,
    reference: dict,  # noqa: F811
    store_server: StoreServer,
) -> None:
    writer = remote_engine(llama_checkpoint, store_server.url)
    writer.add_request("a", PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    while writer.has_unfinished_requests():
        writer.step()
    assert writer.kv_publisher is not None
    writer.kv_publisher.drain()  # PROMPTS["b"]'s 40-token prefix is in the store now

    plain = remote_engine(llama_checkpoint, store_server.url)
    plain_steps, plain_tokens, plain_cached = _steps_to_first_token(plain, PROMPTS["b"])

    hinted = remote_engine(llama_checkpoint, store_server.url)
    hinted.kv_manager.hint_lookup(PROMPTS["b"])
    _wait_for_lookups(hinted, 1)
    hinted_steps, hinted_tokens, hinted_cached = _steps_to_first_token(hinted, PROMPTS["b"])

    assert plain_tokens == hinted_tokens == reference["b"]
    # plain found the writer's 40-token prefix and published its own full blocks, so the hinted engine
    # finds one block more (44 of the 45 tokens)
    assert (plain_cached, hinted_cached) == (40, 44)
    assert hinted_steps == plain_steps - 1, (plain_steps, hinted_steps)


def test_the_async_engine_hints_only_with_a_shared_store(llama_checkpoint: Path, store_server: StoreServer) -> None:
    assert AsyncEngine(remote_engine(llama_checkpoint, store_server.url))._hint_lookups
    assert not AsyncEngine(Engine(tiny_llama_config(llama_checkpoint, 24)))._hint_lookups
