"""w8a8_int8 / w4a8_int8 linears: integer dot products over activations quantized per block of 32.

The reference quantizes the activations the same way in torch (`quantize_activations`: d = max|x| / 127,
round half to even; the kernel's division is IEEE, so its int8 values are the same) and multiplies the
result with the dequantized weight in float64. The integer block dots are exact; the kernel only sums
float32 partial results in another order, so it is held to the classic float32 dot-product bound,
2 K 2^-24 sum_k |x_hat_k| m_k (m_k = |w_k| for int8; |code_k * scale| + |offset| for int4, whose two
terms the kernel sums separately). The portable and AVX2 paths build, scale and sum the same lanes in
the same order: they agree bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from symmetric_int4 import symmetric_int4, with_offsets

from kvpager.core.config import EngineConfig
from kvpager.engine.loading import log_weight_format
from kvpager.model.backends import quant_dot
from kvpager.model.backends.kernels.build import KernelBuildError
from kvpager.model.backends.quant_dot import (
    BF16_GEMM_AFTER_ROWS,
    DOT_KERNEL_MAX_ROWS,
    Int4DotWeight,
    Int8DotWeight,
    cpu_vendor,
    dot_kernel_max_rows,
    fake_quantize_activations,
    native_bf16,
    quantize_activations,
    reference_matmul,
)
from kvpager.model.backends.quant_kernels import LEVEL_AVX2, LEVEL_AVX512, LEVEL_PORTABLE, load_quant_kernels
from kvpager.model.backends.quant_weights import (
    KERNEL_MAX_ROWS,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    cat_rows,
    quantize,
)
from kvpager.planner.weights import quantized_matrix_bytes


def _half_scales(weight: Int8DotWeight) -> Int8DotWeight:
    """The same weight holding float16 scales (rounded), as GGUF files' blocks do."""
    return Int8DotWeight(weight.plain_qweight(), weight.scales.half(), weight.group_size)


BATCHES = [1, 3, 16, 64]
# N not a multiple of the 4-row tile; K a multiple of 32 but not of the group (96, 160 with g64/g128);
# K not a multiple of 32 at all (200: int8 per channel, and int4 whose last group is 8 wide)
SHAPES = [(37, 96), (64, 256), (130, 160), (9, 200)]
FORMATS = {
    "w8a8_channel": lambda w: Int8DotWeight.from_float(w),
    "w8a8_g32": lambda w: Int8DotWeight.from_float(w, 32),
    "w8a8_g16": lambda w: Int8DotWeight.from_float(w, 16),  # two scales per block (GGUF Q6_K)
    "w8a8_g16_f16_scales": lambda w: _half_scales(Int8DotWeight.from_float(w, 16)),
    "w8a8_g64": lambda w: Int8DotWeight.from_float(w, 64),
    "w4a8_g32": lambda w: Int4DotWeight.from_float(w, 32),
    "w4a8_g64": lambda w: Int4DotWeight.from_float(w, 64),
    "w4a8_g128": lambda w: Int4DotWeight.from_float(w, 128),
    "w4a8_g32_symmetric": lambda w: symmetric_int4(Int4DotWeight, w, 32),  # GGUF Q4_0: no offsets stored
    "w4a8_g64_symmetric": lambda w: symmetric_int4(Int4DotWeight, w, 64),
}


def _kernels_or_skip() -> None:
    try:
        load_quant_kernels()
    except KernelBuildError as exc:  # pragma: no cover - every CI machine has g++
        pytest.skip(f"no C++ compiler for the packed-weight kernels: {exc}")


def _magnitude(weight: PackedWeight) -> torch.Tensor:
    """|w| per element as the kernel's float sums see it (int4: code * scale and offset apart)."""
    if isinstance(weight, Int4Weight):
        rep = lambda t: t.repeat_interleave(weight.group_size, dim=1)[:, : weight.in_features]  # noqa: E731
        offsets = rep(weight.group_offsets()).double().abs()
        return (weight.codes().double() * rep(weight.scales).double()).abs() + offsets
    return weight.dequantize().double().abs()


