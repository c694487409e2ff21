"""Packed-weight linears (bf16, fp16, int8, int4) against a dequantize-then-matmul reference.

The reference multiplies the float32 dequantized weight (`dequantize()`, plain torch) with x in
float64. The kernels sum the same float32 products in another order (group partial sums times the
scale), so they may differ by float32 rounding only: the bound is the classic one for a length-K
float32 dot product, 2 K 2^-24 sum_k |x_k w_k|, elementwise. A wrong nibble, scale, group index or
tail element is off by orders of magnitude more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from symmetric_int4 import symmetric_int4, with_offsets

from kvpager.model.backends import quant_weights
from kvpager.model.backends.bf16_linear import native_bf16_matmul_available
from kvpager.model.backends.kernels.build import KernelBuildError
from kvpager.model.backends.quant_kernels import LEVEL_AVX2, LEVEL_AVX512, LEVEL_PORTABLE, load_quant_kernels
from kvpager.model.backends.quant_weights import (
    DEQUANT_CHUNK_ROWS,
    KERNEL_MAX_ROWS,
    NATIVE_BF16_AFTER_ROWS,
    Bf16Weight,
    F16Weight,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    cat_rows,
)

# 1-2: in registers; 3-KERNEL_MAX_ROWS: the shared L1 tile; beyond: dequantize in chunks + torch's GEMM
BATCHES = [1, 2, 3, 16, 64, KERNEL_MAX_ROWS + 1]
SHAPES = [(37, 100), (64, 256), (530, 129)]  # N not a multiple of any tile; K not a multiple of the group
FORMATS = {
    "bf16": lambda w: Bf16Weight(w.to(torch.bfloat16)),
    "fp16": lambda w: F16Weight(w.to(torch.float16)),
    "int8_channel": lambda w: Int8Weight.from_float(w),
    "int8_g32": lambda w: Int8Weight.from_float(w, 32),
    "int4_g32": lambda w: Int4Weight.from_float(w, 32),
    "int4_g64": lambda w: Int4Weight.from_float(w, 64),
    "int4_g128": lambda w: Int4Weight.from_float(w, 128),
    "int4_g32_symmetric": lambda w: symmetric_int4(Int4Weight, w, 32),  # GGUF Q4_0: no offsets stored
    "int4_g64_symmetric": lambda w: symmetric_int4(Int4Weight, w, 64),
}


def _kernels_or_skip() -> None:
    try:
        load_quant_kernels()
    except KernelBuildError as exc:  # pragma: no cover - every CI machine has g++
        pytest.skip(f"no C++ compiler for the packed-weight kernels: {exc}")


def _assert_float32_exact(out: torch.Tensor, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> None:
    w = weight.dequantize().double()
    ref = x.double() @ w.t() + (bias.double() if bias is not None else 0.0)
    bound = 2 * weight.in_features * 2.0**-24 * (x.double().abs() @ w.abs().t()) + 1e-30
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"off by more than float32 rounding ({excess:.3e} over the bound)"


LEVELS = {"avx512": LEVEL_AVX512, "avx2": LEVEL_AVX2, "portable": LEVEL_PORTABLE}


def _level_or_skip(name: str) -> int:
    _kernels_or_skip()
    if load_quant_kernels().level(LEVELS[name]) != LEVELS[name]:
        pytest.skip(f"this CPU has no {name} path (it runs the next path down, tested under its own name)")
    return LEVELS[name]


@pytest.mark.parametrize("isa", list(LEVELS))
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_packed_linear_equals_dequantize_then_matmul_to_float32_rounding(
    fmt: str, shape: tuple[int, int], isa: str
) -> None:
    level = _level_or_skip(isa)
    gen = torch.Generator().manual_seed(10 * list(FORMATS).index(fmt) + SHAPES.index(shape))
    n, k = shape
    weight = FORMATS[fmt](torch.randn(n, k, generator=gen) * 0.05)
    weight.max_level = level
    bias = torch.randn(n, generator=gen)
    for rows in BATCHES:
        x = torch.randn(rows, k, generator=gen)
        out = weight.matmul(x, bias if rows % 2 else None)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        if fmt == "bf16" and rows > NATIVE_BF16_AFTER_ROWS and native_bf16_matmul_available():
            # oneDNN's bf16 GEMM: bf16-rounded activations, float32 sums, the product rounded to bf16
            # (half a bf16 step: at most 2^-8 relative) before the float32 bias is added
            xb = x.bfloat16().double()
            product = xb @ weight.dequantize().double().t()
            got = out.double() - (bias.double() if rows % 2 else 0.0)
            bound = 2.0**-8 * product.abs() + 2 * k * 2.0**-24 * (xb.abs() @ weight.dequantize().double().abs().t())
            assert ((got - product).abs() <= bound + 1e-6).all(), rows
            continue
        _assert_float32_exact(out, x, weight, bias if rows % 2 else None)


def test_large_batch_path_covers_several_dequantized_chunks() -> None:
    _kernels_or_skip()
    n = DEQUANT_CHUNK_ROWS * 2 + 3
    weight = Int4Weight.from_float(torch.randn(n, 48) * 0.1, 16)
    x = torch.randn(KERNEL_MAX_ROWS + 1, 48)
    _assert_float32_exact(weight.matmul(x, None), x, weight, None)


def test_torch_fallback_without_kernels_dequantizes_and_keeps_the_input_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = Int8Weight.from_float(torch.randn(40, 70), 32)
    x = torch.randn(5, 70)
    monkeypatch.setattr(quant_weights, "quant_kernels_or_none", lambda: None)
    _assert_float32_exact(weight.matmul(x, None), x, weight, None)
    assert weight.matmul(x.to(torch.bfloat16), None).dtype == torch.bfloat16


def test_rounding_to_nearest_stays_within_half_a_step() -> None:
    w = torch.randn(33, 200) * 0.1
    w[3] = 0.0  # a zero row: scale 1, exact zeros
    w[4, :64] = 0.25  # a constant group: exact
    original = w.clone()
    i8, i4 = Int8Weight.from_float(w), Int4Weight.from_float(w, 64)
    assert torch.equal(w, original)  # the source (a mapped checkpoint tensor while loading) is never written
    step8 = i8.scales.repeat_interleave(i8.group_size, 1)[:, :200]
    step4 = i4.scales.repeat_interleave(64, 1)[:, :200]
    assert ((i8.dequantize() - w).abs() <= step8 / 2 * (1 + 1e-5)).all()
    assert ((i4.dequantize() - w).abs() <= step4 / 2 * (1 + 1e-5) + 1e-7).all()
    assert torch.equal(i8.dequantize()[3], torch.zeros(200)) and torch.equal(i4.dequantize()[3], torch.zeros(200))
    assert torch.allclose(i4.dequantize()[4, :64], torch.full((64,), 0.25))
    assert int(i8.qweight.abs().max()) == 127 and int(i4.codes().max()) == 15 and int(i4.codes().min()) == 0


def test_gguf_q8_0_and_q4_0_blocks_map_exactly() -> None:
    """GGUF's Q8_0 (w = q d) and Q4_0 (w = (q - 8) d), blocks of 32 with an fp16 scale d."""
    gen = torch.Generator().manual_seed(3)
    n, k = 6, 96
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).to(torch.float16)
    q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d_full = d.float().repeat_interleave(32, 1)
    w8 = Int8Weight(q8, d.float(), 32)
    w4 = Int4Weight.from_codes(q4, d.float(), -8 * d.float(), 32)
    w4_symmetric = Int4Weight.from_codes(q4, d.float(), None, 32)
    assert torch.equal(w8.dequantize(), q8.float() * d_full)
    assert torch.equal(w4.dequantize(), (q4.float() - 8) * d_full)
    assert torch.equal(w4_symmetric.dequantize(), (q4.float() - 8) * d_full)
    assert torch.equal(w4.codes(), q4)


