"""GGUF Q6_K on the integer-dot kernels with the file's super-block factors (kvpager/model/backends/k_scales.py).

Q6ScaledInt8DotWeight holds, per row and super-block of 256, the file's float16 d and 16 int8 scales;
the kernel's decode tiles widen d * sc super-block by super-block as they multiply a row. Those products are exact in float32, so the
weight must give the float32 form's results (Int8DotWeight group 16 with the block decoder's scales) bit
for bit on every path: the decode tiles (interleaved and plain rows), the AVX2 and portable builds, the
exact fallback and the bfloat16 GEMM; and hold 1.07 bytes a weight where the float32 form holds 1.25.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kquants import encode_q6_k

from kvpager.gguf.blocks import Q6_RECORD_BYTES, unpack_blocks
from kvpager.gguf.executed import DOT_FORMS, PACKED_FORMS
from kvpager.model.backends.k_scales import FMT_Q6_SCALES, Q6ScaledInt8DotWeight, expand_q6_records
from kvpager.model.backends.quant_dot import Int8DotWeight
from kvpager.model.backends.quant_kernels import FMT_INT8, LEVEL_PORTABLE, quant_kernels_or_none
from kvpager.model.gguf_packed import packed_from_blocks, stack_rows

pytestmark = pytest.mark.skipif(quant_kernels_or_none() is None, reason="packed-weight kernels did not build here")


def q6_k(rows: int, cols: int, seed: int) -> tuple[Q6ScaledInt8DotWeight, Int8DotWeight]:
    """A random Q6_K tensor as the records form and as the float32 form."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q6_K", encode_q6_k(values)[0], (rows, cols))
    weight = packed_from_blocks(blocks, "Q6_K", int8_activations=True)
    assert isinstance(weight, Q6ScaledInt8DotWeight)
    float_form = Int8DotWeight(torch.from_numpy(blocks.codes), torch.from_numpy(blocks.scales), 16)
    return weight, float_form


def test_records_expand_to_the_block_decoders_scales() -> None:
    values = np.random.default_rng(0).standard_normal((12, 768)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q6_K", encode_q6_k(values)[0], (12, 768))
    assert blocks.q6_records is not None and blocks.q6_records.shape == (12, 3, Q6_RECORD_BYTES)
    assert torch.equal(expand_q6_records(torch.from_numpy(blocks.q6_records)), torch.from_numpy(blocks.scales))
    weight = packed_from_blocks(blocks, "Q6_K", int8_activations=True)
    assert torch.equal(weight.dequantize(), torch.from_numpy(blocks.dequantize()))


@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (8, 256), (37, 512), (9, 4352)])
def test_kernel_gives_the_float32_forms_bits(portable: bool, rows: int, cols: int) -> None:
    """42 rows: 40 interleaved and 2 plain (where this CPU interleaves int8 rows); 37: a remainder of 1;
    rows of 4352 bytes stay plain; batches of one row, row pairs, and the prompt panels (33 rows)."""
    weight, float_form = q6_k(rows, cols, seed=rows)
    assert weight.interleaved == float_form.interleaved
    for w in (weight, float_form):
        w.max_level = LEVEL_PORTABLE if portable else None
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(rows, generator=gen)
    for m in (1, 2, 3, 16, 33):
        x = torch.randn(m, cols, generator=gen)
        b = bias if m % 2 else None
        assert torch.equal(weight.dot_kernel(x, b), float_form.dot_kernel(x, b)), m
        assert torch.equal(weight.matmul(x, b), float_form.matmul(x, b)), m


def test_negative_scales_keep_their_sign_in_the_kernel() -> None:
    """llama.cpp's Q6_K quantizer may store a negative sc (the scale of the largest magnitude's sign):
    a byte >= 128 is a negative int8, in the expansion and the kernel alike."""
    weight, _ = q6_k(12, 512, seed=11)
    records = weight.records.clone()
    records[::2, :, 2::3] = (-records[::2, :, 2::3].view(torch.int8)).view(torch.uint8)  # some sc negated
    negated = Q6ScaledInt8DotWeight(weight.plain_qweight(), records)
    scales = expand_q6_records(records)
    assert bool((scales < 0).any()) and torch.equal(scales.abs(), expand_q6_records(weight.records))
    float_form = Int8DotWeight(weight.plain_qweight(), scales, 16)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(12))
    for level in (None, LEVEL_PORTABLE):
        negated.max_level = float_form.max_level = level
        assert torch.equal(negated.dot_kernel(x), float_form.dot_kernel(x)), level


