"""The lm_head of a quantized model: int8 per output channel in every --quantization mode.

With `--quantization int8|int4|w8a8_int8|w4a8_int8` (and --quantize-lm-head, the default) the loader
gives the lm_head an int8 weight, one float32 scale per output channel (a vocabulary row), rounded to
nearest: the same packed format and kernels as `--quantization int8`'s projections. int4 is not used for
it in any mode: the logits' error would grow several times for a quarter of the model's bytes. A tied
embedding keeps its lookup table in --dtype and the lm_head gets its own int8 copy (more bytes in all than
an unquantized tied model, fewer bytes read per decode step). w8a8_int8 / w4a8_int8 multiply it with
activations quantized to int8 per block of 32 (Int8DotWeight), as their projections; int8 / int4 exactly.
"""

from __future__ import annotations

import torch

from kvpager.model.backends.quant_dot import DYNAMIC_METHODS, Int4DotWeight, Int8DotWeight
from kvpager.model.backends.quant_weights import Int8Weight, PackedWeight
from kvpager.model.llama import CausalLM


def lm_head_weight(weight: torch.Tensor, method: str) -> Int8Weight:
    """The lm_head for quantization `method`: int8 per output channel, round-to-nearest, in every mode (int4
    costs too much accuracy in the logits); w8a8_int8 / w4a8_int8 multiply it with int8 activations
    (Int8DotWeight), int8 / int4 exactly (Int8Weight)."""
    kind = Int8DotWeight if method in DYNAMIC_METHODS else Int8Weight
    return kind.from_float(weight, None)


def lm_head_format(model: CausalLM) -> str:
    """How the lm_head is stored and multiplied, for the start-up log."""
    weight = model.lm_head.weight
    tied = " (a copy of the tied embedding)" if model.spec.tie_word_embeddings else ""
    if isinstance(weight, Int8Weight) and weight.group_size == weight.in_features:
        dot = " x int8 activations per block of 32" if isinstance(weight, Int8DotWeight) else ""
        return f"int8 per output channel{dot}{tied}"
    if isinstance(weight, PackedWeight):  # a GGUF file's own output tensor, or its tied embedding's blocks
        dot = " x int8 activations per block of 32" if isinstance(weight, Int8DotWeight | Int4DotWeight) else ""
        return f"{weight.method} g{weight.group_size} (packed){dot}{tied}"
    dtype = str(weight.dtype).removeprefix("torch.")
    return dtype + (" (tied to the embedding)" if tied else "")
