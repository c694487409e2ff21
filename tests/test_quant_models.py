"""Quantized and bfloat16 models inside the engine.

- A quantized model generates exactly the greedy tokens of a float32 model whose checkpoint holds
  the dequantized weights (so quantization changes the weights, nothing else).
- Every format (bf16, fp16, int8, int4, w8a8_int8, w4a8_int8) gives the same tokens through prefix caching, preemption and the
  host KV tier as the same format run cold; its KV fingerprint names the format and weights.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from dequantized import dequantized_checkpoint
from engine_helpers import run_greedy

from kvpager.core.config import EngineConfig
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine
from kvpager.model.backends.quant_weights import Int4Weight, Int8Weight

BLOCK = 4
# bf16 logits move by ~1e-2 with the batch's shape (tests/test_bf16_models.py bounds them): a top-2
# margin below this may flip; the float formats' logits move by float32 rounding only.
BF16_NEAR_TIE = 0.1
NUM_NEW = 20  # cold runs; the tier test compares the first 6 (greedy: a prefix of the same run)
FORMATS: dict[str, dict[str, object]] = {
    "bf16": {"dtype": "bfloat16"},
    "fp16": {"dtype": "float16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4", "quantization_group_size": 32},
    "w8a8_int8": {"quantization": "w8a8_int8"},  # not exact (activations rounded): cold tokens of its own
    "w4a8_int8": {"quantization": "w4a8_int8", "quantization_group_size": 32},
}
RNG = random.Random(11)
SHARED = [RNG.randrange(3, 384) for _ in range(40)]  # 10 full blocks
PROMPTS = {
    "a": SHARED + [RNG.randrange(3, 384) for _ in range(7)],
    "b": SHARED + [RNG.randrange(3, 384) for _ in range(5)],
}
FILLERS = [[RNG.randrange(3, 384) for _ in range(30)] for _ in range(6)]


def _config(checkpoint: Path, fmt: str, num_blocks: int, **fields: object) -> EngineConfig:
    kv_bytes = 2 if fmt in ("bf16", "fp16") else 4
    block_bytes = BLOCK * 2 * 2 * 2 * 16 * kv_bytes  # tiny llama: 2 layers, K+V, 2 KV heads, head_dim 16
    base = {"block_size": BLOCK, "kv_cache_memory": num_blocks * block_bytes, "max_num_seqs": 4}
    return EngineConfig(model=str(checkpoint), **{**base, **FORMATS[fmt], **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_model_generates_the_tokens_of_a_float_model_holding_the_dequantized_weights(
    llama_checkpoint: Path, tmp_path: Path, fmt: str
) -> None:
    quantized = Engine(_config(llama_checkpoint, fmt, 64))
    float_dir = dequantized_checkpoint(quantized.loaded.model, llama_checkpoint, tmp_path / "dequantized")
    dense = Engine(_config(float_dir, "int8", 64, quantization=None))
    original = Engine(_config(llama_checkpoint, "int8", 64, quantization=None))
    for prompt in [*PROMPTS.values(), *FILLERS[:3]]:
        assert run_greedy(quantized, prompt, 12)[0] == run_greedy(dense, prompt, 12)[0]
    weights = quantized.loaded.model.layers[0].mlp.down_proj.weight
    assert isinstance(weights, Int8Weight if fmt == "int8" else Int4Weight)
    assert quantized.loaded.weight_bytes < original.loaded.weight_bytes
    assert quantized.loaded.fingerprint != original.loaded.fingerprint
    assert f"+{fmt}-g" in quantized.loaded.weights_digest


@pytest.fixture(scope="module")
def cold(llama_checkpoint: Path) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """Per format: each prompt run alone on a fresh engine with prefix caching off: the greedy tokens
    and, per position, the margin between the top two logprobs."""
    out: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=2)
    for fmt in FORMATS:
        engine = Engine(_config(llama_checkpoint, fmt, 64, enable_prefix_caching=False))
        out[fmt] = {}
        for name, prompt in {**PROMPTS, **{f"f{i}": p for i, p in enumerate(FILLERS)}}.items():
            engine.add_request(name, prompt, params)
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        positions = o.outputs[0].logprobs or []
                        margins = [p.top[0][1] - p.top[1][1] for p in positions]
                        out[fmt][name] = (o.outputs[0].token_ids, margins)
    return out


def _same_as_cold(fmt: str, got: list[int], cold: tuple[list[int], list[float]]) -> bool:
    """Float32-compute formats: the cold tokens exactly. bf16: the cold tokens up to the first position
    where the cold run's top two logprobs are within BF16_NEAR_TIE (there a batch of another shape,
    which rounds its bf16 activations differently, may legitimately pick the other token)."""
    tokens, margins = cold
    if fmt not in ("bf16", "fp16"):  # NOTE: fp16 keeps a 16-bit KV cache (its rounding may flip likewise)
        return got == tokens
    for i, (a, b) in enumerate(zip(got, tokens, strict=True)):
        if a != b:
            return margins[i] < BF16_NEAR_TIE
    return True


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_gives_cold_tokens_through_prefix_cache_and_host_tier(
    llama_checkpoint: Path, cold: dict[str, dict[str, tuple[list[int], list[float]]]], fmt: str
) -> None:
    engine = Engine(_config(llama_checkpoint, fmt, 24, host_kv_cache_memory=1 << 20))
    assert run_greedy(engine, PROMPTS["a"], 6) == (cold[fmt]["a"][0][:6], 0)
    assert run_greedy(engine, PROMPTS["b"], 6) == (cold[fmt]["b"][0][:6], 40)  # device prefix cache
    for i, prompt in enumerate(FILLERS):  # push the shared prefix out of the device pool
        assert run_greedy(engine, prompt, 6)[0] == cold[fmt][f"f{i}"][0][:6]
    assert run_greedy(engine, PROMPTS["a"], 6) == (cold[fmt]["a"][0][:6], 44)  # 11 blocks back from the host tier
    stats = engine.kv_tier_stats()
    assert stats.host is not None and stats.host.hits >= 10 and stats.device_evictions > 0


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_gives_cold_tokens_under_preemption(
    llama_checkpoint: Path, cold: dict[str, dict[str, tuple[list[int], list[float]]]], fmt: str
) -> None:
    # 24 blocks of 4: two 30-token prompts fit, their 20 new tokens each do not; prefills in chunks of 16
    engine = Engine(_config(llama_checkpoint, fmt, 24, max_num_seqs=6, max_num_batched_tokens=16))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    for i, prompt in enumerate(FILLERS):
        engine.add_request(f"f{i}", prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert engine.stats().num_preemptions > 0
    assert finished.keys() == {f"f{i}" for i in range(len(FILLERS))}
    for name, tokens in finished.items():
        assert _same_as_cold(fmt, tokens, cold[fmt][name]), name
    if fmt not in ("bf16", "fp16"):
        assert finished == {name: cold[fmt][name][0] for name in finished}