def _assert_float32_rounding(
    out: torch.Tensor, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None
) -> None:
    ref = reference_matmul(weight, x, bias)
    xq = fake_quantize_activations(x.float()).double()
    bound = 2 * weight.in_features * 2.0**-24 * (xq.abs() @ _magnitude(weight).t()) + 1e-30
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"off by more than float32 rounding ({excess:.3e} over the bound)"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_integer_dot_kernel_equals_the_quantized_activation_reference_to_float32_rounding(
    fmt: str, shape: tuple[int, int]
) -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(10 * list(FORMATS).index(fmt) + SHAPES.index(shape))
    n, k = shape
    weight = FORMATS[fmt](torch.randn(n, k, generator=gen) * 0.05)
    bias = torch.randn(n, generator=gen)
    for rows in BATCHES:
        x = torch.randn(rows, k, generator=gen)
        x[0, :32] = 0.0  # an all-zero block (d = 0)
        _assert_float32_rounding(weight.dot_kernel(x, bias), x, weight, bias)
        weight.max_level = LEVEL_PORTABLE
        _assert_float32_rounding(weight.dot_kernel(x, bias), x, weight, bias)
        weight.max_level = None


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_portable_avx2_and_vnni_integer_dot_paths_agree_bit_for_bit_bar_vnni_block_pairs(fmt: str) -> None:
    _kernels_or_skip()
    kernels = load_quant_kernels()
    levels = [level for level in (LEVEL_AVX512, LEVEL_AVX2) if kernels.dot_level(level) == level]
    if not levels:
        pytest.skip("this CPU has no AVX2: only the portable path runs (tested against the reference)")
    print(f"integer-dot paths compared with the portable one here: {levels} (2: AVX-512 VNNI, 1: AVX2)")
    panels = int(kernels.dot_panel_rows(LEVEL_PORTABLE))  # batches from this many rows: the 8-row panels
    assert 3 < panels <= 16  # so the batches below reach both the tiles and the panels
    gen = torch.Generator().manual_seed(list(FORMATS).index(fmt))
    for n, k in SHAPES:
        weight = FORMATS[fmt](torch.randn(n, k, generator=gen))
        for rows in (1, 3, 16):
            x = torch.randn(rows, k, generator=gen) * 3
            weight.max_level = LEVEL_PORTABLE
            portable = weight.dot_kernel(x)
            for level in levels:
                if level == LEVEL_AVX512 and fmt in (
                    "w8a8_g32",
                    "w8a8_g16",
                    "w8a8_g16_f16_scales",
                    "w4a8_g32",
                    "w4a8_g32_symmetric",
                    "w4a8_g128",
                ):
                    # VNNI pairs the blocks of groups 32 and 16 and takes int4 four blocks a step (other
                    # rounding; held to the reference above)
                    continue
                weight.max_level = level
                expected = portable
                if level == LEVEL_AVX512 and rows >= panels:
                    # the VNNI build has no panels: its rows are the one-row tiles', which the portable
                    # path gives a row alone (a row's bits do not depend on the other rows of its batch)
                    weight.max_level = LEVEL_PORTABLE
                    expected = torch.cat([weight.dot_kernel(x[i : i + 1]) for i in range(rows)])
                    weight.max_level = level
                assert torch.equal(weight.dot_kernel(x), expected), (n, k, rows, level)


