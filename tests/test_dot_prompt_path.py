"""Where the integer dot takes every batch (AVX-512 VNNI), prompts over KERNEL_MAX_ROWS rows go to the
exact path's dequantize + GEMM when a load-time measurement found it faster (dot_prompt_path.py).

The choice only moves rows between two paths computing the same quantized activations times the same
dequantized weight, so both are held to the same reference; what is pinned here is which path runs,
which weights the choice reaches (GGUF row stacks and affine wrappers included), that small weights
are never timed (a test model's results never depend on a measurement) and the log line."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvpager.model.backends import dot_prompt_path, quant_dot
from kvpager.model.backends.dot_prompt_path import choose_prompt_paths, dynamic_weights, gemm_is_faster, measure
from kvpager.model.backends.kernels.build import KernelBuildError
from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight, reference_matmul
from kvpager.model.backends.quant_kernels import load_quant_kernels
from kvpager.model.backends.quant_weights import KERNEL_MAX_ROWS
from kvpager.model.gguf_packed import AffineInt8Weight, RowStack


@pytest.fixture(autouse=True)
def kernels() -> None:
    try:
        load_quant_kernels()
    except KernelBuildError as exc:  # pragma: no cover - every CI machine has g++
        pytest.skip(f"no C++ compiler for the packed-weight kernels: {exc}")


@pytest.fixture
def every_batch_on_the_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The VNNI rule on any CPU: the integer dot takes every batch unless `prompt_rows` says otherwise."""
    monkeypatch.setattr(quant_dot, "dot_kernel_max_rows", lambda *_: None)


def counting(monkeypatch: pytest.MonkeyPatch, weight: Any) -> dict[str, int]:
    calls = {"dot": 0, "exact": 0}
    dot, exact = weight.dot_kernel, weight.exact_matmul

    def on_dot(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["dot"] += 1
        return dot(*args, **kwargs)

    def on_exact(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["exact"] += 1
        return exact(*args, **kwargs)

    monkeypatch.setattr(weight, "dot_kernel", on_dot)
    monkeypatch.setattr(weight, "exact_matmul", on_exact)
    return calls


def test_the_gemm_path_must_win_by_the_margin() -> None:
    assert gemm_is_faster(dot_s=1.0, gemm_s=0.8)
    assert not gemm_is_faster(dot_s=1.0, gemm_s=0.9)  # a near tie keeps the integer dot
    assert not gemm_is_faster(dot_s=0.5, gemm_s=1.0)


@pytest.mark.usefixtures("every_batch_on_the_dot")
@pytest.mark.parametrize("make", [lambda w: Int4DotWeight.from_float(w, 32), lambda w: Int8DotWeight.from_float(w)])
def test_prompt_rows_send_larger_batches_to_the_exact_path_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch, make: Any
) -> None:
    weight = make(torch.randn(40, 96, generator=torch.Generator().manual_seed(1)))
    calls = counting(monkeypatch, weight)
    x = torch.randn(KERNEL_MAX_ROWS + 1, 96, generator=torch.Generator().manual_seed(2))
    weight.matmul(x, None)
    assert calls == {"dot": 1, "exact": 0}, "without a measurement the integer dot takes every batch"
    weight.prompt_rows = KERNEL_MAX_ROWS
    results = {rows: weight.matmul(x[:rows], None) for rows in (KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1)}
    assert calls == {"dot": 2, "exact": 1}, "128 rows on the integer dot, 129 on the exact path"
    for rows, out in results.items():
        ref = reference_matmul(weight, x[:rows]).float()
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4), rows


def test_the_measurement_reaches_every_weight_of_the_format_it_timed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, every_batch_on_the_dot: None
) -> None:
    gen = torch.Generator().manual_seed(3)
    int4 = [Int4DotWeight.from_float(torch.randn(n, 64, generator=gen), 32) for n in (8, 24, 16)]
    int8 = Int8DotWeight.from_float(torch.randn(32, 64, generator=gen), 32)
    affine = AffineInt8Weight(Int8DotWeight.from_float(torch.randn(8, 64, generator=gen), 32), torch.zeros(8, 2))
    weights = [RowStack([int4[0], int8]), int4[1], affine, int4[2]]
    assert {id(w) for w in dynamic_weights(weights)} == {id(w) for w in [*int4, int8, affine.inner]}
    timed: list[tuple[int, int]] = []

    def fake_measure(weight: Any, rows: int = 0) -> tuple[float, float]:
        timed.append(weight.shape)
        return (2.0, 1.0) if isinstance(weight, Int4DotWeight) else (1.0, 1.0)  # GEMM wins for int4 only

    monkeypatch.setattr(dot_prompt_path, "measure", fake_measure)
    assert choose_prompt_paths(weights) == [], "weights under MIN_WEIGHTS are never timed"
    assert timed == [] and all(w.prompt_rows is None for w in dynamic_weights(weights))
    with caplog.at_level("INFO", logger="kvpager.kernels"):
        choices = choose_prompt_paths(weights, min_weights=0)
    assert sorted(timed) == [(24, 64), (32, 64)], "each format's largest weight, once"
    assert [(c.weight_format, c.gemm_wins) for c in choices] == [("int4", True), ("int8", False)]
    assert all(w.prompt_rows == KERNEL_MAX_ROWS for w in int4)
    assert int8.prompt_rows is None and affine.inner.prompt_rows is None
    assert "integer-dot int4 prompts" in caplog.text and "take the GEMM path" in caplog.text
    assert "integer-dot int8 prompts" in caplog.text and "take the integer dot" in caplog.text


def test_a_weight_the_rule_already_limits_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_dot, "dot_kernel_max_rows", lambda *_: 4)  # e.g. an AVX2-only integer dot
    monkeypatch.setattr(dot_prompt_path, "measure", lambda *_: pytest.fail("timed a limited weight"))
    weight = Int4DotWeight.from_float(torch.randn(8, 64), 32)
    assert choose_prompt_paths([weight], min_weights=0) == [] and weight.prompt_rows is None


def test_measure_times_both_paths() -> None:
    dot_s, gemm_s = measure(Int4DotWeight.from_float(torch.randn(16, 64), 32), rows=8)
    assert 0 < dot_s < 10 and 0 < gemm_s < 10
