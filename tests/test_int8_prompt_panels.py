"""int8 batches of many rows through the integer dot's 8-row panels (kernels/quant_dot_gemm.inc).

From `kvq_dot_panel_rows` rows on, the AVX2 and portable builds copy each group of 8 output rows' int8
values once per call into a buffer whose vector lanes are the 8 rows. Held to the reference the one-row
tiles meet (the quantized activations times the dequantized weight, float32 rounding of the
accumulation) for every int8 form: groups of one block and of several, per output channel (K not a
multiple of 32), group 16 (two scales per block), float16 scales (Q8_0), per-group offsets (the exact
form of Q5_K), rows interleaved or plain, N not a multiple of 8; and GGUF Q6_K's packed codes, whose
values (-32..31) the panels hold in int4 stored order and the AVX2 build sums in int16 over half a block.
The int16 bounds are pinned with the largest values each form allows. (Q5_K's packed codes take the
int4 panels: test_q5_k_int8_activations.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kquants import encode_q6_k
from panel_checks import assert_panels_meet_the_reference, assert_portable_gives_the_avx2_bits, panel_rows
from test_quant_dot import _assert_float32_rounding, _kernels_or_skip

from kvpager.gguf.blocks import unpack_blocks
from kvpager.model.backends.k_scales import Q6PackedDotWeight
from kvpager.model.backends.quant_dot import Int8DotWeight, reference_matmul
from kvpager.model.backends.quant_kernels import LEVEL_PORTABLE
from kvpager.model.backends.quant_weights import PackedWeight
from kvpager.model.gguf_packed import AffineInt8DotWeight, packed_from_blocks

# (N, K): N not a multiple of the panel (37, 130, 9), K a multiple of 32 but not of 64 (96, 160), a
# model-like row (2048); the per-channel form also takes K = 200 (a last block of 8 values)
SHAPES = [(37, 96), (64, 256), (130, 160), (24, 2048)]
FORMS = ["g32", "g32_plain", "g32_half", "g64", "g16", "per_channel", "affine_g32"]


def _weight(form: str, w: torch.Tensor) -> PackedWeight:
    n, k = w.shape
    interleave = "plain" not in form
    if form == "per_channel":
        base = Int8DotWeight.from_float(w, None)
        return Int8DotWeight(base.plain_qweight(), base.scales, k, interleave=interleave)
    group = int(form.split("_")[1 if form.startswith("affine") else 0][1:])
    base = Int8DotWeight.from_float(w, group)
    if form.startswith("affine"):
        offsets = torch.randn(base.scales.shape, generator=torch.Generator().manual_seed(n + k)) * 0.01
        return AffineInt8DotWeight(base.plain_qweight(), base.scales, offsets, group, interleave=interleave)
    scales = base.scales.half() if "half" in form else base.scales
    return Int8DotWeight(base.plain_qweight(), scales, group, interleave=interleave)


def _q6_k(n: int, k: int, seed: int) -> Q6PackedDotWeight:
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    weight = packed_from_blocks(unpack_blocks("Q6_K", encode_q6_k(values)[0], (n, k)), "Q6_K", int8_activations=True)
    assert isinstance(weight, Q6PackedDotWeight)
    return weight


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_panels_equal_the_quantized_activation_reference_to_float32_rounding(form: str, shape: tuple[int, int]) -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(FORMS.index(form) * 10 + SHAPES.index(shape))
    n, k = shape
    assert_panels_meet_the_reference(_weight(form, torch.randn(n, k, generator=gen) * 0.05), gen)


def test_per_channel_panels_read_no_further_than_a_short_last_block() -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(5)
    weight = _weight("per_channel", torch.randn(9, 200, generator=gen))  # plain rows of 200 values
    assert not weight.interleaved
    x = torch.randn(panel_rows() + 2, 200, generator=gen)
    for level in (None, LEVEL_PORTABLE):
        weight.max_level = level
        _assert_float32_rounding(weight.dot_kernel(x), x, weight, None)


@pytest.mark.parametrize(("n", "k"), [(42, 768), (9, 256)])
def test_q6_k_packed_panels_equal_the_reference(n: int, k: int) -> None:
    _kernels_or_skip()
    weight = _q6_k(n, k, seed=n)
    gen = torch.Generator().manual_seed(2)
    for rows in (panel_rows(), panel_rows() + 5):
        x = torch.randn(rows, k, generator=gen)
        for level in (None, LEVEL_PORTABLE):
            weight.max_level = level
            ref = reference_matmul(weight, x)
            assert torch.allclose(weight.dot_kernel(x).double(), ref, rtol=1e-5, atol=1e-5), (rows, level)


def _extreme_case(kind: str) -> tuple[PackedWeight, torch.Tensor]:
    """Weights at the largest magnitude the form allows, all of one sign per row, times activations at
    +-127 everywhere: every int16 sum the AVX2 panels keep is at its bound."""
    k, n = 512, 16
    gen = torch.Generator().manual_seed(9)
    sign = torch.where(torch.rand(n, 1, generator=gen) < 0.5, -1, 1)
    if kind == "full":
        values = torch.where(sign < 0, -128, 127).expand(n, k).to(torch.int8)
        weight: PackedWeight = Int8DotWeight(values.contiguous(), torch.full((n, k // 32), 0.01), 32)
    else:
        base = _q6_k(n, k, seed=3)
        values = torch.where(sign < 0, -32, 31).expand(n, k).to(torch.int8).contiguous()
        weight = Q6PackedDotWeight.from_q6_values(values, base.records)
    x = torch.where(torch.rand(panel_rows() + 3, 1, generator=gen) < 0.5, -1.0, 1.0).expand(-1, k).contiguous()
    return weight, x


@pytest.mark.parametrize("kind", ["full", "Q6_K"])
def test_the_largest_values_each_form_allows_do_not_overflow_the_int16_sums(kind: str) -> None:
    _kernels_or_skip()
    weight, x = _extreme_case(kind)
    for level in (None, LEVEL_PORTABLE):
        weight.max_level = level
        ref = reference_matmul(weight, x)
        assert torch.allclose(weight.dot_kernel(x).double(), ref, rtol=1e-5, atol=1e-3), (kind, level)


@pytest.mark.parametrize("form", [*FORMS, "Q6_K"])
def test_portable_and_avx2_panels_agree_bit_for_bit(form: str) -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(3)
    for n, k in [(37, 256), (64, 512), (24, 2048)]:
        weight = _q6_k(n, k, seed=n) if form == "Q6_K" else _weight(form, torch.randn(n, k, generator=gen))
        assert_portable_gives_the_avx2_bits(weight, gen)