@pytest.mark.parametrize("isa", list(LEVELS))
def test_symmetric_int4_computes_the_bits_of_its_stored_offset_form_and_holds_four_bytes_less_a_group(
    isa: str,
) -> None:
    _kernels_or_skip()
    level = _level_or_skip(isa)
    gen = torch.Generator().manual_seed(4)
    for n, k in SHAPES:
        symmetric = symmetric_int4(Int4Weight, torch.randn(n, k, generator=gen), 32)
        stored = with_offsets(symmetric)
        symmetric.max_level = stored.max_level = level
        for rows in BATCHES:
            x = torch.randn(rows, k, generator=gen)
            assert torch.equal(symmetric.matmul(x, None), stored.matmul(x, None)), (n, k, rows)
        groups = -(-k // 32)
        assert stored.nbytes - symmetric.nbytes == n * groups * 4
        assert len(symmetric.tensors()) == 2


def test_row_concatenation_keeps_symmetric_parts_symmetric_and_mixes_by_their_offsets() -> None:
    gen = torch.Generator().manual_seed(5)
    a, b = (symmetric_int4(Int4Weight, torch.randn(r, 64, generator=gen), 32) for r in (8, 4))
    assert cat_rows([a, b]).offsets is None
    mixed = cat_rows([a, Int4Weight.from_float(torch.randn(4, 64, generator=gen), 32)])
    assert mixed.offsets is not None
    assert torch.equal(mixed.dequantize()[:8], a.dequantize())


def test_row_concatenation_equals_quantizing_the_fused_tensor() -> None:
    parts = [torch.randn(r, 80) for r in (16, 8, 8)]
    for make in (lambda w: Int8Weight.from_float(w, 32), lambda w: Int4Weight.from_float(w, 32)):
        fused, joined = make(torch.cat(parts)), cat_rows([make(p) for p in parts])
        assert all(torch.equal(a, b) for a, b in zip(fused.tensors(), joined.tensors(), strict=True))


def test_malformed_packed_weights_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="scales must be"):
        Int8Weight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3), 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        Int4Weight.from_float(torch.randn(4, 64), 24)
    with pytest.raises(ValueError, match="0..15"):
        Int4Weight.from_codes(torch.full((2, 32), 16), torch.ones(2, 1), torch.zeros(2, 1), 32)
    with pytest.raises(ValueError, match="bfloat16"):
        Bf16Weight(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="float16"):
        F16Weight(torch.zeros(3, 3, dtype=torch.bfloat16))


