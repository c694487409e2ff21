"""GGUF Q5_K on the integer-dot kernels (--gguf-int8-activations): K5ScaledInt8DotWeight.

Q5_K's values are q * scale + offset per group of 32 with 5-bit codes q (0..31). The integer-dot kernel
multiplies the int8 codes with the activations quantized per block of 32 and adds offset[n, g] times
the group's activation sum, as for int4's asymmetric groups. The weight holds the file's super-block
factors (Q4_K's record: float16 d, dmin, six-bit sc and m; 1.08 bytes a weight), widened by the kernel
to exactly the float32 form's (AffineInt8DotWeight's) scales and offsets, so it gives that form's
bits. Checked against the torch reference (the quantized activations times the dequantized weight,
float64) on every path: the decode tiles (AVX2 and portable), the exact path larger batches take, and
the bfloat16 reference path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kquants import encode_q5_k

from kvpager.gguf.blocks import K_RECORD_BYTES, unpack_blocks
from kvpager.gguf.executed import DOT_FORMS, PACKED_FORMS
from kvpager.model.backends.k_scales import FMT_K_SCALES, expand_k_records
from kvpager.model.backends.quant_dot import fake_quantize_activations, reference_matmul
from kvpager.model.backends.quant_kernels import FMT_INT8, LEVEL_PORTABLE, quant_kernels_or_none
from kvpager.model.gguf_packed import (
    AffineInt8DotWeight,
    AffineInt8Weight,
    K5ScaledInt8DotWeight,
    packed_from_blocks,
    stack_rows,
)

pytestmark = pytest.mark.skipif(quant_kernels_or_none() is None, reason="packed-weight kernels did not build here")


def q5_k(rows: int, cols: int, seed: int) -> K5ScaledInt8DotWeight:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    weight = packed_from_blocks(
        unpack_blocks("Q5_K", encode_q5_k(values)[0], (rows, cols)), "Q5_K", int8_activations=True
    )
    assert isinstance(weight, K5ScaledInt8DotWeight)
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
    assert weight.nbytes == DOT_FORMS["Q5_K"].num_bytes(12, 512) == 12 * (512 + 2 * K_RECORD_BYTES)
    assert exact.nbytes == PACKED_FORMS["Q5_K"].num_bytes(12, 512) > weight.nbytes


@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (8, 256), (37, 512)])
def test_kernel_gives_the_float32_forms_bits(portable: bool, rows: int, cols: int) -> None:
    """42 rows: 40 interleaved and 2 plain (where this CPU interleaves int8 rows); 37: a remainder of 1;
    batches of one row, row pairs, and the prompt panels (33 rows)."""
    weight = q5_k(rows, cols, seed=rows)
    float_form = weight.float_form()
    assert isinstance(float_form, AffineInt8DotWeight) and float_form.interleaved == weight.interleaved
    for w in (weight, float_form):
        w.max_level = LEVEL_PORTABLE if portable else None
    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(rows, generator=gen)
    for m in (1, 2, 3, 16, 33):
        x = torch.randn(m, cols, generator=gen)
        b = bias if m % 2 else None
        assert torch.equal(weight.dot_kernel(x, b), float_form.dot_kernel(x, b)), m
        assert torch.equal(weight.matmul(x, b), float_form.matmul(x, b)), m


@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (8, 256), (37, 512)])
def test_kernel_adds_the_offsets_on_the_groups_activation_sums(portable: bool, rows: int, cols: int) -> None:
    weight = q5_k(rows, cols, seed=rows)
    weight.max_level = LEVEL_PORTABLE if portable else None
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(rows, generator=gen)
    for m in (1, 2, 3, 16, 33):  # 33: the prompt panels (kvq_dot_panel_rows) of the AVX2 and portable builds
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
    weight = q5_k(20, 512, seed=5)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6))
    ref = x.double() @ weight.dequantize(torch.float64).T
    assert torch.allclose(weight.exact_matmul(x, None).double(), ref, rtol=1e-5, atol=1e-5)
    ref_bf16 = torch.nn.functional.linear(x.bfloat16(), weight.dequantize(torch.bfloat16)).float()
    assert torch.equal(weight.bf16_matmul(x, None), ref_bf16)


def test_fused_parts_join_with_their_offsets() -> None:
    q, k = q5_k(32, 512, seed=7), q5_k(16, 512, seed=8)
    fused = stack_rows([q, k])
    assert isinstance(fused, K5ScaledInt8DotWeight) and fused.out_features == 48
    assert fused.interleaved == q.interleaved  # interleaved parts join as they are stored
    assert torch.equal(fused.plain_qweight(), torch.cat([q.plain_qweight(), k.plain_qweight()]))
    assert torch.equal(fused.records, torch.cat([q.records, k.records]))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(9))
    assert torch.equal(fused.dot_kernel(x), torch.cat([q.dot_kernel(x), k.dot_kernel(x)], dim=-1))


def test_kernel_refuses_int8_offsets_with_groups_inside_an_activation_block() -> None:
    kernels = quant_kernels_or_none()
    assert kernels is not None
    weight = q5_k(8, 512, seed=10)
    x, y = torch.randn(1, 512), torch.full((1, 8), 7.0)
    offsets = torch.zeros(8, 32)
    rc = kernels.dot_linear(
        FMT_INT8, x.data_ptr(), 1, 512, weight.qweight.data_ptr(), torch.ones(8, 32).data_ptr(), offsets.data_ptr(),
        8, 16, None, y.data_ptr(), 1, kernels.default_level,
    )  # fmt: skip
    assert rc == -1 and torch.equal(y, torch.full((1, 8), 7.0))


def test_kernel_refuses_records_it_cannot_widen() -> None:
    """int8 codes with kKScales: offsets passed beside the records, a row that is not whole super-blocks,
    or groups other than 32 leave y untouched."""
    kernels = quant_kernels_or_none()
    assert kernels is not None
    weight = q5_k(8, 512, seed=12)
    fmt = FMT_INT8 | FMT_K_SCALES
    for k, group, offsets in ((512, 32, torch.zeros(8, 16)), (384, 32, None), (512, 16, None)):
        x, y = torch.randn(1, k), torch.full((1, 8), 7.0)
        rc = kernels.dot_linear(
            fmt, x.data_ptr(), 1, k, weight.plain_qweight().data_ptr(), weight.records.data_ptr(),
            None if offsets is None else offsets.data_ptr(), 8, group, None, y.data_ptr(), 1, kernels.default_level,
        )  # fmt: skip
        assert rc == -1 and torch.equal(y, torch.full((1, 8), 7.0)), (k, group)


def test_bad_offsets_or_records_are_refused() -> None:
    weight = q5_k(8, 512, seed=11)
    affine = weight.float_form()
    with pytest.raises(ValueError, match="offsets"):
        AffineInt8DotWeight(weight.plain_qweight(), affine.scales, affine.offsets[:4], 32)
    with pytest.raises(ValueError, match="multiples of 32"):
        AffineInt8DotWeight(weight.plain_qweight(), torch.ones(8, 32), torch.zeros(8, 32), 16)
    with pytest.raises(ValueError, match="records must be uint8"):
        K5ScaledInt8DotWeight(weight.plain_qweight(), weight.records[:4])
    with pytest.raises(ValueError, match="codes must be int8"):
        K5ScaledInt8DotWeight(weight.plain_qweight().to(torch.uint8), weight.records)
