"""GGUF Q6_K on the integer-dot kernels (--gguf-int8-activations): Q6PackedDotWeight.

Q6_K's values are (q - 32) * d * sc per group of 16, with 6-bit codes q. The weight holds the codes'
low 4 bits as int4 codes, their high two bits in a plane, and per row and super-block of 256 the file's
float16 d and 16 int8 sc: 0.82 bytes a weight, the file's. The kernel's decode tiles keep the codes
unsigned and subtract 32 times the activations' sums; its prompt panels unpack the values into int8
panels in int4 stored order. Checked against the torch reference (the quantized activations times the
dequantized weight, float64) on every path: the decode tiles (interleaved and plain rows) and the
prompt panels (AVX2 and portable, the same bits), the exact path and the bfloat16 path (both on the
float32 form, Int8DotWeight group 16).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kquants import encode_q6_k
from plane_checks import (
    ROWS,
    assert_codes_unpack_to,
    assert_exact_and_bf16_paths_match_the_reference,
    assert_portable_gives_the_avx2_bits,
)

from kvpager.gguf.blocks import Q6_RECORD_BYTES, unpack_blocks
from kvpager.gguf.executed import DOT_FORMS, PACKED_FORMS
from kvpager.model.backends.k_scales import (
    FMT_HI_PLANE,
    FMT_K_SCALES,
    FMT_Q6_SCALES,
    INT4_NATURAL,
    Q6_PLANE_SHIFTS,
    Q6PackedDotWeight,
    expand_q6_records,
)
from kvpager.model.backends.quant_dot import reference_matmul
from kvpager.model.backends.quant_kernels import (
    FMT_INT4,
    FMT_INT8,
    LEVEL_PORTABLE,
    quant_kernels_or_none,
)
from kvpager.model.gguf_packed import packed_from_blocks, stack_rows

pytestmark = pytest.mark.skipif(quant_kernels_or_none() is None, reason="packed-weight kernels did not build here")


def q6_k(rows: int, cols: int, seed: int) -> Q6PackedDotWeight:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q6_K", encode_q6_k(values)[0], (rows, cols))
    weight = packed_from_blocks(blocks, "Q6_K", int8_activations=True)
    assert isinstance(weight, Q6PackedDotWeight)
    return weight


def test_holds_the_files_values_in_the_files_bytes() -> None:
    values = np.random.default_rng(0).standard_normal((12, 768)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q6_K", encode_q6_k(values)[0], (12, 768))
    assert blocks.q6_records is not None and blocks.q6_records.shape == (12, 3, Q6_RECORD_BYTES)
    assert torch.equal(expand_q6_records(torch.from_numpy(blocks.q6_records)), torch.from_numpy(blocks.scales))
    weight = packed_from_blocks(blocks, "Q6_K", int8_activations=True)
    exact = packed_from_blocks(blocks, "Q6_K")
    assert torch.equal(weight.dequantize(), torch.from_numpy(blocks.dequantize()))
    # int4 codes (384 bytes a row), the plane (192), three records: the file's 210 bytes per 256 weights
    assert weight.nbytes == DOT_FORMS["Q6_K"].num_bytes(12, 768) == 12 * (384 + 192 + 3 * Q6_RECORD_BYTES)
    assert weight.nbytes == 12 * 3 * 210
    assert exact.nbytes == PACKED_FORMS["Q6_K"].num_bytes(12, 768) > weight.nbytes


def test_the_plane_holds_each_codes_high_bits_where_the_kernel_reads_it() -> None:
    values = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q6_K", encode_q6_k(values)[0], (6, 512))
    codes = torch.from_numpy(blocks.codes).to(torch.int16) + 32
    weight = packed_from_blocks(blocks, "Q6_K", int8_activations=True)
    assert isinstance(weight, Q6PackedDotWeight) and torch.equal(weight.codes().to(torch.int16), codes)
    # row 3, blocks 4 and 5 (pair 2): byte j % 16 of the pair's 16 holds stored position j's two bits
    for block in (4, 5):
        natural = codes[3, 32 * block : 32 * block + 32]
        pair = weight.plane[3, 32:48]
        bits = [(int(pair[j % 16]) >> Q6_PLANE_SHIFTS[block % 2][j // 16]) & 3 for j in range(32)]
        assert bits == [int(natural[INT4_NATURAL[j]]) >> 4 for j in range(32)], block
        assert len(set(bits)) > 2  # more than two of the four values occur


@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (8, 256), (37, 512), (9, 4352)])
def test_kernel_meets_the_reference(portable: bool, rows: int, cols: int) -> None:
    """42 rows: 40 interleaved and 2 plain; 37: a remainder of 1; 9 x 4352: long rows, 17 super-blocks."""
    weight = q6_k(rows, cols, seed=rows)
    assert weight.interleaved
    weight.max_level = LEVEL_PORTABLE if portable else None
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(rows, generator=gen)
    for m in ROWS:
        x = torch.randn(m, cols, generator=gen)
        b = bias if m % 2 else None
        ref = reference_matmul(weight, x, b)
        assert torch.allclose(weight.dot_kernel(x, b).double(), ref, rtol=1e-5, atol=1e-5), m
        assert torch.allclose(weight.matmul(x, b).double(), ref, rtol=1e-5, atol=1e-5), m


@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (8, 256), (37, 512)])
def test_portable_gives_the_avx2_bits(rows: int, cols: int) -> None:
    assert_portable_gives_the_avx2_bits(q6_k(rows, cols, seed=rows), torch.Generator().manual_seed(2))


@pytest.mark.parametrize("value", [31, -32])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_extreme_values_do_not_overflow_the_int16_sums(value: int, sign: float) -> None:
    # every value at one end (codes all 63: the tiles' unsigned sums at their int16 bound; all 0: the
    # correction alone) times activations at +-127 everywhere, on the tiles and the panels
    base = q6_k(16, 512, seed=13)
    weight = Q6PackedDotWeight.from_q6_values(torch.full((16, 512), value, dtype=torch.int8), base.records)
    x = torch.full((35, 512), sign)
    for level in (None, LEVEL_PORTABLE):
        weight.max_level = level
        for m in (1, 2, 35):
            ref = reference_matmul(weight, x[:m])
            assert torch.allclose(weight.dot_kernel(x[:m]).double(), ref, rtol=1e-5, atol=1e-3), (level, m)


def test_negative_scales_keep_their_sign_in_the_kernel() -> None:
    """llama.cpp's Q6_K quantizer may store a negative sc (the scale of the largest magnitude's sign):
    a byte >= 128 is a negative int8, in the expansion and the kernel alike."""
    weight = q6_k(12, 512, seed=11)
    records = weight.records.clone()
    records[::2, :, 2::3] = (-records[::2, :, 2::3].view(torch.int8)).view(torch.uint8)  # some sc negated
    negated = Q6PackedDotWeight(weight.plain_packed(), weight.plane, records, 512)
    scales = expand_q6_records(records)
    assert bool((scales < 0).any()) and torch.equal(scales.abs(), expand_q6_records(weight.records))
    x = torch.randn(34, 512, generator=torch.Generator().manual_seed(12))
    for level in (None, LEVEL_PORTABLE):
        negated.max_level = level
        for m in (3, 34):
            ref = reference_matmul(negated, x[:m])
            assert torch.allclose(negated.dot_kernel(x[:m]).double(), ref, rtol=1e-5, atol=1e-5), (level, m)
            assert not torch.allclose(ref, reference_matmul(weight, x[:m]), atol=1e-2)


@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (9, 4352), (3, 256)])
def test_the_kernel_unpacks_the_codes_the_blocks_hold(rows: int, cols: int) -> None:
    """42 rows: 40 interleaved and 2 plain; 3 rows: none interleaved."""
    values = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q6_K", encode_q6_k(values)[0], (rows, cols))
    weight = packed_from_blocks(blocks, "Q6_K", int8_activations=True)
    assert isinstance(weight, Q6PackedDotWeight) and weight.interleaved == (rows >= 4)
    file_values = torch.from_numpy(blocks.codes).to(torch.int16)  # the blocks' codes are q - 32
    assert_codes_unpack_to(weight, (file_values + 32).to(torch.uint8), float_offset=32)
    assert torch.equal(weight.values(), file_values.to(torch.int8))


def test_the_codes_unpack_refuses_other_formats() -> None:
    kernels = quant_kernels_or_none()
    assert kernels is not None
    weight = q6_k(8, 512, seed=14)
    q6 = FMT_INT4 | FMT_Q6_SCALES | FMT_HI_PLANE
    for fmt, k, plane in (
        (FMT_INT4 | FMT_Q6_SCALES, 512, weight.plane.data_ptr()),  # no plane flag
        (FMT_INT8 | FMT_Q6_SCALES | FMT_HI_PLANE, 512, weight.plane.data_ptr()),
        (q6 | FMT_K_SCALES, 512, weight.plane.data_ptr()),
        (q6, 384, weight.plane.data_ptr()),
        (q6, 512, None),
    ):
        out = torch.full((8, 512), 7, dtype=torch.uint8)
        rc = kernels.dot_plane_codes(
            fmt, weight.packed.data_ptr(), plane, 8, k, out.data_ptr(), 1, kernels.default_level
        )
        assert rc == -1 and bool((out == 7).all()), (fmt, k)


def test_exact_and_bf16_paths_match_the_reference() -> None:
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    assert_exact_and_bf16_paths_match_the_reference(q6_k(20, 512, seed=3), x)


def test_fused_q6_k_parts_join_with_their_planes_and_records() -> None:
    """q/k/v all Q6_K (a Q6_K file): one packed weight, its rows still interleaved, each row's result
    the part's own."""
    q, k, v = q6_k(32, 512, 5), q6_k(16, 512, 6), q6_k(16, 512, 7)
    fused = stack_rows([q, k, v])
    assert isinstance(fused, Q6PackedDotWeight) and fused.out_features == 64 and fused.interleaved
    assert torch.equal(fused.records, torch.cat([q.records, k.records, v.records]))
    assert torch.equal(fused.plane, torch.cat([q.plane, k.plane, v.plane]))
    for m in (3, 33):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(8))
        expected = torch.cat([q.dot_kernel(x), k.dot_kernel(x), v.dot_kernel(x)], dim=-1)
        assert torch.equal(fused.dot_kernel(x), expected), m


