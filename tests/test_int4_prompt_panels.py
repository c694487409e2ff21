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
from panel_checks import assert_panels_meet_the_reference, assert_portable_gives_the_avx2_bits
from symmetric_int4 import symmetric_int4
from test_quant_dot import _kernels_or_skip

from kvpager.model.backends.quant_dot import Int4DotWeight

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


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_panels_equal_the_quantized_activation_reference_to_float32_rounding(form: str, shape: tuple[int, int]) -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(FORMS.index(form) * 10 + SHAPES.index(shape))
    n, k = shape
    assert_panels_meet_the_reference(_weight(form, torch.randn(n, k, generator=gen) * 0.05), gen)


@pytest.mark.parametrize("form", FORMS)
def test_portable_and_avx2_panels_agree_bit_for_bit(form: str) -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(3 + FORMS.index(form))
    for n, k in SHAPES:
        assert_portable_gives_the_avx2_bits(_weight(form, torch.randn(n, k, generator=gen)), gen)
