"""The float16 KV conversion of the kernels' portable branch (no F16C: the bit layout by hand) is
torch's float <-> float16, bit for bit. The kernel library itself is built with -march=native, which
on every x86-64 CPU with AVX2 has F16C, so this branch is compiled here on its own for plain x86-64."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from kvpager.model.backends.kernels import abi
from kvpager.model.backends.kernels.binding import c_header
from kvpager.model.backends.kernels.build import KernelBuildError, _compiler

KERNELS = Path(abi.__file__).parent
SOURCE = """
#include "common.h"
extern "C" void kvp_test_f16(const float* src, uint16_t* bits, float* back, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    kvp::f16_t h;
    kvp::kv_store(&h, src[i]);
    bits[i] = h.bits;
    back[i] = kvp::kv_load(h);
  }
}
"""


@pytest.mark.slow
def test_portable_float16_conversion_is_torchs_bit_for_bit(tmp_path: Path) -> None:
    try:
        compiler = _compiler()
    except KernelBuildError as exc:
        pytest.skip(f"no C++ compiler here: {exc}")
    (tmp_path / "kvp_abi.h").write_text(c_header(abi.SPECS))
    (tmp_path / "t.cpp").write_text(SOURCE)
    lib_path = tmp_path / "libt.so"
    flags = ["-O2", "-march=x86-64", "-mno-f16c", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]
    cmd = [compiler, *flags, f"-I{KERNELS}", f"-I{tmp_path}", str(tmp_path / "t.cpp"), "-o", str(lib_path)]
    subprocess.run(cmd, check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    edges = [0.0, -0.0, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 65504.0, 65519.0, 65520.0, 1e6, float("inf"), -float("inf")]
    edges += [2**-14, 2**-24, 2**-25, 1.5 * 2**-24, 2**-26, 6.1e-5, -3e-7, float("nan")]
    src = torch.cat([torch.tensor(edges), torch.randn(4000) * torch.logspace(-9, 6, 4000)]).float()
    bits = torch.empty(src.numel(), dtype=torch.int16)
    back = torch.empty_like(src)
    lib.kvp_test_f16(
        ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(bits.data_ptr()), ctypes.c_void_p(back.data_ptr()),
        ctypes.c_int64(src.numel()),
    )  # fmt: skip
    ref = src.half()
    nan = ref.isnan()
    assert torch.equal(bits.view(torch.float16).isnan(), nan)
    assert torch.equal(bits[~nan], ref.view(torch.int16)[~nan])  # rounding to nearest even, overflow, subnormals
    assert torch.equal(back[~nan], ref.float()[~nan]) and back[nan].isnan().all()  # widening is exact
