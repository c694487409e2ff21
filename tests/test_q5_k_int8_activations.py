"""GGUF Q5_K on the integer-dot kernels (--gguf-int8-activations): AffineInt8DotWeight.

Q5_K's values are q * scale + offset per group of 32 with 5-bit codes q (0..31). The integer-dot kernel
multiplies the int8 codes with the activations quantized per block of 32 and adds offset[n, g] times
the group's activation sum, as for int4's asymmetric groups. Checked against the torch reference (the
quantized activations times the dequantized weight, float64) on every path: the decode tiles (AVX2 and
portable), the exact path larger batches take, and the bfloat16 reference path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kquants import encode_q5_k

from kvpager.gguf.blocks import unpack_blocks
from kvpager.gguf.executed import PACKED_FORMS
from kvpager.model.backends.quant_dot import fake_quantize_activations, reference_matmul
from kvpager.model.backends.quant_kernels import FMT_INT8, LEVEL_PORTABLE, quant_kernels_or_none
from kvpager.model.gguf_packed import AffineInt8DotWeight, AffineInt8Weight, packed_from_blocks, stack_rows

pytestmark = pytest.mark.skipif(quant_kernels_or_none() is None, reason="packed-weight kernels did not build here")


def q5_k(rows: int, cols: int, seed: int) -> AffineInt8DotWeight:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    weight = packed_from_blocks(
        unpack_blocks("Q5_K", encode_q5_k(values)[0], (rows, cols)), "Q5_K", int8_activations=True
    )
    assert isinstance(weight, AffineInt8DotWeight)
    return weight


def test_holds_the_files_values_in_the_exact_forms_bytes() -> None:
    values = np.random.default_rng(0).standard_normal((12, 512)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q5_K", encode_q5_k(values)[0], (12, 512))
    weight = packed_from_blocks(blocks, "Q5_K", int8_activations=True)
    exact = packed_from_blocks(blocks, "Q5_K")
    assert isinstance(exact, AffineInt8Weight)
    assert torch.equal(weight.dequantize(), torch.from_numpy(blocks.dequantize()))
    assert weight.nbytes == exact.nbytes == PACKED_FORMS["Q5_K"].num_bytes(12, 512)


@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (8, 256), (37, 512)])
def test_kernel_adds_the_offsets_on_the_groups_activation_sums(portable: bool, rows: int, cols: int) -> None:
    weight = q5_k(rows, cols, seed=rows)
    weight.max_level = LEVEL_PORTABLE if portable else None
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(rows, generator=gen)
    for m in (1, 2, 3, 16, 33):  # 33: past the integer dot's rows on AVX2, the exact path
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
    without = (
        fake_quantize_activations(x).double()
        @ (weight.dequantize(torch.float64) - weight.offsets.double().repeat_interleave(32, 1)).T
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
    assert isinstance(fused, AffineInt8DotWeight) and fused.out_features == 48
    assert fused.interleaved == q.interleaved  # interleaved parts join as they are stored
    assert torch.equal(fused.plain_qweight(), torch.cat([q.plain_qweight(), k.plain_qweight()]))
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


def test_bad_offsets_are_refused() -> None:
    weight = q5_k(8, 512, seed=11)
    with pytest.raises(ValueError, match="offsets"):
        AffineInt8DotWeight(weight.plain_qweight(), weight.scales, weight.offsets[:4], 32)
    with pytest.raises(ValueError, match="multiples of 32"):
        AffineInt8DotWeight(weight.plain_qweight(), torch.ones(8, 32), torch.zeros(8, 32), 16)
