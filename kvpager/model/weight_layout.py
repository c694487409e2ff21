"""Linear weights stored column-major, for the CPU kernels' outer-product linear.

torch's `nn.Linear` keeps its weight row-major, [out_features, in_features]. kvpager's CPU kernel for
small and medium batches (`kvp_linear_t`, kvpager/kernels/linear.cpp) reads it the other way round:
one row of `in_features` rows holds every output column for that input feature. `to_column_major`
copies a weight once into an [in_features, ld] buffer and returns the [out_features, in_features]
*view* of it that torch uses as before (strides (1, ld): torch's GEMM takes it as a transposed
operand, no copy), so no second copy of any weight is kept. `column_major_ld` recognises the layout
from the strides, which is how the ops pick the kernel.

ld is out_features padded to an odd number of 64-byte lines, so that the rows a kernel panel walks
down do not all map to the same cache sets (a power-of-two row length would).
"""

from __future__ import annotations

import torch
from torch import nn

FLOATS_PER_LINE = 16  # float32 per 64-byte cache line


def padded_ld(out_features: int) -> int:
    """The row length (in floats) of a column-major copy: out_features rounded up to an odd number of lines."""
    lines = -(-out_features // FLOATS_PER_LINE) + 1
    if lines % 2 == 0:
        lines += 1
    return lines * FLOATS_PER_LINE


def column_major_ld(weight: torch.Tensor) -> int:
    """The leading dimension of a float32 CPU weight stored column-major ([N, K] with strides (1, ld)),
    or 0 for any other layout."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return 0
    out_features, in_features = weight.shape
    ld = weight.stride(1)
    if weight.stride(0) != 1 or ld < out_features or in_features < 2:
        return 0
    return ld


def to_column_major(weight: torch.Tensor) -> torch.Tensor:
    """A column-major copy of a row-major [N, K] weight, as an [N, K] view (values equal)."""
    out_features, in_features = weight.shape
    buffer = torch.empty((in_features, padded_ld(out_features)), dtype=weight.dtype, device=weight.device)
    view = buffer[:, :out_features]
    view.copy_(weight.t())
    return view.t()


def convert_linear_weights(model: nn.Module) -> int:
    """Store every float32 CPU `nn.Linear` weight of `model` column-major, in place; returns how many.

    A weight the Linear shares with an `nn.Embedding` (a tied lm_head) is converted for both: the
    lookup then gathers strided columns (measured 0.33 vs 0.05 ms for 64 tokens of a 49152 x 576
    table, 10 vs 2 ms for 2,048), the lm_head gets the kernel. Skipped: output widths that are not
    a multiple of 16 (the kernel's vector width) and anything not float32 on the CPU.
    """
    owners: dict[int, list[nn.Module]] = {}  # id(weight) -> the Linear and Embedding modules holding it
    weights: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            owners.setdefault(id(module.weight), []).append(module)
            weights[id(module.weight)] = module.weight
    converted = 0
    for key, holders in owners.items():
        weight = weights[key]
        if (
            not any(isinstance(m, nn.Linear) for m in holders)
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or not weight.is_contiguous()
            or weight.shape[0] % FLOATS_PER_LINE != 0
        ):
            continue
        replacement = nn.Parameter(to_column_major(weight.detach()), requires_grad=False)
        for module in holders:
            module.weight = replacement
        converted += 1
    return converted
