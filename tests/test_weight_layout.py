"""Linear weights in column blocks (kvpager.model.backends.weight_layout): the same values, a layout the kernels read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpager.model.backends.weight_layout import (
    BLOCK,
    block_stride,
    blocked_stride,
    convert_linear_weights,
    embedding_rows,
    logical_shape,
    to_blocked,
    unblocked,
)


@pytest.mark.parametrize("in_features", [1, 7, 40, 576, 1536, 4096])
def test_block_stride_is_an_odd_number_of_lines_past_the_block(in_features: int) -> None:
    stride = block_stride(in_features)
    assert stride > in_features * BLOCK and stride % BLOCK == 0 and (stride // BLOCK) % 2 == 1


def test_blocks_hold_sixteen_output_columns_one_line_per_input_feature() -> None:
    w = torch.randn(48, 40, generator=torch.Generator().manual_seed(0))
    wb = to_blocked(w)
    assert wb.shape == (3, 40, BLOCK) and wb.stride() == (block_stride(40), BLOCK, 1)
    assert blocked_stride(wb) == block_stride(40) and logical_shape(wb) == (48, 40)
    flat = torch.as_strided(wb, (wb.stride(0) * 3,), (1,))  # the buffer, padding included
    assert torch.equal(flat[block_stride(40) + 5 * BLOCK + 3], w[BLOCK + 3, 5])  # block 1, feature 5, column 3
    assert torch.equal(unblocked(wb), w) and unblocked(w) is w


def test_other_tensors_are_not_blocked() -> None:
    assert blocked_stride(torch.zeros(96, 40)) == 0
    assert blocked_stride(torch.zeros(6, 40, 16, dtype=torch.bfloat16)) == 0
    assert blocked_stride(torch.zeros(6, 40, 8)) == 0
    assert blocked_stride(torch.zeros(6, 16, 40).transpose(1, 2)) == 0
    assert logical_shape(torch.zeros(96, 40)) == (96, 40)


def test_a_width_that_is_no_multiple_of_sixteen_is_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        to_blocked(torch.zeros(20, 8))


def test_embedding_rows_are_the_same_in_either_layout() -> None:
    table = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([0, 15, 16, 63, 5, 5])
    assert torch.equal(embedding_rows(to_blocked(table), ids), table[ids])
    assert torch.equal(embedding_rows(table, ids), table[ids])


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 48)
        self.odd = nn.Linear(32, 20)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight


def test_convert_keeps_tied_weights_shared_and_skips_widths_the_kernel_cannot_tile() -> None:
    model = _Tied()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([0, 5, 63, 5])
    assert convert_linear_weights(model) == 2
    assert blocked_stride(model.proj.weight) == block_stride(32)
    assert blocked_stride(model.odd.weight) == 0
    # the tied head and the embedding: one blocked tensor, the lookup unchanged
    assert model.head.weight is model.embed.weight and blocked_stride(model.head.weight) > 0
    assert torch.equal(embedding_rows(model.embed.weight, ids), before["embed.weight"][ids])
    for name, p in model.named_parameters():
        assert torch.equal(unblocked(p), before[name]), name


def test_an_embedding_without_a_linear_stays_row_major() -> None:
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 16))
    assert convert_linear_weights(model) == 1
    assert blocked_stride(model[0].weight) == 0 and blocked_stride(model[1].weight) > 0
