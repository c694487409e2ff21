"""Prompt logprobs: the logprob of each prompt token given the ones before it, from the prefill.

The runner hands over the hidden states of a step; for every row whose request asked for prompt
logprobs, the positions of this step that predict a prompt token are turned into logits (in
slices, so a long prefill never materialises [T, V] at once) and their log_softmax is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvpager.core.outputs import PositionLogprobs
from kvpager.core.scheduler import ScheduledRequest

SLICE_ROWS = 256


def prompt_positions(start: int, num_tokens: int, num_prompt_tokens: int) -> range:
    """Positions of a step whose logits predict a prompt token (position p predicts token p + 1)."""
    return range(start, min(start + num_tokens, num_prompt_tokens - 1))


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    hidden_rows: list[int],
    targets: list[int],
    k: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[PositionLogprobs]:
    """One PositionLogprobs per (hidden row, target token): its logprob, rank and the top-k."""
    out: list[PositionLogprobs] = []
    for lo in range(0, len(hidden_rows), SLICE_ROWS):
        rows = torch.tensor(hidden_rows[lo : lo + SLICE_ROWS], dtype=torch.long, device=hidden.device)
        want = torch.tensor(targets[lo : lo + SLICE_ROWS], dtype=torch.long, device=hidden.device)
        logprobs = torch.log_softmax(compute_logits(hidden.index_select(0, rows)).float(), dim=-1)
        chosen = logprobs.gather(1, want.unsqueeze(1))  # [S, 1]
        ranks = (logprobs > chosen).sum(dim=1) + 1
        top_values, top_ids = logprobs.topk(k, dim=-1)
        chosen_l, ranks_l = chosen.squeeze(1).tolist(), ranks.tolist()
        ids_l, values_l = top_ids.tolist(), top_values.tolist()
        for i, token_id in enumerate(targets[lo : lo + SLICE_ROWS]):
            top = list(zip(ids_l[i], values_l[i], strict=True))
            out.append(PositionLogprobs(token_id=token_id, logprob=chosen_l[i], top=top, rank=int(ranks_l[i])))
    return out


def store_prompt_logprobs(
    scheduled: Sequence[ScheduledRequest],
    rows: Mapping[str, Any],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Store in each asking row (`row.prompt_logprobs`: position -> logprobs, until
    `row.prompt_logprobs_taken`) the prompt tokens this step predicts; one logits batch for all."""
    hidden_rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[Any, int]] = []
    k = 0
    offset = 0
    for s in scheduled:
        row = rows.get(s.request_id)
        if row is not None and row.prompt_logprobs is not None and not row.prompt_logprobs_taken:
            for p in prompt_positions(s.start_position, s.num_tokens, len(row.prompt_token_ids)):
                hidden_rows.append(offset + p - s.start_position)
                targets.append(row.prompt_token_ids[p + 1])
                owners.append((row, p + 1))
            k = max(k, row.params.prompt_logprobs or 0)
        offset += s.num_tokens
    if not hidden_rows:
        return
    computed = compute_prompt_logprobs(hidden, hidden_rows, targets, k, compute_logits)
    for (row, position), lp in zip(owners, computed, strict=True):
        lp.top = lp.top[: row.params.prompt_logprobs or 0]
        row.prompt_logprobs[position] = lp
