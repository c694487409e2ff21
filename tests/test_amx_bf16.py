"""bfloat16 batches in the AMX tile kernel (kernels/amx_bf16.cpp) and the choice between it and oneDNN.

The kernel rounds the activations to bfloat16 and sums their products with the bfloat16 weight in
float32, so it is held to the bfloat16-input product computed in float64 within float32 summation
rounding (2 K 2^-24 sum_k |x_k w_k|, elementwise); a wrong tile, pair or row is off by far more. The
kernel tests need a CPU with AMX-BF16 and skip elsewhere with that reason; the path choice is tested
on any CPU with a stand-in kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from amx_checks import amx_or_skip, kernels_or_skip

from kvpager.model.backends import quant_weights
from kvpager.model.backends.quant_kernels import LEVEL_AVX2
from kvpager.model.backends.quant_weights import AMX_MAX_ROWS, NATIVE_BF16_AFTER_ROWS, Bf16Weight


def _no_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the oneDNN fallback fail loudly, so a passing result came from the tile kernel."""

    def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("oneDNN's F.linear ran where the AMX kernel should have")

    monkeypatch.setattr(quant_weights.F, "linear", refuse)


def _assert_bf16_inputs_float32_sums(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    xb, wd = x.bfloat16().double(), w.double()
    ref = xb @ wd.t()
    bound = 2 * w.shape[1] * 2.0**-24 * (xb.abs() @ wd.abs().t()) + 1e-30
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"off by more than float32 summation rounding ({excess:.3e} over the bound)"


@pytest.mark.parametrize("shape", [(32, 32), (96, 256), (64, 8192)], ids=["32x32", "96x256", "64x8192"])
def test_amx_tiles_sum_bfloat16_inputs_in_float32(shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    amx_or_skip()
    _no_onednn(monkeypatch)
    gen = torch.Generator().manual_seed(shape[0] + shape[1])
    n, k = shape
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    weight = Bf16Weight(w)
    # 3: the first rows past the register kernel; 15-17 / 32-33: one or two 16-row tiles, part-filled;
    # up to AMX_MAX_ROWS: several pairs of tiles and an odd one at the end
    for rows in (NATIVE_BF16_AFTER_ROWS + 1, 15, 16, 17, 32, 33, 100, AMX_MAX_ROWS):
        x = torch.randn(rows, k, generator=gen)
        out = weight.matmul(x, None)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        _assert_bf16_inputs_float32_sums(out, x, w)


def test_amx_bias_is_added_in_float32_after_the_product(monkeypatch: pytest.MonkeyPatch) -> None:
    amx_or_skip()
    _no_onednn(monkeypatch)
    w = torch.randn(64, 96).bfloat16()
    bias, x = torch.randn(64), torch.randn(5, 96)
    weight = Bf16Weight(w)
    assert torch.equal(weight.matmul(x, bias), weight.matmul(x, None) + bias)


def test_amx_rounds_activations_as_torch_does_ties_nan_and_infinities_included(monkeypatch: pytest.MonkeyPatch) -> None:
    amx_or_skip()
    _no_onednn(monkeypatch)
    # an identity weight returns each activation rounded to bfloat16 (one product, the rest exact zeros)
    k = 64
    eye = torch.eye(k).bfloat16()
    x = torch.randn(4, k) * 1e3
    x[0, :8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-100, 3.0e38, 1 + 2**-9, 1 - 2**-10, 0.0])
    # NaNs whose payload would carry into the exponent or sign when rounded: still NaN, as torch's
    nans = torch.tensor([0x7FFFFFFF, 0x7F800001, -1], dtype=torch.int32).view(torch.float32)
    x[1, 5], x[1, 6] = nans[0], nans[1]
    x[2, 3] = nans[2]
    x[2, 7] = float("inf")
    x[3, 9] = float("-inf")
    out = Bf16Weight(eye).matmul(x, None)
    ref = x.bfloat16().double() @ eye.double().t()  # NaN / inf times the zeros: NaN across those rows
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out[0, :3], torch.tensor([1.0, 1 + 2**-6, -1.0]))  # ties to even


