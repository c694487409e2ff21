"""Prompt batches of packed weights in AMX tiles on the weight dequantized in cache (kvq_amx_dequant_linear).

Each thread dequantizes the 32 weight rows it multiplies next (kvq_dequant_bf16's values, rounded to
bfloat16) and runs the AMX bfloat16 tile kernel on them, so its result is held two ways: bit for bit the
tile kernel (kvq_amx_bf16_linear) on the weight dequantized whole, and, like that kernel, the product of
x rounded to bfloat16 with dequantize(torch.bfloat16) computed in float64, within float32 summation
rounding (2 K 2^-24 sum_k |x_k w_k|, elementwise; no rounding of the result). The kernel tests need a CPU
with AMX-BF16 and skip elsewhere with that reason; the choice of path is tested on any CPU with a
stand-in kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from amx_checks import amx_or_skip, kernels_or_skip
from kquants import encode_q4_k, encode_q6_k

from kvpager.gguf.blocks import unpack_blocks
from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight, _DynamicActivations
from kvpager.model.backends.quant_kernels import LEVEL_AVX2, QuantKernels
from kvpager.model.backends.quant_weights import AMX_DEQUANT_MAX_ROWS, PackedWeight
from kvpager.model.gguf_packed import packed_from_blocks


def _gguf(kind: str, rows: int, cols: int, seed: int) -> PackedWeight:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    encode = {"Q4_K": encode_q4_k, "Q6_K": encode_q6_k}[kind]
    return packed_from_blocks(unpack_blocks(kind, encode(values)[0], (rows, cols)), kind, int8_activations=True)


def _dense(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


# every packed form a prompt of a GGUF file or --quantization w4a8_int8 / w8a8_int8 multiplies
FORMATS: dict[str, Callable[[int, int, int], PackedWeight]] = {
    "int4_g32": lambda n, k, s: Int4DotWeight.from_float(_dense(n, k, s), 32),
    "int4_g128": lambda n, k, s: Int4DotWeight.from_float(_dense(n, k, s), 128),
    "int4_g32_plain": lambda n, k, s: Int4DotWeight.from_float(_dense(n, k, s), 32, interleave=False),
    "int8_g32": lambda n, k, s: Int8DotWeight.from_float(_dense(n, k, s), 32),
    "int8_channel": lambda n, k, s: Int8DotWeight.from_float(_dense(n, k, s)),
    "Q4_K": lambda n, k, s: _gguf("Q4_K", n, k, s),
    "Q6_K": lambda n, k, s: _gguf("Q6_K", n, k, s),
}


def _whole_weight_tiles(weight: PackedWeight, x: torch.Tensor, kernels: QuantKernels) -> torch.Tensor:
    """The AMX tile kernel on the weight dequantized whole to bfloat16 (the fused kernel's operands)."""
    wb = weight.dequantize(torch.bfloat16).contiguous()
    out = torch.empty((x.shape[0], weight.out_features), dtype=torch.float32)
    assert kernels.amx_bf16_linear(x.data_ptr(), x.shape[0], wb.data_ptr(), *wb.shape, out.data_ptr(), 2) == 0
    return out


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 33, 300, AMX_DEQUANT_MAX_ROWS])
def test_tiles_on_rows_dequantized_in_cache_are_the_whole_weights_tiles(fmt: str, rows: int) -> None:
    kernels = amx_or_skip()
    weight = FORMATS[fmt](96, 512, rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows + 1)) * 3
    out = weight.tiled_bf16_matmul(x, None, kernels)
    assert out is not None and out.shape == (rows, 96) and out.dtype == torch.float32
    assert torch.equal(out, _whole_weight_tiles(weight, x, kernels))
    # the reference: bfloat16 inputs, the dequantized weight, summed in float64; float32 summation rounding
    xb, wd = x.bfloat16().double(), weight.dequantize(torch.bfloat16).double()
    ref = xb @ wd.t()
    bound = 2 * 512 * 2.0**-24 * (xb.abs() @ wd.abs().t()) + 1e-30
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"off by more than float32 summation rounding ({excess:.3e} over the bound)"


