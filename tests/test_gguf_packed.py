"""GGUF quantized blocks executed in packed form (kvpager/model/gguf_packed.py): exact, per type.

The reference is gguf-py's own dequantizer (`gguf.quants.dequantize`), then a float64 matmul. The block
codes must decode to gguf-py's floats bit for bit; the packed linear (the C++ kernels up to their
batch limit, dequantize + GEMM beyond, AVX2 and portable paths) must equal x @ w.T to float32
rounding: |ours - ref| <= REL_TOL * sum_k |x_k w_k|, the magnitude float32 accumulation error scales
with (K = 512 terms at float32's 6e-8 unit round-off; the largest seen here 2.1e-7, REL_TOL 2e-6).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from kquants import ENCODERS

from kvpager.gguf.blocks import unpack_blocks
from kvpager.model.backends.quant_kernels import LEVEL_PORTABLE, quant_kernels_or_none
from kvpager.model.backends.quant_weights import Int4Weight, Int8Weight, PackedWeight
from kvpager.model.gguf_packed import AffineInt8Weight, RowStack, packed_from_blocks, stack_rows

TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
FORMATS = {
    "Q8_0": (Int8Weight, 32),
    "Q4_0": (Int4Weight, 32),
    "Q4_K": (Int4Weight, 32),
    "Q5_K": (AffineInt8Weight, 32),
    "Q6_K": (Int8Weight, 16),
}
HALF_SCALE_TYPES = ("Q8_0", "Q4_0")
REL_TOL = 2e-6
K = 512


def encode(values: np.ndarray, type_name: str) -> np.ndarray:
    if type_name in ENCODERS:
        return ENCODERS[type_name](values)[0]
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])


def reference(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(shape).copy())


def tensor(type_name: str, rows: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    values = np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32) * 0.05
    raw = encode(values, type_name)
    return raw, reference(raw, type_name, (rows, K))


def assert_matmul_exact(weight: PackedWeight, w_ref: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    got = weight.matmul(x, bias)
    ref = (x.double() @ w_ref.double().T) + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w_ref.double().abs().T + (0 if bias is None else bias.double().abs())
    err = ((got.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
    assert got.dtype == x.dtype and got.shape == ref.shape
    assert err <= REL_TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("type_name", TYPES)
def test_block_codes_decode_to_gguf_py_dequantize_bit_for_bit(type_name: str) -> None:
    raw, ref = tensor(type_name, 12, seed=1)
    blocks = unpack_blocks(type_name, raw, (12, K))
    assert np.array_equal(blocks.dequantize(), ref.numpy())
    packed = packed_from_blocks(blocks, type_name)
    cls, group = FORMATS[type_name]
    assert type(packed) is cls and packed.group_size == group
    assert torch.equal(packed.dequantize(), ref)  # the packed weight holds exactly these values
    if type_name in HALF_SCALE_TYPES:  # the file's float16 scales kept: the file's bytes per weight
        assert isinstance(packed, Int8Weight | Int4Weight) and packed.scales.dtype == torch.float16
        assert packed.nbytes == raw.nbytes


@pytest.mark.skipif(quant_kernels_or_none() is None, reason="the packed-weight C++ kernels do not build here")
@pytest.mark.parametrize("portable", [False, True], ids=["avx2", "portable"])
@pytest.mark.parametrize("type_name", TYPES)
def test_packed_gguf_linear_equals_dequantize_then_matmul(type_name: str, portable: bool) -> None:
    raw, w_ref = tensor(type_name, 40, seed=2)  # 40 rows: not a multiple of a kernel tile
    weight = packed_from_blocks(unpack_blocks(type_name, raw, (40, K)), type_name)
    weight.max_level = LEVEL_PORTABLE if portable else None
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(40, generator=gen)
    for rows in (1, 3, 16, 64):  # kernel path up to KERNEL_MAX_ROWS, dequantize + GEMM beyond
        x = torch.randn(rows, K, generator=gen)
        assert_matmul_exact(weight, w_ref, x, bias if rows % 2 else None)


@pytest.mark.skipif(quant_kernels_or_none() is None, reason="the packed-weight C++ kernels do not build here")
def test_fused_projection_of_mixed_types_runs_each_part_in_its_own_format() -> None:
    """q/k in Q4_K and v in Q6_K (a Q4_K_M file): q and k merge into one int4 weight, v stays int8 g16."""
    parts = [tensor(t, rows, seed=i) for i, (t, rows) in enumerate([("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16)])]
    types = ("Q4_K", "Q4_K", "Q6_K")
    packed = [
        packed_from_blocks(unpack_blocks(t, raw, tuple(ref.shape)), t)
        for t, (raw, ref) in zip(types, parts, strict=True)
    ]
    fused = stack_rows(packed)
    assert isinstance(fused, RowStack) and [type(p) for p in fused.parts] == [Int4Weight, Int8Weight]
    assert fused.parts[0].out_features == 48
    w_ref = torch.cat([ref for _, ref in parts])
    assert torch.equal(fused.dequantize(), w_ref)
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 5, 33):
        assert_matmul_exact(fused, w_ref, torch.randn(rows, K, generator=gen), torch.randn(64, generator=gen))
    q5 = [tensor("Q5_K", rows, seed) for rows, seed in ((8, 5), (24, 6))]
    merged = stack_rows([packed_from_blocks(unpack_blocks("Q5_K", raw, tuple(ref.shape)), "Q5_K") for raw, ref in q5])
    assert isinstance(merged, AffineInt8Weight) and merged.out_features == 32
    assert torch.equal(merged.dequantize(), torch.cat([ref for _, ref in q5]))


def test_bfloat16_activations_go_through_the_packed_matmul_in_float32() -> None:
    raw, w_ref = tensor("Q5_K", 16, seed=7)
    weight = packed_from_blocks(unpack_blocks("Q5_K", raw, (16, K)), "Q5_K")
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    got = weight.matmul(x, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (x.float() @ w_ref.T).to(torch.bfloat16).float(), atol=0, rtol=1e-2)
