"""Where the integer dot has AVX-512 VNNI, prompts over KERNEL_MAX_ROWS rows go to the exact path's
dequantize + GEMM on Intel CPUs (`dot_kernel_max_rows`' vendor rule, quant_dot.py); elsewhere the
integer dot takes every batch.

The rule only moves rows between two paths computing the same quantized activations times the same
dequantized weight, so both are held to the same reference; what is pinned here is the rule, which
path runs (GGUF row stacks and affine wrappers included), the vendor parsing and the log line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpager.model.backends import quant_dot
from kvpager.model.backends.kernels.build import KernelBuildError
from kvpager.model.backends.quant_dot import (
    Int4DotWeight,
    Int8DotWeight,
    dot_kernel_max_rows,
    read_cpu_vendor,
    reference_matmul,
)
from kvpager.model.backends.quant_kernels import LEVEL_AVX2, LEVEL_AVX512, LEVEL_PORTABLE, load_quant_kernels
from kvpager.model.backends.quant_weights import KERNEL_MAX_ROWS
from kvpager.model.gguf_packed import AffineInt8Weight, RowStack

REAL_RULE = dot_kernel_max_rows


@pytest.fixture(autouse=True)
def kernels() -> None:
    try:
        load_quant_kernels()
    except KernelBuildError as exc:  # pragma: no cover - every CI machine has g++
        pytest.skip(f"no C++ compiler for the packed-weight kernels: {exc}")


def on_a_vnni_cpu_of(monkeypatch: pytest.MonkeyPatch, vendor: str) -> None:
    """The rule as a VNNI CPU of `vendor` without native bf16 matmul applies it, on any CPU (with native
    bf16 matmul prompts take the bf16 GEMM whatever the vendor: tests/test_bf16_prompt_path.py)."""
    monkeypatch.setattr(
        quant_dot, "dot_kernel_max_rows", lambda f, *_: REAL_RULE(f, LEVEL_AVX512, LEVEL_AVX512, vendor)
    )
    monkeypatch.setattr(quant_dot, "native_bf16", lambda: False)


def counting(monkeypatch: pytest.MonkeyPatch, weight: Any, calls: dict[str, int]) -> None:
    dot, exact = weight.dot_kernel, weight.exact_matmul

    def on_dot(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["dot"] += 1
        return dot(*args, **kwargs)

    def on_exact(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["exact"] += 1
        return exact(*args, **kwargs)

    monkeypatch.setattr(weight, "dot_kernel", on_dot)
    monkeypatch.setattr(weight, "exact_matmul", on_exact)


def test_the_vnni_rule_sends_prompts_to_the_gemm_path_on_intel_only() -> None:
    for weight_format in ("int8", "int4"):
        assert dot_kernel_max_rows(weight_format, LEVEL_AVX512, LEVEL_AVX512, "GenuineIntel") == KERNEL_MAX_ROWS
        assert dot_kernel_max_rows(weight_format, LEVEL_AVX512, LEVEL_AVX512, "AuthenticAMD") is None
        assert dot_kernel_max_rows(weight_format, LEVEL_AVX512, LEVEL_AVX512, None) is None
        # without VNNI the vendor changes only the AVX2 path (exact kernels and dot both AVX2), whose prompts
        # stay on the integer dot (its 8-row panels) off Intel, int8 and int4 alike
        for exact in (LEVEL_AVX512, LEVEL_AVX2, LEVEL_PORTABLE):
            intel = dot_kernel_max_rows(weight_format, exact, LEVEL_AVX2, "GenuineIntel")
            amd = dot_kernel_max_rows(weight_format, exact, LEVEL_AVX2, "AuthenticAMD")
            on_intel = {"int8": 16, "int4": 32}[weight_format]
            assert (intel, amd) == ((on_intel, None) if exact == LEVEL_AVX2 else (intel, intel))


def test_the_vendor_is_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n")
    assert read_cpu_vendor(cpuinfo) == "AuthenticAMD"
    cpuinfo.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")  # an Arm machine names no vendor_id
    assert read_cpu_vendor(cpuinfo) is None
    assert read_cpu_vendor(tmp_path / "missing") is None


@pytest.mark.parametrize("make", [lambda w: Int4DotWeight.from_float(w, 32), lambda w: Int8DotWeight.from_float(w)])
def test_prompts_over_the_limit_take_the_exact_path_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch, make: Any
) -> None:
    weight = make(torch.randn(40, 96, generator=torch.Generator().manual_seed(1)))
    calls = {"dot": 0, "exact": 0}
    counting(monkeypatch, weight, calls)
    x = torch.randn(KERNEL_MAX_ROWS + 1, 96, generator=torch.Generator().manual_seed(2))
    on_a_vnni_cpu_of(monkeypatch, "AuthenticAMD")
    weight.matmul(x, None)
    assert calls == {"dot": 1, "exact": 0}, "elsewhere the integer dot takes every batch"
    on_a_vnni_cpu_of(monkeypatch, "GenuineIntel")
    results = {rows: weight.matmul(x[:rows], None) for rows in (KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1)}
    assert calls == {"dot": 2, "exact": 1}, "128 rows on the integer dot, 129 on the exact path"
    for rows, out in results.items():
        ref = reference_matmul(weight, x[:rows]).float()
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4), rows


def test_the_rule_reaches_gguf_row_stacks_and_affine_wrappers(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    int4 = Int4DotWeight.from_float(torch.randn(8, 64, generator=gen), 32)
    int8 = Int8DotWeight.from_float(torch.randn(16, 64, generator=gen), 32)
    affine = AffineInt8Weight(Int8DotWeight.from_float(torch.randn(8, 64, generator=gen), 32), torch.zeros(8, 2))
    calls = {"dot": 0, "exact": 0}
    for weight in (int4, int8, affine.inner):
        counting(monkeypatch, weight, calls)
    on_a_vnni_cpu_of(monkeypatch, "GenuineIntel")
    x = torch.randn(KERNEL_MAX_ROWS + 1, 64, generator=gen)
    RowStack([int4, int8]).matmul(x, None)
    affine.matmul(x, None)
    assert calls == {"dot": 0, "exact": 3}


def test_the_start_up_line_names_where_prompts_leave_the_integer_dot(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvpager.core.config import EngineConfig
    from kvpager.engine import loading

    spec: Any = SimpleNamespace(torch_dtype="bfloat16")
    config = EngineConfig(gguf_int8_activations=True)
    with caplog.at_level("INFO", logger="kvpager"):
        monkeypatch.setattr(loading, "dot_kernel_max_rows", lambda f, *_: KERNEL_MAX_ROWS if f == "int4" else None)
        loading.log_weight_format(config, spec, torch.device("cpu"), gguf=True)
        monkeypatch.setattr(loading, "dot_kernel_max_rows", lambda *_: None)
        loading.log_weight_format(config, spec, torch.device("cpu"), gguf=True)
    routed, everywhere = caplog.records[-2].getMessage(), caplog.records[-1].getMessage()
    assert "for every batch (int8) / up to 128 rows (int4), then the" in routed
    assert "integer-dot kernel" in everywhere and "at every batch size" in everywhere
