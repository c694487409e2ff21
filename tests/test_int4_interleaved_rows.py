"""int4 rows stored interleaved four at a time (kernels/int4_rows.h): the same codes, the same results.

The interleaved layout only changes where a row's bytes lie, so every kernel path (the integer dot, the
exact tiles, the GEMM's dequantize, the portable fallback) must give the same bits as the plain layout
for the same weight; the digest, the codes and concatenation must not see the layout at all.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest
import torch
from symmetric_int4 import symmetric_int4

from kvpager.model.backends.kernels.build import KernelBuildError
from kvpager.model.backends.quant_dot import Int4DotWeight
from kvpager.model.backends.quant_kernels import (
    FMT_ROWS4,
    LEVEL_AVX2,
    LEVEL_PORTABLE,
    load_quant_kernels,
)
from kvpager.model.backends.quant_weights import Int4Weight, PackedWeight, cat_rows, interleave_rows, plain_rows

# input rows through each path: the integer dot (few rows), the exact tile (up to 128), the GEMM beyond
BATCHES = [1, 2, 3, 5, 33, 200]
LEVELS = [None, LEVEL_AVX2, LEVEL_PORTABLE]


def _kernels_or_skip() -> None:
    try:
        load_quant_kernels()
    except KernelBuildError as exc:  # pragma: no cover - every CI machine has g++
        pytest.skip(f"no C++ compiler for the packed-weight kernels: {exc}")


def _byte_at(rows: int, row_bytes: int, n: int, o: int) -> int:
    """int4_rows.h's byte_at, written out: chunk o // 32 of row n = 4i + j at 4i * row_bytes + 128c + 32j."""
    whole = rows // 4 * 4
    if n >= whole:
        return n * row_bytes + o
    i, j, c = n // 4, n % 4, o // 32
    return 4 * i * row_bytes + 128 * c + 32 * j + o % 32


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 11])
def test_interleaved_rows_put_each_byte_where_the_kernels_read_it_and_plain_rows_undoes_it(rows: int) -> None:
    row_bytes = 96
    plain = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    mixed = interleave_rows(plain)
    assert mixed.shape == plain.shape
    flat = mixed.flatten()
    for n, o in itertools.product(range(rows), range(row_bytes)):
        assert flat[_byte_at(rows, row_bytes, n, o)] == plain[n, o]
    assert torch.equal(plain_rows(mixed), plain)


@pytest.mark.parametrize(("rows", "in_features"), [(3, 256), (8, 96), (8, 200), (2, 64)])
def test_weights_whose_rows_are_not_whole_chunks_or_a_group_stay_plain(rows: int, in_features: int) -> None:
    w = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    weight = Int4Weight.from_float(w, 32, interleave=True)
    assert not weight.interleaved
    assert weight.kernel_fmt() & FMT_ROWS4 == 0
    assert torch.equal(weight.packed, Int4Weight.from_float(w, 32).packed)


def _pair(cls: type[Int4Weight], w: torch.Tensor, group: int, form: str) -> tuple[Int4Weight, Int4Weight]:
    """The same weight plain and interleaved; form: asymmetric, symmetric (Q4_0), half (float16 scales)."""
    if form == "symmetric":
        plain = symmetric_int4(cls, w, group)
    else:
        plain = cls.from_float(w, group, interleave=False)
    scales = plain.scales.half() if form == "half" else plain.scales
    plain = cls(plain.plain_packed(), scales, plain.offsets, group, plain.in_features, interleave=False)
    mixed = cls(plain.plain_packed(), scales, plain.offsets, group, plain.in_features, interleave=True)
    return plain, mixed


@pytest.mark.parametrize("cls", [Int4Weight, Int4DotWeight], ids=["exact", "dot"])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group"),
    [(4, 64, 32), (7, 128, 64), (33, 192, 96), (64, 256, 128), (200, 128, 32)],
)
@pytest.mark.parametrize("form", ["asymmetric", "symmetric", "half"])
def test_interleaved_int4_gives_the_plain_layouts_bits_on_every_path(
    cls: type[Int4Weight], out_features: int, in_features: int, group: int, form: str
) -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(out_features * in_features + group)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    plain, mixed = _pair(cls, w, group, form)
    assert mixed.interleaved and not plain.interleaved
    if in_features > 64:  # rows of more than one 32-byte chunk really are stored another way
        assert not torch.equal(mixed.packed, plain.packed)
    assert torch.equal(mixed.codes(), plain.codes())
    assert torch.equal(mixed.dequantize(), plain.dequantize())
    bias = torch.randn(out_features, generator=gen)
    for level in LEVELS:
        plain.max_level = mixed.max_level = level
        for batch in BATCHES:
            x = torch.randn(batch, in_features, generator=gen)
            for b in (None, bias):
                assert torch.equal(mixed.matmul(x, b), plain.matmul(x, b)), (level, batch, b is None)


def _digest(weight: PackedWeight) -> str:
    """What a weight commits to a KV fingerprint (update_digest), as hex."""
    h = hashlib.sha256()
    weight.update_digest(h)
    return h.hexdigest()


def test_the_digest_and_stored_size_do_not_depend_on_the_layout() -> None:
    w = torch.randn(12, 256, generator=torch.Generator().manual_seed(3))
    plain, mixed = Int4Weight.from_float(w, 64, interleave=False), Int4Weight.from_float(w, 64, interleave=True)
    assert mixed.interleaved
    assert _digest(plain) == _digest(mixed)
    assert mixed.nbytes == plain.nbytes


@pytest.mark.parametrize("rows", [(6, 5, 9), (8, 4, 6)], ids=["groups-straddle-parts", "parts-whole-groups"])
def test_concatenated_interleaved_parts_interleave_the_joined_rows(rows: tuple[int, ...]) -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(5)
    parts_w = [torch.randn(n, 128, generator=gen) for n in rows]
    parts = [Int4DotWeight.from_float(p, 32) for p in parts_w]
    joined = cat_rows(parts)
    assert isinstance(joined, Int4DotWeight) and joined.interleaved
    whole = Int4DotWeight.from_float(torch.cat(parts_w), 32)
    assert torch.equal(joined.packed, whole.packed)
    x = torch.randn(3, 128, generator=gen)
    assert torch.equal(joined.matmul(x, None), whole.matmul(x, None))
