"""Linear weights stored in column blocks, for the CPU kernels' outer-product linear.

torch's `nn.Linear` keeps its weight row-major, [out_features, in_features]. kvpager's CPU kernel
(`kvp_linear_b`, kvpager/model/backends/kernels/linear.cpp) computes outer products: for each input feature k it
reads the weights of a panel of output columns and multiplies them with every input row. It wants
those weights contiguous and in the order it reads them, so `to_blocked` copies a weight once into
blocks of 16 output columns (one 64-byte line per input feature): block b holds
w[16b : 16b + 16, k] for k = 0..K-1, one block after the other. A panel of 48 columns is then
three sequential streams the hardware prefetchers follow; a column-major [K, N] copy (the previous
layout) made the same panel read 192 bytes out of every weight row, one DRAM page apart, and
measured 1.06-1.25x slower over 30 streamed SmolLM2 layers at 1-64 rows.

The copy is a [N / 16, K, 16] tensor with strides (block_stride, 16, 1); `blocked_stride`
recognises it. Blocks are padded to an odd number of lines so that the block streams of a panel do
not fall into the same cache sets. torch cannot read the layout as an [N, K] matrix: `unblocked`
copies it back (slow paths and tests), the ops unpack it for torch's GEMM on large batches.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK = 16  # output columns per block: one AVX-512 vector of float32, one 64-byte line per input feature


def block_stride(in_features: int) -> int:
    """Floats from one block to the next: in_features lines rounded up past it to an odd number."""
    lines = in_features + 1
    if lines % 2 == 0:
        lines += 1
    return lines * BLOCK


def blocked_stride(weight: torch.Tensor) -> int:
    """The block stride of a float32 CPU weight stored in column blocks ([N / 16, K, 16] with strides
    (block_stride, 16, 1)), or 0 for any other tensor."""
    if weight.dim() != 3 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return 0
    _, in_features, block = weight.shape
    if block != BLOCK or weight.stride(1) != BLOCK or weight.stride(2) != 1 or weight.stride(0) < in_features * BLOCK:
        return 0
    return weight.stride(0)


def logical_shape(weight: torch.Tensor) -> tuple[int, int]:
    """(out_features, in_features) of a linear weight in either layout."""
    if blocked_stride(weight):
        return weight.shape[0] * BLOCK, weight.shape[1]
    return weight.shape[0], weight.shape[1]


def to_blocked(weight: torch.Tensor) -> torch.Tensor:
    """The column-block copy of a row-major [N, K] float32 weight (N a multiple of 16)."""
    out_features, in_features = weight.shape
    if out_features % BLOCK != 0:
        raise ValueError(f"column blocks need out_features divisible by {BLOCK}, got {out_features}")
    blocks, stride = out_features // BLOCK, block_stride(in_features)
    buffer = torch.empty(blocks * stride, dtype=weight.dtype, device=weight.device)
    view = buffer.as_strided((blocks, in_features, BLOCK), (stride, BLOCK, 1))
    view.copy_(weight.reshape(blocks, BLOCK, in_features).transpose(1, 2))
    return view


def unblocked(weight: torch.Tensor) -> torch.Tensor:
    """A row-major [N, K] copy of a weight stored in column blocks; any other weight unchanged."""
    if not blocked_stride(weight):
        return weight
    blocks, in_features, _ = weight.shape
    return weight.transpose(1, 2).reshape(blocks * BLOCK, in_features)


def embedding_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] for an embedding table in either layout ([T, hidden]); for blocks a strided gather."""
    if not blocked_stride(weight):
        return weight[ids]
    return weight[ids // BLOCK, :, ids % BLOCK]


def convert_linear_weights(model: nn.Module) -> int:
    """Store every float32 CPU `nn.Linear` weight of `model` in column blocks, in place; returns how many.

    A weight the Linear shares with an `nn.Embedding` (a tied lm_head) is converted for both, so no
    second copy of the table is kept: the lookup (`embedding_rows`, through the ops) gathers one
    float of every 16. Skipped: output widths that are not a multiple of 16 (the kernel's vector
    width) and anything not float32 on the CPU.
    """
    owners: dict[int, list[nn.Module]] = {}  # id(weight) -> the Linear and Embedding modules holding it
    weights: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding) and isinstance(module.weight, torch.Tensor):
            owners.setdefault(id(module.weight), []).append(module)
            weights[id(module.weight)] = module.weight
    converted = 0
    for key, holders in owners.items():
        weight = weights[key]
        if (
            not any(isinstance(m, nn.Linear) for m in holders)
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or weight.dim() != 2
            or weight.shape[0] % BLOCK != 0
        ):
            continue
        replacement = nn.Parameter(to_blocked(weight.detach()), requires_grad=False)
        for module in holders:
            module.weight = replacement
        converted += 1
    return converted
