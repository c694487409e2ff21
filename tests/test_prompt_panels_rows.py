"""What the integer dot's 8-row panels (kernels/quant_dot_gemm.inc) promise whatever the weight's format:
they start at `kvq_dot_panel_rows` rows on the AVX2 and portable paths only, and a row's bits there do not
depend on the other rows of its batch. Each format's arithmetic: test_int4_prompt_panels.py and
test_int8_prompt_panels.py."""

from __future__ import annotations

import pytest
import torch
from test_int4_prompt_panels import _weight as int4_weight
from test_int8_prompt_panels import _weight as int8_weight
from test_quant_dot import _kernels_or_skip

from kvpager.model.backends.quant_kernels import LEVEL_AVX2, LEVEL_AVX512, LEVEL_PORTABLE, load_quant_kernels
from kvpager.model.backends.quant_weights import PackedWeight

# batches from this many rows take the panels (quant_dot_gemm.inc's kGemmMinRows): decode steps of a
# dozen sequences or more, where the panels' per-call unpacking costs less than the one-row tiles' work
PANEL_ROWS = 12

# a form of each format with a row tail and a panel tail: symmetric int4 with float16 scales, int8 at
# group 16 (two scales per block)
WEIGHTS = {
    "int4": lambda w: int4_weight("g32_symmetric_half", w),
    "int8": lambda w: int8_weight("g16", w),
}


def _weight(fmt: str, n: int, k: int, gen: torch.Generator) -> PackedWeight:
    return WEIGHTS[fmt](torch.randn(n, k, generator=gen) * 0.05)


@pytest.mark.parametrize("fmt", list(WEIGHTS))
@pytest.mark.parametrize("level", [LEVEL_AVX2, LEVEL_PORTABLE])
def test_a_rows_panel_bits_do_not_depend_on_the_other_rows_of_the_batch(fmt: str, level: int) -> None:
    # rows land in a pass of 4 or in the remainder depending on the batch: the same bits either way
    _kernels_or_skip()
    first = int(load_quant_kernels().dot_panel_rows(LEVEL_AVX2))
    gen = torch.Generator().manual_seed(17)
    weight = _weight(fmt, 37, 256, gen)
    weight.max_level = level
    x = torch.randn(2 * first + 3, 256, generator=gen)
    whole = weight.dot_kernel(x)
    for rows in (first, first + 1, first + 2, first + 3, first + 5):
        assert torch.equal(weight.dot_kernel(x[:rows]), whole[:rows]), rows
    order = torch.randperm(x.shape[0], generator=gen)
    assert torch.equal(weight.dot_kernel(x[order]), whole[order])


@pytest.mark.parametrize("fmt", list(WEIGHTS))
def test_panels_start_at_the_kernels_row_count_on_the_avx2_and_portable_paths_only(fmt: str) -> None:
    _kernels_or_skip()
    kernels = load_quant_kernels()
    first = PANEL_ROWS
    assert kernels.dot_panel_rows(LEVEL_PORTABLE) == kernels.dot_panel_rows(LEVEL_AVX2) == first
    if kernels.dot_level(LEVEL_AVX512) == LEVEL_AVX512:
        assert kernels.dot_panel_rows(LEVEL_AVX512) == 0  # the VNNI build's block pairs take every batch
    weight = _weight(fmt, 16, 256, torch.Generator().manual_seed(4))
    weight.max_level = LEVEL_AVX2
    x = torch.randn(first, 256, generator=torch.Generator().manual_seed(5))
    below, at = weight.dot_kernel(x[: first - 1]), weight.dot_kernel(x)
    # one order below the panels (the one-row tiles), another from them on: the same rows differ by rounding
    assert not torch.equal(below, at[: first - 1])
    assert torch.allclose(below, at[: first - 1], rtol=1e-5, atol=1e-5)
    describe = kernels.describe_dot()
    if kernels.dot_level(kernels.default_level) != LEVEL_AVX512:
        assert f"batches of {first}+ rows: 8 output rows per vector" in describe
