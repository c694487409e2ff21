"""Build and load the packed-weight linear kernels (kernels/quant.cpp) with the system compiler.

A library of its own beside kernels/build.py's: it is compiled without -march=native (the AVX2 + FMA
code carries target attributes and is chosen at run time from the CPU's feature bits), so the same
binary runs on any x86-64 CPU and the portable path can be forced for tests. Cached under the same
directory as the other kernels, keyed by source, flags and compiler. `load_quant_kernels()` raises
KernelBuildError (with the reason) when there is no compiler; the weight classes then run in torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpager.model.backends.kernels.build import KernelBuildError, _compiler, cache_dir

logger = logging.getLogger("kvpager")

SOURCE = Path(__file__).parent / "kernels" / "quant.cpp"
FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC", "-std=c++17")
FMT_BF16, FMT_INT8, FMT_INT4 = 0, 1, 2

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: dict[str, tuple[list[object], object]] = {
    "kvq_avx2_path": ([_I], ctypes.c_int64),
    "kvq_linear": ([_I, _P, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I], None),
    "kvq_dequant": ([_I, _P, _P, _P, _I, _I, _I, _I, _I, _P, _I], None),
}


@dataclass(frozen=True)
class QuantKernels:
    """The loaded library; `avx2` says which path kvq_linear takes on this CPU."""

    path: Path
    linear: Any
    dequant: Any
    avx2_path: Any

    @property
    def avx2(self) -> bool:
        return bool(self.avx2_path(0))

    def describe(self) -> str:
        """One line for the start-up log: which code path the packed-weight linear takes."""
        if self.avx2:
            return "AVX2+FMA kernel (dequantize in registers, float32 accumulation)"
        return "portable C++ kernel (this CPU lacks AVX2+FMA; float32 accumulation)"


def _build() -> Path:
    compiler = _compiler()
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(FLAGS).encode() + b"\0" + compiler.encode())
    out_dir = cache_dir() / f"quant-{h.hexdigest()[:16]}"
    target = out_dir / "libkvpager_quant.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)  # NOTE: renamed when complete (concurrent builds)
    os.close(fd)
    cmd = [compiler, *FLAGS, str(SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KernelBuildError(
                f"compiling the quantized-linear kernels failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load_quant_kernels() -> QuantKernels:
    """Build (once per machine) and load the library. Raises KernelBuildError."""
    import torch  # noqa: F401  NOTE: torch's libgomp first, so the kernels share its OpenMP runtime

    path = _build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"loading {path} failed: {exc}") from exc
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    kernels = QuantKernels(path, lib.kvq_linear, lib.kvq_dequant, lib.kvq_avx2_path)
    logger.info("packed-weight linear: %s", kernels.describe())
    return kernels


def quant_kernels_or_none() -> QuantKernels | None:
    """The kernels, or None (logged once) when they cannot be built here."""
    try:
        return load_quant_kernels()
    except KernelBuildError as exc:
        _warn_once(str(exc))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("packed-weight kernels unavailable, dequantizing in torch per call: %s", reason)
