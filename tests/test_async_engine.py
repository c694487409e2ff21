"""AsyncEngine: the real Engine stepped on a background thread, streamed to asyncio consumers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpager.core.config import EngineConfig
from kvpager.core.outputs import RequestOutput
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from kvpager.engine.engine import Engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

MakeEngine = Callable[..., AsyncEngine]


@pytest.fixture
def make_engine(llama_checkpoint: Path) -> Iterator[MakeEngine]:
    started: list[AsyncEngine] = []

    def make(max_waiting: int | None = None, **config: object) -> AsyncEngine:
        engine = Engine(EngineConfig(model=str(llama_checkpoint), kv_cache_memory=2 << 20, device="cpu", **config))  # type: ignore[arg-type]
        async_engine = AsyncEngine(engine, max_waiting=max_waiting)
        async_engine.start()
        started.append(async_engine)
        return async_engine

    yield make
    for async_engine in started:
        async_engine.shutdown()


def offline(async_engine: AsyncEngine, prompts: list[str], params: SamplingParams) -> list[RequestOutput]:
    """The same requests on a fresh Engine driven directly (no thread)."""
    engine = Engine(async_engine.engine.config)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"offline-{i}", prompt, params)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return [finished[f"offline-{i}"] for i in range(len(prompts))]


async def collect(
    async_engine: AsyncEngine, prompt: str, params: SamplingParams, request_id: str
) -> list[RequestOutput]:
    return [out async for out in async_engine.generate(prompt, params, request_id)]


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return predicate()


def test_generate_streams_the_tokens_the_engine_makes_alone(make_engine: MakeEngine) -> None:
    async_engine = make_engine()
    outs = asyncio.run(collect(async_engine, "The quick brown fox", GREEDY, "r0"))
    want = offline(async_engine, ["The quick brown fox"], GREEDY)[0].outputs[0]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == want.token_ids
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == want.token_ids
    assert "".join(o.outputs[0].delta_text for o in outs) == want.text


def test_concurrent_consumers_each_get_their_own_output(make_engine: MakeEngine) -> None:
    async_engine = make_engine()
    prompts = [f"Prompt {i}: hello" for i in range(8)]

    async def run() -> list[list[RequestOutput]]:
        return list(await asyncio.gather(*(collect(async_engine, p, GREEDY, f"r{i}") for i, p in enumerate(prompts))))

    got = [outs[-1].outputs[0].token_ids for outs in asyncio.run(run())]
    assert got == [o.outputs[0].token_ids for o in offline(async_engine, prompts, GREEDY)]
    assert async_engine.stats().num_owned_blocks == 0


def test_bad_request_raises_value_error_and_the_loop_keeps_serving(make_engine: MakeEngine) -> None:
    async_engine = make_engine()

    async def run() -> list[RequestOutput]:
        with pytest.raises(ValueError, match="vocabulary"):
            await async_engine.add_request([10**6], GREEDY, "bad")
        return await collect(async_engine, "Hello", GREEDY, "good")

    assert asyncio.run(run())[-1].finished
    assert async_engine.is_running


def test_duplicate_request_id_is_rejected(make_engine: MakeEngine) -> None:
    async_engine = make_engine()

    async def run() -> None:
        stream = await async_engine.add_request("Hello", LONG, "same")
        with pytest.raises(ValueError, match="already"):
            await async_engine.add_request("Hello", GREEDY, "same")
        stream.abort()

    asyncio.run(run())


def test_leaving_the_iterator_early_aborts_and_frees_blocks(make_engine: MakeEngine) -> None:
    async_engine = make_engine()

    async def main() -> None:
        gen = async_engine.generate("Memory management", LONG, "early")
        await gen.__anext__()
        assert async_engine.stats().num_owned_blocks > 0
        await gen.aclose()  # what the server's response does when its client goes away
        assert await wait_until(lambda: async_engine.stats().num_owned_blocks == 0)
        assert async_engine.stats().num_running == 0

    asyncio.run(main())
    assert async_engine.stats().generation_tokens_total < LONG.max_tokens  # type: ignore[operator]


def test_cancelled_consumer_task_aborts_its_request(make_engine: MakeEngine) -> None:
    async_engine = make_engine()

    async def main() -> None:
        task = asyncio.create_task(collect(async_engine, "Cancel me", LONG, "cancelled"))
        assert await wait_until(lambda: async_engine.stats().num_owned_blocks > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await wait_until(lambda: async_engine.stats().num_owned_blocks == 0)

    asyncio.run(main())
    assert async_engine.stats().generation_tokens_total < LONG.max_tokens  # type: ignore[operator]


def test_full_waiting_queue_raises_queue_full(make_engine: MakeEngine) -> None:
    async_engine = make_engine(max_waiting=1, max_num_seqs=1)

    async def main() -> None:
        running = await async_engine.add_request("one", LONG, "running")
        outputs = aiter(running)
        await anext(outputs)  # now it holds the only running slot
        waiting = await async_engine.add_request("two", LONG, "waiting")
        assert async_engine.stats().num_waiting == 1
        with pytest.raises(QueueFullError, match="limit 1"):
            await async_engine.add_request("three", GREEDY, "rejected")
        await outputs.aclose()
        waiting.abort()
        assert await wait_until(lambda: async_engine.stats().num_owned_blocks == 0)

    asyncio.run(main())


def test_idle_loop_sleeps_instead_of_stepping(make_engine: MakeEngine) -> None:
    async_engine = make_engine()
    engine = async_engine.engine
    calls = {"step": 0, "has_work": 0}
    step, has_work = engine.step, engine.has_unfinished_requests

    def counted_step() -> list[RequestOutput]:
        calls["step"] += 1
        return step()

    def counted_has_work() -> bool:
        calls["has_work"] += 1
        return has_work()

    engine.step, engine.has_unfinished_requests = counted_step, counted_has_work
    asyncio.run(collect(async_engine, "Hello", GREEDY, "r"))
    time.sleep(0.05)
    before = dict(calls)
    time.sleep(0.3)
    assert calls == before, "the loop thread must block while there is no work"
    assert before["step"] >= GREEDY.max_tokens  # type: ignore[operator]


def test_shutdown_fails_live_requests_and_refuses_new_ones(make_engine: MakeEngine) -> None:
    async_engine = make_engine()

    async def main() -> None:
        stream = await async_engine.add_request("Hello", LONG, "live")
        await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("Hello", GREEDY, "late")

    asyncio.run(main())
    assert not async_engine.is_running
