"""GGUF tensors -> the model's weights, one tensor at a time, in the model's float dtype.

Float tensors (F32, F16, BF16) are converted; quantized ones (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) are
dequantized with the `gguf` package's own block decoders (kvpager has no kernels reading GGUF blocks,
so they are not kept quantized). Each tensor goes from its memory-mapped bytes to a float32 or
target-dtype array and is released before the next one is read, so loading holds one full copy of
the weights (the model's) plus one tensor in flight.

llama.cpp's converter permutes the rows of a llama model's q/k projections (its RoPE pairs adjacent
elements, transformers' rotates halves); that permutation is undone here, so the weights are
transformers'. qwen2/qwen3 files are not permuted.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import torch

from kvpager.gguf.config import ROPE_FREQS_TENSOR
from kvpager.gguf.reader import GGUFError, GGUFModel, GGUFTensor
from kvpager.model.spec import ModelSpec

logger = logging.getLogger("kvpager")

FLOAT_TYPES = ("F32", "F16", "BF16")
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TENSOR_TYPES = FLOAT_TYPES + QUANTIZED_TYPES

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors the config already consumed (the rope divisors become the spec's rope scaling).
_CONSUMED = (ROPE_FREQS_TENSOR,)


@dataclass(frozen=True)
class GGUFLoadReport:
    """What happened to each ggml type: how many tensors, and in what form the model holds them."""

    counts: dict[str, int]
    dtype: torch.dtype

    def lines(self) -> list[str]:
        name = str(self.dtype).removeprefix("torch.")
        out = []
        for type_name, count in self.counts.items():
            if type_name in QUANTIZED_TYPES:
                out.append(f"{type_name}: {count} tensor(s) dequantized to {name} at load (no GGUF block kernels)")
            else:
                out.append(f"{type_name}: {count} tensor(s) as {name}")
        return out


def read_gguf_state(
    model: GGUFModel, spec: ModelSpec, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], GGUFLoadReport]:
    """Every tensor under the loader's checkpoint names (no "model." prefix), on CPU in `dtype`."""
    permute = model.architecture == "llama"
    state: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    for gguf_name, tensor in model.tensors.items():
        if gguf_name in _CONSUMED:
            continue
        name = checkpoint_name(gguf_name, model)
        if spec.tie_word_embeddings and name == "lm_head.weight":
            continue
        weights = tensor_to_torch(tensor, dtype, model)
        if permute and (".q_proj." in name or ".k_proj." in name):
            heads = spec.num_heads if ".q_proj." in name else spec.num_kv_heads
            weights = unpermute_rope_rows(weights, heads)
        state[name] = weights
        counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
    return state, GGUFLoadReport(dict(sorted(counts.items())), dtype)


def checkpoint_name(gguf_name: str, model: GGUFModel) -> str:
    """llama.cpp's tensor name -> transformers' (without "model."); GGUFError for a name kvpager does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.match(gguf_name)
    if match is not None and match[2] in _LAYER_NAMES:
        return f"layers.{match[1]}.{_LAYER_NAMES[match[2]]}"
    raise GGUFError(
        f"GGUF file {str(model.path)!r} holds tensor {gguf_name!r}, which a {model.architecture} model does not use"
    )


def tensor_to_torch(tensor: GGUFTensor, dtype: torch.dtype, model: GGUFModel) -> torch.Tensor:
    """One tensor's values as a new CPU tensor of `tensor.shape` in `dtype` (dequantized when quantized)."""
    kind = tensor.type_name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise GGUFError(
            f"GGUF file {str(model.path)!r}: tensor {tensor.name!r} has ggml type {kind}, which kvpager cannot load "
            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
        )
    if kind == "BF16":
        raw = np.ascontiguousarray(tensor.data).view(np.int16).reshape(tensor.shape)
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).to(dtype)
    if kind in ("F32", "F16"):
        # NOTE: np.array copies out of the read-only memory map (torch wants writable memory).
        values = np.array(tensor.data, copy=True).reshape(tensor.shape)
    else:
        from gguf import GGMLQuantizationType, dequantize

        # dequantize returns a new float32 array: no further copy
        values = dequantize(np.asarray(tensor.data), GGMLQuantizationType[kind]).reshape(tensor.shape)
    out = torch.from_numpy(np.ascontiguousarray(values))
    return out if out.dtype == dtype else out.to(dtype)


def unpermute_rope_rows(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (0, d/2, 1, d/2+1, ...) back to (0, 1, ..., d-1)."""
    rows = weights.shape[0]
    head_dim = rows // num_heads
    grouped = weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:])
    return grouped.transpose(1, 2).reshape(weights.shape).contiguous()
