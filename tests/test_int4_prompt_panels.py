"""int4 batches of many rows through the integer dot's 8-row panels (kernels/quant_dot_gemm.inc).

From `kvq_dot_panel_rows` rows on, the AVX2 and portable builds unpack each group of 8 output rows once
per call and keep one output row per vector lane. Held to the same reference as the one-row tiles (the
quantized activations times the dequantized weight, float32 rounding of the accumulation), for every
int4 form the other tiles take: groups of one and of several blocks, symmetric (Q4_0: no offsets
stored), float16 scales, rows interleaved or plain, K not a multiple of 32, N not a multiple of 8.
"""

from __future__ import annotations

import pytest
import torch
from symmetric_int4 import symmetric_int4
from test_quant_dot import _assert_float32_rounding, _kernels_or_skip

from kvpager.model.backends.quant_dot import Int4DotWeight
from kvpager.model.backends.quant_kernels import LEVEL_AVX2, LEVEL_AVX512, LEVEL_PORTABLE, load_quant_kernels

# (N, K): N not a multiple of the panel (37, 130, 9), K a multiple of 32 but not of the group (96 and 160
# with g64 / g128), K not a multiple of 32 (200: a last block of 8 codes), a model-like row (2048)
SHAPES = [(37, 96), (64, 256), (130, 160), (9, 200), (24, 2048)]


def _weight(form: str, w: torch.Tensor) -> Int4DotWeight:
    group = int(form.split("_")[0][1:])
    if "symmetric" in form:
        weight = symmetric_int4(Int4DotWeight, w, group)
    else:
        weight = Int4DotWeight.from_float(w, group)
    scales = weight.scales.half() if "half" in form else weight.scales
    interleave = "plain" not in form
    return Int4DotWeight(
        weight.plain_packed(), scales, weight.offsets, group, weight.in_features, interleave=interleave
    )


FORMS = ["g32", "g32_symmetric_half", "g32_plain", "g64", "g64_symmetric", "g128_half"]


def _panel_rows() -> int:
    rows = int(load_quant_kernels().dot_panel_rows(LEVEL_AVX2))
    assert rows > 1
    return rows


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_panels_equal_the_quantized_activation_reference_to_float32_rounding(form: str, shape: tuple[int, int]) -> None:
    _kernels_or_skip()
    first = _panel_rows()
    gen = torch.Generator().manual_seed(FORMS.index(form) * 10 + SHAPES.index(shape))
    n, k = shape
    weight = _weight(form, torch.randn(n, k, generator=gen) * 0.05)
    bias = torch.randn(n, generator=gen)
    for rows in (first, first + 1, first + 7, 2 * first + 3):  # whole passes of 4 rows and every remainder
        x = torch.randn(rows, k, generator=gen)
        x[1, :32] = 0.0  # an all-zero block (d = 0)
        for level in (None, LEVEL_PORTABLE):
            weight.max_level = level
            _assert_float32_rounding(weight.dot_kernel(x, bias), x, weight, bias)
            _assert_float32_rounding(weight.dot_kernel(x), x, weight, None)


@pytest.mark.parametrize("form", FORMS)
def test_portable_and_avx2_panels_agree_bit_for_bit(form: str) -> None:
    _kernels_or_skip()
    if load_quant_kernels().dot_level(LEVEL_AVX2) != LEVEL_AVX2:
        pytest.skip("this CPU has no AVX2: only the portable panels run (held to the reference above)")
    gen = torch.Generator().manual_seed(3 + FORMS.index(form))
    for n, k in SHAPES:
        weight = _weight(form, torch.randn(n, k, generator=gen))
        x = torch.randn(_panel_rows() + 3, k, generator=gen) * 3
        weight.max_level = LEVEL_PORTABLE
        portable = weight.dot_kernel(x)
        weight.max_level = LEVEL_AVX2
        assert torch.equal(weight.dot_kernel(x), portable), (form, n, k)


@pytest.mark.parametrize("level", [LEVEL_AVX2, LEVEL_PORTABLE])
def test_a_rows_panel_bits_do_not_depend_on_the_other_rows_of_the_batch(level: int) -> None:
    # rows land in a pass of 4 or in the remainder depending on the batch: the same bits either way
    _kernels_or_skip()
    first = _panel_rows()
    gen = torch.Generator().manual_seed(17)
    weight = _weight("g32_symmetric_half", torch.randn(37, 200, generator=gen) * 0.05)
    weight.max_level = level
    x = torch.randn(2 * first + 3, 200, generator=gen)
    whole = weight.dot_kernel(x)
    for rows in (first, first + 1, first + 2, first + 3, first + 5):
        assert torch.equal(weight.dot_kernel(x[:rows]), whole[:rows]), rows
    order = torch.randperm(x.shape[0], generator=gen)
    assert torch.equal(weight.dot_kernel(x[order]), whole[order])


def test_panels_start_at_the_kernels_row_count_on_the_avx2_and_portable_paths_only() -> None:
    _kernels_or_skip()
    kernels = load_quant_kernels()
    assert kernels.dot_panel_rows(LEVEL_PORTABLE) == kernels.dot_panel_rows(LEVEL_AVX2) == 32
    if kernels.dot_level(LEVEL_AVX512) == LEVEL_AVX512:
        assert kernels.dot_panel_rows(LEVEL_AVX512) == 0  # the VNNI build's block pairs take every batch
    gen = torch.Generator().manual_seed(4)
    weight = _weight("g32", torch.randn(16, 256, generator=gen))
    weight.max_level = LEVEL_AVX2
    x = torch.randn(32, 256, generator=gen)
    below, at = weight.dot_kernel(x[:31]), weight.dot_kernel(x)
    # one order below the panels (the one-row tiles), another from them on: the same rows differ by rounding
    assert not torch.equal(below, at[:31])
    assert torch.allclose(below, at[:31], rtol=1e-5, atol=1e-5)
    describe = kernels.describe_dot()
    if kernels.dot_level(kernels.default_level) != LEVEL_AVX512:
        assert "batches of 32+ rows: 8 output rows per vector" in describe
