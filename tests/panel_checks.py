"""Checks the int4 and int8 prompt-panel tests share (test_int4_prompt_panels.py, test_int8_prompt_panels.py)."""

from __future__ import annotations

import pytest
import torch
from test_quant_dot import _assert_float32_rounding

from kvpager.model.backends.quant_kernels import LEVEL_AVX2, LEVEL_PORTABLE, load_quant_kernels
from kvpager.model.backends.quant_weights import PackedWeight


def panel_rows() -> int:
    """The fewest rows a batch needs to take the panels on the AVX2 / portable paths."""
    rows = int(load_quant_kernels().dot_panel_rows(LEVEL_AVX2))
    assert rows > 1
    return rows


def assert_panels_meet_the_reference(weight: PackedWeight, gen: torch.Generator) -> None:
    """Batches of panel_rows() and more (whole passes of 4 rows and every remainder, an all-zero
    activation block), with and without a bias, on the best path and the portable one."""
    n, k = weight.out_features, weight.in_features
    bias = torch.randn(n, generator=gen)
    first = panel_rows()
    for rows in (first, first + 1, first + 7, 2 * first + 3):
        x = torch.randn(rows, k, generator=gen)
        x[1, :32] = 0.0  # d = 0
        for level in (None, LEVEL_PORTABLE):
            weight.max_level = level
            _assert_float32_rounding(weight.dot_kernel(x, bias), x, weight, bias)
            _assert_float32_rounding(weight.dot_kernel(x), x, weight, None)


def assert_portable_gives_the_avx2_bits(weight: PackedWeight, gen: torch.Generator) -> None:
    if load_quant_kernels().dot_level(LEVEL_AVX2) != LEVEL_AVX2:
        pytest.skip("this CPU has no AVX2: only the portable panels run (held to the reference)")
    x = torch.randn(panel_rows() + 3, weight.in_features, generator=gen) * 3
    weight.max_level = LEVEL_PORTABLE
    portable = weight.dot_kernel(x)
    weight.max_level = LEVEL_AVX2
    assert torch.equal(weight.dot_kernel(x), portable), (weight.out_features, weight.in_features)
