"""GGUF Q5_K on the integer-dot kernels (--gguf-int8-activations): K5PackedDotWeight.

Q5_K's values are q * scale + offset per group of 32 with 5-bit codes q (0..31). The weight holds the
codes' low 4 bits as int4 codes, their fifth bits in a plane, and the file's super-block factors (Q4_K's
record: float16 d, dmin, six-bit sc and m): 0.70 bytes a weight, the file's 0.69 but for the record's
padding. The kernel's Q4_K tiles and int4 panels add 16 where a code's bit is set, multiply with the
activations quantized per block of 32 and add offset[n, g] times the group's activation sum. Checked
against the torch reference (the quantized activations times the dequantized weight, float64) on every
path: the decode tiles and the prompt panels (AVX2 and portable, the same bits), the exact path and the
bfloat16 path (both on the float32 form, AffineInt8DotWeight).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kquants import encode_q5_k
from plane_checks import (
    assert_codes_unpack_to,
    assert_exact_and_bf16_paths_match_the_reference,
    assert_portable_gives_the_avx2_bits,
)

from kvpager.gguf.blocks import K_RECORD_BYTES, unpack_blocks
from kvpager.gguf.executed import DOT_FORMS, PACKED_FORMS
from kvpager.model.backends.k_scales import FMT_K_SCALES, expand_k_records
from kvpager.model.backends.quant_dot import fake_quantize_activations, reference_matmul
from kvpager.model.backends.quant_kernels import (
    FMT_INT4,
    FMT_INT8,
    LEVEL_PORTABLE,
    quant_kernels_or_none,
)
from kvpager.model.gguf_packed import (
    FMT_HI_PLANE,
    INT4_NATURAL,
    AffineInt8DotWeight,
    AffineInt8Weight,
    K5PackedDotWeight,
    packed_from_blocks,
    stack_rows,
)

pytestmark = pytest.mark.skipif(quant_kernels_or_none() is None, reason="packed-weight kernels did not build here")


def q5_k(rows: int, cols: int, seed: int) -> K5PackedDotWeight:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    weight = packed_from_blocks(
        unpack_blocks("Q5_K", encode_q5_k(values)[0], (rows, cols)), "Q5_K", int8_activations=True
    )
    assert isinstance(weight, K5PackedDotWeight)
    return weight


def test_holds_the_files_values_in_fewer_bytes_than_the_exact_form() -> None:
    values = np.random.default_rng(0).standard_normal((12, 512)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q5_K", encode_q5_k(values)[0], (12, 512))
    assert blocks.k_records is not None and blocks.k_records.shape == (12, 2, K_RECORD_BYTES)
    scales, offsets = expand_k_records(torch.from_numpy(blocks.k_records))
    assert torch.equal(scales, torch.from_numpy(blocks.scales))
    assert torch.equal(offsets, torch.from_numpy(blocks.offsets))
    weight = packed_from_blocks(blocks, "Q5_K", int8_activations=True)
    exact = packed_from_blocks(blocks, "Q5_K")
    assert isinstance(exact, AffineInt8Weight)
    assert torch.equal(weight.dequantize(), torch.from_numpy(blocks.dequantize()))
    # int4 codes (256 bytes a row), the plane (64), two records
    assert weight.nbytes == DOT_FORMS["Q5_K"].num_bytes(12, 512) == 12 * (256 + 64 + 2 * K_RECORD_BYTES)
    assert exact.nbytes == PACKED_FORMS["Q5_K"].num_bytes(12, 512) > weight.nbytes


def test_the_plane_holds_each_codes_fifth_bit_where_the_kernel_reads_it() -> None:
    values = np.random.default_rng(1).standard_normal((6, 256)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q5_K", encode_q5_k(values)[0], (6, 256))
    codes = torch.from_numpy(blocks.codes).to(torch.uint8)
    weight = packed_from_blocks(blocks, "Q5_K", int8_activations=True)
    assert isinstance(weight, K5PackedDotWeight) and torch.equal(weight.codes(), codes)
    # row 3, block 2: bit j of its 4 plane bytes is the fifth bit of stored position j
    block = codes[3, 64:96]
    bits = [(int(weight.plane[3, 8 + j // 8]) >> (j % 8)) & 1 for j in range(32)]
    assert bits == [int(block[INT4_NATURAL[j]]) >> 4 for j in range(32)]
    assert 0 < sum(bits) < 32  # both kinds of bit occur


@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (9, 4352), (3, 256)])
def test_the_kernel_unpacks_the_codes_the_blocks_hold(rows: int, cols: int) -> None:
    """42 rows: 40 interleaved and 2 plain; 3 rows: none interleaved."""
    values = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q5_K", encode_q5_k(values)[0], (rows, cols))
    weight = packed_from_blocks(blocks, "Q5_K", int8_activations=True)
    assert isinstance(weight, K5PackedDotWeight) and weight.interleaved == (rows >= 4)
    assert_codes_unpack_to(weight, torch.from_numpy(blocks.codes).to(torch.uint8), float_offset=0)


@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (8, 256), (37, 512)])
def test_portable_gives_the_avx2_bits(rows: int, cols: int) -> None:
    assert_portable_gives_the_avx2_bits(q5_k(rows, cols, seed=rows), torch.Generator().manual_seed(2))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_codes_do_not_overflow_the_int16_sums(sign: float) -> None:
    # every code 31 (the plane all ones) times activations at +-127 everywhere: each int16 sum the AVX2
    # tiles and panels keep is at its bound
    base = q5_k(16, 512, seed=13)
    weight = K5PackedDotWeight.from_q5_codes(torch.full((16, 512), 31, dtype=torch.uint8), base.records)
    x = torch.full((35, 512), sign)
    for level in (None, LEVEL_PORTABLE):
        weight.max_level = level
        for m in (1, 2, 35):
            ref = reference_matmul(weight, x[:m])
            assert torch.allclose(weight.dot_kernel(x[:m]).double(), ref, rtol=1e-5, atol=1e-3), (level, m)


@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (8, 256), (37, 512)])
def test_kernel_adds_the_offsets_on_the_groups_activation_sums(portable: bool, rows: int, cols: int) -> None:
    weight = q5_k(rows, cols, seed=rows)
    weight.max_level = LEVEL_PORTABLE if portable else None
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(rows, generator=gen)
    for m in (1, 2, 3, 11, 16, 33):  # from 12 rows (kvq_dot_panel_rows) the panels of the AVX2 and portable builds
        x = torch.randn(m, cols, generator=gen)
        b = bias if m % 2 else None
        ref = reference_matmul(weight, x, b)
        assert torch.allclose(weight.dot_kernel(x, b).double(), ref, rtol=1e-5, atol=1e-5), m
        assert torch.allclose(weight.matmul(x, b).double(), ref, rtol=1e-5, atol=1e-5), m


def test_the_offsets_are_material_in_these_weights() -> None:
    """Without its offset term the reference moves far past the tolerance above: a kernel that dropped
    the offsets would fail those checks."""
    weight = q5_k(16, 512, seed=3)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(4))
    offsets = weight.float_form().offsets
    without = (
        fake_quantize_activations(x).double()
        @ (weight.dequantize(torch.float64) - offsets.double().repeat_interleave(32, 1)).T
    )
    assert (reference_matmul(weight, x) - without).abs().max() > 1e-2


def test_exact_and_bf16_paths_match_the_reference() -> None:
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6))
    assert_exact_and_bf16_paths_match_the_reference(q5_k(20, 512, seed=5), x)


def test_fused_parts_join_with_their_offsets() -> None:
    q, k = q5_k(32, 512, seed=7), q5_k(16, 512, seed=8)
    fused = stack_rows([q, k])
    assert isinstance(fused, K5PackedDotWeight) and fused.out_features == 48
    assert fused.interleaved == q.interleaved  # interleaved parts join as they are stored
    assert torch.equal(fused.plain_packed(), torch.cat([q.plain_packed(), k.plain_packed()]))
    assert torch.equal(fused.plane, torch.cat([q.plane, k.plane]))
    assert torch.equal(fused.records, torch.cat([q.records, k.records]))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(9))
    assert torch.equal(fused.dot_kernel(x), torch.cat([q.dot_kernel(x), k.dot_kernel(x)], dim=-1))


def test_kernel_refuses_int8_offsets_with_groups_inside_an_activation_block() -> None:
    kernels = quant_kernels_or_none()
    assert kernels is not None
    codes = q5_k(8, 512, seed=10).float_form().qweight
    x, y = torch.randn(1, 512), torch.full((1, 8), 7.0)
    offsets = torch.zeros(8, 32)
    rc = kernels.dot_linear(
        FMT_INT8, x.data_ptr(), 1, 512, codes.data_ptr(), torch.ones(8, 32).data_ptr(), offsets.data_ptr(),
        8, 16, None, y.data_ptr(), 1, kernels.default_level,
    )  # fmt: skip
    assert rc == -1 and torch.equal(y, torch.full((1, 8), 7.0))


def test_kernel_refuses_records_and_planes_it_cannot_read() -> None:
    """Q4_K's records with int8 codes, the plane without the records or on int8, a records weight without
    its plane pointer, rows that are not whole super-blocks: y untouched."""
    kernels = quant_kernels_or_none()
    assert kernels is not None
    weight = q5_k(8, 512, seed=12)
    packed, records, plane = weight.plain_packed(), weight.records, weight.plane
    cases = [
        (FMT_INT8 | FMT_K_SCALES, 512, None),
        (FMT_INT4 | FMT_HI_PLANE, 512, plane),
        (FMT_INT8 | FMT_K_SCALES | FMT_HI_PLANE, 512, plane),
        (FMT_INT4 | FMT_K_SCALES | FMT_HI_PLANE, 512, None),
        (FMT_INT4 | FMT_K_SCALES | FMT_HI_PLANE, 384, plane),
    ]
    for fmt, k, plane_arg in cases:
        x, y = torch.randn(1, k), torch.full((1, 8), 7.0)
        rc = kernels.dot_linear(
            fmt, x.data_ptr(), 1, k, packed.data_ptr(), records.data_ptr(),
            None if plane_arg is None else plane_arg.data_ptr(), 8, 32, None, y.data_ptr(), 1, kernels.default_level,
        )  # fmt: skip
        assert rc == -1 and torch.equal(y, torch.full((1, 8), 7.0)), (fmt, k)


def test_bad_offsets_planes_or_codes_are_refused() -> None:
    weight = q5_k(8, 512, seed=11)
    affine = weight.float_form()
    with pytest.raises(ValueError, match="offsets"):
        AffineInt8DotWeight(affine.plain_qweight(), affine.scales, affine.offsets[:4], 32)
    with pytest.raises(ValueError, match="multiples of 32"):
        AffineInt8DotWeight(affine.plain_qweight(), torch.ones(8, 32), torch.zeros(8, 32), 16)
    with pytest.raises(ValueError, match="records must be uint8"):
        K5PackedDotWeight(weight.plain_packed(), weight.plane, weight.records[:4], 512)
    with pytest.raises(ValueError, match="plane must be uint8"):
        K5PackedDotWeight(weight.plain_packed(), weight.plane[:, :32], weight.records, 512)
    codes = weight.codes()
    codes[2, 7] = 32
    with pytest.raises(ValueError, match="codes must lie in 0..31"):
        K5PackedDotWeight.from_q5_codes(codes, weight.records)
