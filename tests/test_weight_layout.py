"""Column-major linear weights (kvpager.model.weight_layout): same values, a layout torch and the kernels read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvpager.model.weight_layout import (
    FLOATS_PER_LINE,
    column_major_ld,
    convert_linear_weights,
    padded_ld,
    to_column_major,
)


@pytest.mark.parametrize("out_features", [16, 48, 576, 960, 1008, 3072, 32000, 49152])
def test_padded_row_length_is_an_odd_number_of_lines_past_the_width(out_features: int) -> None:
    ld = padded_ld(out_features)
    assert ld > out_features and ld % FLOATS_PER_LINE == 0 and (ld // FLOATS_PER_LINE) % 2 == 1


def test_column_major_copy_has_the_same_values_and_torch_computes_the_same_linear() -> None:
    w = torch.randn(96, 40, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    wt = to_column_major(w)
    assert wt.shape == w.shape and torch.equal(wt, w)
    assert wt.stride() == (1, padded_ld(96)) and column_major_ld(wt) == padded_ld(96)
    torch.testing.assert_close(F.linear(x, wt), F.linear(x, w))


def test_row_major_and_other_tensors_are_not_column_major() -> None:
    assert column_major_ld(torch.zeros(96, 40)) == 0
    assert column_major_ld(torch.zeros(96, 40, dtype=torch.bfloat16).t().contiguous().t()) == 0
    assert column_major_ld(torch.zeros(4, 96, 40)) == 0
    assert column_major_ld(torch.zeros(96, 1)) == 0


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
    looked_up = model.embed(ids)
    assert convert_linear_weights(model) == 2
    assert column_major_ld(model.proj.weight) == padded_ld(48)
    assert column_major_ld(model.odd.weight) == 0
    # the tied head and the embedding: one column-major tensor, the lookup unchanged
    assert model.head.weight is model.embed.weight and column_major_ld(model.head.weight) == padded_ld(64)
    assert torch.equal(model.embed(ids), looked_up)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_an_embedding_without_a_linear_stays_row_major() -> None:
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 16))
    assert convert_linear_weights(model) == 1
    assert column_major_ld(model[0].weight) == 0 and column_major_ld(model[1].weight) > 0
