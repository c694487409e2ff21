"""Logit edits a request asks for, batched over [B, V]: logit_bias and grammar token bitmasks.

Both run before penalties and temperature (vLLM v1's order: the logits processors first), and
after the raw logprobs are taken, so reported logprobs stay the model's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpager.core.sampling_params import SamplingParams

BITS = 32


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each row's `logit_bias` (token id -> bias) to its logits; ids past the vocab are ignored."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < vocab:
                rows.append(i)
                cols.append(token_id)
                values.append(bias)
    if not rows:
        return logits
    logits = logits.clone()
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
    return logits


def bitmask_to_bool(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 (bit j of word w allows token 32w+j) -> [B, V] bool allowed."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Set to -inf the tokens a grammar forbids in `rows` (bitmask: [len(rows), W] int32, any device)."""
    if not rows:
        return logits
    allowed = bitmask_to_bool(bitmask.to(logits.device), logits.shape[1])
    index = torch.tensor(list(rows), device=logits.device)
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits
