"""Rotary position embeddings: frequencies (default, linear, dynamic, llama3) and a cos/sin table.

The frequencies follow transformers' `modeling_rope_utils` (computed in float32, like it does), so
logits match the reference to fp32 rounding. The table covers every position below
`max_position_embeddings` and is indexed by the token positions of each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpager.model.spec import ModelSpec


def inverse_frequencies(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies for `spec`: [head_dim // 2] float32."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    scaling = spec.rope_scaling or {}
    rope_type = spec.rope_type
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if rope_type == "freq_factors":  # GGUF's rope_freqs tensor (llama.cpp divides each frequency by it)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    # NOTE: "dynamic" equals "default" for positions < max_position_embeddings (the table's range).
    return inv_freq


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency smoothing (transformers `_compute_llama3_parameters`)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass
class RopeCache:
    """cos/sin of every position: each [max_positions, head_dim // 2] in the compute dtype."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(cls, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> RopeCache:
        inv_freq = inverse_frequencies(spec)
        positions = torch.arange(spec.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, head_dim // 2], float32 like transformers
        return cls(cos=freqs.cos().to(device=device, dtype=dtype), sin=freqs.sin().to(device=device, dtype=dtype))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T]: each [T, 1, head_dim // 2] (broadcasts over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [T, num_heads, head_dim] by (cos, sin) [T, 1, head_dim // 2] (rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
