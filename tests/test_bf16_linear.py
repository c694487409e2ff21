"""The packed bfloat16 linear used at fp32_matmul_precision="medium" (kvpager/model/backends/bf16_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpager.model.backends.bf16_linear import PackedBf16Linear, native_bf16_matmul_available
from kvpager.model.backends.ops import SMALL_BATCH_LINEAR, select_ops
from kvpager.model.precision import fp32_matmul_precision

pytestmark = pytest.mark.skipif(not native_bf16_matmul_available(), reason="this CPU has no native bf16 matmul")


@pytest.mark.parametrize("rows", [33, 64, 257])
def test_packed_linear_equals_bf16_linear_of_rounded_inputs(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=gen), torch.randn(80, 96, generator=gen), torch.randn(80, generator=gen)
    linear = PackedBf16Linear()
    got = linear(x, w, b)
    expected = F.linear(x.bfloat16(), w.bfloat16()).float() + b
    assert got.dtype == torch.float32 and got.shape == (rows, 80)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    err = (got - F.linear(x, w, b)).abs().max().item()
    assert 0 < err < 0.05 * F.linear(x, w).abs().max().item()  # bf16 rounding, not garbage


def test_packed_weight_is_made_once_and_another_tensor_at_its_address_is_packed_afresh() -> None:
    linear = PackedBf16Linear()
    x = torch.randn(40, 32)
    w = torch.randn(16, 32)
    first = linear(x, w, None)
    assert len(linear._packed) == 1
    torch.testing.assert_close(linear(x, w, None), first, rtol=0, atol=0)
    w.mul_(2)
    other = w.view(16, 32)  # a new tensor object at the packed weight's address (as after a free and reuse)
    torch.testing.assert_close(linear(x, other, None), F.linear(x.bfloat16(), w.bfloat16()).float(), rtol=0, atol=0)


def test_kernel_ops_use_the_packed_path_only_at_medium_precision_and_above_the_small_batch_size() -> None:
    ops = select_ops("cpu", torch.float32, torch.float32, torch.device("cpu"))
    x, w = torch.randn(SMALL_BATCH_LINEAR + 8, 64), torch.randn(48, 64)
    exact = ops.linear(x, w, None)
    torch.testing.assert_close(exact, F.linear(x, w))
    with fp32_matmul_precision("medium"):
        medium = ops.linear(x, w, None)
        small = ops.linear(x[:SMALL_BATCH_LINEAR], w, None)  # the float32 kernel, exact at any precision
    torch.testing.assert_close(medium, F.linear(x.bfloat16(), w.bfloat16()).float(), rtol=0, atol=0)
    torch.testing.assert_close(small, F.linear(x[:SMALL_BATCH_LINEAR], w), rtol=1e-5, atol=1e-5)
