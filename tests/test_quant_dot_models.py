"""Whole models in w8a8_int8 / w4a8_int8 against the exact int8 / int4 models on the same weights.

The dynamic formats store the exact formats' weights and round only the activations entering each
projection (int8 per block of 32, relative step 1/127 of the block's largest value), so their logits
stay near the exact format's. The bound asserted is about twice the difference measured on the tiny
Llama (hidden 64, 2 layers, random weights, logits of standard deviation 0.41): w8a8_int8 vs int8
measured 1.4e-2, w4a8_int8 vs int4 (group 32) 1.5e-2 (max |difference| over the prompt's prefill and
6 decode steps); for scale, int8 itself is 1.5e-2 from float32 and int4 2.7e-1. Prefill (more rows than
quant_dot.dot_kernel_max_rows: the quantized activations through the exact kernel's tile) and decode (one row: the integer-dot
kernel) are both covered.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpager.core.config import EngineConfig
from kvpager.engine.engine import Engine
from kvpager.model import allocate_kv_cache, build_attention_metadata, load_model
from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight

BLOCK = 16
PROMPT = [5, 77, 301, 12, 250, 9, 133, 64, 18, 200, 37, 99]
DECODE = [41, 7, 350, 120, 66, 3]
# (dynamic, exact, group, bound on max |logit difference|)
PAIRS = [("w8a8_int8", "int8", None, 3e-2), ("w4a8_int8", "int4", 32, 3e-2)]


def _logits(model_dir: Path, quantization: str | None, group: int | None) -> tuple[torch.Tensor, torch.nn.Module]:
    """Logits of the prompt's prefill (one forward) and of DECODE fed one token at a time."""
    model = load_model(
        model_dir, dtype=torch.float32, device="cpu", quantization=quantization, quantization_group_size=group
    )
    ids = PROMPT + DECODE
    kv = allocate_kv_cache(model.spec, -(-len(ids) // BLOCK), BLOCK, torch.float32, "cpu")
    table = list(range(-(-len(ids) // BLOCK)))
    out = []
    with torch.inference_mode():
        chunks = [(0, len(PROMPT))] + [(len(PROMPT) + i, len(PROMPT) + i + 1) for i in range(len(DECODE))]
        for start, end in chunks:
            meta = build_attention_metadata([end - start], [end], [table], BLOCK, "cpu")
            hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), kv, meta)
            out.append(model.compute_logits(hidden).float())
    return torch.cat(out), model


@pytest.mark.parametrize(("dynamic", "exact", "group", "bound"), PAIRS, ids=[p[0] for p in PAIRS])
def test_dynamic_model_logits_stay_within_the_measured_bound_of_the_exact_format(
    llama_checkpoint: Path, dynamic: str, exact: str, group: int | None, bound: float
) -> None:
    fast, model = _logits(llama_checkpoint, dynamic, group)
    slow, _ = _logits(llama_checkpoint, exact, group)
    assert isinstance(model.layers[0].mlp.down_proj.weight, Int8DotWeight if dynamic == "w8a8_int8" else Int4DotWeight)
    diff = (fast - slow).abs().max().item()
    print(f"{dynamic} vs {exact}: max |logit difference| {diff:.2e}")
    assert 0 < diff <= bound
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() >= 0.9


def test_kv_fingerprint_separates_the_dynamic_formats_from_the_exact_ones(llama_checkpoint: Path) -> None:
    # the same weights, other activations: KV from one must never be reused by the other
    loaded = {
        q: Engine(EngineConfig(model=str(llama_checkpoint), quantization=q, kv_cache_memory=1 << 20)).loaded
        for q in ("int8", "w8a8_int8")
    }
    assert loaded["int8"].weight_bytes == loaded["w8a8_int8"].weight_bytes
    assert loaded["int8"].fingerprint != loaded["w8a8_int8"].fingerprint
    assert "+w8a8_int8-gchannel:" in loaded["w8a8_int8"].weights_digest
