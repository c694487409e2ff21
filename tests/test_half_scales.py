"""float16 scales (GGUF Q8_0 / Q4_0 keep the file's): every kernel path reads them as the float32 values
they widen to, so a weight with float16 scales gives the bits of the same weight holding those values
as float32 scales, in fewer bytes.

Both weights run the same kernel code with the same operation order; only the load of a scale differs
(F16C's vcvtph2ps / the bit layout in the portable build, both exact), so the outputs are equal, not
merely close. Covered: the exact kernels (1-2 rows in registers, the L1 tile, dequantize + GEMM past
KERNEL_MAX_ROWS) and the integer-dot kernels (w8a8 / w4a8: GGUF's --gguf-int8-activations), at group 32
(one scale per block, the GGUF forms) and 64, with N not a multiple of a tile and K not of a block.
"""

from __future__ import annotations

import pytest
import torch

from kvpager.model.backends.kernels.build import KernelBuildError
from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight
from kvpager.model.backends.quant_kernels import (
    FMT_HALF_SCALES,
    LEVEL_AVX2,
    LEVEL_AVX512,
    LEVEL_PORTABLE,
    load_quant_kernels,
)
from kvpager.model.backends.quant_weights import KERNEL_MAX_ROWS, Int4Weight, Int8Weight, PackedWeight, cat_rows

LEVELS = {"avx512": LEVEL_AVX512, "avx2": LEVEL_AVX2, "portable": LEVEL_PORTABLE}
BATCHES = [1, 2, 3, 5, 16, 64, KERNEL_MAX_ROWS + 1]
SHAPES = [(37, 100), (22, 256)]  # (N, K)


def _level_or_skip(name: str) -> int:
    try:
        kernels = load_quant_kernels()
    except KernelBuildError as exc:  # pragma: no cover - every CI machine has g++
        pytest.skip(f"no C++ compiler for the packed-weight kernels: {exc}")
    if kernels.level(LEVELS[name]) != LEVELS[name]:
        pytest.skip(f"this CPU has no {name} path (it runs the next path down, tested under its own name)")
    return LEVELS[name]


def _scales(n: int, k: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """float16 scales over several binades, a zero and a float16 subnormal among them."""
    s = (torch.rand(n, -(-k // group), generator=gen) * 4 - 2).exp2() * 0.01
    s[0, 0], s[-1, -1] = 0.0, 2.0**-20
    return s.to(torch.float16)


def _pair(kind: str, n: int, k: int, group: int, gen: torch.Generator) -> tuple[PackedWeight, PackedWeight]:
    """(float16 scales, float32 scales of the same values) for one weight format."""
    half = _scales(n, k, group, gen)
    if kind in ("int8", "w8a8_int8"):
        cls8 = Int8Weight if kind == "int8" else Int8DotWeight
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return cls8(q, half, group), cls8(q, half.float(), group)
    cls4 = Int4Weight if kind.startswith("int4") else Int4DotWeight
    codes = torch.randint(0, 16, (n, k), generator=gen)
    offsets = None if kind.endswith("symmetric") else torch.randn(half.shape, generator=gen) * 0.01
    return cls4.from_codes(codes, half, offsets, group), cls4.from_codes(codes, half.float(), offsets, group)


KINDS = ["int8", "int4", "int4_symmetric", "w8a8_int8", "w4a8_int8", "w4a8_int8_symmetric"]


@pytest.mark.parametrize("isa", list(LEVELS))
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_float16_scales_give_the_bits_of_their_float32_values(
    kind: str, group: int, shape: tuple[int, int], isa: str
) -> None:
    level = _level_or_skip(isa)
    gen = torch.Generator().manual_seed(KINDS.index(kind) * 10 + group + shape[0])
    n, k = shape
    half, full = _pair(kind, n, k, group, gen)
    assert half.kernel_fmt() == full.kernel_fmt() | FMT_HALF_SCALES and not full.kernel_fmt() & FMT_HALF_SCALES
    assert torch.equal(half.dequantize(), full.dequantize())
    assert full.nbytes - half.nbytes == 2 * n * -(-k // group)
    half.max_level = full.max_level = level
    bias = torch.randn(n, generator=gen)
    for rows in BATCHES:
        x = torch.randn(rows, k, generator=gen)
        b = bias if rows % 2 else None
        assert torch.equal(half.matmul(x, b), full.matmul(x, b)), rows


def test_joined_parts_keep_float16_scales_only_when_every_part_has_them() -> None:
    gen = torch.Generator().manual_seed(3)
    a, a32 = _pair("int4_symmetric", 8, 64, 32, gen)
    b, _ = _pair("int4_symmetric", 4, 64, 32, gen)
    both = cat_rows([a, b])
    mixed = cat_rows([a32, b])
    assert isinstance(both, Int4Weight) and both.scales.dtype == torch.float16
    assert isinstance(mixed, Int4Weight) and mixed.scales.dtype == torch.float32
    assert torch.equal(both.dequantize(), mixed.dequantize())
