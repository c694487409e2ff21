"""The two copies that had diverged: `--seed` reaching the sampler, and one byte-size rule for every flag."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import tiny_llama_config

from kvpager.cli import plan as plan_cli
from kvpager.core import units
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine import args as engine_args
from kvpager.engine.engine import Engine

SIZE_STRINGS = ["4G", "4GiB", "4GB", "512MiB", "512M", "2k", "2kB", "1.5GiB", "1073741824", "1e9", "3T", "64 MiB"]


@pytest.mark.parametrize("text", SIZE_STRINGS)
def test_serve_and_plan_read_every_size_string_the_same(text: str) -> None:
    serve = engine_args.bytes_arg(text)
    parser = plan_cli.build_parser()
    args = parser.parse_args(["Llama-3.1-8B", "--kv-cache-memory", text])
    plan = plan_cli._options(args, None).kv_cache_memory
    assert serve == plan == units.parse_bytes(text)


def test_single_letter_suffixes_are_binary_and_decimal_units_are_decimal() -> None:
    assert units.parse_bytes("4G") == 4 * 1024**3 == units.parse_bytes("4GiB")
    assert units.parse_bytes("4GB") == 4 * 10**9
    assert units.parse_bytes("2k") == 2048 and units.parse_bytes("2kB") == 2000


@pytest.mark.parametrize("text", ["0", "-1G", "four", "4 parsecs"])
def test_a_bad_or_empty_engine_size_is_a_usage_error(text: str) -> None:
    with pytest.raises(Exception, match="size|negative|positive"):
        engine_args.bytes_arg(text)


def _sampled(checkpoint: Path, seed: int) -> list[list[int]]:
    engine = Engine(tiny_llama_config(checkpoint, num_blocks=64, seed=seed))
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # unseeded: the engine's seed decides
    for i in range(3):
        engine.add_request(f"r{i}", [1, 2, 3 + i], params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return [outs[f"r{i}"] for i in range(3)]


def test_engine_seed_makes_unseeded_sampling_repeatable_and_a_different_seed_differs(llama_checkpoint: Path) -> None:
    first = _sampled(llama_checkpoint, seed=7)
    assert _sampled(llama_checkpoint, seed=7) == first
    assert _sampled(llama_checkpoint, seed=8) != first
