"""Slow readers cost bounded memory: a stream keeps at most one undelivered output, merging newer
ones into it (issue 16 item 7: two never-read streams of n=128 x 1000 tokens took 1.6 GiB because
every step queued a full copy of every sample's text)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from kvpager.core.config import EngineConfig
from kvpager.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.engine import Engine
from kvpager.engine.output_processor import merge_outputs


def test_a_never_read_stream_holds_one_merged_output_equal_to_the_full_result(llama_checkpoint: Path) -> None:
    engine = Engine(EngineConfig(model=str(llama_checkpoint), kv_cache_memory=1 << 21, block_size=4))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    params = SamplingParams(n=4, temperature=0.0, max_tokens=40, ignore_eos=True)

    async def run() -> None:
        stream = await async_engine.add_request([5, 6, 7, 8], params, "slow")
        deadline = time.monotonic() + 60
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the engine runs every step; nobody reads
        await asyncio.sleep(0.05)
        assert len(stream._pending) == 1  # 40 steps, one pending (merged) output
        outs = [out async for out in stream]
        assert len(outs) == 1 and outs[0].finished
        for sample in outs[0].outputs:
            assert len(sample.token_ids) == 40
            assert sample.delta_token_ids == sample.token_ids  # every delta since the start, once
            assert sample.delta_text == sample.text

    try:
        asyncio.run(run())
    finally:
        async_engine.shutdown()


def _out(deltas: dict[int, list[int]], finished: bool = False) -> RequestOutput:
    outputs = [
        CompletionOutput(
            index=i, token_ids=list(t), text="".join(map(str, t)), delta_token_ids=t, delta_text="".join(map(str, t))
        )
        for i, t in deltas.items()
    ]
    return RequestOutput("r", None, [1], outputs, finished, 0, RequestMetrics(0.0))


def test_merge_joins_deltas_per_sample_and_keeps_samples_only_in_the_older_output() -> None:
    merged = merge_outputs(_out({0: [1], 1: [2]}), _out({1: [3], 2: [4]}, finished=True))
    assert merged.finished
    assert [(o.index, o.delta_token_ids, o.delta_text) for o in merged.outputs] == [
        (0, [1], "1"),
        (1, [2, 3], "23"),
        (2, [4], "4"),
    ]


def test_serve_bounds_the_waiting_queue_by_default() -> None:
    from kvpager.cli.serve import DEFAULT_MAX_WAITING_REQUESTS, build_parser

    assert build_parser().parse_args([]).max_waiting_requests == DEFAULT_MAX_WAITING_REQUESTS == 1024
