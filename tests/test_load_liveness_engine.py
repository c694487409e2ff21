"""An abort while a request's prefix loads from the host tier, through the real engine and store:
the load's blocks are freed once the tier answers, even when no request is left to step for
(test_load_liveness.py covers the scheduler's side of it with a fake tier)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from held_tiers import NUM_NEW, PROMPTS

from kvpager.core.invariants import check_scheduler
from kvpager.core.request import RequestStatus
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.engine import Engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def test_aborting_the_only_request_during_its_load_frees_the_blocks_once_the_tier_answers(
    held_host_tier: tuple[Engine, threading.Event],
) -> None:
    engine, host_answers = held_host_tier
    engine.add_request("b", PROMPTS["b"], GREEDY)
    engine.step()
    assert engine.scheduler.requests["b"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort_request("b")
    assert engine.stats().num_owned_blocks > 0  # the store is writing into them
    host_answers.set()
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests():  # the callers' loop (LLM.generate, AsyncEngine)
        assert time.monotonic() < deadline, "the engine never settled the cancelled load"
        engine.step()
    assert engine.stats().num_owned_blocks == 0 and check_scheduler(engine.scheduler) == []


@pytest.mark.slow
def test_async_engine_settles_a_load_whose_stream_was_dropped_with_no_request_left(
    held_host_tier: tuple[Engine, threading.Event],
) -> None:
    engine, host_answers = held_host_tier
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def drop_while_loading() -> None:
        stream = await async_engine.add_request(PROMPTS["b"], GREEDY, "b")
        deadline = time.monotonic() + 30
        while async_engine.stats().num_waiting == 0 or async_engine.stats().num_owned_blocks == 0:
            assert time.monotonic() < deadline, "the request never started its load"
            await asyncio.sleep(0.01)
        stream.abort()  # what a client disconnect does

    try:
        asyncio.run(drop_while_loading())
        time.sleep(0.05)  # NOTE: the loop thread applies the abort
        host_answers.set()
        deadline = time.monotonic() + 30
        while async_engine.stats().num_owned_blocks != 0:
            assert time.monotonic() < deadline, "the loop thread went idle with the cancelled load's blocks owned"
            time.sleep(0.02)
    finally:
        host_answers.set()
        async_engine.shutdown()
