"""Small helpers for tests that drive an Engine directly."""

from __future__ import annotations

from kvpager.engine import Engine
from kvpager.sampling_params import SamplingParams


def run_greedy(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """(generated token ids, num_cached_tokens) of one greedy request run alone to completion."""
    engine.add_request("q", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    result: tuple[list[int], int] | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                result = (out.outputs[0].token_ids, out.num_cached_tokens)
    assert result is not None, "the request never finished"
    return result
