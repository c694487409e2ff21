"""Where the integer dot takes every batch (AVX-512 VNNI), prompts over KERNEL_MAX_ROWS rows go to the
exact path's dequantize + GEMM on Intel CPUs (a fixed rule per vendor, dot_prompt_path.py).

The rule only moves rows between two paths computing the same quantized activations times the same
dequantized weight, so both are held to the same reference; what is pinned here is which path runs,
which weights the rule reaches (GGUF row stacks and affine wrappers included), the vendor parsing and
the log line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpager.model.backends import quant_dot
from kvpager.model.backends.dot_prompt_path import cpu_vendor, dynamic_weights, prompt_rows_for, route_prompts
from kvpager.model.backends.kernels.build import KernelBuildError
from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight, reference_matmul
from kvpager.model.backends.quant_kernels import load_quant_kernels
from kvpager.model.backends.quant_weights import KERNEL_MAX_ROWS, Int4Weight
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


def test_the_vendor_decides_and_is_read_from_cpuinfo(tmp_path: Path) -> None:
    assert prompt_rows_for("GenuineIntel") == KERNEL_MAX_ROWS
    assert prompt_rows_for("AuthenticAMD") is None and prompt_rows_for(None) is None
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n")
    assert cpu_vendor(cpuinfo) == "AuthenticAMD"
    cpuinfo.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")  # an Arm machine names no vendor_id
    assert cpu_vendor(cpuinfo) is None
    assert cpu_vendor(tmp_path / "missing") is None


@pytest.mark.usefixtures("every_batch_on_the_dot")
@pytest.mark.parametrize("make", [lambda w: Int4DotWeight.from_float(w, 32), lambda w: Int8DotWeight.from_float(w)])
def test_prompt_rows_send_larger_batches_to_the_exact_path_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch, make: Any
) -> None:
    weight = make(torch.randn(40, 96, generator=torch.Generator().manual_seed(1)))
    calls = counting(monkeypatch, weight)
    x = torch.randn(KERNEL_MAX_ROWS + 1, 96, generator=torch.Generator().manual_seed(2))
    weight.matmul(x, None)
    assert calls == {"dot": 1, "exact": 0}, "without the rule the integer dot takes every batch"
    weight.prompt_rows = KERNEL_MAX_ROWS
    results = {rows: weight.matmul(x[:rows], None) for rows in (KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1)}
    assert calls == {"dot": 2, "exact": 1}, "128 rows on the integer dot, 129 on the exact path"
    for rows, out in results.items():
        ref = reference_matmul(weight, x[:rows]).float()
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4), rows


def test_the_rule_reaches_every_integer_dot_weight_on_an_intel_cpu(
    caplog: pytest.LogCaptureFixture, every_batch_on_the_dot: None
) -> None:
    gen = torch.Generator().manual_seed(3)
    int4 = [Int4DotWeight.from_float(torch.randn(n, 64, generator=gen), 32) for n in (8, 24, 16)]
    int8 = Int8DotWeight.from_float(torch.randn(32, 64, generator=gen), 32)
    affine = AffineInt8Weight(Int8DotWeight.from_float(torch.randn(8, 64, generator=gen), 32), torch.zeros(8, 2))
    exact = Int4Weight.from_float(torch.randn(8, 64, generator=gen), 32)  # not an integer-dot weight
    weights = [RowStack([int4[0], int8]), int4[1], affine, int4[2], exact]
    assert {id(w) for w in dynamic_weights(weights)} == {id(w) for w in [*int4, int8, affine.inner]}
    assert route_prompts(weights, "AuthenticAMD") == {}
    assert all(w.prompt_rows is None for w in dynamic_weights(weights))
    with caplog.at_level("INFO", logger="kvpager.kernels"):
        assert route_prompts(weights, "GenuineIntel") == {"int4": KERNEL_MAX_ROWS, "int8": KERNEL_MAX_ROWS}
    assert all(w.prompt_rows == KERNEL_MAX_ROWS for w in dynamic_weights(weights))
    assert not hasattr(exact, "prompt_rows")
    assert "integer-dot int4 weights: batches over 128 rows take the dequantize + float32 GEMM path" in caplog.text


def test_a_weight_the_rule_already_limits_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_dot, "dot_kernel_max_rows", lambda *_: 4)  # e.g. an AVX2-only integer dot
    weight = Int4DotWeight.from_float(torch.randn(8, 64), 32)
    assert route_prompts([weight], "GenuineIntel") == {} and weight.prompt_rows is None


def test_the_start_up_line_names_where_prompts_leave_the_integer_dot(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvpager.core.config import EngineConfig
    from kvpager.engine import loading

    monkeypatch.setattr(loading, "dot_kernel_max_rows", lambda *_: None)
    spec: Any = SimpleNamespace(torch_dtype="bfloat16")
    config = EngineConfig(gguf_int8_activations=True)
    with caplog.at_level("INFO", logger="kvpager"):
        loading.log_weight_format(config, spec, torch.device("cpu"), gguf=True, prompt_rows={"int4": KERNEL_MAX_ROWS})
        loading.log_weight_format(config, spec, torch.device("cpu"), gguf=True)
    routed, everywhere = caplog.records[-2].getMessage(), caplog.records[-1].getMessage()
    assert "for every batch (int8) / up to 128 rows (int4), then the" in routed
    assert "integer-dot kernel" in everywhere and "at every batch size" in everywhere
