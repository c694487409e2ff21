"""Small helpers for tests that drive an Engine directly."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvpager.core.config import EngineConfig
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine

TINY_BLOCK = 4
TINY_BLOCK_BYTES = TINY_BLOCK * 2 * 2 * 2 * 16 * 4  # tiny llama: 2 layers, K+V, 2 KV heads, head_dim 16, fp32


def tiny_llama_config(checkpoint: Path, num_blocks: int, **fields: object) -> EngineConfig:
    """An EngineConfig for the tiny llama checkpoint with a pool of exactly `num_blocks` blocks of 4."""
    base: dict = {"block_size": TINY_BLOCK, "kv_cache_memory": num_blocks * TINY_BLOCK_BYTES, "max_num_seqs": 4}
    return EngineConfig(model=str(checkpoint), **{**base, **fields})


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


def cold_greedy(checkpoint: Path, prompts: Mapping[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from one engine with prefix caching off (64 blocks of 4): the reference
    the prefix-cache, tier and pack tests compare with (tests/test_engine.py checks it against transformers)."""
    engine = Engine(tiny_llama_config(checkpoint, 64, enable_prefix_caching=False))
    return {name: run_greedy(engine, prompt, max_tokens)[0] for name, prompt in prompts.items()}
