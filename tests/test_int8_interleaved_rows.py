"""int8 rows stored interleaved four at a time (kernels/int4_rows.h, as int4's): the same values, the same results.

The layout changes only where a row's bytes lie, so the exact kernels (direct tiles, the L1 tile, the
GEMM's dequantize) and the integer dot must give the plain layout's bits for the same weight, at every
ISA level; the digest, the stored size, `dequantize` and concatenation must not see it. The integer
dot has no VNNI form for interleaved int8 rows: there kvq_dot_linear runs the AVX2 build, so on a VNNI
CPU an interleaved weight gives the AVX2 build's bits (which the plain weight gives at that level).
"""

from __future__ import annotations

import pytest
import torch
from test_int4_interleaved_rows import BATCHES, LEVELS, _digest, _kernels_or_skip

from kvpager.model.backends.quant_dot import Int8DotWeight
from kvpager.model.backends.quant_kernels import FMT_ROWS4, LEVEL_AVX2, LEVEL_AVX512, load_quant_kernels
from kvpager.model.backends.quant_weights import Int8Weight, cat_rows, interleave_rows
from kvpager.model.gguf_packed import AffineInt8Weight


def _pair(cls: type[Int8Weight], w: torch.Tensor, group: int | None, half: bool) -> tuple[Int8Weight, Int8Weight]:
    """The same weight plain and interleaved (half: float16 scales, as GGUF Q8_0 holds)."""
    plain = cls.from_float(w, group, interleave=False)
    scales = plain.scales.half() if half else plain.scales
    plain = cls(plain.qweight, scales, plain.group_size, interleave=False)
    return plain, cls(plain.qweight, scales, plain.group_size, interleave=True)


def _dot_reference_level(level: int | None) -> int | None:
    """The level at which the plain weight's integer dot takes the path an interleaved one takes at `level`."""
    kernels = load_quant_kernels()
    chosen = int(kernels.dot_level(kernels.default_level if level is None else level))
    return LEVEL_AVX2 if chosen == LEVEL_AVX512 else level


@pytest.mark.parametrize(
    ("out_features", "in_features", "group"),
    [(4, 64, 32), (7, 128, None), (33, 192, 32), (64, 256, 16), (10, 96, 64), (200, 128, 32)],
    ids=["one-group-of-four", "per-channel-tail-rows", "q8_0-like", "q6_k-halves", "group-64", "many-tiles"],
)
@pytest.mark.parametrize("half", [False, True], ids=["f32-scales", "f16-scales"])
def test_interleaved_int8_gives_the_plain_layouts_bits_on_every_path(
    out_features: int, in_features: int, group: int | None, half: bool
) -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(out_features * in_features + (group or 0))
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    bias = torch.randn(out_features, generator=gen)
    for cls in (Int8Weight, Int8DotWeight):
        plain, mixed = _pair(cls, w, group, half)
        assert mixed.interleaved and not plain.interleaved
        assert mixed.kernel_fmt() == plain.kernel_fmt() | FMT_ROWS4
        if in_features > 32:  # rows of more than one 32-byte chunk really are stored another way
            assert not torch.equal(mixed.qweight, plain.qweight)
        assert torch.equal(mixed.plain_qweight(), plain.qweight)
        assert torch.equal(mixed.dequantize(), plain.dequantize())
        for level in LEVELS:
            mixed.max_level = level
            for batch in BATCHES:
                x = torch.randn(batch, in_features, generator=gen)
                for b in (None, bias):
                    plain.max_level = level
                    expected = plain.matmul(x, b)
                    if isinstance(mixed, Int8DotWeight):
                        # on a VNNI CPU the interleaved weight's integer dot (batches up to its dot_rows)
                        # runs the AVX2 build, whose bits the plain weight gives at that level
                        reference, limit = _dot_reference_level(level), mixed.dot_rows(load_quant_kernels())
                        if reference != level and (limit is None or batch <= limit):
                            plain.max_level = reference
                            expected = plain.dot_kernel(x, b)
                    assert torch.equal(mixed.matmul(x, b), expected), (cls, level, batch, b is None)
                    if isinstance(mixed, Int8DotWeight):
                        assert isinstance(plain, Int8DotWeight)
                        plain.max_level = _dot_reference_level(level)
                        assert torch.equal(mixed.dot_kernel(x, b), plain.dot_kernel(x, b)), (level, batch)


@pytest.mark.parametrize(
    ("rows", "in_features"), [(3, 256), (8, 96 + 16), (8, 8192)], ids=["under-a-group", "partial-chunk", "long-rows"]
)
def test_int8_weights_that_cannot_or_should_not_interleave_stay_plain(rows: int, in_features: int) -> None:
    w = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    weight = Int8Weight.from_float(w, None, interleave=True)
    assert not weight.interleaved
    assert weight.kernel_fmt() & FMT_ROWS4 == 0
    assert torch.equal(weight.qweight, Int8Weight.from_float(w).qweight)


def test_int8_dot_weights_interleave_by_default_only_where_the_dot_is_below_vnni() -> None:
    _kernels_or_skip()
    kernels = load_quant_kernels()
    below_vnni = int(kernels.dot_level(kernels.default_level)) < LEVEL_AVX512
    weight = Int8DotWeight.from_float(torch.randn(8, 64, generator=torch.Generator().manual_seed(2)), 32)
    assert weight.interleaved == below_vnni
    assert not Int8Weight.from_float(torch.randn(8, 64)).interleaved  # the exact class keeps plain rows


def test_the_digest_and_stored_size_do_not_depend_on_the_int8_layout() -> None:
    w = torch.randn(12, 256, generator=torch.Generator().manual_seed(3))
    plain, mixed = _pair(Int8DotWeight, w, 32, half=True)
    offsets = torch.randn(12, 8, generator=torch.Generator().manual_seed(4))
    weights = [plain, mixed, AffineInt8Weight(plain, offsets), AffineInt8Weight(mixed, offsets)]
    digests = [_digest(weight) for weight in weights]
    assert digests[0] == digests[1] and digests[2] == digests[3]
    assert mixed.nbytes == plain.nbytes


@pytest.mark.parametrize("rows", [(6, 5, 9), (8, 4, 6)], ids=["groups-straddle-parts", "parts-whole-groups"])
def test_concatenated_interleaved_int8_parts_interleave_the_joined_rows(rows: tuple[int, ...]) -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(5)
    parts_w = [torch.randn(n, 128, generator=gen) for n in rows]
    parts = [Int8DotWeight.from_float(p, 32, interleave=True) for p in parts_w]
    joined = cat_rows(parts)
    assert isinstance(joined, Int8DotWeight) and joined.interleaved
    whole = Int8DotWeight.from_float(torch.cat(parts_w), 32, interleave=True)
    assert torch.equal(joined.qweight, whole.qweight)
    assert torch.equal(joined.qweight, interleave_rows(whole.plain_qweight()))
    x = torch.randn(3, 128, generator=gen)
    assert torch.equal(joined.matmul(x, None), whole.matmul(x, None))