@pytest.mark.parametrize("isa", list(LEVELS))
def test_fp16_weights_widen_exactly_subnormals_and_extremes_included(isa: str) -> None:
    """float16's whole range through the kernel's widening (F16C or the portable bit-layout path):
    subnormals, the smallest and largest normals, signed zeros, against torch's exact .float()."""
    level = _level_or_skip(isa)
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(0, 0x7C00, (48, 80), generator=gen, dtype=torch.int32)  # every finite magnitude
    bits[:, :16] = torch.randint(0, 0x400, (48, 16), generator=gen, dtype=torch.int32)  # subnormals
    bits[0, :4] = torch.tensor([0x0001, 0x03FF, 0x0400, 0x7BFF])  # min subnormal, max subnormal, min/max normal
    bits |= torch.randint(0, 2, bits.shape, generator=gen, dtype=torch.int32) << 15  # either sign
    weight = F16Weight(bits.to(torch.int16).view(torch.float16))
    weight.max_level = level
    for rows in (1, 2, 5):
        x = torch.randn(rows, 80, generator=gen) * 1e-3
        _assert_float32_exact(weight.matmul(x, None), x, weight, None)
    assert weight.dequantize()[0, :4].abs().tolist() == [2.0**-24, 1023 * 2.0**-24, 2.0**-14, 65504.0]


def test_the_kernel_path_follows_the_cpu_features_and_the_isa_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    _kernels_or_skip()
    kernels = load_quant_kernels()
    flags = set(
        next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "").split()
    )
    best = (
        LEVEL_AVX512
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
        else LEVEL_AVX2
        if {"avx2", "fma", "f16c"} <= flags
        else LEVEL_PORTABLE
    )
    monkeypatch.delenv("KVPAGER_KERNEL_ISA", raising=False)
    assert kernels.default_level == best and kernels.level(LEVEL_PORTABLE) == LEVEL_PORTABLE
    line = kernels.describe()
    assert line.startswith({LEVEL_AVX512: "AVX-512", LEVEL_AVX2: "AVX2+FMA", LEVEL_PORTABLE: "portable"}[best])
    assert "the best this CPU has" in line
    monkeypatch.setenv("KVPAGER_KERNEL_ISA", "portable")  # the switch the other kernels take too
    assert kernels.default_level == LEVEL_PORTABLE
    assert kernels.describe().startswith("portable C++ kernel")
    if best != LEVEL_PORTABLE:
        assert "KVPAGER_KERNEL_ISA=portable" in kernels.describe()
    w = Int4Weight.from_float(torch.randn(20, 70) * 0.1, 32)  # the weights follow the switch per call
    x = torch.randn(2, 70)
    _assert_float32_exact(w.matmul(x, None), x, w, None)