def test_kernel_refuses_records_or_planes_it_cannot_read() -> None:
    """Q6_K records need int4 codes with a plane, group 16, K a multiple of 256 and no float16 scales;
    a plane needs exactly one kind of records: anything else is -1, nothing written."""
    kernels = quant_kernels_or_none()
    assert kernels is not None
    weight = q6_k(8, 512, seed=9)
    x = torch.randn(1, 512)
    plane = weight.plane.data_ptr()
    q6 = FMT_INT4 | FMT_Q6_SCALES | FMT_HI_PLANE
    for fmt, k, group, off in (
        (FMT_INT4 | FMT_Q6_SCALES, 512, 16, None),  # no plane
        (FMT_INT4 | FMT_Q6_SCALES, 512, 16, plane),  # a pointer, but not said to be a plane
        (q6, 512, 16, None),  # a plane without its pointer
        (FMT_INT8 | FMT_Q6_SCALES | FMT_HI_PLANE, 512, 16, plane),
        (q6 | FMT_K_SCALES, 512, 16, plane),
        (q6, 512, 32, plane),
        (q6, 480, 16, plane),
        (q6 | 256, 512, 16, plane),  # float16 scales
    ):
        y = torch.full((1, 8), 7.0)
        rc = kernels.dot_linear(
            fmt, x.data_ptr(), 1, k, weight.packed.data_ptr(), weight.records.data_ptr(), off, 8, group, None,
            y.data_ptr(), 1, kernels.default_level,
        )  # fmt: skip
        assert rc == -1 and torch.equal(y, torch.full((1, 8), 7.0)), (fmt, k, group)


def test_bad_planes_records_and_values_are_refused() -> None:
    weight = q6_k(8, 512, seed=10)
    packed, plane, records = weight.plain_packed(), weight.plane, weight.records
    with pytest.raises(ValueError, match="records must be uint8"):
        Q6PackedDotWeight(packed, plane, records[:4], 512)
    with pytest.raises(ValueError, match="plane must be uint8"):
        Q6PackedDotWeight(packed, plane[:, :64], records, 512)
    with pytest.raises(ValueError, match="packed must be uint8"):
        Q6PackedDotWeight(packed[:, :128], plane, records, 512)
    with pytest.raises(ValueError, match="multiple of 256"):
        Q6PackedDotWeight.from_q6_values(torch.zeros(8, 128, dtype=torch.int8), records[:, :1])
    for bad in (-33, 32):
        values = (weight.codes().to(torch.int16) - 32).to(torch.int16)
        values[2, 7] = bad
        with pytest.raises(ValueError, match=r"values must lie in -32\.\.31"):
            Q6PackedDotWeight.from_q6_values(values, records)
