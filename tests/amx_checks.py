"""The kernel library or a skip, and AMX or a skip: what the AMX kernel tests share
(test_amx_bf16.py, test_amx_dequant_linear.py)."""

from __future__ import annotations

import pytest

from kvpager.model.backends.kernels.build import KernelBuildError
from kvpager.model.backends.quant_kernels import QuantKernels, load_quant_kernels


def kernels_or_skip() -> QuantKernels:
    """The packed-weight kernel library, or a skip naming the build failure."""
    try:
        return load_quant_kernels()
    except KernelBuildError as exc:  # pragma: no cover - every CI machine has g++
        pytest.skip(f"no C++ compiler for the packed-weight kernels: {exc}")


def amx_or_skip() -> QuantKernels:
    """The library where its AMX bfloat16 tiles run here, else a skip saying this CPU or OS has none
    (the oneDNN paths are tested in test_quant_linear.py and test_bf16_prompt_path.py)."""
    kernels = kernels_or_skip()
    if not kernels.amx_bf16:
        pytest.skip(
            "this CPU (or its OS) has no AMX-BF16 tiles; the oneDNN paths are tested in test_quant_linear.py and "
            "test_bf16_prompt_path.py"
        )
    return kernels