def test_the_bias_is_added_in_float32_after_the_product() -> None:
    kernels = amx_or_skip()
    weight = FORMATS["Q4_K"](64, 256, 3)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(64, generator=torch.Generator().manual_seed(5))
    out = weight.tiled_bf16_matmul(x, bias, kernels)
    assert out is not None
    assert torch.equal(out, _whole_weight_tiles(weight, x, kernels) + bias)


@pytest.mark.parametrize(("n", "k"), [(80, 256), (64, 200)], ids=["N not whole tiles", "K not whole tiles"])
def test_shapes_outside_whole_tiles_are_declined_without_running_the_kernel(n: int, k: int) -> None:
    kernels = kernels_or_skip()
    ran: list[int] = []
    spy = dataclasses.replace(kernels, amx_bf16=True, amx_dequant_linear=lambda *a: ran.append(1) or 0)
    weight = Int8DotWeight.from_float(_dense(n, k, 7), k)
    assert weight.tiled_bf16_matmul(torch.randn(70, k), None, spy) is None
    assert ran == []


def test_without_amx_or_below_avx512_the_tiles_are_not_asked() -> None:
    kernels = kernels_or_skip()
    ran: list[int] = []
    weight = Int4DotWeight.from_float(_dense(64, 256, 8), 32)
    no_amx = dataclasses.replace(kernels, amx_bf16=False, amx_dequant_linear=lambda *a: ran.append(1) or 0)
    assert weight.tiled_bf16_matmul(torch.randn(70, 256), None, no_amx) is None
    capped = dataclasses.replace(no_amx, amx_bf16=True)
    weight.max_level = LEVEL_AVX2
    assert weight.tiled_bf16_matmul(torch.randn(70, 256), None, capped) is None
    assert ran == []


def _path_spy(monkeypatch: pytest.MonkeyPatch, tiled_result: bool) -> dict[str, int]:
    """Count which prompt path runs; the tile kernel stands in (declining where `tiled_result` is False)."""
    calls = {"tiled": 0, "bf16_matmul": 0}

    def tiled(self: PackedWeight, x2: torch.Tensor, bias: Any, kernels: Any) -> torch.Tensor | None:
        calls["tiled"] += 1
        return torch.zeros(x2.shape[0], self.out_features) if tiled_result else None

    def gemm(self: PackedWeight, x2: torch.Tensor, bias: Any) -> torch.Tensor:
        calls["bf16_matmul"] += 1
        return torch.ones(x2.shape[0], self.out_features)

    monkeypatch.setattr(PackedWeight, "tiled_bf16_matmul", tiled)
    monkeypatch.setattr(Int4DotWeight, "bf16_matmul", gemm)
    monkeypatch.setattr(_DynamicActivations, "dot_rows", lambda self, kernels: 16)
    monkeypatch.setattr(_DynamicActivations, "bf16_prompts", lambda self, kernels: True)
    return calls


def test_prompts_up_to_the_limit_take_the_tiles_and_larger_ones_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels_or_skip()
    calls = _path_spy(monkeypatch, tiled_result=True)
    weight = Int4DotWeight.from_float(_dense(64, 256, 9), 32)
    assert torch.equal(
        weight.matmul(torch.randn(AMX_DEQUANT_MAX_ROWS, 256), None), torch.zeros(AMX_DEQUANT_MAX_ROWS, 64)
    )
    assert calls == {"tiled": 1, "bf16_matmul": 0}
    assert torch.equal(
        weight.matmul(torch.randn(AMX_DEQUANT_MAX_ROWS + 1, 256), None), torch.ones(AMX_DEQUANT_MAX_ROWS + 1, 64)
    )
    assert calls == {"tiled": 1, "bf16_matmul": 1}


def test_a_declined_prompt_falls_back_to_onednns_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels_or_skip()
    calls = _path_spy(monkeypatch, tiled_result=False)
    weight = Int4DotWeight.from_float(_dense(64, 256, 10), 32)
    assert torch.equal(weight.matmul(torch.randn(40, 256), None), torch.ones(40, 64))
    assert calls == {"tiled": 1, "bf16_matmul": 1}
