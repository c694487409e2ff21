"""Checks the tests of the GGUF forms holding a plane of higher code bits beside int4 codes share
(test_q5_k_int8_activations.py, test_q6_k_int8_activations.py)."""

from __future__ import annotations

import pytest
import torch

from kvpager.model.backends.quant_dot import Int4DotWeight
from kvpager.model.backends.quant_kernels import LEVEL_AVX2, LEVEL_PORTABLE, load_quant_kernels

# batches of one row, row pairs and a remainder, the most rows the one-row tiles take, the panels
# (kvq_dot_panel_rows: 12) at a decode batch and at a prompt
ROWS = (1, 2, 3, 11, 16, 33)


def assert_portable_gives_the_avx2_bits(weight: Int4DotWeight, gen: torch.Generator) -> None:
    """The portable build's bits are the AVX2 build's at every batch of ROWS."""
    if load_quant_kernels().dot_level(LEVEL_AVX2) != LEVEL_AVX2:
        pytest.skip("this CPU has no AVX2: only the portable build runs (held to the reference elsewhere)")
    for m in ROWS:
        x = torch.randn(m, weight.in_features, generator=gen) * 3
        weight.max_level = LEVEL_PORTABLE
        portable = weight.dot_kernel(x)
        weight.max_level = LEVEL_AVX2
        assert torch.equal(weight.dot_kernel(x), portable), m


def assert_exact_and_bf16_paths_match_the_reference(weight: Int4DotWeight, x: torch.Tensor) -> None:
    """The exact path (float32 activations) meets the dequantized weight to float32 rounding; the bfloat16
    path is F.linear in bfloat16 bit for bit."""
    ref = x.double() @ weight.dequantize(torch.float64).T
    assert torch.allclose(weight.exact_matmul(x, None).double(), ref, rtol=1e-5, atol=1e-5)
    ref_bf16 = torch.nn.functional.linear(x.bfloat16(), weight.dequantize(torch.bfloat16)).float()
    assert torch.equal(weight.bf16_matmul(x, None), ref_bf16)


def assert_codes_unpack_to(weight: Int4DotWeight, expected: torch.Tensor, float_offset: int) -> None:
    """codes() (the kernel library's unpack, on the best path and the portable one) and codes_in_torch()
    equal `expected` (uint8 [N, K], the blocks' own codes), and the float form's int8 codes are those
    minus `float_offset` (Q6_K's values: code - 32). The exact and bfloat16 paths build the float form
    from them on every batch they take."""
    assert torch.equal(weight.codes_in_torch(), expected)  # type: ignore[attr-defined]
    for level in (None, LEVEL_PORTABLE):
        weight.max_level = level
        assert torch.equal(weight.codes(), expected), level
        float_codes = weight.float_form().plain_qweight()  # type: ignore[attr-defined]
        assert torch.equal(float_codes, (expected.to(torch.int16) - float_offset).to(torch.int8)), level
