"""Build and load kvpager's C++ CPU kernels (common.h, layers.cpp, linear.cpp, attention.cpp, prefill.cpp).

The library is compiled once per (sources, declarations, compiler flags, CPU feature set) into a
cache directory (`$KVPAGER_CACHE_DIR/kernels`, default `~/.cache/kvpager/kernels`) and loaded with
ctypes behind the checked binding of binding.py: the prototypes the sources include (`kvp_abi.h`)
are generated from abi.py, the same declarations every call is checked against. No torch headers
are involved, so a build takes seconds (a torch C++ extension with TORCH_LIBRARY takes ~20 s of CPU
for one empty operator). `load_cpu_kernels()` raises KernelBuildError (with the reason) when no
compiler is available or the build fails; `select_ops("auto", ...)` then keeps the torch path.

Instruction sets (`isa`, default `$KVPAGER_KERNEL_ISA`, else "native"): "native" compiles for this
CPU (-march=native: the AVX-512 branches where it has AVX-512F); "portable" adds -mno-avx512f, so the
portable branches (AVX2 or whatever else the CPU has, vectorised by the compiler) run on any CPU —
the test suite runs the kernel tests under both where they differ.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvpager.model.backends.kernels.abi import SPECS
from kvpager.model.backends.kernels.binding import KernelFunction, c_header

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
SOURCES = (
    KERNEL_DIR / "layers.cpp",
    KERNEL_DIR / "linear.cpp",
    KERNEL_DIR / "attention.cpp",
    KERNEL_DIR / "prefill.cpp",
    KERNEL_DIR / "prefill_amx.cpp",
)
HEADERS = (KERNEL_DIR / "common.h", KERNEL_DIR / "amx.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC", "-std=c++17")
ISAS = ("native", "portable")
ISA_ENV = "KVPAGER_KERNEL_ISA"
# kvp_isa()'s codes
ISA_NAMES = {2: "avx512", 1: "avx2", 0: "generic"}
HEADER = "kvp_abi.h"


def requested_isa(isa: str | None = None) -> str:
    """`isa`, else $KVPAGER_KERNEL_ISA, else "native"; ValueError for anything but ISAS."""
    value = isa if isa is not None else (os.environ.get(ISA_ENV) or "native")
    if value not in ISAS:
        raise ValueError(f"{ISA_ENV} / isa must be one of {ISAS}, got {value!r}")
    return value


def isa_flags(isa: str) -> tuple[str, ...]:
    """The compiler flags of `isa` ("portable" turns AVX-512 off on x86; other CPUs have none)."""
    if isa == "portable" and platform.machine().lower() in ("x86_64", "amd64"):
        return (*FLAGS, "-mno-avx512f")
    return FLAGS


@dataclass(frozen=True)
class KernelLibrary:
    """The loaded shared library: one checked function per kernel of abi.SPECS."""

    path: Path
    lib: ctypes.CDLL
    isa: str  # what the library was compiled for: "avx512", "avx2" or "generic"
    functions: dict[str, KernelFunction]

    def fn(self, name: str) -> KernelFunction:
        return self.functions[name]


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded (no compiler, compile error, load error)."""


def cache_dir() -> Path:
    root = os.environ.get("KVPAGER_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "kvpager"
    return base / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError("no C++ compiler found (set CXX, or install g++); using the torch path")


def _cpu_features() -> str:
    """The CPU's feature flags: -march=native code must not run on another CPU sharing the cache."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key(compiler: str, isa: str = "native") -> str:
    h = hashlib.sha256()
    parts = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    flags = " ".join(isa_flags(isa)).encode()
    for part in (*parts, c_header(SPECS).encode(), flags, compiler.encode(), _cpu_features().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build(force: bool = False, isa: str | None = None) -> Path:
    """Compile the kernels for `isa` (see requested_isa) unless the cached library for these
    sources, declarations, flags and CPU exists; return its path."""
    isa = requested_isa(isa)
    compiler = _compiler()
    out_dir = cache_dir() / build_key(compiler, isa)
    target = out_dir / "libkvpager_cpu.so"
    if target.exists() and not force:
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: compile to a temporary name, then rename: concurrent builders never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory() as include:
            (Path(include) / HEADER).write_text(c_header(SPECS))
            cmd = [compiler, *isa_flags(isa), f"-I{include}", *(str(p) for p in SOURCES), "-o", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KernelBuildError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built CPU kernels (%s): %s", isa, target)
    return target


@functools.cache
def _load(isa: str) -> KernelLibrary:
    import torch  # noqa: F401  NOTE: torch's libgomp must be loaded first so the kernels share its thread pool

    path = build(isa=isa)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"loading {path} failed: {exc}") from exc
    functions = {spec.name: KernelFunction(lib, spec) for spec in SPECS}
    compiled = functions["kvp_isa"]()
    return KernelLibrary(path, lib, ISA_NAMES.get(int(compiled or 0), "generic"), functions)


def load_cpu_kernels(isa: str | None = None) -> KernelLibrary:
    """Build (once per machine) and load (once per process) the kernels for `isa` (default
    $KVPAGER_KERNEL_ISA, else "native"). Raises KernelBuildError, or ValueError for an unknown isa."""
    return _load(requested_isa(isa))


def expected_isa(isa: str | None = None) -> str:
    """What a build for `isa` must report on this CPU (from its feature flags): "avx512" where the
    CPU has AVX-512F and the build is native, else "avx2" where it has AVX2 and FMA, else "generic"."""
    flags = set(_cpu_features().split())
    if requested_isa(isa) == "native" and "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "generic"