@pytest.mark.parametrize("fmt", ["w8a8_g32", "w8a8_g16", "w4a8_g32", "w8a8_channel", "w4a8_g128"])
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(fmt: str) -> None:
    # groups 32 and 16 run the per-block loop, other groups the group loop; rows alone and in pairs
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(11)
    weight = FORMATS[fmt](torch.randn(37, 200, generator=gen) * 0.05)
    x = torch.randn(DOT_KERNEL_MAX_ROWS, 200, generator=gen)
    alone = torch.cat([weight.dot_kernel(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in range(2, DOT_KERNEL_MAX_ROWS + 1):
        assert torch.equal(weight.dot_kernel(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("fmt", ["w8a8_g32", "w4a8_g32"])
def test_every_batch_size_and_the_torch_fallback_compute_the_same_quantized_product(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernels_or_skip()
    # (the bfloat16 GEMM that takes prompts on CPUs with native bf16 matmul computes another product:
    # tests/test_bf16_prompt_path.py)
    monkeypatch.setattr(quant_dot, "native_bf16", lambda: False)
    gen = torch.Generator().manual_seed(5)
    weight = FORMATS[fmt](torch.randn(70, 128, generator=gen) * 0.05)
    bias = torch.randn(70, generator=gen)
    # the VNNI integer dot takes every batch; capped at AVX2 the exact tile and GEMM take the larger ones
    for level in (None, LEVEL_AVX2):
        weight.max_level = level
        limit = weight.dot_rows(load_quant_kernels())
        for rows in (1, 129) if limit is None else (1, limit, limit + 1, 129):  # the dot kernel, exact tile, GEMM
            x = torch.randn(2, rows, 128, generator=gen)
            out = weight.matmul(x, bias)
            assert out.shape == (2, rows, 70)
            _assert_float32_rounding(out.view(-1, 70), x.view(-1, 128), weight, bias)
    weight.max_level = None
    monkeypatch.setattr(quant_dot, "quant_kernels_or_none", lambda: None)
    monkeypatch.setattr("kvpager.model.backends.quant_weights.quant_kernels_or_none", lambda: None)
    x = torch.randn(3, 128, generator=gen)
    _assert_float32_rounding(weight.matmul(x, bias), x, weight, bias)


@pytest.mark.parametrize(("dot", "exact"), [("w8a8_int8", "int8"), ("w4a8_int8", "int4")])
def test_the_dynamic_modes_differ_from_the_exact_ones_by_the_activation_rounding_only(dot: str, exact: str) -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=gen) * 0.05
    fast, slow = quantize(w, dot, 64), quantize(w, exact, 64)
    # the same stored weights (the dot mode may keep its int4 rows interleaved; the digest is layout-free)
    assert all(torch.equal(a, b) for a, b in zip(fast.digest_tensors(), slow.digest_tensors(), strict=True))
    x = torch.randn(1, 256, generator=gen)
    diff = (fast.matmul(x, None) - slow.matmul(x, None)).double().abs()
    # |w . (x - x_hat)| <= sum_k |w_k| |x_k - x_hat_k|, each |x_k - x_hat_k| <= d_block / 2
    _, d = quantize_activations(x)
    half_step = (d / 2).repeat_interleave(32, dim=1)[:, :256].double()
    bound = half_step @ slow.dequantize().double().abs().t() + 1e-5
    assert (diff <= bound).all()
    assert diff.max() > 1e-5  # the activations really are rounded (an exact run would differ by ~1e-7)


def test_the_dot_kernels_row_limit_follows_both_kernels_vector_width() -> None:
    # AVX2 exact kernels (as wide as the integer dot): decode batches stay on the integer dot; AVX-512
    # exact kernels against the AVX2 integer dot (twice as wide) or the portable build: only a few rows;
    # the VNNI integer dot: decode batches again. int8 and int4 on AVX2 off Intel: every batch (prompts
    # take the 8-row panels).
    assert dot_kernel_max_rows("int4", LEVEL_AVX2, LEVEL_AVX2, "GenuineIntel") == 32
    assert dot_kernel_max_rows("int4", LEVEL_AVX2, LEVEL_AVX2, "AuthenticAMD") is None
    assert dot_kernel_max_rows("int8", LEVEL_AVX2, LEVEL_AVX2, "GenuineIntel") == 16
    assert dot_kernel_max_rows("int8", LEVEL_AVX2, LEVEL_AVX2, "AuthenticAMD") is None
    assert dot_kernel_max_rows("int4", LEVEL_AVX512, LEVEL_AVX2) == DOT_KERNEL_MAX_ROWS == 4
    assert dot_kernel_max_rows("int8", LEVEL_PORTABLE, LEVEL_PORTABLE) == 4
    assert dot_kernel_max_rows("int8", LEVEL_AVX512, LEVEL_AVX512) is None  # every batch
    assert dot_kernel_max_rows("int4", LEVEL_AVX512, LEVEL_AVX512) is None
    _kernels_or_skip()
    weight = Int4DotWeight.from_float(torch.randn(8, 64), 32)
    weight.max_level = LEVEL_PORTABLE  # a weight capped below AVX2 takes the portable exact path past 4 rows
    assert weight.dot_rows(load_quant_kernels()) == DOT_KERNEL_MAX_ROWS
    if load_quant_kernels().dot_level(LEVEL_AVX512) == LEVEL_AVX512:
        weight.max_level = LEVEL_AVX512  # this CPU has the VNNI integer dot: every batch, or up to the
        # prompts' limit where they take the bf16 GEMM (native bf16 matmul) or the exact GEMM path
        # (Intel's vendor rule: tests/test_dot_prompt_path.py, tests/test_bf16_prompt_path.py)
        expected = KERNEL_MAX_ROWS if cpu_vendor() == "GenuineIntel" else None
        assert weight.dot_rows(load_quant_kernels()) == (BF16_GEMM_AFTER_ROWS if native_bf16() else expected)


def test_activations_are_quantized_symmetric_per_block_of_32_round_half_to_even() -> None:
    x = torch.zeros(1, 40)
    x[0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # d = 1: the halves round to even
    x[0, 32:34] = torch.tensor([-0.25, 0.125])  # the last block (8 wide, zero-padded): d = 0.25 / 127
    q, d = quantize_activations(x)
    assert q.shape == (1, 2, 32) and d.shape == (1, 2)
    assert q[0, 0, :4].tolist() == [127, 0, 2, -2] and d[0, 0].item() == 1.0
    assert q[0, 1, :3].tolist() == [-127, 64, 0] and not q[0, 1, 3:].any()


def test_row_concatenation_keeps_the_dynamic_format() -> None:
    gen = torch.Generator().manual_seed(3)
    parts = [Int4DotWeight.from_float(torch.randn(n, 64, generator=gen), 32) for n in (8, 4)]
    fused = cat_rows(list(parts))
    assert type(fused) is Int4DotWeight and fused.method == "w4a8_int8" and fused.out_features == 12
    parts8 = [Int8DotWeight.from_float(torch.randn(n, 64, generator=gen)) for n in (8, 4)]
    assert type(cat_rows(list(parts8))) is Int8DotWeight
    assert not isinstance(Int8Weight.from_float(torch.randn(4, 64)), Int8DotWeight)


@pytest.mark.parametrize("method", ["w8a8_int8", "w4a8_int8"])
def test_group_sizes_that_are_not_multiples_of_32_are_refused_naming_the_value(method: str) -> None:
    with pytest.raises(ValueError, match="multiple of 32.*got 48"):
        EngineConfig(quantization=method, quantization_group_size=48)
    with pytest.raises(ValueError, match="multiple of 32.*got 48"):
        quantize(torch.randn(8, 96), method, 48)
    with pytest.raises(ValueError, match="multiple of 32.*got 48"):
        quantized_matrix_bytes(8, 96, method, 48)
    EngineConfig(quantization=method, quantization_group_size=64)  # accepted
    EngineConfig(quantization="int4", quantization_group_size=48)  # the exact int4 keeps its multiple of 16


def test_the_kernel_refuses_a_group_it_cannot_run_and_writes_nothing() -> None:
    _kernels_or_skip()
    kernels = load_quant_kernels()
    w = Int8Weight.from_float(torch.randn(8, 96), 48)  # an exact-mode weight: group 48 is fine there
    x, out = torch.randn(1, 96), torch.full((1, 8), 7.0)
    qw, scales, _ = w._pointers()
    rc = kernels.dot_linear(w.fmt, x.data_ptr(), 1, 96, qw, scales, None, 8, 48, None, out.data_ptr(), 1, 1)
    assert rc == -1 and (out == 7.0).all()
    # group 16 is int8's only (two scales per block); an int4 weight at group 16 is refused
    w4 = Int4Weight.from_float(torch.randn(8, 96), 16)
    qw, scales, offsets = w4._pointers()
    rc = kernels.dot_linear(w4.fmt, x.data_ptr(), 1, 96, qw, scales, offsets, 8, 16, None, out.data_ptr(), 1, 1)
    assert rc == -1 and (out == 7.0).all()


def test_the_integer_dot_path_follows_the_cpu_and_the_isa_switch_and_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _kernels_or_skip()
    kernels = load_quant_kernels()
    monkeypatch.delenv("KVPAGER_KERNEL_ISA", raising=False)
    flags = set(
        next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "").split()
    )
    vnni, avx2 = {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"} <= flags, {"avx2", "fma"} <= flags
    best = LEVEL_AVX512 if avx2 and vnni else LEVEL_AVX2 if avx2 else LEVEL_PORTABLE
    assert kernels.dot_level(kernels.default_level) == best
    names = {
        LEVEL_AVX512: "AVX-512 VNNI integer-dot",
        LEVEL_AVX2: "AVX2+FMA integer-dot",
        LEVEL_PORTABLE: "portable C++",
    }
    assert kernels.describe_dot().startswith(names[best])
    assert kernels.dot_level(LEVEL_AVX2) == min(best, LEVEL_AVX2)  # a cap below VNNI takes AVX2
    config = EngineConfig(quantization="w4a8_int8")
    with caplog.at_level("INFO", logger="kvpager"):
        log_weight_format(config, SimpleNamespace(torch_dtype="float32"), torch.device("cpu"))  # type: ignore[arg-type]
    assert "quantization w4a8_int8, group 128" in caplog.text and "integer-dot kernel" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="kvpager"):  # a GGUF file: its types, not "none"
        for config in (EngineConfig(), EngineConfig(gguf_int8_activations=True)):
            log_weight_format(config, SimpleNamespace(torch_dtype="float32"), torch.device("cpu"), gguf=True)  # type: ignore[arg-type]
    exact, with_dot = caplog.records[-2].getMessage(), caplog.records[-1].getMessage()
    assert "quantization the GGUF file's own types" in exact and "integer-dot" not in exact
    assert "quantization the GGUF file's own types" in with_dot and "integer-dot kernel" in with_dot
    monkeypatch.setenv("KVPAGER_KERNEL_ISA", "portable")
    assert kernels.dot_level(kernels.default_level) == LEVEL_PORTABLE
    assert kernels.describe_dot().startswith("portable C++ integer-dot kernel (scalar int32")


def test_symmetric_int4_dot_gives_the_bits_of_its_stored_offset_form_where_it_adds_the_offset_term() -> None:
    # Every path but the VNNI block tiles (group 32) adds the offset -8 * scale as a term of its own,
    # as it adds stored offsets; those tiles fold it into the integer dots instead (held to the
    # reference, and closer to it than the stored form).
    _kernels_or_skip()
    kernels = load_quant_kernels()
    gen = torch.Generator().manual_seed(12)
    levels = [LEVEL_PORTABLE] + [lv for lv in (LEVEL_AVX2, LEVEL_AVX512) if kernels.dot_level(lv) == lv]
    folded = 0
    for group in (32, 64):
        for n, k in SHAPES:
            symmetric = symmetric_int4(Int4DotWeight, torch.randn(n, k, generator=gen), group)
            stored = with_offsets(symmetric)
            for level in levels:
                symmetric.max_level = stored.max_level = level
                for rows in (1, 3, 16):
                    x = torch.randn(rows, k, generator=gen)
                    if level == LEVEL_AVX512 and group == 32:
                        _assert_float32_rounding(symmetric.dot_kernel(x), x, symmetric, None)
                        ref = reference_matmul(symmetric, x, None)
                        folded_err = (symmetric.dot_kernel(x).double() - ref).abs().max().item()
                        stored_err = (stored.dot_kernel(x).double() - ref).abs().max().item()
                        assert folded_err <= stored_err, (n, k, rows)
                        folded += 1
                    else:
                        assert torch.equal(symmetric.dot_kernel(x), stored.dot_kernel(x)), (group, n, k, level, rows)
    if LEVEL_AVX512 in levels:
        assert folded > 0
