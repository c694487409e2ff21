"""Symmetric int4 weights for the kernel tests: GGUF Q4_0's form, w = (code - 8) * scale, no offsets."""

from __future__ import annotations

import torch

from kvpager.model.backends.quant_weights import Int4Weight


def symmetric_int4(cls: type[Int4Weight], weight: torch.Tensor, group: int) -> Int4Weight:
    """`weight` [N, K] quantized as Q4_0 does (scale = the group's max |w| / 8, codes clamped to 0..15)
    in `cls` (Int4Weight or its integer-dot subclass), holding no offsets."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -k % group)).view(n, -1, group)
    scales = padded.abs().amax(-1) / 8.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (padded / scales[..., None]).round().add(8).clamp(0, 15).flatten(1)[:, :k]
    return cls.from_codes(codes.to(torch.uint8), scales, None, group)


def with_offsets(weight: Int4Weight) -> Int4Weight:
    """The same weight with its offsets (-8 * scale) stored: the asymmetric form of the same values."""
    return type(weight)(
        weight.plain_packed(), weight.scales, weight.group_offsets(), weight.group_size, weight.in_features
    )