def test_amx_rows_do_not_depend_on_the_rest_of_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    amx_or_skip()
    _no_onednn(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    weight = Bf16Weight(torch.randn(96, 512, generator=gen).bfloat16())
    x = torch.randn(70, 512, generator=gen)
    full = weight.matmul(x, None)
    for lo, hi in ((0, 3), (10, 13), (16, 48), (60, 70)):
        assert torch.equal(weight.matmul(x[lo:hi], None), full[lo:hi]), (lo, hi)


def test_the_kernel_refuses_what_its_tiles_cannot_take_without_writing() -> None:
    kernels = kernels_or_skip()
    x = torch.randn(4, 64)
    w = torch.randn(64, 64).bfloat16()
    for m, n, k in ((4, 48, 64), (4, 64, 48), (0, 64, 64), (4, 16, 64)):
        out = torch.full((4, 64), 7.0)
        done = kernels.amx_bf16_linear(x.data_ptr(), m, w.data_ptr(), n, k, out.data_ptr(), 1)
        assert done == -1 and bool((out == 7.0).all()), (m, n, k)
    out = torch.empty(4, 64)  # NOTE: held while the kernel writes it
    done = kernels.amx_bf16_linear(x.data_ptr(), 4, w.data_ptr(), 64, 64, out.data_ptr(), 1)
    assert done == (0 if kernels.amx_bf16 else -1)


def _fake_amx(monkeypatch: pytest.MonkeyPatch, result: int) -> list[tuple[int, int, int]]:
    """Kernels whose AMX entry is a recorder that refuses (`result` -1) or claims success (0, leaving
    `out` as allocated: only the calls are checked); _native_bf16 on, so the choice runs on any CPU."""
    calls: list[tuple[int, int, int]] = []

    def amx(x: int, m: int, w: int, n: int, k: int, out: int, threads: int) -> int:
        calls.append((m, n, k))
        return result

    kernels = dataclasses.replace(kernels_or_skip(), amx_bf16=True, amx_bf16_linear=amx)
    monkeypatch.setattr(quant_weights, "quant_kernels_or_none", lambda: kernels)
    monkeypatch.setattr(quant_weights, "load_quant_kernels", lambda: kernels)
    monkeypatch.setattr(quant_weights, "_native_bf16", lambda: True)
    return calls


def test_batches_past_the_register_kernel_and_up_to_the_limit_take_the_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_amx(monkeypatch, 0)
    weight = Bf16Weight(torch.randn(64, 96).bfloat16())
    for rows in (NATIVE_BF16_AFTER_ROWS + 1, AMX_MAX_ROWS):
        weight.matmul(torch.randn(rows, 96), None)
    assert calls == [(NATIVE_BF16_AFTER_ROWS + 1, 64, 96), (AMX_MAX_ROWS, 64, 96)]


def test_onednn_takes_what_the_tiles_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_amx(monkeypatch, 0)
    x = torch.randn(8, 96)
    Bf16Weight(torch.randn(48, 96).bfloat16()).matmul(x, None)  # N not whole tiles
    Bf16Weight(torch.randn(64, 48).bfloat16()).matmul(torch.randn(8, 48), None)  # K not whole tiles
    Bf16Weight(torch.randn(64, 96).bfloat16()).matmul(torch.randn(AMX_MAX_ROWS + 1, 96), None)  # prefill-sized
    capped = Bf16Weight(torch.randn(64, 96).bfloat16())
    capped.max_level = LEVEL_AVX2  # a cap below AVX-512 (tests, $KVPAGER_KERNEL_ISA=portable) turns AMX off
    capped.matmul(x, None)
    assert calls == []


def test_a_refused_batch_is_computed_by_onednn_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(64, 96).bfloat16()
    bias, x = torch.randn(64), torch.randn(5, 96)
    expected = torch.nn.functional.linear(x.bfloat16(), w).float() + bias
    calls = _fake_amx(monkeypatch, -1)
    out = Bf16Weight(w).matmul(x, bias)
    assert calls == [(5, 64, 96)] and torch.equal(out, expected)


def test_the_start_up_line_says_whether_the_tiles_run(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = kernels_or_skip()
    monkeypatch.delenv("KVPAGER_KERNEL_ISA", raising=False)
    absent = dataclasses.replace(kernels, amx_bf16=False).describe_amx()
    assert absent.startswith("no AMX bfloat16 tiles")
    present = dataclasses.replace(kernels, amx_bf16=True)
    if kernels.default_level == quant_weights.LEVEL_AVX512:
        assert present.describe_amx().startswith("AMX bfloat16 tiles reading the plain weight")
        assert present.describe_amx().endswith("quantized prompts on weight rows dequantized in cache")
    monkeypatch.setenv("KVPAGER_KERNEL_ISA", "portable")
    assert "KVPAGER_KERNEL_ISA=portable" in present.describe_amx()


def test_amx_tiles_and_onednn_interleave_in_the_same_threads() -> None:
    # both configure the tiles per call; a prompt in oneDNN between decode steps in the kernel (a server's
    # steps) must leave each correct
    amx_or_skip()
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(256, 512, generator=gen) * 0.05).bfloat16()
    weight = Bf16Weight(w)
    small, large = torch.randn(8, 512, generator=gen), torch.randn(AMX_MAX_ROWS + 64, 512, generator=gen)
    onednn_ref = torch.nn.functional.linear(large.bfloat16(), w).float()
    for _ in range(3):
        _assert_bf16_inputs_float32_sums(weight.matmul(small, None), small, w)
        assert torch.equal(weight.matmul(large, None), onednn_ref)  # past AMX_MAX_ROWS: oneDNN's GEMM