def test_exact_and_bf16_paths_take_the_expanded_scales() -> None:
    weight, float_form = q6_k(20, 512, seed=3)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    assert torch.equal(weight.exact_matmul(x, None), float_form.exact_matmul(x, None))
    assert torch.equal(weight.bf16_matmul(x, None), float_form.bf16_matmul(x, None))
    assert torch.equal(weight.dequantize(torch.bfloat16), float_form.dequantize(torch.bfloat16))


def test_holds_the_files_factors_in_fewer_bytes_than_float32() -> None:
    weight, float_form = q6_k(64, 2048, seed=4)
    assert weight.nbytes == DOT_FORMS["Q6_K"].num_bytes(64, 2048) == 64 * (2048 + 8 * Q6_RECORD_BYTES)
    assert float_form.nbytes == PACKED_FORMS["Q6_K"].num_bytes(64, 2048) == 64 * (2048 + 128 * 4)
    assert weight.nbytes / (64 * 2048) == pytest.approx(1.070, abs=1e-3)


def test_fused_q6_k_parts_join_with_their_records() -> None:
    """q/k/v all Q6_K (a Q6_K file): one records weight, interleaved rows kept where this CPU keeps them."""
    (q, q_float), (k, k_float), (v, v_float) = q6_k(32, 512, 5), q6_k(16, 512, 6), q6_k(16, 512, 7)
    fused = stack_rows([q, k, v])
    assert isinstance(fused, Q6ScaledInt8DotWeight) and fused.out_features == 64
    assert fused.interleaved == q.interleaved
    assert torch.equal(fused.records, torch.cat([q.records, k.records, v.records]))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(8))
    expected = torch.cat([q_float.dot_kernel(x), k_float.dot_kernel(x), v_float.dot_kernel(x)], dim=-1)
    assert torch.equal(fused.dot_kernel(x), expected)


def test_kernel_refuses_records_it_cannot_expand() -> None:
    """Records need int8, group 16, K a multiple of 256, no float16 scales and no offsets: anything else
    is -1, nothing written."""
    kernels = quant_kernels_or_none()
    assert kernels is not None
    weight, _ = q6_k(8, 512, seed=9)
    x = torch.randn(1, 512)
    offsets = torch.zeros(8, 32)
    for fmt, k, group, off in (
        (FMT_INT8, 512, 32, None),
        (FMT_INT8, 480, 16, None),
        (FMT_INT8, 512, 16, offsets),
        (2, 512, 16, None),  # int4
        (FMT_INT8 | 256, 512, 16, None),  # float16 scales
    ):
        y = torch.full((1, 8), 7.0)
        rc = kernels.dot_linear(
            fmt | FMT_Q6_SCALES, x.data_ptr(), 1, k, weight.qweight.data_ptr(), weight.records.data_ptr(),
            None if off is None else off.data_ptr(), 8, group, None, y.data_ptr(), 1, kernels.default_level,
        )  # fmt: skip
        assert rc == -1 and torch.equal(y, torch.full((1, 8), 7.0)), (fmt, k, group)


def test_bad_records_or_codes_are_refused() -> None:
    weight, _ = q6_k(8, 512, seed=10)
    with pytest.raises(ValueError, match="records must be uint8"):
        Q6ScaledInt8DotWeight(weight.plain_qweight(), weight.records[:4])
    with pytest.raises(ValueError, match="multiple of 256"):
        Q6ScaledInt8DotWeight(weight.plain_qweight()[:, :128], weight.records[:, :1])
    with pytest.raises(ValueError, match="codes must be int8"):
        Q6ScaledInt8DotWeight(weight.plain_qweight().to(torch.int16), weight.records)
