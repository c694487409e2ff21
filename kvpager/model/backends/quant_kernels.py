"""Build and load the packed-weight linear kernels (kernels/quant.cpp, quant_dot.cpp) with the system compiler.

A library of its own beside kernels/build.py's: it is compiled without -march=native (the AVX-512 and
AVX2 + FMA code carry target pragmas and are chosen at run time from the CPU's feature bits), so the
same binary runs on any x86-64 CPU and a lower path can be forced. The path is capped by
`$KVPAGER_KERNEL_ISA` ("portable": the portable C++ path, the other kernels' switch too) or per weight
(`PackedWeight.max_level`, tests). Cached under the same directory as the other kernels, keyed by
sources, flags and compiler. `load_quant_kernels()` raises KernelBuildError (with the reason) when
there is no compiler; the weight classes then run in torch.

-ffp-contract=off: the buffered path dequantizes with the same float32 multiply and add as the torch
reference (`dequantize()`), never a fused multiply-add the compiler chose.
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

from kvpager.model.backends.kernels.build import ISA_ENV, KernelBuildError, _compiler, cache_dir, requested_isa

logger = logging.getLogger("kvpager")

KERNEL_DIR = Path(__file__).parent / "kernels"
# quant.cpp: the exact kernels (dequantize in registers); quant_dot.cpp: integer dot products with
# activations quantized per block of 32 (w8a8_int8 / w4a8_int8); amx_bf16.cpp: bfloat16 batches in AMX tiles
SOURCES = (KERNEL_DIR / "quant.cpp", KERNEL_DIR / "quant_dot.cpp", KERNEL_DIR / "amx_bf16.cpp")
INCLUDES = (
    KERNEL_DIR / "amx.h",
    KERNEL_DIR / "half_bits.h",
    KERNEL_DIR / "int4_rows.h",
    KERNEL_DIR / "quant_simd.h",
    KERNEL_DIR / "quant_body.inc",
    KERNEL_DIR / "quant_dot_simd.h",
    KERNEL_DIR / "quant_dot_body.inc",
    KERNEL_DIR / "quant_dot_pairs.inc",
    KERNEL_DIR / "quant_dot_gemm.inc",
)
FLAGS = (
    "-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-Wno-psabi",
    "-shared", "-fPIC", "-std=c++17",
)  # fmt: skip
FMT_BF16, FMT_INT8, FMT_INT4 = 0, 1, 2
FMT_F16 = 3  # IEEE float16 weights (kFmtF16 in quant.cpp)
FMT_HALF_SCALES = 256  # or'ed into an int8 / int4 format: its scales are IEEE float16 (kHalfScales)
FMT_ROWS4 = 512  # or'ed into int4 / int8: rows interleaved four at a time (kernels/int4_rows.h, kRowsBit)
LEVEL_PORTABLE, LEVEL_AVX2, LEVEL_AVX512 = 0, 1, 2
LEVEL_NAMES = {LEVEL_AVX512: "AVX-512", LEVEL_AVX2: "AVX2+FMA", LEVEL_PORTABLE: "portable C++"}


def max_level_from_env() -> int:
    """The highest path $KVPAGER_KERNEL_ISA allows: "portable" caps at the portable path."""
    return LEVEL_PORTABLE if requested_isa() == "portable" else LEVEL_AVX512


_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: dict[str, tuple[list[object], object]] = {
    "kvq_level": ([_I], ctypes.c_int64),
    "kvq_linear": ([_I, _P, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I], None),
    "kvq_dequant": ([_I, _P, _P, _P, _I, _I, _I, _I, _I, _P, _I, _I], None),
    "kvq_dequant_bf16": ([_I, _P, _P, _P, _I, _I, _I, _I, _I, _P, _I, _I], None),
    "kvq_dot_level": ([_I], ctypes.c_int64),
    "kvq_dot_panel_rows": ([_I], ctypes.c_int64),
    "kvq_dot_linear": ([_I, _P, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I], ctypes.c_int64),
    "kvq_dot_plane_codes": ([_I, _P, _P, _I, _I, _P, _I, _I], ctypes.c_int64),
    "kvq_dot_expand_records": ([_I, _P, _I, _P, _P, _I], None),
    "kvq_amx_bf16_ready": ([], ctypes.c_int64),
    "kvq_amx_bf16_linear": ([_P, _I, _P, _I, _I, _P, _I], ctypes.c_int64),
    "kvq_amx_dequant_linear": ([_I, _P, _P, _P, _I, _I, _I, _I, _P, _I, _P, _I], ctypes.c_int64),
}


@dataclass(frozen=True)
class QuantKernels:
    """The loaded library; `level(cap)` says which path kvq_linear takes on this CPU under a cap."""

    path: Path
    linear: Any
    dequant: Any
    level: Any
    best_level: int  # the best path this CPU has (kvq_level uncapped), read once at load
    dot_linear: Any  # kvq_dot_linear: integer dot products (w8a8_int8 / w4a8_int8)
    dot_level: Any  # kvq_dot_level(cap): the path kvq_dot_linear takes (LEVEL_AVX512: AVX-512 VNNI)
    dequant_bf16: Any  # kvq_dequant_bf16: dequantized rows rounded to bfloat16 (the bf16 GEMM's operand)
    dot_panel_rows: Any  # kvq_dot_panel_rows(cap): batches from this many rows take 8-row panels (0: none)
    dot_plane_codes: Any  # kvq_dot_plane_codes: a GGUF Q5_K / Q6_K packed weight's codes (its float form's)
    dot_expand_records: Any  # kvq_dot_expand_records: GGUF Q4_K / Q6_K records -> float32 scales (and offsets)
    amx_bf16_linear: Any  # kvq_amx_bf16_linear: float32 rows @ a plain bfloat16 weight in AMX tiles (-1: not taken)
    amx_bf16: bool  # kvq_amx_bf16_ready(): this CPU and OS run AMX bfloat16 tiles in this process
    # kvq_amx_dequant_linear: float32 rows @ a packed weight dequantized 32 rows at a time into AMX tiles (-1: not taken)
    amx_dequant_linear: Any

    @property
    def default_level(self) -> int:
        """The path a weight takes by default: the best this CPU has, capped by $KVPAGER_KERNEL_ISA."""
        return min(self.best_level, max_level_from_env())

    def describe(self) -> str:
        """One line for the start-up log: which code path the packed-weight linear takes, and why."""
        chosen, best = self.default_level, self.best_level
        why = "the best this CPU has" if chosen == best else f"{ISA_ENV}=portable; this CPU has {LEVEL_NAMES[best]}"
        return f"{LEVEL_NAMES[chosen]} kernel ({why}; dequantize in registers, float32 accumulation)"

    def describe_amx(self) -> str:
        """One line for the start-up log: whether bfloat16 batches can run in AMX tiles here, and why."""
        if not self.amx_bf16:
            return "no AMX bfloat16 tiles (this CPU or OS lacks AMX-TILE / AMX-BF16)"
        if self.default_level < LEVEL_AVX512:
            return f"AMX bfloat16 tiles off ({ISA_ENV}=portable)"
        return (
            "AMX bfloat16 tiles reading the plain weight (bfloat16 activations, float32 accumulation); quantized "
            "prompts on weight rows dequantized in cache"
        )

    def describe_dot(self) -> str:
        """One line for the start-up log: the integer-dot path (w8a8_int8 / w4a8_int8) and why."""
        chosen = int(self.dot_level(self.default_level))
        best = int(self.dot_level(LEVEL_AVX512))
        if chosen == LEVEL_AVX512:
            how, why = "int8: _mm256_dpbusd_epi32, int4: _mm_dpbusd_epi32 x 2", "the best this CPU has"
        elif chosen == LEVEL_AVX2:
            how = "int8: _mm256_maddubs_epi16 + _mm256_madd_epi16, int4: _mm_maddubs_epi16 x 2 + _mm_madd_epi16"
            why = "this CPU has AVX-512 without VNNI" if self.best_level > LEVEL_AVX2 else "the best this CPU has"
        else:
            how = "scalar int32"
            why = f"{ISA_ENV}=portable" if best > LEVEL_PORTABLE else "this CPU has no AVX2"
        name = "AVX-512 VNNI" if chosen == LEVEL_AVX512 else LEVEL_NAMES[chosen]
        panels = int(self.dot_panel_rows(self.default_level))
        batches = f"; batches of {panels}+ rows: 8 output rows per vector" if panels else ""
        return (
            f"{name} integer-dot kernel ({how}; {why}{batches}): activations quantized to int8 per "
            "block of 32 per call, float32 accumulation across blocks (not exact)"
        )


def _build() -> Path:
    compiler = _compiler()
    h = hashlib.sha256()
    for include in (*SOURCES, *INCLUDES):
        h.update(include.read_bytes())
    h.update(" ".join(FLAGS).encode() + b"\0" + compiler.encode())
    out_dir = cache_dir() / f"quant-{h.hexdigest()[:16]}"
    target = out_dir / "libkvpager_quant.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)  # NOTE: renamed when complete (concurrent builds)
    os.close(fd)
    cmd = [compiler, *FLAGS, *(str(s) for s in SOURCES), "-o", tmp]
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
    kernels = QuantKernels(
        path,
        lib.kvq_linear,
        lib.kvq_dequant,
        lib.kvq_level,
        int(lib.kvq_level(LEVEL_AVX512)),
        lib.kvq_dot_linear,
        lib.kvq_dot_level,
        lib.kvq_dequant_bf16,
        lib.kvq_dot_panel_rows,
        lib.kvq_dot_plane_codes,
        lib.kvq_dot_expand_records,
        lib.kvq_amx_bf16_linear,
        bool(lib.kvq_amx_bf16_ready()),
        lib.kvq_amx_dequant_linear,
    )
    logger.info("packed-weight linear: %s", kernels.describe())
    logger.info("bfloat16 batches: %s", kernels.describe_amx())
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
