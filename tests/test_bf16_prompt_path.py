"""Prompts of the int8-activation formats on CPUs with native bf16 matmul: the bfloat16 GEMM.

Where oneDNN has native bfloat16 matmul (AVX512-BF16 / AMX) and the integer dot runs its VNNI build,
batches of more than BF16_GEMM_AFTER_ROWS rows leave the integer dot for `bf16_matmul`: the weight
dequantized and rounded to bfloat16 by the kernel (`kvq_dequant_bf16`), the activations rounded to
bfloat16, oneDNN's GEMM (float32 accumulation, the result rounded to bfloat16). Pinned here: the
kernel's bfloat16 rows are the torch reference's bits (float32 dequantization, round to nearest
even) in every format, layout and ISA level; the product is the bfloat16 reference's to the output's
rounding; the rule and which path runs (GGUF row stacks and affine wrappers included); the log line.
bf16_matmul runs on any CPU (torch emulates bf16 matmul where it is not native), so none of this skips
on a CPU without it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from symmetric_int4 import symmetric_int4

from kvpager.model.backends import quant_dot
from kvpager.model.backends.kernels.build import KernelBuildError
from kvpager.model.backends.quant_dot import (
    BF16_GEMM_AFTER_ROWS,
    Int4DotWeight,
    Int8DotWeight,
    bf16_gemm_prompts,
    dot_kernel_max_rows,
)
from kvpager.model.backends.quant_kernels import LEVEL_AVX2, LEVEL_AVX512, LEVEL_PORTABLE, load_quant_kernels
from kvpager.model.backends.quant_weights import Int4Weight, Int8Weight, PackedWeight
from kvpager.model.gguf_packed import AffineInt8Weight, RowStack

FORMATS = {
    "int8_channel": lambda w: Int8DotWeight.from_float(w),
    "int8_g32": lambda w: Int8DotWeight.from_float(w, 32),
    "int8_g16": lambda w: Int8DotWeight.from_float(w, 16),  # GGUF Q6_K's two scales per block
    "int8_g32_f16_scales": lambda w: _half_scales_int8(Int8DotWeight.from_float(w, 32)),  # GGUF Q8_0
    "int4_g32": lambda w: Int4DotWeight.from_float(w, 32),
    "int4_g64": lambda w: Int4DotWeight.from_float(w, 64),
    "int4_g128": lambda w: Int4DotWeight.from_float(w, 128),
    "int4_g32_symmetric": lambda w: symmetric_int4(Int4DotWeight, w, 32),  # GGUF Q4_0
    "int4_g32_plain": lambda w: Int4DotWeight.from_float(w, 32, interleave=False),
    "int4_exact_g32": lambda w: Int4Weight.from_float(w, 32),
    "int8_exact_channel": lambda w: Int8Weight.from_float(w),
}
# N not a multiple of the 4-row interleave (37), K not a multiple of 32 (200), both plain (64 x 256)
SHAPES = [(37, 96), (64, 256), (8, 200)]


@pytest.fixture(autouse=True)
def kernels() -> None:
    try:
        load_quant_kernels()
    except KernelBuildError as exc:  # pragma: no cover - every CI machine has g++
        pytest.skip(f"no C++ compiler for the packed-weight kernels: {exc}")


def _half_scales_int8(weight: Int8DotWeight) -> Int8DotWeight:
    return Int8DotWeight(weight.plain_qweight(), weight.scales.half(), weight.group_size)


def _bf16_rows(weight: PackedWeight, level: int) -> torch.Tensor:
    kernels = load_quant_kernels()
    out = torch.empty((weight.out_features, weight.in_features), dtype=torch.bfloat16)
    w, scales, offsets = weight._pointers()
    kernels.dequant_bf16(
        weight.kernel_fmt(), w, scales, offsets, weight.out_features, weight.in_features, weight.group_size,
        0, weight.out_features, out.data_ptr(), 2, level,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_kernels_bf16_rows_are_the_reference_dequantization_rounded_to_nearest_even(fmt: str) -> None:
    gen = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        if fmt.startswith("int4") and k % 32 and "g32" not in fmt:
            continue  # int4 groups wider than K's tail: still covered by g32 at K = 200
        weight = FORMATS[fmt](torch.randn(n, k, generator=gen) * 0.05)
        # torch's float32 -> bfloat16 conversion rounds to nearest even: the reference's bits
        ref = weight.dequantize(torch.float32).to(torch.bfloat16)
        for level in (LEVEL_PORTABLE, LEVEL_AVX2, LEVEL_AVX512):
            assert torch.equal(_bf16_rows(weight, level).view(torch.int16), ref.view(torch.int16)), (n, k, level)


def test_rows_on_a_rounding_tie_round_to_even() -> None:
    # codes 0..15 times a scale whose products have bits below bfloat16's: 1 + 2^-8 (a tie) rounds to 1,
    # 1 + 3 * 2^-8 (a tie) rounds up to 1 + 2^-6 ... as torch rounds
    scales = torch.tensor([[1.0 + 2.0**-8]], dtype=torch.float32)
    weight = Int8Weight(torch.arange(1, 33, dtype=torch.int8).view(1, 32), scales, 32)
    ref = weight.dequantize(torch.float32).to(torch.bfloat16)
    assert torch.equal(_bf16_rows(weight, LEVEL_AVX512).view(torch.int16), ref.view(torch.int16))
    assert not torch.equal(ref.float(), weight.dequantize(torch.float32))  # the ties really are rounded


@pytest.mark.parametrize("fmt", ["int4_g32", "int4_g32_symmetric", "int8_g32", "int8_g16", "int8_channel"])
@pytest.mark.parametrize("rows", [BF16_GEMM_AFTER_ROWS + 1, 129, 300])
def test_the_product_is_the_bf16_references_to_the_outputs_rounding(fmt: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = FORMATS[fmt](torch.randn(70, 200, generator=gen) * 0.05)
    bias = torch.randn(70, generator=gen)
    x = torch.randn(rows, 200, generator=gen)
    out = weight.bf16_matmul(x, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, 70)
    xb, wb = x.to(torch.bfloat16).double(), weight.dequantize(torch.bfloat16).double()
    exact = xb @ wb.T
    # the result rounded to bfloat16 (half an ulp: 2^-9 relative) after float32 accumulation
    # (2 K 2^-24 sum |x| |w|), then the bias added in float32
    bound = exact.abs() * 2.0**-8 + 2 * 200 * 2.0**-24 * (xb.abs() @ wb.abs().T) + 1e-6
    assert ((out.double() - bias.double() - exact).abs() <= bound).all()
    # and it is not the integer-dot product (int8 activations): the two paths differ by more than that
    assert not torch.allclose(out, weight.dot_kernel(x, bias), rtol=0, atol=1e-5)


def test_the_rule_sends_batches_past_the_limit_to_the_bf16_gemm_on_vnni_cpus_whatever_the_vendor() -> None:
    for weight_format in ("int8", "int4"):
        for vendor in ("GenuineIntel", "AuthenticAMD", None):
            assert dot_kernel_max_rows(weight_format, LEVEL_AVX512, LEVEL_AVX512, vendor, True) == BF16_GEMM_AFTER_ROWS
        # without VNNI (the AVX2 or portable integer dot) native bf16 changes nothing
        for exact, dot in ((LEVEL_AVX512, LEVEL_AVX2), (LEVEL_AVX2, LEVEL_AVX2), (LEVEL_PORTABLE, LEVEL_PORTABLE)):
            assert dot_kernel_max_rows(weight_format, exact, dot, "AuthenticAMD", True) == dot_kernel_max_rows(
                weight_format, exact, dot, "AuthenticAMD", False
            )
    assert bf16_gemm_prompts(LEVEL_AVX512, True)
    assert not bf16_gemm_prompts(LEVEL_AVX512, False) and not bf16_gemm_prompts(LEVEL_AVX2, True)


def _counting(monkeypatch: pytest.MonkeyPatch, weight: Any, calls: dict[str, int]) -> None:
    for name in ("dot_kernel", "exact_matmul", "bf16_matmul"):
        original = getattr(weight, name)

        def counted(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> torch.Tensor:
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(weight, name, counted)


def _as_a_vnni_cpu(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """The rule as a VNNI CPU with (or without) native bf16 matmul applies it, on any CPU."""
    real = dot_kernel_max_rows
    monkeypatch.setattr(
        quant_dot, "dot_kernel_max_rows", lambda f, *_: real(f, LEVEL_AVX512, LEVEL_AVX512, "AuthenticAMD", native)
    )
    monkeypatch.setattr(quant_dot, "native_bf16", lambda: native)
    monkeypatch.setattr(quant_dot, "bf16_gemm_prompts", lambda _level, n: n)


@pytest.mark.parametrize("make", [lambda w: Int4DotWeight.from_float(w, 32), lambda w: Int8DotWeight.from_float(w)])
def test_batches_past_the_limit_take_the_bf16_gemm_and_smaller_ones_the_integer_dot(
    monkeypatch: pytest.MonkeyPatch, make: Any
) -> None:
    weight = make(torch.randn(40, 96, generator=torch.Generator().manual_seed(3)))
    calls = {"dot_kernel": 0, "exact_matmul": 0, "bf16_matmul": 0}
    _counting(monkeypatch, weight, calls)
    x = torch.randn(2, BF16_GEMM_AFTER_ROWS + 1, 96, generator=torch.Generator().manual_seed(4))
    _as_a_vnni_cpu(monkeypatch, native=True)
    small = weight.matmul(x[0, :BF16_GEMM_AFTER_ROWS], None)
    big = weight.matmul(x, None)  # [2, 65, 96]: 130 rows
    assert calls == {"dot_kernel": 1, "exact_matmul": 0, "bf16_matmul": 1}
    assert small.shape == (BF16_GEMM_AFTER_ROWS, 40) and big.shape == (2, BF16_GEMM_AFTER_ROWS + 1, 40)
    assert torch.equal(big.view(-1, 40), weight.bf16_matmul(x.view(-1, 96), None))
    _as_a_vnni_cpu(monkeypatch, native=False)  # without native bf16 the VNNI dot takes every batch here
    weight.matmul(x, None)
    assert calls == {"dot_kernel": 2, "exact_matmul": 0, "bf16_matmul": 2}


def test_the_rule_reaches_gguf_row_stacks_and_affine_wrappers(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(5)
    int4 = Int4DotWeight.from_float(torch.randn(8, 64, generator=gen), 32)
    int8 = Int8DotWeight.from_float(torch.randn(16, 64, generator=gen), 32)
    affine = AffineInt8Weight(Int8DotWeight.from_float(torch.randn(8, 64, generator=gen), 32), torch.zeros(8, 2))
    calls = {"dot_kernel": 0, "exact_matmul": 0, "bf16_matmul": 0}
    for weight in (int4, int8, affine.inner):
        _counting(monkeypatch, weight, calls)
    _as_a_vnni_cpu(monkeypatch, native=True)
    x = torch.randn(BF16_GEMM_AFTER_ROWS + 1, 64, generator=gen)
    stacked = RowStack([int4, int8]).matmul(x, None)
    affine.matmul(x, None)
    assert calls["bf16_matmul"] == 3 and calls["dot_kernel"] == 0 and calls["exact_matmul"] == 0
    assert torch.equal(stacked, torch.cat([int4.bf16_matmul(x, None), int8.bf16_matmul(x, None)], dim=1))


def test_the_start_up_line_says_prompts_take_the_bf16_gemm(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvpager.core.config import EngineConfig
    from kvpager.engine import loading

    spec: Any = SimpleNamespace(torch_dtype="bfloat16")
    monkeypatch.setattr(loading, "native_bf16_matmul_available", lambda: True)
    monkeypatch.setattr(loading, "dot_kernel_max_rows", lambda *_: BF16_GEMM_AFTER_ROWS)
    monkeypatch.setattr(loading, "bf16_gemm_prompts", lambda *_: True)
    with caplog.at_level("INFO", logger="kvpager"):
        loading.log_weight_format(EngineConfig(quantization="w4a8_int8"), spec, torch.device("cpu"))
    line = caplog.records[-1].getMessage()
    assert (
        f"up to {BF16_GEMM_AFTER_ROWS} rows (int4), then the bf16 GEMM (oneDNN) over the weights dequantized to bfloat16"
        in line
    )


def test_a_bf16_model_prompt_feeds_the_gemm_its_own_activations() -> None:
    # activations already in bfloat16 (a --dtype bfloat16 model) go in unchanged, the result comes back
    # in the caller's dtype through matmul
    weight = Int4DotWeight.from_float(torch.randn(24, 64, generator=torch.Generator().manual_seed(6)), 32)
    x = torch.randn(BF16_GEMM_AFTER_ROWS + 3, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    out = weight.bf16_matmul(x, None)
    ref = F.linear(x.double(), weight.dequantize(torch.bfloat16).double())
    assert torch.allclose(out.double(), ref, rtol=2.0**-8, atol=1e-4)
